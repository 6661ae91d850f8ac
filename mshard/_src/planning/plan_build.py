"""A searched region's strategies turned into what is emitted and reported: the layout of every input, mark and
equation the executor constrains (:func:`emit_layouts`), and the :class:`~mshard._src.values.plan.Plan` with its
price (:func:`build_plan`), equal to the compiled program's collectives (docs/design.md invariant 2)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from mshard._src.jaxpr.manual_collectives import region_manual_moves
from mshard._src.jaxpr.marks import OpNote, mark_p
from mshard._src.jaxpr.op_graph import TraceResult
from mshard._src.jaxpr.walk import as_jaxpr
from mshard._src.planning.axis_assignment import InputInfo, RegionLayouts, exact_mark_key, mark_key
from mshard._src.planning.fused_sums import fused_reductions, unpriced_reduction
from mshard._src.planning.joined_sums import Joined
from mshard._src.planning.scattered_sums import Scattered
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import PlanError, StrategyError
from mshard._src.values.layout import DimAxes, TensorStrategy, axes_by_name, check_strategy, spec_of
from mshard._src.values.plan import Plan, PlanCost, PlanOp, Redistribution
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
    OPAQUE_KINDS,
    UNPRICED_READERS,
    TensorLayout,
    constant_tensors,
    dead_ops,
    operand_layout,
    result_layout,
    share_key,
    split_counts,
)
from searchers.memory import peak_memory
from searchers.strategies import enumerate_strategies
from searchers.xla_reshard import reshard as xla_reshard

EqnKey = tuple[tuple[int, ...], int]


def eqn_key(te) -> EqnKey:
    return (tuple(id(e) for e in te.path), id(te.eqn))


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


def primitive_groups(trace: TraceResult) -> dict[int, Any]:
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


def _xla_bytes(have, want, t, mesh: DeviceMesh) -> float | None:
    """Where the executor runs a redistribution itself (``mshard._src.runtime.redistribute``): the bytes per device
    XLA's own change would have moved; else None."""
    if not cheaper_than_xla(have, want, tuple(mesh.shape)):
        return None
    return float(sum(st.moved for st in xla_reshard(have, want, tuple(mesh.shape))) * math.prod(t.shape) * t.itemsize)


def emit_layouts(trace: TraceResult, strategies, base: RegionLayouts, scattered: dict[int, Scattered] | None = None
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
               joined: Sequence[Joined] = (), bodies: dict[int, Cost] | None = None, manual: bool = True) -> Plan:
    """The Plan of a searched region: one entry per op (a primitive object's ops as one), each priced with the
    redistributions into it; the program's price adds the partial sums the emitter reduces itself (``fused``,
    ``scattered``, ``joined``) and every step of each planned scan body (``bodies``: the scan op id -> the body's
    price, :func:`mshard._src.planning.scan_bodies.plan_scan_bodies`), and the collectives each ``shard_map`` on the
    region mesh runs in its body (``manual``: :mod:`mshard._src.jaxpr.manual_collectives`; a loop body's plan leaves
    them to its region's, which counts them times the trip count)."""
    graph = trace.graph
    scattered = scattered or {}
    groups = primitive_groups(trace)
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
        rescaled[oid] = body
        costs[oid] = costs[oid] + body
    redistributions = []
    done: set = set()
    free = constant_tensors(graph)
    ran: dict = {}
    for op in graph.ops:   # redistribution into each op is charged to it, and listed on its own line
        if op.id in dead or op.kind in UNPRICED_READERS:
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
    moves = region_manual_moves(as_jaxpr(trace.closed_jaxpr), graph.mesh.names, graph.mesh.shape) if manual else []
    program = Cost.sum([graph_cost(graph, strategies, params, shared=True, scatter=False)]  # what the program runs
                       + [manual_cost(m, graph.mesh, params) for m in moves]
                       + [unpriced_reduction(op_cost(graph.ops[i], strategies[i], graph, params), params)
                          for i in fused] + list(rescaled.values()))
    return Plan(mesh, plan_ops, param_specs, PlanCost.of(program), algorithm, result.seconds, tuple(notes),
                graph_axes, tuple(redistributions), _Explainer(graph, strategies, params, mesh),
                peak_bytes=peak_memory(graph, strategies, fused=True)[0])


def context_cost_params() -> CostParams:
    """The cost model's constants from the cost-model context (``ms.set_cost_model_context``): one reading for the
    region's search and for whatever prices collectives beside it (a pipeline's stages)."""
    cm = ctxmod.get_cost_model_context()
    return CostParams(alpha=cm.costmodel_alpha, beta=cm.costmodel_beta, gamma=cm.costmodel_gamma,
                      device_memory_capacity=cm.device_memory_capacity, state_weight=cm.costmodel_state_weight)


def manual_cost(move, mesh: DeviceMesh, params: CostParams) -> Cost:
    """A collective a ``shard_map`` body runs (kind, bytes per device, mesh axes), priced as the cost model prices
    one: the slowest axis's latency plus the bytes over the narrowest axis's bandwidth."""
    kind, nbytes, axes = move
    idx = [mesh.names.index(a) for a in axes]
    seconds = max(mesh.latency[i] for i in idx) + nbytes / min(mesh.bandwidth[i] for i in idx)
    return Cost(0.0, {kind: nbytes}, seconds, 0.0, params.weigh(0.0, seconds, 0.0))


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
    groups = primitive_groups(trace)
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
        # a loop's or conditional's operands are independent tensors (scan_bodies._per_tensor): each is checked on
        # its own
        parts = [[i] for i in range(len(shapes))] if op.kind in OPAQUE_KINDS else [list(range(len(shapes)))]
        try:
            for part in parts:
                check_strategy(entry.name, entry.kind, [shapes[i] for i in part], [dims[i] for i in part],
                               frozenset(fixed), [TensorStrategy(tuple(entry.strategy[i])) for i in part], mesh.size)
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
