"""MindSpore's gradient-accumulation tutorial in its own idiom (``mindspore`` -> ``mshard``):
``parallel.nn.GradAccumulation(net_with_loss, micro_size)`` under ``nn.TrainOneStepCell`` with ``nn.SGD``, trained by
``ms.Model(train_net)`` with ``LossMonitor``, Megatron splits on the first two layers, in semi_auto_parallel.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
from _common import FakeMnist

import mshard as ms
import mshard.dataset as ds
from mshard import nn
from mshard.communication import init
from mshard.parallel.nn import GradAccumulation
from mshard.train import LossMonitor, Model


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.layer1 = nn.Dense(28 * 28, 512)
        self.relu1 = nn.ReLU()
        self.layer2 = nn.Dense(512, 512)
        self.relu2 = nn.ReLU()
        self.layer3 = nn.Dense(512, 10)

    def construct(self, x):
        x = self.flatten(x)
        x = self.relu1(self.layer1(x))
        x = self.relu2(self.layer2(x))
        return self.layer3(x)


def main(parallel=True, epochs=1, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    mode = ms.ParallelMode.SEMI_AUTO_PARALLEL if parallel else ms.ParallelMode.STAND_ALONE
    ms.set_auto_parallel_context(parallel_mode=mode)
    init()
    ms.set_seed(1)

    data_set = ds.GeneratorDataset(FakeMnist(64), ["image", "label"], shuffle=False).batch(32)
    net = Network()
    net.layer1.matmul.shard(((2, 1), (4, 1)))
    net.layer2.matmul.shard(((2, 4), (1, 4)))
    loss_fn = nn.CrossEntropyLoss()
    net_with_loss = nn.WithLossCell(net, loss_fn)
    net_with_grads = GradAccumulation(net_with_loss, 4)           # 4 micro-batches of 8
    optimizer = nn.SGD(net.trainable_params(), 1e-2)
    train_net = nn.TrainOneStepCell(net_with_grads, optimizer)
    model = Model(train_net)
    if epochs:
        model.train(epochs, data_set, callbacks=[LossMonitor()] if verbose else None)
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    out = np.asarray(net(ms.Tensor(FakeMnist(8, seed=1).images)))
    ms.reset_auto_parallel_context()
    return out, params


if __name__ == "__main__":
    main()
