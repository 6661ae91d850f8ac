"""Partial results reduce-scattered where they are read split (issue 40: redistributions at least as good as
MindSpore's).

A ``dot_general`` whose contracting dims are split computes a partial sum on each device. XLA's partitioner
all-reduces it where it is made (``2 S (k-1)/k`` bytes per device), and a reader that wants it split further over
those same axes then slices it: a row-parallel MatMul read split by rows (Megatron's sequence parallelism), a
MatMul with an ``out_strategy`` that splits its result over its reduced axes (MindSpore runs that as a
ReduceScatter). The reduce-scatter alone moves half those bytes. Given the searched strategies,
:func:`scattered_reductions` finds each such op: a dot (or a primitive object whose body is one dot) that is not
part of a sum of partial sums (those are reduced once, ``fused_sums``), whose result every reader reads in one
layout that is its result layout with some of the partial axes appended to its dims' stacks. The executor computes
it per device and reduce-scatters it into that layout (``mshard._src.runtime.partial_sums.materialize``); the plan
prices it so (``searchers.cost.scattered_reduction_cost``) and its readers read it as they want it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mshard._src.jaxpr.op_graph import TraceResult
from mshard._src.planning.fused_sums import sum_roles
from searchers.cost import CostParams, scatter_saving
from searchers.graph import TensorLayout, operand_layout


@dataclass(frozen=True)
class Scattered:
    """One op's partial result reduce-scattered: the equation that computes it (its emitter key), the layout it is
    left in (mesh-axis indices), and the out mark of a primitive object traced as one op, which holds it there."""

    key: tuple
    target: TensorLayout
    mark: object | None = None


def mark_scatter(trace: TraceResult) -> None:
    """Set ``Op.scatter`` on every op the executor can reduce-scatter (a dot, or a primitive object whose body is one
    dot read by its out mark, that is not part of a sum of partial sums), so the searchers price it so where its
    one reader's layout allows (``searchers.cost.scatter_saving``)."""
    roots = _sum_roots(trace)
    for te in trace.eqns:
        found = _dot_of(te)
        if found is not None and id(found[0]) not in roots:
            trace.graph.ops[te.op].scatter = True


def scattered_reductions(trace: TraceResult, strategies, params: CostParams) -> dict[int, Scattered]:
    """Op id -> :class:`Scattered`, for every ``scatter`` op (:func:`mark_scatter`) whose readers all read its
    result in one layout and whose partial result moves fewer bytes reduce-scattered
    (``searchers.cost.scatter_saving``): into that layout where it is the op's own with some partial axes appended
    (nothing left to move), or into the op's own with the partial axes the readers split on appended, then changed
    to theirs (a MatMul's rows over d2, reduced over (d0, d1) and read as rows over (d0, d1, d2): a reduce-scatter
    to rows (d2, d0, d1) and a permute)."""
    graph = trace.graph
    readers: dict[int, list] = defaultdict(list)
    for _, consumer, tid, i in graph.edges():
        readers[tid].append((graph.ops[consumer], i))
    ends = set(graph.outputs)
    out: dict[int, Scattered] = {}
    for te in trace.eqns:
        op = graph.ops[te.op]
        if not op.scatter or len(op.outputs) != 1 or op.outputs[0] in ends or not readers[op.outputs[0]]:
            continue
        s = strategies[op.id]
        wants = {operand_layout(c, strategies[c.id], i) for c, i in readers[op.outputs[0]]}
        if len(wants) != 1:
            continue
        found = scatter_saving(op, s, next(iter(wants)), graph, params)
        if found is not None:
            dot, mark = _dot_of(te)
            out[op.id] = Scattered((tuple(id(e) for e in te.path), id(dot)), found[0], mark)
    return out


def _dot_of(te):
    """(the dot_general equation, the out mark holding its result or None) of a traced op that is one dot, or a
    primitive object traced as one op whose body is one dot read by its one out mark; else None."""
    if not te.group:
        return (te.eqn, None) if te.eqn.primitive.name == "dot_general" else None
    dots = [e for e in te.group if e.primitive.name == "dot_general"]
    outs = [e for e in te.group if e.primitive.name == "mshard_mark" and e.params.get("role") == "out"]
    if len(dots) != 1 or len(outs) != 1 or outs[0].invars[0] is not dots[0].outvars[0]:
        return None
    return dots[0], outs[0]


def _sum_roots(trace: TraceResult) -> set[int]:
    """ids of the equations the emitter computes as parts of a sum of partial sums (``fused_sums.sum_roles``)."""
    return {k for _, roles in sum_roles(trace).values() for k, role in roles.items() if role == "root"}
