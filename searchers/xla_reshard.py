"""How XLA's SPMD partitioner realises a redistribution: the collectives it emits, simulated.

The cost model prices a redistribution (a tensor going from one layout to another) by the
collectives XLA will really compile for it, not by the cheapest conceivable ones. XLA's resharding
(``PartitionedHlo::ReshardNoCache``) works on *tile assignments*: per tensor dim a tile count, a
replication count ``R``, and the device at every tile. It tries, in this order:

1. same tile counts, other devices: one **collective-permute** of the whole local shard;
2. the same tile counts moved between dims, or a factor moved from one dim to another (tiles
   (1, 4) -> (2, 2)): **all-to-alls**, one mesh factor per step (several
   disjoint steps fused in one), then a permute if the devices end up in another order;
3. less replication (every target count a multiple of the source's): a local slice, then a
   permute of the small shard if the order differs;
4. more replication (every source count a multiple of the target's): a permute into the layout
   where each gathered factor is minor in its dim (if it is not already), then one
   **all-gather** per gathered dim;
5. both tiled: split or merge one dim so an all-to-all applies; replicate one dim first; hold
   the dims with equal counts fixed and reshard the rest inside each group;
6. otherwise the *involuntary full rematerialisation*: all-gather every split dim (last first)
   to the full tensor, then slice.

The path modelled is the executor's: a value constrained to the target layout
(``with_sharding_constraint``). A jit's ``out_shardings`` compiles some pairs differently (XLA's
propagation first merges two compatible partially replicated shardings); the tests compile the constraint.

A layout here is the searchers' :data:`~searchers.graph.TensorLayout` (per tensor dim, the mesh
axes that split it, major first) on a mesh whose devices are numbered row-major (``jax.make_mesh``
order). :func:`reshard` returns the collectives as :class:`Step` values; the tests compare them
kind by kind with the compiled HLO of every layout pair on several meshes.

>>> [(s.kind, s.group) for s in reshard(((), (0,)), ((), (1,)), (2, 2, 2), (16, 32))]   # same counts
[('collective-permute', 2)]
>>> [(s.kind, s.group) for s in reshard(((0,), ()), ((), (0,)), (2, 2, 2), (16, 32))]   # dim 0 -> dim 1
[('all-to-all', 2)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .graph import TensorLayout


@dataclass(frozen=True)
class Step:
    """One collective: its kind, its group size, the per-device result size as a fraction of the
    tensor's global size, the bytes each device sends per global byte (ring formulas, as
    ``mshard.comm_report`` counts them), and the mesh axes its groups span."""

    kind: str
    group: int
    result: float
    moved: float
    axes: tuple[int, ...]


class _Sh:
    """A tile assignment: ``dev`` has shape ``tiles + (R,)``; ``dev[idx + (r,)]`` holds tile ``idx``."""

    __slots__ = ("dev",)

    def __init__(self, dev: np.ndarray):
        # the order of the devices that hold the same tile carries no meaning: kept sorted, so two
        # assignments that place every tile on the same devices are equal
        self.dev = np.sort(dev, axis=-1)

    @property
    def tiles(self) -> tuple[int, ...]:
        return tuple(self.dev.shape[:-1])

    @property
    def R(self) -> int:
        return int(self.dev.shape[-1])

    @property
    def ntiles(self) -> int:
        return math.prod(self.tiles)

    @property
    def replicated(self) -> bool:
        return self.ntiles == 1

    def __eq__(self, other) -> bool:
        return self.dev.shape == other.dev.shape and bool(np.array_equal(self.dev, other.dev))

    def __hash__(self) -> int:
        return hash((self.dev.shape, self.dev.tobytes()))


def _from_layout(layout: TensorLayout, mesh: tuple[int, ...]) -> _Sh:
    ids = np.arange(math.prod(mesh)).reshape(mesh)
    used = [a for axes in layout for a in axes]
    rest = [a for a in range(len(mesh)) if a not in used]
    tiles = tuple(math.prod(mesh[a] for a in axes) for axes in layout)
    return _Sh(ids.transpose(used + rest).reshape(tiles + (-1,)))


def _tile_of(s: _Sh) -> np.ndarray:
    """``out[device] = tile index per dim`` of a tile assignment."""
    out = np.zeros((s.dev.size, len(s.tiles)), dtype=np.int64)
    idx = np.stack(np.unravel_index(np.arange(s.dev.size), s.dev.shape), axis=-1)[:, :-1]
    out[s.dev.reshape(-1)] = idx
    return out


def _contains(big: _Sh, small: _Sh) -> bool:
    """Whether every device's tile under ``small`` lies inside its tile under ``big`` (counts divide)."""
    ratio = np.array([b // a for a, b in zip(big.tiles, small.tiles)])
    return bool((_tile_of(small) // ratio == _tile_of(big)).all())


class _Sim:
    """One simulation: the collectives so far, on a mesh, for a tensor of ``shape``."""

    def __init__(self, mesh: tuple[int, ...], shape: tuple[int, ...] | None):
        self.mesh = mesh
        self.shape = shape
        self.steps: list[Step] = []

    # -- recording ------------------------------------------------------------------------
    def _axes(self, groups: np.ndarray) -> tuple[int, ...]:
        coords = np.stack(np.unravel_index(groups, self.mesh), axis=-1)     # (..., k, naxes)
        return tuple(int(a) for a in np.nonzero((coords != coords[..., :1, :]).any(axis=tuple(range(coords.ndim - 1))))[0])

    def _emit(self, kind: str, group: int, result: float, groups: np.ndarray) -> None:
        k = max(group, 1)
        moved = {"all-gather": result * (k - 1) / k, "all-to-all": result * (k - 1) / k,
                 "collective-permute": result}[kind]
        self.steps.append(Step(kind, group, result, moved, self._axes(groups)))

    @staticmethod
    def _local(s: _Sh) -> float:
        return 1.0 / s.ntiles

    def permute(self, src: _Sh, dst: _Sh) -> _Sh:
        """A collective-permute src -> dst (same tile counts)."""
        if src != dst:
            pairs = np.stack([src.dev.reshape(-1), dst.dev.reshape(-1)], axis=-1)
            moving = pairs[pairs[:, 0] != pairs[:, 1]]
            self._emit("collective-permute", 2, self._local(src), moving)
        return dst

    # -- the entry point ------------------------------------------------------------------
    def reshard(self, src: _Sh, dst: _Sh, allow_full: bool = True) -> _Sh | None:
        if src == dst:
            return dst
        if dst.replicated:
            return self.replicate(src)
        if src.replicated:
            return dst                                      # a local slice
        if src.tiles == dst.tiles and src.R == dst.R:
            return self.permute(src, dst)
        out = self.all_to_all(src, dst)
        if out is not None:
            return out
        if src.R > 1:
            out = self.from_partial(src, dst)
            if out is None:
                out = self.shift(src, dst)
            if out is not None:
                return out
        if dst.R > 1:
            out = self.to_partial(src, dst)
            if out is None:
                out = self.shift(src, dst)
            if out is not None:
                return out
        for attempt in (self.split_merge, self.replicate_dim, self.unreplicate_into_dim, self.grouped):
            mark = len(self.steps)
            out = attempt(src, dst)
            if out is not None:
                return out
            del self.steps[mark:]
        if not allow_full:
            return None
        return self.reshard(self.replicate(src), dst)

    # -- 6. full replication ----------------------------------------------------------------
    def replicate(self, src: _Sh) -> _Sh:
        """All-gather every split dim, last dim first, to the whole tensor (the replication kept)."""
        cur = src
        for d in reversed(range(len(src.tiles))):
            if cur.tiles[d] > 1:
                cur = self._gather(cur, {d: cur.tiles[d]})
        return cur

    def _gather(self, s: _Sh, ratios: dict[int, int]) -> _Sh:
        """All-gather the minor ``ratios[d]`` factor of each dim ``d`` (last dim first) into the
        replication (gathered factors major, the old replication minor)."""
        cur = s
        for d in sorted(ratios, reverse=True):
            g = ratios[d]
            t = list(cur.tiles)
            dev = cur.dev.reshape(t[:d] + [t[d] // g, g] + t[d + 1:] + [cur.R])
            n = len(t)
            groups = np.moveaxis(dev, d + 1, -1).reshape(-1, g)
            # the gathered factor becomes the major part of the replication
            dev = np.moveaxis(dev, d + 1, n)                   # (..tiles.., g, R)
            t[d] //= g
            result = self._local(cur) * g
            cur = _Sh(dev.reshape(t + [g * cur.R]))
            self._emit("all-gather", g, result, groups)
        return cur

    # -- 2. all-to-all ------------------------------------------------------------------------
    @staticmethod
    def _ratio_pairs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int]] | None:
        """Factor moves ``(j, i)``: dim ``j`` splits ``g`` times more than the target, dim ``i`` ``g`` times
        less, e.g. tiles (1, 4) -> (2, 2) moves a factor 2 from dim 1 to dim 0."""
        cur, pairs = list(src), []
        while tuple(cur) != tuple(dst):
            found = None
            for i in range(len(cur)):
                if dst[i] <= cur[i] or dst[i] % cur[i]:
                    continue
                g = dst[i] // cur[i]
                for j in range(len(cur)):
                    if j != i and cur[j] > dst[j] and cur[j] % dst[j] == 0 and cur[j] // dst[j] == g:
                        found = (j, i, g)
                        break
                if found:
                    break
            if found is None:
                return None
            j, i, g = found
            pairs.append((j, i))
            cur[i] *= g
            cur[j] //= g
        return pairs

    def _pairs(self, src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int]] | None:
        diff = [d for d in range(len(src)) if src[d] != dst[d]]
        if not diff:
            return None
        if sorted(src[d] for d in diff) != sorted(dst[d] for d in diff):
            return self._ratio_pairs(src, dst) if math.prod(src) == math.prod(dst) else None
        cur = list(src)
        pairs = []
        while True:
            todo = [d for d in range(len(cur)) if cur[d] != dst[d]]
            if not todo:
                return pairs
            s = min(cur[d] for d in todo)
            i = max(d for d in todo if cur[d] == s)
            t = dst[i]
            cand = [j for j in todo if j != i and cur[j] == t]
            if not cand or (s != 1 and t % s):
                return None
            pref = [j for j in cand if (s == 1 and dst[j] != 1) or (s != 1 and t % s == 0 and dst[j] == s)]
            j = (pref or cand)[0]
            pairs.append((j, i))
            cur[i], cur[j] = t, s

    def _move(self, s: _Sh, j: int, i: int, g: int) -> _Sh:
        """Move the minor ``g`` factor of dim ``j`` to be the minor factor of dim ``i``."""
        t = list(s.tiles)
        dev = s.dev.reshape(t[:j] + [t[j] // g, g] + t[j + 1:] + [s.R])
        dev = np.moveaxis(dev, j + 1, i + 1)              # the g factor right after dim i: its minor part
        t[i] *= g
        t[j] //= g
        return _Sh(dev.reshape(t + [s.R]))

    def all_to_all(self, src: _Sh, dst: _Sh) -> _Sh | None:
        if src.replicated or dst.replicated or (src.R > 1) != (dst.R > 1) or src.ntiles != dst.ntiles:
            return None
        pairs = self._pairs(src.tiles, dst.tiles)
        if pairs is None:
            return None
        cur = src
        while cur.tiles != dst.tiles:
            pairs = self._pairs(cur.tiles, dst.tiles)
            if not pairs:
                return None
            chosen: list[tuple[int, int]] = []
            used: set[int] = set()
            for j, i in sorted(pairs, key=lambda p: p[1]):
                if j not in used and i not in used:
                    chosen.append((j, i))
                    used |= {i, j}
            if len(chosen) < 2:
                chosen = [pairs[0]]
            before = self._local(cur)
            gs = 1
            group_axes = []
            swap = 1
            for j, i in chosen:
                g = dst.tiles[i] // cur.tiles[i]
                if dst.tiles[j] == cur.tiles[i] and len(chosen) == 1:
                    swap = cur.tiles[j] // g           # XLA exchanges over the whole source dim
                cur = self._move(cur, j, i, g)
                gs *= g
                group_axes.append((i, g))
            # the group: devices differing only in the moved (now minor) factors of the target dims
            t = list(cur.tiles)
            shape, minor = [], []
            for d, c in enumerate(t):
                g = dict(group_axes).get(d)
                if g:
                    shape += [c // g, g]
                    minor.append(len(shape) - 1)
                else:
                    shape.append(c)
            shape.append(cur.R)
            dev = cur.dev.reshape(shape)
            keep = [a for a in range(len(shape)) if a not in minor]
            groups = dev.transpose(keep + minor).reshape(-1, gs)
            self._emit("all-to-all", gs * swap, before, groups)
        return self.permute(cur, dst)

    # -- 3. less replication: local slice -------------------------------------------------------
    def from_partial(self, src: _Sh, dst: _Sh) -> _Sh | None:
        n = len(src.tiles)
        if any(dst.tiles[d] % src.tiles[d] for d in range(n)):
            return None
        e = [dst.tiles[d] // src.tiles[d] for d in range(n)]
        pe = math.prod(e)
        if src.R % pe or src.R // pe != dst.R:
            return None
        if _contains(src, dst):
            return dst                                          # every device slices its own tile
        # the source's replication split into (expand factors in dim order, leftover); each factor minor in its dim
        dev = src.dev.reshape(list(src.tiles) + [x for x in e] + [dst.R])
        order = []
        for d in range(n):
            order += [d, n + d]
        order.append(2 * n)
        temp = _Sh(dev.transpose(order).reshape(list(dst.tiles) + [dst.R]))
        return self.permute(temp, dst)

    # -- 4. more replication: all-gather ------------------------------------------------------
    def to_partial(self, src: _Sh, dst: _Sh) -> _Sh | None:
        n = len(src.tiles)
        if any(src.tiles[d] % dst.tiles[d] for d in range(n)):
            return None
        ratios = {d: src.tiles[d] // dst.tiles[d] for d in range(n) if src.tiles[d] != dst.tiles[d]}
        pr = math.prod(ratios.values())
        if dst.R % pr or dst.R // pr != src.R:
            return None
        # does gathering src directly give dst (ratios major or minor in the new replication)?
        for major in (True, False):
            if self._gathered(src, ratios, major) == dst:
                return self._gather_as(src, ratios, dst)
        # temp from the target: its replication split into (ratios in dim order, src.R), each ratio minor in its dim
        rs = [ratios[d] for d in sorted(ratios)]
        dev = dst.dev.reshape(list(dst.tiles) + rs + [src.R])
        order = []
        k = 0
        for d in range(n):
            order.append(d)
            if d in ratios:
                order.append(n + k)
                k += 1
        order.append(n + k)
        temp = _Sh(dev.transpose(order).reshape(list(src.tiles) + [src.R]))
        self.permute(src, temp)
        return self._gather_as(temp, ratios, dst)

    def _gathered(self, s: _Sh, ratios: dict[int, int], major: bool) -> _Sh:
        n = len(s.tiles)
        shape, rat_axes = [], []
        for d in range(n):
            if d in ratios:
                shape += [s.tiles[d] // ratios[d], ratios[d]]
                rat_axes.append(len(shape) - 1)
            else:
                shape.append(s.tiles[d])
        shape.append(s.R)
        dev = s.dev.reshape(shape)
        keep = [a for a in range(len(shape) - 1) if a not in rat_axes]
        rep = [len(shape) - 1]
        order = keep + (rat_axes + rep if major else rep + rat_axes)
        tiles = [s.tiles[d] // ratios.get(d, 1) for d in range(n)]
        return _Sh(dev.transpose(order).reshape(tiles + [-1]))

    def _gather_as(self, s: _Sh, ratios: dict[int, int], dst: _Sh) -> _Sh:
        self._gather(s, ratios)
        return dst

    # -- 3b/4b. the shift pattern [1, t0, .., tk] + R = tk  <->  [t0, .., tk] ---------------
    def shift(self, src: _Sh, dst: _Sh) -> _Sh | None:
        P, T = (src, dst) if src.R > 1 else (dst, src)
        if T.R != 1 or P.R == 1 or P.tiles[0] != 1 or P.tiles[1:] + (P.R,) != T.tiles:
            return None
        if not np.array_equal(P.dev.reshape(T.tiles), T.dev.reshape(T.tiles)):
            return None
        last = max(d for d, c in enumerate(T.tiles) if c > 1)
        if T.tiles[last] != P.R:
            return None
        t = list(T.tiles)
        t[last] = 1
        tmp = _Sh(T.dev.reshape(t + [P.R]))
        if P is src:
            got = self.all_to_all(src, tmp)
            return None if got is None else dst                   # then a local slice
        self._gather(src, {last: P.R})
        return self.all_to_all(tmp, dst)

    # -- 5. both tiled ------------------------------------------------------------------------
    def _split(self, s: _Sh, i: int, m: int) -> _Sh:
        t = list(s.tiles)
        return _Sh(s.dev.reshape(t[:i] + [m, t[i] // m] + t[i + 1:] + [s.R]))

    def _merge(self, s: _Sh, i: int) -> _Sh:
        t = list(s.tiles)
        return _Sh(s.dev.reshape(t[:i] + [t[i] * t[i + 1]] + t[i + 2:] + [s.R]))

    def split_merge(self, src: _Sh, dst: _Sh) -> _Sh | None:
        if (src.R > 1) != (dst.R > 1) or src.R != dst.R:
            return None
        n = len(src.tiles)
        d1, d2 = [], []
        for d in range(n):
            s, t = src.tiles[d], dst.tiles[d]
            if s == t:
                continue
            if s == 1 or t == 1:
                d1.append(d)
            elif max(s, t) % min(s, t) == 0 and (self.shape is None or
                                                 (-(-self.shape[d] // min(s, t)) * min(s, t)) % max(s, t) == 0):
                d2.append(d)
        pick = None
        for i in d2:
            for j in d1:
                if src.tiles[i] * src.tiles[j] == dst.tiles[i] * dst.tiles[j]:
                    pick = (i, min(src.tiles[i], dst.tiles[i]))
                    break
            if pick:
                break
        if pick is None:
            for i in d2:
                if src.tiles[i] > dst.tiles[i]:
                    pick = (i, dst.tiles[i])
                    break
        if pick is None:
            return None
        i, m = pick
        sub = _Sim(self.mesh, None if self.shape is None else self.shape[:i] + (m, self.shape[i] // m) + self.shape[i + 1:])
        got = sub.reshard(self._split(src, i, m), self._split(dst, i, m), allow_full=False)
        if got is None:
            return None
        self.steps += sub.steps
        merged = self._merge(got, i)
        if merged == dst:
            return dst
        return self.reshard(merged, dst, allow_full=False)

    def replicate_dim(self, src: _Sh, dst: _Sh) -> _Sh | None:
        if dst.R <= 1:
            return None
        for i, s in enumerate(src.tiles):
            if s > 1 and s * src.R == dst.R:
                mid = self._gather(src, {i: s})
                return self.reshard(mid, dst, allow_full=False)
        return None

    def unreplicate_into_dim(self, src: _Sh, dst: _Sh) -> _Sh | None:
        if src.R <= 1 or dst.R > 1:
            return None
        for i in range(len(src.tiles)):
            if src.tiles[i] == 1 and dst.tiles[i] != 1 and dst.tiles[i] % src.R == 0:
                dev = np.swapaxes(src.dev, i, len(src.tiles))      # the replicas now tile dim i (a local slice)
                return self.reshard(_Sh(dev), dst, allow_full=False)
        return None

    def grouped(self, src: _Sh, dst: _Sh) -> _Sh | None:
        n = len(src.tiles)
        E = [d for d in range(n) if src.tiles[d] > 1 and src.tiles[d] == dst.tiles[d]]
        if not E:
            return None
        rest = [d for d in range(n) if d not in E]
        # one group per tile index on E: the devices, in the source's (and target's) order
        def groups(s: _Sh) -> np.ndarray:
            return s.dev.transpose(E + rest + [n]).reshape([s.tiles[d] for d in E] + [-1])
        gs, gd = groups(src), groups(dst)
        same = all(set(a.tolist()) == set(b.tolist()) for a, b in zip(gs.reshape(-1, gs.shape[-1]),
                                                                       gd.reshape(-1, gd.shape[-1])))
        src0 = src.dev.transpose(E + rest + [n]).reshape([-1] + [src.tiles[d] for d in rest] + [src.R])[0]
        dst0 = dst.dev.transpose(E + rest + [n]).reshape([-1] + [dst.tiles[d] for d in rest] + [dst.R])[0]
        pos = {int(v): k for k, v in enumerate(src0.reshape(-1))}
        local_src = np.arange(src0.size).reshape(src0.shape)
        if same:
            local_dst = np.vectorize(pos.__getitem__)(dst0)
        else:
            local_dst = np.arange(dst0.size).reshape(dst0.shape)
        sub_mesh = (src0.size,)
        sub = _Sim(sub_mesh, None if self.shape is None else tuple(self.shape[d] for d in rest))
        got = sub.reshard(_Sh(local_src), _Sh(local_dst))
        if got is None:
            return None
        # the sub-simulation's groups are in-group positions: map them back to group 0's devices
        share = math.prod(src.tiles[d] for d in E)           # one group holds 1/share of the tensor
        axes = self._axes(src0.reshape(1, -1))
        self.steps += [Step(st.kind, st.group, st.result / share, st.moved / share, axes) for st in sub.steps]
        if same:
            return dst
        # the grouped result: every group's devices placed as the local target says, then a permute
        layout = gs.reshape(-1, gs.shape[-1])[:, local_dst.reshape(-1)]
        shape = [src.tiles[d] for d in E] + [dst.tiles[d] for d in rest] + [dst.R]
        inv = np.argsort(E + rest + [n])
        got_full = _Sh(layout.reshape(shape).transpose(inv))
        return self.permute(got_full, dst)


@lru_cache(maxsize=1 << 16)
def reshard(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...],
            shape: Sequence[int] | None = None) -> tuple[Step, ...]:
    """The collectives XLA compiles to take a tensor of global ``shape`` from layout ``src`` to ``dst``
    on a row-major mesh of ``mesh`` axis sizes; ``()`` when a local slice (or nothing) is enough.
    Without ``shape`` every dim is taken to divide evenly by its tile counts."""
    # a dim that no mesh axis splits on either side takes no part: dropped, so that the many layout pairs
    # of a high-rank tensor share the simulations of the few that differ (the searchers ask for thousands)
    keep = [d for d in range(len(src)) if src[d] or dst[d]] or [0]
    src = tuple(tuple(src[d]) for d in keep)
    dst = tuple(tuple(dst[d]) for d in keep)
    shape = None if shape is None else tuple(int(shape[d]) for d in keep)
    return _reshard(src, dst, tuple(mesh), shape)


@lru_cache(maxsize=1 << 16)
def _reshard(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...],
             shape: tuple[int, ...] | None) -> tuple[Step, ...]:
    sim = _Sim(mesh, shape)
    sim.reshard(_from_layout(src, mesh), _from_layout(dst, mesh))
    return tuple(sim.steps)
