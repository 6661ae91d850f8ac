"""Strategies, Layouts and the region mesh -> ``jax.sharding.Mesh`` + ``PartitionSpec``.

A strategy for one tensor comes in four forms, all normalised here to a :class:`TensorStrategy`:

* a tuple of split counts ``(2, 1)`` (MindSpore): dim i is cut into that many slices; which mesh
  axes carry a split is chosen later, to avoid redistribution between producer and consumer;
* ``layout("dp", "mp")`` from a :class:`Layout` (MindSpore's higher-order operator parallel):
  the mesh axes are named, ``"None"`` leaves a dim whole, ``("dp", "mp")`` puts one dim on two axes;
  the alias ``"interleaved_parallel"`` is no mesh axis: the op computes that dim in copies on each device
  (:data:`INTERLEAVED`);
* a ``jax.sharding.PartitionSpec`` (axis names of the region mesh);
* a ``jax.sharding.NamedSharding`` (its mesh becomes the region mesh).

Mesh rule (docs/design.md §2): one mesh per region. With a Layout or a NamedSharding the mesh is its
device matrix; with plain split tuples the mesh has one axis per prime factor of device_num
(8 devices -> axes ``d0, d1, d2`` of size 2) so any split count that divides device_num maps to
a set of axes, and ``((2,1),(1,4))`` and ``((4,1),(1,2))`` coexist in one region.

>>> from mshard import Layout
>>> layout = Layout((2, 4), ("dp", "mp"))
>>> layout(("dp", "mp"), "None").dims
(('dp', 'mp'), ())
>>> prime_mesh(8).shape
(2, 2, 2)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from mshard._src.values.errors import LayoutError, StrategyError, StrategyTypeError
from searchers.graph import DeviceMesh, prime_factors

INTERLEAVED = "interleaved_parallel"
"""MindSpore's alias for micro-interleaving: a Layout axis that is not devices. A dim laid out over it (and over
device axes) keeps the device axes' split, and the op computes each device's block of that dim in that many copies,
one after another (:func:`mshard._src.frontend.interleave.in_copies`), so one copy's communication can overlap the
next one's compute."""

AxisNames = tuple[str, ...]
DimAxes = tuple[AxisNames, ...]      # per tensor dim, the mesh axes it is split over (in order)


# -- the mesh -----------------------------------------------------------------------------------
def prime_mesh(n: int) -> DeviceMesh:
    """A region's mesh from plain tuples: one axis ``d<i>`` per prime factor of ``n`` (docs/design.md §2), and one
    axis of size 1 for one device.

    >>> prime_mesh(12).shape, prime_mesh(1).names
    ((2, 2, 3), ('d0',))
    """
    f = prime_factors(n) or [1]
    return DeviceMesh(tuple(f), tuple(f"d{i}" for i in range(len(f))))


def jax_mesh(mesh: DeviceMesh) -> Mesh:
    """The ``jax.sharding.Mesh`` of a region's mesh: its axes over the first ``mesh.size`` devices, Auto axes."""
    return _jax_mesh(mesh.names, mesh.shape)


@lru_cache(maxsize=64)
def _jax_mesh(names: tuple[str, ...], shape: tuple[int, ...]) -> Mesh:
    n = math.prod(shape)
    devices = np.asarray(jax.devices()[:n], dtype=object).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


def axes_by_name(layout: Iterable[Iterable[int]], mesh: DeviceMesh) -> DimAxes:
    """A layout over mesh axis indices (the searchers' form) as axis names per dim.

    >>> axes_by_name(((0,), (), (1, 2)), prime_mesh(8))
    (('d0',), (), ('d1', 'd2'))
    """
    return tuple(tuple(mesh.names[a] for a in axes) for axes in layout)


def axes_by_index(dims: Iterable[Iterable[str]], mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """Axis names per dim as mesh axis indices (the searchers' form); the inverse of :func:`axes_by_name`."""
    return tuple(tuple(mesh.names.index(a) for a in axes) for axes in dims)


def spec_of(dims: DimAxes) -> PartitionSpec:
    """``(("d0",), (), ("d1", "d2"))`` -> ``P("d0", None, ("d1", "d2"))``."""
    return PartitionSpec(*[None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in dims])


def dims_of(spec: PartitionSpec, rank: int) -> DimAxes:
    """Inverse of :func:`spec_of`, padded with unsplit dims to ``rank``."""
    out: list[AxisNames] = []
    for entry in tuple(spec) + (None,) * (rank - len(spec)):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out)


# -- Layout ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """MindSpore's ``Layout(device_matrix, alias_names)``: a named device matrix; calling it lays out a tensor.

    ``layout(*dims)`` takes one entry per tensor dim: an alias name, a tuple of them (the dim split over several
    axes), or ``"None"`` (or ``None``) to keep the dim whole; it returns a ``LayoutSpec`` to use as a strategy.
    Maps to JAX as: the device matrix is the region's ``Mesh`` (axis names = alias names) and
    ``layout(...)`` is a ``PartitionSpec`` over it.

    Args:
        device_matrix: the mesh shape, positive ints (their product: the devices used, without the
            ``"interleaved_parallel"`` entry, which is copies on each device, not devices).
        alias_names: one distinct name per ``device_matrix`` entry (not ``"None"``).

    >>> layout = Layout((2, 4), ("dp", "mp"))
    >>> layout("dp", "None")
    LayoutSpec(('dp',), ())
    >>> layout(("dp", "mp"), None).dims
    (('dp', 'mp'), ())
    >>> Layout((2, 4, 2), ("dp", "mp", "interleaved_parallel")).mesh.shape    # 8 devices, 2 copies each
    (2, 4)
    """

    device_matrix: tuple[int, ...]
    alias_names: tuple[str, ...]

    def __init__(self, device_matrix: Sequence[int], alias_names: Sequence[str]):
        dm, names = tuple(device_matrix), tuple(alias_names)
        if not dm or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dm):
            raise LayoutError(f"Layout: device_matrix must be a tuple of positive ints, got {device_matrix!r}.")
        if len(names) != len(dm) or not all(isinstance(a, str) for a in names):
            raise LayoutError(f"Layout: alias_names {alias_names!r} must be {len(dm)} strings, one per "
                              f"device_matrix entry {dm}.")
        if len(set(names)) != len(names) or "None" in names:
            raise LayoutError(f"Layout: alias_names {names} must be distinct and must not be 'None'.")
        if names == (INTERLEAVED,):
            raise LayoutError(f"Layout: {INTERLEAVED!r} is copies on each device, not devices; give the device axes "
                              f"too, e.g. Layout((4, {dm[0]}), ('dp', {INTERLEAVED!r})).")
        object.__setattr__(self, "device_matrix", dm)
        object.__setattr__(self, "alias_names", names)

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh: every axis but ``"interleaved_parallel"``."""
        axes = [(n, a) for n, a in zip(self.device_matrix, self.alias_names, strict=True) if a != INTERLEAVED]
        return DeviceMesh(tuple(n for n, _ in axes), tuple(a for _, a in axes))

    @property
    def copies(self) -> int:
        """How many copies a dim laid out over ``"interleaved_parallel"`` is computed in on each device (1: none)."""
        return dict(zip(self.alias_names, self.device_matrix, strict=True)).get(INTERLEAVED, 1)

    def __call__(self, *dims: str | Sequence[str] | None) -> LayoutSpec:
        out: list[AxisNames] = []
        seen: set[str] = set()
        for d in dims:
            axes: AxisNames = () if d is None or d == "None" else ((d,) if isinstance(d, str) else tuple(d))
            for a in axes:
                if a == "None":
                    raise LayoutError(f"Layout: 'None' cannot be combined with other axes in {d!r}.")
                if a not in self.alias_names:
                    raise LayoutError(f"Layout: unknown alias {a!r} in layout{dims!r}; this Layout has "
                                      f"{self.alias_names}.")
                if a in seen:
                    raise LayoutError(f"Layout: alias {a!r} is used twice in layout{dims!r}; a mesh axis can "
                                      f"split only one dim of a tensor.")
                seen.add(a)
            out.append(axes)
        return LayoutSpec(self, tuple(out))


@dataclass(frozen=True)
class LayoutSpec:
    """The layout of one tensor: its Layout and, per dim, the alias names it is split over."""

    layout: Layout
    dims: DimAxes

    def __repr__(self) -> str:
        return f"LayoutSpec{self.dims!r}"

    def to_dict(self) -> dict[str, Any]:
        """MindSpore's ``to_dict()``: the device matrix, the tensor map (per dim, the device-matrix axes counted
        from the last, ``-1`` for a whole dim, a tuple for a dim over several), whether the Layout has the
        ``"interleaved_parallel"`` alias, the alias names and the ranks.

        >>> layout = Layout((2, 2, 2), ("dp", "sp", "mp"))
        >>> d = layout("dp", "mp").to_dict()
        >>> d["tensor_map"], d["interleaved_parallel"], d["rank_list"]
        ((2, 0), False, [0, 1, 2, 3, 4, 5, 6, 7])
        """
        names = self.layout.alias_names
        index = {a: len(names) - 1 - i for i, a in enumerate(names)}
        tensor_map = tuple(-1 if not d else (index[d[0]] if len(d) == 1 else tuple(index[a] for a in d))
                           for d in self.dims)
        return {"device_matrix": self.layout.device_matrix, "tensor_map": tensor_map,
                "interleaved_parallel": INTERLEAVED in names, "alias_name": names,
                "rank_list": list(range(self.layout.mesh.size))}


# -- one tensor's strategy, normalised --------------------------------------------------------------
@dataclass(frozen=True)
class TensorStrategy:
    """A normalised per-tensor strategy: split counts, and the axes when the user named them.

    ``axes is None`` means "counts only; choose the axes" (tuple form). ``mesh`` is set when the
    form carries its own mesh (Layout, NamedSharding).
    """

    counts: tuple[int, ...]
    axes: DimAxes | None = None
    mesh: DeviceMesh | None = None
    copies: tuple[int, ...] | None = None      # per dim, the copies a Layout's interleaved_parallel asks (None: none)

    @property
    def rank(self) -> int:
        return len(self.counts)

    @property
    def devices(self) -> int:
        return math.prod(self.counts)


def _mesh_of_named(sh: NamedSharding) -> DeviceMesh:
    m = sh.mesh
    return DeviceMesh(tuple(int(m.shape[a]) for a in m.axis_names), tuple(m.axis_names))


def to_tensor_strategy(s: Any, where: str) -> TensorStrategy:
    """Normalise one tensor's strategy (tuple / LayoutSpec / PartitionSpec / NamedSharding).

    ``where`` names the op and input for messages, e.g. ``"MatMul 'mm1' input 0"``.
    """
    if isinstance(s, LayoutSpec):
        mesh = s.layout.mesh
        dims = tuple(tuple(a for a in d if a != INTERLEAVED) for d in s.dims)
        copies = tuple(s.layout.copies if INTERLEAVED in d else 1 for d in s.dims)
        return TensorStrategy(tuple(mesh.count(a) for a in dims), dims, mesh,
                              copies if any(c > 1 for c in copies) else None)
    if isinstance(s, NamedSharding):
        mesh = _mesh_of_named(s)
        dims = dims_of(s.spec, len(s.spec))
        return TensorStrategy(tuple(mesh.count(a) for a in dims), dims, mesh)
    if isinstance(s, PartitionSpec):
        dims = dims_of(s, len(s))
        return TensorStrategy(tuple(-1 if a else 1 for a in dims), dims, None)   # counts resolved by mesh
    if isinstance(s, (tuple, list)) and all(isinstance(c, (int, np.integer)) and not isinstance(c, bool)
                                           for c in s):
        counts = tuple(int(c) for c in s)
        if any(c < 1 for c in counts):
            raise StrategyError(f"{where}: strategy {tuple(s)} has a split count < 1; every entry must be a "
                                f"positive int (1 = not split).")
        return TensorStrategy(counts)
    raise StrategyTypeError(f"{where}: strategy {s!r} is not a tuple of split counts like (2, 1), a Layout call "
                            f"like layout('dp', 'None'), a PartitionSpec or a NamedSharding.")


def normalize_in_strategy(in_strategy: Any, n_inputs: int | None, where: str) -> tuple[TensorStrategy | None, ...]:
    """A per-input tuple of strategies -> normalised; ``None`` entries leave that input unannotated."""
    if isinstance(in_strategy, (LayoutSpec, PartitionSpec, NamedSharding)):
        in_strategy = (in_strategy,)
    if not isinstance(in_strategy, (tuple, list)):
        raise StrategyTypeError(f"{where}: in_strategy must be a tuple with one strategy per input, e.g. "
                                f"((2, 1), (1, 4)), got {in_strategy!r}.")
    if in_strategy and all(isinstance(c, int) for c in in_strategy):
        raise StrategyTypeError(f"{where}: in_strategy {tuple(in_strategy)} looks like one tensor's strategy; "
                                f"wrap it in a tuple with one entry per input: ({tuple(in_strategy)},).")
    if n_inputs is not None and len(in_strategy) != n_inputs:
        raise StrategyError(f"{where}: in_strategy has {len(in_strategy)} entries but the op takes {n_inputs} "
                            f"tensor input(s); give one strategy per input.")
    return tuple(None if s is None else to_tensor_strategy(s, f"{where} input {i}")
                 for i, s in enumerate(in_strategy))


def check_fits(ts: TensorStrategy, shape: Sequence[int], device_num: int, where: str) -> None:
    """Rank, divisibility of each dim, and the product of splits against device_num."""
    if ts.rank != len(shape):
        raise StrategyError(f"{where}: strategy {ts.counts} has {ts.rank} entries but the tensor has rank "
                            f"{len(shape)} (shape {tuple(shape)}); give one split count per dim.")
    for d, (c, size) in enumerate(zip(ts.counts, shape)):
        if c > 0 and size % c:
            raise StrategyError(f"{where}: split {c} on dim {d} does not divide its size {size} (shape "
                                f"{tuple(shape)}); use a split count that divides {size}. Shapes are global: "
                                f"the whole tensor, not one device's slice (a batch of {size} is split {c} ways).")
    if ts.mesh is None and device_num % ts.devices:
        raise StrategyError(f"{where}: strategy {ts.counts} splits over {ts.devices} devices, which "
                            f"{'exceeds' if ts.devices > device_num else 'does not divide'} device_num="
                            f"{device_num}; the product of the splits must divide {device_num}.")


# -- choosing mesh axes for split counts ----------------------------------------------------------
def axis_choices(count: int, free: Sequence[str], mesh: DeviceMesh) -> list[AxisNames]:
    """Every ordered-by-mesh subset of ``free`` axes whose sizes multiply to ``count``."""
    if count == 1:
        return [()]
    out = []
    for r in range(1, len(free) + 1):
        for combo in itertools.combinations(free, r):
            if mesh.count(combo) == count:
                out.append(combo)
    return out


def choose_axes(count: int, free: Sequence[str], mesh: DeviceMesh,
                prefer: Sequence[AxisNames] = (), avoid: Iterable[str] = ()) -> AxisNames | None:
    """Pick axes for a split: an exact preferred match, else the most overlap with a preference
    (keeping its order), else axes not in ``avoid``, else any. ``None`` if no subset fits."""
    cands = axis_choices(count, free, mesh)
    if not cands:
        return None
    for p in prefer:
        if p in cands:
            return p
    avoid = set(avoid)

    def score(c: AxisNames) -> tuple:
        overlap = max((sum(a in p for a in c) for p in prefer), default=0)
        return (-overlap, sum(a in avoid for a in c))
    best = min(cands, key=score)
    # keep the producer's order for the shared axes so the device order matches
    for p in prefer:
        shared = [a for a in p if a in best]
        if shared:
            best = tuple(shared) + tuple(a for a in best if a not in shared)
            break
    return best


def replica_layout(lay, bdim: int, axes: tuple[str, ...]):
    """A per-replica layout for a tensor batched over replicas at ``bdim``: the replica dim takes the
    replica ``axes`` and every other dim drops them (the planner split the per-replica batch over them).

    >>> replica_layout((("d0",), ("d1", "d2")), 0, ("d0",))
    (('d0',), (), ('d1', 'd2'))
    """
    rest = [tuple(a for a in d if a not in axes) for d in lay]
    return tuple(rest[:bdim]) + (tuple(axes),) + tuple(rest[bdim:])


def check_strategy(where: str, kind: str, shapes: Sequence[tuple[int, ...]],
                   in_dims: Sequence[tuple[str | None, ...]], fixed: frozenset[str],
                   strategy: Sequence[TensorStrategy | None], device_num: int) -> None:
    """The one legality of a primitive object's strategy, for what a user asks (``.shard``) and for what a plan
    reports (:func:`mshard._src.planning.plan_build.build_plan`): one split tuple per input that fits its shape, broadcast dims
    and the dims the op cannot split whole, shared dims split alike, the op's splits dividing device_num."""
    if len(strategy) != len(shapes):
        raise StrategyError(f"{where}: strategy has {len(strategy)} entries but the op takes {len(shapes)} "
                            f"tensor input(s); give one split tuple per input.")
    counts: dict[str, tuple[int, int, int]] = {}
    for i, (st, shape, dims) in enumerate(zip(strategy, shapes, in_dims)):
        if st is None:
            continue
        check_fits(st, shape, device_num, f"{where} input {i}")
        for d, (letter, c) in enumerate(zip(dims, st.counts)):
            if c < 0:          # PartitionSpec: counts known once the mesh is
                continue
            if letter is None and c != 1:
                raise StrategyError(f"{where} input {i}: dim {d} (size {shape[d]}) is broadcast, so its split "
                                    f"must be 1, got {c} in {st.counts}.")
            if letter in fixed and c != 1:
                raise StrategyError(f"{where} input {i}: {kind} cannot split dim {d} (split {c} in "
                                    f"{st.counts}); MindSpore's {kind} needs 1 there.")
            if letter is not None:
                if letter in counts and counts[letter][0] != c:
                    c0, i0, d0 = counts[letter]
                    raise StrategyError(f"{where}: inputs disagree on a shared dim: input {i0} dim {d0} is split "
                                        f"{c0} but input {i} dim {d} is split {c} in {st.counts}; the shared "
                                        f"dim needs the same split in both.")
                counts.setdefault(letter, (c, i, d))
    total = math.prod(c for c, _, _ in counts.values())
    if all(st is None or st.mesh is None for st in strategy) and device_num % total:
        raise StrategyError(f"{where}: strategy {tuple(s.counts if s else None for s in strategy)} uses "
                            f"{total} devices in all, which {'exceeds' if total > device_num else 'does not divide'}"
                            f" device_num={device_num}; the product of the op's splits must divide it.")
