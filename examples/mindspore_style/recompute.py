"""MindSpore's recompute tutorial in its own idiom (``mindspore`` -> ``mshard``): ``cell.recompute()`` on the hidden
blocks of a network trained with the functional step (``value_and_grad`` + ``@ms.jit`` + ``optimizer(grads)``) in
data parallel; the activations of the recomputed blocks are not kept for the backward.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
from _common import FakeMnist

import mshard as ms
from mshard import nn
from mshard.communication import init


class Block(nn.Cell):
    def __init__(self, n):
        super().__init__()
        self.dense = nn.Dense(n, n)
        self.relu = nn.ReLU()

    def construct(self, x):
        return self.relu(self.dense(x))


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.inp = nn.Dense(28 * 28, 256)
        self.block1 = Block(256)
        self.block2 = Block(256)
        self.out = nn.Dense(256, 10)

    def construct(self, x):
        return self.out(self.block2(self.block1(self.inp(self.flatten(x)))))


def main(parallel=True, steps=2, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    mode = ms.ParallelMode.DATA_PARALLEL if parallel else ms.ParallelMode.STAND_ALONE
    ms.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True)
    init()
    ms.set_seed(1)

    net = Network()
    net.block1.recompute()
    net.block2.recompute()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = nn.Adam(net.trainable_params(), 1e-3)
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, net.trainable_params())

    @ms.jit
    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        optimizer(grads)
        return loss

    data = FakeMnist(32 * max(steps, 1))
    losses = []
    for i in range(steps):
        loss = train_step(ms.Tensor(data.images[32 * i:32 * (i + 1)]), ms.Tensor(data.labels[32 * i:32 * (i + 1)]))
        losses.append(float(loss))
        if verbose:
            print(f"step {i}: loss is {loss}")
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    ms.reset_auto_parallel_context()
    return losses, params


if __name__ == "__main__":
    main()
