"""What a training step is planned as: the forward pass planned alone gives the mesh, the data-parallel axes and
every parameter's layout (:class:`_StepPlan`) before the step itself is traced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx

from mshard._src.jaxpr.walk import input_reads, scanned_inputs
from mshard._src.runtime.region import Region, search_algorithm
from mshard._src.values.layout import DimAxes
from searchers import DeviceMesh


# -- what a step is planned as -------------------------------------------------------------------------
@dataclass
class _StepPlan:
    """Trace-time facts about one step (from the planned forward region)."""

    mesh: DeviceMesh
    dp_axes: tuple[str, ...]
    param_layouts: dict[str, DimAxes]          # "network.<path>" -> planned layout
    pure_dp: bool
    strategy_layouts: dict[str, DimAxes] = field(default_factory=dict)    # as the user's strategies lay them out
    zero: dict[str, DimAxes] = field(default_factory=dict)      # ZeRO layouts of sharded parameters
    # optimizer_level "level3": the ZeRO parameters are also stored in their ZeRO layout (FSDP), not gathered back
    store_sharded: bool = False
    replicas: tuple[str, ...] = ()      # set when a model-parallel step computes per-replica gradients (fusion)
    info: dict[str, dict] = field(default_factory=dict)
    pipeline: Any = None                # a PipelineCell's mshard._src.training.pipeline.cells.PipelinePlan
    pipeline_report: Any = None         # a PipelineCell's stages (mshard._src.training.pipeline.report.PipelineReport)
    pipeline_layouts: bool = False      # param_layouts set by a pipeline's stage plan (the region stores them so)
    memory: Any = None                  # the predicted mshard._src.training.memory_fit.StepMemory (cost-model search)
    optimizer_level: str | None = None  # the optimizer level the memory fit planned this step under (None: off)
    notes: list[str] = field(default_factory=list)     # what the memory fit chose (the step's plan shows them)
    # parameters the forward reads more than once (a tied embedding): their gradient is a sum of contributions
    # that each replica adds before the one reduction (mshard._src.training.grads._no_fusion_reason)
    tied: tuple[str, ...] = ()
    # parameters a scan reads as stacks of per-step slices (the weights of a scan over layers): their optimizer
    # shard is on dim 1, each step's slice's dim 0 (mshard._src.training.zero)
    scanned: tuple[str, ...] = ()
    # a GradAccumulationCell's step: each replica accumulates its gradient over the micro-batches and the sum is
    # reduced once, after the loop (MindSpore's accumulation; mshard._src.training.grads._no_fusion_reason)
    accumulated: bool = False

    @property
    def dp(self) -> int:
        return self.mesh.count(self.dp_axes)

    def __repr__(self) -> str:
        # the region's cache key holds this repr (the plan is the step region's static argument): every decision
        # the traced step and its input layouts depend on, and nothing of the tracing-time values
        pp = self.pipeline
        stages = None if pp is None else (pp.sched.name, pp.sched.stages, pp.sched.micro, pp.sched.chunks,
                                          pp.stage_axes, pp.parts, tuple(map(str, pp.specs or ())))
        return (f"_StepPlan(mesh={self.mesh!r}, dp_axes={self.dp_axes}, pure_dp={self.pure_dp}, "
                f"param_layouts={sorted(self.param_layouts.items())}, zero={sorted(self.zero.items())}, "
                f"store_sharded={self.store_sharded}, tied={self.tied}, scanned={self.scanned}, pipeline={stages})")


def _plan_step(probe: Region, data: tuple, net: nnx.Module, ctx) -> _StepPlan:
    """Plan the forward pass alone (cheap: traced and planned, not compiled) to learn the mesh, the data-parallel
    axes and every parameter's layout before the step itself is traced."""
    lay = probe.layouts(*data, net)
    n_state = len(jax.tree.leaves(nnx.state(net)))
    names = [n for n, _ in _named_leaves(net)]
    param_layouts = {f"network.{nm}": lay.inputs[i] for i, nm in enumerate(names)}
    by_strategy = lay.strategy_inputs or lay.inputs
    strategy_layouts = {f"network.{nm}": by_strategy[i] for i, nm in enumerate(names)}
    data_lays = lay.inputs[n_state:]
    dp_axes: tuple[str, ...] = ()
    for d in data_lays:
        if d:
            dp_axes = tuple(d[0])
            break
    replicated = all(not any(dim for dim in l) for l in param_layouts.values())
    data_ok = all(not d or (tuple(d[0]) == dp_axes and not any(d[1:])) for d in data_lays)
    marks = (ctx.parallel_mode not in ("data_parallel", "stand_alone") and lay.honour_marks
             and any(v is not None for v in lay.marks.values()))
    no_search = ctx.parallel_mode == "data_parallel" or (
        ctx.parallel_mode == "semi_auto_parallel" and search_algorithm(ctx) is None)
    pure = bool(dp_axes) and replicated and data_ok and not marks and no_search
    params = {id(x) for x in jax.tree.leaves(nnx.state(net, nnx.Param))}
    jaxpr = probe.jaxpr(*data, net).jaxpr
    named = _named_leaves(net)
    tied = tuple(f"network.{nm}" for (nm, x), n in zip(named, input_reads(jaxpr)) if n > 1 and id(x) in params)
    scanned = tuple(f"network.{nm}" for (nm, x), f in zip(named, scanned_inputs(jaxpr)) if f and id(x) in params)
    return _StepPlan(lay.mesh, dp_axes, param_layouts, pure, strategy_layouts, tied=tied, scanned=scanned)


def _named_leaves(module: nnx.Module) -> list[tuple[str, Any]]:
    """(path, leaf) of a module's state in Region order (``jax.tree.flatten_with_path`` of ``nnx.split``)."""
    _, state = nnx.split(module)
    out = []
    for path, leaf in jax.tree.flatten_with_path(state)[0]:
        parts = [str(k.key) if isinstance(k, jax.tree_util.DictKey) else str(k.idx)
                 for k in path if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.SequenceKey))]
        out.append((".".join(parts), leaf))
    return out
