"""Guards for layouts XLA miscompiles (mshard.guards; issue 13): each guarded strategy equals one device through
mshard, and a strict xfail shows plain jax.jit is still wrong. When a JAX upgrade fixes XLA, the xfail passes,
the test fails, and says to lift the guard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mshard as ms
from mshard import ops


def conv(a, b):
    return jax.lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))


CASES = [  # (x shape, kernel shape, Conv2D strategy): the r1 reproducer, and a 3x3 conv with H or W split
    ((1, 1, 4, 1), (2, 1, 2, 1), ((1, 1, 2, 1), (2, 1, 1, 1))),
    ((2, 4, 8, 8), (8, 4, 3, 3), ((1, 1, 2, 1), (2, 1, 1, 1))),
    ((2, 4, 8, 8), (8, 4, 3, 3), ((1, 1, 1, 2), (4, 1, 1, 1))),
]


def data(xs, ks):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal(xs), jnp.float32), jnp.asarray(rng.standard_normal(ks), jnp.float32)


@pytest.mark.parametrize("xs, ks, st", CASES)
def test_conv_with_halo_and_out_channel_split_equals_one_device(xs, ks, st):
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
    x, k = data(xs, ks)
    op = ops.Conv2D(ks[0], ks[2:], pad_mode="same").shard(st)
    f = ms.jit(lambda a, b: op(a, b))
    y = f(x, k)
    # float32: each output sums C*kh*kw <= 36 products, in another order on the halo'd shards
    assert_close(y, conv(x, k))
    assert y.sharding.shard_shape(y.shape)[1] == ks[0] // st[1][0]       # out-channels split as asked
    assert any("guard conv_halo_out_channels" in n for n in f.plan(x, k).notes)
    loss = ms.jit(jax.grad(lambda a, b: jnp.sum(op(a, b) ** 2), argnums=(0, 1)))
    gx, gk = loss(x, k)
    rx, rk = jax.grad(lambda a, b: jnp.sum(conv(a, b) ** 2), argnums=(0, 1))(x, k)
    # float32: gradients sum up to N*H*W = 128 products per kernel entry, reordered by the partitioning
    assert_close(gx, rx, rtol=1e-4, atol=1e-4)
    assert_close(gk, rk, rtol=1e-4, atol=1e-4)


@pytest.mark.xfail(strict=True, reason="XLA (JAX 0.10) miscompiles a conv whose input is split across the kernel "
                                       "window while its kernel is split on out-channels (../shared/repro/"
                                       "r1_conv_halo_outfeature.py); if this passes, lift mshard.guards' guard")
def test_plain_xla_still_miscompiles_the_guarded_conv():
    mesh = jax.make_mesh((2, 2, 2), ("d0", "d1", "d2"), axis_types=(AxisType.Auto,) * 3)
    x, k = data((2, 4, 8, 8), (8, 4, 3, 3))

    def g(a, b):
        a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(None, None, "d0", None)))
        b = jax.lax.with_sharding_constraint(b, NamedSharding(mesh, P("d1", None, None, None)))
        return jax.lax.with_sharding_constraint(conv(a, b), NamedSharding(mesh, P(None, "d1", "d0", None)))
    assert_close(jax.jit(g)(x, k), conv(x, k))
