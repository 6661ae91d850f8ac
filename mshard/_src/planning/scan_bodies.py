"""A scan's body planned as a region of its own, after the region's search (docs/gradients.md): one step's graph
(``op_graph.scan_body_graph``) with its boundary fixed where the loop holds its inputs and keeps its results, every
op computed where its operands arrive, partial sums reduce-scattered where they are read split, priced per step
times the loop's length; the carry kept where the body leaves it when that costs less in all. A ``while``'s body
and a ``cond``'s branches are planned the same way (per iteration times a trip count the jaxpr states; the costlier
branch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jax.extend import core as jcore

from mshard._src.jaxpr.op_graph import TraceResult, scan_body_graph
from mshard._src.planning.axis_assignment import InputInfo, RegionLayouts
from mshard._src.planning.fused_sums import sum_roles
from mshard._src.planning.plan_build import build_plan, emit_layouts, eqn_key
from mshard._src.planning.prepare import fix_marks, mark_recomputed
from mshard._src.planning.scattered_sums import mark_scatter, scattered_reductions
from mshard._src.values.layout import axes_by_index, axes_by_name
from searchers import DeviceMesh
from searchers.cost import Cost, CostParams, graph_cost
from searchers.graph import TensorLayout, operand_layout, result_layout, stored_tensors
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
    moved: bool = False  # its loop's boundary set where the body reads and leaves it (_boundary_where_made)
    nested: dict = field(default_factory=dict)   # a loop's path inside the body -> (its body's input, result layouts)

    def absorb(self, other: ScanBody) -> None:
        """Take ``other``'s layouts too (another branch of the same cond, a while's condition, a loop inside this
        body): its equations' layouts, its marks where this body has none, the loops inside it."""
        self.eqn_out.update(other.eqn_out)
        self.eqn_in.update(other.eqn_in)
        self.eqn_scatter.update(other.eqn_scatter)
        for k, lay in other.marks.items():
            self.marks.setdefault(k, lay)
        self.nested.update(other.nested)


def plan_scan_bodies(trace: TraceResult, strategies, params: CostParams, base: RegionLayouts, notes: list[str]
                     ) -> dict[int, ScanBody]:
    """Scan op id -> its body planned (:func:`_plan_body`), in program order: its inputs in the layouts the body
    reads them in (the scan's operands; a scanned input without its scanned dim, or, a stacked result of an earlier
    loop, where that loop's body left it) and its results in the layouts the loop keeps them in (the carry's; a
    stacked result's one layout its readers read it in, without the scanned dim; where the body makes it, for one
    another loop reads). A mark inside the body (an op object's strategy, a shard-wrapped function: a gradient
    accumulation's whole step, a layer of a scan over layers) is fixed where the user's strategy lays it out
    (``base.marks``), as on the region's graph. A ``while``'s body and a ``cond``'s branches are planned so too
    (:func:`_plan_branched`)."""
    graph = trace.graph
    readers: dict[int, list] = {}
    for _, consumer, tid, i in graph.edges():
        readers.setdefault(tid, []).append((graph.ops[consumer], i))
    out: dict[int, ScanBody] = {}
    stored = stored_tensors(graph)
    # each region input's layout as the user's strategies alone lay it out (a mark inside a loop body reaches the
    # weights the loop reads as constants): a start for the loop's boundary the search could not see
    users = {graph.ops[oid].outputs[0]: axes_by_index(lay, graph.mesh)
             for oid, lay in zip(trace.input_ops, base.inputs) if any(lay)}
    stacked: dict[int, TensorLayout] = {}     # a stacked result left where its body made it -> that layout
    for te in trace.eqns:
        if not te.group and te.eqn.primitive.name in BRANCHED:
            got = _plan_branched(te, graph.ops[te.op], strategies, params, graph, base, stored, notes)
            if got is not None:
                out[te.op] = got
            continue
        if te.group or te.eqn.primitive.name != "scan":
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
            kept = [tid in stored for tid in op.inputs]      # weights: the body reads them as parameters
            body, made = _plan_body(te, in_fixed, out_fixed, params, graph.mesh, base, kept)
            moved = _boundary_where_made(te, op, strategies, in_fixed, out_fixed, body, params, graph, base, kept,
                                         users)
        except Exception as e:    # a body the planner cannot lay out stays XLA's, as before (the note says so)
            notes.append(f"{te.name}: its body is left to XLA's partitioner, unpriced ({type(e).__name__}: {e})")
            continue
        if moved is not None:
            strategies[op.id], body, made = moved
            body.moved = True
            notes.append(f"{te.name}: its constants are read where they arrive and its carry kept where its body "
                         f"leaves it, which moves less in all")
        for j, lay in enumerate(made):
            if j >= p["num_carry"] and out_fixed[j] is None and lay is not None:
                stacked[op.outputs[j]] = ((), *lay)
        out[op.id] = body
        notes.append(f"{te.name}: its body is planned as a region of its own, priced per step times "
                     f"{p['length']} steps")
    return out


def _boundary_where_made(te, op, strategies, in_fixed: list, out_fixed: list, body: ScanBody, params: CostParams,
                         graph, base: RegionLayouts, kept: list[bool], users: dict | None = None):
    """The scan's boundary where its body reads and leaves it, when that costs less in all. The searchers chose
    the scan's strategy without its body and with one mesh axis per loop dim of the scan op: a Megatron layer's
    weights, passed to a gradient accumulation's loop as constants, split over one model-parallel axis on
    different dims, were gathered whole before the loop; a carry that starts from constants (a backward loop's
    cotangent, an accumulated gradient) was left whole, and a body that computes it split moved it back every
    step. The constants are tried where they arrive, whole and, for a region input the user's strategies lay out
    (``users``: tensor id -> layout; a Megatron weight a mark inside the body reads), in that layout; the carry
    starting where its first value arrives and where the search put it; for each, the body is planned with its
    carry results free and the carry set where they come out, until that holds step after step (3 tries). The
    scanned inputs stay as the search read them. The cheapest is taken where the region's price (``graph_cost``,
    shared, with the new scan strategy) plus the body's is lower than the search's. -> (the scan's strategy,
    the body, the layout each result is left in), or None."""
    best, seen = None, set()
    cost = graph_cost(graph, strategies, params, shared=True).total + body.cost.total
    for consts in ("arrive", "whole", "user"):
        for searched in (False, True):
            start = _boundary_start(te, op, strategies, in_fixed, graph, consts, searched, users or {})
            if start in seen:
                continue
            seen.add(start)
            tried = _boundary_tried(te, op, strategies, in_fixed, out_fixed, params, graph, base, kept, list(start))
            if tried is None:
                continue
            alt = dict(strategies)
            alt[op.id] = tried[0]
            total = graph_cost(graph, alt, params, shared=True).total + tried[1].cost.total
            if total < cost:
                best, cost = tried, total
    return best


def _boundary_start(te, op, strategies, in_fixed: list, graph, consts: str, searched: bool, users: dict) -> tuple:
    """The body inputs' layouts a boundary is tried from: the constants where they arrive, whole, or where the
    user's strategies lay them out (``consts``: "arrive", "whole", "user"; where they arrive for a constant no
    strategy lays out), the carry where the search put it or where its first value arrives, the scanned inputs as
    the search read them."""
    nc, nk = te.eqn.params["num_consts"], te.eqn.params["num_carry"]
    start = [tuple(tuple(a) for a in x) for x in in_fixed]
    for i, tid in enumerate(op.inputs[:nc + nk]):
        prod = graph.producer(tid)
        have = tuple(tuple(a) for a in result_layout(prod, strategies[prod.id], prod.outputs.index(tid)))
        if i < nc:
            start[i] = (((),) * len(have) if consts == "whole" else
                        tuple(users[tid]) if consts == "user" and tid in users else have)
        elif not searched:
            start[i] = have
    return tuple(start)


def _boundary_tried(te, op, strategies, in_fixed: list, out_fixed: list, params: CostParams, graph,
                    base: RegionLayouts, kept: list[bool], carry: list):
    """One boundary for :func:`_boundary_where_made`, from the body inputs' layouts ``carry``. -> (the scan's
    strategy, the body, the layout each result is left in), or None where it is the search's, does not settle or
    is no strategy."""
    p = te.eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    free = [None if j < nk else lay for j, lay in enumerate(out_fixed)]
    for _ in range(3 if nk else 0):
        _, made = _plan_body(te, carry, free, params, graph.mesh, base, kept)
        if any(made[k] is None for k in range(nk)):
            return None
        if all(tuple(made[k]) == tuple(carry[nc + k]) for k in range(nk)):
            break
        carry = carry[:nc] + [tuple(made[k]) for k in range(nk)] + carry[nc + nk:]
    else:
        if nk:
            return None
    if [tuple(map(tuple, x)) for x in carry] == [tuple(map(tuple, x)) for x in in_fixed]:
        return None
    where = dict(zip(op.dims, strategies[op.id]))
    for i in range(nc + nk):
        for d, lab in enumerate(op.in_dims[i]):
            if lab is not None:
                where[lab] = tuple(carry[i][d])
    s = tuple(where[d] for d in op.dims)
    if not _per_tensor(op, s) or not is_legal(op, s, graph.mesh):
        return None
    fixed = list(out_fixed)
    fixed[:nk] = [carry[nc + k] for k in range(nk)]
    other, made = _plan_body(te, carry, fixed, params, graph.mesh, base, kept)
    return s, other, made


def _per_tensor(op, s) -> bool:
    """Whether each of a scan's operands and results is a layout (a mesh axis splits one of its dims at most). A
    scan's operands are independent tensors, so one mesh axis may split a dim of each: the gradients of a
    column-parallel and a row-parallel weight accumulated in one carry are split over the same model-parallel axis,
    on different dims."""
    lays = [operand_layout(op, s, i) for i in range(len(op.inputs))] + [
        result_layout(op, s, j) for j in range(len(op.outputs))]
    return all(len(used := [a for axes in lay for a in axes]) == len(set(used)) for lay in lays)


# a region's planned bodies by their boundary (_plan_body): the boundaries tried for a loop or a branch, and the
# second search after a loop moved, plan the same body at the same boundary again. Cleared per region (clear_bodies)
_PLANNED: dict = {}


def clear_bodies() -> None:
    """Forget the bodies planned so far (a new region's planning starts)."""
    _PLANNED.clear()


def _plan_body(te, in_fixed: list, out_fixed: list, params: CostParams, graph_mesh: DeviceMesh,
               region: RegionLayouts, kept: list[bool], jaxpr=None, length: int | None = None,
               scalars: bool = False) -> tuple[ScanBody, list]:
    """One step of a scan's body (``op_graph.scan_body_graph``, its boundary fixed as given), every op computed
    where its operands arrive (semi_auto's follow, ``searchers.follow``), partial sums reduce-scattered where they
    are read split (``scattered_sums``), priced as :func:`build_plan` prices a region, times the scan's length.
    ``jaxpr``/``length``: another body of the eqn and its count (a ``while``'s body, a ``cond``'s branch, once).
    -> (the body, the layout each result is left in). The same body at the same boundary is planned once per
    region (a copy is returned: callers change the bodies they keep)."""
    jaxpr = te.eqn.params["jaxpr"] if jaxpr is None else jaxpr
    norm = lambda lays: tuple(None if x is None else tuple(map(tuple, x)) for x in lays)
    key = (id(te.eqn), id(jaxpr), norm(in_fixed), norm(out_fixed), tuple(kept), length, scalars, id(region),
           id(params), id(graph_mesh))
    hit = _PLANNED.get(key)
    if hit is None or hit[0] is not te.eqn or hit[1] is not jaxpr or hit[2] is not region:
        hit = _PLANNED[key] = (te.eqn, jaxpr, region, *_planned_body(
            te, in_fixed, out_fixed, params, graph_mesh, region, kept, jaxpr, length, scalars))
    body, made = hit[3], hit[4]
    return dataclasses.replace(body, eqn_out=dict(body.eqn_out), eqn_in=dict(body.eqn_in),
                               eqn_scatter=dict(body.eqn_scatter), marks=dict(body.marks),
                               nested=dict(body.nested)), list(made)


def _planned_body(te, in_fixed: list, out_fixed: list, params: CostParams, graph_mesh: DeviceMesh,
                  region: RegionLayouts, kept: list[bool], jaxpr, length: int | None, scalars: bool
                  ) -> tuple[ScanBody, list]:
    """:func:`_plan_body`, planned."""
    mesh = region.mesh
    body = scan_body_graph(te.eqn, te.path, graph_mesh, in_fixed, out_fixed, kept, jaxpr, scalars)
    mark_recomputed(body)
    base = RegionLayouts(mesh, [()] * len(body.input_ops), dict(region.marks), region.op_names)
    fix_marks(body, base)            # the user's strategies inside the loop
    roles = sum_roles(body)
    mark_scatter(body, roles)
    found, scattered, strats, inner = _follow_body(body, te, params, base)
    moved = {oid: strats[oid] for oid, b in inner.items() if b.moved}
    if moved:                        # a loop inside the body moved its boundary: the body follows it there
        for oid, s in moved.items():
            body.graph.ops[oid].fixed = s
        found, scattered, strats, inner = _follow_body(body, te, params, base)
    laid, eqn_out, eqn_in = emit_layouts(body, strats, base, scattered)
    infos = [InputInfo("data", body.graph.tensors[body.graph.ops[i].outputs[0]].shape, body.graph.ops[i].name)
             for i in body.input_ops]
    c = build_plan(body, strats, found, params, mesh, infos, base, [], "follow_operands", scattered, roles,
                   bodies={oid: b.cost for oid, b in inner.items()}, manual=False).cost
    eqn_scatter = {item.key: axes_by_name(item.target, mesh) for item in scattered.values()}
    n = te.eqn.params["length"] if length is None else length
    cost = Cost(c.compute * n, {k: v * n for k, v in c.communication.items()}, c.comm_time * n, c.memory,
                c.total * n)
    sinks = {body.graph.ops[o].name: body.graph.ops[o]
             for o in (body.graph.tensors[t].producer for t in body.graph.outputs)}
    outvars = jaxpr.jaxpr.outvars
    # a scalar result (a loss summed over the steps) has no sink (scan_body_graph) and one layout
    made = [() if not outvars[j].aval.shape else None if (k := sinks.get(f"scan_out{j}")) is None
            else operand_layout(k, strats[k.id], 0) for j in range(len(out_fixed))]
    left = [None if lay is None or want is None else axes_by_name(lay, mesh) for lay, want in zip(made, out_fixed)]
    planned = ScanBody(eqn_out, eqn_in, eqn_scatter, [axes_by_name(x, mesh) for x in in_fixed], left, cost,
                       dict(laid.marks))
    for inner_te in body.eqns:       # the loops inside the body: their layouts, under their own paths
        if (b := inner.get(inner_te.op)) is not None:
            planned.absorb(b)
            planned.nested[(*eqn_key(inner_te)[0], id(inner_te.eqn))] = (b.inputs, b.outputs)
    return planned, made


def _follow_body(body: TraceResult, te, params: CostParams, base: RegionLayouts):
    """A body's graph laid out by semi_auto's follow, its partial sums reduce-scattered where read split, and the
    loops inside it planned as bodies of their own (:func:`plan_scan_bodies`, recursively). -> (the follow's
    result, scattered, strategies, op id -> the inner loop's body)."""
    found = SEARCHERS["follow_operands"].search(body.graph, params, {})
    # a cond's branch sums its partial results whole: XLA's partitioner follows a reduce-scatter in a branch with
    # an all-gather and a slice back to the same layout (3,072 B more on the Megatron MLP of
    # tests/e2e/search/test_branch_bodies.py, which no plan priced; the same reduce-scatter outside a branch
    # compiles as planned), so the branch all-reduces, moving what the reduce-scatter and that gather move
    scattered, strats = (scattered_reductions(body, found.strategies, params) if te.eqn.primitive.name != "cond"
                         else ({}, found.strategies))
    strats = dict(strats)
    inner = plan_scan_bodies(body, strats, params, base, [])
    return found, scattered, strats, inner


# the control flow whose bodies are planned like a scan's (their rules: jaxpr/rules.py while_carry_rule,
# cond_branches_rule): the op input its bodies' first input is bound to, and its bodies
BRANCHED = {"while": (lambda p: p["cond_nconsts"], lambda p: [p["body_jaxpr"]]),
            "cond": (lambda p: 1, lambda p: list(p["branches"]))}


def _plan_branched(te, op, strategies, params: CostParams, graph, base: RegionLayouts, stored, notes: list[str]
                   ) -> ScanBody | None:
    """A ``while``'s body or a ``cond``'s branches planned as regions of their own (:func:`_plan_body`): a while loop
    priced per iteration times its trip count where :func:`trip_count` reads it (once where it does not), a
    conditional as its costlier branch (one runs). Three boundaries are tried and the one that costs less in all
    (the region's price with it plus the bodies') is kept: the search's; the operands read where they arrive; and
    the operands other than a while's carry read whole (a weight split on a dim the body contracts: gathered once
    rather than summed every iteration). With the last two, the results are left where the bodies leave them (a
    while's carry where its body leaves it step after step, 3 tries; a cond's results where one of its branches
    leaves them, each branch tried). The searchers price no body and give each loop dim one mesh axis, so a
    Megatron layer's two weights, split over one axis on different dims, were gathered for a decode loop or a
    branch that reads them.
    The op's strategy is set to the kept boundary (``ScanBody.moved`` where that is not the search's)."""
    first, bodies_of = BRANCHED[te.eqn.primitive.name]
    skip, bodies = first(te.eqn.params), bodies_of(te.eqn.params)
    nk = len(op.outputs) if te.eqn.primitive.name == "while" else 0
    trips = trip_count(te.eqn) if nk else 1
    kept = [tid in stored for tid in op.inputs[skip:]]
    s = strategies[op.id]
    searched_in = [operand_layout(op, s, i) for i in range(skip, len(op.inputs))]
    searched_out = [result_layout(op, s, j) for j in range(len(op.outputs))]
    arrive = []
    for tid in op.inputs[skip:]:
        prod = graph.producer(tid)
        arrive.append(tuple(tuple(a) for a in result_layout(prod, strategies[prod.id], prod.outputs.index(tid))))
    n = len(arrive) - nk                  # the operands that are not a while's carry
    whole = [((),) * len(lay) if i < n else lay for i, lay in enumerate(arrive)]
    best, cost = None, None
    try:
        starts = [[tuple(map(tuple, x)) for x in xs] for xs in (searched_in, arrive, whole)]
        for k, start in enumerate(starts):
            if k > 1 and start == starts[1]:      # nothing to gather: the operands arrive whole
                continue
            for ins, outs, body in _branched_boundary(te, bodies, [tuple(map(tuple, x)) for x in start],
                                                      searched_out, nk, params, graph.mesh, base, kept,
                                                      k > 0, trips or 1):
                where = dict(zip(op.dims, s))
                for i, lay in enumerate(ins):
                    for d, lab in enumerate(op.in_dims[skip + i]):
                        if lab is not None:
                            where[lab] = tuple(lay[d])
                for j, lay in enumerate(outs):
                    for d, lab in enumerate(op.out_dims[j]):
                        if lab is not None and lay is not None:
                            where[lab] = tuple(lay[d])
                new = tuple(where[d] for d in op.dims)
                if new != tuple(s) and (not _per_tensor(op, new) or not is_legal(op, new, graph.mesh)):
                    continue
                alt = dict(strategies)
                alt[op.id] = new
                total = graph_cost(graph, alt, params, shared=True).total + body.cost.total
                if cost is None or total < cost:
                    best, cost = (new, body), total
    except Exception as e:    # a body the planner cannot lay out stays XLA's (the note says so)
        notes.append(f"{te.name}: its {'body' if nk else 'branches'} left to XLA's partitioner, unpriced "
                     f"({type(e).__name__}: {e})")
        return None
    if best is None:
        notes.append(f"{te.name}: its {'body' if nk else 'branches'} left to XLA's partitioner, unpriced")
        return None
    new, body = best
    if nk:
        _with_condition(te, op, new, body, params, graph, base, stored, trips)
    if new != tuple(s):
        strategies[op.id] = new
        body.moved = True
        notes.append(f"{te.name}: its operands are read where they arrive and its results left where its "
                     f"{'body leaves' if nk else 'branches leave'} them, which moves less in all")
    notes.append(f"{te.name}: " + ((f"its body is planned as a region of its own, priced per iteration times "
                                    f"{trips} iterations" if trips is not None else
                                    "its body is planned as a region of its own, priced once per iteration (the "
                                    "trip count is not known)") if nk else
                                   f"its {len(bodies)} branches are planned as regions of their own, priced as the "
                                   f"costlier (one runs)"))
    return body


def _with_condition(te, op, strategy, body: ScanBody, params: CostParams, graph, base: RegionLayouts, stored,
                    trips: int | None) -> None:
    """A while's condition planned as a region of its own (:func:`_plan_body`), added to ``body``: it reads its
    constants and the carry where the loop holds them (``strategy``), and runs once per test: the trip count plus
    one where it is known, once otherwise. A condition that reduces a split carry (an all-done flag over a batch
    split over the devices) sums its partial result every test."""
    p = te.eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    read = list(range(nc)) + list(range(nc + nb, len(op.inputs)))
    ins = [tuple(map(tuple, operand_layout(op, strategy, i))) for i in read]
    cond, _ = _plan_body(te, ins, [()] * len(p["cond_jaxpr"].jaxpr.outvars), params, graph.mesh, base,
                         [op.inputs[i] in stored for i in read], p["cond_jaxpr"],
                         1 if trips is None else trips + 1, scalars=True)
    body.cost = body.cost + cond.cost
    body.absorb(cond)
    body.nested[(*eqn_key(te)[0], id(te.eqn), "cond")] = (cond.inputs, [None] * len(cond.outputs))


def _branched_boundary(te, bodies: list, ins: list, outs: list, nk: int, params: CostParams, graph_mesh,
                       base: RegionLayouts, kept: list[bool], where_made: bool, trips: int = 1) -> list[tuple]:
    """The bodies planned with their inputs read in ``ins`` and their results left in ``outs``; ``where_made``: a
    while's carry (its last ``nk`` inputs and its results) where the body leaves it step after step, a cond's
    results where one of its branches leaves them (one candidate per branch: a branch that does not compute a
    result, as the residuals of a differentiated cond's other branch, leaves a placeholder whole). -> per
    candidate (inputs, results, the body: every body's layouts, the costliest's price); none where the carry
    does not settle."""
    if nk and where_made:
        for _ in range(3):
            _, made = _plan_body(te, ins, [None] * nk, params, graph_mesh, base, kept, bodies[0], 1)
            if any(m is None for m in made):
                return []
            if all(tuple(m) == tuple(c) for m, c in zip(made, ins[-nk:])):
                break
            ins = ins[:-nk] + [tuple(map(tuple, m)) for m in made]
        else:
            return []
        tries = [list(ins[-nk:])]
    elif where_made:
        tries = []
        for b in bodies:
            _, made = _plan_body(te, ins, [None] * len(outs), params, graph_mesh, base, kept, b, 1)
            got = [o if m is None else tuple(map(tuple, m)) for m, o in zip(made, outs)]
            if got not in tries:
                tries.append(got)
    else:
        tries = [outs]
    out = []
    for outs in tries:
        planned = [_plan_body(te, ins, outs, params, graph_mesh, base, kept, b, trips)[0] for b in bodies]
        body = max(planned, key=lambda b: b.cost.total)
        for other in planned:
            if other is not body:
                body.absorb(other)
        out.append((ins, outs, body))
    return out


def trip_count(eqn) -> int | None:
    """The iterations of a ``while`` eqn when its jaxpr says them: a carry that starts at a literal, is compared
    ``<`` (or ``>``) with a literal by the condition and moves by a literal step each iteration (a
    ``while_loop(lambda c: c[0] < n, ...)`` with a Python ``n``), as XLA's own trip count analysis reads it; None
    otherwise (a bound the loop computes or reads from its operands).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x: jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 2, c[1] * 2), (0, x))[1]
    >>> trip_count(jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns[0])
    3
    >>> g = lambda x, n: jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]
    >>> trip_count(jax.make_jaxpr(g)(jnp.ones(3), 5).jaxpr.eqns[0]) is None
    True
    """
    p = eqn.params
    cond, body = p["cond_jaxpr"].jaxpr, p["body_jaxpr"].jaxpr
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    if len(cond.eqns) != 1 or cond.eqns[0].primitive.name not in ("lt", "gt"):
        return None
    test = cond.eqns[0]
    a, b = test.invars
    if test.primitive.name == "gt":
        a, b = b, a
    lit = lambda v: v.val if isinstance(v, jcore.Literal) else None
    carry = cond.invars[nc:]
    if a in carry and lit(b) is not None:            # i < n, counting up
        k, bound, up = carry.index(a), lit(b), True
    elif b in carry and lit(a) is not None:          # n < i, counting down
        k, bound, up = carry.index(b), lit(a), False
    else:
        return None
    start = lit(eqn.invars[nc + nb + k])
    made = next((e for e in body.eqns if body.outvars[k] in e.outvars), None)
    if start is None or made is None or made.primitive.name not in ("add", "sub"):
        return None
    x, y = made.invars
    if x is not body.invars[nb + k] or lit(y) is None:
        return None
    step = lit(y) if made.primitive.name == "add" else -lit(y)
    if (step <= 0) if up else (step >= 0):
        return None
    span = bound - start if up else start - bound
    return max(0, -(-int(span) // abs(int(step))))
