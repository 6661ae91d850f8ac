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

One step is one ``ms.jit`` region (:class:`mshard.region.Region`): the network's strategies, the
plan (or the search, in auto_parallel) and the placement apply to it. Its argument is the
TrainOneStepCell itself, so the parameters *and* the optimizer state (an ``nnx.Optimizer`` holding
the optax state as nnx Variables) are the region's parameters: placed once on their planned
shardings, updated in place (their buffers are donated) and written back after each step.
Parameter paths are attribute paths from the TrainOneStepCell: ``network.backbone.dense1.weight``.
An optimizer-state leaf that mirrors a parameter (Adam's ``mu``/``nu``, momentum, ...) takes that
parameter's layout, or the optimizer-parallel layout below.

Gradient semantics (``gradients_mean``), in global-view JAX. MindSpore's data-parallel step gives
every device the gradient of *its own* loss (over its slice of the batch) and all-reduces them:
the sum of the per-replica gradients, divided by the number of replicas ``dp`` when
``gradients_mean=True``. Here the loss is one scalar over the global batch, so for a loss that is a
mean over the batch (MindSpore's ``reduction='mean'``, the usual case):

* ``gradients_mean=True``: the gradient of the global-batch loss (= the mean of the per-replica
  gradients) — what one device computes on the whole batch;
* ``gradients_mean=False`` (MindSpore's default): ``dp`` times that (= the sum of the per-replica
  gradients), so an SGD step is ``dp`` times larger than on one device.

``dp`` is the number of slices the batch is cut into (dim 0 of the data, as planned: ``device_num``
in data_parallel, the batch split of the first data input in semi/auto modes; 1 with full_batch).
In a pure data-parallel step (data_parallel, or semi_auto_parallel without strategies, with the
batch split over dim 0 and every parameter replicated) mshard computes exactly MindSpore's
quantity: each replica's gradient of its own loss (``jax.vmap`` over the replicas) and their sum,
reduced in the buckets of ``comm_fusion``/``all_reduce_fusion_config`` (:mod:`mshard.fusion`) —
identical to the above for mean losses, and MindSpore's result for any other loss. A semi_auto_parallel
step with model-parallel layouts and a fusion setting (Megatron with ``all_reduce_fusion_config``, say)
does the same per replica: the replicas are the devices every weight slice is repeated on, each computes
the gradient of its own loss with the model-parallel layouts inside (``jax.vmap``; the strategies' marks
constrain the batched tensors to their per-replica layout plus the replica split), and each device
all-reduces its own gradient slices over the replicas in the fusion buckets (with optimizer parallel:
reduce-scatters them in ``reducescatter`` buckets and gathers the updated slices in ``allgather``
buckets). A step planned by a search (auto_parallel, or a ``search_mode`` in semi_auto_parallel) with a
fusion setting does the same with the replicas being every device the searched forward splits the batch
over: a search may also split a weight over a data-parallel axis, which no replica group would then hold
whole, so in the fused step each weight is whole over the replicas (in its searched layout on the other
axes), each device all-reduces its slices over the replicas in the buckets, and the step's own search
plans everything else around the replica split and the bucket collectives (a ``shard_map`` inside a searched
region is a fixed boundary for the search: :mod:`mshard.trace`). Without a fusion setting the gradient is
``jax.grad`` of the global loss, XLA's partitioner places the reductions and its combiner fuses them; where a
fusion setting cannot be applied (a strategy that does not fit one replica's share of the batch, no mesh
axis left for replicas) the step warns (:class:`~mshard.errors.CommFusionWarning`) and does that.

Optimizer parallel (``enable_parallel_optimizer=True``, ZeRO-1): every parameter of at least
``parallel_optimizer_threshold`` KB (default 64) whose dim 0 divides gets its optimizer state,
gradient and update sharded on dim 0 over ``optimizer_weight_shard_size`` devices (-1: every
data-parallel device the parameter is replicated over). The gradient is reduce-scattered, the
update runs on the shard, and the new parameter is all-gathered (in ``comm_fusion`` buckets for
``reducescatter``/``allgather`` in a pure data-parallel step). A shard size larger than the
data-parallel size is an :class:`~mshard.errors.OptimizerParallelError`.
``step.parallel_optimizer_info`` says, per parameter, what was sharded and why not.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import annotate, fusion
from .. import context as ctxmod
from ..errors import CellError, CellTypeError, CommFusionWarning, OptimizerParallelError, StrategyError
from ..layout import DimAxes, RegionMesh, choose_axes, spec_of
from ..region import Region, raw_ok, search_algorithm
from .cell import Cell, register_paths
from .layers import per_replica as replica_context

__all__ = ["GradAccumulationCell", "MicroBatchInterleaved", "TrainOneStepCell", "WithLossCell"]


# -- the loss and micro-batch wrappers -------------------------------------------------------------
class WithLossCell(Cell):
    """``WithLossCell(backbone, loss_fn)``: ``loss_fn(backbone(*data), label)``; the label is the last input."""

    def __init__(self, backbone: nnx.Module, loss_fn: Callable):
        self.backbone = backbone
        self.loss_fn = loss_fn

    def __call__(self, *inputs):
        if len(inputs) < 2:
            raise CellTypeError(f"WithLossCell: expected (data..., label), got {len(inputs)} input(s).")
        return self.loss_fn(self.backbone(*inputs[:-1]), inputs[-1])

    @property
    def backbone_network(self) -> nnx.Module:
        return self.backbone


def _check_count(name: str, what: str, n: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise CellError(f"{name}: {what}={n!r} must be a positive int.")
    return n


def _split_rows(x, n: int, where: str):
    """``[B, ...] -> [n, B/n, ...]``; slice k holds rows k, k+n, k+2n, ... (strided, so each slice keeps
    the batch's data-parallel layout and nothing moves between devices)."""
    if not hasattr(x, "shape") or x.ndim == 0:
        return None
    if x.shape[0] % n:
        raise CellError(f"{where}: the batch dim {x.shape[0]} (input shape {tuple(x.shape)}) is not divisible by "
                         f"{n}; use a batch size that is a multiple of {n}.")
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def _prefix(cell: nnx.Module, child: str) -> str:
    trace = annotate.current_region()
    base = trace.module_paths.get(id(cell), "") if trace is not None else ""
    return f"{base}.{child}" if base else child


class GradAccumulationCell(Cell):
    """``GradAccumulationCell(network, micro_size)``: the batch is cut into ``micro_size`` micro-batches that
    run one after another (``jax.lax.scan``), so activations of one micro-batch are live at a time.

    ``network`` is a network with loss (``WithLossCell``). Called, it returns the mean of the micro-batch
    losses; under :class:`TrainOneStepCell` the gradients are accumulated over the micro-batches (their
    mean: for a mean-reduced loss, the full-batch gradient) and applied once. Micro-batch k holds rows
    k, k+micro_size, ... of the batch, so every micro-batch stays spread over the data-parallel devices.
    """

    def __init__(self, network: nnx.Module, micro_size: int):
        self.network = network
        self.micro_size = _check_count("GradAccumulationCell", "micro_size", micro_size)

    def __call__(self, *inputs):
        n = self.micro_size
        xs = [_split_rows(x, n, "GradAccumulationCell") for x in inputs]
        gdef, params, rest = nnx.split(self.network, nnx.Param, ...)
        params, rest = nnx.as_pure(params), nnx.as_pure(rest)
        trace, prefix = annotate.current_region(), _prefix(self, "network")
        scanned = [x for x in xs if x is not None]

        def body(rest, d):
            it = iter(d)
            args = [next(it) if x is not None else a for x, a in zip(xs, inputs)]
            m = nnx.merge(gdef, params, rest)
            if trace is not None:
                register_paths(trace, m, prefix)
            out = m(*args)
            return nnx.as_pure(nnx.state(m, nnx.Not(nnx.Param))), out

        rest, outs = jax.lax.scan(body, rest, scanned)
        nnx.update(self.network, rest)
        return jax.tree.map(lambda o: jnp.mean(o, axis=0), outs)


class MicroBatchInterleaved(Cell):
    """``MicroBatchInterleaved(network, interleave_num=2)``: the batch is cut into ``interleave_num`` slices
    that run as independent copies of the network in one program (XLA may overlap one slice's
    communication with another's computation), and their outputs are averaged.

    Differences from MindSpore: MindSpore adds the slice outputs; mshard averages them, so the loss and the
    gradients equal the full batch's for a mean-reduced loss (multiply by ``interleave_num`` for MindSpore's
    value). Slice k holds rows k, k+interleave_num, ... (no data moves between devices).
    """

    def __init__(self, network: nnx.Module, interleave_num: int = 2):
        self.network = network
        self.interleave_num = _check_count("MicroBatchInterleaved", "interleave_num", interleave_num)

    def __call__(self, *inputs):
        n = self.interleave_num
        xs = [_split_rows(x, n, "MicroBatchInterleaved") for x in inputs]
        outs = [self.network(*[a if x is None else x[k] for x, a in zip(xs, inputs)]) for k in range(n)]
        return jax.tree.map(lambda *o: sum(o[1:], o[0]) / n, *outs)


# -- gradients -------------------------------------------------------------------------------------
def _value_and_grad(module: nnx.Module, data: tuple, prefix: str):
    """(loss, gradient of the module's Params as a pure State); other state (RNG counts) is updated in place."""
    trace = annotate.current_region()
    if isinstance(module, GradAccumulationCell):
        return _accumulate(module, data, prefix)

    def f(m, *d):
        if trace is not None:
            register_paths(trace, m, prefix)
        return m(*d)
    loss, grads = nnx.value_and_grad(f)(module, *data)
    return loss, nnx.as_pure(grads)


def _accumulate(acc: GradAccumulationCell, data: tuple, prefix: str):
    n = acc.micro_size
    inner = acc.network
    xs = [_split_rows(x, n, "GradAccumulationCell") for x in data]
    gdef, params, rest = nnx.split(inner, nnx.Param, ...)
    params, rest = nnx.as_pure(params), nnx.as_pure(rest)
    zeros = jax.tree.map(jnp.zeros_like, params)
    scanned = [x for x in xs if x is not None]

    def body(carry, d):
        g_acc, l_acc, rest = carry
        it = iter(d)
        args = [next(it) if x is not None else a for x, a in zip(xs, data)]
        m = nnx.merge(gdef, params, rest)
        loss, g = _value_and_grad(m, tuple(args), f"{prefix}.network")
        rest = nnx.as_pure(nnx.state(m, nnx.Not(nnx.Param)))
        return (jax.tree.map(jnp.add, g_acc, g), l_acc + loss.astype(jnp.float32), rest), None

    (g, loss, rest), _ = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32), rest), scanned)
    nnx.update(inner, rest)
    outer = nnx.as_pure(nnx.state(acc, nnx.Param))
    grads = jax.tree.unflatten(jax.tree.structure(outer), [x / n for x in jax.tree.leaves(g)])
    return loss / n, grads


def _combine_rest(x):
    """One value of a per-replica state leaf (all replicas agree on RNG keys/counts; float statistics are averaged)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.mean(x, axis=0)
    return x[0]


# -- what a step is planned as -------------------------------------------------------------------------
@dataclass
class _StepPlan:
    """Trace-time facts about one step (from the planned forward region)."""

    mesh: RegionMesh
    dp_axes: tuple[str, ...]
    param_layouts: dict[str, DimAxes]          # "network.<path>" -> planned layout
    pure_dp: bool
    strategy_layouts: dict[str, DimAxes] = field(default_factory=dict)    # as the user's strategies lay them out
    zero: dict[str, DimAxes] = field(default_factory=dict)      # ZeRO layouts of sharded parameters
    replicas: tuple[str, ...] = ()      # set when a model-parallel step computes per-replica gradients (fusion)
    info: dict[str, dict] = field(default_factory=dict)

    @property
    def dp(self) -> int:
        return self.mesh.count(self.dp_axes)


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
    return _StepPlan(lay.mesh, dp_axes, param_layouts, pure, strategy_layouts)


def _named_leaves(module: nnx.Module) -> list[tuple[str, Any]]:
    """(path, leaf) of a module's state in Region order (``jax.tree.flatten_with_path`` of ``nnx.split``)."""
    _, state = nnx.split(module)
    out = []
    for path, leaf in jax.tree.flatten_with_path(state)[0]:
        parts = [str(k.key) if isinstance(k, jax.tree_util.DictKey) else str(k.idx)
                 for k in path if isinstance(k, (jax.tree_util.DictKey, jax.tree_util.SequenceKey))]
        out.append((".".join(parts), leaf))
    return out


def _zero_layouts(plan: _StepPlan, params: list[tuple[str, Any]], ctx) -> None:
    """Fill ``plan.zero``/``plan.info``: which parameters get optimizer-parallel (ZeRO-1) layouts."""
    cfg = ctx.parallel_optimizer_config
    size, threshold = cfg["optimizer_weight_shard_size"], cfg["parallel_optimizer_threshold"]
    mesh = plan.mesh
    if size != -1 and size > plan.dp:
        raise OptimizerParallelError(
            f"parallel_optimizer_config: optimizer_weight_shard_size={size} is larger than the data-parallel size "
            f"{plan.dp} of this step (the batch is split over mesh axes {plan.dp_axes or '()'}); use a shard size "
            f"<= {plan.dp}, or -1 for the whole data-parallel group.")
    for name, leaf in params:
        lay = plan.param_layouts[name]
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        entry: dict[str, Any] = {"shape": tuple(leaf.shape), "bytes": nbytes, "layout": lay, "sharded": False}
        plan.info[name] = entry
        if nbytes < threshold * 1024:
            entry["reason"] = f"{nbytes / 1024:.1f} KB < parallel_optimizer_threshold {threshold} KB"
            continue
        used = {a for d in lay for a in d}
        free = [a for a in plan.dp_axes if a not in used]
        target = size if size != -1 else mesh.count(free)
        axes = choose_axes(target, free, mesh) if target > 1 else None
        if axes is None:
            entry["reason"] = (f"no data-parallel axes left to shard over (layout {lay}, data-parallel axes "
                               f"{plan.dp_axes})" if target <= 1 else
                               f"{target}-way shard cannot be made from free data-parallel axes {free}")
            continue
        c0 = mesh.count(lay[0]) if leaf.ndim else 1
        if leaf.ndim == 0 or leaf.shape[0] % (c0 * target):
            entry["reason"] = (f"dim 0 of shape {tuple(leaf.shape)} is not divisible by {c0 * target}"
                               if leaf.ndim else "a scalar")
            continue
        plan.zero[name] = (tuple(lay[0]) + tuple(axes),) + tuple(lay[1:])
        entry.update(sharded=True, zero_layout=plan.zero[name], shard_axes=tuple(axes), reason="")


# -- the step ----------------------------------------------------------------------------------------
class _Runtime:
    """Per-TrainOneStepCell machinery kept outside the nnx graph: the step region, the forward probe and the
    trace-time decisions handed to the region's input-layout hook."""

    def __init__(self, name: str):
        self.region = Region(self.step_fn, name=name, input_layout_hook=self.hook, donate_params=True)
        self.probe = Region(lambda *a: a[-1](*a[:-1]), name=f"{name}.forward")
        self.pending: _StepPlan | None = None
        self.last: _StepPlan | None = None
        self.warned = False
        self.fast: _FastPath | None = None

    # traced once per (shapes, context): fn(*data, cell)
    def step_fn(self, *args):
        *data, cell = args
        data = tuple(data)
        ctx = ctxmod.current()
        net, opt = cell.network, cell.optimizer
        plan = _plan_step(self.probe, data, net, ctx)
        if search_algorithm(ctx) is not None and not fusion.is_default(ctx):
            # a searched step with a fusion setting runs its data-parallel replicas side by side (see
            # _replica_axes): every parameter is whole over the replicas, in its layout on the other axes
            rax = _replica_axes(plan, ctx)
            plan.param_layouts = {k: _drop_axes(v, rax) for k, v in plan.param_layouts.items()}
        pstate = nnx.as_pure(nnx.state(net, nnx.Param))
        pleaves, ptree = jax.tree.flatten_with_path(pstate)
        names = ["network." + ".".join(str(k.key) for k in p if isinstance(k, jax.tree_util.DictKey))
                 for p, _ in pleaves]
        params = [x for _, x in pleaves]
        if ctx.enable_parallel_optimizer and ctx.parallel_mode != "stand_alone":
            _zero_layouts(plan, list(zip(names, params)), ctx)
        else:
            for nm, x in zip(names, params):
                plan.info[nm] = {"shape": tuple(x.shape), "layout": plan.param_layouts.get(nm), "sharded": False,
                                 "reason": "enable_parallel_optimizer is False"}
        self.pending = plan
        token = None
        if plan.pure_dp:
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
        mesh = plan.mesh.jax_mesh()
        dp = plan.dp
        # data_parallel ignores strategies (the forward region warned): a replica runs its slice of the batch
        # without them, so a strategy written for the global batch is not checked against a replica's slice
        with annotate.tracing_region(None):
            losses, stacked = _run_replicas(net, data, plan.dp_axes, dp, mesh, manual=True)
        nb = [int(np.prod(x.shape[1:])) * x.dtype.itemsize for x in stacked]

        def collective(kind, key, buckets, token):
            sub = [stacked[i] for i in key]
            if kind == "allreduce":
                return fusion.all_reduce_buckets(sub, buckets, mesh, plan.dp_axes, token)
            shard_axes = plan.info[names[key[0]]]["shard_axes"]
            return fusion.reduce_scatter_buckets(sub, buckets, mesh, plan.dp_axes, shard_axes, token)
        reduced, token = _reduce_in_buckets(stacked, names, nb, plan, ctx, collective)
        if ctx.gradients_mean:
            reduced = [g / dp for g in reduced]
        return jnp.mean(losses), reduced, token

    def _global_grads(self, net, data, plan: _StepPlan, names, ctx):
        """The gradient of the global-batch loss (``jax.grad``; XLA's partitioner places the reductions)."""
        loss, g = _value_and_grad(net, data, "network")
        scale = 1.0 if ctx.gradients_mean else float(plan.dp)
        grads = [x * scale if scale != 1.0 else x for x in jax.tree.leaves(g)]
        mesh = plan.mesh.jax_mesh()
        for i, nm in enumerate(names):
            if nm in plan.zero:
                grads[i] = jax.lax.with_sharding_constraint(grads[i], NamedSharding(mesh, spec_of(plan.zero[nm])))
        return loss, grads

    def _replica_grads(self, net, data, plan: _StepPlan, names, ctx):
        """A hybrid-parallel step with a fusion setting: every data-parallel replica computes the gradient of its
        own loss with the model-parallel layouts inside (``jax.vmap`` over the replicas; the strategies' marks
        become the per-replica layouts plus the replica split, :func:`mshard.execute.replica_layout`), and the
        gradients are summed over the replicas in ``comm_fusion``/``all_reduce_fusion_config`` buckets, each
        device reducing its own model-parallel slices (:func:`mshard.fusion.all_reduce_sharded_buckets`)."""
        mesh = plan.mesh.jax_mesh()
        rax = _replica_axes(plan, ctx)
        dp = plan.mesh.count(rax)
        with annotate.replica_axes(rax):
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
        # the mean over the replicas is the global-batch gradient; gradients_mean=False scales it by the batch
        # split, as the XLA path does (see the module doc)
        scale = 1.0 / dp if ctx.gradients_mean else plan.dp / dp
        return jnp.mean(losses), [g * scale for g in reduced], token

    def _update(self, opt, plan: _StepPlan, names, params, grads, ptree, token):
        """optax on the (possibly ZeRO-sharded) gradients; ZeRO parameters are updated on their shard and
        gathered back to their planned layout."""
        mesh = plan.mesh.jax_mesh()
        p_in = list(params)
        for i, nm in enumerate(names):
            if nm in plan.zero:
                p_in[i] = jax.lax.with_sharding_constraint(p_in[i], NamedSharding(mesh, spec_of(plan.zero[nm])))
        p_tree = jax.tree.unflatten(ptree, p_in)
        g_tree = jax.tree.unflatten(ptree, grads)
        opt_arrays = nnx.as_pure(opt.opt_state)
        updates, new_opt = opt.tx.update(g_tree, opt_arrays, p_tree)
        new = jax.tree.leaves(optax.apply_updates(p_tree, updates))
        nnx.update(opt.opt_state, nnx.state(new_opt, graph=opt.graph))
        opt.step[...] += 1
        zero = [i for i, nm in enumerate(names) if nm in plan.zero]
        if zero and plan.pure_dp:
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

    # after planning the step: optimizer state follows its parameter (or its ZeRO layout)
    def hook(self, infos, layouts):
        # called before a data-parallel plan is made and again after every plan: the second call sees the same plan
        plan = self.pending if self.pending is not None else self.last
        self.pending, self.last = None, plan
        inputs = list(layouts.inputs)
        idx = {info.name: i for i, info in enumerate(infos) if info.kind == "param"}
        params = {nm[len("network."):]: idx[nm] for nm in (plan.param_layouts if plan else {}) if nm in idx}
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


def _no_fusion_reason(plan: _StepPlan, ctx) -> str | None:
    """None when a model-parallel or searched step computes per-replica gradients to reduce them in fusion
    buckets (a step cut into data-parallel replicas, with a fusion setting beyond the default, which leaves the
    grouping to XLA's combiner); else why not."""
    if fusion.is_default(ctx):
        return "the default setting"
    if not _replica_axes(plan, ctx):
        return f"every data-parallel mesh axis {plan.dp_axes} also splits a parameter (no replica group)"
    return None


def _drop_axes(lay: DimAxes | None, axes: tuple[str, ...]) -> DimAxes | None:
    return None if lay is None else tuple(tuple(a for a in d if a not in axes) for d in lay)


def _replica_axes(plan: _StepPlan, ctx) -> tuple[str, ...]:
    """The data-parallel axes of a model-parallel step. Planned from strategies: the batch's axes that no
    parameter is split over (with Megatron's dp=2 x mp=4 on 8 devices, the batch may enter split 8 ways but
    the replicas are the 2 devices every weight slice is repeated on). Planned by a search: the axes the
    searched forward splits the batch over that the user's strategies alone split no parameter over (a search
    may split a weight over a data axis too, which no replica group would then hold whole; the fused step
    keeps each weight whole over the replicas instead, in its searched layout on the other axes, and the
    step's own search plans the rest around that)."""
    layouts = plan.strategy_layouts if search_algorithm(ctx) is not None else plan.param_layouts
    used = {a for lay in layouts.values() if lay for d in lay for a in d}
    return tuple(a for a in plan.dp_axes if a not in used)


def _reduce_in_buckets(stacked: list, names: list[str], nbytes: list[int], plan: _StepPlan, ctx, collective):
    """Sum per-replica gradients in the fusion buckets: plain parameters by all-reduce (``allreduce``
    buckets), optimizer-parallel ones by reduce-scatter (``reducescatter`` buckets), grouped by (dtype, shard
    axes); ``collective(kind, indices, buckets, token) -> (outputs, token)`` runs one group. Returns the
    reduced gradients in parameter order and the last token."""
    plain = [i for i, nm in enumerate(names) if nm not in plan.zero]
    zero = [i for i, nm in enumerate(names) if nm in plan.zero]
    reduced: list[Any] = [None] * len(stacked)
    token = None
    for idx, kind in ((plain, "allreduce"), (zero, "reducescatter")):
        groups = _by_key(idx, [(stacked[i].dtype, plan.info[names[i]].get("shard_axes")) for i in idx],
                         fusion.plan_buckets([nbytes[i] for i in idx], *fusion.fusion_setting(kind, ctx)))
        for key, buckets in groups:
            out, token = collective(kind, key, buckets, token)
            for i, o in zip(key, out):
                reduced[i] = o
    return reduced, token


def _run_replicas(net, data: tuple, dp_axes: tuple[str, ...], dp: int, mesh, manual: bool = False):
    """Every replica's loss and gradient of its own ``1/dp`` of the batch, side by side (``jax.vmap``; dim 0
    of the data is cut into ``dp`` slices over ``dp_axes``): -> (losses ``[dp]``, stacked gradients ``[dp, ...]``
    in parameter order). Other state (RNG counts, statistics) is written back combined over the replicas."""
    gdef, pst, rest = nnx.split(net, nnx.Param, ...)
    pst, rest = nnx.as_pure(pst), nnx.as_pure(rest)
    xs = jax.tree.map(lambda x: _per_replica(x, dp, dp_axes, mesh, net), data)
    axes = jax.tree.map(lambda x: 0 if hasattr(x, "ndim") and x.ndim > 0 else None, data)
    rows = next((x.shape[1] for x in jax.tree.leaves(xs) if hasattr(x, "ndim") and x.ndim > 1), 0)

    def replica(p, r, d, index):
        m = nnx.merge(gdef, p, r)
        with replica_context(index, dp, rows):
            loss, g = _value_and_grad(m, d, "network")
        return loss, g, nnx.as_pure(nnx.state(m, nnx.Not(nnx.Param)))

    if manual:
        # each device runs its own replica on its slice (MindSpore's data parallel): a shard_map over the
        # data-parallel axes rather than a vmap, whose batching rules can turn a weight gradient into a grouped
        # conv that XLA's partitioner splits wrongly (repro r7: a 1x1 conv in a data-parallel step)
        rep, ax = P(tuple(dp_axes)), tuple(dp_axes)

        def local(p, r, d):
            d = jax.tree.map(lambda x: x[0] if hasattr(x, "ndim") and x.ndim > 0 else x, d)
            loss, g, st = replica(p, r, d, jax.lax.axis_index(ax))
            # other state, combined as _combine_rest does: float statistics averaged over the replicas, RNG
            # keys and counts (equal on every replica) kept
            st = jax.tree.map(lambda x: jax.lax.pmean(x, ax) if jnp.issubdtype(x.dtype, jnp.floating) else x, st)
            return loss[None], jax.tree.map(lambda x: x[None], g), st
        specs = jax.tree.map(lambda a: rep if a == 0 else P(), axes, is_leaf=lambda a: a is None)
        losses, g_st, rest_c = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), specs),
                                             out_specs=(rep, rep, P()), check_vma=False)(pst, rest, xs)
        nnx.update(net, rest_c)
        return losses, jax.tree.leaves(g_st)
    losses, g_st, rest_r = jax.vmap(replica, in_axes=(None, None, axes, 0))(pst, rest, xs, jnp.arange(dp))
    nnx.update(net, jax.tree.map(_combine_rest, rest_r))
    return losses, jax.tree.leaves(g_st)


def _per_replica(x, dp: int, dp_axes: tuple[str, ...], mesh, net):
    """``[batch, ...]`` -> ``[dp, batch / dp, ...]``, dim 0 over the data-parallel axes (non-arrays pass)."""
    if not hasattr(x, "ndim") or x.ndim == 0:
        return x
    micro = net.micro_size if isinstance(net, GradAccumulationCell) else 1
    if x.shape[0] % (dp * micro):
        extra = f" x micro_size {micro}" if micro > 1 else ""
        raise CellError(f"TrainOneStepCell: the batch dim {x.shape[0]} (input shape {tuple(x.shape)}) is not "
                         f"divisible by the data-parallel size {dp}{extra}; every replica's slice of the batch "
                         f"must split into equal micro-batches. Use a batch size that is a multiple of "
                         f"{dp * micro}.")
    y = x.reshape(dp, x.shape[0] // dp, *x.shape[1:])
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec_of((tuple(dp_axes),) + ((),) * x.ndim)))


def _by_key(indices: list[int], keys: list, buckets: list[list[int]]):
    """Split buckets (positions into ``indices``) so each holds one key (dtype, shard axes); -> [(indices, buckets)]."""
    out: dict[Any, tuple[list[int], list[list[int]]]] = {}
    for b in buckets:
        cur: dict[Any, list[int]] = {}
        for pos in b:
            cur.setdefault(keys[pos], []).append(pos)
        for k, members in cur.items():
            idx_list, bl = out.setdefault(k, ([], []))
            start = len(idx_list)
            idx_list.extend(indices[p] for p in members)
            bl.append(list(range(start, start + len(members))))
    return list(out.values())


_MISS = object()


class _FastPath:
    """Repeated steps without the region's per-call ``nnx.split``/``nnx.update`` (tens of ms for a model with a
    few hundred Variables): after a first call through the region, the step keeps the network's and optimizer's
    Variables in the region's input order and the compiled step, reads the Variables' arrays, calls the compiled
    step and writes the changed arrays back into the same Variables.

    Valid while the context, algorithm/cost-model parameters, strategy epoch and the data's structure, shapes and
    dtypes are unchanged; otherwise (or if the compiled step rejects the arrays, e.g. a value replaced with one of
    another sharding) the step goes through the region again. As MindSpore compiles a training graph once, Cells or
    Variables *assigned* to the network after the first step are not seen (values written into its Variables,
    e.g. by ``nnx.update``, are).
    """

    def __init__(self, comp, variables, raw, tree, avals, shardings):
        self.comp, self.variables, self.raw = comp, variables, raw
        self.tree, self.avals, self.shardings = tree, avals, shardings
        self.ctx, self.algo, self.cost = ctxmod.current(), ctxmod.get_algo_parameters(), ctxmod.get_cost_model_context()
        self.epoch = annotate.epoch()
        self.user_tree = comp.out_tree.children()[0]
        self.changed = list(comp.changed)

    @staticmethod
    def build(region: Region, cell: TrainOneStepCell, data: tuple) -> _FastPath | None:
        flat, tree = jax.tree.flatten(data)
        if not all(isinstance(x, (jax.Array, np.ndarray)) for x in flat):
            return None
        comp = region._prepare((*data, cell), {})[0]       # the compiled step just used (a cache hit)
        _, state = nnx.split(cell)
        variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        if len(variables) != len(jax.tree.leaves(state)) or not all(isinstance(v, nnx.Variable) for v in variables):
            return None
        raw = [raw_ok(v) for v in variables]
        avals = [(x.shape, x.dtype) for x in flat]
        shardings = comp.in_shardings[len(variables):]
        return _FastPath(comp, variables, raw, tree, avals, shardings)

    def __call__(self, data: tuple):
        if (ctxmod.current() is not self.ctx or annotate.epoch() != self.epoch
                or ctxmod.get_algo_parameters() is not self.algo or ctxmod.get_cost_model_context() is not self.cost):
            return _MISS
        flat, tree = jax.tree.flatten(data)
        if tree != self.tree or any(not isinstance(x, (jax.Array, np.ndarray)) or (x.shape, x.dtype) != a
                                    for x, a in zip(flat, self.avals)):
            return _MISS
        flat = [jax.device_put(x, sh) if isinstance(x, jax.Array) and x.committed and x.sharding != sh else x
                for x, sh in zip(flat, self.shardings)]
        vals = [v._raw_value if r else v.get_value() for v, r in zip(self.variables, self.raw)]
        try:
            outs = self.comp.jitted(*vals, *flat)
        except (ValueError, TypeError):
            return _MISS
        n_user = len(outs) - len(self.changed)
        for i, x in zip(self.changed, outs[n_user:]):
            v = self.variables[i]
            if self.raw[i]:
                v._raw_value = x
            else:
                v.set_value(x)
        return jax.tree.unflatten(self.user_tree, list(outs[:n_user]))


_RUNTIMES: weakref.WeakKeyDictionary[TrainOneStepCell, _Runtime] = weakref.WeakKeyDictionary()


class TrainOneStepCell(Cell):
    """``TrainOneStepCell(network, optimizer, sens=1.0)``: one jitted training step under the current context.

    ``network`` is a network with loss (:class:`WithLossCell`, :class:`GradAccumulationCell`, any Cell
    returning a scalar loss); ``optimizer`` an optax ``GradientTransformation``. ``step(*data)`` runs the
    step and returns the loss; the network's parameters are updated in place. ``step.opt_state`` is the
    optax state (global jax.Arrays on their planned shardings). ``sens`` scales the gradients (MindSpore's
    loss-scale sensitivity). See the module docstring for the gradient semantics and optimizer parallel.

    Maps to JAX as: one ``jax.jit`` (through ``ms.jit``) of ``nnx.value_and_grad`` + ``optax`` with the
    parameters and optimizer state as donated, sharded inputs. Differences from MindSpore: ``optimizer`` is
    an optax transformation, not a MindSpore Optimizer Cell.
    """

    def __init__(self, network: nnx.Module, optimizer: optax.GradientTransformation, sens: float = 1.0):
        if not isinstance(optimizer, optax.GradientTransformation):
            raise CellTypeError(f"TrainOneStepCell: optimizer must be an optax GradientTransformation (e.g. "
                            f"optax.adamw(1e-3)), got {type(optimizer).__name__}.")
        self.network = network
        self.optimizer = nnx.Optimizer(network, optimizer, wrt=nnx.Param)
        self.sens = float(sens)

    @property
    def _rt(self) -> _Runtime:
        rt = _RUNTIMES.get(self)
        if rt is None:
            rt = _RUNTIMES[self] = _Runtime(type(self).__name__)
        return rt

    def __call__(self, *data):
        rt = self._rt
        fast = rt.fast
        if fast is not None:
            out = fast(data)
            if out is not _MISS:
                return out
        loss = rt.region(*data, self)
        rt.fast = _FastPath.build(rt.region, self, data)
        return loss

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
        return self._rt.region.lower(*data, self)

    def layouts(self, *data):
        """The planned layouts of the step's inputs (parameters, optimizer state, data)."""
        return self._rt.region.layouts(*data, self)

    def plan(self, *data):
        """The step's Plan (``plan.summary()``, ``plan.param_specs``)."""
        return self._rt.region.plan(*data, self)

