"""Optimizer parallel (MindSpore's ``enable_parallel_optimizer``, ZeRO) in a training step written by hand: an
``@ms.jit`` step that calls ``optimizer(grads)`` (MindSpore's functional training), where no TrainOneStepCell plans
the step.

While the step is traced, the optimizer Cell lays out what it updates (mshard._src.frontend.optimizers): each
gradient, parameter and optimizer-state leaf of a parameter that optimizer parallel shards is constrained to the
parameter's ZeRO layout (dim 0 split over the data-parallel devices) and the update runs on that shard. The
region's planner takes each ``sharding_constraint`` as fixed, and what is written back (the new parameter and its
optimizer state) is stored in that layout: each device keeps ``1/shard`` of both, and the forward gathers a
parameter where it uses it. That is MindSpore's optimizer parallel in (semi-)auto mode, which also stores parameter
slices and all-gathers them in the forward; ``optimizer_level`` makes no difference to this program (the gathered
weight is a temporary either way). On CPU XLA reduces the gradient with an all-reduce and slices it; the
TrainOneStepCell route reduce-scatters in mshard's own buckets.

Which parameters: those of at least ``parallel_optimizer_threshold`` KB whose dim 0 divides by the shard size
(``optimizer_weight_shard_size``; -1: every device of the job). The data-parallel axes are every mesh axis here:
the step's parameter layouts are planned after it is traced, so a parameter a user strategy splits is sharded over
all devices on dim 0 (right, but it may move more than TrainOneStepCell's ZeRO, which knows the layouts first).

>>> from mshard._src.frontend.functional_zero import zero_layouts
>>> zero_layouts({}) is None        # outside a traced region, or without enable_parallel_optimizer: nothing
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mshard._src.jaxpr import marks
from mshard._src.values import context as ctxmod
from mshard._src.values.layout import choose_axes, jax_mesh, prime_mesh


@dataclass
class ZeroLayouts:
    """Per parameter key that optimizer parallel shards, the sharding of its dim 0."""

    shardings: dict[str, NamedSharding]

    def _constrain_leaf(self, path, x):
        keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
        sh = next((self.shardings[k] for k in reversed(keys) if k in self.shardings), None)
        if sh is None or not hasattr(x, "shape") or not x.ndim:
            return x
        return jax.lax.with_sharding_constraint(x, sh)

    def constrain(self, tree: Any) -> Any:
        """Every leaf under a sharded parameter's key (the gradient, the parameter, its state) in its ZeRO layout."""
        return jax.tree_util.tree_map_with_path(self._constrain_leaf, tree)



def zero_layouts(params: dict[str, Any]) -> ZeroLayouts | None:
    """The ZeRO layouts for ``params`` (key -> value) when an optimizer is called inside a region being traced with
    ``enable_parallel_optimizer`` on; None otherwise. Marks the region's trace as having applied it."""
    record = marks.current_region()
    ctx = ctxmod.current()
    if record is None or not ctx.enable_parallel_optimizer or ctx.parallel_mode == "stand_alone":
        return None
    cfg = ctx.parallel_optimizer_config
    mesh = prime_mesh(ctx.devices)
    jmesh = jax_mesh(mesh)
    size = cfg["optimizer_weight_shard_size"]
    target = ctx.devices if size == -1 else size
    axes = choose_axes(target, list(mesh.names), mesh) if target > 1 else None
    record.zero = True
    if axes is None:
        return ZeroLayouts({})
    shardings = {}
    for k, x in params.items():
        nbytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        if x.ndim and nbytes >= cfg["parallel_optimizer_threshold"] * 1024 and x.shape[0] % target == 0:
            shardings[k] = NamedSharding(jmesh, P(tuple(axes)))
    return ZeroLayouts(shardings)
