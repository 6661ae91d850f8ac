"""A graph as a pairwise cost problem, the common input of dynamic_programming and ilp: the pairwise view of the
search's :class:`~searchers.tables.Tables`, the tables every searcher reads.

Every op is a *node* with a list of candidate strategies and a cost vector over them
(:func:`~searchers.cost_vectors.op_cost_vector`'s values); every pair of ops joined by at least one
edge is a *pair* with a matrix of redistribution costs between their candidates
(:func:`~searchers.cost_vectors.edge_cost_matrix`'s values; several edges between one pair — ``mul(x, x)``,
or two results of one producer — are summed: MindSpore's edge elimination). The total cost
of a choice of one candidate per node is the sum of the chosen unary entries and pair
entries, which equals :func:`~searchers.cost.graph_cost`'s total.

Every vector and matrix carries an integer *content key*: two arrays with one key are equal.
Keys of derived arrays are built from the keys of their inputs, so the ops of identical
layers produce identical keys and a searcher can memoise its expensive steps on them
(this is how repeated layers are recognised: by content, not by name).

Two exact shrinks are provided: :meth:`PairwiseProblem.absorb_single` folds every node with one
candidate (a user strategy, or an op that cannot be split) into its neighbours' vectors, and
:meth:`PairwiseProblem.follow_elementwise` ties an elementwise op to its only consumer
(``elementwise_op_strategy_follow``), and :meth:`PairwiseProblem.tie_operands` an op with a
``follow_operand`` to that operand's producer.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams, graph_cost
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4, 6))
>>> _ = g.add_op("exp", "exp", {"i": 4, "j": 6}, [x], [("i", "j")], [("i", "j")])
>>> p = PairwiseProblem.build(g, CostParams())
>>> [len(c) for c in p.cands], p.pair_count()
([3, 3], 1)
>>> choice = {0: 1, 1: 1}
>>> s = {v: p.cands[v][c] for v, c in choice.items()}
>>> bool(abs(p.total(choice) - graph_cost(g, s, CostParams()).total) < 1e-12)
True
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import numpy as np

from .cost import CostParams, scatter_edges, scatter_saving
from .cost_vectors import layout_cost_matrix
from .graph import Graph, Op, Strategy, TensorLayout, operand_layout, partial_axes, result_layout
from .graph_index import GraphIndex
from .spec import all_devices
from .tables import Tables


class Keys:
    """Interns hashable descriptions into small ints (content keys)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}
        self._t: dict[int, int] = {}

    def __call__(self, desc: tuple) -> int:
        k = self._ids.get(desc)
        if k is None:
            k = self._ids[desc] = len(self._ids)
        return k

    def of_value(self, a: np.ndarray) -> int:
        """The key of an array's value: its shape and two independent hashes of its bytes (96 bits)."""
        b = a.tobytes()          # C order, whatever the layout of a
        return self(("=", a.shape, hash(b), zlib.crc32(b)))

    def transposed(self, k: int) -> int:
        """Key of the transpose of the matrix with key ``k`` (``transposed(transposed(k)) == k``)."""
        t = self._t.get(k)
        if t is None:
            t = self(("T", k))
            self._t[k], self._t[t] = t, k
        return t


class PairwiseProblem:
    """Nodes (ops) with candidates and cost vectors, pairs with cost matrices (see module doc).

    ``adj[v]`` maps each neighbour of node ``v`` to the pair index; pair ``i`` joins
    ``lo[i] < hi[i]`` with matrix ``mat[i]`` of shape ``(len(cands[lo]), len(cands[hi]))``.
    Removed pairs have ``mat[i] is None``; removed nodes ``alive[v] is False``. Arrays are
    shared between nodes and pairs with equal keys: never modify one in place.
    """

    def __init__(self, graph: Graph, params: CostParams) -> None:
        self.graph, self.params = graph, params
        self.keys = Keys()
        self.cands: list[tuple[Strategy, ...]] = []
        self.unary: list[np.ndarray] = []
        self.ukey: list[int] = []
        self.alive: list[bool] = []
        self.adj: list[dict[int, int]] = []
        self.lo: list[int] = []
        self.hi: list[int] = []
        self.mat: list[np.ndarray | None] = []
        self.mkey: list[int] = []
        self.decided: dict[int, int] = {}        # node -> candidate index, for nodes removed with one choice
        self.follows: dict[int, tuple[int, np.ndarray]] = {}   # node -> (leader, candidate map)
        self.cells = 0                           # sum over live pairs of len(cands[lo]) * len(cands[hi])
        self.normalise = False                   # see normalised()
        self.index: GraphIndex | None = None      # the graph's index (build)

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def build(cls, graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
              max_candidates: int | None = None, index: GraphIndex | None = None,
              tables: Tables | None = None) -> PairwiseProblem:
        """The problem of ``graph``: candidates as :meth:`~searchers.tables.Tables.candidates` gives them (a fixed
        op has its one strategy), costs from the cost model. ``index``: the graph's
        :class:`~searchers.graph_index.GraphIndex` (op shapes and edges) and ``tables``: its
        :class:`~searchers.tables.Tables` (candidates, costs and layouts per op shape), the one graph index and
        the one set of tables every searcher reads; built here where not given (the index is kept as
        ``self.index``)."""
        self = cls(graph, params)
        ix = self.index = GraphIndex(graph) if index is None else index
        tab = Tables(graph, params, max_candidates) if tables is None else tables
        mesh, keys = graph.mesh, self.keys
        keys_of_shape, _ = ix.spec_keys
        sid_of = [tab.spec_id(k) for k in keys_of_shape]          # per op shape of the index, its tables' sid
        nodes: dict[tuple, _Node] = {}                             # (op shape, user strategy) -> its node data
        node_of: list[_Node] = []
        for op, si in zip(graph.ops, ix.spec_index):
            fixed = None if op.fixed is None else tuple(tuple(a) for a in op.fixed)
            nd = nodes.get((si, fixed))
            if nd is None:
                sid = sid_of[si]
                cands = (fixed,) if fixed is not None else tab.candidates(sid, all_devices(tab.specs[sid],
                                                                                          fully_use_devices))
                nd = nodes[si, fixed] = _Node(sid, cands, tab.unary(sid, cands), keys(("u", sid, cands)))
            node_of.append(nd)
            self.cands.append(nd.cands)
            self.unary.append(nd.unary)
            self.ukey.append(nd.ukey)
            self.alive.append(True)
            self.adj.append({})
        mat_memo: dict[int, np.ndarray] = {}
        for c, k, p, j, nbytes in ix.edges():          # consumer by consumer, operands in order
            src_id, src = node_of[p].layouts(tab, True, j)
            dst_id, dst = node_of[c].layouts(tab, False, k)
            mk = keys(("e", src_id, dst_id, nbytes))
            m = mat_memo.get(mk)
            if m is None:
                m = mat_memo[mk] = layout_cost_matrix(src, dst, nbytes, mesh, params)
            self.add_pair(p, c, m, mk)
        self._add_scatter_pairs(graph, params)
        return self

    def _add_scatter_pairs(self, graph: Graph, params: CostParams) -> None:
        """Each ``scatter`` op read by one operand: the change :func:`~searchers.cost.scatter_saving` makes to the
        pair's price where its reader's layout is its result layout with reduced axes appended (0 elsewhere), so
        the problem's total stays :func:`~searchers.cost.graph_cost`'s."""
        for p, (c, i) in scatter_edges(graph).items():
            prod, cons = graph.ops[p], graph.ops[c]
            partial = [(a, sp, set(axes), result_layout(prod, sp, 0))
                       for a, sp in enumerate(self.cands[p]) if (axes := partial_axes(prod, sp))]
            if not partial:
                continue
            wants: dict[TensorLayout, list[int]] = {}
            for b, sc in enumerate(self.cands[c]):
                wants.setdefault(operand_layout(cons, sc, i), []).append(b)
            m = np.zeros((len(self.cands[p]), len(self.cands[c])))
            for want, cols in wants.items():
                for a, sp, axes, have in partial:
                    if not _extends(have, want, axes):
                        continue                # not its layout with reduced axes appended: priced as an all-reduce
                    found = scatter_saving(prod, sp, want, graph, params, then_change=False)
                    if found is not None:
                        m[a, cols] = found[1].total
            if m.any():
                self.add_pair(p, c, m, self.keys(("scatter", p, c, i)))

    # -- editing -------------------------------------------------------------------------------
    def add_pair(self, a: int, b: int, m: np.ndarray, key: int) -> None:
        """Add cost matrix ``m`` (shape ``a`` x ``b``) between nodes ``a != b``, summed into an
        existing pair."""
        if a > b:
            a, b, m, key = b, a, m.T, self.keys.transposed(key)
        i = self.adj[a].get(b)
        if i is None:
            i = len(self.lo)
            self.lo.append(a)
            self.hi.append(b)
            self.mat.append(m)
            self.mkey.append(key)
            self.adj[a][b] = i
            self.adj[b][a] = i
            self.cells += m.size
        else:
            self.mat[i] = self.mat[i] + m
            self.mkey[i] = self.keys(("+", self.mkey[i], key))
        if self.normalise:
            self._normalise_pair(i)

    def _normalise_pair(self, i: int) -> None:
        m = self.mat[i]
        assert m is not None
        lo = m.min()
        if np.isfinite(lo) and lo != 0.0:
            m = self.mat[i] = m - lo
        self.mkey[i] = self.keys.of_value(m)

    def oriented(self, i: int, v: int) -> tuple[np.ndarray, int]:
        """Matrix of pair ``i`` with node ``v``'s candidates on the rows, and its key."""
        m = self.mat[i]
        assert m is not None
        if v == self.lo[i]:
            return m, self.mkey[i]
        return m.T, self.keys.transposed(self.mkey[i])

    def add_unary(self, v: int, vec: np.ndarray, key: int) -> None:
        u = self.unary[v] + vec
        if self.normalise:
            lo = u.min()
            if np.isfinite(lo) and lo != 0.0:
                u = u - lo
            self.unary[v], self.ukey[v] = u, self.keys.of_value(u)
        else:
            self.unary[v], self.ukey[v] = u, self.keys(("+", self.ukey[v], key))

    def remove_pair(self, i: int) -> None:
        a, b = self.lo[i], self.hi[i]
        del self.adj[a][b], self.adj[b][a]
        self.cells -= self.mat[i].size  # type: ignore[union-attr]
        self.mat[i] = None

    def fix(self, v: int, choice: int) -> None:
        """Decide node ``v``: its pairs become vectors on its neighbours; ``v`` is removed."""
        for u, i in list(self.adj[v].items()):
            m, k = self.oriented(i, v)
            self.add_unary(u, m[choice], self.keys(("row", k, choice)))
            self.remove_pair(i)
        self.alive[v] = False
        self.decided[v] = choice

    # -- exact shrinks -------------------------------------------------------------------------
    @classmethod
    def prepared(cls, graph: Graph, params: CostParams, notes: list[str], *, fully_use_devices: bool = False,
                 max_candidates: int | None = None, elementwise_op_strategy_follow: bool = False,
                 index: GraphIndex | None = None) -> PairwiseProblem:
        """:meth:`build`, then ops with a ``follow_operand`` are tied to that operand's producer,
        elementwise ops follow their consumer (if asked, with a note) and single-candidate ops are
        absorbed: the common start of the exact searchers."""
        prob = cls.build(graph, params, fully_use_devices=fully_use_devices, max_candidates=max_candidates,
                         index=index)
        prob.tie_operands()
        if elementwise_op_strategy_follow:
            k = prob.follow_elementwise()
            if k:
                notes.append(f"elementwise_op_strategy_follow: {k} elementwise op(s) share their consumer's strategy")
        prob.absorb_single()
        return prob

    def absorb_single(self) -> int:
        """Fix every live node with exactly one candidate; returns how many."""
        n = 0
        for v, c in enumerate(self.cands):
            if self.alive[v] and len(c) == 1:
                self.fix(v, 0)
                n += 1
        return n

    def follow_elementwise(self) -> int:
        """``elementwise_op_strategy_follow``: an elementwise op (one result; every operand and the
        result over the same loop dims) whose result has one consuming op takes the strategy that
        gives its result the layout that consumer wants: it is merged into the consumer, and the
        consumer's candidates whose operand layout the op cannot produce get an infinite cost.
        Returns how many ops follow. Exact under the constraint."""
        graph, n = self.graph, 0
        for op in reversed(graph.ops):
            v = op.id
            if not self.alive[v] or not _elementwise(op) or len(self.cands[v]) < 2:
                continue
            users = set(graph.tensors[op.outputs[0]].consumers)
            if len(users) != 1:
                continue
            (c,) = users
            cons = graph.ops[c]
            k = cons.inputs.index(op.outputs[0])
            have = {result_layout(op, s, 0): i for i, s in enumerate(self.cands[v])}
            fmap = np.array([have.get(operand_layout(cons, s, k), -1) for s in self.cands[c]], dtype=np.intp)
            while c in self.follows:              # the consumer follows in turn: compose the maps
                c, cmap = self.follows[c]
                fmap = np.where(cmap >= 0, fmap[np.maximum(cmap, 0)], -1)
            if not self.alive[c]:
                continue
            self._merge(v, c, fmap)
            n += 1
        return n

    def tie_operands(self) -> int:
        """An op with ``follow_operand = k`` takes the strategy that gives operand ``k`` its producer's
        result layout: it is merged into the producer, whose candidates with a layout no candidate
        of the op can take get an infinite cost. Exact under the constraint. An op none of whose
        candidates fits any producer candidate is left free. Returns how many ops are tied."""
        graph, n = self.graph, 0
        for op in graph.ops:
            k, v = op.follow_operand, op.id
            if k is None or not self.alive[v]:
                continue
            tid = op.inputs[k]
            p = graph.tensors[tid].producer
            j = graph.ops[p].outputs.index(tid)
            have = {operand_layout(op, s, k): i for i, s in enumerate(self.cands[v])}
            fmap = np.array([have.get(result_layout(graph.ops[p], s, j), -1) for s in self.cands[p]], dtype=np.intp)
            c = p
            while c in self.follows:                 # the producer follows in turn: compose the maps
                c, cmap = self.follows[c]
                fmap = np.where(cmap >= 0, fmap[np.maximum(cmap, 0)], -1)
            if not self.alive[c] or not (fmap >= 0).any():
                continue
            self._merge(v, c, fmap)
            n += 1
        return n

    def _merge(self, v: int, c: int, fmap: np.ndarray) -> None:
        """Node ``v``'s choice becomes ``fmap[choice of c]`` (-1: that choice of ``c`` is forbidden)."""
        keys = self.keys
        fk = keys(("map", fmap.tobytes()))
        ok = fmap >= 0
        safe = np.where(ok, fmap, 0)
        bad = np.where(ok, 0.0, np.inf)
        self.add_unary(c, self.unary[v][safe] + bad, keys(("pull", self.ukey[v], fk)))
        for u, i in list(self.adj[v].items()):
            m, k = self.oriented(i, u)            # u x v
            self.remove_pair(i)
            if u != c:
                self.add_pair(u, c, m[:, safe], keys(("cols", k, fk)))
            else:                                  # u == c: the v -> c redistribution on the diagonal
                self.add_unary(c, m[np.arange(len(safe)), safe], keys(("diag", k, fk)))
        self.alive[v] = False
        self.follows[v] = (c, fmap)

    def copy(self) -> PairwiseProblem:
        """An independent copy (arrays and the key table are shared: they are never modified)."""
        new = PairwiseProblem.__new__(PairwiseProblem)
        new.graph, new.params, new.keys, new.index = self.graph, self.params, self.keys, self.index
        new.cands = self.cands
        for name in ("unary", "ukey", "alive", "lo", "hi", "mat", "mkey"):
            setattr(new, name, list(getattr(self, name)))
        new.adj = [dict(d) for d in self.adj]
        new.decided = dict(self.decided)
        new.follows = dict(self.follows)
        new.cells = self.cells
        new.normalise = self.normalise
        return new

    def normalised(self) -> PairwiseProblem:
        """A copy in which every vector and matrix changed from now on is shifted to a minimum of 0
        and keyed by its value. Shifts change every choice's total by the same constant, so the
        best choice is the same; value keys let results computed along different paths (the
        same layer reached after a different prefix) share one key."""
        new = self.copy()
        new.normalise = True
        return new

    # -- reading -------------------------------------------------------------------------------
    def live(self) -> list[int]:
        return [v for v, a in enumerate(self.alive) if a]

    def pairs(self) -> Iterable[int]:
        return (i for i, m in enumerate(self.mat) if m is not None)

    def pair_list(self, index: dict[int, int]) -> list[tuple[int, int, np.ndarray]]:
        """``(index[lo], index[hi], matrix)`` of every live pair (nodes renumbered by ``index``)."""
        out = []
        for i in self.pairs():
            m = self.mat[i]
            assert m is not None
            out.append((index[self.lo[i]], index[self.hi[i]], m))
        return out

    def pair_count(self) -> int:
        return sum(1 for _ in self.pairs())

    def expand(self, choice: dict[int, int]) -> dict[int, int]:
        """Complete a choice for the live nodes with the decided and following nodes."""
        out = dict(self.decided)
        out.update(choice)
        for v in sorted(self.follows, reverse=True):     # a leader comes later in program order
            c, fmap = self.follows[v]
            out[v] = int(fmap[out[c]])
        return out

    def strategies(self, choice: dict[int, int]) -> dict[int, Strategy]:
        return {v: self.cands[v][c] for v, c in sorted(choice.items())}

    def total(self, choice: dict[int, int]) -> float:
        """Cost of a choice for the live nodes under the current vectors and pairs."""
        t = 0.0
        for v, c in choice.items():
            if self.alive[v]:
                t += float(self.unary[v][c])
        for i in self.pairs():
            m = self.mat[i]
            assert m is not None
            t += float(m[choice[self.lo[i]], choice[self.hi[i]]])
        return t


class _Node:
    """What :meth:`PairwiseProblem.build` shares between the ops of one shape and user strategy: the tables' sid, the
    candidates, their cost and its content key, and the layout lists of its operands and results (made when an
    edge first asks)."""

    __slots__ = ("cands", "lists", "sid", "ukey", "unary")

    def __init__(self, sid: int, cands: tuple[Strategy, ...], unary: np.ndarray, ukey: int) -> None:
        self.sid, self.cands, self.unary, self.ukey = sid, cands, unary, ukey
        self.lists: dict[tuple[bool, int], tuple[int, tuple[TensorLayout, ...]]] = {}

    def layouts(self, tab: Tables, out: bool, idx: int) -> tuple[int, tuple[TensorLayout, ...]]:
        """(layout list id, layouts) of result (``out``) or operand ``idx`` under each candidate."""
        got = self.lists.get((out, idx))
        if got is None:
            spec = tab.specs[self.sid]
            got = self.lists[out, idx] = tab.layout_list(spec.out_maps[idx] if out else spec.in_maps[idx],
                                                         self.cands)
        return got


def _elementwise(op: Op) -> bool:
    if op.is_source or len(op.outputs) != 1 or not op.inputs:
        return False
    out = op.out_dims[0]
    return set(out) == set(op.dims) and all(d == out for d in op.in_dims)


def _extends(have: TensorLayout, want: TensorLayout, axes: set) -> bool:
    """Whether ``want`` is ``have`` with some of ``axes`` appended to its dims' stacks."""
    added = False
    for h, w in zip(have, want):
        if w[:len(h)] != h or any(a not in axes for a in w[len(h):]):
            return False
        added = added or len(w) > len(h)
    return added
