"""Multi-process agreement on what each process feeds: one small all-gather that every process answers, and an
error raised on every process where they differ (a rank that went on alone would hang or train on garbage).

Used by ``ms.dataset.shard_batch`` (each process's local batch: shapes and dtypes) and by a region called with
host values (every process must hold the same whole value: shapes, dtypes and contents).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from jax.experimental import multihost_utils

from mshard._src.values.errors import DatasetStrategyError

_SLOTS = 64


def _encode(shapes: list[tuple[int, ...]], dtypes: list) -> np.ndarray:
    """A fixed-size description of a process's local batch (every process must send the same size)."""
    words = [len(shapes)]
    for s, d in zip(shapes, dtypes):
        words += [len(s), *s, int(np.dtype(d).num)]
    head = words[:_SLOTS - 1] + [0] * max(0, _SLOTS - 1 - len(words))
    return np.asarray([*head, hash(tuple(words)) % (2**31)], np.int64)


def _decode(row: np.ndarray) -> str:
    n, i, out = int(row[0]), 1, []
    for _ in range(n):
        if i >= _SLOTS - 1:
            out.append("...")
            break
        r = int(row[i])
        out.append(tuple(int(v) for v in row[i + 1:i + 1 + r]))
        i += r + 2
    return ", ".join(map(str, out))


def agree(shapes: list[tuple[int, ...]], dtypes: list) -> None:
    """Multi-process: every process's local batch has the same shapes and dtypes, or every process raises.
    (Ranks that feed different local shapes would compile different programs whose collectives can still line
    up, and train on a silently wrong loss.) One small all-gather per batch."""
    rows = np.asarray(multihost_utils.process_allgather(_encode(shapes, dtypes)))
    if all(np.array_equal(r, rows[0]) for r in rows):
        return
    desc = "; ".join(f"rank {k}: {_decode(r)}" for k, r in enumerate(rows))
    raise DatasetStrategyError(f"the processes' local batches disagree ({desc}); every process must feed a local "
                               f"batch of the same shapes and dtypes (through ms.dataset.shard_batch the global "
                               f"batch is their concatenation; passed to a step or region directly, every process "
                               f"holds the whole batch). Drop or pad the last, smaller batch on every rank.")


def _digest(x: Any) -> int:
    """A 63-bit digest of a host value's bytes (blake2b over the contiguous buffer)."""
    a = np.ascontiguousarray(np.asarray(x))
    return int.from_bytes(hashlib.blake2b(memoryview(a).cast("B"), digest_size=8).digest(), "little") >> 1


def agree_on_values(values: list) -> None:
    """Multi-process: host values passed straight to a step or region are the global batch, so every process must
    hold the same whole value; a process that passes its own rows instead would have the devices of each process
    read their slices from different arrays, a batch made of every rank's rows. Checked with one small all-gather
    of a digest per value (after :func:`agree` checked the shapes); a difference raises on every process."""
    rows = np.asarray(multihost_utils.process_allgather(np.asarray([_digest(v) for v in values], np.int64)))
    bad = [i for i in range(rows.shape[1]) if not (rows[:, i] == rows[0, i]).all()]
    if bad:
        raise DatasetStrategyError(
            f"host input {bad[0]} (shape {tuple(np.shape(values[bad[0]]))}) differs between the processes: passed "
            f"straight to a step or region, a host value is the whole global batch, which every process must hold "
            f"alike. For each process's own rows (MindSpore's per-rank dataset), pass ms.dataset.shard_batch(batch): "
            f"the global batch is then the processes' batches laid out by dataset_strategy.")


