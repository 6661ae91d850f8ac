"""recursive_programming's rounds and refinement sweep, many ops at a time (numpy).

In a round every op, heaviest first, takes the cut that is cheapest against its neighbours'
current layouts: an op reads the new layouts of its heavier neighbours and the old ones of its
lighter neighbours. So an op depends only on its heavier neighbours, and the ops fall into
*levels*: level 0 has no heavier movable neighbour, level ``k`` has one in level ``k - 1`` and
none deeper. Two neighbours are never in one level, so a whole level can be decided at once,
with exactly the arithmetic of the op-by-op loop (same sums in the same order, same ties),
and the result is identical to it. This class does that for the leading levels while they
are large (a random DAG of 100k ops has about 15 levels; a stack of identical layers ordered
by program order has thousands of tiny ones); the remaining *tail* (every op at or below the
first small level, a set closed under lighter neighbours) is left to the op-by-op loop, in
weight order, after the levels.

>>> import numpy as np
>>> levels_of(np.array([0, 1, 0]), np.array([1, 2, 2]), 3, min_size=1)   # edges 0->1, 1->2, 0->2
(array([0, 1, 2]), 3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .cost import CostParams
from .cost_vectors import redistribution_affine
from .graph import DeviceMesh, TensorLayout
from .rows import distinct_rows
from .slots import Slots

_REL_TIE = 1e-9
_NO = -1
_MAX_INDEX = 1 << 24        # entries of the side-vector index (int32): 64 MiB at most


def levels_of(src: np.ndarray, dst: np.ndarray, n: int, min_size: int, most: int = 64) -> tuple[np.ndarray, int]:
    """Level of each of ``n`` nodes on the edges ``src[e] -> dst[e]`` (``src[e] < dst[e]``): the
    length of the longest path ending there, and the number of leading levels (``most`` at most)
    that hold at least ``min_size`` nodes each. Levels past those are not computed exactly (only
    known to be at least that number), so nodes at or past it form the tail."""
    lvl = np.zeros(n, dtype=np.int64)
    order = np.argsort(dst, kind="stable")
    s, d = src[order], dst[order]
    heads = np.flatnonzero(np.r_[True, d[1:] != d[:-1]]) if len(d) else np.zeros(0, dtype=np.intp)
    targets = d[heads]
    t = 0
    while True:
        # after t + 1 relaxations every level below t + 1 is exact (longest paths truncated at t + 1)
        new = np.zeros(n, dtype=np.int64)
        if len(d):
            new[targets] = np.maximum.reduceat(lvl[s], heads) + 1
        changed = bool((new != lvl).any())
        lvl = new
        if int((lvl == t).sum()) < min_size or t == most:
            return lvl, t
        t += 1
        if not changed:
            return lvl, t


class LevelBatch:
    """The movable ops of a recursive_programming search as flat arrays, decided level by level.

    ``ops``: the movable ops in weight order; ``sids``: every op's spec id; ``sl``: the graph's
    :class:`~searchers.slots.Slots` (each op's refs, the slots its cost reads); per spec:
    ``own`` its cost per candidate, ``n_in`` its operand count, ``cand_slots(sid)`` the layout id
    of every slot of its block per candidate, ``kids(sid)`` its ``{(round, state): cuts}``,
    ``finals(sid)`` its final candidates, ``slot_bytes`` the bytes of each slot of its block;
    ``side(sid, out, idx, lid)``: the searcher's side vector, used for folded leaves (a negative
    ``lid``); every other side vector is computed here from ``layouts``, ``mesh`` and
    ``params`` with the same floats."""

    def __init__(self, ops: np.ndarray, sids: np.ndarray, sl: Slots, own: Sequence[np.ndarray], n_in: Sequence[int],
                 cand_slots: Callable[[int], np.ndarray], kids: Callable[[int], dict], finals: Callable[[int], np.ndarray],
                 side: Callable[[int, int, int, int], np.ndarray], slot_bytes: Sequence[tuple[int, ...]],
                 layouts: Sequence[TensorLayout], mesh: DeviceMesh, params: CostParams, n_axes: int,
                 min_size: int) -> None:
        m = len(ops)
        self.ops, self.sid = ops, sids[ops]
        self.off = sl.ref_ptr[ops]
        self.deg = sl.ref_ptr[ops + 1] - self.off
        self.ref_slot, self.base = sl.ref_slot, sl.base[ops]
        # dependencies: a ref to a heavier movable op (earlier in ``ops``)
        where_op = np.full(len(sl.ref_ptr) - 1, _NO, dtype=np.intp)
        where_op[ops] = np.arange(m)
        ref_owner = np.repeat(np.arange(len(where_op)), np.diff(sl.ref_ptr))
        me, nb = where_op[ref_owner], where_op[sl.owner[sl.ref_slot]]
        dep = (me >= 0) & (nb >= 0) & (nb < me)
        self.level, self.n_levels = levels_of(nb[dep], me[dep], m, min_size)
        self.groups = [np.flatnonzero(self.level == k) for k in range(self.n_levels)]
        self.tail = np.flatnonzero(self.level >= self.n_levels)
        self.used = np.unique(self.sid)
        self._tables(own, cand_slots, kids, finals, n_axes)
        # side vectors, one table row per (spec, position, neighbour layout); a folded leaf's
        # marker -usid - 1 is shifted into range by ``len(own)``
        # positions: as many as the widest block (a result no op reads has a slot but no ref)
        self.P = max(int(sl.ref_pos.max(initial=0)) + 1, max((len(slot_bytes[k]) for k in self.used.tolist()), default=0))
        self.L = len(layouts)
        self.W = self.L + len(own)
        self.shift = len(own)
        local = np.zeros(len(own), dtype=np.intp)
        local[self.used] = np.arange(len(self.used))
        self.ref_code = (local[sids[ref_owner]] * self.P + sl.ref_pos) * self.W + self.shift
        self.row_of = np.full(len(self.used) * self.P * self.W, _NO, dtype=np.int32)
        self.vec = np.zeros((64, self.C + 1))
        self.n_rows = 0
        self.n_in, self.side = n_in, side
        self.n_in_a = np.asarray(n_in, dtype=np.intp)
        self.n_cands = np.array([0 if o is None else len(o) for o in own], dtype=np.intp)    # None: a spec only fixed ops have
        self.nbytes = np.zeros((len(own), self.P), dtype=float)
        for sid in self.used.tolist():
            b = slot_bytes[sid]
            self.nbytes[sid, :len(b)] = b
        self.layouts, self.mesh, self.params = layouts, mesh, params
        self.affine: dict[int, tuple[float, float]] = {}

    @staticmethod
    def fits(n_specs: int, positions: int, n_layouts: int) -> bool:
        """Whether the side-vector index of a search this large fits in memory (else: op by op)."""
        return n_specs * positions * (n_layouts + n_specs) <= _MAX_INDEX

    def _tables(self, own: Sequence[np.ndarray], cand_slots: Callable[[int], np.ndarray], kids: Callable[[int], dict],
                finals: Callable[[int], np.ndarray], n_axes: int) -> None:
        """Padded per-spec tables; candidate index ``C`` (one past the widest) is the padding."""
        used = self.used.tolist()
        C = max(len(own[s]) for s in used)
        P = max(cand_slots(s).shape[1] for s in used)
        ns = len(own)
        self.own = np.full((ns, C + 1), np.inf)
        self.slots = np.zeros((ns, C + 1, max(P, 1)), dtype=np.intp)
        self.n_slots = np.zeros(ns, dtype=np.intp)
        rid: dict[int, int] = {}
        self.rid = np.zeros(ns, dtype=np.intp)
        tables: list[tuple[dict, np.ndarray]] = []
        for s in used:
            o = own[s]
            self.own[s, :len(o)] = o
            cs = cand_slots(s)
            self.slots[s, :cs.shape[0], :cs.shape[1]] = cs
            self.n_slots[s] = cs.shape[1]
            k = kids(s)
            r = rid.get(id(k))
            if r is None:
                r = rid[id(k)] = len(tables)
                tables.append((k, finals(s)))
            self.rid[s] = r
        K = max((len(a) for k, _ in tables for a in k.values()), default=1)
        F = max(len(f) for _, f in tables)
        self.kid = np.full((len(tables), n_axes, C + 1, K), C, dtype=np.intp)
        self.fin = np.full((len(tables), F), C, dtype=np.intp)
        self.is_fin = np.zeros((len(tables), C + 1), dtype=bool)
        for r, (k, f) in enumerate(tables):
            for (rnd, state), a in k.items():
                self.kid[r, rnd, state, :len(a)] = a
            self.fin[r, :len(f)] = f
            self.is_fin[r, f] = True
        self.C = C

    # -- one level -----------------------------------------------------------------------------
    def _rows(self, ref: np.ndarray, lay: np.ndarray) -> np.ndarray:
        """The side-vector table row of each ref at the current layouts (new rows computed)."""
        code = self.ref_code[ref] + lay[self.ref_slot[ref]]
        row = self.row_of[code]
        new = row < 0
        if new.any():
            fresh = np.unique(code[new])
            need = self.n_rows + len(fresh)
            if need > len(self.vec):
                grown = np.zeros((max(need, 2 * len(self.vec)), self.C + 1))
                grown[:self.n_rows] = self.vec[:self.n_rows]
                self.vec = grown
            self.row_of[fresh] = np.arange(self.n_rows, need)
            self._fill(fresh, self.n_rows)
            self.n_rows = need
            row = self.row_of[code]
        return row

    def _fill(self, codes: np.ndarray, at: int) -> None:
        """Table rows ``at, at + 1, ...`` for side-vector codes ``codes``: the redistribution
        ``a + b * nbytes`` between the neighbour's layout and each candidate's, in numpy (the
        searcher's own vectors hold the same floats); a folded leaf's from the searcher."""
        rest, lid = np.divmod(codes, self.W)
        loc, pos = np.divmod(rest, self.P)
        sid = self.used[loc]
        lid = lid - self.shift
        rows = np.arange(at, at + len(codes))
        for i in np.flatnonzero(lid < 0).tolist():     # folded leaves: a few distinct vectors
            s, p = int(sid[i]), int(pos[i])
            v = self.side(s, 0, p, int(lid[i])) if p < self.n_in[s] else self.side(s, 1, p - self.n_in[s], int(lid[i]))
            self.vec[rows[i], :len(v)] = v
        k = np.flatnonzero(lid >= 0)
        if not len(k):
            return
        sid, pos, lid, rows = sid[k], pos[k], lid[k][:, None], rows[k]
        mine = self.slots[sid, :, pos]                                  # (k, C + 1) candidate layouts
        live = np.arange(self.C + 1)[None, :] < self.n_cands[sid][:, None]
        result = (pos >= self.n_in_a[sid])[:, None]
        pair = np.where(result, mine * self.L + lid, lid * self.L + mine)[live]
        uniq, inv = np.unique(pair, return_inverse=True)
        ab = np.array([self._affine(c) for c in uniq.tolist()], dtype=float).reshape(-1, 2)
        nb = np.broadcast_to(self.nbytes[sid, pos][:, None], live.shape)[live]
        v = np.zeros(live.shape)
        v[live] = ab[inv.reshape(-1), 0] + ab[inv.reshape(-1), 1] * nb
        self.vec[rows] = v

    def _affine(self, pair: int) -> tuple[float, float]:
        got = self.affine.get(pair)
        if got is None:
            src, dst = divmod(pair, self.L)
            got = self.affine[pair] = redistribution_affine(self.layouts[src], self.layouts[dst], self.mesh, self.params)
        return got

    def _distinct(self, rows: np.ndarray, state: np.ndarray, lay: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Ops ``rows`` as distinct problems: ops of one spec and state whose refs read the same
        side vectors decide alike (the op-by-op loop's memo). Returns the first op of each
        problem (an index into ``rows``), each op's problem, and the problems' states and
        side-vector rows (``-1``: no ref there)."""
        deg, off = self.deg[rows], self.off[rows]
        width = int(deg.max(initial=0))
        at = np.arange(width)[None, :]
        has = at < deg[:, None]
        R = np.full((len(rows), width), _NO, dtype=np.intp)
        R[has] = self._rows((off[:, None] + at)[has], lay)
        st = state[self.ops[rows]]
        first, inv = distinct_rows(np.concatenate([self.sid[rows][:, None], st[:, None], R], axis=1))
        return first, inv, st[first], R[first]

    def decide(self, level: int, rnd: int, state: np.ndarray, lay: np.ndarray) -> int:
        """Round ``rnd`` for every op of ``level`` (``state``, ``lay``: every op's / slot's, updated
        in place); the number of ops that moved."""
        rows = self.groups[level]
        first, inv, st, R = self._distinct(rows, state, lay)
        sid = self.sid[rows[first]]
        cand = self.kid[self.rid[sid], rnd, st]
        cost = self.own[sid[:, None], cand]
        for j in range(R.shape[1]):               # sides in ref order: the op-by-op loop's sums
            sel = np.flatnonzero(R[:, j] >= 0)
            cost[sel] += self.vec[R[sel, j][:, None], cand[sel]]
        lo = cost.min(axis=1)
        pick = np.argmax(cost <= (lo + _REL_TIE * np.abs(lo))[:, None], axis=1)
        new = np.where(cand[:, 0] < self.C, cand[np.arange(len(cand)), pick], st)   # no cut this round: stay
        return self.apply(rows, new[inv], state, lay)

    def refine(self, level: int, state: np.ndarray, lay: np.ndarray) -> int:
        """The refinement sweep for every op of ``level``; the number of ops that moved."""
        rows = self.groups[level]
        first, inv, st, R = self._distinct(rows, state, lay)
        sid = self.sid[rows[first]]
        full = self.own[sid]
        for j in range(R.shape[1]):
            sel = np.flatnonzero(R[:, j] >= 0)
            full[sel] += self.vec[R[sel, j]]
        r = self.rid[sid]
        cand = self.fin[r]
        idx = np.arange(len(cand))
        cost = full[idx[:, None], cand]
        at = np.argmax(cand == st[:, None], axis=1)
        cur = np.where(self.is_fin[r, st], cost[idx, at], np.inf)
        best = np.argmin(cost, axis=1)
        with np.errstate(invalid="ignore"):        # inf - inf: a state that is not final never moves (as op by op)
            move = cost[idx, best] < cur - _REL_TIE * np.abs(cur)
        return self.apply(rows, np.where(move, cand[idx, best], st)[inv], state, lay)

    def sweep(self, rnd: int | None, state: np.ndarray, lay: np.ndarray) -> int:
        """Round ``rnd`` (None: a refinement sweep) over every level; how many ops moved."""
        if rnd is None:
            return sum(self.refine(k, state, lay) for k in range(self.n_levels))
        return sum(self.decide(k, rnd, state, lay) for k in range(self.n_levels))

    def apply(self, rows: np.ndarray, new: np.ndarray, state: np.ndarray, lay: np.ndarray) -> int:
        """Set ops ``rows`` to candidates ``new``: their state and every slot of their block."""
        ops = self.ops[rows]
        ch = np.flatnonzero(new != state[ops])
        if not len(ch):
            return 0
        ops, new, rows = ops[ch], new[ch], rows[ch]
        state[ops] = new
        sid = self.sid[rows]
        block = self.slots[sid, new]                       # (changed, widest block)
        keep = np.arange(block.shape[1])[None, :] < self.n_slots[sid][:, None]
        at = self.base[rows][:, None] + np.arange(block.shape[1])[None, :]
        lay[at[keep]] = block[keep]
        return len(ch)
