"""MindSpore's operator-parallel tutorial with ``Layout`` in its own idiom (``mindspore`` -> ``mshard``): a named
device matrix ``Layout((2, 4), ("dp", "mp"))`` gives the MatMuls' strategies, the functional step trains them.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

import mshard as ms
from mshard import nn, ops
from mshard.common.initializer import initializer
from mshard.communication import init
from mshard.parallel import Layout


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = ops.Flatten()
        self.fc1_weight = ms.Parameter(initializer("normal", [28 * 28, 512], ms.float32))
        self.fc2_weight = ms.Parameter(initializer("normal", [512, 10], ms.float32))
        self.matmul1 = ops.MatMul()
        self.relu1 = ops.ReLU()
        self.matmul2 = ops.MatMul()

    def construct(self, x):
        x = self.flatten(x)
        x = self.relu1(self.matmul1(x, self.fc1_weight))
        return self.matmul2(x, self.fc2_weight)


def main(parallel=True, steps=3, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    mode = ms.ParallelMode.SEMI_AUTO_PARALLEL if parallel else ms.ParallelMode.STAND_ALONE
    ms.set_auto_parallel_context(parallel_mode=mode)
    init()
    ms.set_seed(1)

    net = Network()
    layout = Layout((2, 4), ("dp", "mp"))
    net.matmul1.shard(in_strategy=(layout("dp", "None"), layout("None", "mp")))      # column parallel
    net.relu1.shard(in_strategy=(layout("dp", "mp"),))
    net.matmul2.shard(in_strategy=(layout("dp", "mp"), layout("mp", "None")))        # row parallel
    optimizer = nn.SGD(net.trainable_params(), 1e-2)
    loss_fn = nn.CrossEntropyLoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, net.trainable_params())

    @ms.jit
    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        optimizer(grads)
        return loss

    rng = np.random.default_rng(0)
    losses = []
    for i in range(steps):
        x = ms.Tensor(rng.normal(size=(32, 1, 28, 28)).astype(np.float32))
        y = ms.Tensor(rng.integers(0, 10, size=(32,)).astype(np.int32))
        losses.append(float(train_step(x, y)))
        if verbose:
            print(f"step {i}: loss is {losses[-1]}")
    params = {"fc1_weight": np.asarray(net.fc1_weight[...]), "fc2_weight": np.asarray(net.fc2_weight[...])}
    ms.reset_auto_parallel_context()
    return losses, params


if __name__ == "__main__":
    main()
