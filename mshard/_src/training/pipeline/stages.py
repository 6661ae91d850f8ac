"""Cut a network's forward (one micro-batch: parameters and data -> loss) into pipeline stage functions.

The network is traced once to a jaxpr while every call of a module that has a stage (``cell.pipeline_stage``,
``cell.pipeline_segment`` for the interleaved schedule's chunk, or ``nn.Pipeline``'s ``stage_config``) runs inside
a ``jax.named_scope`` naming its virtual stage (``segment * stages + stage``). Each top-level equation takes the
innermost stage on its name stack; an equation with none computes where its operands are (the latest stage among
them: glue between cells, the loss after the head); one that reads only parameters, data and constants (a
``jnp.arange``, a weight transpose) is recomputed by every stage that needs it. A cell that reads what a later
stage computes is an error, as is a stage with nothing in it.

Values that cross from stage ``k`` to a later one are handed on stage by stage (what stage ``k+1`` does not use
it passes through). Every stage hands the next one the same structure, the *carry*: for each (shape, dtype) the
most values of that signature any boundary needs (a GPT's boundary is one ``[micro_batch, seq, hidden]``
activation, so its carry is exactly that).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from mshard._src.jaxpr import marks as marklib
from mshard._src.jaxpr.marks import mark_p
from mshard._src.planning.axis_assignment import InputInfo, assign_layouts, exact_mark_key, mark_key
from mshard._src.training.pipeline.balance import balance
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import PipelineError

_SCOPE = "mshard_pp_stage_"
_RE = re.compile(_SCOPE + r"(\d+)_c(\d+)")


def module_stages(net: nnx.Module, stage_config: dict[str, int] | None, stages: int) -> dict[int, tuple[str, int]]:
    """``id(module) -> (path, virtual stage)`` for every module given a stage (inner modules inherit by tracing
    inside their parent's scope)."""
    out: dict[int, tuple[str, int]] = {}
    paths = {}
    for path, m in nnx.iter_graph(net):
        if not isinstance(m, nnx.Module):
            continue
        name = ".".join(map(str, path))
        paths[name] = m
        st = getattr(m, "_mshard_stage", None)
        if st is not None:
            seg = getattr(m, "_mshard_segment", 0)
            _check_stage(name, st, stages)
            out[id(m)] = (name, seg * stages + st)
    for key, st in (stage_config or {}).items():
        m = paths.get(key)
        if m is None:
            near = [p for p in paths if p and (p.endswith(key.split(".")[-1]) or key in p)][:5]
            raise PipelineError(f"nn.Pipeline stage_config: {key!r} names no cell of the network; cells include "
                                f"{near or list(paths)[:8]}. Use attribute paths such as 'blocks.0'.")
        _check_stage(key, st, stages)
        out[id(m)] = (key, getattr(m, "_mshard_segment", 0) * stages + st)
    return out


def _check_stage(name: str, st: Any, stages: int) -> None:
    if not isinstance(st, int) or isinstance(st, bool) or not 0 <= st < stages:
        raise PipelineError(f"pipeline_stage of {name or 'the network'} is {st!r}; with pipeline_stages={stages} it "
                            f"must be an int in [0, {stages - 1}]. Set ms.set_auto_parallel_context("
                            f"pipeline_stages=...) to at least {st + 1 if isinstance(st, int) else 'the stage'} + 1, "
                            f"or give this cell a smaller stage.")


class _stage_scopes:
    """While tracing: every call of a labelled module opens ``jax.named_scope('mshard_pp_stage_<label>')``."""

    def __init__(self, classes):
        self.labels: dict[int, int] = {}
        self.classes = set(classes)
        self.saved: list = []

    def __enter__(self):
        for cls in self.classes:
            orig = cls.__call__
            own = "__call__" in vars(cls)

            def call(self_, *a, _orig=orig, **k):
                label = self.labels.get(id(self_))
                if label is None:
                    return _orig(self_, *a, **k)
                with jax.named_scope(f"{_SCOPE}{label[0]}_c{label[1]}"):
                    return _orig(self_, *a, **k)
            self.saved.append((cls, orig, own))
            cls.__call__ = call
        return self

    def __exit__(self, *exc) -> None:
        for cls, orig, own in reversed(self.saved):
            if own:
                cls.__call__ = orig
            else:
                del cls.__call__


def _trace(net: nnx.Module, loss_of: Any, data_avals: Sequence[Any], by_path: dict[str, int]):
    """-> (closed jaxpr of (params, rest, *data) -> (loss, new rest), n params, n rest); every call of a module
    in ``by_path`` traced inside the scope of its label."""
    gdef, params, rest = nnx.split(net, nnx.Param, ...)
    p_leaves, p_tree = jax.tree.flatten(nnx.as_pure(params))
    r_leaves, r_tree = jax.tree.flatten(nnx.as_pure(rest))
    mods = {".".join(map(str, p)): m for p, m in nnx.iter_graph(net) if isinstance(m, nnx.Module)}
    scopes = _stage_scopes(type(mods[k]) for k in by_path)
    index = {name: i for i, name in enumerate(by_path)}

    def f(p, r, *d):
        m = nnx.merge(gdef, jax.tree.unflatten(p_tree, p), jax.tree.unflatten(r_tree, r))
        for path, sub in nnx.iter_graph(m):      # the merged copy's modules, by the same paths
            name = ".".join(map(str, path))
            if isinstance(sub, nnx.Module) and name in by_path:
                scopes.labels[id(sub)] = (by_path[name], index[name])
        loss = loss_of(m, *d)
        new_rest = jax.tree.leaves(nnx.as_pure(nnx.state(m, nnx.Not(nnx.Param))))
        return loss, new_rest

    aval = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    # traced as a region is (before the step is traced): a primitive with a strategy leaves its mark in the jaxpr
    # (for the in-stage plan) instead of running as its own sharded region
    trace = marklib.current_region() or marklib.TraceRecord(device_num=ctxmod.current().devices)
    with scopes, marklib.recording_into(trace):
        closed = jax.make_jaxpr(f)([aval(x) for x in p_leaves], [aval(x) for x in r_leaves], *data_avals)
    return closed, len(p_leaves), len(r_leaves)


def _stage_marks(closed: jcore.ClosedJaxpr, n_state: int, data_avals: Sequence[Any], stage_mesh, dataset_strategy):
    """Plan the annotated ops of one micro-batch's forward on one stage's devices; -> {mark outvar: PartitionSpec
    over the real mesh's stage-local axes, "params": the parameters' and other state's specs}."""
    if stage_mesh is None:
        raise PipelineError("pipeline: operator strategies inside stages need the step's mesh")
    mesh, axes = stage_mesh
    sizes = [mesh.shape[a] for a in axes]
    jaxpr = closed.jaxpr
    infos = [InputInfo("param", tuple(v.aval.shape), f"p{i}") for i, v in enumerate(jaxpr.invars[:n_state])]
    infos += [InputInfo("data", tuple(a.shape), f"data{i}") for i, a in enumerate(data_avals)]
    n = 1
    for z in sizes:
        n *= z
    lay = assign_layouts(closed, infos, mode="semi_auto_parallel", device_num=n, dataset_strategy=dataset_strategy)
    # each axis of the planned mesh is a run of the stage's real axes whose sizes multiply to its size
    groups, k = {}, 0
    for name, size in zip(lay.mesh.names, lay.mesh.shape):
        run, prod = [], 1
        while prod < size and k < len(axes):
            run.append(axes[k])
            prod *= sizes[k]
            k += 1
        if prod != size:
            raise PipelineError(f"pipeline: the stage's strategies plan a device matrix "
                                f"{dict(zip(lay.mesh.names, lay.mesh.shape))} that the stage's mesh axes "
                                f"{dict(zip(axes, sizes))} cannot hold; use strategies over {n} devices.")
        groups[name] = tuple(run)
    def spec(dims):
        return P(*[tuple(r for a in d for r in groups[a]) or None for d in dims])
    out = {"params": [spec(d) for d in lay.inputs[:n_state]]}
    for eqn in jaxpr.eqns:
        if eqn.primitive is not mark_p:
            continue
        got = lay.marks.get(exact_mark_key(eqn), lay.marks.get(mark_key(eqn)))
        if got is not None:
            out[eqn.outvars[0]] = spec(got)
    return out


def _marks_like(jaxpr, other: StageProgram, drop: tuple[str, ...]) -> dict[Any, Any]:
    """``other``'s marks moved to the same equations of ``jaxpr`` (a trace of the same network at other shapes),
    the axes ``drop`` removed from every PartitionSpec; {} where the two traces differ in their equations."""
    def strip(sp):
        return P(*[None if e is None else (tuple(a for a in ((e,) if isinstance(e, str) else e) if a not in drop)
                                           or None) for e in sp])
    theirs = other.closed.jaxpr.eqns
    if len(theirs) != len(jaxpr.eqns) or any(a.primitive is not b.primitive for a, b in zip(theirs, jaxpr.eqns)):
        return {}
    out: dict[Any, Any] = {"params": [strip(sp) for sp in other.marks.get("params", ())]}
    for a, b in zip(theirs, jaxpr.eqns):
        sp = other.marks.get(a.outvars[0]) if a.outvars else None
        if sp is not None:
            out[b.outvars[0]] = strip(sp)
    return out


def _annotated(jaxpr) -> list[str]:
    """The ops with a user strategy (their marks) anywhere in ``jaxpr``."""
    out: list[str] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is mark_p:
            note = eqn.params["note"]
            if any(st is not None for st in tuple(note.in_strategy) + tuple(note.out_strategy or ())):
                name = note.given_name or note.kind
                if name not in out:
                    out.append(name)
        for v in eqn.params.values():
            for j in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(j, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                    out += [n for n in _annotated(j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j) if n not in out]
    return out


def _label(eqn) -> int | None:
    """The innermost labelled cell's label (its stage) on ``eqn``'s name stack."""
    marks = _RE.findall(str(eqn.source_info.name_stack))
    return int(marks[-1][0]) if marks else None


def cell_of(eqn) -> int | None:
    """The innermost labelled cell (its index in the labelling ``by_path``) on ``eqn``'s name stack."""
    marks = _RE.findall(str(eqn.source_info.name_stack))
    return int(marks[-1][1]) if marks else None


def eqn_flops(eqn) -> float:
    """Forward cost of one equation: 2 * output * contraction for a dot_general, else its output size."""
    out = sum(_prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
    if eqn.primitive.name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        k = _prod(eqn.invars[0].aval.shape[d] for d in lc)
        return 2.0 * out * k
    inner = [v for v in eqn.params.values() if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))]
    if inner:
        j = inner[0].jaxpr if isinstance(inner[0], jcore.ClosedJaxpr) else inner[0]
        return sum(eqn_flops(e) for e in j.eqns) * float(eqn.params.get("length", 1))
    return float(out)


def _units(net: nnx.Module) -> list[str]:
    """The cells a stage helper may place: descend from the network while one child holds every parameter, then
    the children of that cell (a GPT's embeddings, blocks, final norm and head). Containers that are not called
    (``nnx.List``, ``nnx.Dict``) are looked through."""
    mods = [(".".join(map(str, p)), m) for p, m in nnx.iter_graph(net)
            if isinstance(m, nnx.Module) and (not p or _callable(m))]

    def children(path):
        inside = [(q, m) for q, m in mods if q != path and (not path or q.startswith(path + "."))]
        return [q for q, m in inside if not any(r != q and q.startswith(r + ".") for r, _ in inside)
                and jax.tree.leaves(nnx.state(m, nnx.Param))]

    path = ""
    while True:
        kids = children(path)
        if len(kids) != 1:
            return kids
        path = kids[0]


def _callable(m: nnx.Module) -> bool:
    return any("__call__" in vars(c) for c in type(m).__mro__ if c not in (nnx.Module, object))


def auto_stages(net: nnx.Module, loss_of: Any, data_avals: Sequence[Any], stages: int) -> tuple[dict[str, int], list[float]]:
    """The stage helper: ``(cell path -> stage, forward FLOPs per stage)`` from :func:`balance` over the cells of
    :func:`_units` priced by their ops' forward FLOPs, in the order the forward calls them."""
    units = _units(net)
    if len(units) < stages:
        raise PipelineError(f"pipeline_stages={stages}: the network has {len(units)} cells to place ({units}); give "
                            f"cells a pipeline_stage by hand, or use fewer stages.")
    closed, _, _ = _trace(net, loss_of, data_avals, {u: i for i, u in enumerate(units)})
    cost = [0.0] * len(units)
    first: dict[int, int] = {}
    for j, eqn in enumerate(closed.jaxpr.eqns):
        u = _label(eqn)
        if u is not None:
            cost[u] += eqn_flops(eqn)
            first.setdefault(u, j)
    order = sorted(first, key=first.get)
    st = balance([cost[u] for u in order], stages)
    assign = {units[u]: s for u, s in zip(order, st)}
    per = [sum(cost[u] for u, s in zip(order, st) if s == k) for k in range(stages)]
    return assign, per


@dataclass
class StageProgram:
    """The traced forward cut into ``V`` stages (module doc)."""

    closed: jcore.ClosedJaxpr          # (params..., rest..., data...) -> loss
    n_params: int
    n_rest: int
    stage: list[int]                   # per top-level equation: its virtual stage, -1 = recomputed where needed
    needs: list[list[int]]             # per stage: the -1 equations it evaluates
    boundary: list[list[Any]]          # boundary k (stage k -> k+1): the vars crossing it
    slots: list[tuple[tuple[int, ...], Any]]      # the carry: (shape, dtype) per slot
    slot_of: list[list[int]]           # per boundary, the slot of each var
    V: int
    auto: dict[str, int]               # the stage helper's assignment (cell path -> stage), when it made one
    auto_costs: list[float]            # and its forward FLOPs per stage
    marks: dict[Any, Any]              # an annotated op's mark var -> its PartitionSpec inside the stage
    mesh: Any = None
    cells: dict[str, int] | None = None    # cell path -> virtual stage

    @property
    def carry(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(s, d) for s, d in self.slots]

    def param_readers(self, stages: int) -> list[set[int]]:
        """Per parameter: the physical stages (virtual stage mod ``stages``) whose equations read it, counting
        the equations each stage recomputes (a weight transpose read by the stage that needs it)."""
        jaxpr = self.closed.jaxpr
        index = {v: j for j, v in enumerate(jaxpr.invars[:self.n_params])}
        out: list[set[int]] = [set() for _ in range(self.n_params)]
        for vs in range(self.V):
            todo = set(self.needs[vs]) | {j for j, st in enumerate(self.stage) if st == vs}
            for j in todo:
                for v in jaxpr.eqns[j].invars:
                    k = index.get(v) if isinstance(v, jcore.Var) else None
                    if k is not None:
                        out[k].add(vs % stages)
        return out

    def activation_bytes(self) -> list[int]:
        """Bytes handed across each boundary (one micro-batch)."""
        return [sum(int(jnp.dtype(v.aval.dtype).itemsize) * int(_prod(v.aval.shape)) for v in b)
                for b in self.boundary]

    def stage_fn(self, vs: int, params: Sequence[Any], rest: Sequence[Any], carry: Sequence[Any], data: Sequence[Any]):
        """Run virtual stage ``vs`` -> (carry out, loss (0 but on the last stage))."""
        jaxpr = self.closed.jaxpr
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]
        for v, x in zip(jaxpr.constvars, self.closed.consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, list(params) + list(rest) + list(data)):
            env[v] = x
        if vs > 0:
            for v, sl in zip(self.boundary[vs - 1], self.slot_of[vs - 1]):
                env[v] = carry[sl]
        todo = set(self.needs[vs]) | {j for j, st in enumerate(self.stage) if st == vs}
        for j, eqn in enumerate(jaxpr.eqns):
            if j not in todo:
                continue
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*[read(v) for v in eqn.invars], **eqn.primitive.get_bind_params(eqn.params))
            spec = self.marks.get(eqn.outvars[0])
            if spec is not None:
                out = jax.lax.with_sharding_constraint(out, spec)     # inside the shard_map: its mesh
            for v, x in zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]):
                env[v] = x
        if vs == self.V - 1:
            return tuple(jnp.zeros(s, d) for s, d in self.slots), read(jaxpr.outvars[0]).astype(jnp.float32)
        out = [jnp.zeros(s, d) for s, d in self.slots]
        for v, sl in zip(self.boundary[vs], self.slot_of[vs]):
            out[sl] = read(v)
        return tuple(out), jnp.zeros((), jnp.float32)


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def cut(net: nnx.Module, loss_of: Any, data_avals: Sequence[Any], *, stages: int, chunks: int,
        stage_config: dict[str, int] | None = None, stage_mesh: tuple[Any, tuple[str, ...]] | None = None,
        dataset_strategy: Any = "data_parallel", marks_like: tuple[StageProgram, tuple[str, ...]] | None = None
        ) -> StageProgram:
    """Trace ``loss_of(net, *data)`` for one micro-batch and cut it into ``stages * chunks`` virtual stages.

    ``stage_mesh = (jax mesh, the axes of one stage)``: where the cells carry operator strategies, they are planned
    on one stage's devices (semi_auto's axis assignment, ``axis_assignment.assign_layouts``, on a mesh of those
    axes) and every annotated op is constrained to its planned layout inside the stage.

    ``marks_like = (program, axes)``: the annotated ops take the layouts ``program`` (the same network cut at other
    row counts: one data-parallel replica's rows here, the whole micro-batch's there) planned for the op in the
    same place, without ``axes`` (the replica axes, manual where this program runs), instead of being planned."""
    V = stages * chunks
    staged = module_stages(net, stage_config, stages)
    auto: dict[str, int] = {}
    costs: list[float] = []
    if not staged:
        if chunks > 1:
            raise PipelineError("pipeline_interleave needs every cell's pipeline_stage and pipeline_segment set; "
                                "the stage helper places cells on stages only for the non-interleaved schedules.")
        auto, costs = auto_stages(net, loss_of, data_avals, stages)
    by_path = {name: st for name, st in staged.values()} if staged else auto
    closed, n_p, n_r = _trace(net, loss_of, data_avals, by_path)
    jaxpr = closed.jaxpr
    rest_in = jaxpr.invars[n_p:n_p + n_r]
    loss_var, rest_out = jaxpr.outvars[0], jaxpr.outvars[1:]
    changed = [i for i, (a, b) in enumerate(zip(rest_in, rest_out)) if a is not b]
    if changed:
        raise PipelineError(f"PipelineCell: the network updates {len(changed)} state leaves that are not parameters "
                            f"(BatchNorm statistics or dropout RNG counts) in its forward; pipeline stages do not "
                            f"carry such updates yet. Put the cells in eval mode (cell.set_train(False)) or remove "
                            f"them from the pipelined network.")
    closed = jcore.ClosedJaxpr(jaxpr.replace(outvars=[loss_var]), closed.consts)
    if marks_like is not None:
        marks = _marks_like(closed.jaxpr, *marks_like)
    else:
        marks = _stage_marks(closed, n_p + n_r, data_avals, stage_mesh, dataset_strategy) if _annotated(jaxpr) else {}
    jaxpr = closed.jaxpr
    producer: dict[Any, int] = {}
    stage: list[int] = []
    for j, eqn in enumerate(jaxpr.eqns):
        own = _label(eqn)
        ins = [stage[producer[v]] for v in eqn.invars if isinstance(v, jcore.Var) and v in producer]
        after = max(ins, default=-1)
        if own is not None and after > own:
            raise PipelineError(f"pipeline: an op of stage {own} ({eqn.primitive.name} at "
                                f"{eqn.source_info.name_stack}) uses a value computed on the later stage {after}; "
                                f"stages must run in order: give the cells that compute it a stage <= {own}.")
        stage.append(own if own is not None else after)
        for v in eqn.outvars:
            producer[v] = j
    used = {st for st in stage if st >= 0}
    empty = [k for k in range(V) if k not in used]
    if empty:
        raise PipelineError(f"pipeline: stage(s) {empty} of {V} have no cell; every stage needs at least one "
                            f"(assigned: {sorted(used)}). Give cells the stages 0..{V - 1}, or lower pipeline_stages.")
    # where each value is used: the stages of its consumers (the loss: the last stage)
    users: dict[Any, set[int]] = {}
    for j, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jcore.Var) and v in producer:
                users.setdefault(v, set()).add(stage[j])
    users.setdefault(loss_var, set()).add(V)
    # -1 equations: recomputed by every stage that needs them (transitively)
    needs: list[list[int]] = []
    for k in range(V):
        want = {v for j, eqn in enumerate(jaxpr.eqns) if stage[j] == k for v in eqn.invars
                if isinstance(v, jcore.Var)}
        if k == V - 1:
            want.add(loss_var)
        picked: set[int] = set()
        for j in reversed(range(len(jaxpr.eqns))):
            eqn = jaxpr.eqns[j]
            if stage[j] == -1 and any(v in want for v in eqn.outvars):
                picked.add(j)
                want.update(v for v in eqn.invars if isinstance(v, jcore.Var))
        needs.append(sorted(picked))
    boundary: list[list[Any]] = []
    for k in range(V - 1):
        cross = [v for j, eqn in enumerate(jaxpr.eqns) if 0 <= stage[j] <= k for v in eqn.outvars
                 if any(u > k for u in users.get(v, ()))]
        boundary.append(cross)
    slots: list[tuple[tuple[int, ...], Any]] = []
    slot_of: list[list[int]] = []
    for cross in boundary:
        taken: list[int] = []
        for v in cross:
            sig = (tuple(v.aval.shape), v.aval.dtype)
            free = [i for i, s in enumerate(slots) if s == sig and i not in taken]
            if not free:
                slots.append(sig)
                free = [len(slots) - 1]
            taken.append(free[0])
        slot_of.append(taken)
    return StageProgram(closed, n_p, n_r, stage, needs, boundary, slots, slot_of, V, auto, costs, marks,
                        stage_mesh[0] if stage_mesh else None, dict(by_path))
