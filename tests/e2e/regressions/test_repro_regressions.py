"""Regression tests for the mshard bugs the differential fuzzer found (issue 13, docs/xla_repro/): each but r9
failed on main (be1613b) with a bare Python error or a refusal of valid input."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close

import mshard as ms
from mshard import nn, ops
from mshard.errors import DatasetStrategyError, StrategyError, StrategyIgnoredWarning


def test_r4_stand_alone_ignores_a_strategy_valid_for_device_num():
    """Was StrategyError 'splits over 2 devices, which exceeds device_num=1'."""
    ms.set_auto_parallel_context(parallel_mode="stand_alone", device_num=8)
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    x, w = jnp.arange(32.0).reshape(8, 4), jnp.arange(32.0).reshape(4, 8) / 7
    with pytest.warns(StrategyIgnoredWarning, match="stand_alone"):
        y = ms.jit(lambda a, b: mm(a, b))(x, w)
    assert_close(y, x @ w)


@pytest.mark.parametrize("st, src, dst", [((1, 1, 4), (2, 1, 12), (2, 12)), ((1, 4), (2, 12), (2, 1, 12))])
def test_r5_reshape_dropping_or_adding_a_size1_dim_keeps_the_split(st, src, dst):
    """Was StrategyError: the size-1 dim led its run of the reshape, so the 12-dim counted as 'broadcast'."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    x = jnp.arange(float(np.prod(src))).reshape(src)
    y = ms.jit(lambda a: ops.Reshape().shard((st,))(a, dst))(x)
    assert y.shape == dst and jnp.array_equal(y, x.reshape(dst))     # a reshape moves values, no arithmetic
    assert y.sharding.shard_shape(y.shape)[-1] == 3                  # the 12-dim split 4 ways, as asked


def test_r6_tuple_dataset_strategy_counts_data_arguments_not_cells():
    """Was a bare AssertionError((2, 1),) when the Cell came first: the region indexed dataset_strategy by argument
    position, counting the Cell."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy=((2, 1),))
    net = nn.Dense(6, 8, rngs=nnx.Rngs(0))
    x = jnp.arange(48.0).reshape(8, 6) / 10
    a = ms.jit(lambda a, n: n(a))(x, net)
    b = ms.jit(lambda n, a: n(a))(net, x)
    assert_close(a, b)
    assert b.sharding.shard_shape(b.shape)[0] == 4                    # (2, 1): the batch cut in 2
    with pytest.raises(DatasetStrategyError, match="data argument 1"):
        ms.jit(lambda n, a, c: n(a) + c)(net, x, jnp.ones((8, 8)))     # two data arguments, one entry


def test_r12_impossible_reshape_is_a_strategy_error():
    """Was IndexError from Reshape.spec."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    with pytest.raises(StrategyError, match=r"Reshape: cannot reshape an array of shape \(1, 6\)"):
        ms.jit(lambda a: ops.Reshape()(a, (8, 3, 2)))(jnp.ones((1, 6)))


def test_r14_a_region_composes_with_jit_grad_and_vmap():
    """Was ConcretizationTypeError (placing inputs read ``.committed`` on a tracer). Inside a JAX transform the
    region constrains its inputs to the planned layouts and traces its program into the caller's."""
    import jax
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    f = ms.jit(ms.shard(lambda x, w: jnp.tanh(x @ w), in_strategy=((8, 1), (1, 1))))
    x = jnp.arange(64.0).reshape(16, 4) / 64
    w = jnp.arange(16.0).reshape(4, 4) / 16 - 0.5

    def plain(x, w):
        return jnp.tanh(x @ w)
    assert_close(jax.jit(f)(x, w), plain(x, w))
    g = jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(x, w)
    g0 = jax.grad(lambda x, w: plain(x, w).sum(), argnums=(0, 1))(x, w)
    assert_close(g[0], g0[0])
    assert_close(g[1], g0[1])
    xs = jnp.stack([x, 2 * x])
    assert_close(jax.vmap(f, in_axes=(0, None))(xs, w), jax.vmap(plain, in_axes=(0, None))(xs, w))


def test_r8_data_parallel_training_ignores_strategies_written_for_the_global_batch():
    """Was StrategyError: the per-replica run checked (8, 1) against one replica's 2 rows."""
    import jax
    import optax
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)

    class Net(nn.Cell):
        def __init__(self, strategy):
            self.w = nnx.Param(jnp.arange(8.0).reshape(4, 2) / 8)
            self.mm = ops.MatMul().shard(strategy) if strategy else ops.MatMul()

        def __call__(self, x):
            return self.mm(x, self.w[...])
    x = jnp.arange(64.0).reshape(16, 4) / 64
    y = jnp.arange(32.0).reshape(16, 2) / 32
    net = Net(((8, 1), (1, 1)))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optax.sgd(0.1))
    with pytest.warns(StrategyIgnoredWarning):
        loss = step(x, y)
    w0 = jnp.arange(8.0).reshape(4, 2) / 8
    ref_loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w0)
    # float32: a 16x2 mean of squares and a 16-row gradient sum, reordered over the 8 replicas
    assert_close(loss, ref_loss)
    # gradients_mean unset: the gradient of the global-batch loss, as on one device (README, "Gradients")
    assert_close(net.w[...], w0 - 0.1 * g)


def test_r9_grouped_conv_with_out_channels_split_matches_one_device():
    """The fuzzer's INVALID_ARGUMENT from XLA (Conv2D(group=2), out-channels split 2); already right on be1613b (an
    earlier conv-rule fix), kept as the repro's regression test, forward and weight gradient."""
    import jax
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
    x = jnp.arange(4 * 4 * 6 * 6, dtype=jnp.float32).reshape(4, 4, 6, 6) / 500
    w = jnp.arange(4.0).reshape(2, 2, 1, 1)
    conv = ops.Conv2D(2, 1, group=2).shard(((1, 1, 1, 1), (2, 1, 1, 1)))
    plain = ops.Conv2D(2, 1, group=2)

    def f(a, b):
        return jnp.sum(conv(a, b) ** 2)

    def f0(a, b):
        return jnp.sum(plain(a, b) ** 2)
    # float32: a 288-term sum of squares and 2-term convolutions, reordered by the partitioning
    assert_close(ms.jit(f)(x, w), f0(x, w))
    assert_close(ms.jit(jax.grad(f, argnums=1))(x, w), jax.grad(f0, argnums=1)(x, w))


def test_r7_data_parallel_step_with_a_1x1_conv_matches_one_device():
    """Was INVALID_ARGUMENT from XLA: the per-replica jax.vmap turned the 1x1 conv's weight gradient into a grouped
    conv (feature_group_count=8) that the partitioner split wrongly. A pure data-parallel step now runs each
    replica on its own devices (shard_map over the data-parallel axes)."""
    import jax
    import optax
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True)

    class Net(nn.Cell):
        def __init__(self, rngs):
            self.conv = nn.Conv2d(3, 4, 1, rngs=rngs)

        def __call__(self, x):
            return jnp.mean(self.conv(x), axis=(1, 2, 3))
    x = jnp.arange(16 * 3 * 8 * 8, dtype=jnp.float32).reshape(16, 3, 8, 8) / 3000
    y = jnp.arange(16.0) / 16
    net, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optax.sgd(0.1))
    loss = step(x, y)
    ref_loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(ref)
    # float32: 192-term means per sample and a 16-term loss, reordered over the replicas
    assert_close(loss, ref_loss)
    for a, b, gb in zip(jax.tree.leaves(nnx.state(net, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param)),
                        jax.tree.leaves(g), strict=True):
        assert_close(a, b - 0.1 * gb)
