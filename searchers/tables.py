"""The search tables every searcher reads: per op shape its candidates, their cost and their layouts.

One :class:`Tables` per search, on top of the graph's :class:`~searchers.graph_index.GraphIndex` (the op shapes and
edges). ``sid`` numbers the distinct :class:`~searchers.spec.OpSpec` (structure + tensor sizes) in order of first
use; what depends on the structure alone (the candidate strategies, the layout of every operand and result under
each, the cost factors of :func:`~searchers.cost_vectors.candidate_tables`) is built once per structure and shared
by every op shape of it. Layouts are interned as small ints (layout ids), and a list of layout ids (one per
candidate) as a *layout list* id, so two op shapes whose candidates lay a tensor out alike share everything
priced on it.

What each searcher reads:

- sharding_propagation and recursive_programming: every split is a candidate (:meth:`Tables.ensure`; idle devices
  allowed), each with its own-cost vector (``own[sid]``) and its redistribution against one neighbour's layout
  (:meth:`Tables.vector`, from the memory-weight-free :func:`~searchers.cost_vectors.unweighted_affine`);
- recursive_programming's final strategies and the pairwise problem of dynamic_programming and ilp
  (:class:`~searchers.pairwise_problem.PairwiseProblem`): the candidates that use every device where ``fully_use_devices`` asks
  (:meth:`Tables.candidates`), their cost (:meth:`Tables.unary`) and the layouts of a tensor under them
  (:meth:`Tables.layout_list`), from which :func:`~searchers.cost_vectors.layout_cost_matrix` builds an edge's
  matrix.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> from searchers.spec import spec_key
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4, 6))
>>> _ = g.add_op("exp", "exp", {"i": 4, "j": 6}, [x], [("i", "j")], [("i", "j")])
>>> tab = Tables(g, CostParams(), None)
>>> sid = tab.spec_id(spec_key(g.ops[1], g))
>>> tab.ensure(sid).cands                          # replicated, j split, i split
(((), ()), ((), (0,)), ((0,), ()))
>>> tab.candidates(sid, True)                      # those that use both devices
(((), (0,)), ((0,), ()))
>>> [str(lay) for lay in tab.layout_list(tab.specs[sid].out_maps[0], tab.candidates(sid, True))[1]]
['((), (0,))', '((0,), ())']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .cost import CostParams
from .cost_vectors import candidate_tables, cost_vector, halo_fractions, spec_cost_vector, state_price, unweighted_affine
from .graph import Graph, Strategy, TensorLayout
from .spec import OpSpec, SpecKey, layout_of, spec_from_key
from .strategies import strategies_for


class Struct:
    """Size-free tables of one op structure: candidates, their layout ids, cost factors."""

    __slots__ = ("cands", "in_lids", "in_rows", "out_lids", "out_rows", "tables")

    def __init__(self, cands: tuple[Strategy, ...], in_lids: list, out_lids: list, tables: Any) -> None:
        self.cands, self.in_lids, self.out_lids, self.tables = cands, in_lids, out_lids, tables
        # per candidate: the layout id of each operand / result
        self.in_rows = list(zip(*[a[0].tolist() for a in in_lids])) if in_lids else [()] * len(cands)
        self.out_rows = list(zip(*[a[0].tolist() for a in out_lids])) if out_lids else [()] * len(cands)


class Tables:
    """Candidate tables, cost vectors and layout ids of one search (module doc).

    ``max_candidates`` caps every candidate list as :func:`~searchers.strategies.strategies_for` does."""

    def __init__(self, graph: Graph, params: CostParams, max_candidates: int | None):
        self.mesh, self.params, self.maxc = graph.mesh, params, max_candidates
        self.key_ids: dict[SpecKey, int] = {}
        self.specs: list[OpSpec] = []
        self.structs: list[Struct | None] = []      # per sid
        self.own: list[np.ndarray | None] = []      # per sid
        self.by_struct: dict[int, Struct] = {}
        self.struct_of: list[int] = []
        self.layout_ids: dict[TensorLayout, int] = {}
        self.layouts: list[TensorLayout] = []
        self.lid_lists: dict[bytes, tuple] = {}                 # candidate layout-id lists, interned
        self.lids_of: dict[tuple, tuple] = {}                   # (tensor map, candidates) -> its entry there
        self.affine: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}
        self.side_vec: dict[tuple, np.ndarray] = {}
        self._cands: dict[tuple[int, bool], tuple[Strategy, ...]] = {}
        self._list_layouts: dict[int, tuple[TensorLayout, ...]] = {}

    def spec_id(self, key: SpecKey) -> int:
        sid = self.key_ids.get(key)
        if sid is None:
            sid = self.key_ids[key] = len(self.specs)
            self.specs.append(spec_from_key(key))
            self.struct_of.append(key[0])
            self.structs.append(None)
            self.own.append(None)
        return sid

    def lid(self, layout: TensorLayout) -> int:
        i = self.layout_ids.get(layout)
        if i is None:
            i = self.layout_ids[layout] = len(self.layouts)
            self.layouts.append(layout)
        return i

    def ensure(self, sid: int) -> Struct:
        """The structure tables of ``sid`` (every split a candidate, idle devices allowed) and its own costs."""
        st = self.structs[sid]
        if st is not None:
            return st
        spec = self.specs[sid]
        st = self.by_struct.get(self.struct_of[sid])
        if st is None:
            cands = self.candidates(sid, False)
            in_lids = [self._lids(m, cands) for m in spec.in_maps]
            out_lids = [self._lids(m, cands) for m in spec.out_maps]
            tables = candidate_tables(spec.in_maps, spec.out_maps, spec.reduction, cands, self.mesh,
                                      halo_fractions(spec))
            st = self.by_struct[self.struct_of[sid]] = Struct(cands, in_lids, out_lids, tables)
        self.structs[sid] = st
        self.own[sid] = cost_vector(st.tables, spec.flops, spec.in_bytes, spec.out_bytes, self.params,
                                    spec.latency_share, state_price(spec, self.mesh, self.params))
        return st

    def candidates(self, sid: int, all_devices: bool) -> tuple[Strategy, ...]:
        """The candidate strategies of ``sid``: every split (``all_devices=False``), or those that use every
        device (:func:`~searchers.spec.all_devices` says which an op must), in enumeration order."""
        key = (self.struct_of[sid], all_devices)
        got = self._cands.get(key)
        if got is None:
            spec = self.specs[sid]
            got = self._cands[key] = strategies_for(spec.sizes, spec.unsplittable, self.mesh.shape, all_devices,
                                                    self.maxc, spec.apart, spec.nested)
        return got

    def unary(self, sid: int, cands: tuple[Strategy, ...]) -> np.ndarray:
        """The cost of ``sid`` under each of ``cands`` (:func:`~searchers.cost_vectors.spec_cost_vector`;
        read-only)."""
        return spec_cost_vector(self.specs[sid], cands, self.mesh, self.params)

    def layout_list(self, maps: tuple[int, ...], cands: Sequence[Strategy]) -> tuple[int, tuple[TensorLayout, ...]]:
        """(layout list id, layouts): the layout of a tensor with ``maps`` under each of ``cands``. Equal ids:
        equal layouts, whatever op shape asked."""
        _, _, _, list_id = got = self._lids(maps, cands)
        lays = self._list_layouts.get(list_id)
        if lays is None:
            lay = self.layouts
            lays = self._list_layouts[list_id] = tuple(lay[i] for i in got[0].tolist())
        return list_id, lays

    def _lids(self, maps: tuple[int, ...], cands: Sequence[Strategy]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(layout id per candidate, unique ids, inverse index, id of this layout list)."""
        memo = (maps, cands)                 # structures of equal sizes share their candidate tuple
        got = self.lids_of.get(memo)
        if got is not None:
            return got
        ids = np.array([self.lid(layout_of(maps, s)) for s in cands], dtype=np.intp)
        key = ids.tobytes()
        got = self.lid_lists.get(key)
        if got is None:
            uniq, inv = np.unique(ids, return_inverse=True)
            got = self.lid_lists[key] = (ids, uniq, inv.reshape(-1), len(self.lid_lists))
        self.lids_of[memo] = got
        return got

    def vector(self, sid: int, out: int, idx: int, other: int) -> np.ndarray:
        """Redistribution totals per candidate of ``sid`` against one decided side:
        ``out=0``: operand ``idx`` is converted from layout id ``other`` (its producer's);
        ``out=1``: result ``idx`` is converted to layout id ``other`` (a consumer's)."""
        key = (sid, out, idx, other)
        v = self.side_vec.get(key)
        if v is None:
            st, spec = self.structs[sid], self.specs[sid]
            assert st is not None                 # ensure(sid) ran before any vector of sid
            _, uniq, inv, list_id = st.out_lids[idx] if out else st.in_lids[idx]
            ab = self.affine.get((list_id, out, other))
            if ab is None:
                lay, o, mesh = self.layouts, self.layouts[other], self.mesh
                pairs = [unweighted_affine(lay[u], o, mesh) if out else unweighted_affine(o, lay[u], mesh)
                         for u in uniq]
                # beta * a, beta * b: redistribution_affine's products
                small = self.params.beta * np.asarray(pairs, dtype=float).reshape(len(uniq), 2)
                ab = self.affine[list_id, out, other] = (small[inv, 0], small[inv, 1])
            nbytes = spec.out_bytes[idx] if out else spec.in_bytes[idx]
            v = self.side_vec[key] = ab[0] + ab[1] * float(nbytes)
        return v
