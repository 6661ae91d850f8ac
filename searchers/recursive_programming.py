"""recursive_programming: the double-recursive search (Wang et al., Euro-Par 2021; docs/algorithms.md §5).

The outer recursion splits the device count one prime factor at a time: one round per mesh
axis (the mesh has one axis per prime factor, so 8 devices take log2(8) = 3 rounds of halving
and 12 devices rounds of 2, 2 and 3). The inner recursion visits every op, heaviest first
(weight: the op's cost when replicated), and gives it this round's *cut*: which loop dim the
axis splits (or none). A cut is priced by the cost model on the op's partial strategy (the
axes of the rounds so far): compute over the devices used, the all-reduce of a split
reduction dim, memory — the symbolic costs of the paper (cutting ``i`` of a MatMul replicates
the weight, cutting ``k`` leaves partial sums) — plus the redistribution against the
neighbours already decided in this round, at their partial layouts.

In a round an op reads the new layouts of its heavier neighbours and the old ones of its
lighter neighbours, so the ops fall into *levels* of ops that do not depend on each other
(:mod:`searchers.rp_levels`). The large leading levels are decided at once with numpy; the
rest op by op, each decision memoised on (op shape and sizes, neighbours' layouts), so
repeated layers cost one evaluation. Both give the same plan (the same sums in the same order,
the same ties). Work is linear in the number of ops and edges; no sort beyond the weight order.

Quality — no worst-case bound. Three additions to the paper: an input used by one op only (a
weight) is folded into that op, which prices each cut with the weight's best response
(MindSpore's merge elimination); one refinement sweep after the rounds re-chooses each op,
heaviest first, among all its final strategies against its neighbours; and a *block polish*
(:mod:`searchers.block_polish`) re-solves, exactly, the induced tree of up to ``block_size``
ops around each edge that still redistributes, which finds the moves no single op can make
(a chain that should stay replicated instead of being split and gathered at its end).
``polish="auto"`` runs two polish sweeps on graphs of up to ``POLISH_AUTO_OPS`` movable ops
and none above, where it would double the search time; ``polish=k`` forces ``k`` sweeps.
Blocks are memoised on their structure and surroundings, so repeated layers cost one solve.
Measured with bench/search.py and the default cost model: within 1.0002x of the ILP optimum
on the MLP, transformer and conv graphs where ILP finishes (up to 1k ops), 1.00x-1.06x on
random DAGs of 100-1000 ops (1.27x and 1.11x without the polish). The tests hold it to 1.10x
on small MLP and conv graphs, and to 1.25x (median: optimal) on tiny random DAGs.

Differences from MindSpore: user strategies (``op.fixed``) are always honoured (MindSpore only
behind an environment variable); any device count works, not only powers of two up to 1024;
the cut may be "none" when splitting costs more than it saves (disabled by
``fully_use_devices``, which keeps only cuts that can still complete to a strategy using every
mesh axis).

An op with ``Op.follow_operand`` is given its operand's layout after the search
(:func:`~searchers.graph.tied_strategy`): the rounds do not price the tie (dynamic_programming and
ilp do), so mshard searches a training step a second time with its state held.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> g = Graph(DeviceMesh((2, 3)))
>>> x = g.source("x", (12, 6))
>>> w = g.source("w", (6, 4), kind="param")
>>> (y,) = g.add_op("mm", "dot_general", {"m": 12, "k": 6, "n": 4}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
>>> r = recursive_programming(g, CostParams(state_weight=0.0))
>>> r.strategies[2]        # both rounds cut m (12 = 2 * 3 * 2): no all-reduce, the small weight replicated
((0, 1), (), ())
>>> recursive_programming(g, CostParams()).strategies[2]     # priced as stored state, the weight is split too
((1,), (), (0,))
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from typing import cast

import numpy as np

from .baselines import no_worse_than_baselines
from .block_polish import polish_blocks
from .cache import cached_search
from .cost import CostParams
from .cost_vectors import layout_cost_matrix
from .graph import SOURCE_KINDS, Graph, Op, Strategy, Tensor, tied_strategy
from .graph_index import GraphIndex
from .progress import Progress
from .result import SearchResult
from .rp_levels import LevelBatch
from .slots import Slots, flat_ops, slot_graph, starts
from .spec import all_devices, distinct_spec_keys, layout_of
from .tables import Tables

ALGORITHM = "recursive_programming"
_REL_TIE = 1e-9
POLISH_AUTO_OPS = 20_000     # polish="auto": two sweeps up to this many movable ops, none above
LEVEL_MIN_OPS = 256          # levels of at least this many ops are decided at once (numpy), the rest op by op
_ENUMERATED = 4096           # a spec only fixed ops have, with more strategies than this, is not enumerated


class _Rounds:
    """Per op structure: the cuts allowed in each round, as candidate indices: ``kids[(r, i)]`` are
    the candidates that extend partial strategy ``i`` (axes ``< r``) by a cut of axis ``r``."""

    __slots__ = ("final_array", "finals", "kid_lists", "kids", "n_axes", "rep")

    def __init__(self, cands: tuple[Strategy, ...], finals: tuple[Strategy, ...], n_axes: int):
        def code(s: Strategy) -> tuple[int, ...]:
            where = [-1] * n_axes
            for d, axes in enumerate(s):
                for a in axes:
                    where[a] = d
            return tuple(where)

        index = {code(s): i for i, s in enumerate(cands)}
        self.n_axes = n_axes
        self.rep = index[(-1,) * n_axes]
        none = (-1,) * n_axes
        kids: dict[tuple[int, int], set[int]] = {}
        fin = set()
        for f in finals:
            c = code(f)
            path = [index.get(c[:r + 1] + none[r + 1:]) for r in range(n_axes)]
            if None in path:        # a cut before it is no candidate (a merged dim's minor part split before its
                continue            # major one is whole: Op.nested); the same layout is reached with the axes reordered
            fin.add(index[c])
            parent = self.rep
            for r, kid in enumerate(path):
                kids.setdefault((r, parent), set()).add(kid)
                parent = kid
        if not fin:                 # every final needs such a cut (a mesh whose axis sizes force it): replicated
            fin.add(self.rep)
        # ties go to the cut of the leading loop dim (the batch dim first, as in data parallel), "none" last
        dim_of = {i: c for c, i in index.items()}
        self.kids = {(r, p): np.array(sorted(v, key=lambda i: (dim_of[i][r] < 0, dim_of[i][r])), dtype=np.intp)
                     for (r, p), v in kids.items()}
        self.kid_lists = {key: tuple(v.tolist()) for key, v in self.kids.items()}
        self.finals = frozenset(fin)
        self.final_array = np.array(sorted(fin), dtype=np.intp)


@cached_search
def recursive_programming(graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
                          elementwise_op_strategy_follow: bool = False, refine: int = 1,
                          polish: int | str = "auto", block_size: int = 6) -> SearchResult:
    """Strategies for every op of ``graph`` by the double-recursive search (see the module doc).

    With ``elementwise_op_strategy_follow`` an elementwise op whose only consumer is already
    decided takes the strategy that gives that consumer its operand without redistribution.
    """
    enabled = gc.isenabled()
    gc.disable()            # only acyclic tuples and lists are allocated (see sharding_propagation)
    try:
        return _search(graph, params, fully_use_devices, elementwise_op_strategy_follow, refine, polish, block_size)
    finally:
        if enabled:
            gc.enable()


def _search(graph: Graph, params: CostParams, fully: bool, follow: bool, refine: int, polish: int | str,
            block_size: int) -> SearchResult:
    t0 = time.perf_counter()
    search = _Search(graph, params, fully)
    chosen, notes = search.run(follow, refine, polish, block_size)
    ix = search.index()
    return no_worse_than_baselines(graph, params, SearchResult(dict(enumerate(chosen)), ix.cost(chosen, params),
                                                               ALGORITHM, time.perf_counter() - t0, notes),
                                   fully_use_devices=fully, index=ix)


class _Search:
    """One search: the graph's tables (what a cut costs, per op shape) and its one state, ``state`` (each op's
    candidate index) and ``lay`` (the layout id of every slot: an op's operands, then its results), both lists;
    the level batches (numpy) read and write them through arrays made for each sweep."""

    def __init__(self, graph: Graph, params: CostParams, fully: bool):
        self.graph, self.params, self.fully = graph, params, fully
        mesh, ops = graph.mesh, graph.ops
        self.n, self.n_axes = len(ops), len(mesh.shape)
        self.tab = tab = Tables(graph, params, None)          # every partial strategy is a candidate here
        # flat layout slots (every op's operands then results) and each op's refs: the slots of its
        # neighbours its cost depends on (searchers.slots)
        self.flat = flat_ops(graph)
        self.sl = sl = slot_graph(graph, self.flat)
        self.keys = distinct_spec_keys(graph, self.flat)
        keys, index = self.keys
        self.sid_a = np.asarray([tab.spec_id(k) for k in keys], dtype=np.intp)[index]
        self.sids = self.sid_a.tolist()
        base, rp = sl.base.tolist(), sl.ref_ptr.tolist()
        self.in_base, self.out_end = base[:-1], base[1:]
        self.in_end = self.out_base = (sl.base[:-1] + sl.n_in).tolist()
        rl, pl, nin = sl.ref_slot.tolist(), sl.ref_pos.tolist(), sl.n_in.tolist()
        self.refs = [rl[i:j] for i, j in zip(rp, rp[1:])]
        # a signature says which operand / result each ref is: (operand count, result index per consumer ref)
        sig_ids: dict[tuple, int] = {}
        self.sigs: list[tuple] = []
        self.sig_of: list[int] = []
        for k, i, j in zip(nin, rp, rp[1:]):
            t = (k, tuple(pl[i + k:j]))
            g = sig_ids.get(t)
            if g is None:
                g = sig_ids[t] = len(self.sigs)
                self.sigs.append(tuple((0, q) for q in range(k)) + tuple((1, x - k) for x in t[1]))
            self.sig_of.append(g)
        self._rounds: dict[int, _Rounds] = {}
        self._by_sets: dict[tuple, _Rounds] = {}     # structures with the same candidates share their round tables
        self._leaf_msgs: dict[tuple[int, int, int], np.ndarray] = {}
        self._own_lists: dict[int, list[float]] = {}
        self._side_lists: dict[tuple, list[float]] = {}
        self._fin_own: dict[int, np.ndarray] = {}
        self._fin_side: dict[tuple, np.ndarray] = {}
        self._cand_slots: dict[int, np.ndarray] = {}
        self._start()

    # -- what a cut costs, per op shape ------------------------------------------------------------------------
    def rounds_of(self, sid: int) -> _Rounds:
        tab = self.tab
        struct = tab.struct_of[sid]
        got = self._rounds.get(struct)
        if got is None:
            spec = tab.specs[sid]
            cands = tab.ensure(sid).cands
            finals = tab.candidates(sid, all_devices(spec, self.fully))
            key = (cands, finals)
            got = self._by_sets.get(key)
            if got is None:
                got = self._by_sets[key] = _Rounds(cands, finals, self.n_axes)
            self._rounds[struct] = got
        return got

    def side(self, sid: int, out: int, idx: int, lid: int) -> np.ndarray:
        """Redistribution per candidate against one neighbour's layout ``lid``; ``lid < 0`` marks a
        leaf input (of spec ``-lid - 1``) that follows this op: its best response per candidate."""
        tab = self.tab
        if lid >= 0:
            return tab.vector(sid, out, idx, lid)
        key = (sid, idx, -lid - 1)
        got = self._leaf_msgs.get(key)
        if got is None:
            usid = -lid - 1
            su, fin = tab.ensure(usid), self.rounds_of(usid).final_array
            src = tuple(tab.layouts[su.out_rows[i][0]] for i in fin)
            dst = tuple(tab.layouts[row[idx]] for row in tab.ensure(sid).in_rows)
            R = layout_cost_matrix(src, dst, tab.specs[usid].out_bytes[0], tab.mesh, self.params)
            got = self._leaf_msgs[key] = (tab.own[usid][fin][:, None] + R).min(axis=0)   # type: ignore[index]
        return got

    def decide(self, sid: int, sig: int, r: int, state: int, lids: tuple) -> int:
        """Round ``r``'s cut for an op of spec ``sid`` at partial strategy ``state`` against neighbour layouts
        ``lids``."""
        # a round offers a handful of cuts: plain floats beat numpy's per-call overhead here
        kids = self.rounds_of(sid).kid_lists.get((r, state))
        if kids is None:
            return state
        own = self._own_lists.get(sid)
        if own is None:
            own = self._own_lists[sid] = self.tab.own[sid].tolist()     # type: ignore[union-attr]
        side_lists = self._side_lists
        vecs = []
        for (out, idx), lid in zip(self.sigs[sig], lids):
            key = (sid, out, idx, lid)
            v = side_lists.get(key)
            if v is None:
                v = side_lists[key] = self.side(sid, out, idx, lid).tolist()
            vecs.append(v)
        costs = []
        for k in kids:
            c = own[k]
            for v in vecs:
                c += v[k]
            costs.append(c)
        lo = min(costs)
        lim = lo + _REL_TIE * abs(lo)
        for k, c in zip(kids, costs):
            if c <= lim:
                return k
        return state

    def final_costs(self, sid: int, sig: int, lids: Iterable[int | None]) -> np.ndarray:
        """Own cost plus the side against each neighbour layout in ``lids`` (None: left out), per final
        candidate of spec ``sid``."""
        fin = self.rounds_of(sid).final_array
        cost = self._fin_own.get(sid)
        if cost is None:
            cost = self._fin_own[sid] = self.tab.own[sid][fin]           # type: ignore[index]
        for (out, idx), lid in zip(self.sigs[sig], lids):
            if lid is None:
                continue
            key = (sid, out, idx, lid)
            v = self._fin_side.get(key)
            if v is None:
                v = self._fin_side[key] = self.side(sid, out, idx, lid)[fin]
            cost = cost + v
        return cost

    def refine_one(self, sid: int, sig: int, state: int, lids: tuple) -> int:
        ro = self.rounds_of(sid)
        fin = ro.final_array
        cost = self.final_costs(sid, sig, lids)
        cur = cost[int(np.searchsorted(fin, state))] if state in ro.finals else np.inf
        best = int(np.argmin(cost))
        return int(fin[best]) if cost[best] < cur - _REL_TIE * abs(cur) else state

    def slots_of(self, sid: int) -> np.ndarray:
        """Per candidate of spec ``sid``, the layout id of every slot of its block (operands, results)."""
        got = self._cand_slots.get(sid)
        if got is None:
            st = self.tab.ensure(sid)
            got = self._cand_slots[sid] = np.asarray([a + b for a, b in zip(st.in_rows, st.out_rows)],
                                                     dtype=np.intp).reshape(len(st.cands), -1)
        return got

    # -- the state -------------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Every op replicated (the state before round 0), fixed ops at their strategy, leaves marked; the order:
        heaviest first (fixed ops, then by the replicated cost, then program order)."""
        tab, sl, flat, ops, n = self.tab, self.sl, self.flat, self.graph.ops, self.n
        sid_a, in_base, out_end = self.sid_a, self.in_base, self.out_end
        weight = np.zeros(len(tab.specs))
        rep = np.zeros(len(tab.specs), dtype=np.intp)
        rep_slots = np.zeros((len(tab.specs), int(np.diff(sl.base).max(initial=1))), dtype=np.intp)
        is_fixed = np.array([op.fixed is not None for op in ops], dtype=bool)
        # a spec no unfixed op has is only weighed (fixed ops are ordered by it); one with more strategies than
        # _ENUMERATED is not enumerated for that (a loop fixed whole for the search: millions of strategies)
        searched = set(np.asarray(sid_a)[~is_fixed].tolist()) if n else set()
        for sid in range(len(tab.specs)):
            spec = tab.specs[sid]
            if sid not in searched and (sum(not u for u in spec.unsplittable) + 1) ** self.n_axes > _ENUMERATED:
                continue
            tab.ensure(sid)
            weight[sid] = float(np.max(tab.own[sid]))   # type: ignore[arg-type]
            rep[sid] = r = self.rounds_of(sid).rep
            row = self.slots_of(sid)[r]
            rep_slots[sid, :len(row)] = row
        order_a = np.lexsort((np.arange(n), -weight[sid_a], ~is_fixed)) if n else np.zeros(0, dtype=np.intp)
        owner = sl.owner
        state_a = rep[sid_a]
        lay_a = rep_slots[sid_a[owner], np.arange(len(owner)) - sl.base[owner]]
        self.fixed_strategy: dict[int, Strategy] = {}
        for v in np.flatnonzero(is_fixed).tolist():
            f = self.fixed_strategy[v] = tuple(tuple(a) for a in ops[v].fixed)    # type: ignore[union-attr]
            spec = tab.specs[self.sids[v]]
            state_a[v] = 0
            lay_a[in_base[v]:out_end[v]] = [tab.lid(layout_of(m, f)) for m in spec.in_maps + spec.out_maps]
        # leaves: inputs used once (a weight of one op) follow their user, as MindSpore's merge
        # elimination folds them; their slot holds a marker until the end
        source = np.array([op.kind in SOURCE_KINDS for op in ops], dtype=bool)
        uses = np.bincount(flat.inputs, minlength=len(self.graph.tensors))
        user = np.full(len(self.graph.tensors), -1, dtype=np.intp)
        user[flat.inputs] = owner[sl.e_in]
        result = flat.outputs[np.minimum(starts(flat.n_out)[:-1], max(len(flat.outputs) - 1, 0))]  # one result
        leaf = source & ~is_fixed & (flat.n_out == 1)
        leaf &= (uses[result] == 1)
        leaf &= ~is_fixed[np.where(leaf, user[result], 0)]
        self.leaves = np.flatnonzero(leaf).tolist()
        lay_a[sl.base[:-1][leaf] + flat.n_in[leaf]] = -sid_a[leaf] - 1
        self.lay: list[int] = lay_a.tolist()
        self.state: list[int] = state_a.tolist()
        self.movable = order_a[~(is_fixed | leaf)[order_a]].tolist()
        rank_a = np.empty(n, dtype=np.intp)
        rank_a[order_a] = np.arange(n)
        self.rank = rank_a.tolist()

    def _set(self, v: int, c: int) -> None:
        """Op ``v`` takes candidate ``c``: its state and the layouts of its block."""
        st = self.tab.structs[self.sids[v]]
        self.state[v] = c
        self.lay[self.in_base[v]:self.in_end[v]] = st.in_rows[c]      # type: ignore[union-attr]
        self.lay[self.out_base[v]:self.out_end[v]] = st.out_rows[c]   # type: ignore[union-attr]

    # -- sweeps ----------------------------------------------------------------------------------------------
    def _entries(self, vs: Iterable[int]) -> list[tuple]:
        return [(v, self.sids[v], self.sig_of[v], self.refs[v], self.in_base[v], self.in_end[v], self.out_base[v],
                 self.out_end[v]) for v in vs]

    def _one_by_one(self, entries: list[tuple], memo: dict[tuple, int],
                    choose: Callable[[int, int, int, tuple], int]) -> int:
        """Give each op of ``entries``, in order, its choice against its neighbours' current
        layouts; memoised on (spec, signature, state, neighbour layouts). How many ops moved."""
        moved = 0
        mget = memo.get
        state, lay, structs = self.state, self.lay, self.tab.structs
        get = lay.__getitem__
        for v, sid, sig, rf, ib, ie, ob, oe in entries:
            s0 = state[v]
            key = (sid, sig, s0, *map(get, rf))
            c = mget(key)
            if c is None:
                c = memo[key] = choose(sid, sig, s0, key[3:])
            if c != s0:
                moved += 1
                state[v] = c
                st = structs[sid]
                lay[ib:ie] = st.in_rows[c]    # type: ignore[union-attr]
                lay[ob:oe] = st.out_rows[c]   # type: ignore[union-attr]
        return moved

    def _sweep(self, levels: LevelBatch | None, work: list[tuple], memo: dict[tuple, int], rnd: int | None) -> int:
        """Round ``rnd`` (None: a refinement sweep): the large levels at once, then the rest (``work``) op by
        op. How many ops moved."""
        def choose(sid: int, sig: int, s0: int, lids: tuple) -> int:
            return self.refine_one(sid, sig, s0, lids) if rnd is None else self.decide(sid, sig, rnd, s0, lids)

        if levels is None:
            return self._one_by_one(work, memo, choose)
        st_np, lay_np = np.asarray(self.state, dtype=np.intp), np.asarray(self.lay, dtype=np.intp)
        moved = levels.sweep(rnd, st_np, lay_np)
        self.lay[:] = lay_np.tolist()
        self.state[:] = st_np.tolist()
        return moved + (self._one_by_one(work, memo, choose) if work else 0)

    def run(self, follow: bool, refine: int, polish: int | str, block_size: int) -> tuple[list[Strategy], list[str]]:
        """The rounds, the refinement sweeps, the block polish, the leaves' best responses and the ties; -> (a
        strategy per op id, notes)."""
        graph, tab, sids, movable = self.graph, self.tab, self.sids, self.movable
        ops, tensors = graph.ops, graph.tensors
        levels = (_levels(movable, self.sl, sids, tab, self.rounds_of, self.side, self.slots_of, self.n_axes)
                  if len(movable) >= LEVEL_MIN_OPS else None)
        work = self._entries(movable if levels is None else (movable[i] for i in levels.tail.tolist()))
        followers = 0
        with Progress(f"recursive_programming: {self.n} ops", self.n * self.n_axes) as bar:
            for r in range(self.n_axes):
                self._sweep(levels, work, {}, r)    # a memo per round: (spec, signature, state, *layouts) -> cut
                bar.advance(self.n)
            memo: dict[tuple, int] = {}
            for _sweep in range(refine):
                if not self._sweep(levels, work, memo, None):
                    break
            if polish == "auto":
                polish = 2 if len(movable) <= POLISH_AUTO_OPS else 0
            if polish:
                view = _View(ops, tensors, sids, self.sig_of, self.sigs, self.refs, self.in_base, self.in_end,
                             self.out_base, self.out_end, self.lay, self.state, tab, self.rounds_of,
                             self.final_costs, movable)
                view.sweeps(int(polish), block_size, self.rank, self.sl.e_src, self.sl.e_in)
            for u in self.leaves:                  # each leaf's best response to its user's final layout
                (c,) = tensors[ops[u].outputs[0]].consumers
                want = self.lay[self.in_base[c] + ops[c].inputs.index(ops[u].outputs[0])]
                fin = self.rounds_of(sids[u]).final_array
                cost = tab.own[sids[u]][fin] + tab.vector(sids[u], 1, 0, want)[fin]   # type: ignore[index]
                k = self.state[u] = int(fin[int(np.argmin(cost))])
                self.lay[self.out_base[u]] = tab.structs[sids[u]].out_rows[k][0]   # type: ignore[union-attr]
            if follow:
                followers = _follow(ops, movable, sids, tab, self.refs, self.lay, self.in_base, self.out_base,
                                    self.state, self.rounds_of)
        fixed = self.fixed_strategy
        chosen: list[Strategy] = [fixed[v] if v in fixed else tab.structs[sids[v]].cands[self.state[v]]  # type: ignore[union-attr]
                                  for v in range(self.n)]
        for op in (o for o in ops if o.follow_operand is not None):   # the tied op takes its operand's layout
            s = tied_strategy(graph, op, chosen)
            cands = tab.structs[sids[op.id]].cands      # type: ignore[union-attr]
            if s is None or s == chosen[op.id] or op.id in fixed or s not in cands:
                continue
            chosen[op.id] = s
            self._set(op.id, cands.index(s))
        notes = []
        if followers:
            notes.append(f"elementwise_op_strategy_follow: {followers} elementwise op(s) take their consumer's layout")
        return chosen, notes

    def index(self) -> GraphIndex:
        """The graph's :class:`~searchers.graph_index.GraphIndex`, from the tables at hand (the baseline check)."""
        return GraphIndex(self.graph, flat=self.flat, spec_keys=self.keys, slots=self.sl)


def _levels(movable: list[int], sl: Slots, sids: list[int], tab: Tables, rounds_of: Callable[[int], _Rounds],
            side: Callable[[int, int, int, int], np.ndarray], slots_of: Callable[[int], np.ndarray],
            n_axes: int) -> LevelBatch | None:
    """The movable ops as a :class:`~searchers.rp_levels.LevelBatch`; None where there is no
    round, no level is large enough, or the side-vector index would not fit."""
    widest = max(len(spec.in_maps) + len(spec.out_maps) for spec in tab.specs)
    if not n_axes or not LevelBatch.fits(len(tab.specs), widest, len(tab.layouts)):
        return None
    lb = LevelBatch(np.asarray(movable, dtype=np.intp), np.asarray(sids, dtype=np.intp), sl,
                    cast(list[np.ndarray], tab.own), [len(spec.in_maps) for spec in tab.specs], slots_of,
                    lambda sid: rounds_of(sid).kids, lambda sid: rounds_of(sid).final_array, side,
                    [spec.in_bytes + spec.out_bytes for spec in tab.specs], tab.layouts, tab.mesh, tab.params,
                    n_axes, LEVEL_MIN_OPS)
    return lb if lb.n_levels else None


def _follow(ops: list[Op], movable: list[int], sids: list[int], tab: Tables, refs: list[list[int]], lay: list[int],
            in_base: list[int], out_base: list[int], state: list[int], rounds_of: Callable[[int], _Rounds]) -> int:
    """Give every elementwise op whose result has one consuming op the final strategy whose result
    layout is the one that consumer wants (consumers first, so chains follow through). Returns how
    many ops follow (those already there included, as the other searchers count them)."""
    n = 0
    for v in sorted(movable, reverse=True):
        op = ops[v]
        if op.is_source or len(op.outputs) != 1 or not op.inputs:
            continue
        od = op.out_dims[0]
        if set(od) != set(op.dims) or any(d != od for d in op.in_dims):
            continue
        slots = refs[v][len(op.inputs):]                 # the consumers' operand slots
        users = {_owner(in_base, s) for s in slots}
        if len(users) != 1:
            continue
        want = lay[slots[0]]
        s = tab.ensure(sids[v])
        ro = rounds_of(sids[v])
        hit = [i for i in sorted(ro.finals) if s.out_rows[i][0] == want]
        if not hit:
            continue
        n += 1
        if hit[0] != state[v]:
            c = state[v] = hit[0]
            lay[in_base[v]:in_base[v] + len(op.inputs)] = s.in_rows[c]
            lay[out_base[v]] = s.out_rows[c][0]
    return n


def _owner(in_base: list[int], slot: int) -> int:
    """The op whose operand slot ``slot`` is (``in_base`` is ascending)."""
    import bisect
    return bisect.bisect_right(in_base, slot) - 1


class _View:
    """recursive_programming's state as a :class:`~searchers.block_polish.BlockView` (choices: an
    op's final strategies, ``_Rounds.final_array``)."""

    def __init__(self, ops: list[Op], tensors: list[Tensor], sids: list[int], sig_of: list[int], sigs: list[tuple],
                 refs: list[list[int]], in_base: list[int], in_end: list[int], out_base: list[int], out_end: list[int],
                 lay: list[int], state: list[int], tab: Tables, rounds_of: Callable[[int], _Rounds],
                 final_costs: Callable[[int, int, Iterable[int | None]], np.ndarray], movable: list[int]) -> None:
        self.ops, self.tensors, self.sids, self.sig_of, self.sigs, self.refs = ops, tensors, sids, sig_of, sigs, refs
        self.in_base, self.in_end, self.out_base, self.out_end = in_base, in_end, out_base, out_end
        self.lay, self.state, self.tab, self.rounds_of, self.final_costs = lay, state, tab, rounds_of, final_costs
        self.can_move = [False] * len(ops)
        for v in movable:
            self.can_move[v] = True
        self.owner = [[_owner(out_base, x) if k < len(op.inputs) else _owner(in_base, x) for k, x in enumerate(refs[op.id])]
                      for op in ops]
        self.mats: dict[tuple, np.ndarray] = {}
        self.moved: set[int] = set()          # ops moved in the current sweep

    def neighbours(self, v: int) -> list[int]:
        return self.owner[v]

    def movable(self, v: int) -> bool:
        return self.can_move[v]

    def unary(self, v: int, inside: set[int]) -> np.ndarray:
        lay = self.lay
        return self.final_costs(self.sids[v], self.sig_of[v],
                                (None if w in inside else lay[slot] for slot, w in zip(self.refs[v], self.owner[v])))

    def _flow(self, p: int, c: int) -> np.ndarray | None:
        """Redistribution from producer ``p`` (rows: its finals) to consumer ``c`` (columns)."""
        ks = tuple(k for k, t in enumerate(self.ops[c].inputs) if self.tensors[t].producer == p)
        if not ks:
            return None
        sp, sc, tab = self.sids[p], self.sids[c], self.tab
        key = (sp, sc, self.sig_of[p], ks)
        M = self.mats.get(key)
        if M is None:
            fp, fc = self.rounds_of(sp).final_array, self.rounds_of(sc).final_array
            M = np.zeros((len(fp), len(fc)))
            for k in ks:
                j = self.ops[p].outputs.index(self.ops[c].inputs[k])
                src = tuple(tab.layouts[tab.ensure(sp).out_rows[i][j]] for i in fp)
                dst = tuple(tab.layouts[tab.ensure(sc).in_rows[i][k]] for i in fc)
                M = M + layout_cost_matrix(src, dst, tab.specs[sc].in_bytes[k], tab.mesh, tab.params)
            self.mats[key] = M
        return M

    def pair(self, a: int, b: int) -> np.ndarray:
        down, up = self._flow(a, b), self._flow(b, a)
        if down is None:
            return up.T                     # type: ignore[union-attr]
        return down if up is None else down + up.T

    def block_key(self, nodes: list[tuple[int, int]]) -> tuple:
        pos = {v: i for i, (v, _) in enumerate(nodes)}
        lay = self.lay
        return tuple((self.sids[v], self.sig_of[v], self.state[v], pos.get(par, -1),
                      tuple((pos[w],) if w in pos else lay[x] for x, w in zip(self.refs[v], self.owner[v])))
                     for v, par in nodes)

    def current(self, v: int) -> int | None:
        ro = self.rounds_of(self.sids[v])
        s = self.state[v]
        return int(np.searchsorted(ro.final_array, s)) if s in ro.finals else None

    def choose(self, v: int, i: int) -> None:
        sid = self.sids[v]
        k = self.state[v] = int(self.rounds_of(sid).final_array[i])
        st = self.tab.structs[sid]
        self.lay[self.in_base[v]:self.in_end[v]] = st.in_rows[k]      # type: ignore[union-attr]
        self.lay[self.out_base[v]:self.out_end[v]] = st.out_rows[k]   # type: ignore[union-attr]
        self.moved.add(v)

    def sweeps(self, n: int, block_size: int, rank: list[int], e_src: np.ndarray, e_in: np.ndarray) -> None:
        """Up to ``n`` sweeps over the consumers of edges that redistribute, heaviest first; after
        the first, only those next to an op that moved in the sweep before."""
        cons = np.repeat(np.arange(len(self.ops)), [len(op.inputs) for op in self.ops])
        src, dst = np.asarray(e_src, dtype=np.intp), np.asarray(e_in, dtype=np.intp)
        near: set[int] | None = None
        memo: dict = {}
        for _ in range(n):
            la = np.asarray(self.lay)
            hit = cons[(la[src] != la[dst]) & (la[src] >= 0)]    # a leaf's slot holds a negative marker
            seeds = sorted({v for v in hit.tolist() if near is None or v in near}, key=rank.__getitem__)
            self.moved = set()
            if not polish_blocks(self, seeds, block_size, memo):
                break
            near = {u for v in self.moved for u in self.owner[v]} | self.moved
