"""Train an MLP with TrainOneStepCell on 8 (simulated) devices, feature by feature, against one device.

    python examples/train_mlp.py [--steps 10]

Runs, each from the same initial weights on the same synthetic regression batches:

1. data_parallel, gradients_mean=True;
2. + optimizer parallel (ZeRO-1: Adam's moments sharded 8 ways; per-device optimizer-state bytes printed);
3. + gradient accumulation over 4 micro-batches (GradAccumulationCell);
4. + all_reduce_fusion_config=[2, 4] (three gradient all-reduces instead of one);
5. semi_auto_parallel with Megatron strategies on the first two Dense layers (dp=2, mp=4);
6. the same with all_reduce_fusion_config=[2, 4]: each device all-reduces its gradient slices over the
   2 data-parallel replicas in three buckets.

Every run's parameters after training equal plain nnx + optax on one device within rtol 1e-4 and an atol that
bounds Adam's float32 error (see ``tolerances``). The comm report of each step is printed.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax
from flax import nnx
from reference import train_one_device

import mshard as ms
from mshard import nn

LR = 1e-2


def tolerances(steps: int) -> tuple[float, float]:
    """(rtol, atol) for the trained parameters against one device.

    The partitioned gradient sums reorder float32 additions: a weight gradient sums at most 64 x 256 terms, so
    it differs from one device by a relative <= n * 2**-24 ~ 1e-3 at worst (~1e-6 typically). Adam's step is
    lr * m / sqrt(v), invariant to the gradient's scale, so a relative gradient error r moves each step by
    <= lr * r (a few times that where m cancels across steps): after ``steps`` steps, atol = lr * steps * 1e-3.
    (A gradient at the rounding level itself, e.g. a dead ReLU unit's, is not bounded by this; none is in this
    model.) rtol 1e-4 covers the large weights the same way. The bound is derived, not fitted to a run.
    """
    return 1e-4, LR * steps * 1e-3


class MLP(nn.Cell):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nn.Dense(32, 256, activation="relu", rngs=rngs)
        self.fc2 = nn.Dense(256, 256, activation="relu", rngs=rngs)
        self.fc3 = nn.Dense(256, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc3(self.fc2(self.fc1(x)))


LOSS = nn.MSELoss()


def synthetic(steps: int):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(32, 8)).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(64, 32)).astype(np.float32)
        out.append((x, np.tanh(x @ w).astype(np.float32)))
    return out


def per_device_bytes(tree) -> int:
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def run(title, init, tx, data, ref, wrap=None, megatron=False, **ctx):
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(device_num=8, gradients_mean=True, **ctx)
    net = nnx.clone(init)
    if megatron:
        net.fc1.matmul.shard(((2, 1), (4, 1)))
        net.fc1.bias_add.shard(((2, 4), (4,)))
        net.fc2.matmul.shard(((2, 4), (1, 4)))
    loss_net = nn.WithLossCell(net, LOSS)
    step = nn.TrainOneStepCell(wrap(loss_net) if wrap else loss_net, tx)
    losses = [float(step(*b)) for b in ms.dataset.shard_batch(iter(data))]
    rtol, atol = tolerances(len(data))
    for a, b in zip(jax.tree.leaves(nnx.state(net, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)
    print(f"\n== {title}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; parameters match one device "
          f"(rtol {rtol}, atol {atol:.1e})")
    print(f"   optimizer state per device: {per_device_bytes(step.opt_state):,} B")
    print(ms.comm_report(step, *ms.dataset.shard_batch(data[0])))
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args(argv)
    data = synthetic(args.steps)
    init = MLP(nnx.Rngs(0))
    tx = optax.adam(LR)
    ref, _, _ = train_one_device(init, tx, data, LOSS)
    dp = dict(parallel_mode="data_parallel")
    run("data_parallel", init, tx, data, ref, **dp)
    run("data_parallel + optimizer parallel", init, tx, data, ref, enable_parallel_optimizer=True,
        parallel_optimizer_config={"parallel_optimizer_threshold": 8}, **dp)
    run("data_parallel + GradAccumulationCell(micro_size=4)", init, tx, data, ref,
        wrap=lambda n: nn.GradAccumulationCell(n, 4), **dp)
    run("data_parallel + all_reduce_fusion_config=[2, 4]", init, tx, data, ref, all_reduce_fusion_config=[2, 4], **dp)
    run("semi_auto_parallel, Megatron fc1/fc2 (dp=2, mp=4)", init, tx, data, ref, megatron=True,
        parallel_mode="semi_auto_parallel")
    run("semi_auto_parallel, Megatron + all_reduce_fusion_config=[2, 4] (3 gradient all-reduces over the 2 replicas)",
        init, tx, data, ref, megatron=True, parallel_mode="semi_auto_parallel", all_reduce_fusion_config=[2, 4])
    ms.reset_auto_parallel_context()
    print("train_mlp OK")


if __name__ == "__main__":
    main()
