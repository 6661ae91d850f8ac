"""Vectorised costs for searchers: an op's cost for every candidate, an edge's redistribution
cost for every pair of candidates.

Both are affine in tensor sizes: per candidate, an op's total is
``alpha*flops/devices/flops_per_s + beta*(n_results*latency + coef*bytes) + gamma*memory``,
and a redistribution's total is ``a + b * nbytes`` for a layout pair. The size-free parts are
tables memoised per op structure (:func:`candidate_tables`) and per layout pair
(:func:`redistribution_affine`), so graphs whose ops differ only in tensor sizes share them.
Results agree with :func:`~searchers.cost.spec_cost` and
:func:`~searchers.cost.redistribution_total` up to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .cost import CostParams, _reduction_groups, redistribution_steps
from .direct_reshard import depends_on_direct
from .graph import DeviceMesh, Graph, Op, Strategy, TensorLayout
from .spec import OpSpec, layout_of, map_dims, op_spec


@dataclass(frozen=True, eq=False)
class CandidateTables:
    """Size-free per-candidate factors of an op's cost (C candidates, n_in operands, n_out results)."""

    devices: np.ndarray      # (C,) devices used
    in_div: np.ndarray       # (C, n_in) 1 / split count of each operand
    out_div: np.ndarray      # (C, n_out) 1 / split count of each result
    ar_lat: np.ndarray       # (C,) latency of the all-reduces over the partial axes, one per split reduction dim
    ar_coef: np.ndarray      # (C,) their seconds per local result byte: sum of 2(k-1)/k / slowest bandwidth
    halo_lat: np.ndarray | None = None    # (C,) latency of the halo exchanges (cost._halo); None: no halo
    halo_coef: np.ndarray | None = None   # (C, n_in) their seconds per global operand byte


@lru_cache(maxsize=1 << 12)
def candidate_tables(in_maps: tuple[tuple[int, ...], ...], out_maps: tuple[tuple[int, ...], ...],
                     reduction: tuple[int, ...], candidates: tuple[Strategy, ...],
                     mesh: DeviceMesh, halo: tuple[float, ...] = ()) -> CandidateTables:
    """:class:`CandidateTables` of an op structure (memoised); ``halo``: per loop dim, halo rows / dim size."""
    shape, C = mesh.shape, len(candidates)
    dev = np.empty(C)
    in_div = np.empty((C, len(in_maps)))
    out_div = np.empty((C, len(out_maps)))
    lat = np.zeros(C)
    coef = np.zeros(C)
    for c, s in enumerate(candidates):
        counts = [_prod(shape[a] for a in axes) for axes in s]
        dev[c] = _prod(counts)
        for i, m in enumerate(in_maps):
            in_div[c, i] = 1.0 / _prod(counts[d] for e in m for d in map_dims(e))
        for j, m in enumerate(out_maps):
            out_div[c, j] = 1.0 / _prod(counts[d] for e in m for d in map_dims(e))
        for k, latency, bandwidth in _reduction_groups(reduction, s, mesh):
            lat[c] += latency
            coef[c] += 2.0 * (k - 1) / k / bandwidth
    for a in (dev, in_div, out_div, lat, coef):
        a.setflags(write=False)
    if not any(halo):
        return CandidateTables(dev, in_div, out_div, lat, coef)
    h_lat, h_coef = np.zeros(C), np.zeros((C, len(in_maps)))
    for c, s in enumerate(candidates):           # as searchers.cost._halo, per global operand byte
        for i, m in enumerate(in_maps):
            block = in_div[c, i]
            for d in m:
                if not isinstance(d, int) or d < 0 or not halo[d] or not s[d]:
                    continue
                b = block * halo[d] * _prod(shape[a] for a in s[d])
                h_lat[c] += 2 * max(mesh.latency[a] for a in s[d])
                h_coef[c, i] += b / min(mesh.bandwidth[a] for a in s[d])
                block += b
    return CandidateTables(dev, in_div, out_div, lat, coef, h_lat, h_coef)


def _prod(xs: Iterable[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def cost_vector(t: CandidateTables, flops: float, in_bytes: Sequence[int], out_bytes: Sequence[int],
                params: CostParams, latency_share: float = 1.0, state_price: float = 0.0) -> np.ndarray:
    """Weighted totals per candidate from :class:`CandidateTables` and the op's sizes (``latency_share``: the part
    of a latency the op's all-reduces pay, :func:`searchers.graph.mark_merged_reductions`; ``state_price``: per byte
    of the results stored per device, for a parameter source, :meth:`CostParams.state_price`)."""
    out_local = t.out_div @ np.asarray(out_bytes, dtype=float)
    memory = t.in_div @ np.asarray(in_bytes, dtype=float) + out_local
    comm = latency_share * len(out_bytes) * t.ar_lat + t.ar_coef * out_local
    comm = np.where(t.ar_coef > 0, comm, 0.0)
    if t.halo_lat is not None:
        comm = comm + t.halo_lat + t.halo_coef @ np.asarray(in_bytes, dtype=float)
    return (params.alpha * flops / params.flops_per_s) / t.devices + params.beta * comm \
        + (params.gamma / params.memory_unit) * memory + state_price * out_local


def state_price(spec: OpSpec, mesh: DeviceMesh, params: CostParams) -> float:
    """:meth:`CostParams.state_price` for a parameter source, else 0 (what :func:`cost_vector` takes)."""
    return params.state_price(mesh) if spec.stored else 0.0


@lru_cache(maxsize=1 << 14)
def spec_cost_vector(spec: OpSpec, candidates: tuple[Strategy, ...], mesh: DeviceMesh,
                     params: CostParams) -> np.ndarray:
    """Totals of :func:`~searchers.cost.spec_cost` for every candidate (memoised; read-only)."""
    t = candidate_tables(spec.in_maps, spec.out_maps, spec.reduction, candidates, mesh, halo_fractions(spec))
    v = cost_vector(t, spec.flops, spec.in_bytes, spec.out_bytes, params, spec.latency_share,
                    state_price(spec, mesh, params))
    v.setflags(write=False)
    return v


def halo_fractions(spec: OpSpec) -> tuple[float, ...]:
    """Per loop dim, halo rows / dim size (``()`` for an op without a halo): what :func:`candidate_tables` takes."""
    return tuple(h / n for h, n in zip(spec.halo, spec.sizes)) if spec.halo else ()


def op_cost_vector(op: Op, candidates: Sequence[Strategy], graph: Graph, params: CostParams) -> np.ndarray:
    """Totals of :func:`~searchers.cost.op_cost` for every candidate, as a float array.

    >>> from searchers.graph import DeviceMesh, Graph
    >>> g = Graph(DeviceMesh((2,)))
    >>> _ = g.source("x", (4,))
    >>> op_cost_vector(g.ops[0], [((),), ((0,),)], g, CostParams(gamma=1.0, memory_unit=1.0))
    array([16.,  8.])
    """
    return spec_cost_vector(op_spec(op, graph), tuple(tuple(tuple(a) for a in s) for s in candidates),
                            graph.mesh, params)


# -- redistribution ----------------------------------------------------------------------------
def redistribution_affine(src: TensorLayout, dst: TensorLayout, mesh: DeviceMesh,
                          params: CostParams) -> tuple[float, float]:
    """``(a, b)`` with redistribution total ``a + b * nbytes`` for a tensor of ``nbytes`` global
    bytes; ``(0.0, 0.0)`` when no collective is needed.

    >>> redistribution_affine(((0,),), ((),), DeviceMesh((2,), latency=(1.0,), bandwidth=(4.0,)),
    ...                       CostParams(beta=1.0))      # 1 s latency + (nbytes/2)/4 B/s
    (1.0, 0.125)
    """
    a, b = unweighted_affine(src, dst, mesh)
    return params.beta * a, params.beta * b


@lru_cache(maxsize=1 << 18)
def unweighted_affine(src: TensorLayout, dst: TensorLayout, mesh: DeviceMesh) -> tuple[float, float]:
    """:func:`redistribution_affine` before the weight ``beta``: memoised apart from the cost model's weights, so a
    search rerun with another memory weight (:func:`~searchers.memory_fit.fit_memory`) does not redo it."""
    a = b = 0.0
    for _, axis, coef in redistribution_steps(src, dst, mesh):
        a += mesh.latency[axis]
        b += coef / mesh.bandwidth[axis]
    return a, b


def layout_affine_matrix(src: tuple[TensorLayout, ...], dst: tuple[TensorLayout, ...], mesh: DeviceMesh,
                         params: CostParams) -> tuple[np.ndarray, np.ndarray]:
    """``(A, B)``: redistribution totals between every pair of layouts are ``A + B * nbytes``."""
    return _affine_matrix(src, dst, mesh, params.beta)


@lru_cache(maxsize=1 << 14)
def _affine_matrix(src: tuple[TensorLayout, ...], dst: tuple[TensorLayout, ...], mesh: DeviceMesh,
                   beta: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`layout_affine_matrix`, memoised on the one weight it depends on."""
    us, si = _unique(src)
    ud, di = _unique(dst)
    ab = np.array([[unweighted_affine(x, y, mesh) for y in ud] for x in us], dtype=float)
    ab = beta * ab.reshape(len(us), len(ud), 2)          # beta * a, beta * b: redistribution_affine's products
    A, B = ab[..., 0][np.ix_(si, di)], ab[..., 1][np.ix_(si, di)]
    A.setflags(write=False)
    B.setflags(write=False)
    return A, B


def layout_cost_matrix(src: Sequence[TensorLayout], dst: Sequence[TensorLayout], nbytes: int,
                       mesh: DeviceMesh, params: CostParams) -> np.ndarray:
    """Redistribution totals ``R[i, j]`` from ``src[i]`` to ``dst[j]`` for ``nbytes`` global bytes."""
    A, B = layout_affine_matrix(tuple(src), tuple(dst), mesh, params)
    return A + B * float(nbytes)


def _unique(layouts: tuple[TensorLayout, ...]) -> tuple[list[TensorLayout], np.ndarray]:
    seen: dict[TensorLayout, int] = {}
    idx = [seen.setdefault(x, len(seen)) for x in layouts]
    return list(seen), np.array(idx, dtype=np.intp)


def edge_cost_matrix(producer: Op, p_cands: Sequence[Strategy], consumer: Op, c_cands: Sequence[Strategy],
                     operand_index: int, graph: Graph, params: CostParams) -> np.ndarray:
    """Redistribution totals ``R[i, j]`` from the producer's result layout under ``p_cands[i]``
    to the layout operand ``operand_index`` of ``consumer`` needs under ``c_cands[j]``.

    >>> from searchers.graph import DeviceMesh, Graph
    >>> g = Graph(DeviceMesh((2,)))
    >>> x = g.source("x", (4,))
    >>> _ = g.add_op("neg", "neg", {"i": 4}, [x], [("i",)], [("i",)])
    >>> R = edge_cost_matrix(g.ops[0], [((),), ((0,),)], g.ops[1], [((),), ((0,),)], 0, g, CostParams())
    >>> R.tolist()[0], bool(R[1, 1] == 0), bool(R[1, 0] > 0)      # only gathering costs
    ([0.0, 0.0], True, True)
    """
    tid = consumer.inputs[operand_index]
    j = producer.outputs.index(tid)
    ps, cs = op_spec(producer, graph), op_spec(consumer, graph)
    src = tuple(layout_of(ps.out_maps[j], tuple(map(tuple, s))) for s in p_cands)
    dst = tuple(layout_of(cs.in_maps[operand_index], tuple(map(tuple, s))) for s in c_cands)
    return layout_cost_matrix(src, dst, graph.tensors[tid].nbytes, graph.mesh, params)


for _memo in (unweighted_affine, _affine_matrix):
    depends_on_direct(_memo.cache_clear)
