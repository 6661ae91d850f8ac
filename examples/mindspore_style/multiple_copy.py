"""MindSpore's multiple-copy (MicroBatchInterleaved) tutorial in its own idiom (``mindspore`` -> ``mshard``): the
batch runs as two interleaved copies so one copy's communication can overlap the other's compute, Megatron splits
on the network, ``parallel.nn.MicroBatchInterleaved`` under ``TrainOneStepCell`` with ``nn.Momentum``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

import mshard as ms
from mshard import nn
from mshard.communication import init
from mshard.parallel.nn import MicroBatchInterleaved


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(32, 128, activation="relu")
        self.fc2 = nn.Dense(128, 10)

    def construct(self, x):
        return self.fc2(self.fc1(x))


def main(parallel=True, steps=3, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    mode = ms.ParallelMode.SEMI_AUTO_PARALLEL if parallel else ms.ParallelMode.STAND_ALONE
    ms.set_auto_parallel_context(parallel_mode=mode)
    init()
    ms.set_seed(3)

    net = Network()
    net.fc1.matmul.shard(((2, 1), (4, 1)))
    net.fc2.matmul.shard(((2, 4), (1, 4)))
    net_with_loss = MicroBatchInterleaved(nn.WithLossCell(net, nn.CrossEntropyLoss()), 2)
    train_net = nn.TrainOneStepCell(net_with_loss, nn.Momentum(net.trainable_params(), 0.05, 0.9))
    rng = np.random.default_rng(0)
    losses = []
    for i in range(steps):
        x = ms.Tensor(rng.normal(size=(32, 32)).astype(np.float32))
        y = ms.Tensor(rng.integers(0, 10, size=(32,)).astype(np.int32))
        losses.append(float(train_net(x, y)))
        if verbose:
            print(f"step {i}: loss is {losses[-1]}")
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    ms.reset_auto_parallel_context()
    return losses, params


if __name__ == "__main__":
    main()
