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
from mshard._src.jaxpr.sum_pairs import partial_sum_pairs
from mshard._src.jaxpr.walk import call_jaxpr
from mshard._src.planning.fused_sums import unpriced_reduction
from searchers.cost import CostParams, op_cost, redistribution_cost, scattered_reduction_cost
from searchers.graph import TensorLayout, operand_layout, partial_axes, result_layout


@dataclass(frozen=True)
class Scattered:
    """One op's partial result reduce-scattered: the equation that computes it (its emitter key), the layout it is
    left in (mesh-axis indices), and the out mark of a primitive object traced as one op, which holds it there."""

    key: tuple
    target: TensorLayout
    mark: object | None = None


def scattered_reductions(trace: TraceResult, strategies, params: CostParams) -> dict[int, Scattered]:
    """Op id -> :class:`Scattered`, for every op whose partial result the executor reduce-scatters: into the layout
    its readers want where that layout is its own with some partial axes appended (nothing left to move), or into
    its own layout with the partial axes the readers split on appended, then changed to theirs, where that moves
    fewer bytes than the all-reduce and the change from its own layout (a MatMul's rows over d2, reduced over
    (d0, d1) and read as rows over (d0, d1, d2): a reduce-scatter to rows (d2, d0, d1) and a permute)."""
    graph = trace.graph
    readers: dict[int, list] = defaultdict(list)
    for _, consumer, tid, i in graph.edges():
        readers[tid].append((graph.ops[consumer], i))
    roots = _sum_roots(trace)
    ends = set(graph.outputs)
    out: dict[int, Scattered] = {}
    for te in trace.eqns:
        found = _dot_of(te)
        if found is None or id(found[0]) in roots:
            continue
        dot, mark = found
        op = graph.ops[te.op]
        s = strategies[op.id]
        axes = partial_axes(op, s)
        if len(op.outputs) != 1 or not axes or op.outputs[0] in ends or not readers[op.outputs[0]]:
            continue
        wants = {operand_layout(c, strategies[c.id], i) for c, i in readers[op.outputs[0]]}
        if len(wants) != 1:
            continue
        (want,) = wants
        t = graph.tensors[op.outputs[0]]
        have = result_layout(op, s, 0)
        target = _scattered_layout(have, want, axes, t.shape, graph.mesh)
        if target is None:
            continue
        # both less the all-reduce the op's cost holds: the change alone against the reduce-scatter and its change
        before = redistribution_cost(have, want, t.shape, t.itemsize, graph.mesh, params)
        after = (unpriced_reduction(op_cost(op, s, graph, params), params)
                 + scattered_reduction_cost(op, s, target, graph, params)
                 + redistribution_cost(target, want, t.shape, t.itemsize, graph.mesh, params))
        if (after.communication, after.total) < (before.communication, before.total):
            out[op.id] = Scattered((tuple(id(e) for e in te.path), id(dot)), target, mark)
    return out


def _scattered_layout(have: TensorLayout, want: TensorLayout, axes, shape, mesh) -> TensorLayout | None:
    """``have`` with, on each dim, the partial ``axes`` that ``want`` splits that dim on appended (in ``want``'s
    order); None where ``want`` splits no dim on them or a dim would not divide."""
    out, added = [], False
    for h, w, n in zip(have, want, shape, strict=True):
        extra = tuple(a for a in w if a in axes and a not in h)
        added = added or bool(extra)
        out.append(tuple(h) + extra)
        if n % mesh.count(out[-1]):
            return None
    return tuple(out) if added else None


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
    """ids of the equations the emitter computes as parts of a sum of partial sums (``jaxpr.sum_pairs``)."""
    roots: set[int] = set()
    seen: set[tuple] = set()
    for te in trace.eqns:
        key = tuple(map(id, te.path))
        if key in seen:
            continue
        seen.add(key)
        jaxpr = call_jaxpr(te.path[-1]) if te.path else trace.closed_jaxpr.jaxpr
        if jaxpr is not None:
            roots |= {k for k, role in partial_sum_pairs(jaxpr).items() if role == "root"}
    return roots
