"""A plan that fits ``device_memory_capacity`` when the exact program with memory rows cannot be solved.

ilp's memory rows (:mod:`searchers.ilp`) make the program exact but hard: on a two-block transformer training graph
(214 ops, 91 rows) HiGHS finds no useful incumbent in 60 s, and on a GPT-1.3B-shaped graph (2,678 ops) the program
has 13M edge variables and is not built at all. Before, ilp then returned dynamic_programming's plan, which ignores
the capacity: a plan over the limit that the user asked ilp to enforce.

:func:`fit_memory` prices memory instead (a Lagrangian multiplier on one aggregated row): it reruns a searcher with
the cost model's memory weight ``gamma`` raised until the plan's peak (:func:`~searchers.memory.peak_memory`) fits,
then bisects between the last weight that did not fit and the first that did, and returns the fitting plan of least
cost under the caller's own weights. Each plan is a real search result, its peak measured, so the answer fits; it is
not proven optimal (the note says so), and ``None`` comes back where no weight tried makes a plan fit.

>>> from searchers.cost import CostParams
>>> from searchers.generators import mlp_chain
>>> from searchers.graph import DeviceMesh
>>> from searchers.dynamic_programming import dynamic_programming
>>> g = mlp_chain(2, 64, 256, DeviceMesh((2, 4)))
>>> whole = dynamic_programming(g, CostParams(), cache=False)
>>> peak = peak_memory(g, whole.strategies)[0]
>>> p = CostParams(device_memory_capacity=0.6 * peak)
>>> got, notes = fit_memory(g, p, lambda q: dynamic_programming(g, q, cache=False))
>>> peak_memory(g, got.strategies)[0] <= p.device_memory_capacity
True
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from .cost import CostParams
from .graph import Graph
from .graph_index import GraphIndex
from .memory import peak_memory
from .result import SearchResult


def fits_memory(graph: Graph, strategies, capacity: float, index: GraphIndex | None = None) -> bool:
    """Whether the peak of ``strategies`` (:func:`~searchers.memory.peak_memory`; :meth:`GraphIndex.peak
    <searchers.graph_index.GraphIndex.peak>` where the graph's ``index`` is given) is within ``capacity`` (1e-12
    relative: byte sums in float64, a few roundings of ~1e-16 each)."""
    peak = peak_memory(graph, strategies)[0] if index is None else index.peak(strategies)
    return peak <= capacity * (1 + 1e-12)


def fit_memory(graph: Graph, params: CostParams, search: Callable[[CostParams], SearchResult], *,
               refine: Callable[[CostParams], SearchResult] | None = None, first: SearchResult | None = None,
               factor: float = 8.0, tries: int = 12, bisect: int = 4,
               index: GraphIndex | None = None) -> tuple[SearchResult | None, list[str]]:
    """(the cheapest plan found whose peak fits ``params.device_memory_capacity``, or None; notes): ``search`` is
    rerun with ``gamma`` raised by ``factor`` at most ``tries`` times from the weight at which the first plan's
    memory term equals its cost, then ``bisect`` geometric bisections (module doc). ``refine``, a slower and
    better searcher, then runs once at the weight of the best plan found, and its plan counts where it fits.
    ``first``: a plan the caller already has at its own weights, known not to fit (the search there is skipped).
    ``index``: the graph's :class:`~searchers.graph_index.GraphIndex`, which prices each plan and its peak in numpy."""
    ix = GraphIndex(graph) if index is None else index
    cap = params.device_memory_capacity
    best: tuple[float, SearchResult, float] | None = None          # (cost, result, gamma)
    runs = 0

    def attempt(gamma: float, fn: Callable[[CostParams], SearchResult] = search) -> tuple[bool, SearchResult]:
        nonlocal best, runs
        runs += 1
        r = fn(dataclasses.replace(params, gamma=gamma))
        fits = fits_memory(graph, r.strategies, cap, ix)
        if fits:
            cost = ix.cost(r.strategies, params)
            if best is None or cost.total < best[0]:
                best = (cost.total, dataclasses.replace(r, cost=cost), gamma)
        return fits, r

    fits = False
    if first is None:
        fits, first = attempt(params.gamma)
    if fits:
        if refine is not None:
            attempt(params.gamma, refine)
        assert best is not None
        return best[1], []
    mem = max(first.cost.memory / params.memory_unit, 1e-300)
    gamma = max(params.gamma, first.cost.total / mem)       # the memory term as large as the plan's cost
    lo = params.gamma
    hi = None
    for _ in range(tries):
        fits, _r = attempt(gamma)
        if fits:
            hi = gamma
            break
        lo, gamma = gamma, gamma * factor
    if hi is None:
        return None, [f"memory: no plan fits device_memory_capacity={cap:,.0f} B with the memory weight raised to "
                      f"{gamma / factor:.3g} ({runs} searches)"]
    for _ in range(bisect):
        mid = math.sqrt(lo * hi)
        fits, _r = attempt(mid)
        lo, hi = (lo, mid) if fits else (mid, hi)
    assert best is not None                                  # hi fitted
    if refine is not None:
        attempt(best[2], refine)
    return best[1], [f"memory: the plan fits device_memory_capacity={cap:,.0f} B with memory priced at "
                     f"gamma={best[2]:.3g} ({runs} searches); it is not proven optimal"]
