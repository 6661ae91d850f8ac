"""MindSpore's sharding-propagation tutorial in its own idiom (``mindspore`` -> ``mshard``): auto_parallel with
``search_mode="sharding_propagation"``; only the first MatMul of the FFN is configured, the rest is propagated.
Trained with ``ms.Model`` and ``nn.SGD``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

import mshard as ms
from mshard import nn, ops
from mshard.common.initializer import initializer
from mshard.communication import init


class FFN(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1_weight = ms.Parameter(initializer("normal", [64, 256], ms.float32))
        self.dense2_weight = ms.Parameter(initializer("normal", [256, 64], ms.float32))
        self.matmul1 = ops.MatMul()
        self.relu = ops.ReLU()
        self.matmul2 = ops.MatMul()

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul1(x, self.dense1_weight)), self.dense2_weight)


def main(parallel=True, epochs=2, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    if parallel:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.AUTO_PARALLEL, search_mode="sharding_propagation")
    else:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.STAND_ALONE)
    init()
    ms.set_seed(1)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 64)).astype(np.float32)
    y = rng.normal(size=(64, 64)).astype(np.float32)
    dataset = ms.dataset.NumpySlicesDataset((x, y), shuffle=False).batch(32)

    net = FFN()
    net.matmul1.shard(((2, 1), (1, 4)))
    model = ms.Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.05))
    if epochs:
        model.train(epochs, dataset)
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    out = np.asarray(model.predict(ms.Tensor(x[:32])))
    ms.reset_auto_parallel_context()
    return out, params


if __name__ == "__main__":
    main()
