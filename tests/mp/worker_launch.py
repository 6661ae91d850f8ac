"""A worker started by `mshard run` in tests/test_launch.py: data-parallel training of a small MLP over all the
job's devices, fed per rank through ms.dataset.shard_batch, checked against one device at the end.

Env: FAULT = none | raise (rank 1 raises a ValueError at step 3) | batch (rank 1 feeds half as many rows) |
loop (train until killed: the test kills or stops a worker); STEPS (default 3).
"""

import os
import sys
import time

import mshard as ms

ms.communication.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from mshard import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from reference import train_one_device  # noqa: E402

fault, steps = os.environ.get("FAULT", "none"), int(os.environ.get("STEPS", "3"))
rank, size = ms.communication.get_rank(), ms.communication.get_group_size()
print(f"rank {rank} of {size} pid {os.getpid()} local rank {ms.communication.get_local_rank()} "
      f"devices {jax.device_count()}", flush=True)


class MLP(nn.Cell):
    def __init__(self, rngs):
        self.fc1 = nn.Dense(16, 32, activation="relu", rngs=rngs)
        self.fc2 = nn.Dense(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.fc1(x))


def mse(p, y):
    return jnp.mean((p - y) ** 2)


rng = np.random.default_rng(0)
rows = 8 * size
data = [(rng.normal(size=(rows, 16)).astype(np.float32), rng.normal(size=(rows, 8)).astype(np.float32))
        for _ in range(steps)]
ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=jax.device_count(), gradients_mean=True)
net = MLP(nnx.Rngs(0))
step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.adam(1e-2))
losses = []
k = 0
while True:
    x, y = data[k % steps]
    mine = slice(rank * 8, (rank + 1) * 8)
    if fault == "batch" and rank == 1:
        mine = slice(rank * 8, rank * 8 + 4)
    if fault == "raise" and rank == 1 and k == 3:
        raise ValueError("a bad value on rank 1 only")
    losses.append(float(step(*ms.dataset.shard_batch((x[mine], y[mine])))))
    print(f"step {k} loss {losses[-1]:.6f}", flush=True)
    k += 1
    if fault in ("loop", "raise"):
        time.sleep(0.05)
    elif k == steps:
        break
_, _, ref = train_one_device(MLP(nnx.Rngs(0)), optax.adam(1e-2), data, mse, device=jax.local_devices()[0])
# float32: 16/32-term dot products and a 64-row MSE mean reordered over the devices, over 3 Adam steps (lr 1e-2)
np.testing.assert_allclose(losses, ref, rtol=1e-5)
print(f"process {rank} OK", flush=True)
ms.communication.release()
