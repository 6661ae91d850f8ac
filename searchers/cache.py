"""A cache of search results keyed by (searcher, graph structure, cost parameters, options).

A region traced twice (a second ``ms.jit`` of the same function, or a context switched back)
gives an equal graph; the second search is a lookup. The graph key is a digest of everything
a search reads: the mesh, every op's name, kind, loop dims, operands, dim maps, reduce kind,
unsplittable dims, flops and fixed strategy, every tensor's shape and itemsize, and the
region's outputs. Results are copied on the way in and out, so callers may edit them.

>>> from searchers.graph import DeviceMesh, Graph
>>> g1, g2 = Graph(DeviceMesh((2,))), Graph(DeviceMesh((2,)))
>>> _ = g1.source("x", (4,)); _ = g2.source("x", (4,))
>>> graph_key(g1) == graph_key(g2)
True
>>> g2.ops[0].fixed = ((0,),)
>>> graph_key(g1) == graph_key(g2)
False
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .cost import CostParams
from .direct_reshard import depends_on_direct
from .graph import Graph
from .result import SearchResult


def graph_key(graph: Graph) -> bytes:
    """A 32-byte digest of the graph's structure (see the module doc)."""
    ops = [(op.name, op.kind, tuple(op.dims.items()), tuple(op.inputs), tuple(op.in_dims), tuple(op.outputs),
            tuple(op.out_dims), op.reduce, tuple(sorted(op.unsplittable)), op.flops, op.fixed,
            tuple(sorted(op.split_limit.items())) if op.split_limit else None, op.free_devices, op.derived, op.follow_operand,
            op.latency_share, op.scatter)
           for op in graph.ops]
    tensors = [(t.shape, t.itemsize) for t in graph.tensors]
    blob = pickle.dumps((graph.mesh, ops, tensors, tuple(graph.outputs)), protocol=pickle.HIGHEST_PROTOCOL)
    return hashlib.blake2b(blob, digest_size=32).digest()


class SearchCache:
    """A small LRU map from search keys to :class:`~searchers.result.SearchResult`."""

    def __init__(self, maxsize: int = 32) -> None:
        self.maxsize = maxsize
        self._d: OrderedDict[tuple, SearchResult] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: tuple) -> SearchResult | None:
        with self._lock:
            r = self._d.get(key)
            if r is None:
                self.misses += 1
                return None
            self._d.move_to_end(key)
            self.hits += 1
            return r

    def put(self, key: tuple, result: SearchResult) -> None:
        with self._lock:
            self._d[key] = result
            self._d.move_to_end(key)
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._d)


SEARCH_CACHE = SearchCache()
depends_on_direct(SEARCH_CACHE.clear)      # a search made under xla_only() prices redistributions otherwise


def _copy(r: SearchResult, **kw: Any) -> SearchResult:
    fields: dict[str, Any] = {"strategies": dict(r.strategies), "notes": list(r.notes)}
    fields.update(kw)
    return replace(r, **fields)


def cached_search(fn: Callable[..., SearchResult]) -> Callable[..., SearchResult]:
    """Wrap a searcher ``fn(graph, params, **opts)`` with :data:`SEARCH_CACHE`; the wrapper takes
    ``cache=False`` to search without the cache (nothing is looked up or stored)."""

    @functools.wraps(fn)
    def wrapper(graph: Graph, params: CostParams, *, cache: bool = True, **opts: Any) -> SearchResult:
        if not cache:
            return fn(graph, params, **opts)
        t0 = time.perf_counter()
        key = (fn.__module__, fn.__qualname__, graph_key(graph), params, tuple(sorted(opts.items())))
        hit = SEARCH_CACHE.get(key)
        if hit is not None:
            return _copy(hit, seconds=time.perf_counter() - t0,
                         notes=list(hit.notes) + [f"from the search cache (the search took {hit.seconds:.3g} s)"])
        result = fn(graph, params, **opts)
        SEARCH_CACHE.put(key, _copy(result))
        return result

    return wrapper
