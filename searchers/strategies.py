"""Candidate strategies of an op, and MindSpore's data-parallel default.

A strategy gives every loop dim a tuple of mesh-axis indices (ascending); every mesh axis goes
to at most one loop dim. The enumeration assigns each axis to "no dim" or to one splittable loop
dim whose size stays divisible by the product of its axes' sizes, so there are at most
``(len(dims) + 1) ** len(mesh.shape)`` candidates.

>>> from searchers.graph import DeviceMesh, Graph
>>> g = Graph(DeviceMesh((2, 2)))
>>> x = g.source("x", (4, 3))
>>> enumerate_strategies(g.ops[0], g.mesh)
[((), ()), ((0, 1), ()), ((0,), ()), ((1,), ())]
>>> data_parallel_strategy(g.ops[0], g.mesh)
((0, 1), ())
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from .graph import DeviceMesh, Op, Strategy, hand_out, split_count


def enumerate_strategies(op: Op, mesh: DeviceMesh, *, fully_use_devices: bool = False,
                         max_candidates: int | None = None) -> list[Strategy]:
    """Every valid strategy of ``op`` on ``mesh``, in a deterministic order.

    Order: the replicated strategy first (when allowed), then by number of devices used,
    most first, then lexicographically by the strategy tuple. ``max_candidates`` keeps the
    first that many. ``op.fixed`` (a user strategy) is returned alone.

    With ``fully_use_devices`` every mesh axis must be used by an operator (source ops — data,
    parameters — and ops with no operands, such as an iota, are exempt: a tensor's layout follows
    its users, as in MindSpore); if no strategy can do that (e.g.
    all dims unsplittable, or sizes not divisible) the strategies using the most devices are
    returned instead, so a search never runs out of candidates.

    >>> from searchers.graph import Graph
    >>> g = Graph(DeviceMesh((2,)))
    >>> _ = g.source("v", (6,)); _ = g.source("o", (3,))
    >>> enumerate_strategies(g.ops[0], g.mesh), enumerate_strategies(g.ops[1], g.mesh)
    ([((),), ((0,),)], [((),)])
    >>> enumerate_strategies(g.ops[1], g.mesh, fully_use_devices=True)
    [((),)]
    """
    if op.fixed is not None:
        return [tuple(tuple(a) for a in op.fixed)]
    if op.any_devices:       # fully_use_devices is about operators; a tensor's layout follows its users (MindSpore),
        fully_use_devices = False          # an op with no operands too; free_devices: the backward and update (Op)
    uns = tuple(d in op.unsplittable for d in op.dims)
    return list(strategies_for(op.split_sizes(), uns, mesh.shape, fully_use_devices, max_candidates, op.apart(),
                               op.nested()))


def is_legal(op: Op, strategy: Strategy, mesh: DeviceMesh) -> bool:
    """Whether :func:`enumerate_strategies` could give ``strategy`` (mesh axes per loop dim, by index or name):
    no unsplittable dim split, each split dividing what it must (:meth:`~searchers.graph.Op.split_sizes`), no halo
    dim split together with a dim kept apart from it. For a strategy decided elsewhere (a saved file, a marked
    body).

    >>> from searchers.graph import Graph
    >>> g = Graph(DeviceMesh((2, 2)))
    >>> _ = g.source("x", (4, 3))
    >>> is_legal(g.ops[0], ((0, 1), ()), g.mesh), is_legal(g.ops[0], ((), (0,)), g.mesh)
    (True, False)
    """
    for (d, _), axes, size in zip(op.dims.items(), strategy, op.split_sizes(), strict=True):
        if axes and (d in op.unsplittable or size % mesh.count(axes)):
            return False
    halo, apart = op.apart()
    if any(strategy[i] for i in halo) and any(strategy[i] for i in apart):
        return False
    counts = [mesh.count(axes) for axes in strategy]
    return _whole_before(counts, op.nested())


def _whole_before(counts: Sequence[int], nested: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]) -> bool:
    """Whether every split minor part of a tensor dim made of several loop dims has each part before it split
    into its size (:meth:`~searchers.graph.Op.nested`)."""
    return all(counts[i] == 1 or all(counts[j] == n for j, n in before) for i, before in nested)


def strategies_for(sizes: tuple[int, ...], unsplittable: tuple[bool, ...], mesh_shape: tuple[int, ...],
                   fully_use_devices: bool = False, max_candidates: int | None = None,
                   apart: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
                   nested: tuple = ()) -> tuple[Strategy, ...]:
    """:func:`enumerate_strategies` on plain loop-dim sizes (memoised). ``apart``: no strategy splits a loop dim of
    ``apart[0]`` (a convolution's halo dims) together with one of ``apart[1]`` (its out-channels: ``Op.halo_apart``).
    ``nested``: :meth:`~searchers.graph.Op.nested` (a minor part of a merged tensor dim is split only when the parts
    before it are split whole).

    A split count is a product of mesh axis sizes, so it divides the device count ``N``; it
    divides a size exactly when it divides ``gcd(size, N)``. Sizes are memoised by that gcd, so
    graphs with many different sizes enumerate a few cases.

    >>> strategies_for((4, 6), (False, True), (2, 2))
    (((), ()), ((0, 1), ()), ((0,), ()), ((1,), ()))
    """
    n = math.prod(mesh_shape)
    return _strategies_for(tuple(math.gcd(s, n) for s in sizes), unsplittable, tuple(mesh_shape),
                           fully_use_devices, max_candidates, apart, nested)


@lru_cache(maxsize=4096)
def _strategies_for(sizes: tuple[int, ...], unsplittable: tuple[bool, ...], mesh_shape: tuple[int, ...],
                    fully_use_devices: bool, max_candidates: int | None,
                    apart: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
                    nested: tuple = ()) -> tuple[Strategy, ...]:
    n_dims, n_axes = len(sizes), len(mesh_shape)
    found: list[tuple[int, Strategy]] = []
    counts = [1] * n_dims
    assign: list[list[int]] = [[] for _ in range(n_dims)]

    def rec(axis: int, used: int) -> None:
        if axis == n_axes:
            found.append((used, tuple(tuple(a) for a in assign)))
            return
        k = mesh_shape[axis]
        rec(axis + 1, used)                        # axis not used
        for d in range(n_dims):
            if unsplittable[d] or sizes[d] % (counts[d] * k):
                continue
            counts[d] *= k
            assign[d].append(axis)
            rec(axis + 1, used * k)
            assign[d].pop()
            counts[d] //= k

    rec(0, 1)
    if apart[0] and apart[1]:
        found = [(u, s) for u, s in found
                 if not (any(s[d] for d in apart[0]) and any(s[d] for d in apart[1]))]
    if nested:
        found = [(u, s) for u, s in found
                 if _whole_before([math.prod(mesh_shape[a] for a in axes) for axes in s], nested)]
    if fully_use_devices:
        every = [(u, s) for u, s in found if sum(len(a) for a in s) == n_axes]
        best = max(u for u, _ in found)
        found = every if every else [(u, s) for u, s in found if u == best]
    rep = tuple(() for _ in sizes)
    rest = sorted((s for _, s in found if s != rep), key=lambda s: (-split_count(s, mesh_shape), s))
    out = ([rep] if any(s == rep for _, s in found) else []) + rest
    if max_candidates is not None:
        out = out[:max(1, max_candidates)]
    return tuple(out)


def data_parallel_strategy(op: Op, mesh: DeviceMesh) -> Strategy:
    """MindSpore's default: split the loop dim behind dim 0 of the first operand (of the result
    for a source op of kind ``"data"``) over as many mesh axes as divide it, in ascending axis
    order, greedily; everything else (parameters, constants, scalars, unsplittable or size-1
    leading dims) is replicated.

    >>> from searchers.graph import Graph
    >>> g = Graph(DeviceMesh((2, 2, 3)))
    >>> x = g.source("x", (8, 5))
    >>> w = g.source("w", (5, 7), kind="param")
    >>> (y,) = g.add_op("mm", "dot_general", {"m": 8, "k": 5, "n": 7}, [x, w],
    ...                 [("m", "k"), ("k", "n")], [("m", "n")])
    >>> [data_parallel_strategy(op, g.mesh) for op in g.ops]
    [((0, 1), ()), ((), ()), ((0, 1), (), ())]
    """
    strategy: list[tuple[int, ...]] = [() for _ in op.dims]
    if op.is_source:
        if op.kind != "data" or not op.out_dims or not op.out_dims[0]:
            return tuple(strategy)
        dim = op.out_dims[0][0]
    else:
        if not op.in_dims or not op.in_dims[0]:
            return tuple(strategy)
        dim = op.in_dims[0][0]
    names = list(op.dims)
    if dim is not None and not isinstance(dim, str):        # a dim made of several loop dims: split as one, major first
        if any(d in op.unsplittable for d in dim):
            return tuple(strategy)
        sizes = op.split_sizes()
        idx = tuple(names.index(d) for d in dim)
        axes = _greedy_axes(math.prod(sizes[i] for i in idx), mesh.shape)
        for i, got in hand_out(idx, axes, sizes, mesh.shape).items():
            strategy[i] = got
        return tuple(strategy)
    if dim is None or dim in op.unsplittable:
        return tuple(strategy)
    strategy[names.index(dim)] = _greedy_axes(op.split_sizes()[names.index(dim)], mesh.shape)
    return tuple(strategy)


def _greedy_axes(size: int, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """As many mesh axes, in ascending order, as divide ``size`` together (MindSpore's data-parallel split)."""
    count, axes = 1, []
    for a, k in enumerate(mesh_shape):
        if k > 1 and size % (count * k) == 0:
            count *= k
            axes.append(a)
    return tuple(axes)
