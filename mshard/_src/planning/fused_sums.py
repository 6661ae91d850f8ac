"""The planner's price of partial sums added before one reduction (issue 40).

Where a program adds two partial sums (``mshard._src.jaxpr.sum_pairs``: a tied parameter's two gradient
contributions, the dx of two column-parallel projections that read one activation), the emitter computes each per
device and reduces their sum once (``mshard._src.runtime.partial_sums``). The cost model prices each op's
partial results where the op makes them (``searchers.cost.op_cost``), so it counted that reduction twice. Given
the searched strategies, :func:`fused_reductions` finds the ops whose reduction the emitter leaves to another's:
both partial over the same mesh axes, their results laid out alike once the transposes between them and the sum
are applied (the emitter's conditions: ``partial_sums.local_partial`` and ``partial_sums.add``). Their all-reduce
is then taken out of the plan's price (:func:`unpriced_reduction`).
"""

from __future__ import annotations

from collections import defaultdict

from mshard._src.jaxpr.op_graph import TraceResult
from mshard._src.jaxpr.sum_pairs import ROOTS, partial_sum_pairs
from mshard._src.jaxpr.walk import call_jaxpr
from searchers.cost import Cost, CostParams
from searchers.graph import partial_axes, result_layout


def sum_roles(trace: TraceResult) -> dict[tuple, tuple]:
    """Per jaxpr the trace's equations sit in (keyed by the ids of their enclosing calls): (that jaxpr, the role of
    each of its equations in a sum of partial sums, ``jaxpr.sum_pairs.partial_sum_pairs``)."""
    out: dict[tuple, tuple] = {}
    for te in trace.eqns:
        key = tuple(map(id, te.path))
        if key not in out and (jaxpr := _jaxpr_at(trace, te.path)) is not None:
            out[key] = (jaxpr, partial_sum_pairs(jaxpr))
    return out


def fused_reductions(trace: TraceResult, strategies, roles_at: dict[tuple, tuple] | None = None) -> dict[int, int]:
    """Op id whose partial sums are reduced together with another's -> that other op's id. ``roles_at``: the
    trace's :func:`sum_roles`, where already found."""
    by_path: dict[tuple, dict[int, object]] = defaultdict(dict)
    for te in trace.eqns:
        if not te.group:
            by_path[tuple(map(id, te.path))][id(te.eqn)] = te
    roles_at = sum_roles(trace) if roles_at is None else roles_at
    out: dict[int, int] = {}
    for key, tes in by_path.items():
        if key not in roles_at:
            continue
        jaxpr, roles = roles_at[key]
        if "sum" not in roles.values():
            continue
        producer = {v: e for e in jaxpr.eqns for v in e.outvars}
        held: dict[int, tuple] = {}          # id(sum eqn) -> (axes, layout, root op) of the sum fused there
        for e in jaxpr.eqns:
            if roles.get(id(e)) != "sum":
                continue
            sides = [_side(v, producer, roles, tes, trace, strategies, held) for v in e.invars]
            if any(s is None for s in sides):
                continue
            (ax1, lay1, op1, from_sum1), (ax2, lay2, op2, from_sum2) = sides
            if ax1 != ax2 or lay1 != lay2 or (from_sum1 and from_sum2):
                continue
            free, kept = (op1, op2) if from_sum2 else (op2, op1)
            out[free] = kept
            held[id(e)] = (ax1, lay1, kept)
    return out


def _jaxpr_at(trace: TraceResult, path: tuple):
    """The jaxpr whose equations carry ``path`` (the inlined calls enclosing them; a scan's body planned as a
    region of its own, ``scan_bodies.plan_scan_bodies``)."""
    if not path:
        return trace.closed_jaxpr.jaxpr
    return path[-1].params["jaxpr"].jaxpr if path[-1].primitive.name == "scan" else call_jaxpr(path[-1])


def _side(v, producer, roles, tes, trace: TraceResult, strategies, held):
    """(partial axes, layout at the sum, the op whose reduction it is, whether it is an earlier sum) of one
    operand of a sum, or None where the emitter would not hold it as a partial sum."""
    perms = []
    while True:
        e = producer.get(v)
        if e is None:
            return None
        if roles.get(id(e)) == "sum":
            if id(e) not in held:
                return None
            axes, layout, op = held[id(e)]
            return axes, _permuted(layout, perms), op, True
        if roles.get(id(e)) == "root" and e.primitive.name in ROOTS:
            te = tes.get(id(e))
            if te is None:
                return None
            op = trace.graph.ops[te.op]
            axes = partial_axes(op, strategies[op.id])
            layout = result_layout(op, strategies[op.id], 0)
            if not axes or (e.primitive.name == "scatter-add" and any(layout)):
                return None
            return axes, _permuted(layout, perms), op.id, False
        if e.primitive.name == "transpose":
            perms.append(e.params["permutation"])
        v = e.invars[0]


def _permuted(layout, perms):
    for perm in reversed(perms):     # applied from the root towards the sum
        layout = tuple(layout[p] for p in perm)
    return tuple(tuple(a) for a in layout)


def unpriced_reduction(cost: Cost, params: CostParams) -> Cost:
    """The part of an op's cost that is its partial sums' all-reduce, negated (to take out of a price)."""
    b, t = cost.comm_bytes["all-reduce"], cost.comm_time
    return Cost(0.0, {"all-reduce": -b}, -t, 0.0, -params.weigh(0.0, t, 0.0))
