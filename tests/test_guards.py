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


def _chain(x, w1, w2, act):
    return jnp.sum(act(jax.lax.conv_general_dilated(
        jax.lax.conv_general_dilated(x, w1, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")),
        w2, (1, 1), [(1, 1), (1, 1)], dimension_numbers=("NCHW", "OIHW", "NCHW"))))


def _r13_data():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((8, 4, 6, 6)), jnp.float32),
            jnp.asarray(rng.standard_normal((4, 4, 1, 1)), jnp.float32),
            jnp.asarray(rng.standard_normal((6, 4, 2, 1)), jnp.float32))


@pytest.mark.parametrize("mode", ["semi_auto", "dynamic_programming", "recursive_programming",
                                  "sharding_propagation"])
def test_conv_chain_split_on_width_after_it_has_the_right_weight_gradient(mode):
    """r13: a conv chain whose output is split on W gets a wrong weight gradient from plain jax.jit (dw2 off by 218
    where |dw2| <= 73). mshard pins each conv's result to the layout it computes in (W whole: a padded window is
    not split) and slices afterwards, so the gradient is right in every mode."""
    kw = ({"parallel_mode": "semi_auto_parallel"} if mode == "semi_auto" else
          {"parallel_mode": "auto_parallel", "search_mode": mode})
    ms.set_auto_parallel_context(device_num=8, dataset_strategy="full_batch", **kw)
    x, w1, w2 = _r13_data()
    act = ops.Tanh().shard(((1, 1, 1, 2),))
    g = ms.jit(jax.grad(lambda w2, w1, x: _chain(x, w1, w2, act)))(w2, w1, x)
    r = jax.grad(lambda w2, w1, x: _chain(x, w1, w2, jnp.tanh))(w2, w1, x)
    # float32: each dw2 entry sums 8*7*8 = 448 products of order 1 (|dw2| <= 73), reordered by the partitioning
    assert_close(g, r, rtol=1e-4, atol=1e-3)


@pytest.mark.xfail(strict=True, reason="XLA (JAX 0.10) computes a wrong weight gradient for a conv chain whose output "
                                       "is constrained on W (../shared/repro/r13_conv_chain_w_split_grad_plain_jax.py)")
def test_plain_xla_still_miscompiles_the_width_split_conv_chain():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    x, w1, w2 = _r13_data()

    def act(y):
        return jnp.sin(jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, None, None, "a"))))
    g = jax.jit(jax.grad(lambda w2, w1, x: _chain(x, w1, w2, act)))(w2, w1, x)
    assert_close(g, jax.grad(lambda w2, w1, x: _chain(x, w1, w2, jnp.sin))(w2, w1, x), rtol=1e-4, atol=1e-3)


def _r11_loss(x, relu, sl, sq):
    return jnp.sum(sq(sl(relu(x), (0, 2), (4, 3), (1, 2))))


def test_strided_slice_gradient_on_a_split_dim_equals_one_device():
    """r11: the gradient of a stride-2 StridedSlice on a dim an annotated producer splits leaks into the next
    column under plain jax.jit; through mshard (every op pinned) it equals one device."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)
    ops_ = (ops.ReLU().shard(((1, 2),)), ops.StridedSlice(), ops.Square().shard(((1, 1),)))
    g = ms.jit(jax.grad(lambda x: _r11_loss(x, *ops_)))(x)
    plain = (jax.nn.relu, ops.StridedSlice(), jnp.square)
    assert_close(g, jax.grad(lambda x: _r11_loss(x, *plain))(x))       # 4 rows, 1 column: no sums to reorder


@pytest.mark.xfail(strict=True, reason="XLA (JAX 0.10) leaks a strided slice's cotangent into the next column when "
                                       "the sliced dim is split (../shared/repro/r11_strided_slice_grad.py)")
def test_plain_xla_still_miscompiles_the_strided_slice_gradient():
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)

    def plain(x):
        x = jax.lax.with_sharding_constraint(jax.nn.relu(x), NamedSharding(mesh, P(None, "a")))
        return jnp.sum(jax.lax.with_sharding_constraint(x[:, 2:3:2], NamedSharding(mesh, P())) ** 2)
    assert_close(jax.jit(jax.grad(plain))(x), jax.grad(lambda x: jnp.sum(jax.nn.relu(x)[:, 2:3:2] ** 2))(x))
