"""semi_auto's default for the ops a user did not annotate: compute in the layout the operands arrive in.

Not a search: one pass in program order. Each op that is not fixed takes, loop dim by loop dim, the axes its
operands already carry (the most split operand first, then the larger), never an axis twice, never a dim the op
cannot split or a split its size does not allow. Nothing new is split: an op whose operands are whole stays
whole, so a data-parallel batch flows on as data parallel and a model-parallel split the user asked for flows
on as itself (what XLA's own propagation does for a program with the same constraints, and what MindSpore's
data-parallel default gives for ops downstream of the batch). A parameter nobody fixed is stored as its first
fixed consumer computes with it (MindSpore's parameter slicing), else whole. A ``follow_operand`` op (a
training step's write-back) takes its operand's layout, an ``operand_ties`` op (a marked operand read again as a
residual) the layout its op computed that operand in.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> g = Graph(DeviceMesh((2, 4)))
>>> x = g.source("x", (8, 16), fixed=((0,), ()))
>>> w = g.source("w", (16, 32), kind="param")
>>> (y,) = g.add_op("mm", "dot_general", {"m": 8, "k": 16, "n": 32}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
>>> (z,) = g.add_op("relu", "max", {"i": 8, "j": 32}, [y], [("i", "j")], [("i", "j")])
>>> r = follow_operands(g, CostParams())
>>> r.strategies[2], r.strategies[3], r.strategies[1]
(((0,), (), ()), ((0,), ()), ((), ()))
"""

from __future__ import annotations

import math
import time

from .cost import CostParams, graph_cost
from .graph import Graph, Op, Strategy, operand_layout, operand_tied_strategy, replicated, result_layout, tied_strategy
from .result import SearchResult


def follow_operands(graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
                    first_operand_first: bool = False) -> SearchResult:
    """semi_auto's default (module doc); ``fully_use_devices`` is accepted for the searcher signature and ignored:
    semi_auto splits only what the user asked for. ``first_operand_first`` takes the operands' axes in operand
    order instead (MindSpore's data parallel: an op follows the batch split of its first operand)."""
    t0 = time.perf_counter()
    mesh = graph.mesh
    st: list[Strategy | None] = [None] * len(graph.ops)
    for op in graph.ops:
        if op.fixed is not None:
            st[op.id] = op.fixed
        elif op.is_source:
            st[op.id] = replicated(op)
        elif op.follow_operand is not None:
            st[op.id] = tied_strategy(graph, op, st) or replicated(op)
        elif op.id in graph.operand_ties:
            st[op.id] = operand_tied_strategy(graph, op, st) or replicated(op)
        else:
            st[op.id] = _follow(graph, op, st, mesh.shape, first_operand_first)
    for op in graph.ops:                      # an unfixed parameter: stored as its first fixed consumer computes
        if op.is_source and op.fixed is None and op.kind == "param":
            tid = op.outputs[0]
            users = [c for c in graph.tensors[tid].consumers if graph.ops[c].fixed is not None]
            cs = st[graph.ops[users[0]].id] if users else None
            if cs is not None:
                cons = graph.ops[users[0]]
                lay = operand_layout(cons, cs, cons.inputs.index(tid))
                where = dict(zip(op.out_dims[0], lay))
                st[op.id] = tuple(tuple(where.get(d, ())) for d in op.dims)
    strategies: dict[int, Strategy] = {op.id: s for op, s in zip(graph.ops, st) if s is not None}
    return SearchResult(strategies, graph_cost(graph, strategies, params), "semi_auto", time.perf_counter() - t0,
                        ["semi_auto: ops without a user strategy compute in the layout their operands arrive in "
                         "(nothing new is split; the batch stays data parallel)"])


def _follow(graph: Graph, op: Op, st: list[Strategy | None], shape: tuple[int, ...],
            first_operand_first: bool = False) -> Strategy:
    sizes = dict(zip(op.dims, op.split_sizes()))
    arriving: list[tuple[int, int, int, tuple[tuple[int, ...], ...]]] = []
    for i, tid in enumerate(op.inputs):
        prod = graph.producer(tid)
        s = st[prod.id]
        lay = result_layout(prod, s if s is not None else replicated(prod), prod.outputs.index(tid))
        n = math.prod(shape[a] for axes in lay for a in axes)
        arriving.append((i, 0, i, lay) if first_operand_first else (-n, -graph.tensors[tid].nbytes, i, lay))
    where: dict[str, tuple[int, ...]] = {}
    used: set[int] = set()
    for _, _, i, lay in sorted(arriving):
        for d, axes in zip(op.in_dims[i], lay):
            if d is None or not axes or d in where or d in op.unsplittable or set(axes) & used:
                continue
            if sizes[d] % math.prod(shape[a] for a in axes):
                continue
            where[d] = tuple(axes)
            used.update(axes)
    return tuple(where.get(d, ()) for d in op.dims)
