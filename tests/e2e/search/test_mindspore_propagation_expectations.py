"""MindSpore's sharding-propagation unit-test expectations (issue 40), in our own words.

Each case is a network from MindSpore's ``tests/ut/python/parallel`` propagation tests with the strategy MindSpore
configures and the strategies its propagation is expected to give the other ops. Each either holds, or says why
mshard's plan differs and measures the bytes of both plans' compiled programs.

- A conv2d -> batch norm -> max pool chain whose ReLU alone is configured: every op takes the ReLU's split, for
  ``(8, 1, 1, 1)``, ``(1, 1, 1, 8)`` and, with fully_use_devices off, ``(1, 1, 2, 1)`` (MindSpore's test of
  conv2d/bn/maxpool propagation; its Conv2DTranspose is not among mshard's ops). Before this stop the last one gave
  the convolution and the batch norm ``(4, 1, 2, 1)``.
- An Add after a MatMul ``((4, 2), (1, 2))`` takes ``(4, 2)``: tests/e2e/search/test_propagation_on_models.py
  ``test_matmul_transpose_b_then_add_takes_its_split`` (MindSpore's out-strategy propagation test 1).
- Two MatMuls with three Adds (MindSpore's strategy save/load test): documented difference, below.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close

import mshard as ms
from mshard import ops

pytestmark = pytest.mark.slow

X = np.random.default_rng(0).normal(size=(16, 16, 32, 32)).astype(np.float32)
W = nnx.Param(jnp.asarray(np.random.default_rng(1).normal(size=(8, 16, 3, 3)) * 0.1, jnp.float32))


def _conv_chain(seed):
    relu = ops.ReLU().shard((seed,))
    conv = ops.Conv2D(8, 3, pad_mode="same")
    bn = ops.BatchNorm(is_training=True)
    pool = ops.MaxPool(kernel_size=2, strides=2)

    def net(x, w):
        out = conv(relu(x), w[...])
        out = bn(out, jnp.ones(8), jnp.zeros(8), jnp.zeros(8), jnp.ones(8))
        return relu(pool(out))
    return net


def _reference(x, w):
    """The same chain in plain JAX on one device (NCHW / OIHW, 'same' padding, batch statistics, 2x2 max pool)."""
    x = jax.nn.relu(x)
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    mean = y.mean(axis=(0, 2, 3), keepdims=True)
    var = ((y - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True)
    y = (y - mean) / jnp.sqrt(var + 1e-5)
    y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    return jax.nn.relu(y)


@pytest.mark.parametrize("seed, fully", [((8, 1, 1, 1), True), ((1, 1, 1, 8), True), ((1, 1, 2, 1), False)])
def test_a_conv_chain_takes_its_configured_relus_split(seed, fully):
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8,
                             dataset_strategy="full_batch"):
        ms.set_algo_parameters(fully_use_devices=fully)
        f = ms.jit(_conv_chain(seed))
        plan = f.plan(X, W)
        y = f(X, W)
        ms.reset_algo_parameters()
    assert plan.strategy_of("Conv2D") == (seed, (1, 1, 1, 1))
    assert plan.strategy_of("BatchNorm") == (seed, (1,), (1,), (1,), (1,))
    assert plan.strategy_of("MaxPool") == (seed,)
    # float32: 144-term convolution sums and 16*32*32-value batch statistics, reordered by the split (the
    # statistics' all-reduce: ~sqrt(16384) * 2**-24 relative), then normalised to unit scale
    assert_close(y, _reference(X, W[...]), rtol=1e-4, atol=1e-4)


def test_two_matmuls_with_three_adds_move_no_more_than_mindspores_strategies():
    """MindSpore expects add1 ``(4, 2)``, add2 ``(2, 4)`` and add3 ``(2, 4)`` around MatMuls ``((4, 2), (1, 2))`` and
    ``((2, 4), (1, 4))`` (transpose_b). mshard gives add1 ``(4, 2)`` and add3 ``(2, 4)`` (before this stop add1
    was ``(1, 1)``), but add2 ``(1, 4)``.

    Why: mshard decides an op against every neighbour already decided (here the first MatMul's reduced result and
    the second MatMul's operand), and MindSpore against the one edge it reached the op by, in its own visiting
    order (add2 is reached from the second MatMul, whose input layout it copies). Both plans move the same HLO
    bytes: 3,072 B per device each (mshard: 2 all-reduces of 2,560 B and an all-to-all of 512 B; MindSpore's
    strategies replayed in semi_auto: the same all-reduces, an all-to-all of 256 B and a collective-permute of
    256 B)."""
    mm1 = ops.MatMul(transpose_b=True).shard(((4, 2), (1, 2)))
    mm2 = ops.MatMul(transpose_b=True).shard(((2, 4), (1, 4)))
    adds = [ops.Add(name=f"add{i}") for i in (1, 2, 3)]

    def net(x, b1, b2, b3, w1, w2):
        return adds[2](mm2(adds[1](mm1(adds[0](x, b1), w1[...]), b2), w2[...]), b3)

    r = np.random.default_rng(2)
    args = [r.normal(size=s).astype(np.float32) for s in ((64, 32), (64, 32), (64, 8), (64, 16))]
    args += [nnx.Param(jnp.asarray(r.normal(size=s), jnp.float32)) for s in ((8, 32), (16, 8))]
    x, b1, b2, b3, w1, w2 = args
    want = ((x + b1) @ w1[...].T + b2) @ w2[...].T + b3

    def moved(report):
        return sum(v["bytes"] for v in report.by_kind.values())

    with ms.parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8,
                             dataset_strategy="full_batch"):
        f = ms.jit(net)
        plan = f.plan(*args)
        ours = ms.comm_report(f, *args)
        y = f(*args)
    assert plan.strategy_of("add1") == ((4, 2), (4, 2)) and plan.strategy_of("add3") == ((2, 4), (2, 4))
    for a, s in zip(adds, (((4, 2), (4, 2)), ((2, 4), (2, 4)), ((2, 4), (2, 4))), strict=True):
        a.shard(s)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch"):
        g = ms.jit(net)
        theirs = ms.comm_report(g, *args)
        y_ms = g(*args)
    assert moved(ours) <= moved(theirs), (ours.by_kind, theirs.by_kind)
    # float32: 32- and 8-term dot products reordered by the splits
    assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert_close(y_ms, want, rtol=1e-5, atol=1e-5)
