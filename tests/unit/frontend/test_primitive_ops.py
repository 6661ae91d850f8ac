"""Every primitive object: with a MindSpore strategy in a semi_auto region == the same op eagerly on one device,
and the output split as the strategy implies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, on_one_device, split_counts

import mshard as ms
from mshard import ops


def r(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


ids = np.random.default_rng(9).integers(0, 32, (8, 4)).astype(np.int32)
labels = np.eye(16, dtype=np.float32)[np.random.default_rng(3).integers(0, 16, 8)]

# (op, strategy, tensor args, attribute args, expected split counts of output 0 — from MindSpore's semantics)
CASES = [
    (ops.MatMul(), ((2, 1), (1, 4)), [r(0, 8, 16), r(1, 16, 8)], [], (2, 4)),
    (ops.MatMul(transpose_a=True), ((1, 2), (1, 4)), [r(0, 16, 8), r(1, 16, 8)], [], (2, 4)),
    (ops.BatchMatMul(), ((2, 2, 1), (2, 1, 2)), [r(0, 4, 8, 16), r(1, 4, 16, 8)], [], (2, 2, 2)),
    (ops.BatchMatMul(transpose_b=True), ((2, 1, 4), (2, 1, 4)), [r(0, 4, 8, 16), r(1, 4, 8, 16)], [], (2, 1, 1)),
    (ops.Add(), ((2, 4), (4,)), [r(0, 8, 16), r(1, 16)], [], (2, 4)),
    (ops.Sub(), ((8, 1), (8, 1)), [r(0, 8, 16), r(1, 8, 16)], [], (8, 1)),
    (ops.Mul(), ((2, 2), (2, 2)), [r(0, 8, 16), r(1, 8, 16)], [], (2, 2)),
    (ops.RealDiv(), ((4, 2), (4, 2)), [r(0, 8, 16), np.abs(r(1, 8, 16)) + 1], [], (4, 2)),
    (ops.Maximum(), ((1, 8), (1, 8)), [r(0, 8, 16), r(1, 8, 16)], [], (1, 8)),
    (ops.Minimum(), ((2, 4), (2, 4)), [r(0, 8, 16), r(1, 8, 16)], [], (2, 4)),
    (ops.BiasAdd(), ((2, 4), (4,)), [r(0, 8, 16), r(1, 16)], [], (2, 4)),
    (ops.ReLU(), ((4, 2),), [r(0, 8, 16)], [], (4, 2)),
    (ops.GeLU(), ((4, 2),), [r(0, 8, 16)], [], (4, 2)),
    (ops.Tanh(), ((8, 1),), [r(0, 8, 16)], [], (8, 1)),
    (ops.Sigmoid(), ((2, 4),), [r(0, 8, 16)], [], (2, 4)),
    (ops.Exp(), ((2, 4),), [r(0, 8, 16)], [], (2, 4)),
    (ops.Log(), ((2, 4),), [np.abs(r(0, 8, 16)) + 1], [], (2, 4)),
    (ops.Sqrt(), ((2, 4),), [np.abs(r(0, 8, 16))], [], (2, 4)),
    (ops.Square(), ((2, 4),), [r(0, 8, 16)], [], (2, 4)),
    (ops.Cast(), ((2, 4),), [r(0, 8, 16)], [jnp.bfloat16], (2, 4)),
    (ops.Softmax(axis=-1), ((8, 1),), [r(0, 8, 16)], [], (8, 1)),
    (ops.LogSoftmax(axis=0), ((1, 8),), [r(0, 8, 16)], [], (1, 8)),
    (ops.ReduceSum(keep_dims=False), ((2, 4),), [r(0, 8, 16)], [1], (2,)),
    (ops.ReduceMean(keep_dims=True), ((2, 4),), [r(0, 8, 16)], [0], (1, 4)),
    (ops.ReduceMax(), ((4, 2),), [r(0, 8, 16)], [1], (4,)),
    (ops.Transpose(), ((2, 4),), [r(0, 8, 16)], [(1, 0)], (4, 2)),
    (ops.Reshape(), ((8, 1),), [r(0, 64, 8)], [(8, 64)], (8, 1)),
    (ops.ExpandDims(), ((2, 4),), [r(0, 8, 16)], [1], (2, 1, 4)),
    (ops.Squeeze(axis=1), ((8, 1, 1),), [r(0, 8, 1, 16)], [], (8, 1)),
    (ops.Concat(axis=1), ((8, 1), (8, 1)), [r(0, 8, 16), r(1, 8, 4)], [], (8, 1)),
    (ops.StridedSlice(), ((8, 1),), [r(0, 8, 16)], [(0, 2), (8, 10), (1, 1)], (8, 1)),
    (ops.Gather(), ((1, 4), (2, 1)), [r(0, 32, 16), ids], [0], (2, 1, 4)),
    (ops.Gather(), ((8, 1), (1, 1)), [r(0, 32, 16), ids], [0], (1, 1, 1)),
    (ops.OneHot(), ((8,),), [ids[:, 0].copy()], [32, 1.0, 0.0], (8, 1)),
    (ops.LayerNorm(begin_norm_axis=1, begin_params_axis=1), ((8, 1), (1,), (1,)),
     [r(0, 8, 16), r(1, 16), r(2, 16)], [], (8, 1)),
    (ops.SoftmaxCrossEntropyWithLogits(), ((8, 1), (8, 1)), [r(0, 8, 16), labels], [], (8,)),
    (ops.Conv2D(8, 3, pad_mode="same"), ((2, 1, 2, 2), (1, 1, 1, 1)), [r(0, 4, 3, 8, 8), r(1, 8, 3, 3, 3)], [],
     (2, 1, 2, 2)),
    (ops.Conv2D(8, 3), ((4, 1, 1, 1), (2, 1, 1, 1)), [r(0, 4, 3, 8, 8), r(1, 8, 3, 3, 3)], [], (4, 2, 1, 1)),
    (ops.MaxPool(kernel_size=2, strides=2), ((2, 2, 2, 1),), [r(0, 4, 4, 8, 8)], [], (2, 2, 2, 1)),
    (ops.AvgPool(kernel_size=3, strides=1), ((4, 2, 1, 1),), [r(0, 4, 4, 8, 8)], [], (4, 2, 1, 1)),
    (ops.BatchNorm(is_training=True), ((2, 4, 1, 1), (4,), (4,), (4,), (4,)),
     [r(0, 4, 8, 4, 4), r(1, 8), r(2, 8), r(3, 8), np.abs(r(4, 8))], [], (2, 4, 1, 1)),
]


@pytest.mark.parametrize("op, strategy, tensors, attrs, expect", CASES,
                         ids=[f"{c[0].kind}-{i}" for i, c in enumerate(CASES)])
def test_primitive_with_strategy_matches_one_device(op, strategy, tensors, attrs, expect):
    op.shard(strategy)
    ref = on_one_device(lambda *t: op(*t, *attrs), *tensors)      # eager: the op is plain JAX
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        out = ms.jit(lambda *t: op(*t, *attrs))(*map(jnp.asarray, tensors))
    # float32: sums of <= 64 terms (BatchNorm's 4 x 4 x 4 statistics, Conv2D's 27, MatMul's 16, 16-wide softmax and
    # LayerNorm) reordered by the split, <= 64 * 2**-24 = 4e-6 relative, then divided by sqrt(var); atol: outputs ~ 0
    assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert split_counts(jax.tree.leaves(out)[0]) == expect


def test_hybrid_collectives_in_shard_map():
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jnp.arange(32.0).reshape(8, 4)
    f = jax.jit(jax.shard_map(lambda v: (ops.AllReduce()(v), ops.AllGather()(v), ops.ReduceScatter(group="x")(
        jnp.tile(v, (8, 1))), ops.AlltoAll(8, 1, 0)(jnp.tile(v, (1, 2)))), mesh=mesh, in_specs=P("x"),
        out_specs=(P(), P(), P("x"), P("x")), check_vma=False))
    s, g, rs, a2a = f(x)
    # assert_allclose's default rtol=1e-7: x holds the integers 0..31, whose sums (< 2**24) are exact in float32
    np.testing.assert_allclose(np.asarray(s)[0], np.asarray(x).sum(0))
    np.testing.assert_allclose(np.asarray(g), np.asarray(x))
    # every device contributes 8 copies of its row; device i keeps row i of the sum: the column sums
    np.testing.assert_allclose(np.asarray(rs), np.tile(np.asarray(x).sum(0), (8, 1)))
    assert a2a.shape == (64, 1)


def test_primitives_accept_nnx_variables_as_mindspore_passes_parameters():
    """MindSpore's ``self.matmul(x, self.weight)``: the Param itself (not its value) goes to the primitive, eagerly,
    in a region and under grad; any nnx.Variable kind is read as its value. The reference is plain jnp on one
    device."""
    from flax import nnx

    from mshard import nn

    class Net(nn.Cell):
        def __init__(self):
            self.weight = nnx.Param(jnp.asarray(r(0, 16, 8)))
            self.bias = nnx.Param(jnp.asarray(r(1, 8)))
            self.scale = nnx.BatchStat(jnp.asarray(np.abs(r(2, 8)) + 1))
            self.matmul = ops.MatMul().shard(((2, 1), (1, 4)))
            self.add, self.mul = ops.Add(), ops.Mul()

        def __call__(self, x):
            return self.mul(self.add(self.matmul(x, self.weight), self.bias), self.scale)

    x = jnp.asarray(r(3, 8, 16))
    net = Net()
    w, b, s = (np.asarray(v[...]) for v in (net.weight, net.bias, net.scale))

    def ref_loss(w, b, x):
        return jnp.sum(jnp.tanh((x @ w + b) * s))
    ref_y = on_one_device(lambda x: (x @ w + b) * s, x)
    ref_gw, ref_gb = on_one_device(jax.grad(ref_loss, argnums=(0, 1)), w, b, x)
    # float32, 16-term dot products reordered by the split: <= 16 * 2**-24 relative; atol for values near 0
    assert_close(ops.MatMul()(x, net.weight), x @ w, rtol=1e-5, atol=1e-5)       # eager, no strategy
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        assert_close(net(x), ref_y, rtol=1e-5, atol=1e-5)                        # eager: its own region
        y = ms.jit(lambda n, x: n(x))(net, x)
        g = ms.jit(nnx.grad(lambda n, x: jnp.sum(jnp.tanh(n(x)))))(net, x)          # nnx.Param only
    assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    assert split_counts(y) == (2, 4)
    assert_close(g.weight[...], ref_gw, rtol=1e-5, atol=1e-5)
    assert_close(g.bias[...], ref_gb, rtol=1e-5, atol=1e-5)
