"""What is marked and fixed on a region's graph before a search: the ops the searchers treat apart (a step's
backward and update, what no data reaches, recomputed scopes, a loop's slices: :func:`mark_graph`,
:func:`mark_recomputed`), the layouts the user decided (inputs, marks, primitive objects: :func:`fix_user_layouts`),
and updated state held at its input's layout (:func:`hold_state`)."""

from __future__ import annotations

from collections.abc import Sequence

from mshard._src.jaxpr.marks import OpNote, mark_p
from mshard._src.jaxpr.op_graph import REPLICA, TraceResult
from mshard._src.jaxpr.walk import REMAT
from mshard._src.planning.axis_assignment import InputInfo, RegionLayouts, mark_key
from mshard._src.planning.plan_build import primitive_groups
from mshard._src.values.layout import DimAxes, axes_by_index, replica_layout
from searchers import DeviceMesh, Graph
from searchers.graph import mark_merged_reductions, result_layout, strategy_of_layout
from searchers.strategies import is_legal


def strategy_from_layout(op, layout: DimAxes, mesh: DeviceMesh, operand: int | None = None):
    """A strategy of an op whose loop dims map 1:1 onto one tensor (source ops, marks), from axis names."""
    return strategy_of_layout(op, axes_by_index(layout, mesh), operand)


def batched(lay: DimAxes, eqn, rank: int) -> DimAxes:
    """A mark's planned layout on its traced tensor: with the replica split added where the mark was batched
    over data-parallel replicas (:func:`mshard._src.runtime.emit.replica_layout`)."""
    bdim = eqn.params.get("bdim")
    if bdim is not None and len(lay) == rank - 1:
        return replica_layout(lay, bdim, eqn.params["replica_axes"])
    return lay


def fix_group(te, op, base: RegionLayouts, mesh: DeviceMesh) -> None:
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


def free_derived(graph: Graph, n_user: int) -> None:
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
    :func:`free_derived` marks a step's: MindSpore derives a backward from the forward's strategies;
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


def hold_state(graph: Graph, strategies) -> bool:
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


def mark_recomputed(trace: TraceResult) -> None:
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


def mark_graph(graph: Graph, n_user: int) -> None:
    """What the searchers treat apart: a step's backward and update (derived, free of ``fully_use_devices``), a
    returned gradient's backward (derived), what no data reaches, and the gradient all-reduces XLA merges."""
    free_derived(graph, n_user)
    _derive_backward(graph)
    _free_data_free(graph)
    mark_merged_reductions(graph)        # a step's gradient all-reduces: XLA combines them into one


def fix_user_layouts(trace: TraceResult, base: RegionLayouts, inputs: Sequence[InputInfo], algorithm: str) -> None:
    """Fix the ops whose layout the user (or the data-parallel default) decides: user inputs (data,
    ``parameter_plan``), every input in data_parallel / stand_alone, a parameter semi_auto slices as its first
    annotated use asks, and the marks of annotated primitive objects and shard-wrapped functions."""
    graph, mesh = trace.graph, base.mesh
    dp_mode = algorithm in ("data_parallel", "stand_alone")
    for i in range(len(inputs)):
        sliced = algorithm == "follow_operands" and inputs[i].kind == "param" and any(base.inputs[i])
        if i in base.user_inputs or sliced or dp_mode:
            op = graph.ops[trace.input_ops[i]]
            op.fixed = strategy_from_layout(op, base.inputs[i], mesh)
    fix_marks(trace, base)


def fix_marks(trace: TraceResult, base: RegionLayouts) -> None:
    """Fix the marks the user's strategies lay out (``base.marks``: annotated primitive objects, shard-wrapped
    functions), and the one body op of a primitive object traced op by op, on a region's graph or on a loop body's
    (:mod:`mshard._src.planning.scan_bodies`)."""
    graph, mesh = trace.graph, base.mesh
    for te in trace.eqns:
        if te.group:
            fix_group(te, graph.ops[te.op], base, mesh)
        elif te.eqn.primitive is mark_p:
            lay = base.marks.get(mark_key(te.eqn))
            if lay is not None:
                op = graph.ops[te.op]
                op.fixed = strategy_from_layout(op, batched(lay, te.eqn, len(op.out_dims[0])), mesh)
    fix_marked_bodies(trace)


def fix_marked_bodies(trace: TraceResult) -> None:
    """A primitive object traced op by op (an ``out_strategy`` keeps its output marks apart) whose body is one op
    computes as its input strategy says (MindSpore's ``in_strategy`` is how the operator computes; its
    ``out_strategy`` only redistributes the result): the body op is fixed to the layouts its fixed input marks
    give its loop dims. Before, the search chose the body's strategy freely between the marks, so a MatMul
    configured ``((2, 4), (1, 4))`` with an out_strategy could compute split ``(1, 8)``."""
    graph = trace.graph
    members: dict[int, tuple[OpNote, list[int]]] = {}
    for oid, note in primitive_groups(trace).items():
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
