"""A hashable, name-free summary of an op: everything its candidates and costs depend on.

Two ops with equal :class:`OpSpec` have the same candidate strategies (for the same mesh) and
the same cost vectors, so searchers and the cost model memoise on it. Loop dims are referred
to by position (``op.dims`` order), tensor-dim maps use ``-1`` for "no loop dim".

>>> from searchers.graph import DeviceMesh, Graph
>>> g = Graph(DeviceMesh((2, 2)))
>>> x = g.source("x", (8, 4)); w = g.source("w", (4, 6), kind="param")
>>> _ = g.add_op("mm", "dot_general", {"m": 8, "k": 4, "n": 6}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
>>> s = op_spec(g.ops[2], g)
>>> s.sizes, s.in_maps, s.out_maps, s.reduction, s.out_bytes
((8, 4, 6), ((0, 1), (1, 2)), ((0, 2),), (1,), (192,))
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .graph import SOURCE_KINDS, Graph, Op, may_idle
from .rows import distinct_rows
from .slots import Flat, flat_ops, starts

Map = int | tuple[int, ...]       # a tensor dim's loop dim index (-1: none), or the indices of the loop dims it is made of


class OpSpec(NamedTuple):
    sizes: tuple[int, ...]                   # loop-dim sizes a split must divide (Op.split_sizes), op.dims order
    unsplittable: tuple[bool, ...]           # per loop dim
    in_maps: tuple[tuple[Map, ...], ...]     # per operand, per tensor dim: loop-dim index, -1, or a tuple of indices
    out_maps: tuple[tuple[Map, ...], ...]    # per result, the same
    in_bytes: tuple[int, ...]                # global bytes of each operand
    out_bytes: tuple[int, ...]               # global bytes of each result
    reduction: tuple[int, ...]               # loop-dim indices no result uses
    flops: float
    free_devices: bool = False               # Op.free_devices: exempt from fully_use_devices
    latency_share: float = 1.0               # Op.latency_share: the part of a latency its all-reduces pay
    halo: tuple[int, ...] = ()               # Op.halo per loop dim (0: none); () when the op has none
    apart: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())   # no strategy splits one of [0] and one of [1]
    stored: bool = False                     # a "param" source: state the device stores (weights, optimizer moments)
    nested: tuple = ()                       # Op.nested: minor parts of merged tensor dims, split only after the major


def op_spec(op: Op, graph: Graph) -> OpSpec:
    """The :class:`OpSpec` of ``op`` (its tensors are looked up in ``graph``)."""
    return spec_from_key(spec_key(op, graph))


SpecKey = tuple[int, tuple[int, ...], tuple[int, ...]]


def spec_key(op: Op, graph: Graph) -> SpecKey:
    """A cheap hashable key equivalent to :func:`op_spec`: (structure id, operand bytes, result
    bytes). The name-free structure (dims, maps, unsplittable, flops) is interned once per
    distinct op shape, so repeated layers pay for it once.

    >>> from searchers.graph import DeviceMesh, Graph
    >>> g = Graph(DeviceMesh((2,)))
    >>> a = g.source("a", (4,)); b = g.source("b", (4,))
    >>> spec_key(g.ops[0], g) == spec_key(g.ops[1], g)
    True
    """
    tensors = graph.tensors
    return (_struct_id(op), tuple([tensors[t].nbytes for t in op.inputs]),
            tuple([tensors[t].nbytes for t in op.outputs]))


def _struct_id(op: Op) -> int:
    """The interned id of ``op``'s name-free structure (dims, maps, unsplittable, flops, split limits)."""
    lim = op.split_limit
    halo = op.halo
    key = (tuple(op.dims.items()), tuple(op.in_dims), tuple(op.out_dims), op.unsplittable, op.flops,
           op.kind in SOURCE_KINDS, op.kind == "param", tuple(sorted(lim.items())) if lim else None, op.free_devices,
           op.latency_share, (tuple(sorted(halo.items())), op.halo_apart) if halo else None)
    sid = _STRUCT_IDS.get(key)
    if sid is None:
        sid = _STRUCT_IDS[key] = len(_STRUCTS)
        _STRUCTS.append(_structure(op))
    return sid


def spec_keys(graph: Graph) -> list[SpecKey]:
    """:func:`spec_key` of every op of ``graph``, in one pass (each tensor's size computed once).

    >>> from searchers.graph import DeviceMesh, Graph
    >>> g = Graph(DeviceMesh((2,)))
    >>> a = g.source("a", (4,)); b = g.source("b", (4,))
    >>> spec_keys(g) == [spec_key(op, g) for op in g.ops]
    True
    """
    nb = [math.prod(t.shape) * t.itemsize for t in graph.tensors]
    return [(_struct_id(op), tuple([nb[t] for t in op.inputs]), tuple([nb[t] for t in op.outputs]))
            for op in graph.ops]


def distinct_spec_keys(graph: Graph, flat: Flat | None = None) -> tuple[list[SpecKey], np.ndarray]:
    """The distinct :func:`spec_key` of ``graph``'s ops in order of first use, and each op's
    index into them: :func:`spec_keys` without building a key per op (rows of structure id
    and tensor bytes are compared in numpy). ``flat``: the graph's :func:`~searchers.slots.flat_ops`.

    >>> from searchers.graph import DeviceMesh, Graph
    >>> g = Graph(DeviceMesh((2,)))
    >>> a = g.source("a", (4,)); b = g.source("b", (4,)); c = g.source("c", (8,))
    >>> keys, index = distinct_spec_keys(g)
    >>> [keys[i] for i in index] == spec_keys(g), index.tolist()
    (True, [0, 0, 1])
    """
    f = flat_ops(graph) if flat is None else flat
    n = len(f.n_in)
    wi, wo = int(f.n_in.max(initial=0)), int(f.n_out.max(initial=0))
    rows = np.full((n, 1 + wi + wo), -1, dtype=np.int64)
    rows[:, 0] = [_struct_id(op) for op in graph.ops]
    for cols, counts, tids in ((1, f.n_in, f.inputs), (1 + wi, f.n_out, f.outputs)):
        who = np.repeat(np.arange(n), counts)
        rows[who, cols + np.arange(len(tids)) - starts(counts)[who]] = f.nbytes[tids]
    first, inv = distinct_rows(rows)
    order = np.argsort(first, kind="stable")          # keys in order of first use, as spec_keys meets them
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    keys: list[SpecKey] = []
    for r in rows[first[order]].tolist():
        ins, outs = r[1:1 + wi], r[1 + wi:]
        keys.append((r[0], tuple(x for x in ins if x >= 0), tuple(x for x in outs if x >= 0)))
    return keys, rank[inv]


def spec_from_key(key: SpecKey) -> OpSpec:
    """The :class:`OpSpec` a :func:`spec_key` stands for."""
    sizes, uns, in_maps, out_maps, red, flops, free, share, halo, apart, stored, nested = _STRUCTS[key[0]]
    return OpSpec(sizes, uns, in_maps, out_maps, key[1], key[2], red, flops, free, share, halo, apart, stored, nested)


def all_devices(spec: OpSpec, fully_use_devices: bool) -> bool:
    """Whether ``fully_use_devices`` restricts this op: not one :func:`~searchers.graph.may_idle` leaves free."""
    return fully_use_devices and not may_idle(bool(spec.in_maps), spec.free_devices)


# interned op structures: a few per distinct op shape, never cleared (ids must stay valid)
_STRUCT_IDS: dict[tuple, int] = {}
_STRUCTS: list[tuple] = []


def _structure(op: Op) -> tuple:
    idx = {d: i for i, d in enumerate(op.dims)}

    def index(d):
        return -1 if d is None else idx[d] if isinstance(d, str) else tuple(idx[x] for x in d)
    in_maps = tuple(tuple(index(d) for d in dd) for dd in op.in_dims)
    out_maps = tuple(tuple(index(d) for d in dd) for dd in op.out_dims)
    used = {i for m in out_maps for e in m for i in ((e,) if isinstance(e, int) else e)} | {
        idx[d] for d in op.read_only}
    uns = op.unsplittable
    halo = tuple(op.halo.get(d, 0) for d in op.dims) if op.halo else ()
    return (op.split_sizes(), tuple(d in uns for d in op.dims), in_maps, out_maps,
            tuple(i for i in range(len(idx)) if i not in used), op.compute_flops(), op.free_devices, op.latency_share,
            halo, op.apart(), op.kind == "param", op.nested())


def layout_of(maps: tuple[Map, ...], strategy: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Tensor layout from a tensor-dim map and a strategy (``-1`` -> not split; a tuple of loop dims -> their axes,
    major first).

    >>> layout_of((0, -1, 2), ((1,), (), (0,)))
    ((1,), (), (0,))
    >>> layout_of(((0, 1), 2), ((1,), (2,), ()))
    ((1, 2), ())
    """
    return tuple((() if i < 0 else strategy[i]) if isinstance(i, int) else tuple(a for j in i for a in strategy[j])
                 for i in maps)


def map_dims(m: Map) -> tuple[int, ...]:
    """The loop dim indices one tensor dim's map names (``()`` for -1).

    >>> map_dims(-1), map_dims(2), map_dims((0, 1))
    ((), (2,), (0, 1))
    """
    if isinstance(m, int):
        return () if m < 0 else (m,)
    return m
