"""Exact search by enumeration: the oracle for tests on tiny graphs.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4,), fixed=((0,),))
>>> _ = g.add_op("neg", "neg", {"i": 4}, [x], [("i",)], [("i",)])
>>> brute_force(g, CostParams())      # follow x's split: no gather, half the memory
{0: ((0,),), 1: ((0,),)}
"""

from __future__ import annotations

import math

import numpy as np

from .cost import CostParams
from .cost_vectors import edge_cost_matrix, op_cost_vector
from .errors import SearchLimitError
from .graph import Graph, Strategy, operand_layout, result_layout
from .strategies import enumerate_strategies

DEFAULT_LIMIT = 2_000_000
_CHUNK = 1 << 16


def brute_force(graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
                limit: float = DEFAULT_LIMIT) -> dict[int, Strategy]:
    """The strategies (one per op id) minimising :func:`~searchers.cost.graph_cost`'s total,
    over every combination of :func:`~searchers.strategies.enumerate_strategies` candidates that
    keeps every ``Op.follow_operand`` tie.
    Ties go to the combination that comes first (op 0's candidate order is the slowest-varying).

    Raises ``ValueError`` when the number of combinations exceeds ``limit``.
    """
    mesh = graph.mesh
    cands = [enumerate_strategies(op, mesh, fully_use_devices=fully_use_devices) for op in graph.ops]
    sizes = tuple(len(c) for c in cands)
    total = math.prod(sizes)
    if total > limit:
        raise SearchLimitError(f"brute_force: {total:.3g} combinations of strategies exceed the limit {limit:.3g}; "
                         f"use a smaller graph or mesh, or raise limit=")
    if not graph.ops:
        return {}
    vectors = [op_cost_vector(op, c, graph, params) for op, c in zip(graph.ops, cands)]
    edges = [(p, c, edge_cost_matrix(graph.ops[p], cands[p], graph.ops[c], cands[c], k, graph, params))
             for p, c, _, k in graph.edges()]
    edges += [(p, c, _tie(graph, cands, p, c)) for p, c, _, k in graph.edges() if graph.ops[c].follow_operand == k]
    best_val, best_flat = math.inf, 0
    for start in range(0, total, _CHUNK):
        flat = np.arange(start, min(total, start + _CHUNK))
        choice = np.unravel_index(flat, sizes)
        val = np.zeros(len(flat))
        for i, v in enumerate(vectors):
            val += v[choice[i]]
        for p, c, r in edges:
            val += r[choice[p], choice[c]]
        j = int(np.argmin(val))
        if val[j] < best_val:
            best_val, best_flat = float(val[j]), int(flat[j])
    pick = np.unravel_index(best_flat, sizes)
    return {op.id: cands[i][int(pick[i])] for i, op in enumerate(graph.ops)}


def _tie(graph: Graph, cands: list, p: int, c: int) -> np.ndarray:
    """``Op.follow_operand``: 0 where op ``c``'s operand has its producer ``p``'s result layout, inf elsewhere."""
    op = graph.ops[c]
    k = op.follow_operand
    assert k is not None
    j = graph.ops[p].outputs.index(op.inputs[k])
    src = [result_layout(graph.ops[p], s, j) for s in cands[p]]
    dst = [operand_layout(op, s, k) for s in cands[c]]
    return np.where(np.array([[a == b for b in dst] for a in src]), 0.0, np.inf)
