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
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from mshard._src.jaxpr.marks import OpNote
from mshard._src.jaxpr.op_graph import TraceResult, jaxpr_to_graph
from mshard._src.planning.axis_assignment import InputInfo, RegionLayouts, assign_layouts
from mshard._src.planning.fused_sums import sum_roles
from mshard._src.planning.joined_sums import joined_sums
from mshard._src.planning.plan_build import EqnKey, build_plan, context_cost_params, emit_layouts, eqn_key
from mshard._src.planning.prepare import (
    fix_user_layouts,
    hold_state,
    mark_graph,
    mark_recomputed,
    strategy_from_layout,
)
from mshard._src.planning.scan_bodies import clear_bodies, plan_scan_bodies
from mshard._src.planning.scattered_sums import mark_scatter, scattered_reductions
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import ContextError, StrategyIgnoredWarning
from mshard._src.values.layout import DimAxes, axes_by_index, axes_by_name, dims_of
from mshard._src.values.plan import Plan, load_plan
from searchers import DeviceMesh
from searchers.cost import CostParams, graph_cost
from searchers.graph import OPAQUE_KINDS, operand_tied_strategy, result_layout, tied_strategy
from searchers.protocol import SEARCHERS, register
from searchers.strategies import is_legal


def register_searcher(name: str, fn: Callable, **capabilities) -> None:
    """A new search_mode (:func:`searchers.protocol.register`: ``ties_exactly``, ``holds_state``, ``options``)."""
    register(name, fn, **capabilities)


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
    (:func:`mark_graph`), fix the user's layouts (:func:`fix_user_layouts`) and a loaded strategy file's
    (:func:`_apply_strategy_file`), search (:func:`_search`), and turn the strategies into the layouts the program
    is emitted with (:func:`emit_layouts`) and the Plan (:func:`build_plan`)."""
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
    params = context_cost_params()
    trace = trace_on(mesh)
    mark_graph(trace.graph, n_user)
    mark_recomputed(trace)
    roles = sum_roles(trace)             # the sums of partial sums, found once: reduced together, never scattered
    mark_scatter(trace, roles)           # the dots whose partial results the executor can reduce-scatter
    fix_user_layouts(trace, base, inputs, algorithm)
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
    result, scattered, strategies, joined, bodies = _searched(searcher, trace, params, opts, inputs, base, hold,
                                                              roles, notes)
    layouts, eqn_out, eqn_in = emit_layouts(trace, strategies, base, scattered)
    plan = build_plan(trace, strategies, result, params, mesh, inputs, base, notes, algorithm, scattered, roles,
                      joined, {oid: b.cost for oid, b in bodies.items()})
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
            for k, lay in body.marks.items():      # a mark inside the body: where the body's plan lays it out
                layouts.marks.setdefault(k, lay)
            body_layouts[(*eqn_key(te)[0], id(te.eqn))] = (body.inputs, body.outputs)
            body_layouts.update(body.nested)          # the loops inside it
    return Planned(plan, layouts, eqn_out, eqn_in, eqn_scatter, eqn_joined, body_layouts)


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
                op, fixed := strategy_from_layout(op, dims_of(spec, len(info.shape)), mesh)):
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


def _searched(searcher, trace: TraceResult, params: CostParams, opts: dict, inputs: Sequence[InputInfo],
              base: RegionLayouts, hold: Callable | None, roles: dict, notes: list[str]):
    """The search (:func:`_search`), the partial results it reduce-scatters or joins, and each loop's body planned
    (:func:`mshard._src.planning.scan_bodies.plan_scan_bodies`). Where a body's plan moved its loop's boundary
    (constants read where they arrive, a carry kept where the body leaves it), the searcher ran without knowing
    it: the region is searched once more with those loops fixed there, so the ops after a loop read its results
    where it leaves them. -> (result, scattered, strategies, joined, bodies)."""
    graph = trace.graph
    clear_bodies()
    wide = _wide_loops(graph)
    if wide:
        notes.append(f"{len(wide)} loop(s) with more strategies than a searcher enumerates (a loop over a whole "
                     f"network's parameters and gradients): searched whole, then their boundary set after the search")
    kept: set[int] = set()        # the wide loops whose boundary moved: fixed there, as any moved loop
    try:
        return _searched_loops(searcher, trace, params, opts, inputs, base, hold, roles, notes, wide, kept)
    finally:
        clear_bodies()
        for oid in set(wide) - kept:
            graph.ops[oid].fixed = None


# A scan op's strategies are every placement of the mesh axes on its loop dims, one set per operand (its constants
# and carry are independent tensors): (D + 1) ** axes for D loop dims. A gradient accumulation over a network reads
# every parameter and carries every gradient (a 2-block GPT: 142 dims, 2.9 million strategies on a (2, 2, 2) mesh,
# which took the searchers minutes and GBs to price). A while's or a cond's the same (each operand and result its
# own dims): the transposed cond of a differentiated branch reads every residual (about 20 dims on a 2-layer MLP;
# dynamic_programming took 311 s). Past this many, the loop is searched whole and its boundary is
# set after the search (scan_bodies._boundary_where_made tries where its operands arrive, whole, and the user's
# layouts), as for any loop.
_WIDE = 4096


def _wide_loops(graph) -> list[int]:
    """The unfixed loops and conditionals (scan, while, cond) with more than ``_WIDE`` strategies, fixed whole for
    the search (their id list)."""
    out = []
    for op in graph.ops:
        if op.kind not in OPAQUE_KINDS or op.fixed is not None:
            continue
        free = sum(d not in op.unsplittable for d in op.dims)
        if (free + 1) ** len(graph.mesh.shape) > _WIDE:
            op.fixed = tuple(() for _ in op.dims)
            out.append(op.id)
    return out


def _searched_loops(searcher, trace: TraceResult, params: CostParams, opts: dict, inputs: Sequence[InputInfo],
                    base: RegionLayouts, hold: Callable | None, roles: dict, notes: list[str], wide: list[int],
                    kept: set[int]):
    """:func:`_searched`'s loop: ``wide`` loops are fixed whole for the search, and may move after it (those that
    do are added to ``kept``)."""
    graph = trace.graph
    first = 0.0
    for again in (False, True):
        result = _search(searcher, trace, params, opts, inputs, base, hold, notes if not again else [])
        result = dataclasses.replace(result, seconds=result.seconds + first)
        # partial results reduce-scattered; the ops that only pass them on laid out as their readers read them
        scattered, strategies = scattered_reductions(trace, result.strategies, params)
        if strategies != result.strategies:
            result = dataclasses.replace(result, strategies=strategies)
        summed = {(where, eid) for where, (_, found) in roles.items() for eid in found}  # in a sum of partial sums
        joined = [j for j in joined_sums(trace, strategies, params)
                  if not set(j.roots) & set(scattered) and not set(j.roles) & summed]
        strategies = dict(strategies)
        said: list[str] = []
        bodies = plan_scan_bodies(trace, strategies, params, base, said)
        moved = {oid: strategies[oid] for oid, b in bodies.items()
                 if b.moved and (graph.ops[oid].fixed is None or oid in wide)}
        if again or not moved:
            notes.extend(n for n in said if n not in notes)     # a body planned again says so once
            break
        notes.extend(said)
        for oid, s in moved.items():
            graph.ops[oid].fixed = s
            if oid in wide:
                kept.add(oid)
        first = result.seconds
        notes.append(f"searched again with {len(moved)} loop(s) fixed where their bodies read and leave their "
                     f"boundary")
    for op in graph.ops:
        # a tie (a write-back in its input's layout: the program stores updated state where it was read) holds in
        # the strategies the plan is built from, whatever step after the search moved the tied operand (measured: a
        # searched fused step's write-backs left whole while their parameters were stored split, 100,608 B of
        # gathers the plan priced and the program does not run)
        if op.follow_operand is not None and op.fixed is None:
            strategies[op.id] = tied_strategy(graph, op, strategies) or strategies[op.id]
    return dataclasses.replace(result, strategies=strategies), scattered, strategies, joined, bodies


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
                op.fixed = strategy_from_layout(op, lay, mesh)
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
    elif searcher.holds_state and hold_state(graph, result.strategies):
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
