"""MindSpore's distributed checkpoint tutorials in their own idiom (``mindspore`` -> ``mshard``): train under one
strategy and save with ``ModelCheckpoint(config=CheckpointConfig(integrated_save=False))``; then load into the same
network under another strategy for inference, with ``Model.infer_predict_layout`` and
``ms.load_distributed_checkpoint``, and into a third copy through MindSpore's parameter dict
(``ms.load_checkpoint(file)`` + ``ms.load_param_into_net``).

What differs from MindSpore: a checkpoint is one directory holding every rank's shards (global arrays), so the
per-rank file list names the same directory for every rank, and no strategy file or ``transform_checkpoints`` is
needed to load it under another strategy or device count.

    .venv/bin/python examples/mindspore_style/checkpoint.py          # 8 simulated CPU devices
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import tempfile

import numpy as np

import mshard as ms
from mshard import nn, ops, train
from mshard.common.initializer import initializer
from mshard.communication import get_group_size, init


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc1_weight = ms.Parameter(initializer("normal", [64, 256], ms.float32))
        self.fc2_weight = ms.Parameter(initializer("normal", [256, 10], ms.float32))
        self.matmul1 = ops.MatMul()
        self.relu = ops.ReLU()
        self.matmul2 = ops.MatMul()

    def construct(self, x):
        return self.matmul2(self.relu(self.matmul1(x, self.fc1_weight)), self.fc2_weight)


def create_dataset(batch_size=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 64)).astype(np.float32)
    y = rng.integers(0, 10, size=(128,)).astype(np.int32)
    return ms.dataset.NumpySlicesDataset((x, y), column_names=["data", "label"], shuffle=False).batch(batch_size)


def train_and_save(directory, epochs, verbose):
    """Train with a Megatron split (dp 2 x mp 4) and save every 2 steps, keeping the last checkpoint."""
    net = Network()
    net.matmul1.shard(((2, 1), (1, 4)))
    net.relu.shard(((2, 4),))
    net.matmul2.shard(((2, 4), (4, 1)))
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    model = ms.Model(net, loss_fn=nn.CrossEntropyLoss(), optimizer=optimizer)
    ckpt_config = train.CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=1, integrated_save=False)
    ckpoint_cb = train.ModelCheckpoint(prefix="checkpoint", directory=directory, config=ckpt_config)
    callbacks = [ckpoint_cb] + ([train.LossMonitor()] if verbose else [])
    model.train(epochs, create_dataset(), callbacks=callbacks)
    return ckpoint_cb.latest_ckpt_file_name


def load_and_predict(ckpt_file, x):
    """Another strategy (the hidden layer 8-way column parallel, no data parallel), the checkpoint loaded into
    the layout its predict plan gives each parameter."""
    net = Network()
    net.matmul1.shard(((1, 1), (1, 8)))
    net.relu.shard(((1, 8),))
    net.matmul2.shard(((1, 8), (8, 1)))
    model = ms.Model(net)
    predict_layout = model.infer_predict_layout(ms.Tensor(x))
    ckpt_file_list = [ckpt_file] * get_group_size()            # one entry per rank, as MindSpore's list
    ms.load_distributed_checkpoint(net, ckpt_file_list, predict_layout)
    return net, np.asarray(model.predict(ms.Tensor(x)))


def main(parallel=True, epochs=1, verbose=True, directory=None):
    ms.set_context(mode=ms.GRAPH_MODE)
    mode = ms.ParallelMode.SEMI_AUTO_PARALLEL if parallel else ms.ParallelMode.STAND_ALONE
    ms.set_auto_parallel_context(parallel_mode=mode)
    init()
    ms.set_seed(1)
    if not epochs:                                  # the parameters before training (nothing saved)
        net = Network()
        ms.reset_auto_parallel_context()
        return np.zeros((16, 10), np.float32), {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    with tempfile.TemporaryDirectory(prefix="mshard_ckpt_") as tmp:       # or keep it: main(directory=...)
        directory = directory or tmp
        ckpt_file = train_and_save(directory, epochs, verbose)

        x = np.random.default_rng(1).normal(size=(16, 64)).astype(np.float32)
        net, logits = load_and_predict(ckpt_file, x)

        # MindSpore's parameter dict: every saved leaf (parameters and Momentum's state), loaded by name
        param_dict = ms.load_checkpoint(ckpt_file)
        copy = Network()
        param_not_load, _ = ms.load_param_into_net(copy, param_dict)
        assert not param_not_load, param_not_load
        for p, q in zip(net.trainable_params(), copy.trainable_params()):
            assert np.array_equal(np.asarray(p[...]), np.asarray(q[...])), p.name
        if verbose:
            print(f"checkpoint {ckpt_file}: {len(param_dict)} leaves; predict logits[0] = {logits[0][:4]}")
    params = {p.name: np.asarray(p[...]) for p in net.trainable_params()}
    ms.reset_auto_parallel_context()
    return logits, params


if __name__ == "__main__":
    main()
