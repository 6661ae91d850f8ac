"""A training script for `mshard run --dry_run` (tests/unit/edges/test_launch.py): examples/gpt.py's GPT with Megatron
strategies (mp 4, the rest data parallel) over however many devices the dry run simulates."""

import os
import sys

import jax
import numpy as np
import optax
from flax import nnx

import mshard as ms
from mshard import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from gpt import GPT

ms.communication.init()
n = jax.device_count()
ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n)
net = GPT(nnx.Rngs(0), vocab=64, hidden=64, heads=4, ffn=128, seq=16, layers=2)
for block in net.blocks:
    block.shard_megatron(data_parallel=n // 4, model_parallel=4)
step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")),
                           optax.adamw(1e-3))
ids = np.zeros((n, 16), np.int32)
for _ in range(3):
    print("loss", float(step(ids, ids)))        # a dry run ends inside the first call
print("ran the steps: not a dry run")
