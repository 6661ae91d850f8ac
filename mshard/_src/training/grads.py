"""A training step's gradients: the gradient of the global loss (accumulated over micro-batches for a
GradAccumulationCell), every data-parallel replica's gradient of its own loss, and their sum in fusion buckets
(the semantics are in docs/gradients.md)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mshard._src.frontend.cell import register_paths
from mshard._src.frontend.layers import per_replica as replica_context
from mshard._src.frontend.wrapper_cells import GradAccumulationCell, _split_rows
from mshard._src.jaxpr import marks
from mshard._src.runtime import fusion
from mshard._src.runtime.region import search_algorithm
from mshard._src.training.step_layouts import _StepPlan
from mshard._src.values.errors import CellError
from mshard._src.values.layout import DimAxes, spec_of


# -- gradients -------------------------------------------------------------------------------------
def _value_and_grad(module: nnx.Module, data: tuple, prefix: str):
    """(loss, gradient of the module's Params as a pure State); other state (RNG counts) is updated in place."""
    trace = marks.current_region()
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


# -- per-replica gradients and fusion buckets ----------------------------------------------------
def _zero_past_dim0(plan: _StepPlan) -> bool:
    """Whether some parameter's optimizer shard is on a dim other than 0 (a scanned stack's, on dim 1)."""
    return any(e.get("dim", 0) for e in plan.info.values() if e.get("sharded"))


def _no_fusion_reason(plan: _StepPlan, ctx) -> str | None:
    """None when a model-parallel or searched step computes per-replica gradients to reduce them in fusion
    buckets (a step cut into data-parallel replicas, with a fusion setting beyond the default, which leaves the
    grouping to XLA's combiner, or with a tied parameter: XLA's partitioner reduces each contribution to a tied
    parameter's gradient by itself, and XLA:CPU does not reassociate them, where a replica adds them first and
    the sum is reduced once; or a GradAccumulationCell's: XLA reduces each micro-batch's gradient inside the loop,
    where a replica accumulates its own and the sum is reduced once after it); else why not."""
    if _zero_past_dim0(plan):
        return ("a scanned parameter's optimizer shard is on its dim 1 (each layer's slice), where the buckets "
                "reduce-scatter dim 0")
    if fusion.is_default(ctx) and not plan.tied and not plan.accumulated:
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
