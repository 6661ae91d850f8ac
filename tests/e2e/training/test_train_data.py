"""ms.dataset.shard_batch: global arrays by dataset_strategy, each device holding only its slice."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import assert_params_close, reference_train

import mshard as ms
from mshard import nn
from mshard.errors import DatasetStrategyError


def host(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def check_slices(arr, full):
    """Every device holds exactly its slice of the host batch (and nothing else)."""
    shard_shape = arr.sharding.shard_shape(arr.shape)
    for s in arr.addressable_shards:
        assert s.data.shape == shard_shape
        np.testing.assert_array_equal(np.asarray(s.data), full[s.index])
    return shard_shape


def test_data_parallel_splits_dim_0_over_all_devices():
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    x, y = host(16, 3), host(16, 1, seed=1)
    bx, by = ms.dataset.shard_batch((x, y))
    assert check_slices(bx, x) == (2, 3) and check_slices(by, y) == (2, 1)
    assert len(bx.sharding.device_set) == 8


def test_full_batch_gives_every_device_the_whole_batch():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
    x = host(4, 3)
    bx = ms.dataset.shard_batch({"x": x})["x"]
    assert check_slices(bx, x) == (4, 3) and len(bx.sharding.device_set) == 8


def test_tuple_strategy_splits_image_height_and_width():
    """The remote-sensing case: 2 images on 8 devices, H cut in 2 and W in 4; labels whole."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                                 dataset_strategy=((1, 1, 2, 4), (1, 1)))
    img, lab = host(2, 3, 8, 16), host(2, 10, seed=1)
    bi, bl = ms.dataset.shard_batch([img, lab])
    assert check_slices(bi, img) == (2, 3, 4, 4)
    assert check_slices(bl, lab) == (2, 10)
    # the 8 H/W tiles are distinct and cover the image
    tiles = {(s.index[2].start, s.index[3].start) for s in bi.addressable_shards}
    assert tiles == {(h, w) for h in (0, 4) for w in (0, 4, 8, 12)}


def test_an_iterator_of_batches_gives_sharded_batches():
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=4)
    source = (host(8, 2, seed=k) for k in range(3))
    out = list(ms.dataset.shard_batch(source))
    assert len(out) == 3
    for k, b in enumerate(out):
        assert check_slices(b, host(8, 2, seed=k)) == (2, 2) and len(b.sharding.device_set) == 4


def test_a_batch_the_strategy_cannot_split_is_a_clear_error():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                                 dataset_strategy=((1, 1, 2, 4),))
    with pytest.raises(DatasetStrategyError, match=r"cuts dim 3 into 4 slices but its size 6"):
        ms.dataset.shard_batch(host(2, 3, 8, 6))
    with pytest.raises(DatasetStrategyError, match=r"has 4 splits but the input has rank 3"):
        ms.dataset.shard_batch(host(2, 8, 8))
    with pytest.raises(DatasetStrategyError, match=r"2 inputs but dataset_strategy .* gives 1"):
        ms.dataset.shard_batch((host(2, 3, 8, 8), host(2)))
    ms.set_auto_parallel_context(dataset_strategy="data_parallel")
    with pytest.raises(DatasetStrategyError, match=r"splits dim 0 over 8 devices but its size is 12"):
        ms.dataset.shard_batch(host(12, 3))


class SmallConvNet(nn.Cell):
    def __init__(self, rngs):
        self.conv = nn.Conv2d(3, 8, 3, pad_mode="same", has_bias=True, rngs=rngs)
        self.pool = nn.MaxPool2d(2, 2)
        self.flatten = nn.Flatten()
        self.fc = nn.Dense(8 * 4 * 8, 10, rngs=rngs)

    def __call__(self, x):
        return self.fc(self.flatten(self.pool(jax.nn.relu(self.conv(x)))))


def test_training_on_height_width_split_images_matches_one_device():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True,
                                 dataset_strategy=((1, 1, 2, 4), (1, 1)))
    data = [(host(2, 3, 8, 16, seed=k), host(2, 10, seed=10 + k)) for k in range(3)]
    net = SmallConvNet(nnx.Rngs(0))

    def loss(p, y):
        return jnp.mean((p - y) ** 2)
    ref, _, ref_losses = reference_train(net, optax.adam(1e-2), data, loss)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, loss), optax.adam(1e-2))
    losses = []
    for b in ms.dataset.shard_batch(iter(data)):
        assert b[0].sharding.shard_shape(b[0].shape) == (2, 3, 4, 4)
        losses.append(float(step(*b)))
    # float32: 27-term conv sums (3 x 3 x 3, halos across the height/width split), a 256-term dense layer and a 20-term
    # mean reordered, ~sqrt(n) * 2**-24 <= 1e-6 relative per op, over 3 Adam steps
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    # shard_batch laid the images out exactly as the step planned them: nothing is resharded at the call
    lay = step.layouts(*data[0])
    n_state = len(jax.tree.leaves(nnx.state(step)))
    planned = lay.inputs[n_state]
    assert [len(d) for d in planned] == [0, 0, 1, 2]        # (1, 1, 2, 4) on the 2 x 2 x 2 prime mesh
    given = ms.dataset.batch_shardings([(2, 3, 8, 16)])[0].spec
    assert tuple(given) == tuple(None if not d else d[0] if len(d) == 1 else d for d in planned)
