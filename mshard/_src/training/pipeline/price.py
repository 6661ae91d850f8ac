"""The bytes a pipelined step moves inside its stages' ``shard_map``, from its :class:`PipelinePlan`.

The region's plan does not price the pipeline's body from the jaxpr (:mod:`mshard._src.jaxpr.manual_collectives`):
where the ``shard_map`` is manual over the stage axes only, the body's shapes are whole over the axes inside a
stage, which XLA splits further, and in any case each device runs the branches of the schedule's conditionals as the
schedule says, which the jaxpr does not. The pipeline knows what it emits and how each value is laid out inside a
stage, so it prices its own collectives, per device, by the ring formulas the cost model uses (all-reduce
``2 S (k-1)/k``, all-to-all ``S (k-1)/k``, a permute ``S``):

- every tick, each stage sends the activation it made forward and the cotangent it made backward to its
  neighbours (``run_pipeline``: two permutes per tick, idle ticks included; ``run_gpipe_keeping_residuals``: one per
  forward tick and its transpose), each device its share of the carry as the carry's in-stage layout splits it;
- the parameters a stage owns come to it whole by one all-to-all per (shape, dtype, layout) group, and their
  gradients go back by another (:mod:`mshard._src.training.pipeline.storage`); under a ``GradAccumulationCell`` the
  gather runs once for all passes, the parameters being the same in each;
- a shared parameter's gradient and the loss are summed over the stages;
- where a stage's data-parallel devices run as replicas (``PipelinePlan.replicas``: no operator strategies in the
  stages), every gradient is summed over them once, after the ticks: a shared one in the same all-reduce as over the
  stages, an owned one on the slice the stage all-to-all leaves on the device;
- otherwise XLA sums each backward's gradient over the stage's data-parallel devices in the branch that computes it
  (a partial sum cannot leave a ``lax.switch``), so every micro-batch's gradient of every parameter a virtual stage
  reads is reduced, ``M`` times per step, and every forward of the last stage reduces its loss so. These depend on
  the stage a device is in: the plan gives the busiest device's;
- a ``GradAccumulationCell`` around the pipeline runs all of this once per pass.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mshard._src.planning.plan_build import context_cost_params, manual_cost
from mshard._src.training.pipeline.run import run_gpipe_keeping_residuals
from mshard._src.values.layout import dims_of

Move = tuple[str, float, tuple[str, ...]]      # (collective kind, bytes per device, mesh axes)


def _spec_axes(spec) -> set[str]:
    """The mesh axes a PartitionSpec (or None) splits over."""
    return set() if spec is None else {a for d in dims_of(spec, len(spec)) for a in d}


def _split(spec, sizes: dict[str, int]) -> int:
    """Devices a PartitionSpec splits a value over (1 for None / unsplit)."""
    return math.prod(sizes.get(a, 1) for a in _spec_axes(spec))


def pipeline_moves(pp: Any, params: Sequence[Any], sizes: dict[str, int]) -> list[Move] | None:
    """The collectives a pipelined step's ``shard_map`` runs (module doc): ``pp`` its
    :class:`~mshard._src.training.pipeline.cells.PipelinePlan`, ``params`` the network's Param leaves (shape and
    dtype), ``sizes`` the mesh's axis sizes. None where the stages carry operator strategies (Megatron inside a
    stage): XLA then also moves activations inside each stage's branches, which this does not model (measured on
    the dp 2 x mp 2 x pp 2 GPT of tests/e2e/pipeline: 1.69 MB all-reduced and 398,336 B gathered in the stages)."""
    if pp.specs is not None and any(sp is not None and _spec_axes(sp) for sp in pp.specs):
        return None
    stage_axes = tuple(pp.stage_axes)
    S = math.prod(sizes[a] for a in stage_axes)
    sched, st = pp.sched, pp.storage
    specs = list(pp.specs) if pp.specs is not None else [None] * len(params)
    out: list[Move] = []
    # the activations handed on: each device sends its share of every carry slot
    carry = sum(int(np.prod(c.shape)) * np.dtype(c.dtype).itemsize / _split(sp, sizes)
                for c, sp in zip(pp.prog.carry, pp.carry_specs or [None] * len(pp.prog.carry)))
    gpipe = pp.runner is run_gpipe_keeping_residuals
    sends = 2 * (sched.micro + S - 1 if gpipe else sched.ticks)
    if carry:
        out.append(("collective-permute", sends * carry, stage_axes))
    # the owned parameters whole onto their stage, and their gradients back (an all-to-all each way per group)
    members: dict[int, list[int]] = {}
    for j in range(len(params)):
        if st.split(j):
            members.setdefault(st.slot[j][0], []).append(j)
    for g, ((shape, dt), n) in enumerate(zip(st.groups, st.counts)):
        spec = specs[members[g][0]] if members.get(g) else None
        whole = n * int(np.prod(shape)) * np.dtype(dt).itemsize / _split(spec, sizes)
        # the gather reads the parameters, the same in every pass of an accumulation: XLA runs it once
        out += [("all-to-all", whole * (S - 1) / S / pp.parts, stage_axes),
                ("all-to-all", whole * (S - 1) / S, stage_axes)]
    nbytes = [int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize / _split(sp, sizes) for x, sp in zip(params, specs)]
    # after the ticks: a shared parameter's gradient is summed over the stages, and with replicas inside a stage
    # (run._Replicas) every gradient is summed over them too, a shared one in the same all-reduce, an owned one on
    # the slice the stage all-to-all left on this device
    after = list(stage_axes) + list(pp.replicas)
    for j in range(len(params)):
        if not st.split(j):
            out += _reduced(nbytes[j], after, sizes)
        elif pp.replicas:
            out += _reduced(nbytes[j] / S, list(pp.replicas), sizes)
    # the loss (float32), summed likewise; JAX's backward of gpipe's forward sums its cotangent again, a constant
    # XLA sums once for all passes of an accumulation
    out += _reduced(4.0, after, sizes)
    out += _reduced(4.0 / pp.parts, after, sizes) if gpipe else []
    if not pp.replicas:
        out += _busiest_stage(pp, nbytes, specs, sizes, S)
    return [(kind, b * pp.parts, axes) for kind, b, axes in out if b]


def _busiest_stage(pp: Any, nbytes: list[float], specs: list, sizes: dict[str, int], S: int) -> list[Move]:
    """The reductions XLA runs inside a stage's branches, on the device of the stage that runs most of them: every
    backward of virtual stage ``vs`` (``M`` per step) sums the gradient of each parameter ``vs`` reads over the
    stage's data-parallel devices, and every forward of the last virtual stage sums its micro-batch loss so."""
    M, V = pp.sched.micro, S * pp.sched.chunks
    dp = _in_stage_dp_axes(pp, sizes)
    readers = pp.prog.param_readers(V)              # per parameter: the virtual stages that read it
    best: list[Move] = []
    for s in range(S):
        moves: list[Move] = []
        for vs in range(s, V, S):
            for j, who in enumerate(readers):
                if vs in who:
                    moves += _reduced(M * nbytes[j], [a for a in dp if a not in _spec_axes(specs[j])], sizes)
            if vs == V - 1:
                moves += _reduced(M * 4.0, dp, sizes)
        if sum(b for _, b, _ in moves) > sum(b for _, b, _ in best):
            best = moves
    return best


def _reduced(nbytes: float, axes: list[str], sizes: dict[str, int]) -> list[Move]:
    k = math.prod(sizes[a] for a in axes)
    return [("all-reduce", 2.0 * nbytes * (k - 1) / k, tuple(axes))] if k > 1 else []


def _in_stage_dp_axes(pp: Any, sizes: dict[str, int]) -> list[str]:
    """The axes inside a stage that split a micro-batch's rows (the data-parallel devices of a stage): the axes of
    dim 0 of the data's in-stage layouts."""
    axes: list[str] = []
    for sp in pp.data_specs or ():
        if sp is not None and len(tuple(sp)):
            axes += [a for a in dims_of(sp, len(sp))[0] if a not in axes and sizes.get(a, 1) > 1]
    return axes


def priced(plan: Any, pp: Any) -> Any:
    """``plan`` (the step region's Plan, in which the pipeline's ``shard_map`` is a boundary) with the pipeline's
    own collectives (:func:`pipeline_moves`) added to its cost, and a note that says what they are."""
    mesh = plan.mesh
    moves = pipeline_moves(pp, pp.param_avals, dict(zip(mesh.names, mesh.shape)))
    if moves is None:
        return dataclasses.replace(plan, notes=tuple(plan.notes) + (
            "pipeline: the stages carry operator strategies; the collectives XLA runs inside each stage (its "
            "model-parallel activations and gradient reductions) are not in this plan's bytes",))
    cp = context_cost_params()
    comm = dict(plan.cost.communication)
    seconds = total = 0.0
    by_kind: dict[str, float] = {}
    for move in moves:
        c = manual_cost(move, mesh, cp)
        comm[move[0]] = comm.get(move[0], 0.0) + move[1]
        by_kind[move[0]] = by_kind.get(move[0], 0.0) + move[1]
        seconds += c.comm_time
        total += c.total
    cost = dataclasses.replace(plan.cost, communication=comm, comm_time=plan.cost.comm_time + seconds,
                               total=plan.cost.total + total)
    said = ", ".join(f"{k} {v:,.0f} B" for k, v in sorted(by_kind.items()))
    where = (f"the gradients summed over the replicas {pp.replicas} once per pass" if pp.replicas else
             f"the gradient reductions XLA runs in each backward, {pp.sched.micro} per step, for the busiest stage's "
             f"devices")
    return dataclasses.replace(plan, cost=cost, notes=tuple(plan.notes) + (
        f"pipeline: its stages' own collectives, priced from the schedule ({said}; {where})",))
