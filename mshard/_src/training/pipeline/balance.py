"""Assign contiguous cells to pipeline stages so the most expensive stage is as cheap as it can be.

Pure Python (no JAX): :func:`balance` is the classic linear partition (dynamic programming over prefix sums,
exact). :mod:`mshard._src.training.pipeline.stages` prices the cells (the forward FLOPs of each cell's ops, the embedding and
the head counted like any other cell) and applies the answer when ``pipeline_stages > 1`` and no cell has a
``pipeline_stage``.

>>> balance([1, 4, 4, 4, 4, 2], 2)
[0, 0, 0, 1, 1, 1]
>>> balance([2, 2, 2, 2, 2, 2], 3)
[0, 0, 1, 1, 2, 2]
"""

from __future__ import annotations

from collections.abc import Sequence


def balance(costs: Sequence[float], stages: int) -> list[int]:
    """Stage of each item, items in order and stages contiguous, every stage non-empty, minimising the largest
    stage sum (ties: the earliest cut points)."""
    n = len(costs)
    if stages < 1 or n < stages:
        raise ValueError(f"balance: {n} cells cannot fill {stages} stages")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest max over the first i items in k stages; cut[k][i]: where stage k starts
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], pre[i] - pre[j])
                if v < best[k][i] - 1e-12 * max(1.0, abs(v)):
                    best[k][i], cut[k][i] = v, j
    out = [0] * n
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        for t in range(j, i):
            out[t] = k - 1
        i = j
    return out
