"""Plan a region: jaxpr -> searchers.Graph -> user strategies fixed -> searcher or default -> Plan + the layouts
to emit. The one planning path (docs/design.md invariant 1) of every mode: semi_auto_parallel, auto_parallel, a loaded
strategy file, and data_parallel / stand_alone (MindSpore's data-parallel plan, :func:`searchers.baselines.
data_parallel`: the batch split over every device, or over one, flowing through every op; parameters whole).

The user's strategies are fixed first (the axis assignment of :mod:`mshard._src.planning.axis_assignment`), the data inputs by
dataset_strategy, the parameters with a parameter_plan by it. Then auto_parallel's searcher decides the rest;
semi_auto_parallel's default (:func:`searchers.follow.follow_operands`) gives every other op the layout its
operands arrive in (nothing new split: the batch stays data parallel, a user's model split flows on), or
sharding_propagation where ``search_mode="sharding_propagation"`` was set explicitly. Every traced op then has
a layout for each result; the executor constrains op results to them, and an op's operands where the plan
redistributes them, so the Plan is the program.

Updated state (parameters, optimizer state, counters) is stored back in its input's layout, which the
graph shows as a ``writeback`` op per updated input (:func:`mshard._src.jaxpr.op_graph.jaxpr_to_graph`). Where the
search left one of them free, the region is searched a second time with every updated input and its
writeback held at the layout the first search gave the input: the update's ops are then priced against
the layout they must end in (without this, a search splits an update as finely as it can, slicing is
free, and XLA gathers every new value back after the step). Not for ``sharding_propagation``: it spreads
layouts outwards from the fixed ops, and held state would make every parameter such a seed (measured on
a GPT step: 5 times the bytes moved).

``fully_use_devices`` restricts the ops a user output depends on (a training step's forward); the others
(its backward and update, which MindSpore derives from the forward strategies and the parameters' layouts
rather than searches) are marked ``free_devices`` and may leave devices idle, e.g. to stay in a Megatron
layout that is replicated over the model-parallel devices.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from mshard._src.jaxpr.marks import OpNote, mark_p
from mshard._src.jaxpr.op_graph import REPLICA, TraceResult, jaxpr_to_graph, scan_body_graph
from mshard._src.jaxpr.walk import REMAT, has_marks
from mshard._src.planning.axis_assignment import InputInfo, RegionLayouts, assign_layouts, exact_mark_key, mark_key
from mshard._src.planning.fused_sums import fused_reductions, sum_roles, unpriced_reduction
from mshard._src.planning.joined_sums import Joined, joined_sums
from mshard._src.planning.scattered_sums import Scattered, mark_scatter, scattered_reductions
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import ContextError, PlanError, StrategyError, StrategyIgnoredWarning
from mshard._src.values.layout import (
    DimAxes,
    TensorStrategy,
    axes_by_index,
    axes_by_name,
    check_strategy,
    dims_of,
    replica_layout,
    spec_of,
)
from mshard._src.values.plan import Plan, PlanCost, PlanOp, Redistribution, load_plan
from searchers import DeviceMesh, Graph
from searchers.cost import (
    Cost,
    CostParams,
    graph_cost,
    op_cost,
    redistribution_cost,
    reshard_once,
    scattered_reduction_cost,
)
from searchers.direct_reshard import cheaper_than_xla
from searchers.graph import (
    TensorLayout,
    constant_tensors,
    dead_ops,
    mark_merged_reductions,
    operand_layout,
    operand_tied_strategy,
    result_layout,
    share_key,
    split_counts,
    strategy_of_layout,
)
from searchers.memory import peak_memory
from searchers.protocol import SEARCHERS, register
from searchers.strategies import enumerate_strategies, is_legal
from searchers.xla_reshard import reshard as xla_reshard

EqnKey = tuple[tuple[int, ...], int]


def register_searcher(name: str, fn: Callable, **capabilities) -> None:
    """A new search_mode (:func:`searchers.protocol.register`: ``ties_exactly``, ``holds_state``, ``options``)."""
    register(name, fn, **capabilities)


def eqn_key(te) -> EqnKey:
    return (tuple(id(e) for e in te.path), id(te.eqn))


@dataclass
class Planned:
    plan: Plan
    layouts: RegionLayouts
    eqn_out: dict[EqnKey, tuple[DimAxes | None, ...]] = field(default_factory=dict)
    eqn_in: dict[EqnKey, tuple[DimAxes | None, ...]] = field(default_factory=dict)
    eqn_scatter: dict[EqnKey, DimAxes] = field(default_factory=dict)   # partial results reduce-scattered there
    eqn_joined: dict[EqnKey, str] = field(default_factory=dict)  # roles in partial sums joined (joined_sums)
    # the emitter's path inside a planned scan body -> (the layouts the body reads its inputs in, leaves its results in)
    bodies: dict[tuple, tuple] = field(default_factory=dict)


def _strategy_from_layout(op, layout: DimAxes, mesh: DeviceMesh, operand: int | None = None):
    """A strategy of an op whose loop dims map 1:1 onto one tensor (source ops, marks), from axis names."""
    return strategy_of_layout(op, axes_by_index(layout, mesh), operand)


def _batched(lay: DimAxes, eqn, rank: int) -> DimAxes:
    """A mark's planned layout on its traced tensor: with the replica split added where the mark was batched
    over data-parallel replicas (:func:`mshard._src.runtime.emit.replica_layout`)."""
    bdim = eqn.params.get("bdim")
    if bdim is not None and len(lay) == rank - 1:
        return replica_layout(lay, bdim, eqn.params["replica_axes"])
    return lay


def _fix_group(te, op, base: RegionLayouts, mesh: DeviceMesh) -> None:
    """Fix a primitive object's op (traced as one op) to the strategy its annotated input marks were given."""
    note: OpNote = te.eqn.params["note"]
    where: dict[str, tuple[str, ...]] = {}
    for e in te.group:
        if e.primitive is not mark_p or e.params["role"] != "in":
            continue
        lay = base.marks.get(mark_key(e))
        if lay is None:
            continue
        rep = tuple(e.params["replica_axes"]) if e.params.get("bdim") is not None else ()
        for letter, axes in zip(note.in_dims[e.params["index"]], lay):
            if letter is not None:            # the replica split leaves the per-replica dims (replica_layout)
                where[letter] = tuple(a for a in axes if a not in rep)
        if rep:
            where[REPLICA] = rep
    if where:
        op.fixed = axes_by_index((where.get(d, ()) for d in op.dims), mesh)


def _merged_strategy(note: OpNote, layouts: dict[int, DimAxes], mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """The strategy of a primitive object traced op by op (its body's values are read elsewhere, so it is not one
    op of the search): each of its loop dims takes the axes the first input carrying it arrives with (an axis once
    only), so the report is one device matrix even where its inputs arrive in layouts that disagree (the body
    redistributes them)."""
    where: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    for i in sorted(layouts):
        for letter, axes in zip(note.in_dims[i], layouts[i]):
            if letter is not None and letter not in where and letter not in note.fixed and not set(axes) & used:
                where[letter] = axes
                used.update(axes)
    return tuple(tuple(mesh.count(where.get(letter, ())) if letter else 1 for letter in dims) for dims in note.in_dims)


def _group_strategy(te, op, strategy, mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """A primitive object's MindSpore strategy (one split tuple per input, its own dims: no replica dim)."""
    note: OpNote = te.eqn.params["note"]
    where = dict(zip(op.dims, strategy))
    return tuple(tuple(mesh.count(where.get(letter, ())) if letter else 1 for letter in dims)
                 for dims in note.in_dims)


def _groups(trace: TraceResult) -> dict[int, Any]:
    """op id -> the primitive-object note it belongs to (its marks and the ops between them)."""
    out: dict[int, Any] = {}
    open_note, left = None, 0
    for te in trace.eqns:
        e = te.eqn
        if te.group:               # traced as one op: its own entry (build_plan)
            continue
        if e.primitive is mark_p:
            note: OpNote = e.params["note"]
            role = e.params["role"]
            if note.in_dims is not None and role == "in":
                open_note, left = note, len(note.out_dims)
            if note.in_dims is not None and role in ("in", "out"):
                out[te.op] = note
                if role == "out" and open_note is note:
                    left -= 1
                    if left == 0:
                        open_note = None
                continue
        if open_note is not None:
            out[te.op] = open_note
    return out


def _free_derived(graph: Graph, n_user: int) -> None:
    """Mark ``free_devices`` every op no user output depends on: in a training step, the backward and the
    update, which only feed the new state. MindSpore applies ``fully_use_devices`` to the operators it searches
    (the forward); their backward is derived from the forward strategies and the optimizer follows the
    parameters' layouts. Here they are searched too, but without that restriction; they are also marked
    ``derived``, which sharding_propagation derives rather than propagates into (searchers.propagation)."""
    if n_user < 0 or n_user >= len(graph.outputs):
        return
    live: set[int] = set()
    todo = list(graph.outputs[:n_user])
    while todo:
        op = graph.producer(todo.pop())
        if op.id not in live:
            live.add(op.id)
            todo.extend(op.inputs)
    for op in graph.ops:
        if op.id not in live and not op.is_source:
            op.free_devices = op.derived = True


def _derive_backward(graph: Graph) -> None:
    """Mark ``derived`` every op of a backward pass the region computes as a result (``jax.grad`` of a loss inside
    the region: its ops' names carry JAX's ``transpose(...)`` scope) and every op only such ops read, as
    :func:`_free_derived` marks a step's: MindSpore derives a backward from the forward's strategies;
    sharding_propagation does not propagate into it."""
    marked = False
    for op in graph.ops:
        if not op.is_source and _BACKWARD in op.name:
            op.derived = marked = True
    if not marked:
        return
    # and what only the backward reads: the forward's residual coefficients (the 2 * y of a y ** 2, a ReLU's mask).
    # One step back only: further back lies the primal forward itself, which a loss the region does not return
    # also feeds only the backward
    backward = {op.id for op in graph.ops if op.derived}
    for op in graph.ops:
        if op.derived or op.is_source or not op.outputs or any(t in graph.outputs for t in op.outputs):
            continue
        readers = [c for t in op.outputs for c in graph.tensors[t].consumers]
        if readers and all(c in backward for c in readers):
            op.derived = True


_BACKWARD = "transpose("     # JAX's name-stack scope of a transposed (backward) equation


def _free_data_free(graph: Graph) -> None:
    """Mark ``free_devices`` every op that no data input reaches: a parameter's own transform (a reshape of a norm's
    scale, a position table's lookup at fixed positions) and what is computed from constants alone (an iota's
    comparisons, a causal mask). Like a source or an iota, such an op's layout follows its users and
    ``fully_use_devices`` (the batch enters over every device) does not bind it: data parallel computes it whole
    on every device, and so may a search (the baselines' admissibility, searchers.baselines). Held to use every
    device, the exact searchers could not reach data parallel's plan: on the MiniGPT forward ilp's optimum over
    that narrower space cost 0.026 against data parallel's 8e-8."""
    fed = [False] * len(graph.ops)
    for op in graph.ops:                                   # program order: producers first
        fed[op.id] = op.kind == "data" or any(fed[graph.producer(t).id] for t in op.inputs)
    for op in graph.ops:
        if not op.is_source and not fed[op.id]:
            op.free_devices = True


def _hold_state(graph: Graph, strategies) -> bool:
    """Fix each ``writeback`` op and its state input to the state input's layout in ``strategies`` (see
    :func:`mshard._src.jaxpr.op_graph.jaxpr_to_graph`); True if any was not fixed yet."""
    changed = False
    for op in graph.ops:
        if op.kind != "writeback":
            continue
        src = graph.producer(op.inputs[1])
        lay = result_layout(src, strategies[src.id], src.outputs.index(op.inputs[1]))
        want = tuple(tuple(a) for a in lay)
        if op.fixed is None or src.fixed is None:
            changed = True
        src.fixed = src.fixed if src.fixed is not None else strategy_of_layout(src, want)
        op.fixed = want
    return changed


def _device_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The searchers' mesh of a region mesh, with the cost model's per-axis bandwidths."""
    bw = ctxmod.get_cost_model_context().axis_bandwidth
    if bw is not None and len(bw) != len(mesh.shape):
        raise ContextError(f"set_cost_model_context: axis_bandwidth has {len(bw)} entries but the region mesh "
                           f"{dict(zip(mesh.names, mesh.shape))} has {len(mesh.shape)} axes; give one per axis.")
    return DeviceMesh(mesh.shape, mesh.names, tuple(bw) if bw else ())


def search_region(closed: jcore.ClosedJaxpr, inputs: Sequence[InputInfo], *, ctx, algorithm: str,
                  param_plans: Sequence[tuple[str, str, Any]] = (), input_layout_hook: Callable | None = None
                  ) -> Planned:
    """Plan a region with the searcher ``algorithm`` (a key of :data:`SEARCHERS`, or ``"data_parallel"`` /
    ``"stand_alone"``: MindSpore's data-parallel plan on every device / on one).

    ``input_layout_hook(inputs, layouts) -> input layouts`` (a training step's optimizer-parallel layouts, a
    pipeline's parameter layouts inside its stages, each optimizer-state leaf in its parameter's layout) is applied
    to the inputs of a data-parallel, semi_auto or pipelined plan before the plan is made, so the plan prices and
    pins them; a searched plan holds what the search laid out otherwise and searches again.

    The steps, each a function of its own: trace the region into its one graph (once the mesh is known), lay out
    the user's splits (:func:`mshard._src.planning.axis_assignment.assign_layouts`), mark what the searchers treat apart
    (:func:`_mark_graph`), fix the user's layouts (:func:`_fix_user_layouts`) and a loaded strategy file's
    (:func:`_apply_strategy_file`), search (:func:`_search`), and turn the strategies into the layouts the program
    is emitted with (:func:`_emit_layouts`) and the Plan (:func:`build_plan`)."""
    dp_mode = algorithm in ("data_parallel", "stand_alone")
    # a region returns its user outputs, then the new value of every state input (the "param" inputs, first)
    n_state = sum(i.kind == "param" for i in inputs)
    n_user = len(closed.jaxpr.outvars) - n_state
    state = [(n_user + j, j) for j in range(n_state)] if n_user >= 0 else []
    traced: list[TraceResult] = []

    def trace_on(mesh: DeviceMesh) -> TraceResult:
        # the region's one operator graph: axis assignment finds where user splits meet on it, the search runs on it
        if not traced:
            traced.append(jaxpr_to_graph(closed, _device_mesh(mesh), [i.kind for i in inputs],
                                         [i.name for i in inputs], state, primitives=True))
        return traced[0]

    base = assign_layouts(closed, inputs, mode=algorithm if dp_mode else "semi_auto_parallel",
                       device_num=ctx.devices if algorithm != "stand_alone" else 1,
                       dataset_strategy=ctx.dataset_strategy, param_plans=param_plans, trace=trace_on)
    hooked_before = (dp_mode or algorithm == "follow_operands" or ctx.pipeline_stages > 1) and input_layout_hook is not None
    if hooked_before:
        hooked = list(input_layout_hook(inputs, base))
        base.user_inputs = set(base.user_inputs) | {i for i, (a, b) in enumerate(zip(hooked, base.inputs)) if a != b}
        base.inputs = hooked
    mesh = base.mesh
    cm = ctxmod.get_cost_model_context()
    params = CostParams(alpha=cm.costmodel_alpha, beta=cm.costmodel_beta, gamma=cm.costmodel_gamma,
                        device_memory_capacity=cm.device_memory_capacity, state_weight=cm.costmodel_state_weight)
    trace = trace_on(mesh)
    _mark_graph(trace.graph, n_user)
    _mark_recomputed(trace)
    roles = sum_roles(trace)             # the sums of partial sums, found once: reduced together, never scattered
    mark_scatter(trace, roles)           # the dots whose partial results the executor can reduce-scatter
    _fix_user_layouts(trace, base, inputs, algorithm)
    notes: list[str] = list(base.notes)
    load = ctx.strategy_ckpt_config.get("load_file")
    saved = load_plan(load) if load else None        # read once: applied before the search, its copies after
    if saved is not None:
        notes.append(_apply_strategy_file(load, saved, trace, inputs, mesh))
    searcher = SEARCHERS["data_parallel"] if dp_mode else SEARCHERS.get(algorithm)
    if searcher is None:
        notes.append(f"search_mode {algorithm!r} is not available yet; used sharding_propagation")
        searcher, algorithm = SEARCHERS["sharding_propagation"], "sharding_propagation"
    algo = ctxmod.get_algo_parameters()
    opts = {"fully_use_devices": algo.fully_use_devices,
            "elementwise_op_strategy_follow": algo.elementwise_op_strategy_follow}
    hold = input_layout_hook if not hooked_before else None
    result = _search(searcher, trace, params, opts, inputs, base, hold, notes)
    # partial results reduce-scattered; the ops that only pass them on laid out as their readers read them
    scattered, strategies = scattered_reductions(trace, result.strategies, params)
    if strategies != result.strategies:
        result = dataclasses.replace(result, strategies=strategies)
    summed = {(where, eid) for where, (_, found) in roles.items() for eid in found}     # in a sum of partial sums
    joined = [j for j in joined_sums(trace, strategies, params)
              if not set(j.roots) & set(scattered) and not set(j.roles) & summed]
    bodies = _plan_scan_bodies(trace, strategies, params, mesh, notes)
    layouts, eqn_out, eqn_in = _emit_layouts(trace, strategies, base, scattered)
    plan = build_plan(trace, strategies, result, params, mesh, inputs, base, notes, algorithm, scattered, roles,
                      joined, bodies)
    if saved is not None and (lost := _copies_not_given(load, saved, plan)):
        plan = dataclasses.replace(plan, notes=plan.notes + (lost,))
    eqn_scatter = {item.key: axes_by_name(item.target, mesh) for item in scattered.values()}
    eqn_joined = {}
    for j in joined:
        eqn_joined.update(j.roles)
        eqn_scatter.update((k, axes_by_name(j.target, mesh)) for k, role in j.roles.items() if role == "concat")
    body_layouts = {}
    for te in trace.eqns:          # each planned body's layouts, under its scan's path
        if (body := bodies.get(te.op)) is not None:
            eqn_out.update(body.eqn_out)
            eqn_in.update(body.eqn_in)
            eqn_scatter.update(body.eqn_scatter)
            body_layouts[(*eqn_key(te)[0], id(te.eqn))] = (body.inputs, body.outputs)
    return Planned(plan, layouts, eqn_out, eqn_in, eqn_scatter, eqn_joined, body_layouts)


@dataclass
class ScanBody:
    """A scan's body planned as a region of its own (:func:`_plan_scan_bodies`): the emitter's layouts inside it
    (keyed by the body's equations under the scan's path), the layouts it reads its inputs in and leaves its results
    in (None: where it makes them), and the price of every step."""

    eqn_out: dict
    eqn_in: dict
    eqn_scatter: dict
    inputs: list
    outputs: list
    cost: Cost


def _plan_scan_bodies(trace: TraceResult, strategies, params: CostParams, mesh: DeviceMesh, notes: list[str]
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
            body, made = _plan_body(te, in_fixed, out_fixed, params, graph.mesh, mesh)
            moved = _carry_where_made(te, op, strategies, in_fixed, out_fixed, body, params, graph, mesh)
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
                      graph, mesh):
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
        _, made = _plan_body(te, carry, free, params, graph.mesh, mesh)
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
    other, made = _plan_body(te, carry, fixed, params, graph.mesh, mesh)
    tried = dict(strategies)
    tried[op.id] = s
    before = graph_cost(graph, strategies, params, shared=True).total + body.cost.total
    after = graph_cost(graph, tried, params, shared=True).total + other.cost.total
    return (s, other, made) if after < before else None


def _plan_body(te, in_fixed: list, out_fixed: list, params: CostParams, graph_mesh: DeviceMesh, mesh
               ) -> tuple[ScanBody, list]:
    """One step of a scan's body (``op_graph.scan_body_graph``, its boundary fixed as given), every op computed
    where its operands arrive (semi_auto's follow, ``searchers.follow``), partial sums reduce-scattered where they
    are read split (``scattered_sums``), priced as :func:`build_plan` prices a region, times the scan's length.
    -> (the body, the layout each result is left in)."""
    body = scan_body_graph(te.eqn, te.path, graph_mesh, in_fixed, out_fixed)
    _mark_recomputed(body)
    roles = sum_roles(body)
    mark_scatter(body, roles)
    found = SEARCHERS["follow_operands"].search(body.graph, params, {})
    scattered, strats = scattered_reductions(body, found.strategies, params)
    base = RegionLayouts(mesh, [()] * len(body.input_ops))
    _, eqn_out, eqn_in = _emit_layouts(body, strats, base, scattered)
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
                    [axes_by_name(x, mesh) for x in in_fixed], left, cost), made


def _mark_recomputed(trace: TraceResult) -> None:
    """``Op.share_scope``: the innermost ``jax.checkpoint`` (``prevent_cse``) an op sits in, numbered from 1. A
    recomputed layer's backward reads the values the forward read, and XLA runs their redistributions again there
    (a level3 weight gathered for the forward and again for its recomputation): the program's cost shares a
    redistribution only between readers in one scope. ``Op.scanned_from``: a scan's first scanned operand (each loop
    moves its own slices, ``searchers.graph.share_key``)."""
    scopes: dict[int, int] = {}
    for te in trace.eqns:
        inner = next((e for e in reversed(te.path) if e.primitive.name in REMAT
                      and e.params.get("prevent_cse", True)), None)
        if inner is not None:
            trace.graph.ops[te.op].share_scope = scopes.setdefault(id(inner), len(scopes) + 1)
        if not te.group and te.eqn.primitive.name == "scan":
            trace.graph.ops[te.op].scanned_from = te.eqn.params["num_consts"] + te.eqn.params["num_carry"]


def _copies_not_given(load: str, saved: Plan, plan: Plan) -> str | None:
    """A note on the ops a strategy file computed in ``interleaved_parallel`` copies that this trace computes
    whole: copies are how an op's body is traced (:mod:`mshard._src.frontend.interleave`), which a file read at
    planning time cannot change; their device splits are loaded."""
    now = {o.name: o.copies for o in plan.ops}
    lost = [o.name for o in saved.ops if o.copies and now.get(o.name, o.copies) != o.copies]
    if not lost:
        return None
    return (f"strategy file {load}: {', '.join(lost)} computed in interleaved_parallel copies when saved; here whole "
            f"(their device splits are loaded). Give them the Layout again to compute them in copies.")


def _mark_graph(graph: Graph, n_user: int) -> None:
    """What the searchers treat apart: a step's backward and update (derived, free of ``fully_use_devices``), a
    returned gradient's backward (derived), what no data reaches, and the gradient all-reduces XLA merges."""
    _free_derived(graph, n_user)
    _derive_backward(graph)
    _free_data_free(graph)
    mark_merged_reductions(graph)        # a step's gradient all-reduces: XLA combines them into one


def _fix_user_layouts(trace: TraceResult, base: RegionLayouts, inputs: Sequence[InputInfo], algorithm: str) -> None:
    """Fix the ops whose layout the user (or the data-parallel default) decides: user inputs (data,
    ``parameter_plan``), every input in data_parallel / stand_alone, a parameter semi_auto slices as its first
    annotated use asks, and the marks of annotated primitive objects and shard-wrapped functions."""
    graph, mesh = trace.graph, base.mesh
    dp_mode = algorithm in ("data_parallel", "stand_alone")
    for i in range(len(inputs)):
        sliced = algorithm == "follow_operands" and inputs[i].kind == "param" and any(base.inputs[i])
        if i in base.user_inputs or sliced or dp_mode:
            op = graph.ops[trace.input_ops[i]]
            op.fixed = _strategy_from_layout(op, base.inputs[i], mesh)
    for te in trace.eqns:
        if te.group:
            _fix_group(te, graph.ops[te.op], base, mesh)
        elif te.eqn.primitive is mark_p:
            lay = base.marks.get(mark_key(te.eqn))
            if lay is not None:
                op = graph.ops[te.op]
                op.fixed = _strategy_from_layout(op, _batched(lay, te.eqn, len(op.out_dims[0])), mesh)
    _fix_marked_bodies(trace)


def _fix_marked_bodies(trace: TraceResult) -> None:
    """A primitive object traced op by op (an ``out_strategy`` keeps its output marks apart) whose body is one op
    computes as its input strategy says (MindSpore's ``in_strategy`` is how the operator computes; its
    ``out_strategy`` only redistributes the result): the body op is fixed to the layouts its fixed input marks
    give its loop dims. Before, the search chose the body's strategy freely between the marks, so a MatMul
    configured ``((2, 4), (1, 4))`` with an out_strategy could compute split ``(1, 8)``."""
    graph = trace.graph
    members: dict[int, tuple[OpNote, list[int]]] = {}
    for oid, note in _groups(trace).items():
        members.setdefault(id(note), (note, []))[1].append(oid)
    for note, oids in members.values():
        if not (any(note.out_strategy or ()) or (note.as_traced and any(note.in_strategy))):
            continue                               # traced apart for another reason: left to the search
        body = [graph.ops[o] for o in oids if graph.ops[o].kind != "mshard_mark"]
        marks = {t: graph.ops[o] for o in oids for t in graph.ops[o].outputs if graph.ops[o].kind == "mshard_mark"}
        if len(body) != 1 or body[0].fixed is not None:
            continue
        op, where, ok = body[0], {}, True
        for k, tid in enumerate(op.inputs):
            mark = marks.get(tid)
            if mark is None or mark.fixed is None:
                ok = False
                break
            given = strategy_of_layout(op, result_layout(mark, mark.fixed, 0), k, graph.mesh)
            for label, axes in zip(op.dims, given, strict=True):
                if axes and where.setdefault(label, tuple(axes)) != tuple(axes):
                    ok = False
        fixed = tuple(where.get(d, ()) for d in op.dims)
        if ok and where and is_legal(op, fixed, graph.mesh):
            op.fixed = fixed


def _apply_strategy_file(load: str, saved: Plan, trace: TraceResult, inputs: Sequence[InputInfo], mesh: DeviceMesh) -> str:
    """Fix what a saved strategy file ``saved`` (the plan read from ``strategy_ckpt_config['load_file']``, the path
    ``load``) says on ops not fixed yet: op
    strategies by op name, parameter layouts by name, and data laid out as the saved region's was; the plan's
    note on what was applied."""
    graph = trace.graph
    loaded = _on_mesh(saved, mesh)
    if loaded.mesh != mesh:
        return f"strategy file {load} is for mesh {loaded.mesh}, not {mesh}: not applied"
    applied, misfit = 0, []       # misfit: saved for other shapes (a split that does not divide here): searched
    groups = {te.op: te for te in trace.eqns if te.group}

    def fits(op, fixed) -> bool:
        if is_legal(op, fixed, mesh):
            return True
        misfit.append(op.name)
        return False
    for op in graph.ops:
        axes = loaded.graph_axes.get(op.name)
        if axes is None and op.id in groups:
            axes = _saved_group_axes(groups[op.id], op, loaded)
        if axes is not None and len(axes) == len(op.dims) and op.fixed is None and fits(op, fixed := axes_by_index(
                axes, mesh)):
            op.fixed = fixed
            applied += 1
    stored = 0
    for i, info in enumerate(inputs):     # the parameters are stored as the file says
        spec = loaded.param_specs.get(info.name) if info.kind == "param" else None
        op = graph.ops[trace.input_ops[i]]
        if spec is not None and op.fixed is None and len(spec) <= len(info.shape) and fits(
                op, fixed := _strategy_from_layout(op, dims_of(spec, len(info.shape)), mesh)):
            op.fixed = fixed
            stored += 1
        axes = loaded.graph_axes.get(op.name) if info.kind == "data" and info.strategy is None else None
        if axes is not None and len(axes) == len(op.dims) and fits(op, fixed := axes_by_index(axes, mesh)):
            op.fixed = fixed       # data laid out as the saved region's was
    note = f"strategy file {load}: {applied} op strategies and {stored} parameter layouts loaded"
    if misfit:
        note += (f"; {len(misfit)} saved for other shapes (a split that does not divide here) were searched instead: "
                 f"{', '.join(misfit[:5])}{' ...' if len(misfit) > 5 else ''}")
        warnings.warn(f"{note}. Save the file again from this network to apply all of it.", StrategyIgnoredWarning,
                      stacklevel=2)
    return note


def _on_mesh(loaded, mesh: DeviceMesh):
    """A saved plan on a mesh of the same shape and links whose axes are named otherwise (a ``Layout``'s
    ``("dp", "mp", "sp")`` against the default ``d0, d1, d2``): the same devices in the same order, so its axes
    are renamed by position. Any other mesh is returned as it is (and not applied)."""
    old = loaded.mesh
    if old == mesh or dataclasses.replace(old, names=mesh.names) != mesh:
        return loaded
    name = dict(zip(old.names, mesh.names, strict=True))
    axes = {k: [[name[a] for a in d] for d in v] for k, v in loaded.graph_axes.items()}
    specs = {k: PartitionSpec(*[None if d is None else (name[d] if isinstance(d, str) else tuple(name[a] for a in d))
                                for d in spec]) for k, spec in loaded.param_specs.items()}
    return dataclasses.replace(loaded, mesh=mesh, graph_axes=axes, param_specs=specs)


def _saved_group_axes(te, op, loaded) -> list[list[str]] | None:
    """A primitive object traced as one op here, saved op by op (an ``out_strategy`` keeps its marks and body
    apart, ``mshard._src.jaxpr.op_graph``): its loop dims' axes from the saved layouts of its input marks, which
    its scope holds first, in input order (``scope/mshard_mark``, ``scope/mshard_mark_1``, ...), checked against
    the saved strategy's split counts. None where the file holds no such op."""
    scope, _, _ = op.name.rpartition("/")
    saved = next((o for o in loaded.ops if o.name == op.name), None)
    note: OpNote = te.eqn.params["note"]
    if saved is None or note.in_dims is None:
        return None
    head = f"{scope}/mshard_mark" if scope else "mshard_mark"
    marks = [f"{head}_{k}" if k else head for k in range(len(note.in_dims))]
    if any(m not in loaded.graph_axes for m in marks):
        return None
    where: dict[str, list[str]] = {}
    for dims, m, counts in zip(note.in_dims, marks, saved.strategy, strict=False):
        lay = loaded.graph_axes[m]
        if len(lay) != len(dims) or len(counts) != len(dims):
            return None
        for letter, axes, n in zip(dims, lay, counts, strict=True):
            if letter is not None and loaded.mesh.count(axes) != n:
                return None
            if letter is not None:
                where.setdefault(letter, list(axes))
    return [where.get(d, []) for d in op.dims]


def _search(searcher, trace: TraceResult, params: CostParams, opts: dict, inputs: Sequence[InputInfo],
            base: RegionLayouts, hold: Callable | None, notes: list[str]):
    """Run ``searcher`` on the region's graph, and again where stored state must keep a layout the first search
    did not give it: optimizer state in its parameter's layout (``hold``, the step's layout hook), updated state
    in its input's (a greedy searcher's write-back ties); then marked operands read again take the layout their op
    computed them in. Appends the notes; returns the search's result."""
    graph, mesh = trace.graph, base.mesh
    result = searcher.search(graph, params, opts)
    if hold is not None:
        # a training step stores each optimizer-state leaf that mirrors a parameter in the parameter's layout (the
        # hook), whatever the search gave the leaf: held there, the search is run again, so the update computes the
        # leaf where it is stored (else the program gathers it whole to compute and slices it to store)
        searched = [result_layout(graph.ops[trace.input_ops[i]], result.strategies[trace.input_ops[i]], 0)
                    for i in range(len(inputs))]
        want = list(hold(inputs, dataclasses.replace(base, inputs=[axes_by_name(x, mesh) for x in searched])))
        held = 0
        for i, lay in enumerate(want):
            op = graph.ops[trace.input_ops[i]]
            if axes_by_name(searched[i], mesh) != lay and op.fixed is None:
                op.fixed = _strategy_from_layout(op, lay, mesh)
                held += 1
        if held:
            first = result.seconds
            result = searcher.search(graph, params, opts)
            result = dataclasses.replace(result, seconds=result.seconds + first)
            notes.append(f"optimizer state is stored in its parameter's layout: searched again with {held} state "
                         f"leaves held there")
    if searcher.ties_exactly:
        if any(op.kind == "writeback" for op in graph.ops):
            notes.append("updated state is stored in its input's layout: every write-back was tied to its input "
                         "in the search")
    elif searcher.holds_state and _hold_state(graph, result.strategies):
        # updated state is stored in its input's layout: a greedy searcher applies the writeback ties only after
        # its search, so a second search with every state input held at the layout the first one gave it prices
        # the update's layout against that (the writeback ops)
        first = result.seconds
        result = searcher.search(graph, params, opts)
        result = dataclasses.replace(result, seconds=result.seconds + first, notes=list(result.notes) + [
            "updated state is stored in its input's layout: searched again with every updated input held at the "
            "layout the first search gave it"])
    if graph.operand_ties:      # marked operands read again keep the layout their op computed them in
        tied = dict(result.strategies)
        for oid in sorted(graph.operand_ties):
            tied[oid] = operand_tied_strategy(graph, graph.ops[oid], tied) or tied[oid]
        if tied != result.strategies:
            result = dataclasses.replace(result, strategies=tied, cost=graph_cost(graph, tied, params))
    notes.extend(result.notes)
    return result


def _xla_bytes(have, want, t, mesh: DeviceMesh) -> float | None:
    """Where the executor runs a redistribution itself (``mshard._src.runtime.redistribute``): the bytes per device
    XLA's own change would have moved; else None."""
    if not cheaper_than_xla(have, want, tuple(mesh.shape)):
        return None
    return float(sum(st.moved for st in xla_reshard(have, want, tuple(mesh.shape))) * math.prod(t.shape) * t.itemsize)


def _emit_layouts(trace: TraceResult, strategies, base: RegionLayouts, scattered: dict[int, Scattered] | None = None
                  ) -> tuple[RegionLayouts, dict[EqnKey, tuple], dict[EqnKey, tuple]]:
    """The layouts the program is emitted with: every input's, every mark's (a primitive object's operands and
    results as it computes), and per equation its results' layouts and the operands it reads in another layout
    than their producer gave them (None where it reads them as they are). A primitive object whose result is
    reduce-scattered (``scattered``) holds it in the layout it is scattered to."""
    scattered = scattered or {}
    graph, mesh = trace.graph, base.mesh
    layouts = RegionLayouts(mesh, list(base.inputs), dict(base.marks), base.op_names, honour_marks=True,
                            user_inputs=set(base.user_inputs), strategy_inputs=list(base.inputs))
    for i, oid in enumerate(trace.input_ops):
        op = graph.ops[oid]
        layouts.inputs[i] = axes_by_name(result_layout(op, strategies[op.id], 0), mesh)
    eqn_out: dict[EqnKey, tuple] = {}
    eqn_in: dict[EqnKey, tuple] = {}
    # a tensor computed from constants alone (the ones a sum's gradient broadcasts, a ReLU gradient's zeros, a
    # causal mask) is priced free between layouts (graph_cost(shared=True)): the ops computing it are left
    # unconstrained and each other reader constrains it to the layout it reads, so XLA broadcasts it there; pinned
    # at its producer's layout, XLA moves it (an all-to-all and a collective-permute for a (32, 64) one)
    free = constant_tensors(graph)
    for te in trace.eqns:
        op = graph.ops[te.op]
        s = strategies[op.id]
        if te.group:               # a primitive object: its marks pin its operands and results as it computes
            for e in te.group:
                if e.primitive is mark_p:
                    idx = e.params["index"]
                    lay = operand_layout(op, s, idx) if e.params["role"] == "in" else result_layout(op, s, idx)
                    if op.id in scattered and scattered[op.id].mark is e:
                        lay = scattered[op.id].target
                    layouts.marks[mark_key(e)] = axes_by_name(lay, mesh)
            continue
        if te.eqn.primitive is mark_p:
            layouts.marks[exact_mark_key(te.eqn)] = axes_by_name(result_layout(op, s, 0), mesh)
            continue
        if op.outputs and all(t in free for t in op.outputs):
            continue
        eqn_out[eqn_key(te)] = tuple(axes_by_name(result_layout(op, s, j), mesh) for j in range(len(op.outputs)))
        ins = []
        for i, tid in enumerate(op.inputs):
            prod = graph.producer(tid)
            have = result_layout(prod, strategies[prod.id], prod.outputs.index(tid))
            want = operand_layout(op, s, i)
            moved = have != want or (tid in free and any(want))
            ins.append(axes_by_name(want, mesh) if moved and prod.kind != "const" else None)
        if op.id in scattered:     # computed per device on its operands' blocks: every layout it reads is said,
            ins = [axes_by_name(operand_layout(op, s, i), mesh) for i in range(len(op.inputs))]    # known or not
        if any(x is not None for x in ins):
            eqn_in[eqn_key(te)] = tuple(ins)
    return layouts, eqn_out, eqn_in


def build_plan(trace: TraceResult, strategies, result, params: CostParams, mesh: DeviceMesh,
               inputs: Sequence[InputInfo], base: RegionLayouts, notes: list[str], algorithm: str,
               scattered: dict[int, Scattered] | None = None, roles: dict[tuple, tuple] | None = None,
               joined: Sequence[Joined] = (), bodies: dict[int, ScanBody] | None = None) -> Plan:
    graph = trace.graph
    scattered = scattered or {}
    groups = _groups(trace)
    dead = dead_ops(graph)       # results nothing uses: XLA removes them, they cost nothing (graph_cost(shared=True))
    costs = {op.id: Cost() if op.id in dead else op_cost(op, strategies[op.id], graph, params) for op in graph.ops}
    owner: dict[int, str] = {}          # graph op id -> the plan entry it belongs to
    groups_by_name: dict[str, OpNote] = {}
    entries: dict[str, dict] = {}       # plan entry name -> its fields, in program order
    for te in trace.eqns:
        op = graph.ops[te.op]
        if te.group:
            note = te.eqn.params["note"]
            name = base.op_names.get(note.uid, note.kind)
            entries[name] = dict(kind=note.kind, strategy=_group_strategy(te, op, strategies[op.id], graph.mesh),
                                 fixed=op.fixed is not None, ids=[op.id], copies=_copies_of(note))
        elif (note := groups.get(op.id)) is not None:   # a primitive object traced op by op (not self-contained)
            name = base.op_names.get(note.uid, note.kind)
            groups_by_name[name] = note
            e = entries.setdefault(name, dict(kind=note.kind, strategy=[], fixed=False, ids=[],
                                              copies=_copies_of(note)))
            e["ids"].append(op.id)
            if te.eqn.primitive is mark_p and te.eqn.params["role"] == "in" and te.eqn.params["note"] is note:
                idx = te.eqn.params["index"]
                lay = list(axes_by_name(result_layout(op, strategies[op.id], 0), mesh))
                extra = len(lay) - len(note.in_dims[idx])
                if te.eqn.params.get("bdim") is not None and extra == 1:
                    del lay[te.eqn.params["bdim"]]         # the replica dim is not the op's
                elif extra > 0:
                    del lay[:extra]                        # batched by a vmap that did not say where: jax.vmap's
                                                           # default puts the batch dims first
                e["layouts"] = e.get("layouts", {}) | {idx: tuple(lay)}
                e["fixed"] = e["fixed"] or note.in_strategy[idx] is not None
        elif te.eqn.primitive is mark_p:
            continue
        else:
            name = te.name
            entries[name] = dict(kind=op.kind, strategy=split_counts(op, strategies[op.id], graph.mesh),
                                 fixed=op.fixed is not None, ids=[op.id])
        owner[op.id] = name
    fused = fused_reductions(trace, strategies, roles)     # partial sums the emitter adds before one all-reduce
    fused = {oid: kept for oid, kept in fused.items() if oid not in dead}
    for oid in fused:
        costs[oid] = costs[oid] + unpriced_reduction(costs[oid], params)
    rescaled, twins = {}, set()
    for oid, item in scattered.items():              # reduce-scattered where it is read (scattered_sums)
        op = graph.ops[oid]
        rescaled[oid] = unpriced_reduction(costs[oid], params)
        twin = (op.kind, tuple(op.inputs), tuple(op.in_dims), tuple(op.out_dims), strategies[oid], item.target)
        if twin not in twins:        # XLA computes two equal reductions of one value once (CSE: a batch norm's
            twins.add(twin)          # mean, and jnp.var's own)
            rescaled[oid] = rescaled[oid] + scattered_reduction_cost(op, strategies[oid], item.target, graph, params)
        costs[oid] = costs[oid] + rescaled[oid]
    left: dict[int, TensorLayout] = {}     # op id -> the layout a reduce-scatter leaves its result in
    for j in joined:                       # copies' partial sums put back, then reduce-scattered once (joined_sums)
        for oid in j.roots:
            rescaled[oid] = unpriced_reduction(costs[oid], params)
            costs[oid] += rescaled[oid]
        rescaled[j.concat] = j.cost
        costs[j.concat] = costs[j.concat] + j.cost
        left[j.last] = j.target
    left.update((oid, item.target) for oid, item in scattered.items())
    for oid, body in (bodies or {}).items():     # each step of a planned scan body
        rescaled[oid] = body.cost
        costs[oid] = costs[oid] + body.cost
    redistributions = []
    done: set = set()
    free = constant_tensors(graph)
    ran: dict = {}
    for op in graph.ops:   # redistribution into each op is charged to it, and listed on its own line
        if op.id in dead:
            continue
        for i, tid in enumerate(op.inputs):
            prod, t = graph.producer(tid), graph.tensors[tid]
            have = result_layout(prod, strategies[prod.id], prod.outputs.index(tid))
            have = left.get(prod.id, have)
            want = operand_layout(op, strategies[op.id], i)
            key = share_key(op, i, tid, have, want)      # a loop's slices are moved inside it (emit._scan_slices)
            if (key, want) in done or tid in free:
                continue           # XLA reshards a value once per layout (the first reader is charged; a recomputed
                                   # layer's readers again), and re-broadcasts a tensor computed from constants
                                   # alone where it is read
            done.add((key, want))
            reused = reshard_once(ran, key, have, want, graph.mesh)    # XLA runs a collective on a value once
            c = redistribution_cost(have, want, t.shape, t.itemsize, graph.mesh, params, reused)
            costs[op.id] = costs[op.id] + c
            if have != want and prod.kind != "const" and op.id in owner:
                redistributions.append(Redistribution(
                    owner[op.id], i, t.shape, tuple(graph.mesh.count(a) for a in have),
                    tuple(graph.mesh.count(a) for a in want), axes_by_name(have, mesh), axes_by_name(want, mesh),
                    {k: float(v) for k, v in c.comm_bytes.items() if v}, reused,
                    _xla_bytes(have, want, t, graph.mesh)))
    for name, e in entries.items():       # traced op by op: its inputs' layouts merged into one strategy
        if "layouts" in e:
            e["strategy"] = _merged_strategy(groups_by_name[name], e["layouts"], mesh)
    plan_ops = tuple(PlanOp(name, e["kind"], tuple(tuple(x) for x in e["strategy"]), e["fixed"],
                            PlanCost.of(Cost.sum([costs[i] for i in e["ids"]])), tuple(e["ids"]),
                            e.get("copies", ()))
                     for name, e in entries.items())
    _check_reported(trace, plan_ops, mesh)
    param_specs = {}
    for i, info in enumerate(inputs):
        if info.kind == "param":
            op = graph.ops[trace.input_ops[i]]
            param_specs[info.name] = spec_of(axes_by_name(result_layout(op, strategies[op.id], 0), mesh))
    graph_axes = {op.name: [list(ax) for ax in axes_by_name(strategies[op.id], mesh)] for op in graph.ops
                  if not op.is_source or op.kind == "data"}
    program = Cost.sum([graph_cost(graph, strategies, params, shared=True, scatter=False)]  # what the program runs
                       + [unpriced_reduction(op_cost(graph.ops[i], strategies[i], graph, params), params)
                          for i in fused] + list(rescaled.values()))
    return Plan(mesh, plan_ops, param_specs, PlanCost.of(program), algorithm, result.seconds, tuple(notes),
                graph_axes, tuple(redistributions), _Explainer(graph, strategies, params, mesh),
                peak_bytes=peak_memory(graph, strategies, fused=True)[0])


def _copies_of(note: OpNote) -> tuple[tuple[int, ...], ...]:
    """A primitive object's ``interleaved_parallel`` copies per input dim (:class:`~mshard.Layout`), or ()."""
    if not any(st is not None and st.copies is not None for st in note.in_strategy):
        return ()
    return tuple(st.copies if st is not None and st.copies is not None else (1,) * len(shape)
                 for st, shape in zip(note.in_strategy, note.in_shapes, strict=True))


def _check_reported(trace: TraceResult, plan_ops, mesh: DeviceMesh) -> None:
    """Invariant 3: every reported strategy passes the check a user's strategy passes
    (:func:`mshard._src.values.layout.check_strategy`): a primitive object's over its own dims, any other op's over its
    iteration space. A failure is a planner bug, raised, never a silent report."""
    graph = trace.graph
    entry_of = {i: p for p in plan_ops for i in p.op_ids}
    groups = _groups(trace)
    seen: set[str] = set()
    for te in trace.eqns:
        entry = entry_of.get(te.op)
        if entry is None or entry.name in seen:
            continue
        seen.add(entry.name)
        op = graph.ops[te.op]
        note = te.eqn.params["note"] if te.group else groups.get(op.id)
        if note is not None:
            shapes, dims, fixed = note.in_shapes, note.in_dims, note.fixed
        else:
            shapes, dims, fixed = [graph.tensors[t].shape for t in op.inputs], op.in_dims, op.unsplittable
        if len(entry.strategy) != len(shapes):
            continue                  # a primitive object traced op by op whose marks were not all searched
        try:
            check_strategy(entry.name, entry.kind, shapes, dims, frozenset(fixed),
                           [TensorStrategy(tuple(c)) for c in entry.strategy], mesh.size)
        except StrategyError as e:
            raise PlanError(f"mshard planner: the plan would report {entry.name} with {entry.strategy}, which is "
                            f"not a valid strategy ({e}); please report this.") from e


class _Explainer:
    def __init__(self, graph: Graph, strategies, params: CostParams, mesh: DeviceMesh):
        self.graph, self.strategies, self.params, self.mesh = graph, strategies, params, mesh

    def local(self, op, s):
        """The op's own cost plus redistribution against its decided neighbours, under strategy ``s``."""
        g, st = self.graph, self.strategies
        c = op_cost(op, s, g, self.params)
        for i, tid in enumerate(op.inputs):
            prod, t = g.producer(tid), g.tensors[tid]
            c = c + redistribution_cost(result_layout(prod, st[prod.id], prod.outputs.index(tid)),
                                        operand_layout(op, s, i), t.shape, t.itemsize, g.mesh, self.params)
        for j, tid in enumerate(op.outputs):
            t = g.tensors[tid]
            for cid in dict.fromkeys(t.consumers):
                cons = g.ops[cid]
                for i, x in enumerate(cons.inputs):
                    if x == tid:
                        c = c + redistribution_cost(result_layout(op, s, j), operand_layout(cons, st[cid], i),
                                                    t.shape, t.itemsize, g.mesh, self.params)
        return c

    def __call__(self, pop: PlanOp, alternatives: int) -> str:
        lines = [f"{pop.name} ({pop.kind}): strategy {pop.strategy}"
                 f"{' — fixed by the user' if pop.fixed else ''}"]
        for oid in pop.op_ids[:4]:
            op = self.graph.ops[oid]
            chosen = self.strategies[oid]
            c = self.local(op, chosen)
            lines.append(f"  {op.name}: loop dims {dict(op.dims)} axes "
                         f"{[list(ax) for ax in axes_by_name(chosen, self.mesh)]}: {_fmt(c)}")
            if op.fixed is not None:
                continue
            alts = []
            for s in enumerate_strategies(op, self.graph.mesh, max_candidates=256):
                if s == chosen:
                    continue
                alts.append((self.local(op, s).total, s))
            alts.sort(key=lambda a: a[0])
            for _, s in alts[:alternatives]:
                lines.append(f"    alternative {split_counts(op, s, self.graph.mesh)} axes "
                             f"{[list(ax) for ax in axes_by_name(s, self.mesh)]}: {_fmt(self.local(op, s))}")
        return "\n".join(lines)


def _fmt(c) -> str:
    comm = {k: round(v) for k, v in c.comm_bytes.items() if v}
    return f"total {c.total:.4g} (compute {c.compute:.3g} s, comm {comm} B, comm time {c.comm_time:.3g} s, " \
           f"memory {c.memory:,.0f} B)"
