"""``ms.dataset.shard_batch``: host batches -> global ``jax.Array`` laid out by ``dataset_strategy``.

MindSpore's dataset slicing (``set_auto_parallel_context(dataset_strategy=...)``):

* ``"data_parallel"`` (default): dim 0 of every input is split over all ``device_num`` devices;
* ``"full_batch"``: every device holds the whole batch;
* a tuple with one split tuple per input, e.g. ``((1, 1, 2, 4), (8,))``: dim i of input k is cut
  into ``strategy[k][i]`` slices — the remote-sensing case splits an image's H and W when there are
  fewer samples than devices.

The arrays are built shard by shard with :func:`jax.make_array_from_callback` (one process: each
device receives only its slice of the host batch, the full batch is never put on one device) or
:func:`jax.make_array_from_process_local_data` (several processes: each process passes its own
part of the batch, as MindSpore's per-rank dataset does). The layouts are exactly those an
``ms.jit`` region or ``TrainOneStepCell`` plans for its data arguments (same mesh, same axes), so
the step moves nothing.

>>> import numpy as np, mshard as ms
>>> ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
>>> x = ms.dataset.shard_batch(np.zeros((16, 3), np.float32))
>>> x.sharding.shard_shape(x.shape)
(2, 3)
>>> ms.reset_auto_parallel_context()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from mshard._src.planning.axis_assignment import Assigner, InputInfo, data_layout
from mshard._src.values import context as ctxmod
from mshard._src.values.agreement import agree as _agree
from mshard._src.values.errors import DatasetStrategyError
from mshard._src.values.layout import DimAxes, TensorStrategy, jax_mesh, prime_mesh, spec_of
from searchers import DeviceMesh

__all__ = ["batch_shardings", "shard_batch"]


def _is_leaf_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array, np.generic)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__array__"))


def _flatten(batch: Any) -> tuple[list[Any], Any]:
    if isinstance(batch, dict):
        keys = list(batch)
        return [batch[k] for k in keys], ("dict", keys)
    if isinstance(batch, (tuple, list)):
        return list(batch), (type(batch), None)
    return [batch], ("one", None)


def _unflatten(arrays: list, how) -> Any:
    kind, keys = how
    if kind == "dict":
        return dict(zip(keys, arrays))
    if kind == "one":
        return arrays[0]
    return kind(arrays)


def _layouts(shapes: list[tuple[int, ...]], ctx) -> tuple[DeviceMesh, list[DimAxes]]:
    """The data layouts a region plans for inputs of these shapes (docs/design.md §2; axis_assignment.data_layout)."""
    if ctx.parallel_mode == "stand_alone":
        return prime_mesh(1), [((),) * len(s) for s in shapes]
    n = ctx.devices
    mesh = prime_mesh(n)
    ds = ctx.dataset_strategy
    assigner = Assigner(mesh)
    taken: set[str] = set()
    out = []
    for i, shape in enumerate(shapes):
        name = f"input {i} (shape {shape})"
        st = None
        if isinstance(ds, tuple):
            if i >= len(ds):
                raise DatasetStrategyError(f"shard_batch: the batch has {len(shapes)} inputs but dataset_strategy "
                                           f"{ds} gives {len(ds)} split tuples; give one split tuple per input.")
            counts = ds[i]
            if len(counts) != len(shape):
                raise DatasetStrategyError(f"shard_batch: {name}: dataset_strategy entry {counts} has {len(counts)} "
                                           f"splits but the input has rank {len(shape)}; give one split per dim.")
            for d, (c, size) in enumerate(zip(counts, shape)):
                if size % c:
                    raise DatasetStrategyError(f"shard_batch: {name}: dataset_strategy entry {counts} cuts dim {d} "
                                               f"into {c} slices but its size {size} is not divisible by {c}; use a "
                                               f"batch whose dim {d} is a multiple of {c}, or another split.")
            st = TensorStrategy(tuple(counts))
        elif ds == "data_parallel" and shape and shape[0] % n:
            raise DatasetStrategyError(f"shard_batch: {name}: dataset_strategy 'data_parallel' splits dim 0 over "
                                       f"{n} devices but its size is {shape[0]}; use a batch size divisible by {n}, "
                                       f"or dataset_strategy='full_batch'.")
        info = InputInfo("data", tuple(shape), f"arg{i}", st)
        lay = data_layout(info, ds, i, mesh, assigner, taken)
        taken.update(a for dim in lay for a in dim)
        out.append(lay)
    return mesh, out


def batch_shardings(shapes: Iterable[tuple[int, ...]]) -> list[NamedSharding]:
    """The ``NamedSharding`` of each input of these shapes under the current ``dataset_strategy``.

    These are the layouts :func:`shard_batch` builds and an ``ms.jit`` region or ``TrainOneStepCell`` plans for its
    data arguments: use them to lay out data yourself (e.g. ``jax.make_array_from_callback``).

    Args:
        shapes: the global shape of each input of a batch, in order.

    Returns:
        One ``NamedSharding`` per shape, on the region mesh (one axis per prime factor of ``device_num``).

    >>> import mshard as ms
    >>> with ms.parallel_context(parallel_mode="data_parallel", device_num=8):
    ...     x, y = batch_shardings([(16, 3), (16,)])
    >>> x.spec, x.shard_shape((16, 3)), y.shard_shape((16,))
    (P(('d0', 'd1', 'd2'), None), (2, 3), (2,))
    """
    mesh, lays = _layouts([tuple(s) for s in shapes], ctxmod.current())
    jm = jax_mesh(mesh)
    return [NamedSharding(jm, spec_of(lay)) for lay in lays]


def _one(x: Any, sharding: NamedSharding) -> jax.Array:
    if isinstance(x, jax.Array) and not isinstance(x, np.ndarray):
        if x.sharding == sharding:
            return x
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    if jax.process_count() == 1:
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    return jax.make_array_from_process_local_data(sharding, host)


def _shard_one_batch(batch: Any) -> Any:
    arrays, how = _flatten(batch)
    for i, a in enumerate(arrays):
        if not _is_leaf_array(a):
            raise DatasetStrategyError(f"shard_batch: input {i} is a {type(a).__name__}, not an array; a batch is "
                                       f"an array, or a tuple/list/dict of arrays.")
    shapes = [tuple(np.shape(a)) for a in arrays]
    if jax.process_count() > 1:
        _agree(shapes, [np.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype for a in arrays])
        # each process passes its own rows: the global batch is process_count times larger along split dims
        shardings = batch_shardings(_global_shapes(shapes))
    else:
        shardings = batch_shardings(shapes)
    return _unflatten([_one(a, sh) for a, sh in zip(arrays, shardings)], how)


def _global_shapes(local: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Multi-process: the global shape of process-local data (split dims scale with the process count)."""
    ctx = ctxmod.current()
    p = jax.process_count()
    out = []
    for i, s in enumerate(local):
        if not s or ctx.dataset_strategy == "full_batch":
            out.append(s)
        elif isinstance(ctx.dataset_strategy, tuple):
            counts = ctx.dataset_strategy[i] if i < len(ctx.dataset_strategy) else (1,) * len(s)
            d = next((k for k, c in enumerate(counts) if c > 1), None)
            out.append(s if d is None else s[:d] + (s[d] * p,) + s[d + 1:])
        else:
            out.append((s[0] * p,) + s[1:])
    return out


def shard_batch(batch: Any) -> Any:
    """Lay a host batch out as global ``jax.Array``s by ``dataset_strategy`` (MindSpore's dataset slicing).

    Each device receives only its slice (:func:`batch_shardings`, filled by ``jax.make_array_from_callback``); a
    jax.Array already laid out as planned is returned as is (otherwise it is resharded). Multi-process: each
    process passes its own part (split along the first split dim of each input), as MindSpore's per-rank datasets
    do. Raises :class:`~mshard.errors.DatasetStrategyError` when the strategy cannot split the batch (a dim not
    divisible by its split, a split tuple of the wrong rank, a missing split tuple).

    Args:
        batch: a numpy array or ``jax.Array``, a tuple/list/dict of them, or an iterator of such batches.

    Returns:
        The batch in the same structure with global ``jax.Array``s; for an iterator, an iterator of sharded
        batches (each built when it is reached).

    >>> import numpy as np, mshard as ms
    >>> with ms.parallel_context(parallel_mode="data_parallel", device_num=8):
    ...     b = shard_batch({"x": np.zeros((16, 3), np.float32), "y": np.zeros(16, np.int32)})
    >>> {k: v.sharding.shard_shape(v.shape) for k, v in b.items()}
    {'x': (2, 3), 'y': (2,)}
    """
    if _is_leaf_array(batch) or isinstance(batch, (tuple, list, dict)):
        return _shard_one_batch(batch)
    if isinstance(batch, Iterator) or hasattr(batch, "__iter__"):
        return (_shard_one_batch(b) for b in batch)
    raise DatasetStrategyError(f"shard_batch: expected an array, a tuple/list/dict of arrays or an iterator of "
                               f"them, got {type(batch).__name__}.")
