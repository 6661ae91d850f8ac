"""Shared set-up of the JAX benchmarks (every bench/*.py but search.py and rp_levels.py): import it first.

It puts 8 simulated CPU devices in ``XLA_FLAGS`` before JAX is imported, quiets XLA's partitioner warnings
(they would bury the tables), puts the repository and ``examples/`` on ``sys.path``, and builds the small GPT
training step bench/fusion.py and bench/searched_step.py measure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def gpt_step(cfg: dict, megatron: bool = True):
    """(network, TrainOneStepCell) of ``examples/gpt.py``'s GPT under the current context: sparse softmax
    cross-entropy, SGD (lr 0.1), every block with ``shard_megatron(2, 4)`` if ``megatron``."""
    import optax
    from flax import nnx
    from gpt import GPT

    from mshard import nn
    net = GPT(nnx.Rngs(0), **cfg)
    if megatron:
        for block in net.blocks:
            block.shard_megatron(2, 4)
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    return net, nn.TrainOneStepCell(nn.WithLossCell(net, loss), optax.sgd(0.1))
