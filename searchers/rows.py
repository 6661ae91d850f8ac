"""Grouping equal rows of an integer matrix fast: the dedupe behind the numpy paths of the searchers."""

from __future__ import annotations

import numpy as np

_MIX = np.random.default_rng(0).integers(1, 1 << 62, size=64, dtype=np.int64) | 1   # row hash multipliers


def distinct_rows(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first row of each group of equal rows of ``key`` and each row's group: an exact
    ``np.unique(key, axis=0)``, by a hash of each row checked against the rows (it falls back
    to sorting the rows on a collision).

    >>> first, inv = distinct_rows(np.array([[1, 2], [3, 4], [1, 2]]))
    >>> first[inv].tolist()
    [0, 1, 0]
    """
    first: np.ndarray | None = None
    if key.shape[1] <= len(_MIX):
        with np.errstate(over="ignore"):
            _, first, inv = np.unique(key @ _MIX[:key.shape[1]], return_index=True, return_inverse=True)
        if not (key == key[first][inv]).all():
            first = None
    if first is None:
        _, first, inv = np.unique(key, axis=0, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)
