"""MindSpore's in-memory ``mindspore.dataset`` sources, ``GeneratorDataset`` and ``NumpySlicesDataset``, with
``batch``, ``map``, ``shuffle``, ``repeat`` and MindSpore's iterators.

A dataset yields rows: one numpy array per column. ``batch`` stacks rows along a new dim 0. Every shuffle draws from
``numpy.random.default_rng`` seeded by the global seed (``set_seed``, read when the source is built), the epoch and
the op's place in the pipeline, so a script reruns identically and every process of a job shuffles alike.

Data parallel: in a single-process program over 8 devices pass no ``num_shards``. The dataset yields the global
batch, and mshard's ``dataset_strategy`` splits it over the devices (``Model.train`` and ``ms.dataset.shard_batch``
give each device its rows). With several processes, each passes ``num_shards=<process count>`` and
``shard_id=<its rank>``, as MindSpore's per-rank datasets do: each process's batch is its part of the global batch.
So a MindSpore job of 8 one-device processes, ported to one process over 8 devices, keeps its global batch with
a batch size 8 times its per-rank one.

Not offered: MindSpore's file readers (``MnistDataset``, ``Cifar10Dataset``, ``MindDataset``, ...), samplers and
worker processes. Read files into numpy arrays and use ``NumpySlicesDataset`` or ``GeneratorDataset``.

>>> import numpy as np
>>> ds = NumpySlicesDataset({"x": np.arange(6.0), "y": np.arange(6) % 2}, shuffle=False).batch(4)
>>> [[a.tolist() for a in row] for row in ds.create_tuple_iterator(output_numpy=True)]
[[[0.0, 1.0, 2.0, 3.0], [0, 1, 0, 1]], [[4.0, 5.0], [0, 1]]]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from mshard._src.values.errors import DatasetStrategyError
from mshard._src.values.seed import get_seed

__all__ = ["Dataset", "GeneratorDataset", "NumpySlicesDataset"]

Row = tuple[np.ndarray, ...]


# -- argument checks ---------------------------------------------------------------------------------------
def _int_arg(where: str, name: str, value: Any, low: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise DatasetStrategyError(f"{where}: {name}={value!r} must be an int >= {low}; {fix}.")
    return int(value)


def _shards(where: str, num_shards: Any, shard_id: Any) -> tuple[int, int] | None:
    """MindSpore's per-rank sharding arguments: both or neither."""
    if num_shards is None and shard_id is None:
        return None
    if num_shards is None or shard_id is None:
        raise DatasetStrategyError(f"{where}: num_shards={num_shards!r} and shard_id={shard_id!r}: give both (each "
                                   f"process passes num_shards=<process count>, shard_id=<its rank>) or neither (one "
                                   f"process: the global batch, split over the devices by dataset_strategy).")
    k = _int_arg(where, "num_shards", num_shards, 1, "the number of processes that read the dataset")
    if isinstance(shard_id, bool) or not isinstance(shard_id, (int, np.integer)) or not 0 <= shard_id < k:
        raise DatasetStrategyError(f"{where}: shard_id={shard_id!r} must be an int in [0, num_shards - 1] = "
                                   f"[0, {k - 1}] (num_shards={k}); pass this process's rank.")
    return k, int(shard_id)


def _no_sampler(where: str, sampler: Any) -> None:
    if sampler is not None:
        raise DatasetStrategyError(f"{where}: sampler={sampler!r} is not offered; use shuffle=True/False and "
                                   f"num_shards/shard_id (MindSpore's DistributedSampler), or order the rows yourself.")


def _names(where: str, column_names: Any) -> list[str] | None:
    if column_names is None:
        return None
    names = [column_names] if isinstance(column_names, str) else column_names
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise DatasetStrategyError(f"{where}: column_names={column_names!r} must be a str or a list of str.")
    if len(set(names)) != len(names):
        raise DatasetStrategyError(f"{where}: column_names={list(names)!r} names a column twice; give unique names.")
    return list(names)


def _as_row(item: Any, ncols: int | None, where: str) -> Row:
    """One row of a source: a tuple/list of values is one value per column, anything else one column."""
    if isinstance(item, dict):
        raise DatasetStrategyError(f"{where}: a row is a dict ({sorted(item)}); return a tuple of arrays, one per "
                                   f"column (name the columns with column_names).")
    row = tuple(np.asarray(v) for v in item) if isinstance(item, (tuple, list)) else (np.asarray(item),)
    if ncols is not None and len(row) != ncols:
        raise DatasetStrategyError(f"{where}: a row has {len(row)} column(s) but column_names gives {ncols}; return "
                                   f"one value per column name.")
    return row


def _stack(rows: list[Row], names: list[str]) -> Row:
    out = []
    for i, name in enumerate(names):
        try:
            out.append(np.stack([r[i] for r in rows]))
        except ValueError as e:
            shapes = sorted({tuple(r[i].shape) for r in rows})
            raise DatasetStrategyError(f"batch: column {name!r} has rows of shapes {shapes}, which do not stack into "
                                       f"one batch; give every row the same shape (pad them in a map) or use "
                                       f"batch_size=1.") from e
    return tuple(out)


# -- the pipeline --------------------------------------------------------------------------------------------
class Dataset:
    """A dataset pipeline (MindSpore's ``mindspore.dataset.Dataset``): a source and the ops chained on it.

    Built by :class:`GeneratorDataset` / :class:`NumpySlicesDataset` and their ``batch``, ``map``, ``shuffle`` and
    ``repeat``; each op returns a new dataset. Each pass (``for row in ds``) is the next epoch: a shuffled
    dataset is reshuffled, deterministically. A fresh ``create_tuple_iterator()`` starts again from epoch 0.

    Args:
        parent: the dataset this op reads (None for a source).
        column_names: the names of the columns this dataset yields.

    >>> import numpy as np
    >>> ds = NumpySlicesDataset((np.arange(4), np.arange(4) * 10), column_names=["a", "b"], shuffle=False)
    >>> ds.get_col_names(), ds.get_dataset_size(), [int(b) for _, b in ds]
    (['a', 'b'], 4, [0, 10, 20, 30])
    """

    def __init__(self, parent: Dataset | None, column_names: Sequence[str]):
        self._parent = parent
        self._columns = list(column_names)
        self._depth = 0 if parent is None else parent._depth + 1
        self._seed = get_seed() if parent is None else parent._seed
        self._passes = 0
        self._count: int | None = None

    # what each op defines
    def _rows(self, epoch: int) -> Iterator[Row]:
        raise NotImplementedError

    def _size(self) -> int | None:
        """Rows (batches) per epoch; None: endless."""
        raise NotImplementedError

    def _rng(self, epoch: int) -> np.random.Generator:
        return np.random.default_rng([self._seed, epoch, self._depth])

    # MindSpore's ops
    def batch(self, batch_size: int, drop_remainder: bool = False, num_parallel_workers: int | None = None) -> Dataset:
        """Stack ``batch_size`` consecutive rows into one (a new dim 0); the last smaller batch is kept unless
        ``drop_remainder``. ``num_parallel_workers`` is accepted and unused (rows are stacked in this process)."""
        return _Batch(self, batch_size, drop_remainder)

    def map(self, operations: Callable | Sequence[Callable], input_columns: str | Sequence[str] | None = None,
            output_columns: str | Sequence[str] | None = None, num_parallel_workers: int | None = None,
            python_multiprocessing: bool = False) -> Dataset:
        """Apply ``operations`` (a callable or a list applied in turn) to the ``input_columns`` of every row (default:
        the first column); their outputs replace those columns (renamed to ``output_columns`` if given)."""
        return _Map(self, operations, input_columns, output_columns)

    def shuffle(self, buffer_size: int) -> Dataset:
        """Shuffle through a buffer of ``buffer_size`` rows (MindSpore's shuffle op; at least the dataset's size for a
        full shuffle)."""
        return _Shuffle(self, buffer_size)

    def repeat(self, count: int | None = None) -> Dataset:
        """The dataset ``count`` times over (each time the next epoch); None or -1: endless."""
        return _Repeat(self, count)

    # reading
    def get_col_names(self) -> list[str]:
        """The column names, in order."""
        return list(self._columns)

    def get_dataset_size(self) -> int:
        """The rows (batches, after ``batch``) of one epoch; -1 for an endless ``repeat``."""
        n = self._size()
        return -1 if n is None else n

    def get_batch_size(self) -> int:
        """The batch size of the last ``batch`` op (1 without one)."""
        node: Dataset | None = self
        while node is not None:
            if isinstance(node, _Batch):
                return node._batch_size
            node = node._parent
        return 1

    def create_tuple_iterator(self, columns: Sequence[str] | None = None, num_epochs: int = -1,
                              output_numpy: bool = False, do_copy: bool = True) -> _Iterator:
        """An iterator yielding each row as a list of arrays (``jax.numpy`` arrays, numpy with ``output_numpy``).
        Each ``for`` loop over it is one epoch, up to ``num_epochs`` (-1: no limit)."""
        return _Iterator(self, columns, num_epochs, output_numpy, as_dict=False)

    def create_dict_iterator(self, num_epochs: int = -1, output_numpy: bool = False, do_copy: bool = True) -> _Iterator:
        """As :meth:`create_tuple_iterator`, each row a dict ``{column name: array}``."""
        return _Iterator(self, None, num_epochs, output_numpy, as_dict=True)

    def __iter__(self) -> Iterator[list]:
        epoch = self._passes
        self._passes += 1
        return (_convert(r, False) for r in self._rows(epoch))


def _convert(row: Row, output_numpy: bool) -> list:
    if output_numpy:
        return list(row)
    return [a if a.dtype.kind in "OSUV" else jnp.asarray(a) for a in row]


class _Iterator:
    """MindSpore's dataset iterator: ``next`` runs through an epoch; the next ``for`` loop starts the next one."""

    def __init__(self, ds: Dataset, columns, num_epochs, output_numpy: bool, as_dict: bool):
        if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or (num_epochs < 1 and num_epochs != -1):
            raise DatasetStrategyError(f"create_tuple_iterator: num_epochs={num_epochs!r} must be a positive int or "
                                       f"-1 (no limit).")
        names = ds.get_col_names()
        cols = _names("create_tuple_iterator", columns)
        if cols is not None:
            unknown = [c for c in cols if c not in names]
            if unknown:
                raise DatasetStrategyError(f"create_tuple_iterator: columns {unknown} are not columns of the dataset "
                                           f"({names}).")
        self._ds, self._num_epochs, self._numpy, self._dict = ds, num_epochs, bool(output_numpy), as_dict
        self._names = cols or names
        self._pick = [names.index(c) for c in self._names]
        self._epoch = 0
        self._gen: Iterator[Row] | None = None

    def _start(self) -> None:
        if self._num_epochs != -1 and self._epoch >= self._num_epochs:
            self._gen = iter(())
        else:
            self._gen = self._ds._rows(self._epoch)
        self._epoch += 1

    def __iter__(self) -> _Iterator:
        if self._gen is None:
            self._start()
        return self

    def __next__(self):
        if self._gen is None:
            self._start()
        try:
            row = next(self._gen)
        except StopIteration:
            self._gen = None
            raise
        out = _convert(tuple(row[i] for i in self._pick), self._numpy)
        return dict(zip(self._names, out, strict=True)) if self._dict else out


# -- sources -------------------------------------------------------------------------------------------------
class _Replay:
    """A one-pass iterator kept in memory as it is read, so every later pass replays it."""

    def __init__(self, it: Iterator):
        self._it, self._seen, self._done = it, [], False

    def __iter__(self):
        yield from self._seen[:]
        if self._done:
            return
        for item in self._it:
            self._seen.append(item)
            yield item
        self._done = True


class _Source(Dataset):
    """A source's order: MindSpore's sampler over ``n`` rows (shuffled per epoch, then split round robin into the
    shards, padded by wrapping to an equal count per shard as MindSpore's DistributedSampler)."""

    def __init__(self, where: str, names: list[str], n: int | None, shuffle: bool, shards, num_samples):
        super().__init__(None, names)
        self._where, self._n, self._shuffle, self._shards = where, n, shuffle, shards
        self._num_samples = None if num_samples is None else _int_arg(where, "num_samples", num_samples, 1,
                                                                      "or None for every row")

    def _order(self, epoch: int) -> np.ndarray:
        n = self._n
        idx = self._rng(epoch).permutation(n) if self._shuffle else np.arange(n)
        if self._shards is not None:
            k, sid = self._shards
            per = -(-n // k)
            idx = idx[(np.arange(per) * k + sid) % n] if n else idx
        return idx if self._num_samples is None else idx[:self._num_samples]

    def _size(self) -> int:
        if self._n is not None:
            per = -(-self._n // self._shards[0]) if self._shards is not None else self._n
            return per if self._num_samples is None else min(per, self._num_samples)
        if self._count is None:
            self._count = sum(1 for _ in self._rows(0))
        return self._count


class GeneratorDataset(_Source):
    """MindSpore's ``GeneratorDataset``: rows from a Python source.

    ``source`` is random access (``__getitem__`` and ``__len__``: the rows are sampled, shuffled and sharded), or
    iterable (a generator function, called once per epoch, or an iterable: read in order). A row is a tuple of
    values (one per column) or a single array. Differences from MindSpore: no worker processes, no samplers, and
    ``column_names`` may be omitted for a random-access source (``column_0``, ``column_1``, ...).

    Args:
        source: a random-access object, a generator function or an iterable of rows.
        column_names: the columns' names (a str or list); required for an iterable source.
        column_types: optional numpy dtypes the columns are cast to, one per column.
        num_samples: read at most this many rows per epoch (of this shard); None: all.
        num_parallel_workers: accepted, unused (rows are read in this process).
        shuffle: shuffle the rows every epoch; None (MindSpore's default): True for a random-access source, False
            for an iterable one (which cannot be shuffled here: use ``.shuffle(buffer_size)``).
        sampler: not offered (None).
        num_shards: the number of processes reading the dataset (MindSpore's per-rank sharding); with ``shard_id``.
        shard_id: this process's rank: it reads rows ``shard_id::num_shards`` of the (shuffled) order, padded by
            wrapping so every shard has ``ceil(rows / num_shards)``.
        python_multiprocessing: accepted, unused.
        max_rowsize: accepted, unused.

    >>> ds = GeneratorDataset(lambda: ((i, i * i) for i in range(5)), column_names=["x", "x2"])
    >>> [int(b) for _, b in ds.create_tuple_iterator(output_numpy=True)]
    [0, 1, 4, 9, 16]
    >>> class Squares:
    ...     def __getitem__(self, i): return (i, i * i)
    ...     def __len__(self): return 8
    >>> sorted(int(a) for a, _ in GeneratorDataset(Squares(), ["x", "x2"], shuffle=False, num_shards=4, shard_id=1))
    [1, 5]
    """

    def __init__(self, source: Any, column_names: str | Sequence[str] | None = None,
                 column_types: Sequence[Any] | None = None, num_samples: int | None = None,
                 num_parallel_workers: int | None = None, shuffle: bool | None = None, sampler: Any = None,
                 num_shards: int | None = None, shard_id: int | None = None, python_multiprocessing: bool = False,
                 max_rowsize: int | None = None):
        where = "GeneratorDataset"
        _no_sampler(where, sampler)
        shards = _shards(where, num_shards, shard_id)
        names = _names(where, column_names)
        random_access = hasattr(source, "__getitem__") and hasattr(source, "__len__") and not isinstance(source, str)
        if random_access:
            n = len(source)
            if names is None:
                names = [f"column_{i}" for i in range(len(_as_row(source[0], None, where)))] if n else []
        else:
            if not (callable(source) or hasattr(source, "__iter__")):
                raise DatasetStrategyError(f"{where}: source={type(source).__name__} is neither random access "
                                           f"(__getitem__ and __len__) nor iterable nor a generator function; give "
                                           f"one of them.")
            if shuffle:
                raise DatasetStrategyError(f"{where}: shuffle=True needs a random-access source (__getitem__ and "
                                           f"__len__), got an iterable {type(source).__name__}; pass shuffle=None/"
                                           f"False and chain .shuffle(buffer_size), or give a random-access source.")
            if shards is not None:
                raise DatasetStrategyError(f"{where}: num_shards/shard_id need a random-access source (__getitem__ "
                                           f"and __len__), got an iterable {type(source).__name__}; give a "
                                           f"random-access source, or yield only this process's rows.")
            if names is None:
                raise DatasetStrategyError(f"{where}: column_names=None for an iterable source; name the columns "
                                           f"(e.g. column_names=['data', 'label']).")
            if not callable(source) and iter(source) is source:
                source = _Replay(source)
            n = None
        if column_types is not None and len(column_types) != len(names):
            raise DatasetStrategyError(f"{where}: column_types gives {len(column_types)} dtype(s) for {len(names)} "
                                       f"column(s) {names}; give one per column.")
        super().__init__(where, names, n, bool(random_access if shuffle is None else shuffle), shards, num_samples)
        self._source = source
        self._types = None if column_types is None else [np.dtype(t) for t in column_types]

    def _rows(self, epoch: int) -> Iterator[Row]:
        ncols = len(self._columns)
        if self._n is not None:
            rows = (_as_row(self._source[int(i)], ncols, self._where) for i in self._order(epoch))
        else:
            items = self._source() if callable(self._source) else iter(self._source)
            rows = (_as_row(r, ncols, self._where) for r in items)
            if self._num_samples is not None:
                rows = itertools.islice(rows, self._num_samples)
        for r in rows:
            yield r if self._types is None else tuple(a.astype(t) for a, t in zip(r, self._types, strict=True))


class NumpySlicesDataset(_Source):
    """MindSpore's ``NumpySlicesDataset``: rows are slices of in-memory arrays along dim 0.

    As in MindSpore: a tuple is one column per element, a dict one column per key (its key the column's name),
    anything else (an array, a list) one column. Rows are shuffled every epoch by default and split over
    ``num_shards`` processes as :class:`GeneratorDataset`'s.

    Args:
        data: a tuple of arrays, a dict ``{column name: array}``, or one array / list; equal lengths along dim 0.
        column_names: the columns' names; default: the dict's keys, else ``column_0``, ``column_1``, ...
        num_samples: read at most this many rows per epoch (of this shard); None: all.
        num_parallel_workers: accepted, unused.
        shuffle: shuffle the rows every epoch (None, MindSpore's default, is True).
        sampler: not offered (None).
        num_shards: the number of processes reading the dataset; with ``shard_id``.
        shard_id: this process's rank: it reads rows ``shard_id::num_shards`` of the (shuffled) order.

    >>> import numpy as np
    >>> ds = NumpySlicesDataset((np.arange(10.0), np.arange(10)), ["x", "y"], shuffle=False).batch(4, True)
    >>> [b.tolist() for _, b in ds.create_tuple_iterator(output_numpy=True)], ds.get_dataset_size()
    ([[0, 1, 2, 3], [4, 5, 6, 7]], 2)
    """

    def __init__(self, data: Any, column_names: str | Sequence[str] | None = None, num_samples: int | None = None,
                 num_parallel_workers: int | None = None, shuffle: bool | None = None, sampler: Any = None,
                 num_shards: int | None = None, shard_id: int | None = None):
        where = "NumpySlicesDataset"
        _no_sampler(where, sampler)
        shards = _shards(where, num_shards, shard_id)
        names = _names(where, column_names)
        if isinstance(data, dict):
            keys = list(data)
            cols = [np.asarray(getattr(v, "values", v)) for v in data.values()]
        else:
            keys = None
            cols = [np.asarray(v) for v in data] if isinstance(data, tuple) else [np.asarray(data)]
        if not cols or any(c.ndim == 0 for c in cols):
            raise DatasetStrategyError(f"{where}: data must hold at least one column with a dim 0 to slice, got "
                                       f"shapes {[c.shape for c in cols]}.")
        lengths = [len(c) for c in cols]
        if len(set(lengths)) != 1:
            raise DatasetStrategyError(f"{where}: the columns have {lengths} rows; give every column the same length "
                                       f"along dim 0.")
        names = names or keys or [f"column_{i}" for i in range(len(cols))]
        if len(names) != len(cols):
            raise DatasetStrategyError(f"{where}: column_names={names!r} names {len(names)} column(s) but data has "
                                       f"{len(cols)}; give one name per column.")
        super().__init__(where, names, lengths[0], True if shuffle is None else bool(shuffle), shards, num_samples)
        self._data = cols

    def _rows(self, epoch: int) -> Iterator[Row]:
        for i in self._order(epoch):
            yield tuple(c[i] for c in self._data)


# -- ops -----------------------------------------------------------------------------------------------------
class _Batch(Dataset):
    def __init__(self, parent: Dataset, batch_size: Any, drop_remainder: Any):
        super().__init__(parent, parent.get_col_names())
        self._batch_size = _int_arg("batch", "batch_size", batch_size, 1, "rows per batch")
        if not isinstance(drop_remainder, bool):
            raise DatasetStrategyError(f"batch: drop_remainder={drop_remainder!r} must be a bool.")
        self._drop = drop_remainder

    def _rows(self, epoch: int) -> Iterator[Row]:
        buf: list[Row] = []
        for r in self._parent._rows(epoch):
            buf.append(r)
            if len(buf) == self._batch_size:
                yield _stack(buf, self._columns)
                buf = []
        if buf and not self._drop:
            yield _stack(buf, self._columns)

    def _size(self) -> int | None:
        n = self._parent._size()
        if n is None:
            return None
        return n // self._batch_size if self._drop else -(-n // self._batch_size)


class _Map(Dataset):
    def __init__(self, parent: Dataset, operations: Any, input_columns: Any, output_columns: Any):
        names = parent.get_col_names()
        ops = list(operations) if isinstance(operations, (list, tuple)) else [operations]
        if not ops or not all(callable(op) for op in ops):
            raise DatasetStrategyError(f"map: operations={operations!r} must be a callable or a non-empty list of "
                                       f"callables.")
        ins = _names("map", input_columns) or names[:1]
        unknown = [c for c in ins if c not in names]
        if unknown:
            raise DatasetStrategyError(f"map: input_columns {unknown} are not columns of the dataset ({names}).")
        outs = _names("map", output_columns) or ins
        if len(outs) != len(ins):
            raise DatasetStrategyError(f"map: output_columns={outs!r} gives {len(outs)} name(s) for {len(ins)} input "
                                       f"column(s); here the outputs replace the input columns in place, so give one "
                                       f"output name per input column.")
        new = list(names)
        for i, o in zip(ins, outs, strict=True):
            new[names.index(i)] = o
        if len(set(new)) != len(new):
            raise DatasetStrategyError(f"map: output_columns={outs!r} repeats a column name of {names}.")
        super().__init__(parent, new)
        self._ops, self._idx = ops, [names.index(c) for c in ins]

    def _rows(self, epoch: int) -> Iterator[Row]:
        for r in self._parent._rows(epoch):
            vals = [r[i] for i in self._idx]
            for op in self._ops:
                out = op(*vals)
                vals = list(out) if isinstance(out, tuple) else [out]
            if len(vals) != len(self._idx):
                raise DatasetStrategyError(f"map: the operations return {len(vals)} value(s) for "
                                           f"{len(self._idx)} input column(s); return one value per input column.")
            row = list(r)
            for i, v in zip(self._idx, vals, strict=True):
                row[i] = np.asarray(v)
            yield tuple(row)

    def _size(self) -> int | None:
        return self._parent._size()


class _Shuffle(Dataset):
    def __init__(self, parent: Dataset, buffer_size: Any):
        super().__init__(parent, parent.get_col_names())
        self._buffer = _int_arg("shuffle", "buffer_size", buffer_size, 2,
                                "at least the dataset size shuffles it whole")

    def _rows(self, epoch: int) -> Iterator[Row]:
        rng, buf = self._rng(epoch), []
        for r in self._parent._rows(epoch):
            if len(buf) < self._buffer:
                buf.append(r)
                continue
            j = int(rng.integers(len(buf)))
            yield buf[j]
            buf[j] = r
        while buf:
            j = int(rng.integers(len(buf)))
            buf[j], buf[-1] = buf[-1], buf[j]
            yield buf.pop()

    def _size(self) -> int | None:
        return self._parent._size()


class _Repeat(Dataset):
    def __init__(self, parent: Dataset, count: Any):
        super().__init__(parent, parent.get_col_names())
        self._times = None if count is None or count == -1 else _int_arg("repeat", "count", count, 1,
                                                                         "or None / -1 for endless")

    def _rows(self, epoch: int) -> Iterator[Row]:
        times = self._times
        for k in (itertools.count() if times is None else range(times)):
            yield from self._parent._rows(k if times is None else epoch * times + k)

    def _size(self) -> int | None:
        n = self._parent._size()
        return None if n is None or self._times is None else n * self._times
