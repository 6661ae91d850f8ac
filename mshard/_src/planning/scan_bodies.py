"""A scan's body planned as a region of its own, after the region's search (docs/gradients.md): one step's graph
(``op_graph.scan_body_graph``) with its boundary fixed where the loop holds its inputs and keeps its results, every
op computed where its operands arrive, partial sums reduce-scattered where they are read split, priced per step
times the loop's length; the carry kept where the body leaves it when that costs less in all."""

from __future__ import annotations

from dataclasses import dataclass

from mshard._src.jaxpr.op_graph import TraceResult, scan_body_graph
from mshard._src.jaxpr.walk import has_marks
from mshard._src.planning.axis_assignment import InputInfo, RegionLayouts
from mshard._src.planning.fused_sums import sum_roles
from mshard._src.planning.plan_build import build_plan, emit_layouts
from mshard._src.planning.prepare import fix_marks, mark_recomputed
from mshard._src.planning.scattered_sums import mark_scatter, scattered_reductions
from mshard._src.values.layout import axes_by_name
from searchers import DeviceMesh
from searchers.cost import Cost, CostParams, graph_cost
from searchers.graph import TensorLayout, operand_layout, result_layout
from searchers.protocol import SEARCHERS
from searchers.strategies import is_legal


@dataclass
class ScanBody:
    """A scan's body planned as a region of its own (:func:`plan_scan_bodies`): the emitter's layouts inside it
    (keyed by the body's equations under the scan's path), the layouts it reads its inputs in and leaves its results
    in (None: where it makes them), and the price of every step."""

    eqn_out: dict
    eqn_in: dict
    eqn_scatter: dict
    inputs: list
    outputs: list
    cost: Cost
    marks: dict          # the layout of each mark inside the body (the user's where fixed, else where planned)


def plan_scan_bodies(trace: TraceResult, strategies, params: CostParams, base: RegionLayouts, notes: list[str]
                     ) -> dict[int, ScanBody]:
    """Scan op id -> its body planned (:func:`_plan_body`), in program order: its inputs in the layouts the body
    reads them in (the scan's operands; a scanned input without its scanned dim, or, a stacked result of an earlier
    loop, where that loop's body left it) and its results in the layouts the loop keeps them in (the carry's; a
    stacked result's one layout its readers read it in, without the scanned dim; where the body makes it, for one
    another loop reads). A body with marks (an op object's strategy inside the loop) is left to XLA, as before: only
    its carry is planned."""
    graph = trace.graph
    readers: dict[int, list] = {}
    for _, consumer, tid, i in graph.edges():
        readers.setdefault(tid, []).append((graph.ops[consumer], i))
    out: dict[int, ScanBody] = {}
    stacked: dict[int, TensorLayout] = {}     # a stacked result left where its body made it -> that layout
    for te in trace.eqns:
        if te.group or te.eqn.primitive.name != "scan" or has_marks(te.eqn.params["jaxpr"].jaxpr):
            continue
        op, p = graph.ops[te.op], te.eqn.params
        s = strategies[op.id]
        lead = p["num_consts"] + p["num_carry"]
        in_fixed = [operand_layout(op, s, i) if i < lead else stacked.get(tid, operand_layout(op, s, i))[1:]
                    for i, tid in enumerate(op.inputs)]
        out_fixed: list = []
        for j, tid in enumerate(op.outputs):
            lay = result_layout(op, s, j)
            if j >= p["num_carry"]:
                # a stacked result read by another scan (a forward's residuals, read by the backward's loop) stays
                # where the body makes it: the emitter leaves it free (emit._stacked_results_free)
                got = readers.get(tid, [])
                wants = {operand_layout(c, strategies[c.id], i) for c, i in got}
                lay = (None if any(c.kind == "scan" for c, _ in got) or not got
                       else (next(iter(wants)) if len(wants) == 1 else lay)[1:])
            out_fixed.append(lay)
        try:
            body, made = _plan_body(te, in_fixed, out_fixed, params, graph.mesh, base)
            moved = _carry_where_made(te, op, strategies, in_fixed, out_fixed, body, params, graph, base)
        except Exception as e:    # a body the planner cannot lay out stays XLA's, as before (the note says so)
            notes.append(f"{te.name}: its body is left to XLA's partitioner, unpriced ({type(e).__name__}: {e})")
            continue
        if moved is not None:
            strategies[op.id], body, made = moved
            notes.append(f"{te.name}: its carry is kept where its body leaves it, which moves less in all")
        for j, lay in enumerate(made):
            if j >= p["num_carry"] and out_fixed[j] is None and lay is not None:
                stacked[op.outputs[j]] = ((), *lay)
        out[op.id] = body
        notes.append(f"{te.name}: its body is planned as a region of its own, priced per step times "
                     f"{p['length']} steps")
    return out


def _carry_where_made(te, op, strategies, in_fixed: list, out_fixed: list, body: ScanBody, params: CostParams,
                      graph, base: RegionLayouts):
    """The scan's carry laid out where its body leaves it, when that costs less in all: the searchers chose the
    carry's layout without the body (a carry that starts from constants, a backward loop's cotangent, is left
    whole), and a body that computes it split then moves it back every step. The body is planned with its carry
    results free, the carry set where they come out, until that holds step after step (3 tries); the layout is
    taken where the region's price (``graph_cost``, shared, with the new scan strategy) plus the body's is lower.
    -> (the scan's strategy, the body, the layout each result is left in), or None."""
    p = te.eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    if not nk:
        return None
    carry = list(in_fixed)
    free = [None if j < nk else lay for j, lay in enumerate(out_fixed)]
    for _ in range(3):
        _, made = _plan_body(te, carry, free, params, graph.mesh, base)
        if any(made[k] is None for k in range(nk)):
            return None
        if all(tuple(made[k]) == tuple(carry[nc + k]) for k in range(nk)):
            break
        carry = carry[:nc] + [tuple(made[k]) for k in range(nk)] + carry[nc + nk:]
    else:
        return None
    if carry == list(in_fixed):
        return None
    where = dict(zip(op.dims, strategies[op.id]))
    for k in range(nk):
        for d, lab in enumerate(op.in_dims[nc + k]):
            if lab is not None:
                where[lab] = tuple(carry[nc + k][d])
    s = tuple(where[d] for d in op.dims)
    used = [a for axes in s for a in axes]
    if len(set(used)) != len(used) or not is_legal(op, s, graph.mesh):   # a mesh axis splits one loop dim of an op
        return None
    fixed = list(out_fixed)
    fixed[:nk] = [carry[nc + k] for k in range(nk)]
    other, made = _plan_body(te, carry, fixed, params, graph.mesh, base)
    tried = dict(strategies)
    tried[op.id] = s
    before = graph_cost(graph, strategies, params, shared=True).total + body.cost.total
    after = graph_cost(graph, tried, params, shared=True).total + other.cost.total
    return (s, other, made) if after < before else None


def _plan_body(te, in_fixed: list, out_fixed: list, params: CostParams, graph_mesh: DeviceMesh,
               region: RegionLayouts) -> tuple[ScanBody, list]:
    """One step of a scan's body (``op_graph.scan_body_graph``, its boundary fixed as given), every op computed
    where its operands arrive (semi_auto's follow, ``searchers.follow``), partial sums reduce-scattered where they
    are read split (``scattered_sums``), priced as :func:`build_plan` prices a region, times the scan's length.
    -> (the body, the layout each result is left in)."""
    mesh = region.mesh
    body = scan_body_graph(te.eqn, te.path, graph_mesh, in_fixed, out_fixed)
    mark_recomputed(body)
    base = RegionLayouts(mesh, [()] * len(body.input_ops), dict(region.marks), region.op_names)
    fix_marks(body, base)            # the user's strategies inside the loop
    roles = sum_roles(body)
    mark_scatter(body, roles)
    found = SEARCHERS["follow_operands"].search(body.graph, params, {})
    scattered, strats = scattered_reductions(body, found.strategies, params)
    laid, eqn_out, eqn_in = emit_layouts(body, strats, base, scattered)
    infos = [InputInfo("data", body.graph.tensors[body.graph.ops[i].outputs[0]].shape, body.graph.ops[i].name)
             for i in body.input_ops]
    c = build_plan(body, strats, found, params, mesh, infos, base, [], "follow_operands", scattered, roles).cost
    n = te.eqn.params["length"]
    cost = Cost(c.compute * n, {k: v * n for k, v in c.communication.items()}, c.comm_time * n, c.memory,
                c.total * n)
    sinks = {body.graph.ops[o].name: body.graph.ops[o]
             for o in (body.graph.tensors[t].producer for t in body.graph.outputs)}
    made = [None if (k := sinks.get(f"scan_out{j}")) is None else operand_layout(k, strats[k.id], 0)
            for j in range(len(out_fixed))]
    left = [None if lay is None or want is None else axes_by_name(lay, mesh) for lay, want in zip(made, out_fixed)]
    return ScanBody(eqn_out, eqn_in, {item.key: axes_by_name(item.target, mesh) for item in scattered.values()},
                    [axes_by_name(x, mesh) for x in in_fixed], left, cost, laid.marks), made
