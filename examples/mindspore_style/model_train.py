"""MindSpore's high-level training API in its own idiom, with ``mindspore`` changed to ``mshard``: ``ms.Model``
with ``nn.Momentum`` and ``LossMonitor`` over a ``NumpySlicesDataset``, a Megatron-style split of the first Dense
through its ``matmul.shard``, in semi_auto_parallel.

    .venv/bin/python examples/mindspore_style/model_train.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

import mshard as ms
from mshard import nn
from mshard.communication import init
from mshard.train import LossMonitor, Model


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(64, 128, activation="relu")
        self.fc2 = nn.Dense(128, 10)

    def construct(self, x):
        return self.fc2(self.fc1(x))


def main(parallel=True, epochs=2, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    mode = ms.ParallelMode.SEMI_AUTO_PARALLEL if parallel else ms.ParallelMode.STAND_ALONE
    ms.set_auto_parallel_context(parallel_mode=mode)
    init()
    ms.set_seed(2)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=(96,)).astype(np.int32)
    dataset = ms.dataset.NumpySlicesDataset((x, y), column_names=["data", "label"], shuffle=False).batch(32)

    net = Network()
    net.fc1.matmul.shard(((2, 1), (4, 1)))            # column parallel: the weight [128, 64] split 4 ways
    net.fc2.matmul.shard(((2, 4), (1, 4)))            # row parallel: the partial sums all-reduced
    model = Model(net, nn.CrossEntropyLoss(), nn.Momentum(net.trainable_params(), 0.05, 0.9))
    if epochs:
        model.train(epochs, dataset, callbacks=[LossMonitor()] if verbose else None)
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    logits = np.asarray(model.predict(ms.Tensor(x[:16])))
    ms.reset_auto_parallel_context()
    return logits, params


if __name__ == "__main__":
    main()
