"""The searcher protocol: what every search_mode is, and the capabilities the planner used to sniff by name or
signature, declared as data.

A :class:`Searcher` wraps a search function ``fn(graph, params, *, fully_use_devices, **options) -> SearchResult``
with its name and what it can do. :data:`SEARCHERS` is the registry the planner reads (``search_mode`` ->
Searcher); :func:`register` adds one.

>>> from searchers.cost import CostParams
>>> from searchers.generators import mlp_chain
>>> from searchers.graph import DeviceMesh
>>> s = SEARCHERS["dynamic_programming"]
>>> s.ties_exactly, "elementwise_op_strategy_follow" in s.options
(True, True)
>>> r = s.search(mlp_chain(1, 8, 16, DeviceMesh((2, 2))), CostParams(),
...              {"fully_use_devices": True, "elementwise_op_strategy_follow": False, "unknown": 1})
>>> r.algorithm
'dynamic_programming'
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .baselines import data_parallel
from .cost import CostParams
from .dynamic_programming import dynamic_programming
from .follow import follow_operands
from .graph import Graph
from .ilp import ilp
from .propagation import sharding_propagation
from .recursive_programming import recursive_programming
from .result import SearchResult


class SearchFn(Protocol):
    def __call__(self, graph: Graph, params: CostParams, *, fully_use_devices: bool = ...,
                 **options: Any) -> SearchResult: ...


@dataclass(frozen=True)
class Searcher:
    """A search_mode: its function and capabilities.

    ``ties_exactly``: searches under the write-back ties (``Op.follow_operand``, ``PairwiseProblem.tie_operands``),
    so one search prices a training step's updated state in its stored layout. ``holds_state``:
    a searcher without exact ties that the planner runs a second time with every updated input held at the layout
    the first search gave it (a greedy search). ``options``: the keyword options it takes besides
    ``fully_use_devices`` (others given to :meth:`search` are not passed). ``cost_model``: it minimises the cost
    model (a training step's memory is then fitted to ``device_memory_capacity`` around it)."""

    name: str
    fn: SearchFn
    ties_exactly: bool = False
    holds_state: bool = False
    options: frozenset[str] = frozenset()
    cost_model: bool = False

    def search(self, graph: Graph, params: CostParams, options: Mapping[str, Any]) -> SearchResult:
        """``fn`` with ``fully_use_devices`` and the options it declares, taken from ``options``."""
        kw = {k: v for k, v in options.items() if k == "fully_use_devices" or k in self.options}
        return self.fn(graph, params, **kw)


_FOLLOW = frozenset({"elementwise_op_strategy_follow"})

SEARCHERS: dict[str, Searcher] = {
    "sharding_propagation": Searcher("sharding_propagation", sharding_propagation),
    "follow_operands": Searcher("follow_operands", follow_operands),
    "data_parallel": Searcher("data_parallel", data_parallel, holds_state=True),
    "dynamic_programming": Searcher("dynamic_programming", dynamic_programming, ties_exactly=True, options=_FOLLOW,
                                    cost_model=True),
    "recursive_programming": Searcher("recursive_programming", recursive_programming, holds_state=True,
                                      options=_FOLLOW, cost_model=True),
    "ilp": Searcher("ilp", ilp, ties_exactly=True, options=_FOLLOW, cost_model=True),
}


def register(name: str, fn: Callable[..., SearchResult], *, ties_exactly: bool = False, holds_state: bool = False,
             options: frozenset[str] | set[str] = frozenset(), cost_model: bool = False) -> Searcher:
    """Add (or replace) the search_mode ``name``."""
    s = Searcher(name, fn, ties_exactly, holds_state, frozenset(options), cost_model)
    SEARCHERS[name] = s
    return s
