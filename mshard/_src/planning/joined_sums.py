"""Partial sums joined by a concatenate and reduce-scattered once (issue 40: MindSpore's ``interleaved_parallel``).

A MatMul computed in ``interleaved_parallel`` copies (:mod:`mshard._src.frontend.interleave`) runs one dot per copy,
each over the rows of its copy in every device's block, and puts the results back by a reshape, a concatenate and a
reshape. Where the dots split their contraction, each copy's result is a partial sum; XLA's partitioner all-reduces
each where it is made. Where the put-back result is read split further over those same axes (MindSpore's
``out_strategy`` ``("dp", "interleaved_parallel", "mp")`` after a contraction over ``"mp"``), device ``(d, m)``
reads copy ``m`` of its row block whole: each copy's sum goes to one device of the group, which no layout of the
copy says. The put-back of the partial sums, reduce-scattered over the group, is exactly that: one reduce-scatter
of the whole result moves what the MatMul computed whole would move, half the copies' all-reduces.

:func:`joined_sums` finds, given the searched strategies, each concatenate whose operands are each such a dot's
result passed on unmoved (through its out mark and reshapes), all partial over the same mesh axes, whose result
passes unmoved through reshapes and marks to readers that read it in one layout: the held layout with some of those
axes appended. The executor computes the dots per device, applies the put-back to the parts, and reduce-scatters
the joined parts where they are read (``mshard._src.runtime.partial_sums``); the plan prices that
(:func:`searchers.cost.reduction_cost`) in place of the dots' all-reduces.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mshard._src.jaxpr.op_graph import TraceResult
from mshard._src.planning.scattered_sums import dot_of
from searchers.cost import Cost, CostParams, reduction_cost
from searchers.graph import Graph, TensorLayout, operand_layout, partial_axes, result_layout

# the ops that pass a partial sum on to or from the concatenate, applied to each device's part
_PASS = frozenset({"reshape", "mshard_mark"})


@dataclass(frozen=True)
class Joined:
    """One concatenate of partial sums reduce-scattered once: the emitter's role of each equation (by its key:
    ``"root"``, ``"chain"``, ``"concat"``), the layout the sum is scattered into (mesh-axis indices), the op whose
    result is left there (the last that passes it on), the dots' op ids, the concatenate's op id and the price of
    the reduce-scatter."""

    roles: dict
    target: TensorLayout
    last: int
    roots: tuple[int, ...]
    concat: int
    cost: Cost


def joined_sums(trace: TraceResult, strategies, params: CostParams) -> list[Joined]:
    """The concatenates of partial sums the executor reduce-scatters once (see the module docstring)."""
    graph = trace.graph
    readers: dict[int, list] = defaultdict(list)
    for _, consumer, tid, i in graph.edges():
        readers[tid].append((graph.ops[consumer], i))
    ends = set(graph.outputs)
    tes = {te.op: te for te in trace.eqns}
    out = []
    for te in trace.eqns:
        op = graph.ops[te.op]
        if te.group or op.kind != "concatenate" or len(op.outputs) != 1:
            continue
        found = _joined(graph, op, tes, strategies, readers, ends, params)
        if found is not None:
            out.append(found)
    return out


def _key(te, eqn) -> tuple:
    return (tuple(id(e) for e in te.path), id(eqn))


def _passes(op, te) -> bool:
    return not te.group and op.kind in _PASS and len(op.inputs) == 1 and len(op.outputs) == 1


def _joined(graph: Graph, concat, tes, strategies, readers, ends, params: CostParams) -> Joined | None:
    roles: dict = {_key(tes[concat.id], tes[concat.id].eqn): "concat"}
    roots, axes = [], None
    held = result_layout(concat, strategies[concat.id])
    for i, tid in enumerate(concat.inputs):
        want = operand_layout(concat, strategies[concat.id], i)
        while True:                      # back from the concatenate to the dot, nothing moved on the way
            prod = graph.producer(tid)
            te = tes.get(prod.id)
            if te is None or len(readers[tid]) != 1 or tid in ends:
                return None
            if result_layout(prod, strategies[prod.id], prod.outputs.index(tid)) != want:
                return None
            dot = dot_of(te)
            if dot is not None:
                part = partial_axes(prod, strategies[prod.id])
                if not part or axes not in (None, part):
                    return None
                axes = part
                roots.append(prod.id)
                roles[_key(te, dot[0])] = "root"
                if dot[1] is not None:
                    roles[_key(te, dot[1])] = "chain"
                break
            if not _passes(prod, te):
                return None
            roles[_key(te, te.eqn)] = "chain"
            tid, want = prod.inputs[0], operand_layout(prod, strategies[prod.id], 0)
    last, tid = concat, concat.outputs[0]
    while len(readers[tid]) == 1 and tid not in ends:    # on from it to the readers, nothing moved on the way
        c, i = readers[tid][0]
        te = tes.get(c.id)
        if te is None or not _passes(c, te) or operand_layout(c, strategies[c.id], i) != held:
            break
        roles[_key(te, te.eqn)] = "chain"
        last, tid, held = c, c.outputs[0], result_layout(c, strategies[c.id])
    if tid in ends or not readers[tid]:
        return None
    wants = {operand_layout(c, strategies[c.id], i) for c, i in readers[tid]}
    if len(wants) != 1:
        return None
    target = next(iter(wants))
    if len(target) != len(held) or any(tuple(t)[:len(h)] != tuple(h) for h, t in zip(held, target)):
        return None
    extra = [a for h, t in zip(held, target) for a in tuple(t)[len(h):]]
    if not extra or not set(extra) <= set(axes) or len(set(extra)) != len(extra):
        return None
    t = graph.tensors[tid]
    cost = reduction_cost(held, target, set(axes), t.nbytes, graph.mesh, params)
    return Joined(roles, target, last.id, tuple(roots), concat.id, cost)
