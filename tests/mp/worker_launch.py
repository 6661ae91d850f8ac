"""A worker started by `mshard run` in tests/unit/edges/test_launch.py: data-parallel training of a small MLP over all the
job's devices, fed per rank through ms.dataset.shard_batch, checked against one device at the end.

Env: FAULT = none | raise (rank 1 raises a ValueError at step 3) | batch (rank 1 feeds half as many rows) |
loop (train until killed: the test kills or stops a worker) | hostbatch (the whole batch passed to the step as host
arrays, rank 1's with half the rows) | ownrows (each rank's own rows passed to the step as host arrays, not
through shard_batch) | hybrid (hybrid_parallel: a hand-sliced row-parallel
layer in a jax.shard_map over every device of the job, with ms.ops.AllReduce); STEPS (default 3);
ORDER = context_first: set_auto_parallel_context (device_num=JOB_DEVICES) before communication.init(), as MindSpore's
tutorials do; MODE = data_parallel (default) | megatron (semi_auto_parallel: fc1 column parallel, fc2 row parallel over 4
devices, data parallel across the 2 processes); TX = adam (default, lr 1e-2) | sgd (lr 1e-1: a gradient's scale
shows in the parameters). Every parameter and optimizer leaf is compared with one device, shard by shard.
"""

import os
import sys
import time

import mshard as ms

if os.environ.get("ORDER") == "context_first":
    # MindSpore's tutorials: the context first, then init(); setting it must not initialise JAX's backend
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=int(os.environ["JOB_DEVICES"]),
                                 gradients_mean=True, dataset_strategy="data_parallel")
ms.communication.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from mshard import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from reference import train_one_device  # noqa: E402

fault, steps = os.environ.get("FAULT", "none"), int(os.environ.get("STEPS", "3"))
rank, size = ms.communication.get_rank(), ms.communication.get_group_size()
print(f"rank {rank} of {size} pid {os.getpid()} local rank {ms.communication.get_local_rank()} "
      f"devices {jax.device_count()}", flush=True)


class RowParallel(nn.Cell):
    """hybrid_parallel: the weight's rows split over every device, partial products summed by ms.ops.AllReduce."""

    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (32, 32)) * 0.1)

    def __call__(self, x):
        if ms.get_auto_parallel_context("parallel_mode") != "hybrid_parallel":
            return x @ self.w[...]
        mesh = jax.make_mesh((jax.device_count(),), ("mp",), axis_types=(jax.sharding.AxisType.Auto,))
        return jax.shard_map(lambda xl, wl: ms.ops.AllReduce(group="mp")(xl @ wl), mesh=mesh,
                             in_specs=(P(None, "mp"), P("mp", None)), out_specs=P())(x, self.w[...])


class MLP(nn.Cell):
    def __init__(self, rngs):
        self.fc1 = nn.Dense(16, 32, activation="relu", rngs=rngs)
        self.row = RowParallel(rngs) if fault == "hybrid" else None
        self.fc2 = nn.Dense(32, 8, rngs=rngs)

    def __call__(self, x):
        h = self.fc1(x)
        return self.fc2(jax.nn.relu(self.row(h)) if self.row is not None else h)


def mse(p, y):
    return jnp.mean((p - y) ** 2)


def make_tx():
    return optax.sgd(1e-1) if os.environ.get("TX") == "sgd" else optax.adam(1e-2)


def assert_every_value_close(got, want, what):
    """Each value this process holds of every leaf of ``got`` (global arrays over the job's devices) against the
    same slice of ``want`` (one device's): both processes together check every value."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), (what, len(got), len(want))
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        assert g.shape == w.shape, (what, g.shape, w.shape)
        for shard in g.addressable_shards:
            # float32: tests/train_helpers.py's PARAM_RTOL / PARAM_ATOL reasoning (3 steps, 16/32-term products)
            np.testing.assert_allclose(np.asarray(shard.data), w[shard.index], rtol=2e-5, atol=2e-6, err_msg=what)


rng = np.random.default_rng(0)
rows = 8 * size
data = [(rng.normal(size=(rows, 16)).astype(np.float32), rng.normal(size=(rows, 8)).astype(np.float32))
        for _ in range(steps)]
with ms.parallel_context(parallel_mode="stand_alone"):          # one local device, full batches
    ref_net, ref_opt, ref = train_one_device(MLP(nnx.Rngs(0)), make_tx(), data, mse, device=jax.local_devices()[0])
megatron = os.environ.get("MODE", "data_parallel") == "megatron"
mode = "hybrid_parallel" if fault == "hybrid" else ("semi_auto_parallel" if megatron else "data_parallel")
ms.set_auto_parallel_context(parallel_mode=mode, device_num=jax.device_count(), gradients_mean=True)
net = MLP(nnx.Rngs(0))
if megatron:
    dp = jax.device_count() // 4
    net.fc1.matmul.shard(((dp, 1), (4, 1)))
    net.fc1.bias_add.shard(((dp, 4), (4,)))
    net.fc2.matmul.shard(((dp, 4), (1, 4)))
step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), make_tx())
losses = []
k = 0
while True:
    x, y = data[k % steps]
    mine = slice(rank * 8, (rank + 1) * 8)
    if fault == "batch" and rank == 1:
        mine = slice(rank * 8, rank * 8 + 4)
    if fault == "raise" and rank == 1 and k == 3:
        raise ValueError("a bad value on rank 1 only")
    if fault == "ownrows":                      # each rank's own rows as host arrays, straight to the step
        losses.append(float(step(x[mine], y[mine])))
    elif fault == "hostbatch":
        rows_ = slice(0, rows // 2 if rank == 1 else rows)
        losses.append(float(step(x[rows_], y[rows_])))
    else:
        losses.append(float(step(*ms.dataset.shard_batch((x[mine], y[mine])))))
    print(f"step {k} loss {losses[-1]:.6f}", flush=True)
    k += 1
    if fault in ("loop", "raise"):
        time.sleep(0.05)
    elif k == steps:
        break
# float32: 16/32-term dot products and a 64-row MSE mean reordered over the devices, over 3 Adam steps (lr 1e-2)
np.testing.assert_allclose(losses, ref, rtol=1e-5)
assert_every_value_close(nnx.state(net, nnx.Param), nnx.state(ref_net, nnx.Param), "parameters")
assert_every_value_close(step.opt_state, ref_opt, "optimizer state")
print(f"process {rank} OK", flush=True)
ms.communication.release()
