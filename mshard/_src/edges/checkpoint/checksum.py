"""Content checksums of global arrays, independent of how the array is laid out.

Orbax checksums its index but not the array data (a flipped bit in a chunk restores silently wrong values), so
mshard records its own. The checksum of a leaf is two 32-bit lanes of position-weighted sums of the element
bits, taken mod 2**32: lane 1 is ``sum(bits[i] * w[i])`` with ``w[i]`` odd (so any single flipped bit changes
it: ``2**k * odd`` is never 0 mod 2**32), lane 2 mixes the bits first so that errors which cancel in lane 1
rarely cancel in both. Integer addition mod 2**32 is exact and order free, so the value does not depend on the
array's sharding, the device count or the reduction order: it is computed on the saved layout and verified on
whatever layout the checkpoint is restored into.

It is computed per *block* of a grid (the saved layout's shard grid); the blocks' sums add up to the whole
array's, so a restore checks one number per leaf and, on a mismatch, finds the block (and the chunk file) that
changed. Each device hashes its own shard in slices of at most ``CHUNK`` elements (a ``shard_map``; replicas of a
shard are counted once), so the extra memory is a few slices per device, never a copy of the array.

>>> import numpy as np, jax.numpy as jnp
>>> x = jnp.arange(12.0).reshape(3, 4)
>>> s = block_sums([x], [(1, 2)])[0]
>>> s.shape, bool((total(s) == block_sums([x], [(1, 1)])[0].reshape(2)).all())
((1, 2, 2), True)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_M1, _C1 = np.uint32(0x9E3779B1), np.uint32(0x632BE5AB)
_M2, _M3 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
CHUNK = 1 << 18          # elements hashed at once per device


def _bits(x: jax.Array) -> jax.Array:
    """The element bits as uint32, shape ``x.shape``."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        return jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32)
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)            # 8 bytes: a trailing dim of 2 words
    return u[..., 0] ^ (u[..., 1] * _M3)


def _strides(shape) -> list[int]:
    out, s = [], 1
    for n in reversed(shape):
        out.append(s)
        s *= n
    return out[::-1]


def _local(xl: jax.Array, offsets: list, gshape: tuple, grid: tuple) -> jax.Array:
    """Lane sums per block of ``grid`` of one device's shard ``xl`` (its first element at global ``offsets``),
    hashed in slices of ``CHUNK`` elements: shape ``(prod(grid), 2)``."""
    lshape = xl.shape
    n = math.prod(lshape)
    nblocks = math.prod(grid)
    flat = xl.reshape(-1)
    lstr, gstr, bstr = _strides(lshape), _strides(gshape), _strides(grid)
    bsize = [g // b for g, b in zip(gshape, grid)]
    # a shard inside one block (the saved grid is the shard grid): one block id for the whole shard
    whole = all(bs % ls == 0 for bs, ls in zip(bsize, lshape))

    def part(start, size):
        seg = jax.lax.dynamic_slice(flat, (start,), (size,)) if size < n else flat
        f = jnp.asarray(start, jnp.uint32) + jax.lax.iota(jnp.uint32, size)
        g = jnp.zeros((size,), jnp.uint32)
        blk = jnp.zeros((size,), jnp.int32)
        for d in range(len(lshape)):
            i = (f // np.uint32(lstr[d])) % np.uint32(lshape[d]) + offsets[d]
            g = g + i * np.uint32(gstr[d] % 2**32)
            if not whole and nblocks > 1:
                blk = blk + (i // np.uint32(bsize[d])).astype(jnp.int32) * bstr[d]
        b = _bits(seg)
        w = (g * _M1 + _C1) | np.uint32(1)
        m = (b ^ (b >> 16)) * _M2
        m = (m ^ (m >> 13)) * _M3
        h1, h2 = b * w, m * (w ^ _M2 | np.uint32(1))
        if whole or nblocks == 1:
            return jnp.stack([jnp.sum(h1, dtype=jnp.uint32), jnp.sum(h2, dtype=jnp.uint32)])[None]
        return jnp.stack([jax.ops.segment_sum(h1, blk, nblocks), jax.ops.segment_sum(h2, blk, nblocks)], axis=-1)

    k = min(n, CHUNK) if n else 0
    full = n // k if k else 0
    acc = jnp.zeros((1 if whole else nblocks, 2), jnp.uint32)
    if full == 1:
        acc = acc + part(0, k)
    elif full > 1:
        acc = jax.lax.fori_loop(0, full, lambda c, a: a + part(c * k, k), acc)
    if n - full * k:
        acc = acc + part(full * k, n - full * k)
    if whole and nblocks > 1:
        bid = sum((offsets[d] // np.uint32(bsize[d])).astype(jnp.int32) * bstr[d] for d in range(len(lshape)))
        acc = jnp.zeros((nblocks, 2), jnp.uint32).at[bid].set(acc[0])
    return acc


def _one(x: jax.Array, grid: tuple, sharding) -> jax.Array:
    """The (prod(grid), 2) lane sums of global ``x`` laid out by ``sharding``."""
    if not isinstance(sharding, NamedSharding) or not x.ndim:
        return _local(x, [np.uint32(0)] * x.ndim, x.shape, grid)
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    used = [a for d in spec if d is not None for a in ((d,) if isinstance(d, str) else d)]
    free = [a for a in mesh.axis_names if a not in used]
    lshape = sharding.shard_shape(x.shape)

    def body(xl):
        offs = []
        for d, axes in enumerate(spec):
            if axes is None:
                offs.append(np.uint32(0))
                continue
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            offs.append(jax.lax.axis_index(axes).astype(jnp.uint32) * np.uint32(lshape[d]))
        acc = _local(xl, offs, x.shape, grid)
        if free:                        # a shard held by several devices counts once
            first = jnp.all(jnp.stack([jax.lax.axis_index(a) == 0 for a in free]))
            acc = jnp.where(first, acc, jnp.zeros_like(acc))
        return jax.lax.psum(acc, tuple(mesh.axis_names))

    return jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(*spec),), out_specs=PartitionSpec(),
                         check_vma=False)(x)


@functools.lru_cache(maxsize=64)
def _fn(grids: tuple, shardings: tuple, out_sharding):
    return jax.jit(lambda xs: [_one(x, g, sh) for x, g, sh in zip(xs, grids, shardings)],
                   out_shardings=out_sharding)


def block_sums(xs: list, grids: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Per array: its lanes per block of ``grid`` (``grid[d]`` equal blocks along dim d), as host uint32 arrays
    of shape ``grid + (2,)``. One jitted program per device set; every process of a multi-process job calls it
    (it is a collective over global arrays) and gets the same values."""
    out: list = [None] * len(xs)
    groups: dict = {}
    # an array kept in host memory (offloaded optimizer state) is hashed from a device copy of it
    xs = [jax.device_put(x, x.sharding.with_memory_kind("device"))
          if getattr(x.sharding, "memory_kind", None) not in (None, "device") else x for x in xs]
    for i, x in enumerate(xs):
        groups.setdefault(tuple(sorted(d.id for d in x.sharding.device_set)), []).append(i)
    for ids, idx in groups.items():
        devs = {d.id: d for i in idx for d in xs[i].sharding.device_set}
        rep = NamedSharding(jax.sharding.Mesh(np.array([devs[k] for k in ids]), ("all",)), PartitionSpec())
        fn = _fn(tuple(tuple(grids[i]) for i in idx), tuple(xs[i].sharding for i in idx), rep)
        for i, r in zip(idx, fn([xs[i] for i in idx])):
            out[i] = np.asarray(r.addressable_shards[0].data).reshape(*grids[i], 2)
    return out


def total(blocks: np.ndarray) -> np.ndarray:
    """The whole array's two lanes from its block sums (mod 2**32)."""
    return np.asarray(blocks, np.uint64).reshape(-1, 2).sum(axis=0) % np.uint64(2**32)


def grid_of(x: jax.Array) -> tuple[int, ...]:
    """The shard grid of ``x``'s layout: how many distinct slices each dim is cut into."""
    shard = x.sharding.shard_shape(x.shape)
    return tuple(n // s if s else 1 for n, s in zip(x.shape, shard))
