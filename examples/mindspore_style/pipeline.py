"""MindSpore's pipeline-parallel tutorial (2.6's functional form) in its own idiom, ``mindspore`` -> ``mshard``.

A network built under ``no_init_parameters``, each layer given its ``pipeline_stage``, wrapped with loss in
``parallel.nn.Pipeline(..., micro_size=4)``; ``value_and_grad`` over ``net_with_loss.trainable_params()``, an
``@ms.jit`` step that calls ``PipelineGradReducer`` and ``optimizer(grads)``, and ``AutoParallel(train_one_step,
parallel_mode="semi_auto").pipeline(stages=2)``. The two stages run MindSpore's 1F1B schedule over 4 devices each
(data parallel inside a stage). The MNIST reader is replaced by an in-memory dataset of the same shapes.

    .venv/bin/python examples/mindspore_style/pipeline.py          # 8 simulated CPU devices
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np
from _common import FakeMnist

import mshard as ms
import mshard.dataset as ds
from mshard import nn, ops
from mshard.communication import init
from mshard.nn.utils import no_init_parameters
from mshard.parallel.auto_parallel import AutoParallel
from mshard.parallel.nn import Pipeline, PipelineGradReducer


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = ops.Flatten()
        self.layer1 = nn.Dense(28 * 28, 512)
        self.relu1 = nn.ReLU()
        self.layer2 = nn.Dense(512, 512)
        self.relu2 = nn.ReLU()
        self.layer3 = nn.Dense(512, 10)

    def construct(self, x):
        x = self.flatten(x)
        x = self.layer1(x)
        x = self.relu1(x)
        x = self.layer2(x)
        x = self.relu2(x)
        logits = self.layer3(x)
        return logits


def build(parallel=True):
    """-> (the step to call, the network): the tutorial's lines up to its training loop."""
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.STAND_ALONE)   # the wrapper carries the settings
    init()
    ms.set_seed(1)

    with no_init_parameters():
        net = Network()
        optimizer = nn.SGD(net.trainable_params(), 1e-2)
        pp_grad_reducer = PipelineGradReducer(optimizer.parameters, opt_shard=False)

    net.layer1.pipeline_stage = 0
    net.relu1.pipeline_stage = 0
    net.layer2.pipeline_stage = 0
    net.relu2.pipeline_stage = 1
    net.layer3.pipeline_stage = 1

    loss_fn = nn.CrossEntropyLoss()
    net_with_loss = Pipeline(nn.WithLossCell(net, loss_fn), 4)
    net_with_loss.set_train()

    def forward_fn(inputs, target):
        loss = net_with_loss(inputs, target)
        return loss

    grad_fn = ms.value_and_grad(forward_fn, None, net_with_loss.trainable_params())

    @ms.jit
    def train_one_step(inputs, target):
        loss, grads = grad_fn(inputs, target)
        grads = pp_grad_reducer(grads)
        optimizer(grads)
        return loss, grads

    if parallel:
        parallel_net = AutoParallel(train_one_step, parallel_mode="semi_auto")
        parallel_net.pipeline(stages=2)
    else:
        parallel_net = train_one_step
    return parallel_net, net


def main(parallel=True, epochs=1, verbose=True):
    parallel_net, net = build(parallel)

    dataset = ds.GeneratorDataset(FakeMnist(96), ["image", "label"], shuffle=False).batch(32)
    losses = []
    for epoch in range(epochs):
        for i, (image, label) in enumerate(dataset):
            loss_output, _ = parallel_net(image, label)
            losses.append(float(loss_output))
            if verbose:
                print(f"epoch: {epoch}, step: {i}, loss is {loss_output}")
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    ms.reset_auto_parallel_context()
    return losses, params


if __name__ == "__main__":
    main()
