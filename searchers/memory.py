"""Per-device memory over program order: live ranges, the peak of a plan, bounds per step.

The model (Alpa's): at step ``t`` (the ``t``-th op in program order) every tensor whose
producer is at or before ``t`` and whose last consumer is at or after ``t`` is live (a graph
output stays live to the end), and takes its global bytes divided by the split count of the
layout its producer gives it. Redistributed copies and temporaries are not counted.

>>> from searchers.graph import DeviceMesh, Graph
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4, 4))                                       # 64 B
>>> (y,) = g.add_op("exp", "exp", {"i": 4, "j": 4}, [x], [("i", "j")], [("i", "j")])
>>> g.outputs.append(y)
>>> peak_memory(g, {0: ((0,), ()), 1: ((), ())})                   # step 1: x (32 B) + y (64 B)
(96.0, 1)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .graph import Graph, Strategy, parts, result_layout, split_count


def live_ranges(graph: Graph) -> tuple[np.ndarray, np.ndarray]:
    """``(first, last)`` step of every tensor (indexed by tensor id)."""
    n = len(graph.ops)
    first = np.array([t.producer for t in graph.tensors], dtype=np.int64)
    last = first.copy()
    for t in graph.tensors:
        if t.consumers:
            last[t.id] = max(t.consumers)
    for tid in graph.outputs:
        last[tid] = n - 1
    return first, last


def local_bytes(graph: Graph, op_id: int, strategy: Strategy) -> list[float]:
    """Local bytes of each result of op ``op_id`` under ``strategy``."""
    op, shape = graph.ops[op_id], graph.mesh.shape
    return [graph.tensors[tid].nbytes / split_count(result_layout(op, strategy, j), shape)
            for j, tid in enumerate(op.outputs)]


def fusible(graph: Graph, op_id: int) -> bool:
    """Whether an op is one XLA fuses into its readers (an elementwise op or a broadcast): one result, every loop
    dim a result dim (nothing reduced or contracted), every operand over a subset of them."""
    op = graph.ops[op_id]
    if op.is_source or len(op.outputs) != 1:
        return False
    out = {d for lab in op.out_dims[0] for d in parts(lab)}
    return set(op.dims) <= out and all({d for lab in dims for d in parts(lab)} <= out for dims in op.in_dims)


def fused_live_ranges(graph: Graph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(first, last, materialized)``: a tensor a fusible op computes for fusible readers only is not
    materialized (XLA computes it inside its readers' fusions); those readers read the fusible op's operands
    instead, so each operand lives to the last of them."""
    first, last = live_ranges(graph)
    outputs = set(graph.outputs)
    mat = np.ones(len(graph.tensors), dtype=bool)
    for op in reversed(graph.ops):
        if not fusible(graph, op.id):
            continue
        (o,) = op.outputs
        readers = graph.tensors[o].consumers
        if o in outputs or not readers or not all(fusible(graph, c) for c in readers):
            continue
        mat[o] = False
        for t in op.inputs:
            last[t] = max(last[t], last[o])
    return first, last, mat


def memory_profile(graph: Graph, strategies: Mapping[int, Strategy], fused: bool = False) -> np.ndarray:
    """Bytes per device live at every step under ``strategies``. ``fused``: values XLA computes inside their
    readers' fusions are not counted (:func:`fused_live_ranges`)."""
    if fused:
        first, last, mat = fused_live_ranges(graph)
    else:
        (first, last), mat = live_ranges(graph), None
    diff = np.zeros(len(graph.ops) + 1)
    for op in graph.ops:
        for tid, b in zip(op.outputs, local_bytes(graph, op.id, strategies[op.id])):
            if mat is not None and not mat[tid]:
                continue
            diff[first[tid]] += b
            diff[last[tid] + 1] -= b
    return np.cumsum(diff[:-1])


def peak_memory(graph: Graph, strategies: Mapping[int, Strategy], fused: bool = False) -> tuple[float, int]:
    """``(peak bytes per device, step of the peak)``; ``(0.0, -1)`` for an empty graph. ``fused``: as
    :func:`memory_profile`."""
    if not graph.ops:
        return 0.0, -1
    prof = memory_profile(graph, strategies, fused)
    t = int(np.argmax(prof))
    return float(prof[t]), t


def death_steps(graph: Graph) -> np.ndarray:
    """Steps after which some tensor dies (and the last step): the only steps whose live set is
    not contained in the next step's, so the only memory constraints that are not implied."""
    _first, last = live_ranges(graph)
    steps = set(last.tolist())
    if graph.ops:
        steps.add(len(graph.ops) - 1)
    return np.array(sorted(steps), dtype=np.int64)
