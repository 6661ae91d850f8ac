"""Optimizer parallel (ZeRO-1): which parameters of a planned step get their optimizer state, gradient and
update sharded on dim 0, and why the others do not (the semantics are in docs/gradients.md). A stack of
per-layer weights that a scan reads slice by slice is sharded on dim 1, its slices' dim 0, so that each step of
the loop gathers one layer's slice (level3) and reduces one layer's gradient."""

from __future__ import annotations

from typing import Any

import numpy as np

from mshard._src.training.step_layouts import _StepPlan
from mshard._src.values.errors import OptimizerParallelError
from mshard._src.values.layout import choose_axes


def _zero_layouts(plan: _StepPlan, params: list[tuple[str, Any]], ctx) -> None:
    """Fill ``plan.zero``/``plan.info``: which parameters get optimizer-parallel (ZeRO-1) layouts."""
    cfg = ctx.parallel_optimizer_config
    plan.store_sharded = cfg.get("optimizer_level", "level1") == "level3"
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
        d = 1 if name in plan.scanned and leaf.ndim > 1 else 0
        c0 = mesh.count(lay[d]) if leaf.ndim else 1
        if leaf.ndim == 0 or leaf.shape[d] % (c0 * target):
            entry["reason"] = (f"dim {d} of shape {tuple(leaf.shape)} is not divisible by {c0 * target}"
                               if leaf.ndim else "a scalar")
            continue
        plan.zero[name] = tuple(tuple(a) + (tuple(axes) if i == d else ()) for i, a in enumerate(lay))
        entry.update(sharded=True, zero_layout=plan.zero[name], shard_axes=tuple(axes), reason="", dim=d)
        if d:
            plan.notes.append(
                f"optimizer parallel: {name} {tuple(leaf.shape)} is a stack a scan reads slice by slice, so its shard "
                f"is on dim 1 (each slice's dim 0) over {tuple(axes)}" + (
                    ", gathered one slice at a time inside the loop" if plan.store_sharded else "")
                + "; XLA places this step's gradient reductions (the fusion buckets shard dim 0)")
