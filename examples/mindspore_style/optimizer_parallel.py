"""MindSpore's optimizer-parallel tutorial in its own idiom (``mindspore`` -> ``mshard``): semi_auto_parallel with
``enable_parallel_optimizer=True``, ``set_comm_fusion`` per layer, and the functional training step:
``value_and_grad`` over ``net.trainable_params()`` and an ``@ms.jit`` step that calls ``optimizer(grads)``. Each
device keeps 1/8 of Momentum's state and updates its slice; the weights are gathered whole after the update.

    .venv/bin/python examples/mindspore_style/optimizer_parallel.py          # 8 simulated CPU devices
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
from _common import FakeMnist

import mshard as ms
import mshard.dataset as ds
from mshard import nn, ops
from mshard.communication import init


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = ops.Flatten()
        self.layer1 = nn.Dense(28 * 28, 512)
        self.layer2 = nn.Dense(512, 512)
        self.layer3 = nn.Dense(512, 10)
        self.relu = nn.ReLU()

    def construct(self, x):
        x = self.flatten(x)
        x = self.layer1(x)
        x = self.relu(x)
        x = self.layer2(x)
        x = self.relu(x)
        logits = self.layer3(x)
        return logits


def build(parallel=True):
    """-> (the jitted step, the network, the optimizer): the tutorial up to its training loop."""
    ms.set_context(mode=ms.GRAPH_MODE)
    if parallel:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL, enable_parallel_optimizer=True)
    else:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.STAND_ALONE)
    init()
    ms.set_seed(1)

    net = Network()
    net.layer1.set_comm_fusion(0)
    net.layer2.set_comm_fusion(1)
    net.layer3.set_comm_fusion(2)
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def forward_fn(data, target):
        logits = net(data)
        loss = loss_fn(logits, target)
        return loss, logits

    grad_fn = ms.value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)

    @ms.jit
    def train_step(inputs, targets):
        (loss_value, _), grads = grad_fn(inputs, targets)
        optimizer(grads)
        return loss_value

    return train_step, net, optimizer


def main(parallel=True, epochs=1, verbose=True):
    train_step, net, _ = build(parallel)
    losses = []
    for epoch in range(epochs):
        for i, (image, label) in enumerate(ds.GeneratorDataset(FakeMnist(64), ["image", "label"],
                                                               shuffle=False).batch(32)):
            loss_output = train_step(image, label)
            losses.append(float(loss_output))
            if verbose:
                print(f"epoch: {epoch}, step: {i}, loss is {loss_output}")
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    ms.reset_auto_parallel_context()
    return losses, params


if __name__ == "__main__":
    main()
