"""Train a small GPT on synthetic tokens under data_parallel, semi_auto_parallel (Megatron) and auto_parallel.

    python examples/train_gpt.py [--steps 20] [--layers 4] [--modes data_parallel,semi_auto_parallel,auto_parallel]

The model: token + position embeddings, 4 pre-LayerNorm transformer blocks (nn.TransformerBlock), a final
LayerNorm and a vocabulary head. The data: sequences of an affine recurrence modulo the vocabulary
(``t[i+1] = (5 t[i] + 3) % vocab``) from random starts, so the next token is learnable and the loss goes down.

Each mode trains a copy of the same initial model with ``nn.TrainOneStepCell`` on 8 (simulated) devices,
feeding batches through ``ms.dataset.shard_batch``, and is checked step for step against plain
nnx + optax training on one device: every step's loss within rtol 1e-4 (float32; the partitioned sums
reorder additions, and the difference grows slowly over the steps). semi_auto_parallel sets Megatron
strategies on every block (``block.shard_megatron(dp=2, mp=4)``: q/k/v and the first MLP Dense column
parallel, attention heads split 4 ways, the projections row parallel); auto_parallel searches.
For each mode the plan summary (first rows) and the compiled step's collectives are printed.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import optax
from flax import nnx
from gpt import GPT
from reference import train_one_device

import mshard as ms
from mshard import nn

VOCAB, SEQ, HIDDEN, HEADS, FFN, LAYERS, BATCH = 64, 32, 64, 4, 256, 4, 16
LOSS_RTOL = 1e-4


def make_gpt(rngs: nnx.Rngs, layers: int = LAYERS) -> GPT:
    return GPT(rngs, vocab=VOCAB, hidden=HIDDEN, heads=HEADS, ffn=FFN, seq=SEQ, layers=layers)


def synthetic_batches(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        t = np.empty((BATCH, SEQ + 1), np.int32)
        t[:, 0] = rng.integers(0, VOCAB, BATCH)
        for i in range(SEQ):
            t[:, i + 1] = (5 * t[:, i] + 3) % VOCAB
        out.append((t[:, :-1], t[:, 1:]))
    return out


LOSS = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def train(mode: str, init: GPT, tx, data):
    ms.set_auto_parallel_context(parallel_mode=mode, device_num=8, gradients_mean=True)
    net = nnx.clone(init)
    if mode == "semi_auto_parallel":
        for block in net.blocks:
            block.shard_megatron(data_parallel=2, model_parallel=4)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, LOSS), tx)
    losses = [float(step(*batch)) for batch in ms.dataset.shard_batch(iter(data))]
    first = ms.dataset.shard_batch(data[0])
    print(step.plan(*first).summary(max_rows=12))
    print(ms.comm_report(step, *first))
    return losses


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="data_parallel,semi_auto_parallel,auto_parallel")
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args(argv)
    data = synthetic_batches(args.steps)
    init = make_gpt(nnx.Rngs(0), args.layers)
    tx = optax.adamw(3e-3)
    _, _, ref = train_one_device(init, tx, data, LOSS)
    print(f"one device: loss {ref[0]:.4f} -> {ref[-1]:.4f} in {args.steps} steps")
    for mode in args.modes.split(","):
        print(f"\n===== {mode} =====")
        losses = train(mode, init, tx, data)
        for k in range(0, len(losses), max(1, len(losses) // 5)):
            print(f"  step {k:3d}: loss {losses[k]:.5f}  (one device {ref[k]:.5f})")
        err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        assert losses[-1] < losses[0], f"{mode}: the loss did not go down ({losses[0]} -> {losses[-1]})"
        np.testing.assert_allclose(losses, ref, rtol=LOSS_RTOL)
        print(f"{mode}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; matches one device step for step "
              f"(max relative difference {err:.1e} <= {LOSS_RTOL})")
    ms.reset_auto_parallel_context()
    print("train_gpt OK")


if __name__ == "__main__":
    main()
