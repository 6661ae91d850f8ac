"""The graph index every searcher reads, and many whole plans of one graph priced fast with it.

:class:`GraphIndex` computes once what the searchers and the baseline check (:mod:`searchers.baselines`) share: each
op's :class:`~searchers.spec.OpSpec` (one per distinct op shape), every edge as (consumer, operand slot, producer,
result slot, bytes) in numpy arrays, each op's neighbours and operand sources. On it every search builds one
:class:`~searchers.tables.Tables` (candidates, costs and layouts per op shape): sharding_propagation and
recursive_programming search on the two; :class:`~searchers.pairwise_problem.PairwiseProblem`, dynamic_programming's and ilp's
pairwise problem, is built from them. :meth:`GraphIndex.cost` (:func:`~searchers.cost.graph_cost` with the graph indexed once)
interns each distinct (op shape, strategy) pair, looks up the layouts it gives its operands and results, and compares
the two ends of every edge in numpy: the Python work is per distinct (op shape, strategy object), not per op.
The result equals ``graph_cost(graph, plan, params)`` (every edge charged, the searchers' objective).

>>> from searchers.cost import CostParams, graph_cost
>>> from searchers.generators import mlp_chain
>>> from searchers.graph import DeviceMesh
>>> from searchers.strategies import data_parallel_strategy
>>> g = mlp_chain(2, 64, 64, DeviceMesh((2, 4)))
>>> plan = {op.id: data_parallel_strategy(op, g.mesh) for op in g.ops}
>>> p = CostParams()
>>> abs(GraphIndex(g).cost(plan, p).total - graph_cost(g, plan, p).total) < 1e-12
True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from .cost import Cost, CostParams, _canon, counted_cost
from .errors import SearchGraphError
from .graph import Graph, Strategy, TensorLayout, split_count
from .memory import live_ranges
from .slots import Flat, Slots, flat_ops, slot_graph
from .spec import OpSpec, SpecKey, distinct_spec_keys, layout_of, spec_from_key


class GraphIndex:
    """One graph, indexed for pricing and following plans (module doc)."""

    def __init__(self, graph: Graph, *, flat: Flat | None = None,
                 spec_keys: tuple[list[SpecKey], np.ndarray] | None = None, slots: Slots | None = None):
        """``flat``, ``spec_keys`` (:func:`~searchers.spec.distinct_spec_keys`) and ``slots``: the graph's, where a
        searcher has them at hand already."""
        self.graph = graph
        flat = flat_ops(graph) if flat is None and (spec_keys is None or slots is None) else flat
        keys, index = distinct_spec_keys(graph, flat) if spec_keys is None else spec_keys
        self.spec_keys: tuple[list[SpecKey], np.ndarray] = (keys, index)
        self.specs: list[OpSpec] = [spec_from_key(k) for k in keys]
        self.spec_index: list[int] = index.tolist()                 # per op: its spec's index in ``specs``
        self.spec_array = np.asarray(index, dtype=np.intp)
        s = slot_graph(graph, flat) if slots is None else slots
        cons = s.owner[s.e_in]
        prod = s.owner[s.e_src]
        self._edges = (cons, s.e_in - s.base[cons], prod, s.e_src - s.base[prod] - s.n_in[prod], s.e_bytes)
        # per op, (producer, result index) of each operand, for passes in program order
        starts = np.searchsorted(cons, np.arange(len(graph.ops) + 1))
        pj = list(zip(prod.tolist(), self._edges[3].tolist()))
        self.in_src: list[list[tuple[int, int]]] = [pj[a:b] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]
        self._refs = (s.owner[s.ref_slot], s.ref_ptr)              # neighbours(): producers, then consumers
        kinds: dict[str, int] = {}
        kind = np.fromiter((kinds.setdefault(op.kind, len(kinds)) for op in graph.ops), dtype=np.intp,
                           count=len(graph.ops))
        self.is_source: list[bool] = [op.is_source for op in graph.ops]
        # per op, the number of its (op shape, kind): ops with one number get one default strategy (baselines)
        _, self.first_of_kind, inv = np.unique(index * max(len(kinds), 1) + kind, return_index=True,
                                               return_inverse=True)
        self.kind_index: list[int] = inv.reshape(-1).tolist()
        self._outs: tuple[np.ndarray, ...] | None = None        # per op result: op, index, live range (peak())

    def edges(self) -> list[tuple[int, int, int, int, int]]:
        """Every edge as (consumer, operand index, producer, result index, bytes), consumer by consumer, operands in
        order (the order :class:`~searchers.pairwise_problem.PairwiseProblem` numbers its pairs in)."""
        return list(zip(*(a.tolist() for a in self._edges)))

    def out_edges(self) -> list[list[tuple[int, int, int]]]:
        """Per op, (result index, consumer, operand index) of each use of its results, consumers in program order."""
        cons, slot, prod, res, _ = self._edges
        order = np.argsort(prod, kind="stable")          # edges come in consumer order: stable keeps it per producer
        trip = list(zip(res[order].tolist(), cons[order].tolist(), slot[order].tolist()))
        at = np.searchsorted(prod[order], np.arange(len(self.graph.ops) + 1)).tolist()
        return [trip[a:b] for a, b in zip(at[:-1], at[1:])]

    def neighbours(self) -> list[list[int]]:
        """Per op, the producer of each operand (in operand order), then the consumer of each use of its results
        (in program order): the ops a breadth-first pass reaches from it."""
        who, ptr = self._refs
        flat = who.tolist()
        at = ptr.tolist()
        return [flat[a:b] for a, b in zip(at[:-1], at[1:])]

    def pinned(self) -> list[int]:
        """The ops, in program order, whose strategy :func:`~searchers.graph.pinned_strategy` gives now (a user
        strategy, a tie): the rest take a default or a search's choice."""
        ties = self.graph.operand_ties
        return [op.id for op in self.graph.ops if op.fixed is not None or op.follow_operand is not None
                or op.id in ties]

    def _intern(self, plan: Mapping[int, Strategy] | Sequence[Strategy]) -> tuple[dict[tuple[int, Strategy], int],
                                                                                np.ndarray]:
        """(distinct (spec index, strategy) pairs -> their number in order of first use, that number per op).

        A plan built from a memo repeats one strategy object: ops are grouped by (spec, object) in numpy first, and
        only one op of each group is hashed by value (``objs`` holds every object, so no id is reused meanwhile)."""
        n = len(self.spec_index)
        if isinstance(plan, Mapping):
            try:
                objs = list(map(plan.__getitem__, range(n)))
            except KeyError:
                v = next(v for v in range(n) if v not in plan)
                raise SearchGraphError(f"graph_index: no strategy for op {v} ({self.graph.ops[v].name})") from None
        else:
            objs = list(plan[:n])
            if len(objs) < n:
                raise SearchGraphError(f"graph_index: no strategy for op {len(objs)} ({self.graph.ops[len(objs)].name})")
        _, obj = np.unique(np.fromiter(map(id, objs), dtype=np.uintp, count=n), return_inverse=True)
        _, first, inv = np.unique(obj.reshape(-1) * len(self.specs) + self.spec_array, return_index=True,
                                  return_inverse=True)
        pairs: dict[tuple[int, Strategy], int] = {}
        number = np.empty(len(first), dtype=np.intp)
        for q in np.argsort(first, kind="stable").tolist():       # in order of first use, as op by op
            v = int(first[q])
            si, s = self.spec_index[v], objs[v]
            try:
                number[q] = pairs.setdefault((si, s), len(pairs))
            except TypeError:                           # a strategy given with lists: canonical form first
                number[q] = pairs.setdefault((si, _canon(s)), len(pairs))
        return pairs, number[inv.reshape(-1)]

    def peak(self, plan: Mapping[int, Strategy] | Sequence[Strategy]) -> float:
        """:func:`~searchers.memory.peak_memory`'s peak bytes per device of ``plan``, in numpy (the baseline check's
        memory test: 1.2 s at 100k ops op by op, a few tens of ms here).

        >>> from searchers.generators import mlp_chain
        >>> from searchers.graph import DeviceMesh
        >>> from searchers.memory import peak_memory
        >>> from searchers.strategies import data_parallel_strategy
        >>> g = mlp_chain(2, 64, 64, DeviceMesh((2, 4)), backward=True)
        >>> plan = {op.id: data_parallel_strategy(op, g.mesh) for op in g.ops}
        >>> GraphIndex(g).peak(plan) == peak_memory(g, plan)[0]
        True
        """
        if not self.graph.ops:
            return 0.0
        if self._outs is None:
            first, last = live_ranges(self.graph)
            op_of, j_of, tids = [], [], []
            for op in self.graph.ops:
                for j, t in enumerate(op.outputs):
                    op_of.append(op.id)
                    j_of.append(j)
                    tids.append(t)
            t_a = np.asarray(tids, dtype=np.intp)
            self._outs = (np.asarray(op_of, dtype=np.intp), np.asarray(j_of, dtype=np.intp), first[t_a], last[t_a])
        op_of, j_of, first, last = self._outs
        pairs, pid = self._intern(plan)
        shape = self.graph.mesh.shape
        width = max((len(self.specs[si].out_maps) for si, _ in pairs), default=0)
        local = np.zeros((len(pairs), max(width, 1)))
        for k, (si, s) in enumerate(pairs):
            spec, s = self.specs[si], _canon(s)
            for j, (m, b) in enumerate(zip(spec.out_maps, spec.out_bytes)):
                local[k, j] = b / split_count(layout_of(m, s), shape)
        b = local[pid[op_of], j_of]
        diff = np.zeros(len(self.graph.ops) + 1)
        np.add.at(diff, first, b)
        np.add.at(diff, last + 1, -b)
        return float(np.cumsum(diff[:-1]).max())

    def cost(self, plan: Mapping[int, Strategy] | Sequence[Strategy], params: CostParams) -> Cost:
        """``graph_cost(graph, plan, params)``; ``plan`` has a strategy for every op id."""
        pairs, pid = self._intern(plan)
        lay_ids: dict[TensorLayout, int] = {}
        n_in = max((len(self.specs[si].in_maps) for si, _ in pairs), default=0)
        n_out = max((len(self.specs[si].out_maps) for si, _ in pairs), default=0)
        pin = np.full((len(pairs), max(n_in, 1)), -1, dtype=np.intp)
        pout = np.full((len(pairs), max(n_out, 1)), -1, dtype=np.intp)
        op_counts: Counter = Counter()
        counts = np.bincount(pid, minlength=len(pairs)).tolist()
        for k, (si, s) in enumerate(pairs):
            spec, s = self.specs[si], _canon(s)
            op_counts[spec, s] += counts[k]
            for row, maps in ((pin, spec.in_maps), (pout, spec.out_maps)):
                for i, m in enumerate(maps):
                    row[k, i] = lay_ids.setdefault(layout_of(m, s), len(lay_ids))
        cons, slot, prod, res, nbytes = self._edges
        want, have = pin[pid[cons], slot], pout[pid[prod], res]
        moved = want != have
        red: dict[tuple[TensorLayout, TensorLayout, int], int] = {}
        if moved.any():
            rows, n = np.unique(np.stack([have[moved], want[moved], nbytes[moved]], axis=1), axis=0, return_counts=True)
            layouts = list(lay_ids)
            red = {(layouts[h], layouts[w], b): c for (h, w, b), c in zip(rows.tolist(), n.tolist())}
        return counted_cost(op_counts, red, self.graph.mesh, params)
