"""Train the GPT of examples/train_gpt.py in pipeline stages on 8 (simulated) devices.

    python examples/train_gpt_pipeline.py [--steps 10] [--layers 4] [--stages 2] [--micro 4]
                                          [--schedule 1f1b|gpipe|interleaved] [--megatron]

The embeddings go on the first stage, the blocks are spread over the stages, the final LayerNorm, the head and
the loss go on the last one (``cell.pipeline_stage``; with ``--schedule interleaved`` each stage holds two chunks,
``cell.pipeline_segment``). ``nn.PipelineCell`` cuts every batch into ``--micro`` micro-batches; the devices split
into ``--stages`` stage groups and each group is data parallel (``--megatron``: Megatron dp 2 x mp 2 inside each
of 2 stages). The run is checked step for step against plain nnx + optax on one device (AdamW with eps = lr, so
the comparison is float32-tight: see tests/test_pipeline.py) and prints the step's per-stage plan.
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import optax
from flax import nnx
from reference import train_one_device
from train_gpt import LOSS, LOSS_RTOL, make_gpt, synthetic_batches

import mshard as ms
from mshard import nn


def place(net, stages: int, chunks: int) -> None:
    """Embeddings first, blocks evenly over the (virtual) stages, norm and head last."""
    V = stages * chunks
    net.embedding.pipeline_stage = net.position.pipeline_stage = 0
    for i, block in enumerate(net.blocks):
        vs = min(i * V // len(net.blocks), V - 1)
        block.pipeline_stage, block.pipeline_segment = vs % stages, vs // stages
    net.final_norm.pipeline_stage = net.head.pipeline_stage = stages - 1
    net.final_norm.pipeline_segment = net.head.pipeline_segment = chunks - 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b", choices=("1f1b", "gpipe", "interleaved"))
    ap.add_argument("--megatron", action="store_true")
    a = ap.parse_args(argv)
    data = synthetic_batches(a.steps)
    init = make_gpt(nnx.Rngs(0), a.layers)
    tx = optax.adamw(1e-3, eps=1e-3)
    _, _, ref = train_one_device(init, tx, data, LOSS)
    chunks = 2 if a.schedule == "interleaved" else 1
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True,
                                 pipeline_stages=a.stages,
                                 pipeline_config={"pipeline_interleave": chunks > 1,
                                                  "pipeline_scheduler": "gpipe" if a.schedule == "gpipe" else "1f1b"})
    net = nnx.clone(init)
    place(net, a.stages, chunks)
    if a.megatron:
        for block in net.blocks:
            block.shard_megatron(data_parallel=2, model_parallel=8 // a.stages // 2)
    step = nn.TrainOneStepCell(nn.PipelineCell(nn.WithLossCell(net, LOSS), a.micro), tx)
    losses = [float(step(*batch)) for batch in data]
    print(step.plan(*data[0]).summary(max_rows=4))
    print(ms.comm_report(step, *data[0]))
    for k in range(0, len(losses), max(1, len(losses) // 5)):
        print(f"  step {k:3d}: loss {losses[k]:.5f}  (one device {ref[k]:.5f})")
    assert losses[-1] < losses[0], f"the loss did not go down ({losses[0]} -> {losses[-1]})"
    np.testing.assert_allclose(losses, ref, rtol=LOSS_RTOL)
    ms.reset_auto_parallel_context()
    print(f"train_gpt_pipeline OK ({a.schedule}, {a.stages} stages, {a.micro} micro-batches)")


if __name__ == "__main__":
    main()
