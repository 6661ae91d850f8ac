"""Shared test helpers: single-device references and shard-shape checks."""

import jax
import numpy as np

RTOL = 1e-5   # float32 sums over at most a few hundred terms, reordered by the partitioning
ATOL = 1e-5


def on_one_device(fn, *args):
    """The same computation on one device (plain JAX, no mshard region)."""
    dev = jax.devices()[0]
    return jax.jit(fn)(*[jax.device_put(a, dev) if hasattr(a, "shape") else a for a in args])


def assert_close(a, b, rtol=RTOL, atol=ATOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def split_counts(arr) -> tuple[int, ...]:
    """How many slices each dim of a global array is cut into (from its sharding, not from mshard)."""
    shard = arr.sharding.shard_shape(arr.shape)
    return tuple(n // s for n, s in zip(arr.shape, shard))


def rand(key, *shape):
    return jax.random.normal(jax.random.key(key), shape, dtype=np.float32)
