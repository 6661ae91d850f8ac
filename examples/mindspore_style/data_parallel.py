"""MindSpore's data-parallel tutorial in MindSpore's own idiom, with ``mindspore`` changed to ``mshard``.

A ``SequentialCell`` of Dense layers without ``rngs`` (seeded by ``set_seed``), ``value_and_grad`` over
``trainable_params()``, ``nn.DistributedGradReducer`` and ``optimizer(grads)`` in an ``@ms.jit`` step, on an
in-memory ``GeneratorDataset`` of MNIST's shapes. In one process the batch is the global batch, split over the
devices by ``dataset_strategy``; the reducer has nothing left to do (the gradient is already the global one).

    .venv/bin/python examples/mindspore_style/data_parallel.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
from _common import FakeMnist

import mshard as ms
import mshard.dataset as ds
from mshard import nn
from mshard.communication import init


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.dense_relu_sequential = nn.SequentialCell(
            nn.Dense(28 * 28, 512, weight_init="normal", bias_init="zeros"),
            nn.ReLU(),
            nn.Dense(512, 512, weight_init="normal", bias_init="zeros"),
            nn.ReLU(),
            nn.Dense(512, 10, weight_init="normal", bias_init="zeros"),
        )

    def construct(self, x):
        x = self.flatten(x)
        logits = self.dense_relu_sequential(x)
        return logits


def create_dataset(batch_size):
    dataset = ds.GeneratorDataset(FakeMnist(128), ["image", "label"], shuffle=False)
    return dataset.batch(batch_size)


def main(parallel=True, epochs=1, batch_size=32, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    mode = ms.ParallelMode.DATA_PARALLEL if parallel else ms.ParallelMode.STAND_ALONE
    ms.set_auto_parallel_context(parallel_mode=mode, gradients_mean=True)
    init()
    ms.set_seed(1)

    data_set = create_dataset(batch_size)
    net = Network()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = nn.SGD(net.trainable_params(), 1e-2)

    def forward_fn(data, label):
        logits = net(data)
        loss = loss_fn(logits, label)
        return loss, logits

    grad_fn = ms.value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)
    grad_reducer = nn.DistributedGradReducer(optimizer.parameters)

    @ms.jit
    def train_step(inputs, labels):
        (loss, _), grads = grad_fn(inputs, labels)
        grads = grad_reducer(grads)
        optimizer(grads)
        return loss

    losses = []
    for epoch in range(epochs):
        for step, (inputs, labels) in enumerate(data_set.create_tuple_iterator()):
            loss = train_step(inputs, labels)
            losses.append(float(loss))
            if verbose:
                print(f"epoch: {epoch}, step: {step}, loss is {loss}")
    ms.reset_auto_parallel_context()
    return losses, {p.name: np.asarray(p[...]) for p in net.trainable_params()}


if __name__ == "__main__":
    main()
