"""MindSpore's sharding_propagation (ALGORITHMS §3).

Start from the ops with a fixed strategy (``op.fixed``); walk the graph breadth-first over
edges in both directions. When an op is first reached it is decided at once, against every
neighbour already decided (operand producers and result consumers): among its candidates keep
those with the least summed redistribution cost against those sides (a layout equal to the
neighbour's, or obtainable by a free local slice, costs 0), then take the least own cost
(ties: candidate order). Every split is a candidate, one that idles devices too: fully_use_devices restricts the
cost-model searchers, not propagation (issue 14: a ReLU that feeds a MatMul operand laid out (2, 1) takes (2, 1)
on 8 devices). This is MindSpore's rule (edge_costmodel.cc: zero-communication
candidates first, the least computation cost among them; else the least communication).
Costs compare with a relative tolerance of 1e-9, so float rounding never decides a tie.
A source op gets one strategy, so a parameter consumed by several ops
keeps the layout of the first decision; later consumers pay the redistribution. Ops never
reached get :func:`~searchers.strategies.data_parallel_strategy`; with no fixed op at all every
op does, and a note says so.

Work is linear in edges x candidates; cost vectors and decisions are memoised per
(:class:`~searchers.spec.OpSpec`, neighbour layouts), so repeated layers cost one evaluation.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4, 6))
>>> (y,) = g.add_op("exp", "exp", {"i": 4, "j": 6}, [x], [("i", "j")], [("i", "j")], fixed=((), (0,)))
>>> _ = g.add_op("neg", "neg", {"i": 4, "j": 6}, [y], [("i", "j")], [("i", "j")])
>>> sharding_propagation(g, CostParams()).strategies
{0: ((), (0,)), 1: ((), (0,)), 2: ((), (0,))}
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections import deque

import numpy as np

from .baselines import no_worse_than_baselines
from .cache import cached_search
from .cost import CostParams
from .graph import DeviceMesh, Graph, Strategy, tied_strategy
from .plan_cost import PlanIndex
from .result import SearchResult
from .spec import layout_of
from .strategies import data_parallel_strategy
from .tables import Tables

ALGORITHM = "sharding_propagation"
_REL_TIE = 1e-9


def _first_min(own: list[float], red: list[float]) -> int:
    """First candidate with the least ``red`` and, among those, the least ``own`` (both
    compared with a relative tolerance, so float rounding never decides a tie). Plain floats: a
    decision weighs a few dozen candidates, where numpy's per-call overhead is most of the time.

    >>> _first_min([3.0, 1.0, 2.0], [1.0, 2.0, 1.0 + 1e-12])    # 0 and 2 tie; the lesser own cost wins
    2
    """
    best = min(red)
    lim = best + _REL_TIE * abs(best)
    tied = [i for i, x in enumerate(red) if x <= lim]
    if len(tied) == 1:
        return tied[0]
    lo = min([own[i] for i in tied])
    lim = lo + _REL_TIE * abs(lo)
    return next(i for i in tied if own[i] <= lim)


class _Tables(Tables):
    """The search's :class:`~searchers.tables.Tables` and propagation's memoised side lists and decisions (per op
    shape and decided sides)."""

    def __init__(self, graph: Graph, params: CostParams, max_candidates: int | None):
        super().__init__(graph, params, max_candidates)
        self.decision: dict[tuple, int] = {}
        self.own_list: dict[int, list[float]] = {}
        self.side_list: dict[tuple, list[float]] = {}

    def decide(self, sid: int, sides: tuple) -> int:
        key = (sid, sides)
        c = self.decision.get(key)
        if c is None:
            own = self.own_list.get(sid)
            if own is None:
                own = self.own_list[sid] = self.own[sid].tolist()        # type: ignore[union-attr]
            if len(sides) == 1:
                red = self.vector_list(sid, *sides[0])
            else:
                total = self.vector(sid, *sides[0])
                for out, idx, other in sides[1:]:
                    total = total + self.vector(sid, out, idx, other)
                red = total.tolist()
            c = self.decision[key] = _first_min(own, red)
        return c

    def vector_list(self, sid: int, out: int, idx: int, other: int) -> list[float]:
        """:meth:`vector` as a list."""
        key = (sid, out, idx, other)
        v = self.side_list.get(key)
        if v is None:
            v = self.side_list[key] = self.vector(sid, out, idx, other).tolist()
        return v


@cached_search
def sharding_propagation(graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
                         max_candidates: int | None = None, baselines: bool = True) -> SearchResult:
    """Propagate the fixed strategies of ``graph`` to every op it can reach (see module doc) and return that plan,
    as MindSpore's sharding_propagation does: where an obvious plan (:mod:`searchers.baselines`) costs less on the
    cost model, a note says so with both figures, and the plan is kept (``baselines=False``: no such check).
    ``fully_use_devices`` does not restrict the propagation (a neighbour takes the layout that needs no
    redistribution even where that idles devices, as MindSpore's propagation does: the option is the cost-model
    searchers'); it only keeps the replicated plan out of the baselines that are compared."""
    # the search allocates only acyclic tuples and lists: pausing the cyclic garbage collector
    # saves its repeated scans of the (large) live graph, about a third of the time at 100k ops
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        ix = PlanIndex(graph)
        res = _propagate(graph, params, max_candidates, ix)
        res = dataclasses.replace(res, seconds=time.perf_counter() - t0)        # the index's time included
        return (no_worse_than_baselines(graph, params, res, fully_use_devices=fully_use_devices, index=ix, swap=False)
                if baselines else res)
    finally:
        if enabled:
            gc.enable()


def _propagate(graph: Graph, params: CostParams, max_candidates: int | None, ix: PlanIndex) -> SearchResult:
    t0 = time.perf_counter()
    mesh, ops = graph.mesh, graph.ops
    n = len(ops)
    tab = _Tables(graph, params, max_candidates)
    keys, index = ix.spec_keys
    sids = np.asarray([tab.spec_id(k) for k in keys], dtype=np.intp)[index].tolist()
    in_src = ix.in_src
    out_edges = ix.out_edges()
    st = _State(n)

    def set_strategy(i: int, s: Strategy) -> None:
        spec = tab.specs[sids[i]]
        st.chosen[i] = s
        st.in_l[i] = tuple(tab.lid(layout_of(m, s)) for m in spec.in_maps)
        st.out_l[i] = tuple(tab.lid(layout_of(m, s)) for m in spec.out_maps)

    # seeds: operators with user strategies spread first; fixed inputs (the dataset layout, a
    # parameter_plan) only then, so an annotation reaches its neighbours before the batch split does
    queue: deque[int] = deque()
    later: deque[int] = deque()
    for op in ops:
        if op.fixed is not None:
            set_strategy(op.id, tuple(tuple(a) for a in op.fixed))
            (later if op.is_source else queue).append(op.id)
    notes: list[str] = []
    if not queue and not later:
        notes.append("no op has a fixed strategy: every op gets the data-parallel strategy "
                     "(MindSpore requires at least one configured op)")
    nbrs = ix.neighbours()
    _bfs(queue, tab, sids, in_src, out_edges, nbrs, st)
    _bfs(later, tab, sids, in_src, out_edges, nbrs, st)
    unreached = [op for op in ops if st.chosen[op.id] is None]
    for op in unreached:
        set_strategy(op.id, data_parallel_strategy(op, mesh))
    if unreached and len(unreached) < n:
        names = ", ".join(op.name for op in unreached[:5]) + (", ..." if len(unreached) > 5 else "")
        notes.append(f"{len(unreached)} op(s) not reached from a fixed op got the data-parallel strategy: {names}")
    for op in (o for o in ops if o.follow_operand is not None):   # the tied op takes its operand's layout
        s = tied_strategy(graph, op, st.chosen)
        if s is not None and s != st.chosen[op.id] and op.fixed is None and s in tab.ensure(sids[op.id]).cands:
            set_strategy(op.id, s)
    chosen = {i: s for i, s in enumerate(st.chosen) if s is not None}     # every op is decided by now
    cost = ix.cost(chosen, params)
    return SearchResult(chosen, cost, ALGORITHM, time.perf_counter() - t0, notes)


class _State:
    """Decisions so far: strategy, and layout id of every operand / result, per op id."""

    def __init__(self, n: int):
        self.chosen: list[Strategy | None] = [None] * n
        self.in_l: list[tuple[int, ...] | None] = [None] * n
        self.out_l: list[tuple[int, ...] | None] = [None] * n


def _bfs(queue: deque[int], tab: _Tables, sids: list[int], in_src: list[list[tuple[int, int]]],
         out_edges: list[list[tuple[int, int, int]]], nbrs: list[list[int]], st: _State) -> None:
    """Breadth-first from the decided ops in ``queue``: decide each op when first reached."""
    chosen, in_l, out_l = st.chosen, st.in_l, st.out_l
    structs, decision = tab.structs, tab.decision
    while queue:
        u = queue.popleft()
        for v in nbrs[u]:
            if chosen[v] is not None:
                continue
            sid = sids[v]
            s = structs[sid]
            if s is None:
                s = tab.ensure(sid)
            sides = []
            for k, (p, j) in enumerate(in_src[v]):
                src = out_l[p]
                if src is not None:
                    sides.append((0, k, src[j]))
            for j, c, k in out_edges[v]:
                dst = in_l[c]
                if dst is not None:
                    sides.append((1, j, dst[k]))
            key = (sid, tuple(sides))
            ci = decision.get(key)
            if ci is None:
                ci = tab.decide(sid, key[1])
            chosen[v] = s.cands[ci]
            in_l[v] = s.in_rows[ci]
            out_l[v] = s.out_rows[ci]
            queue.append(v)


def _main() -> None:  # pragma: no cover - a benchmark, run by hand
    import argparse

    from .generators import graph_of_size

    ap = argparse.ArgumentParser(description="time sharding_propagation on a synthetic graph")
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--family", default="transformer")
    ap.add_argument("--devices", type=int, default=8)
    a = ap.parse_args()
    t = time.perf_counter()
    g = graph_of_size(a.ops, family=a.family, mesh=DeviceMesh.prime(a.devices), fix_data=True)
    build = time.perf_counter() - t
    r = sharding_propagation(g, CostParams())
    print(f"{a.family}: {len(g)} ops, {sum(len(op.inputs) for op in g.ops)} edges; build {build:.2f} s; "
          f"propagation {r.seconds:.3f} s; cost total {r.cost.total:.6g}; notes {r.notes}")


if __name__ == "__main__":  # pragma: no cover
    _main()
