"""Training wrappers with MindSpore's names: WithLossCell, TrainOneStepCell, GradAccumulationCell,
MicroBatchInterleaved.

>>> import jax.numpy as jnp, optax, mshard as ms
>>> from flax import nnx
>>> from mshard import nn
>>> ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True)
>>> net = nn.Dense(4, 2, rngs=nnx.Rngs(0))
>>> step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optax.sgd(0.1))
>>> loss = step(jnp.ones((16, 4)), jnp.zeros((16, 2)))
>>> step.opt_state is not None and loss.shape
()
>>> ms.reset_auto_parallel_context()

One step is one ``ms.jit`` region whose parameters are the network's and the optimizer's state. Its gradient is
the one device's gradient of the global loss (MindSpore's ``gradients_mean=True``); how it is reduced (fusion
buckets, per-replica sums, optimizer parallel) is in docs/gradients.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from mshard._src.frontend.auto_parallel import AutoParallel
from mshard._src.frontend.cell import Cell
from mshard._src.frontend.optimizers import Optimizer
from mshard._src.frontend.wrapper_cells import GradAccumulationCell, MicroBatchInterleaved, WithLossCell
from mshard._src.jaxpr import marks
from mshard._src.planning.flax_meta import ambient_mesh, creation_mesh
from mshard._src.runtime import fusion
from mshard._src.runtime.fastcall import MISS
from mshard._src.runtime.region import Region, search_algorithm
from mshard._src.training.grads import (
    _by_key,
    _drop_axes,
    _no_fusion_reason,
    _reduce_in_buckets,
    _replica_axes,
    _run_replicas,
    _value_and_grad,
    _zero_past_dim0,
)
from mshard._src.training.memory_fit import StepMemory, choose_level
from mshard._src.training.pipeline.cells import check_pipeline, pipeline_grads, pipeline_plan
from mshard._src.training.pipeline.price import priced as pipeline_priced
from mshard._src.training.step_layouts import _plan_step, _StepPlan
from mshard._src.training.zero import _zero_layouts
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import CellError, CellTypeError, CommFusionWarning, GradientsMeanWarning, StrategyError
from mshard._src.values.layout import jax_mesh, spec_of
from searchers.protocol import SEARCHERS

__all__ = ["GradAccumulationCell", "MicroBatchInterleaved", "TrainOneStepCell", "WithLossCell"]


def _warn_gradients_sum(ctx, dp: int) -> None:
    """The one warning of ``gradients_mean=False`` with data-parallel replicas (module doc: gradient semantics)."""
    if ctx.gradients_mean or not ctx.gradients_mean_explicit or dp <= 1 or ctx.parallel_mode == "stand_alone":
        return
    warnings.warn(f"gradients_mean=False (MindSpore's default) would sum the {dp} data-parallel replicas' gradients, "
                  f"{dp}x the gradient of a batch-mean loss; mshard computes the gradient of the reported loss over "
                  f"the global batch in every route (what one device computes: MindSpore's gradients_mean=True). Set "
                  f"gradients_mean=True to say so, or multiply the learning rate (or sens) by {dp} for MindSpore's "
                  f"summed update.", GradientsMeanWarning, stacklevel=4)


# -- the step ----------------------------------------------------------------------------------------
class _Runtime:
    """Per-TrainOneStepCell machinery kept outside the nnx graph: the step region and the forward probe. The step's
    plan (:meth:`plan`) is a value computed before the step is traced; the region receives it as its last
    (static) argument, so the traced step and the input-layout hook read the plan they were built for."""

    def __init__(self, name: str):
        self.region = Region(self.step_fn, name=name, input_layout_hook=self.hook, donate_params=True,
                             memory_kind_hook=self.memory_kinds, compiler_options_hook=self.compiler_options)
        self.probe = Region(lambda *a: a[-1](*a[:-1]), name=f"{name}.forward", strategy_file=False)
        self.last: _StepPlan | None = None    # the plan of the latest step run through the region (for reports)
        self.plans: dict = {}                 # plan() per (context stamp, network structure, shapes): computed once
        self.warned = False
        self.fast: Callable | None = None     # repeated steps: the compiled step on the Variables' arrays

    def plan(self, cell: TrainOneStepCell, data: tuple) -> _StepPlan:
        """The step's plan for ``data``'s shapes under the current context, before the step is traced: the forward
        planned alone (mesh, data-parallel axes, parameter layouts), the fused step's replica layouts, optimizer
        parallel, and a pipeline's stage program and in-stage layouts. Computed once per context, network structure
        and shapes (the step, ``lower``, ``plan`` and ``place`` share it: a pipeline's cut traces the network)."""
        net = cell.network
        names, params = _param_names(net)
        key = (ctxmod.stamp(), nnx.graphdef(net), tuple((tuple(x.shape), str(x.dtype)) for x in params),
               tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else repr(x) for x in jax.tree.leaves(data)))
        plan = self.plans.get(key)
        if plan is None:
            if any(k[0] is not key[0] for k in self.plans):   # plans made under another context are not used again
                self.plans.clear()
            plan = self.plans[key] = self._fitted_plan(cell, names, params, data)
        return plan

    def _fitted_plan(self, cell: TrainOneStepCell, names, params, data) -> _StepPlan:
        """The step's plan; with a cost-model searcher, one whose predicted memory fits device_memory_capacity
        (:mod:`mshard._src.training.memory_fit`)."""
        ctx = ctxmod.current()
        net = cell.network
        searcher = SEARCHERS.get(search_algorithm(ctx) or "")
        if searcher is None or not searcher.cost_model or ctx.pipeline_stages > 1:
            return self._plan(net, names, params, data, ctx)
        def measure(plan: _StepPlan) -> StepMemory:
            # the searched step (traced and planned, not compiled; the region keeps it for the call)
            stored = self.region.state_bytes(*data, cell, plan)
            plan.memory = StepMemory(sum(v for k, v in stored.items() if k.startswith("network.")),
                                     sum(v for k, v in stored.items() if k.startswith("optimizer.")),
                                     self.region.plan(*data, cell, plan).peak_bytes)
            return plan.memory

        def plan_with(c) -> _StepPlan:
            plan = self._plan(net, names, params, data, c)
            plan.optimizer_level = c.parallel_optimizer_config.get("optimizer_level", "level1") \
                if c.enable_parallel_optimizer else None
            return plan
        capacity = ctxmod.get_cost_model_context().device_memory_capacity
        plan, notes = choose_level(ctx, capacity, plan_with, measure)
        plan.notes = plan.notes + list(notes)
        return plan

    def _plan(self, net, names, params, data, ctx) -> _StepPlan:
        check_pipeline(ctx, net)
        plan = _plan_step(self.probe, data, net, ctx)
        plan.accumulated = isinstance(net, GradAccumulationCell)
        if search_algorithm(ctx) is not None and (not fusion.is_default(ctx) or plan.tied or plan.accumulated):
            # a searched step with a fusion setting or a tied parameter runs its data-parallel replicas side by
            # side (see _replica_axes): every parameter is whole over the replicas, in its layout on the other axes
            rax = _replica_axes(plan, ctx)
            plan.param_layouts = {k: _drop_axes(v, rax) for k, v in plan.param_layouts.items()}
        zero_plan = plan
        if ctx.pipeline_stages > 1:
            pp = plan.pipeline = pipeline_plan(net, data, plan.mesh, ctx)
            plan.pipeline_report = pp.report
            # the parameters and their optimizer state are stored as the stages use them (a parameter one stage
            # owns split over the stage axes, mshard._src.training.pipeline.storage), and the gradients leave the stages so
            plan.param_layouts.update(zip(names, pp.dims))
            plan.pipeline_layouts = True
            # optimizer parallel shards over the data-parallel axes inside a stage (the same dicts are filled)
            zero_plan = dataclasses.replace(plan, dp_axes=tuple(a for a in plan.dp_axes if a not in pp.stage_axes))
        if ctx.enable_parallel_optimizer and ctx.parallel_mode != "stand_alone":
            _zero_layouts(zero_plan, list(zip(names, params)), ctx)
            plan.store_sharded = zero_plan.store_sharded    # level3 under stages: set on the copy, stored by plan
            level3 = bool(plan.store_sharded and plan.zero and fusion.is_default(ctx))
            if level3 or _zero_past_dim0(plan):
                # level3 with no fusion setting: XLA gathers each weight where a layer reads it (the replicas of the
                # bucketed step would each hold every weight whole); a shard on dim 1: the buckets shard dim 0
                plan.pure_dp = False
                if level3:
                    plan.notes.append("optimizer_level level3: each weight is gathered where a layer reads it and "
                                      "its gradient reduced to its shard by XLA, one layer at a time (a comm_fusion "
                                      "setting gathers and reduces in its buckets instead, every weight at once)")
        else:
            for nm, x in zip(names, params):
                plan.info[nm] = {"shape": tuple(x.shape), "layout": plan.param_layouts.get(nm), "sharded": False,
                                 "reason": "enable_parallel_optimizer is False"}
        if plan.pipeline is None and not plan.pure_dp and _no_fusion_reason(plan, ctx) is None:
            # the fused step's data-parallel replicas (the traced step falls back to XLA's reductions, with a
            # CommFusionWarning, where the strategies do not fit one replica's share of the batch)
            plan.replicas = _replica_axes(plan, ctx)
            if plan.tied and fusion.is_default(ctx):
                plan.notes.append(f"tied parameters {', '.join(plan.tied)}: each data-parallel replica (over "
                                  f"{plan.replicas}) adds its gradient contributions, and the sum is reduced once")
            if plan.accumulated and fusion.is_default(ctx):
                plan.notes.append(f"GradAccumulationCell: each data-parallel replica (over {plan.replicas}) "
                                  f"accumulates its gradient over the micro-batches, and the sum is reduced once")
        return plan

    # traced once per (shapes, context): fn(*data, cell, plan)
    def step_fn(self, *args):
        *data, cell, plan = args
        data = tuple(data)
        plan = dataclasses.replace(plan)      # what tracing decides (the fused replicas) stays in this trace
        ctx = ctxmod.current()
        _warn_gradients_sum(ctx, plan.pipeline.dp if plan.pipeline is not None else plan.dp)
        net, opt = cell.network, cell.optimizer
        names, params = _param_names(net)
        ptree = jax.tree.structure(nnx.as_pure(nnx.state(net, nnx.Param)))
        token = None
        if plan.pipeline is not None:
            loss, grads = self._pipeline_grads(net, data, plan, names, ctx)
        elif plan.pure_dp:
            loss, grads, token = self._pure_dp_grads(net, data, plan, names, params, ctx)
        else:
            why = _no_fusion_reason(plan, ctx)
            if why is None:
                try:
                    loss, grads, token = self._replica_grads(net, data, plan, names, ctx)
                except StrategyError as e:        # a strategy that does not fit one replica's share of the batch
                    why = f"the strategies do not fit one replica's share of the batch ({e})"
                    plan.replicas = ()
            if why is not None:
                if not fusion.is_default(ctx) and not self.warned and plan.dp > 1:
                    self.warned = True
                    warnings.warn(f"TrainOneStepCell: comm_fusion/all_reduce_fusion_config not applied: {why}; XLA "
                                  "places and fuses this step's gradient reductions.", CommFusionWarning, stacklevel=3)
                loss, grads = self._global_grads(net, data, plan, names, ctx)
        if cell.sens != 1.0:
            grads = [g * cell.sens for g in grads]
        new_params = self._update(opt, plan, names, params, grads, ptree, token)
        nnx.update(net, new_params)
        return loss

    def _pure_dp_grads(self, net, data, plan: _StepPlan, names, params, ctx):
        """MindSpore's data-parallel gradient: each replica's gradient of its own loss, summed in fusion buckets."""
        mesh = jax_mesh(plan.mesh)
        dp = plan.dp
        # data_parallel ignores strategies (the forward region warned): a replica runs its slice of the batch
        # without them, so a strategy written for the global batch is not checked against a replica's slice
        with marks.recording_into(None):
            losses, stacked = _run_replicas(net, data, plan.dp_axes, dp, mesh, manual=True)
        nb = [int(np.prod(x.shape[1:])) * x.dtype.itemsize for x in stacked]

        def collective(kind, key, buckets, token):
            sub = [stacked[i] for i in key]
            if kind == "allreduce":
                return fusion.all_reduce_buckets(sub, buckets, mesh, plan.dp_axes, token)
            shard_axes = plan.info[names[key[0]]]["shard_axes"]
            return fusion.reduce_scatter_buckets(sub, buckets, mesh, plan.dp_axes, shard_axes, token)
        reduced, token = _reduce_in_buckets(stacked, names, nb, plan, ctx, collective)
        reduced = [g / dp for g in reduced]       # the mean over the replicas: the gradient of the reported loss
        return jnp.mean(losses), reduced, token

    def _pipeline_grads(self, net, data, plan: _StepPlan, names, ctx):
        """A PipelineCell's gradient: its schedule run over the stage axes (:mod:`mshard._src.training.pipeline.cells`)."""
        loss, g = pipeline_grads(net, data, plan.pipeline)
        grads = list(jax.tree.leaves(g))
        mesh = jax_mesh(plan.mesh)
        if plan.pipeline_layouts:
            grads = [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_of(plan.param_layouts[nm])))
                     for x, nm in zip(grads, names)]
        for i, nm in enumerate(names):
            if nm in plan.zero:
                grads[i] = jax.lax.with_sharding_constraint(grads[i], NamedSharding(mesh, spec_of(plan.zero[nm])))
        return loss, grads

    def _global_grads(self, net, data, plan: _StepPlan, names, ctx):
        """The gradient of the global-batch loss (``jax.grad``; XLA's partitioner places the reductions)."""
        loss, g = _value_and_grad(net, data, "network")
        grads = list(jax.tree.leaves(g))
        mesh = jax_mesh(plan.mesh)
        for i, nm in enumerate(names):
            # a gradient is reduced to the layout its update runs in: the ZeRO shard, else a split parameter's own
            lay = plan.zero.get(nm) or (plan.param_layouts.get(nm) if nm in plan.scanned else None)
            if lay is not None and any(lay):
                grads[i] = jax.lax.with_sharding_constraint(grads[i], NamedSharding(mesh, spec_of(lay)))
        return loss, grads

    def _replica_grads(self, net, data, plan: _StepPlan, names, ctx):
        """A hybrid-parallel step with a fusion setting: every data-parallel replica computes the gradient of its
        own loss with the model-parallel layouts inside (``jax.vmap`` over the replicas; the strategies' marks
        become the per-replica layouts plus the replica split, :func:`mshard._src.runtime.emit.replica_layout`), and the
        gradients are summed over the replicas in ``comm_fusion``/``all_reduce_fusion_config`` buckets, each
        device reducing its own model-parallel slices (:func:`mshard.fusion.all_reduce_sharded_buckets`)."""
        mesh = jax_mesh(plan.mesh)
        rax = _replica_axes(plan, ctx)
        dp = plan.mesh.count(rax)
        if set(rax) == set(plan.mesh.names):
            # every device is a replica (no parameter split inside one): each runs its own on its slice, as a data-
            # parallel step does (a shard_map, not a vmap: vmapped, a convolution's weight gradient is a grouped
            # convolution, which the plan keeps whole, gathering the batch for it)
            with marks.recording_into(None):
                losses, stacked = _run_replicas(net, data, rax, dp, mesh, manual=True)
        else:
            with marks.replica_axes(rax):
                losses, stacked = _run_replicas(net, data, rax, dp, mesh)
        plan.replicas = rax
        lays = [plan.param_layouts.get(nm) or ((),) * (x.ndim - 1) for nm, x in zip(names, stacked)]
        local = [int(np.prod(x.shape[1:])) * x.dtype.itemsize // plan.mesh.count([a for d in lay for a in d])
                 for x, lay in zip(stacked, lays)]

        def collective(kind, key, buckets, token):
            sub, specs = [stacked[i] for i in key], [spec_of(lays[i]) for i in key]
            if kind == "allreduce":
                return fusion.all_reduce_sharded_buckets(sub, specs, buckets, mesh, rax, token)
            return fusion.reduce_scatter_sharded_buckets(sub, specs, [spec_of(plan.zero[names[i]]) for i in key],
                                                         buckets, mesh, rax, plan.info[names[key[0]]]["shard_axes"],
                                                         token)
        reduced, token = _reduce_in_buckets(stacked, names, local, plan, ctx, collective)
        # the mean over the replicas is the global-batch gradient (see the module doc)
        return jnp.mean(losses), [g / dp for g in reduced], token

    def _update(self, opt, plan: _StepPlan, names, params, grads, ptree, token):
        """optax on the (possibly ZeRO-sharded) gradients; ZeRO parameters are updated on their shard and
        gathered back to their planned layout."""
        mesh = jax_mesh(plan.mesh)
        p_in = list(params)
        for i, nm in enumerate(names):
            if nm in plan.zero:
                p_in[i] = jax.lax.with_sharding_constraint(p_in[i], NamedSharding(mesh, spec_of(plan.zero[nm])))
        p_tree = jax.tree.unflatten(ptree, p_in)
        g_tree = jax.tree.unflatten(ptree, grads)
        opt_arrays = nnx.as_pure(opt.opt_state)
        offload = _offloaded(ctxmod.current())
        if offload:                     # the state lives in host memory between steps: on the device for the update
            opt_arrays = jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), opt_arrays)
        updates, new_opt = opt.tx.update(g_tree, opt_arrays, p_tree)
        if offload:
            new_opt = jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), new_opt)
        new = jax.tree.leaves(optax.apply_updates(p_tree, updates))
        nnx.update(opt.opt_state, nnx.state(new_opt, graph=opt.graph))
        opt.step[...] += 1
        zero = [i for i, nm in enumerate(names) if nm in plan.zero]
        if zero and plan.store_sharded:         # level3: the weights stay stored in their ZeRO layout
            for i in zero:
                new[i] = jax.lax.with_sharding_constraint(new[i], NamedSharding(mesh, spec_of(plan.zero[names[i]])))
        elif zero and plan.pure_dp:
            ctx = ctxmod.current()
            nb = [int(np.prod(new[i].shape)) * new[i].dtype.itemsize for i in zero]
            groups = _by_key(zero, [(new[i].dtype, plan.info[names[i]]["shard_axes"]) for i in zero],
                             fusion.plan_buckets(nb, *fusion.fusion_setting("allgather", ctx)))
            for key, buckets in groups:
                out, token = fusion.all_gather_buckets([new[i] for i in key], buckets, mesh,
                                                       plan.info[names[key[0]]]["shard_axes"], token)
                for i, o in zip(key, out):
                    new[i] = o
        elif zero and plan.replicas:            # a fused model-parallel step: each device gathers its own slices
            ctx = ctxmod.current()
            lays = [plan.param_layouts[names[i]] for i in zero]
            nb = [int(np.prod(new[i].shape)) * new[i].dtype.itemsize // plan.mesh.count([a for d in lay for a in d])
                  for i, lay in zip(zero, lays)]
            groups = _by_key(zero, [(new[i].dtype, plan.info[names[i]]["shard_axes"]) for i in zero],
                             fusion.plan_buckets(nb, *fusion.fusion_setting("allgather", ctx)))
            for key, buckets in groups:
                out, token = fusion.all_gather_sharded_buckets(
                    [new[i] for i in key], [spec_of(plan.zero[names[i]]) for i in key],
                    [spec_of(plan.param_layouts[names[i]]) for i in key], buckets, mesh,
                    plan.info[names[key[0]]]["shard_axes"], token)
                for i, o in zip(key, out):
                    new[i] = o
        elif zero:
            for i in zero:
                lay = plan.param_layouts[names[i]]
                new[i] = jax.lax.with_sharding_constraint(new[i], NamedSharding(mesh, spec_of(lay)))
        return jax.tree.unflatten(ptree, new)

    @staticmethod
    def compiler_options(statics) -> dict | None:
        """A data-parallel level3 step on XLA:CPU compiles memory first: each weight is gathered whole where a
        layer reads it, and the CPU's default schedule (ordered for concurrency) gathers every weight before the
        first layer while its all-reduce combiner merges every layer's gradient reduction into one (every
        gradient whole at once); the memory-optimized schedule without the combiner holds about one layer at a
        time. Not where a scan runs the layers (its loop bounds them already; this schedule measured worse there),
        in semi_auto (its plans compute in the weights' shards), or on other backends (they schedule under a
        memory limit of their own). Measured in docs/gradients.md."""
        plan = statics[-1]
        if (not (plan.store_sharded and plan.zero) or jax.default_backend() != "cpu"
                or ctxmod.current().parallel_mode != "data_parallel" or any(n in plan.zero for n in plan.scanned)):
            return None
        return dict(_LEVEL3_CPU_OPTIONS)

    @staticmethod
    def memory_kinds(infos, statics):
        """The step's inputs' memory kinds: every optimizer-state leaf in host memory (``pinned_host``) under
        ``set_offload_context(offload_config={"offload_param": "cpu"})``, the rest on the device."""
        host = "pinned_host" if _offloaded(ctxmod.current()) else None
        return [host if info.name.startswith("optimizer.opt_state.") else None for info in infos]

    # after planning the step: optimizer state follows its parameter (or its ZeRO layout)
    @staticmethod
    def hook(infos, layouts, statics):
        """The step's input layouts: a pipeline's parameters in their in-stage layouts, and every optimizer-state
        leaf that mirrors a parameter in that parameter's layout (or its ZeRO layout). ``statics[-1]`` is the
        step's plan (the region's static argument); called before a data-parallel plan is made and again after
        every plan."""
        plan = statics[-1]
        inputs = list(layouts.inputs)
        idx = {info.name: i for i, info in enumerate(infos) if info.kind == "param"}
        if plan.pipeline_layouts:
            for nm, lay in plan.param_layouts.items():
                if nm in idx:
                    inputs[idx[nm]] = lay
        if plan.store_sharded:                  # level3: a ZeRO parameter is stored in its ZeRO layout (FSDP)
            for nm, lay in plan.zero.items():
                if nm in idx:
                    inputs[idx[nm]] = lay
        params = {nm[len("network."):]: idx[nm] for nm in plan.param_layouts if nm in idx}
        by_len = sorted(params, key=len, reverse=True)
        for name, j in idx.items():
            if not name.startswith("optimizer.opt_state."):
                continue
            for p in by_len:
                i = params[p]
                if name.endswith("." + p) and tuple(infos[j].shape) == tuple(infos[i].shape):
                    inputs[j] = plan.zero.get("network." + p, inputs[i])
                    break
        return inputs


# XLA:CPU options of a level3 step (TrainOneStepCell._Runtime.compiler_options)
_LEVEL3_CPU_OPTIONS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
                       "xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def _offloaded(ctx) -> bool:
    """Whether ``set_offload_context(offload_config={"offload_param": "cpu"})`` is in force."""
    return ctx.offload_config.get("offload_param") == "cpu"


def _param_names(net: nnx.Module) -> tuple[list[str], list[Any]]:
    """The step's names (``network.<path>``) and values of ``net``'s Param leaves, in flattening order."""
    pleaves = jax.tree.flatten_with_path(nnx.as_pure(nnx.state(net, nnx.Param)))[0]
    names = ["network." + ".".join(str(k.key) for k in p if isinstance(k, jax.tree_util.DictKey))
             for p, _ in pleaves]
    return names, [x for _, x in pleaves]


def _optimizer_cell_tx(network: nnx.Module, opt: Optimizer) -> optax.GradientTransformation:
    """An optimizer Cell's ``tx`` for ``network``'s Param state: as it is where the Cell holds every trained parameter;
    otherwise applied to the Cell's parameters only (``optax.masked``), the others' updates set to zero."""
    state = nnx.state(network, nnx.Param)
    is_var = lambda x: isinstance(x, nnx.Variable)
    ours = {id(p) for p in opt.parameters}
    theirs = {id(v) for v in jax.tree.leaves(state, is_leaf=is_var)}
    if not ours <= theirs:
        raise CellError(f"TrainOneStepCell: {len(ours - theirs)} of the {len(ours)} parameters of "
                        f"{type(opt).__name__} are not parameters of the network; build the optimizer from this "
                        f"network's trainable_params().")
    branches = getattr(opt, "group_branches", None)
    if branches is not None:          # group parameters: each Variable's group, the network's others frozen
        labels = jax.tree.map(lambda v: opt.group_of.get(id(v), "frozen"), state, is_leaf=is_var)
        return optax.multi_transform({**branches, "frozen": optax.set_to_zero()}, labels)
    if ours == theirs:
        return opt.tx
    mask = jax.tree.map(lambda v: id(v) in ours, state, is_leaf=is_var)
    frozen = jax.tree.map(lambda m: not m, mask)
    return optax.chain(optax.masked(opt.tx, mask), optax.masked(optax.set_to_zero(), frozen))


_RUNTIMES: weakref.WeakKeyDictionary[TrainOneStepCell, _Runtime] = weakref.WeakKeyDictionary()


class TrainOneStepCell(Cell):
    """``TrainOneStepCell(network, optimizer, sens=1.0)``: one jitted training step under the current context.

    ``network`` is a network with loss (:class:`WithLossCell`, :class:`GradAccumulationCell`, any Cell
    returning a scalar loss); ``optimizer`` an optimizer Cell (``nn.Momentum(net.trainable_params(), ...)``) or
    an optax ``GradientTransformation``. ``step(*data)`` runs the step and returns the loss; the parameters are
    updated in place. ``step.opt_state`` is the optax state (global jax.Arrays on their planned shardings).
    ``sens`` scales the gradients (MindSpore's loss-scale sensitivity). Gradients: docs/gradients.md.

    Maps to JAX as: one ``jax.jit`` (through ``ms.jit``) of ``nnx.value_and_grad`` + ``optax`` with the
    parameters and optimizer state as donated, sharded inputs. Differences from MindSpore: an optimizer Cell
    runs as its optax ``tx`` (calling it on gradients yourself is not supported yet).

    Args:
        network: the network with loss; ``network(*data)`` returns the scalar loss.
        optimizer: an optimizer Cell (``nn.SGD``, ``nn.Momentum``, ``nn.Adam``, ``nn.AdamWeightDecay``) over some or
            all of the network's ``nnx.Param``s, or an ``optax.GradientTransformation`` (e.g. ``optax.adamw(1e-3)``)
            applied to every ``nnx.Param``; an ``optax.MultiSteps`` runs as its ``gradient_transformation()``
            (the step accumulates, and applies every k calls).
        sens: the factor the gradients are scaled by (MindSpore's loss-scale sensitivity).

    >>> import jax.numpy as jnp, optax, mshard as ms
    >>> from flax import nnx
    >>> from mshard import nn
    >>> ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True)
    >>> net = nn.Dense(4, 2, rngs=nnx.Rngs(0))
    >>> step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optax.sgd(0.1))
    >>> before = net.weight[...]
    >>> step(jnp.ones((16, 4)), jnp.zeros((16, 2))).shape, bool((net.weight[...] != before).any())
    ((), True)
    >>> ms.reset_auto_parallel_context()
    """

    def __init__(self, network: nnx.Module, optimizer: Optimizer | optax.GradientTransformation | optax.MultiSteps,
                 sens: float = 1.0):
        if isinstance(optimizer, Optimizer):
            optimizer = _optimizer_cell_tx(network, optimizer)
        elif isinstance(optimizer, optax.MultiSteps):     # optax's accumulation wrapper: its transformation
            optimizer = optimizer.gradient_transformation()
        elif not isinstance(optimizer, optax.GradientTransformation):
            raise CellTypeError(f"TrainOneStepCell: optimizer must be an optimizer Cell (e.g. "
                                f"nn.Momentum(net.trainable_params(), 0.01, 0.9)), an optax GradientTransformation "
                                f"(e.g. optax.adamw(1e-3)) or an optax.MultiSteps, got {type(optimizer).__name__}.")
        self.network = network
        # flax creates moments that copy a parameter's sharding names under a mesh: the parameters' own, where
        # none is set around this call
        mesh = None if ambient_mesh() is not None else creation_mesh(network)
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            self.optimizer = nnx.Optimizer(network, optimizer, wrt=nnx.Param)
        self.sens = float(sens)

    @property
    def _rt(self) -> _Runtime:
        rt = _RUNTIMES.get(self)
        if rt is None:
            rt = _RUNTIMES[self] = _Runtime(type(self).__name__)
        return rt

    def __call__(self, *data):
        ap = next((m for _, m in nnx.iter_graph(self.network) if isinstance(m, AutoParallel)), None)
        if ap is not None:          # TrainOneStepCell(AutoParallel(net)): the whole step runs under its settings
            with ctxmod.parallel_context(**ap.settings):
                return self._step(*data)
        return self._step(*data)

    def _step(self, *data):
        rt = self._rt
        fast = rt.fast
        if fast is not None:
            out = fast(data)
            if out is not MISS:
                return out
        plan = rt.last = rt.plan(self, data)
        loss = rt.region(*data, self, plan)
        rt.fast = self._fast_step(rt.region, data, plan)
        return loss

    def _fast_step(self, region: Region, data: tuple, plan: _StepPlan) -> Callable | None:
        """Repeated steps without the region's per-call ``nnx.split``/``nnx.update`` (tens of ms for a model
        with a few hundred Variables), valid while the context, algorithm/cost-model parameters, strategy epoch
        and the data's structure, shapes and dtypes are unchanged. As MindSpore compiles a training graph once,
        Cells or Variables *assigned* to the network after the first step are not seen (values written into its
        Variables, e.g. by ``nnx.update``, are)."""
        return region.fast_path((*data, self, plan), [self], data)

    @property
    def opt_state(self) -> Any:
        """The optax state (the structure ``optimizer.init`` returned; leaves are global jax.Arrays)."""
        return nnx.as_pure(self.optimizer.opt_state)

    @property
    def parallel_optimizer_info(self) -> dict[str, dict]:
        """Per parameter path: shape, planned layout, whether its optimizer state is sharded, and why not."""
        last = self._rt.last
        return {} if last is None else dict(last.info)

    def lower(self, *data) -> jax.stages.Lowered:
        """The step's ``jax.stages.Lowered`` (``.compile().memory_analysis()``, ``.as_text()``)."""
        return self._rt.region.lower(*data, self, self._rt.plan(self, data))

    def jaxpr(self, *data) -> jax.extend.core.ClosedJaxpr:
        """The traced step (forward, backward and update) the plan is made for: what XLA is given, before the
        plan's layouts."""
        return self._rt.region.jaxpr(*data, self, self._rt.plan(self, data))

    def place(self, *data) -> None:
        """Put the parameters and optimizer state on the layouts this step's plan gives for ``data`` (plans,
        compiles nothing, runs nothing)."""
        self._rt.region.place(*data, self, self._rt.plan(self, data))

    def layouts(self, *data):
        """The planned layouts of the step's inputs (parameters, optimizer state, data)."""
        return self._rt.region.layouts(*data, self, self._rt.plan(self, data))

    def plan(self, *data):
        """The step's Plan (``plan.summary()``, ``plan.param_specs``; ``plan.pipeline`` for a PipelineCell)."""
        step_plan = self._rt.plan(self, data)
        plan = self._rt.region.plan(*data, self, step_plan)
        if step_plan.pipeline_report is not None:
            plan = dataclasses.replace(plan, pipeline=step_plan.pipeline_report)
            plan = pipeline_priced(plan, step_plan.pipeline)
        if step_plan.notes:
            plan = dataclasses.replace(plan, notes=tuple(plan.notes) + tuple(step_plan.notes))
        return plan
