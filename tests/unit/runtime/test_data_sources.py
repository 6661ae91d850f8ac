"""MindSpore's in-memory datasets (mshard._src.runtime.data_sources): batching, columns, deterministic shuffles,
per-rank shards (MindSpore's DistributedSampler: round robin after the shuffle, padded by wrapping) and errors."""

import jax
import numpy as np
import pytest

from mshard._src.runtime.data_sources import GeneratorDataset, NumpySlicesDataset
from mshard._src.values.errors import DatasetStrategyError
from mshard._src.values.seed import get_seed, set_seed


def rows_of(ds, col=0, epochs=1):
    """Column ``col`` of every row, one list per epoch (numpy, read through one iterator)."""
    it = ds.create_tuple_iterator(output_numpy=True)
    return [[r[col].tolist() for r in it] for _ in range(epochs)]


@pytest.fixture
def seed0():
    old = get_seed()
    set_seed(0)
    yield
    set_seed(old)


def test_batch_stacks_rows_and_keeps_or_drops_the_remainder():
    x, y = np.arange(20.0).reshape(10, 2), np.arange(10)
    ds = NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False)
    kept = list(ds.batch(4).create_tuple_iterator(output_numpy=True))
    assert [b[0].shape for b in kept] == [(4, 2), (4, 2), (2, 2)]
    np.testing.assert_array_equal(np.concatenate([b[0] for b in kept]), x)
    np.testing.assert_array_equal(np.concatenate([b[1] for b in kept]), y)
    assert ds.batch(4).get_dataset_size() == 3 and ds.batch(4, drop_remainder=True).get_dataset_size() == 2
    dropped = rows_of(ds.batch(4, drop_remainder=True), col=1)[0]
    assert dropped == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ds.get_dataset_size() == 10 and ds.batch(4).get_batch_size() == 4


def test_iterators_yield_jax_arrays_unless_output_numpy():
    ds = NumpySlicesDataset(np.arange(6.0).reshape(3, 2), shuffle=False).batch(3)
    (row,) = list(ds.create_tuple_iterator())
    assert isinstance(row, list) and isinstance(row[0], jax.Array) and row[0].shape == (3, 2)
    (row,) = list(ds.create_tuple_iterator(output_numpy=True))
    assert type(row[0]) is np.ndarray
    (row,) = list(ds)                                  # __iter__: as create_tuple_iterator()
    assert isinstance(row[0], jax.Array)


def test_dict_columns_take_the_keys_as_names():
    ds = NumpySlicesDataset({"image": np.zeros((4, 3)), "label": np.arange(4)}, shuffle=False)
    assert ds.get_col_names() == ["image", "label"]
    first = next(iter(ds.batch(2).create_dict_iterator(output_numpy=True)))
    assert sorted(first) == ["image", "label"] and first["label"].tolist() == [0, 1] and first["image"].shape == (2, 3)
    renamed = NumpySlicesDataset({"a": np.arange(2), "b": np.arange(2)}, column_names=["x", "y"])
    assert renamed.get_col_names() == ["x", "y"]


def test_a_tuple_is_columns_a_list_is_one_column_as_in_mindspore():
    assert NumpySlicesDataset((np.arange(3), np.arange(3))).get_col_names() == ["column_0", "column_1"]
    one = NumpySlicesDataset([[1, 2], [3, 4], [5, 6]], shuffle=False)
    assert one.get_col_names() == ["column_0"] and rows_of(one)[0] == [[1, 2], [3, 4], [5, 6]]


def test_shuffle_is_a_permutation_per_epoch_deterministic_from_the_seed(seed0):
    data = np.arange(32)
    a = rows_of(NumpySlicesDataset(data), epochs=3)
    b = rows_of(NumpySlicesDataset(data), epochs=3)
    assert a == b                                       # the same seed: the same orders, epoch by epoch
    for order in a:
        assert sorted(order) == list(range(32))
    assert a[0] != a[1] != a[2] and a[0] != list(range(32))   # reshuffled every epoch
    # each pass over the dataset itself is the next epoch, as through one iterator
    ds = NumpySlicesDataset(data)
    assert [[int(r[0]) for r in ds] for _ in range(2)] == a[:2]
    set_seed(1)
    assert rows_of(NumpySlicesDataset(data), epochs=1)[0] != a[0]


def test_the_shuffle_op_is_deterministic_and_keeps_every_row(seed0):
    ds = NumpySlicesDataset(np.arange(50), shuffle=False).shuffle(8)
    a, b = rows_of(ds, epochs=2), rows_of(ds, epochs=2)
    assert a == b and sorted(a[0]) == list(range(50)) and a[0] != list(range(50)) and a[0] != a[1]


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_split_round_robin_and_cover_every_row_once(seed0, shuffle):
    n, k = 24, 4
    shards = [rows_of(NumpySlicesDataset(np.arange(n), shuffle=shuffle, num_shards=k, shard_id=i), epochs=2)
              for i in range(k)]
    for e in range(2):
        got = sorted(v for s in shards for v in s[e])
        assert got == list(range(n))                    # every row exactly once over the shards
        assert all(len(s[e]) == n // k for s in shards)
    if not shuffle:
        assert [s[0] for s in shards] == [list(range(i, n, k)) for i in range(k)]
    else:                                               # shard i takes rows i::k of the one shuffled order
        whole = rows_of(NumpySlicesDataset(np.arange(n)), epochs=2)
        for e in range(2):
            assert [s[e] for s in shards] == [whole[e][i::k] for i in range(k)]


def test_shards_of_an_uneven_dataset_are_padded_by_wrapping():
    """MindSpore's DistributedSampler gives every shard ceil(n / k) rows (the processes step together)."""
    shards = [rows_of(GeneratorDataset(list(range(10)), ["v"], shuffle=False, num_shards=4, shard_id=i))[0]
              for i in range(4)]
    assert shards == [[0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1]]
    assert GeneratorDataset(list(range(10)), ["v"], num_shards=4, shard_id=3).get_dataset_size() == 3


def test_generator_sources():
    class Pairs:
        def __getitem__(self, i):
            return np.float32(i), np.int32(i * i)

        def __len__(self):
            return 6

    ds = GeneratorDataset(Pairs(), column_names=["x", "y"], shuffle=False)
    assert ds.get_dataset_size() == 6 and rows_of(ds, col=1)[0] == [0, 1, 4, 9, 16, 25]
    assert GeneratorDataset(Pairs()).get_col_names() == ["column_0", "column_1"]

    def gen():
        for i in range(5):
            yield np.full(2, i), i
    ds = GeneratorDataset(gen, ["a", "b"]).batch(2)
    assert ds.get_dataset_size() == 3 and rows_of(ds, col=1, epochs=2) == [[[0, 1], [2, 3], [4]]] * 2
    once = GeneratorDataset((i for i in range(3)), "v")   # a generator object: replayed after its one pass
    assert rows_of(once, epochs=2) == [[0, 1, 2], [0, 1, 2]]
    assert GeneratorDataset(Pairs(), ["x", "y"], column_types=[np.float64, np.int64]).batch(6).create_tuple_iterator(
        output_numpy=True).__next__()[0].dtype == np.float64


def test_map_repeat_and_epochs_of_an_iterator(seed0):
    ds = NumpySlicesDataset((np.arange(4), np.arange(4)), ["x", "y"], shuffle=False)
    mapped = ds.map([lambda v: v * 10, lambda v: v + 1], input_columns="x")
    assert rows_of(mapped)[0] == [1, 11, 21, 31] and rows_of(mapped, col=1)[0] == [0, 1, 2, 3]
    swapped = ds.map(lambda a, b: (b * 2, a), input_columns=["x", "y"], output_columns=["p", "q"])
    assert swapped.get_col_names() == ["p", "q"] and rows_of(swapped)[0] == [0, 2, 4, 6]
    rep = NumpySlicesDataset(np.arange(5)).repeat(2)
    (both,) = rows_of(rep)
    assert rep.get_dataset_size() == 10 and sorted(both[:5]) == sorted(both[5:]) == list(range(5))
    assert both[:5] != both[5:]                          # each repetition is the next epoch
    it = ds.create_tuple_iterator(num_epochs=1, output_numpy=True)
    assert len(list(it)) == 4 and list(it) == []


@pytest.mark.parametrize("make, match", [
    (lambda: NumpySlicesDataset(np.arange(8), num_shards=2), r"num_shards=2 and shard_id=None"),
    (lambda: NumpySlicesDataset(np.arange(8), shard_id=0), r"num_shards=None and shard_id=0"),
    (lambda: NumpySlicesDataset(np.arange(8), num_shards=2, shard_id=2), r"shard_id=2 must be an int in .* = \[0, 1\]"),
    (lambda: NumpySlicesDataset(np.arange(8), num_shards=0, shard_id=0), r"num_shards=0 must be an int >= 1"),
    (lambda: NumpySlicesDataset(np.arange(8)).batch(0), r"batch_size=0 must be an int >= 1"),
    (lambda: NumpySlicesDataset((np.arange(8), np.arange(7))), r"\[8, 7\] rows"),
    (lambda: NumpySlicesDataset((np.arange(8), np.arange(8)), ["a"]), r"names 1 column\(s\) but data has 2"),
    (lambda: NumpySlicesDataset(np.arange(8), sampler=[0, 1]), r"sampler=\[0, 1\] is not offered"),
    (lambda: GeneratorDataset(lambda: iter([(1,)]), ["v"], shuffle=True), r"shuffle=True needs a random-access"),
    (lambda: GeneratorDataset(lambda: iter([(1,)]), ["v"], num_shards=2, shard_id=0), r"num_shards/shard_id need"),
    (lambda: GeneratorDataset(lambda: iter([(1,)])), r"column_names=None for an iterable source"),
    (lambda: NumpySlicesDataset(np.arange(8)).shuffle(1), r"buffer_size=1 must be an int >= 2"),
    (lambda: NumpySlicesDataset(np.arange(8)).map(len, input_columns="nope"), r"input_columns \['nope'\]"),
])
def test_bad_arguments_name_the_parameter(make, match):
    with pytest.raises(DatasetStrategyError, match=match):
        make()


def test_rows_that_do_not_fit_are_named():
    ds = GeneratorDataset([(1, 2), (3, 4)], ["a"])
    with pytest.raises(DatasetStrategyError, match=r"a row has 2 column\(s\) but column_names gives 1"):
        rows_of(ds)
    ragged = GeneratorDataset([np.zeros(2), np.zeros(3)], ["v"], shuffle=False).batch(2)
    with pytest.raises(DatasetStrategyError, match=r"column 'v' has rows of shapes \[\(2,\), \(3,\)\]"):
        rows_of(ragged)


def test_the_tutorials_mnist_pipeline_maps_rescale_normalize_hwc2chw_and_typecast():
    """MindSpore's tutorial pipeline over MNIST-shaped rows ([28, 28, 1] uint8 images, uint32 labels): the images
    rescaled to [0, 1], normalised with MNIST's mean/std, made [1, 28, 28]; the labels cast to int32. Checked
    against the same formula written with NumPy on the whole batch."""
    import mshard as ms
    from mshard.dataset import transforms, vision

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(8, 28, 28, 1)).astype(np.uint8)
    labels = rng.integers(0, 10, size=(8,)).astype(np.uint32)
    dataset = GeneratorDataset(list(zip(images, labels, strict=True)), ["image", "label"], shuffle=False)
    dataset = dataset.map([vision.Rescale(1.0 / 255.0, 0), vision.Normalize(mean=(0.1307,), std=(0.3081,)),
                           vision.HWC2CHW()], "image")
    dataset = dataset.map(transforms.TypeCast(ms.int32), "label").batch(4)
    got = list(dataset.create_tuple_iterator(output_numpy=True))
    want = ((images.astype(np.float64) / 255.0 - 0.1307) / 0.3081).transpose(0, 3, 1, 2)
    assert len(got) == 2
    for k, (x, y) in enumerate(got):
        assert x.shape == (4, 1, 28, 28) and x.dtype == np.float32 and y.dtype == np.int32
        np.testing.assert_allclose(x, want[4 * k:4 * k + 4], rtol=1e-6, atol=1e-6)   # float32 of a float64 formula
        np.testing.assert_array_equal(y, labels[4 * k:4 * k + 4].astype(np.int32))
    with pytest.raises(ms.errors.DatasetStrategyError, match="is_hwc"):
        vision.Normalize(mean=(0.1, 0.2, 0.3), std=(1, 1, 1))(np.zeros((28, 28, 1)))
