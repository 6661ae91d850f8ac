"""The propagation at the heart of sharding_propagation (:mod:`searchers.propagation`): start from the ops with a fixed
strategy and decide each other op when the breadth-first walk first reaches it (see that module's doc for the rule).

:func:`propagate` with no ``derive`` walks every op (the seed :mod:`searchers.dynamic_programming` starts one of its
passes from); with a ``derive`` it walks the forward only, decides an opaque op in the layout its operands arrive in,
and hands the derived ops (``Op.derived``: a training step's backward and update) to ``derive``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from .cost import CostParams
from .follow import follow_layouts
from .graph import OPAQUE_KINDS, Graph, Strategy, tied_strategy
from .graph_index import GraphIndex
from .result import SearchResult
from .spec import layout_of
from .strategies import data_parallel_strategy
from .tables import Tables

ALGORITHM = "sharding_propagation"
_REL_TIE = 1e-9


def used_log2(s: Strategy, mesh) -> float:
    """log2 of the devices a strategy uses: the mesh axes it splits any dim over."""
    return math.log2(mesh.count({a for d in s for a in d}))


def _first_min(own: list[float], red: list[float], change: list[float] | None = None,
               moved: list[float] | None = None) -> int:
    """First candidate with the least ``moved`` (when given: the redistributions' bytes alone), then the least
    ``red``, then the least ``change`` (when given) and then the least ``own`` (each compared with a relative
    tolerance, so float rounding never decides a tie). Plain floats: a decision weighs a few dozen candidates,
    where numpy's per-call overhead is most of the time.

    >>> _first_min([3.0, 1.0, 2.0], [1.0, 2.0, 1.0 + 1e-12])    # 0 and 2 tie; the lesser own cost wins
    2
    >>> _first_min([3.0, 1.0, 2.0], [1.0, 2.0, 1.0], [0.0, 0.0, 2.0])    # 2 uses more devices than its neighbour
    0
    >>> _first_min([3.0, 1.0, 2.0], [1.0, 2.0, 1.0], None, [5.0, 4.0, 5.0])   # 1 moves fewer bytes, in 2 collectives
    1
    """
    tied = list(range(len(red)))
    for vec in (moved, red, change, own):
        if vec is None or len(tied) == 1:
            continue
        lo = min([vec[i] for i in tied])
        lim = lo + _REL_TIE * abs(lo)
        tied = [i for i in tied if vec[i] <= lim]
    return tied[0]


class _Tables(Tables):
    """The search's :class:`~searchers.tables.Tables` and propagation's memoised side lists and decisions (per op
    shape and decided sides)."""

    def __init__(self, graph: Graph, params: CostParams, max_candidates: int | None, least_change: bool = False):
        super().__init__(graph, params, max_candidates)
        self.least_change = least_change       # MindSpore's rule (searchers.propagation): bytes first, devices used
        self.used: dict[int, list[float]] = {}
        self.is_source: list[bool] = []
        self.decision: dict[tuple, int] = {}
        self.own_list: dict[int, list[float]] = {}
        self.side_list: dict[tuple, list[float]] = {}

    def decide(self, sid: int, sides: tuple) -> int:
        """The chosen candidate of ``sid`` against its decided ``sides``: ``(out, idx, layout id)`` each, plus, with
        ``least_change``, the log2 of the devices the neighbour's strategy uses."""
        key = (sid, sides)
        c = self.decision.get(key)
        if c is None:
            own = self.own_list.get(sid)
            if own is None:
                own = self.own_list[sid] = self.own[sid].tolist()        # type: ignore[union-attr]
            if len(sides) == 1:
                red = self.vector_list(sid, *sides[0][:3])
            else:
                total = self.vector(sid, *sides[0][:3])
                for side in sides[1:]:
                    total = total + self.vector(sid, *side[:3])
                red = total.tolist()
            change = moved = None
            if self.least_change:
                moved = sum(self.bytes_vector(sid, *side[:3]) for side in sides).tolist()
                if any(len(side) > 3 for side in sides):
                    used = self.devices_used(sid)
                    change = [sum(abs(u - side[3]) for side in sides if len(side) > 3) for u in used]
            c = self.decision[key] = _first_min(own, red, change, moved)
        return c

    def devices_used(self, sid: int) -> list[float]:
        """log2 of the devices each candidate of ``sid`` uses (the mesh axes its strategy splits over)."""
        v = self.used.get(sid)
        if v is None:
            st = self.structs[sid]
            assert st is not None
            v = self.used[sid] = [used_log2(s, self.mesh) for s in st.cands]
        return v

    def bytes_vector(self, sid: int, out: int, idx: int, other: int) -> np.ndarray:
        """:meth:`vector` without its latency terms: the redistribution's bytes over the links' bandwidth, what
        MindSpore's redistribution cost counts (``tensor_redistribution.cc`` prices the data a change moves, no
        per-collective term)."""
        key = (sid, out, idx, other, "bytes")
        v = self.side_vec.get(key)
        if v is None:
            self.vector(sid, out, idx, other)           # fills self.affine for this list and side
            st, spec = self.structs[sid], self.specs[sid]
            assert st is not None
            list_id = (st.out_lids[idx] if out else st.in_lids[idx])[3]
            nbytes = spec.out_bytes[idx] if out else spec.in_bytes[idx]
            v = self.side_vec[key] = self.affine[list_id, out, other][1] * float(nbytes)
        return v

    def vector_list(self, sid: int, out: int, idx: int, other: int) -> list[float]:
        """:meth:`vector` as a list."""
        key = (sid, out, idx, other)
        v = self.side_list.get(key)
        if v is None:
            v = self.side_list[key] = self.vector(sid, out, idx, other).tolist()
        return v


def propagate(graph: Graph, params: CostParams, max_candidates: int | None, ix: GraphIndex,
              derive: Callable[..., None] | None = None, least_change: bool = False) -> SearchResult:
    """The propagation's plan of every op (module doc). ``derive(graph, params, state, derived, set_strategy)``
    decides the derived ops once the forward is decided (``state.chosen``: the strategies so far, per op id).
    ``least_change``: among the candidates that need no more communication, those that use as many devices as
    their decided neighbours' strategies do win before the lesser own cost (see :mod:`searchers.propagation`);
    without it (the seed of dynamic_programming) the lesser own cost decides among them."""
    t0 = time.perf_counter()
    mesh, ops = graph.mesh, graph.ops
    n = len(ops)
    tab = _Tables(graph, params, max_candidates, least_change)
    tab.is_source = [op.is_source for op in ops]
    keys, index = ix.spec_keys
    sids = np.asarray([tab.spec_id(k) for k in keys], dtype=np.intp)[index].tolist()
    in_src = ix.in_src
    out_edges = ix.out_edges()
    st = State(n)

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
    derived = [derive is not None and op.derived and op.fixed is None for op in ops]
    opaque = [derive is not None and op.kind in OPAQUE_KINDS for op in ops]
    for q in (queue, later):
        _bfs(q, tab, sids, in_src, out_edges, nbrs, st, derived, opaque, mesh.shape)
    # the forward first (what a derived op reads must be decided), then the derived ops and the state only they read
    read_forward = [any(not derived[c] for c in graph.tensors[op.outputs[0]].consumers) if op.is_source else True
                    for op in ops]
    unreached = [op for op in ops if st.chosen[op.id] is None and not derived[op.id] and read_forward[op.id]]
    for op in unreached:
        set_strategy(op.id, data_parallel_strategy(op, mesh))
    if any(derived):
        derive(graph, params, st, derived, set_strategy)
    late = [op for op in ops if st.chosen[op.id] is None]
    for op in late:
        set_strategy(op.id, data_parallel_strategy(op, mesh))
    unreached += [op for op in late if not derived[op.id]]
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


class State:
    """Decisions so far: strategy, and layout id of every operand / result, per op id."""

    def __init__(self, n: int):
        self.chosen: list[Strategy | None] = [None] * n
        self.in_l: list[tuple[int, ...] | None] = [None] * n
        self.out_l: list[tuple[int, ...] | None] = [None] * n


def _followed(tab: _Tables, sid: int, srcs: list[tuple[int, int]], st: State, shape: tuple[int, ...]) -> Strategy:
    """The strategy of :func:`~searchers.follow.follow_layouts` for an op of ``sid`` whose operands come from ``srcs``
    (an undecided operand counts as whole); where that is not a candidate of the op (a split its shape forbids), the
    least redistribution from the decided operands, as the propagation decides."""
    spec = tab.specs[sid]
    lays = tuple(tab.layouts[st.out_l[p][j]] if st.out_l[p] is not None else ((),) * len(spec.in_maps[k])
                 for k, (p, j) in enumerate(srcs))
    s = follow_layouts(spec, lays, shape)
    struct = tab.ensure(sid)
    if s not in struct.cands:
        sides = tuple((0, k, st.out_l[p][j]) for k, (p, j) in enumerate(srcs) if st.out_l[p] is not None)
        s = struct.cands[tab.decide(sid, sides)] if sides else struct.cands[0]
    return s


def _bfs(queue: deque[int], tab: _Tables, sids: list[int], in_src: list[list[tuple[int, int]]],
         out_edges: list[list[tuple[int, int, int]]], nbrs: list[list[int]], st: State, derived: list[bool],
         opaque: list[bool], shape: tuple[int, ...]) -> None:
    """Breadth-first from the decided ops in ``queue``: decide each op when first reached (never a derived one; an
    opaque one by :func:`_followed`)."""
    chosen, in_l, out_l = st.chosen, st.in_l, st.out_l
    structs, decision = tab.structs, tab.decision
    while queue:
        u = queue.popleft()
        for v in nbrs[u]:
            if chosen[v] is not None or derived[v]:
                continue
            sid = sids[v]
            if opaque[v]:
                s_v = _followed(tab, sid, in_src[v], st, shape)
                chosen[v] = s_v
                in_l[v] = tuple(tab.lid(layout_of(m, s_v)) for m in tab.specs[sid].in_maps)
                out_l[v] = tuple(tab.lid(layout_of(m, s_v)) for m in tab.specs[sid].out_maps)
                queue.append(v)
                continue
            s = structs[sid]
            if s is None:
                s = tab.ensure(sid)
            sides = []
            for k, (p, j) in enumerate(in_src[v]):
                src = out_l[p]
                if src is not None:
                    # a source (data, a parameter) has a layout, not an op strategy: it does not count devices
                    sides.append((0, k, src[j], used_log2(chosen[p], tab.mesh))
                                 if tab.least_change and not tab.is_source[p] else (0, k, src[j]))
            for j, c, k in out_edges[v]:
                dst = in_l[c]
                if dst is not None:
                    sides.append((1, j, dst[k], used_log2(chosen[c], tab.mesh)) if tab.least_change
                                 else (1, j, dst[k]))
            key = (sid, tuple(sides))
            ci = decision.get(key)
            if ci is None:
                ci = tab.decide(sid, key[1])
            chosen[v] = s.cands[ci]
            in_l[v] = s.in_rows[ci]
            out_l[v] = s.out_rows[ci]
            queue.append(v)
