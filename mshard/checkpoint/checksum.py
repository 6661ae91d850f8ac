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
changed.

>>> import numpy as np, jax.numpy as jnp
>>> x = jnp.arange(12.0).reshape(3, 4)
>>> s = block_sums([x], [(1, 2)])[0]
>>> s.shape, bool((total(s) == block_sums([x], [(1, 1)])[0].reshape(2)).all())
((1, 2, 2), True)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_M1, _C1 = np.uint32(0x9E3779B1), np.uint32(0x632BE5AB)
_M2, _M3 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


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


def _hashes(x: jax.Array) -> jax.Array:
    """Per element: the two lanes, shape ``x.shape + (2,)``."""
    b = _bits(x)
    idx = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * np.uint32(stride % 2**32)
        stride *= x.shape[d]
    w = (idx * _M1 + _C1) | np.uint32(1)
    m = (b ^ (b >> 16)) * _M2
    m = (m ^ (m >> 13)) * _M3
    return jnp.stack([b * w, m * (w ^ _M2 | np.uint32(1))], axis=-1)


def _block(x: jax.Array, grid: tuple[int, ...]) -> jax.Array:
    h = _hashes(x)
    shape = []
    for n, g in zip(x.shape, grid):
        shape += [g, n // g]
    h = h.reshape(*shape, 2)
    return jnp.sum(h, axis=tuple(range(1, 2 * x.ndim, 2)), dtype=jnp.uint32)


@functools.lru_cache(maxsize=64)
def _fn(grids: tuple, out_sharding):
    return jax.jit(lambda xs: [_block(x, g) for x, g in zip(xs, grids)], out_shardings=out_sharding)


def block_sums(xs: list, grids: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Per array: its lanes per block of ``grid`` (``grid[d]`` equal blocks along dim d), as host uint32 arrays
    of shape ``grid + (2,)``. One jitted program per device set; every process of a multi-process job calls it
    (it is a collective over global arrays) and gets the same values."""
    out: list = [None] * len(xs)
    groups: dict = {}
    for i, x in enumerate(xs):
        groups.setdefault(tuple(sorted(d.id for d in x.sharding.device_set)), []).append(i)
    for ids, idx in groups.items():
        devs = {d.id: d for i in idx for d in xs[i].sharding.device_set}
        mesh = jax.sharding.Mesh(np.array([devs[k] for k in ids]), ("all",))
        rep = NamedSharding(mesh, PartitionSpec())
        res = _fn(tuple(tuple(grids[i]) for i in idx), rep)([xs[i] for i in idx])
        for i, r in zip(idx, res):
            out[i] = np.asarray(r.addressable_shards[0].data)
    return out


def total(blocks: np.ndarray) -> np.ndarray:
    """The whole array's two lanes from its block sums (mod 2**32)."""
    return np.asarray(blocks, np.uint64).reshape(-1, 2).sum(axis=0).astype(np.uint64) % np.uint64(2**32)


def grid_of(x: jax.Array) -> tuple[int, ...]:
    """The shard grid of ``x``'s layout: how many distinct slices each dim is cut into."""
    shard = x.sharding.shard_shape(x.shape)
    return tuple(n // s if s else 1 for n, s in zip(x.shape, shard))
