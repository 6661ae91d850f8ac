"""MindSpore's operator-parallel tutorial in MindSpore's own idiom, with ``mindspore`` changed to ``mshard``.

A Cell with ``construct``, weights as ``Parameter(initializer(...))``, primitives sharded with ``.shard``, and the
functional training step: ``value_and_grad`` over ``net.trainable_params()`` and an ``@ms.jit`` step that closes over
the network and the optimizer Cell. The MNIST reader is replaced by an in-memory dataset of the same shapes.

    .venv/bin/python examples/mindspore_style/operator_parallel.py          # 8 simulated CPU devices
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

import mshard as ms
from mshard import nn, ops
from mshard.common.initializer import initializer
from mshard.communication import init


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = ops.Flatten()
        self.fc1_weight = ms.Parameter(initializer("normal", [28 * 28, 512], ms.float32))
        self.fc2_weight = ms.Parameter(initializer("normal", [512, 512], ms.float32))
        self.fc3_weight = ms.Parameter(initializer("normal", [512, 10], ms.float32))
        self.matmul1 = ops.MatMul()
        self.relu1 = ops.ReLU()
        self.matmul2 = ops.MatMul()
        self.relu2 = ops.ReLU()
        self.matmul3 = ops.MatMul()

    def construct(self, x):
        x = self.flatten(x)
        x = self.matmul1(x, self.fc1_weight)
        x = self.relu1(x)
        x = self.matmul2(x, self.fc2_weight)
        x = self.relu2(x)
        logits = self.matmul3(x, self.fc3_weight)
        return logits


def create_dataset(batch_size, steps, seed=0):
    """MNIST's shapes: images [batch, 1, 28, 28] float32, labels [batch] int32."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        yield (rng.normal(size=(batch_size, 1, 28, 28)).astype(np.float32),
               rng.integers(0, 10, size=(batch_size,)).astype(np.int32))


def main(parallel=True, steps=4, batch_size=32, verbose=True):
    ms.set_context(mode=ms.GRAPH_MODE)
    if parallel:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.SEMI_AUTO_PARALLEL)
    else:
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.STAND_ALONE)
    init()
    ms.set_seed(1)

    net = Network()
    net.matmul1.shard(((2, 4), (4, 1)))
    net.relu1.shard(((4, 1),))
    net.matmul2.shard(((1, 8), (8, 1)))
    net.relu2.shard(((8, 1),))

    optimizer = nn.SGD(net.trainable_params(), 1e-2)
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

    losses = []
    for step, (image, label) in enumerate(create_dataset(batch_size, steps)):
        loss_output = train_step(ms.Tensor(image), ms.Tensor(label))
        losses.append(float(loss_output))
        if verbose:
            print(f"step: {step}, loss is {loss_output}")
    ms.reset_auto_parallel_context()
    return losses, {n: np.asarray(p[...]) for n, p in [("fc1_weight", net.fc1_weight), ("fc2_weight", net.fc2_weight),
                                                          ("fc3_weight", net.fc3_weight)]}


if __name__ == "__main__":
    main()
