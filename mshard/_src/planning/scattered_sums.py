"""Partial results reduce-scattered where they are read split (issue 40: redistributions at least as good as
MindSpore's).

A ``dot_general`` whose contracting dims are split computes a partial sum on each device. XLA's partitioner
all-reduces it where it is made (``2 S (k-1)/k`` bytes per device), and a reader that wants it split further over
those same axes then slices it: a row-parallel MatMul read split by rows (Megatron's sequence parallelism), a
MatMul with an ``out_strategy`` that splits its result over its reduced axes (MindSpore runs that as a
ReduceScatter). The reduce-scatter alone moves half those bytes. Given the searched strategies,
:func:`scattered_reductions` finds each such op: a dot, a sum over split dims (a bias's gradient over the split
batch), or a primitive object whose body is one of them, that is not part of a sum of partial sums (those are
reduced once, ``fused_sums``), whose result every reader reads in one layout that is its result layout with some
of the partial axes appended to its dims' stacks. Ops that only pass the result on (marks, casts, transposes,
reshapes that keep every dim) are looked through and laid out as the readers after them read it. The executor
computes it per device and reduce-scatters it into that layout (``mshard._src.runtime.partial_sums.materialize``);
the plan prices it so (``searchers.cost.scattered_reduction_cost``) and its readers read it as they want it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from mshard._src.jaxpr.op_graph import TraceResult
from mshard._src.planning.fused_sums import sum_roles
from searchers.cost import CostParams, scatter_saving
from searchers.graph import Graph, Op, Strategy, TensorLayout, operand_layout, result_layout, strategy_of_layout
from searchers.strategies import is_legal


@dataclass(frozen=True)
class Scattered:
    """One op's partial result reduce-scattered: the equation that computes it (its emitter key), the layout it is
    left in (mesh-axis indices), and the out mark of a primitive object traced as one op, which holds it there."""

    key: tuple
    target: TensorLayout
    mark: object | None = None


def mark_scatter(trace: TraceResult, roles_at: dict[tuple, tuple] | None = None) -> None:
    """Set ``Op.scatter`` on every op the executor can reduce-scatter (a dot or a reduce_sum, or a primitive object
    whose body is one of them read by its out mark, that is not part of a sum of partial sums), so the searchers
    price it so where its one reader's layout allows (``searchers.cost.scatter_saving``). ``roles_at``: the trace's
    :func:`~mshard._src.planning.fused_sums.sum_roles`, where already found."""
    roots = {k for _, roles in (sum_roles(trace) if roles_at is None else roles_at).values()
             for k, role in roles.items() if role == "root"}
    for te in trace.eqns:
        found = dot_of(te)
        if found is not None and id(found[0]) not in roots:
            trace.graph.ops[te.op].scatter = True


def scattered_reductions(trace: TraceResult, strategies, params: CostParams
                         ) -> tuple[dict[int, Scattered], dict[int, Strategy]]:
    """(op id -> :class:`Scattered`, the strategies with the ops it passes through re-laid), for every ``scatter``
    op (:func:`mark_scatter`) whose readers all read its result in one layout and whose partial result moves fewer
    bytes reduce-scattered (``searchers.cost.scatter_saving``): into that layout where it is the op's own with some
    partial axes appended (nothing left to move), or into the op's own with the partial axes the readers split on
    appended, then changed to theirs (a MatMul's rows over d2, reduced over (d0, d1) and read as rows over
    (d0, d1, d2): a reduce-scatter to rows (d2, d0, d1) and a permute).

    Ops that only pass the result on (:func:`_pass_chain`: a Cell's out mark, a parameter's storage mark, a cast, a
    transpose, a reshape that keeps every dim) are looked through: the readers after them decide, and they are laid
    out as those readers read it. That is a Megatron block's row-parallel output read by a data-parallel loss in
    semi_auto (reduce-scattered into the loss's rows, where MindSpore all-reduces it and slices), and a level3
    parameter's gradient reduced into the shard it is stored in."""
    graph = trace.graph
    readers: dict[int, list] = defaultdict(list)
    for _, consumer, tid, i in graph.edges():
        readers[tid].append((graph.ops[consumer], i))
    ends = set(graph.outputs)
    out: dict[int, Scattered] = {}
    strategies = dict(strategies)
    for te in trace.eqns:
        op = graph.ops[te.op]
        if not op.scatter or len(op.outputs) != 1 or op.outputs[0] in ends or not readers[op.outputs[0]]:
            continue
        chain = _pass_chain(graph, op, strategies, readers, ends)
        for n in range(len(chain), -1, -1):          # the longest prefix of the chain the readers' layout maps back through
            want, relaid = _read_back(graph, op, chain[:n], strategies, readers)
            if want is not None:
                break
        if want is None:
            continue
        found = scatter_saving(op, strategies[op.id], want, graph, params)
        if found is not None:
            dot, mark = dot_of(te)
            out[op.id] = Scattered((tuple(id(e) for e in te.path), id(dot)), found[0], mark)
            strategies.update(relaid)
    return out, strategies


# ops that can pass a value on untouched: with every loop dim of size > 1 in both their operand and their result
# (:func:`_pass_chain`), a layout maps through them both ways (a transpose permutes it; a cast copies it; a
# reshape, squeeze, broadcast or sum over size-1 dims only drops or adds unsplit dims). An elementwise op that
# follows a dot takes the dot's layout with its partial axes appended already (semi_auto's follow_operands, the
# searchers' pair price), so it is read directly.
_PASSING = frozenset({"mshard_mark", "convert_element_type", "copy", "copy_p", "reshape", "squeeze", "transpose",
                      "broadcast_in_dim", "reduce_sum"})


def _pass_chain(graph: Graph, op: Op, strategies, readers, ends) -> list[Op]:
    """The ops after ``op`` that only pass its result on: each the one reader of what came before, one of
    :data:`_PASSING` whose every loop dim of size > 1 is in both its operand and its result (a layout maps through
    it both ways), not fixed or tied, not a region result, and taking it where the op before leaves it (no bytes
    move there)."""
    have = result_layout(op, strategies[op.id])
    chain, tid = [], op.outputs[0]
    while len(readers[tid]) == 1:
        c, i = readers[tid][0]
        s = strategies[c.id]
        if (c.kind not in _PASSING or c.fixed is not None or c.id in graph.operand_ties
                or c.follow_operand is not None or len(c.inputs) != 1 or len(c.outputs) != 1
                or c.outputs[0] in ends or not readers[c.outputs[0]]
                or not {d for d, n in c.dims.items() if n > 1} <= set(c.in_dims[0]) & set(c.out_dims[0])
                or operand_layout(c, s, i) != have):
            break
        chain.append(c)
        tid, have = c.outputs[0], result_layout(c, s)
    return chain


def _read_back(graph: Graph, op: Op, chain: list[Op], strategies, readers
               ) -> tuple[TensorLayout | None, dict[int, Strategy]]:
    """(the layout the first op of ``chain`` reads ``op``'s result in, each op's strategy) when every reader after
    ``chain`` reads in one layout and each op of it can compute in that layout (a legal strategy that gives its
    result exactly that layout); (None, {}) otherwise. An empty chain: the one layout ``op``'s readers read in."""
    wants = {operand_layout(c, strategies[c.id], i) for c, i in readers[(chain[-1] if chain else op).outputs[0]]}
    if len(wants) != 1:
        return None, {}
    want, relaid = next(iter(wants)), {}
    for c in reversed(chain):
        s = strategy_of_layout(c, want, mesh=graph.mesh)
        if result_layout(c, s) != want or not is_legal(c, s, graph.mesh):
            return None, {}
        relaid[c.id] = s
        want = operand_layout(c, s, 0)
    return want, relaid


_SUMS = ("dot_general", "reduce_sum")       # the equations whose split result is a partial sum the executor scatters


def dot_of(te):
    """(the dot_general or reduce_sum equation, the out mark holding its result or None) of a traced op that is one
    such equation, or a primitive object traced as one op whose body is one such equation read by its one out mark;
    else None."""
    if not te.group:
        return (te.eqn, None) if te.eqn.primitive.name in _SUMS else None
    dots = [e for e in te.group if e.primitive.name in _SUMS]
    outs = [e for e in te.group if e.primitive.name == "mshard_mark" and e.params.get("role") == "out"]
    if len(dots) != 1 or len(outs) != 1 or outs[0].invars[0] is not dots[0].outvars[0]:
        return None
    return dots[0], outs[0]
