"""Collective primitives for hybrid_parallel: used inside ``jax.shard_map`` regions, as MindSpore's.

``group`` is a mesh axis name or a tuple of names (MindSpore's communication group); ``None`` means
every axis of the enclosing shard_map's mesh.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from jax.sharding import PartitionSpec as P
>>> from mshard import ops
>>> mesh = jax.make_mesh((jax.device_count(),), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
>>> f = jax.jit(jax.shard_map(lambda v: ops.AllReduce()(v), mesh=mesh, in_specs=P("x"), out_specs=P()))
>>> float(f(jnp.ones(jax.device_count()))[0]) == jax.device_count()
True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mshard._src.frontend.primitive_base import Primitive
from mshard._src.values.errors import StrategyError


def _group(group):
    if group is None:
        return tuple(jax.sharding.get_abstract_mesh().axis_names)
    return group


class _Collective(Primitive):
    def spec(self, shapes, attrs):  # collectives live in hand-sliced regions: no strategy
        raise NotImplementedError(f"{self.kind} is for hybrid_parallel shard_map regions and takes no strategy")

    def __call__(self, *args):
        return self.compute(*args)


class AllReduce(_Collective):
    """``AllReduce(op="sum", group=None)``: psum/pmax/pmin over the group."""

    def __init__(self, op: str = "sum", group=None, name: str | None = None):
        super().__init__(name)
        self.op, self.group = op.lower(), group

    def compute(self, x):
        fn = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin, "mean": jax.lax.pmean}[self.op]
        return fn(x, _group(self.group))


class AllGather(_Collective):
    """``AllGather(group=None)``: concatenate the shards along dim 0."""

    def __init__(self, group=None, name: str | None = None):
        super().__init__(name)
        self.group = group

    def compute(self, x):
        return jax.lax.all_gather(x, _group(self.group), axis=0, tiled=True)


class ReduceScatter(_Collective):
    """``ReduceScatter(op="sum", group=None)``: sum over the group, then keep this device's slice of dim 0
    (``op`` ``"sum"``, or ``"mean"``: the sum divided by the group size)."""

    def __init__(self, op: str = "sum", group=None, name: str | None = None):
        super().__init__(name)
        if op.lower() not in ("sum", "mean"):
            raise StrategyError(f"ReduceScatter: op={op!r} is not supported; use 'sum' or 'mean' (JAX reduce-scatters "
                                f"sums).")
        self.op, self.group = op.lower(), group

    def compute(self, x):
        g = _group(self.group)
        out = jax.lax.psum_scatter(x, g, scatter_dimension=0, tiled=True)
        return out / jax.lax.psum(1, g) if self.op == "mean" else out


class Broadcast(_Collective):
    """``Broadcast(root_rank, group=None)``: every device of the group gets ``root_rank``'s value (its index along
    the group's axes)."""

    def __init__(self, root_rank: int = 0, group=None, name: str | None = None):
        super().__init__(name)
        self.root_rank, self.group = int(root_rank), group

    def compute(self, x):
        g = _group(self.group)
        mine = jax.lax.axis_index(g) == self.root_rank
        return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), g)


class SendReceive(_Collective):
    """``SendReceive(pairs, group=None)``: MindSpore's ``Send``/``Receive`` as one SPMD op: for each
    ``(src, dst)`` in ``pairs`` the device ``src`` (its index along the group's axes) sends its value and
    ``dst`` receives it; a device that receives nothing gets zeros (``jax.lax.ppermute``).

    Differences from MindSpore: a send and its receive are one op that every device of the group runs (SPMD),
    not two ops on two ranks matched by ``sr_tag``."""

    def __init__(self, pairs, group=None, name: str | None = None):
        super().__init__(name)
        self.pairs, self.group = tuple((int(a), int(b)) for a, b in pairs), group

    def compute(self, x):
        return jax.lax.ppermute(x, _group(self.group), self.pairs)


class AlltoAll(_Collective):
    """``AlltoAll(split_count, split_dim, concat_dim, group=None)``."""

    def __init__(self, split_count: int, split_dim: int, concat_dim: int, group=None, name: str | None = None):
        super().__init__(name)
        self.split_dim, self.concat_dim, self.group = split_dim, concat_dim, group

    def compute(self, x):
        return jax.lax.all_to_all(x, _group(self.group), self.split_dim, self.concat_dim, tiled=True)
