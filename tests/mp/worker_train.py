"""One process of a 2-process x 4-device training run (started by tests/e2e/multiprocess/test_train_multiprocess.py).

Each process feeds its own half of every batch through ms.dataset.shard_batch; TrainOneStepCell trains
data-parallel with optimizer parallel over all 8 devices. Every process also trains the same model on its
first local device alone on the full batches (plain nnx + optax) and compares the shards it holds.
"""

import os
import sys

pid, port = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4" + os.environ.get("MSHARD_TEST_XLA_EXTRA", "")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mshard as ms  # noqa: E402
from mshard import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from reference import train_one_device  # noqa: E402


class MLP(nn.Cell):
    def __init__(self, rngs):
        self.fc1 = nn.Dense(16, 64, activation="relu", rngs=rngs)
        self.fc2 = nn.Dense(64, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.fc1(x))


def mse(p, y):
    return jnp.mean((p - y) ** 2)


assert jax.device_count() == 8 and jax.local_device_count() == 4
rng = np.random.default_rng(0)                      # the same batches in both processes
data = [(rng.normal(size=(32, 16)).astype(np.float32), rng.normal(size=(32, 8)).astype(np.float32))
        for _ in range(3)]
tx = optax.adam(1e-2)

# one local device, full batches
ref, ref_opt, ref_losses = train_one_device(MLP(nnx.Rngs(0)), tx, data, mse, device=jax.local_devices()[0])
ref_params = jax.tree.leaves(nnx.as_pure(nnx.state(ref, nnx.Param)))


def assert_opt_state_close(got, want):
    """Every optimizer leaf this process holds (Adam's count, mu, nu; sharded 8 ways under optimizer parallel)
    against one device's: Adam's moments carry the gradient's scale, which its update normalises away."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want), (len(got), len(want))
    for g, w in zip(got, want, strict=True):
        assert g.shape == np.shape(w), (g.shape, np.shape(w))
        for shard in g.addressable_shards:
            # PARAM_RTOL / PARAM_ATOL (tests/train_helpers.py): mu and nu are sums of 3 reordered float32 gradients
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(w)[shard.index], rtol=2e-5, atol=2e-6)

# 8 devices in 2 processes
ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True,
                             enable_parallel_optimizer=True, parallel_optimizer_config={"parallel_optimizer_threshold": 0})
net = MLP(nnx.Rngs(0))
step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx)
losses = []
for x, y in data:
    half = slice(pid * 16, (pid + 1) * 16)          # this process's rows
    bx, by = ms.dataset.shard_batch((x[half], y[half]))
    assert bx.shape == (32, 16) and not bx.is_fully_addressable
    losses.append(float(step(bx, by)))
# float32: 16/64-term dot products and a 256-term MSE mean reordered across 8 devices in 2 processes,
# ~sqrt(n) * 2**-24 <= 1e-6 relative per op, over 3 Adam steps
np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
for got, want in zip(jax.tree.leaves(nnx.state(net, nnx.Param)), ref_params, strict=True):
    for shard in got.addressable_shards:
        # tests/train_helpers.py's PARAM_RTOL / PARAM_ATOL: 3 Adam steps (lr 1e-2) of reordered float32 gradient sums
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=2e-5, atol=2e-6)
assert_opt_state_close(step.opt_state, ref_opt)
mu = step.opt_state[0].mu["backbone"]["fc1"]["weight"]
assert mu.sharding.shard_shape(mu.shape) == (8, 16)          # Adam's moment sharded 8 ways across processes


# the same training with Megatron (dp=2 across the processes, mp=4 inside each) and gradient fusion: every device
# all-reduces its gradient slices with its replica in the other process, in the buckets of all_reduce_fusion_config;
# from the strategies alone, and in auto_parallel with the same strategies fixed and the rest searched
for mode, search in (("semi_auto_parallel", {}), ("auto_parallel", {"search_mode": "sharding_propagation"})):
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode=mode, device_num=8, gradients_mean=True, all_reduce_fusion_config=[2],
                                 **search)
    net = MLP(nnx.Rngs(0))
    net.fc1.matmul.shard(((2, 1), (4, 1)))
    net.fc1.bias_add.shard(((2, 4), (4,)))
    net.fc2.matmul.shard(((2, 4), (1, 4)))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx)
    mp_losses = []
    for x, y in data:
        half = slice(pid * 16, (pid + 1) * 16)
        mp_losses.append(float(step(*ms.dataset.shard_batch((x[half], y[half])))))
    # as above (float32 losses, 3 steps); Megatron's 4-way partial sums reorder the 64-term dot product too
    np.testing.assert_allclose(mp_losses, ref_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(nnx.state(net, nnx.Param)), ref_params, strict=True):
        for shard in got.addressable_shards:
            # PARAM_RTOL / PARAM_ATOL, as above
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=2e-5, atol=2e-6)
    assert_opt_state_close(step.opt_state, ref_opt)
    assert step._rt.last.replicas and net.fc1.weight[...].sharding.shard_shape((64, 16)) == (16, 16), mode
print(f"process {pid} OK", losses, mp_losses, flush=True)
jax.distributed.shutdown()
