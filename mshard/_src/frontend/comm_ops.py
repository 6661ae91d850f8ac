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
    """``AllReduce(op="sum", group=None)(x)``: ``x`` reduced over the devices of ``group``; every device gets the result.

    For hybrid_parallel: call it inside a ``jax.shard_map`` region (it takes no strategy). ``op`` is ``psum`` /
    ``pmax`` / ``pmin`` / ``pmean`` over the group's mesh axes.

    Args:
        op: ``"sum"`` (default), ``"max"``, ``"min"`` (MindSpore's ``ReduceOp`` values) or ``"mean"``, case-insensitive;
            ``"prod"`` is not supported.
        group: a mesh axis name or a tuple of names (MindSpore's communication group); ``None``: every axis of the
            enclosing shard_map's mesh.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from mshard import ops
    >>> mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> jax.shard_map(ops.AllReduce(), mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.arange(8)).tolist()
    [28, 28, 28, 28, 28, 28, 28, 28]
    """

    def __init__(self, op: str = "sum", group=None, name: str | None = None):
        super().__init__(name)
        self.op, self.group = op.lower(), group

    def compute(self, x):
        fn = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin, "mean": jax.lax.pmean}[self.op]
        return fn(x, _group(self.group))


class AllGather(_Collective):
    """``AllGather(group=None)(x)``: the group's shards of ``x`` concatenated along dim 0, on every device of the group.

    For hybrid_parallel: call it inside a ``jax.shard_map`` region (it takes no strategy); ``jax.lax.all_gather``
    (tiled). Below each of 8 devices holds one value and gets all 8.

    Args:
        group: a mesh axis name or a tuple of names (MindSpore's communication group); ``None``: every axis of the
            enclosing shard_map's mesh.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from mshard import ops
    >>> mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(ops.AllGather(), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    >>> f(jnp.arange(8)).reshape(8, 8)[5].tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """

    def __init__(self, group=None, name: str | None = None):
        super().__init__(name)
        self.group = group

    def compute(self, x):
        return jax.lax.all_gather(x, _group(self.group), axis=0, tiled=True)


class ReduceScatter(_Collective):
    """``ReduceScatter(op="sum", group=None)(x)``: sum ``x`` over the group, then keep this device's slice of dim 0
    (``op`` ``"sum"``, or ``"mean"``: the sum divided by the group size).

    For hybrid_parallel: call it inside a ``jax.shard_map`` region (it takes no strategy); ``jax.lax.psum_scatter``.
    Dim 0 must divide by the group size. Unlike MindSpore, ``"max"`` / ``"min"`` / ``"prod"`` raise StrategyError.

    Args:
        op: ``"sum"`` (default) or ``"mean"``, case-insensitive.
        group: a mesh axis name or a tuple of names (MindSpore's communication group); ``None``: every axis of the
            enclosing shard_map's mesh.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from mshard import ops
    >>> mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> jax.shard_map(ops.ReduceScatter(), mesh=mesh, in_specs=P(), out_specs=P("x"))(jnp.arange(8)).tolist()
    [0, 8, 16, 24, 32, 40, 48, 56]
    """

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
    """``Broadcast(root_rank=0, group=None)(x)``: every device of the group gets ``root_rank``'s value of ``x``.

    For hybrid_parallel: call it inside a ``jax.shard_map`` region (it takes no strategy).

    Args:
        root_rank: the sending device, by its index along the group's axes (not its global rank).
        group: a mesh axis name or a tuple of names (MindSpore's communication group); ``None``: every axis of the
            enclosing shard_map's mesh.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from mshard import ops
    >>> mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> jax.shard_map(ops.Broadcast(3), mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.arange(8)).tolist()
    [3, 3, 3, 3, 3, 3, 3, 3]
    """

    def __init__(self, root_rank: int = 0, group=None, name: str | None = None):
        super().__init__(name)
        self.root_rank, self.group = int(root_rank), group

    def compute(self, x):
        g = _group(self.group)
        mine = jax.lax.axis_index(g) == self.root_rank
        return jax.lax.psum(jnp.where(mine, x, jnp.zeros_like(x)), g)


class SendReceive(_Collective):
    """``SendReceive(pairs, group=None)(x)``: MindSpore's ``Send``/``Receive`` as one SPMD op: for each
    ``(src, dst)`` in ``pairs`` the device ``src`` (its index along the group's axes) sends its value and
    ``dst`` receives it; a device that receives nothing gets zeros (``jax.lax.ppermute``).

    Differences from MindSpore: a send and its receive are one op that every device of the group runs (SPMD),
    not two ops on two ranks matched by ``sr_tag``. Call it inside a ``jax.shard_map`` region (no strategy).

    Args:
        pairs: ``(src, dst)`` pairs of device indices along the group's axes; each device sends to at most one and
            receives from at most one.
        group: a mesh axis name or a tuple of names (MindSpore's communication group); ``None``: every axis of the
            enclosing shard_map's mesh.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from mshard import ops
    >>> mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> ring = ops.SendReceive([(j, (j + 1) % 8) for j in range(8)])
    >>> jax.shard_map(ring, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(jnp.arange(8)).tolist()
    [7, 0, 1, 2, 3, 4, 5, 6]
    """

    def __init__(self, pairs, group=None, name: str | None = None):
        super().__init__(name)
        self.pairs, self.group = tuple((int(a), int(b)) for a, b in pairs), group

    def compute(self, x):
        return jax.lax.ppermute(x, _group(self.group), self.pairs)


class AlltoAll(_Collective):
    """``AlltoAll(split_count, split_dim, concat_dim, group=None)(x)``: split ``x`` along ``split_dim`` into one
    chunk per device of the group, send chunk ``j`` to device ``j``, and concatenate the received chunks along
    ``concat_dim`` (``jax.lax.all_to_all``, tiled), as MindSpore's AlltoAll.

    For hybrid_parallel: call it inside a ``jax.shard_map`` region (it takes no strategy).

    Args:
        split_count: MindSpore's chunk count; accepted, not used: the chunk count is the group's size.
        split_dim: the dim split into chunks (its size must divide by the group's size).
        concat_dim: the dim the received chunks are concatenated along.
        group: a mesh axis name or a tuple of names (MindSpore's communication group); ``None``: every axis of the
            enclosing shard_map's mesh.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from mshard import ops
    >>> mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(ops.AlltoAll(8, 0, 0), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    >>> f(jnp.arange(64)).reshape(8, 8)[1].tolist()
    [1, 9, 17, 25, 33, 41, 49, 57]
    """

    def __init__(self, split_count: int, split_dim: int, concat_dim: int, group=None, name: str | None = None):
        super().__init__(name)
        self.split_dim, self.concat_dim, self.group = split_dim, concat_dim, group

    def compute(self, x):
        return jax.lax.all_to_all(x, _group(self.group), self.split_dim, self.concat_dim, tiled=True)
