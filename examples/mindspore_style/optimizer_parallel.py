"""MindSpore's optimizer-parallel tutorial in its own idiom (``mindspore`` -> ``mshard``): data parallel with
``enable_parallel_optimizer=True`` (each device keeps a shard of Momentum's state and updates its slice), a
``SequentialCell`` network, ``nn.Momentum``, ``nn.TrainOneStepCell`` run over a ``GeneratorDataset``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
from _common import FakeMnist

import mshard as ms
import mshard.dataset as ds
from mshard import nn
from mshard.communication import init


def main(parallel=True, epochs=1, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    if parallel:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     enable_parallel_optimizer=True,
                                     parallel_optimizer_config={"parallel_optimizer_threshold": 1})
    else:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.STAND_ALONE)
    init()
    ms.set_seed(1)

    net = nn.SequentialCell(nn.Flatten(), nn.Dense(28 * 28, 256), nn.ReLU(), nn.Dense(256, 10))
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    train_net = nn.TrainOneStepCell(nn.WithLossCell(net, nn.CrossEntropyLoss()), optimizer)
    losses = []
    for _ in range(epochs):
        for image, label in ds.GeneratorDataset(FakeMnist(64), ["image", "label"], shuffle=False).batch(32):
            loss = train_net(image, label)
            losses.append(float(loss))
            if verbose:
                print(f"loss is {loss}")
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    ms.reset_auto_parallel_context()
    return losses, params


if __name__ == "__main__":
    main()
