"""hybrid_parallel (issue 18): the user slices by hand in jax.shard_map regions with ms.ops collectives, inside
planned regions and training steps; each collective against its definition, and a training step against one
device."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from train_helpers import assert_params_close, assert_trees_close, mse, reference_train

import mshard as ms
from mshard import nn, ops

MESH = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
X = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3) % 7 - 3     # device (i, j) holds rows 4*(4i+j)...


ROWS = P(("a", "b"))


def _on_b(op):
    """Run ``op`` on each device's 4-row block, ``b`` as the group; -> the global result, rows per device."""
    return np.asarray(jax.jit(jax.shard_map(op, mesh=MESH, in_specs=ROWS, out_specs=ROWS))(X))


def _blocks():
    return X.reshape(2, 4, 4, 3)                 # [a, b, rows, 3]


@pytest.mark.parametrize("red,fn", [("sum", np.sum), ("max", np.max), ("min", np.min), ("mean", np.mean)])
def test_all_reduce(red, fn):
    got = _on_b(ops.AllReduce(red, group="b")).reshape(2, 4, 4, 3)
    want = np.broadcast_to(fn(_blocks(), axis=1, keepdims=True), (2, 4, 4, 3))
    np.testing.assert_allclose(got, want, rtol=1e-6)        # sums of 4 small integers / 4: exact in float32


def test_all_gather_reduce_scatter_all_to_all_broadcast_send_receive():
    bl = _blocks()
    got = _on_b(ops.AllGather(group="b")).reshape(2, 4, 16, 3)            # every device: its group's 16 rows
    assert np.array_equal(got, np.broadcast_to(bl.reshape(2, 1, 16, 3), (2, 4, 16, 3)))
    got = _on_b(ops.ReduceScatter("sum", group="b")).reshape(2, 4, 1, 3)  # device j: row j of the group's sum
    assert np.array_equal(got, bl.sum(axis=1).reshape(2, 4, 1, 3))
    got = _on_b(ops.ReduceScatter("mean", group="b")).reshape(2, 4, 1, 3)
    np.testing.assert_allclose(got, bl.mean(axis=1).reshape(2, 4, 1, 3), rtol=1e-6)
    got = _on_b(ops.AlltoAll(4, 0, 0, group="b")).reshape(2, 4, 4, 3)    # device j gets row j of every member
    assert np.array_equal(got, bl.transpose(0, 2, 1, 3))
    got = _on_b(ops.Broadcast(2, group="b")).reshape(2, 4, 4, 3)
    assert np.array_equal(got, np.broadcast_to(bl[:, 2:3], (2, 4, 4, 3)))
    ring = [(j, (j + 1) % 4) for j in range(4)]
    got = _on_b(ops.SendReceive(ring, group="b")).reshape(2, 4, 4, 3)
    assert np.array_equal(got, np.roll(bl, 1, axis=1))
    got = _on_b(ops.SendReceive([(0, 3)], group="b")).reshape(2, 4, 4, 3)
    assert np.array_equal(got[:, 3], bl[:, 0]) and not got[:, :3].any()
    with pytest.raises(ms.errors.StrategyError, match="op='max' is not supported"):
        ops.ReduceScatter("max")


class RowParallel(nn.Cell):
    """A hand-sliced Dense: in hybrid_parallel its weight's rows are split over 8 devices, each multiplies its
    slice of the features, ``AllReduce`` sums the partial products; elsewhere the same product on one device."""

    def __init__(self, din, dout, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (din, dout)) * 0.1)

    def __call__(self, x):
        if ms.get_auto_parallel_context("parallel_mode") != "hybrid_parallel":
            return x @ self.w[...]
        mesh = jax.make_mesh((jax.device_count(),), ("mp",), axis_types=(jax.sharding.AxisType.Auto,))
        part = jax.shard_map(lambda xl, wl: ops.AllReduce(group="mp")(xl @ wl), mesh=mesh,
                             in_specs=(P(None, "mp"), P("mp", None)), out_specs=P())
        return part(x, self.w[...])


class HybridNet(nn.Cell):
    def __init__(self, rngs):
        self.fc1 = nn.Dense(16, 64, activation="relu", rngs=rngs)
        self.row = RowParallel(64, 32, rngs)
        self.fc2 = nn.Dense(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.row(self.fc1(x))))


@pytest.mark.parametrize("tx", [optax.adam, optax.sgd])
def test_hybrid_parallel_training_step_equals_one_device(tx):
    """Every parameter and every optimizer leaf against one device; plain SGD as well as Adam, where a gradient off
    by the replica count or the mp group size would be normalised away."""
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(32, 16)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32))
            for _ in range(3)]
    ref, ref_opt, ref_losses = reference_train(HybridNet(nnx.Rngs(0)), tx(1e-2), data, mse)
    ms.set_auto_parallel_context(parallel_mode="hybrid_parallel", device_num=8, gradients_mean=True)
    net = HybridNet(nnx.Rngs(0))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx(1e-2))
    losses = [float(step(*b)) for b in data]
    # float32: the 64-term row-parallel product summed in 8 partial sums, 16/32-term dot products, a 256-element
    # MSE mean, reordered over 8 devices, across 3 steps (tests/train_helpers.py's PARAM_RTOL reasoning)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    assert_trees_close(step.opt_state, ref_opt)
    rep = ms.comm_report(step, *data[0])
    assert rep.count("all-reduce") >= 1           # the user's AllReduce (and the gradient reduction) are in it
