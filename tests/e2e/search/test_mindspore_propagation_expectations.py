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
- Neighbours configured with splits that disagree (MindSpore's propagation tests of activations and of
  Mul/Cast/Sigmoid, which only compile): the search completes, keeps the configured strategies, and the training step
  equals one device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close
from reference import train_one_device

import mshard as ms
from mshard import nn, ops

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


# MindSpore's propagation tests that configure neighbouring ops with splits that disagree and expect the search to
# complete (they assert no strategies: only that the training step compiles). Here: the configured strategies are
# kept, every other op is given one, and after two steps of SGD with momentum (a gradient of the wrong scale shows in
# the parameters; Adam would normalise it away) every parameter and momentum leaf equals plain flax + optax on one
# device. Sizes are MindSpore's divided down for the CPU ([64, 32000] -> [64, 256]); the splits still divide. What the
# free ops take (measured, not asserted: MindSpore's tests state nothing): in activation1 the Add and ReLU whose
# result feeds ReduceMax (8, 1) and Sub (1, 8) compute whole on every device, the one layout that reaches both by a
# free slice (the first key of the propagation's rule, searchers/propagation.py); in activation2 the Add takes the
# ReLU's (1, 8); the Cast takes the Mul's (2, 4).
class _AddReluMaxSub(nn.Cell):
    """Add(x, w) -> ReLU -> ReduceMax(keep_dims) over every dim -> Sub(relu, max)."""

    def __init__(self, relu=None, rmax=None, sub=None):
        self.w = nnx.Param(jnp.asarray(np.random.default_rng(3).normal(size=(64, 256)), jnp.float32))
        self.add = ops.Add(name="add")
        self.relu = ops.ReLU(name="relu").shard(relu) if relu else ops.ReLU(name="relu")
        self.max = ops.ReduceMax(keep_dims=True, name="rmax")
        self.max = self.max.shard(rmax) if rmax else self.max
        self.sub = ops.Sub(name="sub").shard(sub) if sub else ops.Sub(name="sub")

    def __call__(self, x):
        out = self.relu(self.add(x, self.w[...]))
        return self.sub(out, self.max(out, (0, 1)))


class _MulCastSigmoid(nn.Cell):
    """Mul(x, w) -> Cast(float16) -> Sigmoid, read back as float32."""

    def __init__(self, mul=None, sigmoid=None):
        self.w = nnx.Param(jnp.asarray(np.random.default_rng(4).normal(size=(64, 256)), jnp.float32))
        self.mul = ops.Mul(name="mul").shard(mul) if mul else ops.Mul(name="mul")
        self.cast = ops.Cast(name="cast")
        self.sigmoid = ops.Sigmoid(name="sigmoid").shard(sigmoid) if sigmoid else ops.Sigmoid(name="sigmoid")

    def __call__(self, x):
        return self.sigmoid(self.cast(self.mul(x, self.w[...]), jnp.float16)).astype(jnp.float32)


def _square_mean(out, _label):
    return jnp.mean(out ** 2)


@pytest.mark.parametrize("make, configured", [
    # MindSpore's activation1: ReLU free, ReduceMax ((8, 1),), Sub ((1, 8), (1, 1))
    (lambda: _AddReluMaxSub(rmax=((8, 1),), sub=((1, 8), (1, 1))), {"rmax": ((8, 1),), "sub": ((1, 8), (1, 1))}),
    # activation2: ReLU ((1, 8),), ReduceMax ((1, 1),), Sub ((1, 8), (1, 1))
    (lambda: _AddReluMaxSub(relu=((1, 8),), rmax=((1, 1),), sub=((1, 8), (1, 1))),
     {"relu": ((1, 8),), "rmax": ((1, 1),), "sub": ((1, 8), (1, 1))}),
    # the Mul / Cast / Sigmoid test (16 devices there, (4, 4) -> (2, 4) on 8 here): Mul configured, Cast free,
    # Sigmoid ((8, 1),)
    (lambda: _MulCastSigmoid(mul=((2, 4), (2, 4)), sigmoid=((8, 1),)),
     {"mul": ((2, 4), (2, 4)), "sigmoid": ((8, 1),)}),
], ids=["activation1", "activation2", "mul_cast_sigmoid"])
def test_disagreeing_configured_neighbours_propagate_and_train_like_one_device(make, configured):
    x = np.random.default_rng(5).normal(size=(64, 256)).astype(np.float32)
    data = [(x, np.zeros((), np.float32))] * 2
    tx = optax.sgd(0.1, momentum=0.9)
    ref, ref_opt, ref_losses = train_one_device(make(), tx, data, _square_mean)
    net = make()
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8,
                             dataset_strategy="full_batch"):
        step = nn.TrainOneStepCell(nn.WithLossCell(net, _square_mean), tx)
        plan = step.plan(*data[0])
        losses = [float(step(*b)) for b in data]
    forward = {op.name.split("/")[-2]: op for op in plan.ops if op.name.startswith("jvp(network)/backbone/")}
    for name, strategy in configured.items():
        assert forward[name].fixed and forward[name].strategy == strategy, (name, forward[name])
    free = [op for name, op in forward.items() if name not in configured]
    assert free and all(not op.fixed and op.strategy for op in free), free
    # float32 (the Cast case: float16 inside, the same float16 ops on both sides): the 16,384-term mean of the loss
    # and its gradient, reordered by the splits (~sqrt(16384) * 2**-24 relative), over 2 momentum steps
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(net, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(step.opt_state), jax.tree.leaves(ref_opt), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
