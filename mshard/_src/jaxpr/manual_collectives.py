"""The collectives a ``shard_map`` body runs itself: the fused step's bucket reductions.

A ``shard_map`` on the region mesh is a fixed boundary of the plan (:mod:`mshard._src.jaxpr.op_graph`): the search
does not lay out its body. Its collectives are explicit in the body (``psum``, ``psum_scatter``, ``all_gather``,
``ppermute``, ``all_to_all``) on per-device shapes, so their bytes per device are known from the jaxpr alone, by the
ring formulas the cost model uses for the collectives XLA inserts (all-reduce ``2 S (k-1)/k`` of its result,
reduce-scatter ``S (k-1)`` of its result, all-gather ``S (k-1)/k`` of its result, all-to-all ``S (k-1)/k``, a
permute ``S``), times the trip count of each ``scan`` around them. A ``while`` body is counted once (its trip count
is not known) and a ``cond`` by its costliest branch. Only a ``shard_map`` manual over every mesh axis is priced (the
bucketed reductions): in one manual over some axes only, the body's shapes are still whole over the others, and XLA
splits them further as it partitions the body. A pipeline prices its own (:mod:`mshard._src.training.pipeline.price`),
manual over every axis or not: its ``shard_map`` is traced in the ``SELF_PRICED_SCOPE`` name scope.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
>>> f = jax.shard_map(lambda x: jax.lax.psum(x, "a"), mesh=mesh, in_specs=P("a"), out_specs=P(), check_vma=False)
>>> region_manual_moves(jax.make_jaxpr(f)(jnp.ones((16, 8))).jaxpr, ("a", "b"), (2, 4))
[('all-reduce', 256.0, ('a',))]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from mshard._src.jaxpr.walk import as_jaxpr, sub_jaxprs

Move = tuple[str, float, tuple[str, ...]]      # (collective kind, bytes per device, mesh axes)

# the name scope a pipeline's shard_map is traced in: it prices its own collectives (it knows which branch of its
# schedule a device runs at which tick, which a jaxpr does not say), so it is left out here
SELF_PRICED_SCOPE = "mshard_self_priced"

# primitive -> (kind, the axis-name param, bytes per device from (operand bytes, result bytes, group size))
_RING: dict[str, tuple[str, str, Callable[[float, float, int], float]]] = {
    "psum": ("all-reduce", "axes", lambda s_in, s_out, k: 2.0 * s_out * (k - 1) / k),
    "reduce_scatter": ("reduce-scatter", "axis_name", lambda s_in, s_out, k: s_out * (k - 1)),
    "all_gather": ("all-gather", "axis_name", lambda s_in, s_out, k: s_out * (k - 1) / k),
    "all_to_all": ("all-to-all", "axis_name", lambda s_in, s_out, k: s_in * (k - 1) / k),
    "ppermute": ("collective-permute", "axis_name", lambda s_in, s_out, k: s_out),
}


def _nbytes(avals) -> float:
    return float(sum(math.prod(a.shape) * a.dtype.itemsize for a in avals if hasattr(a, "shape")))


def manual_moves(jaxpr, sizes: dict[str, int], times: float = 1.0) -> list[Move]:
    """The collectives of a ``shard_map`` body (``sizes``: its mesh's axis sizes), each times ``times``."""
    out: list[Move] = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _RING:
            kind, param, bytes_of = _RING[name]
            axes = eqn.params.get(param, ())
            axes = tuple(a for a in (axes if isinstance(axes, (tuple, list)) else (axes,)) if isinstance(a, str))
            k = math.prod(sizes.get(a, 1) for a in axes)
            if k > 1:
                b = bytes_of(_nbytes([v.aval for v in eqn.invars]), _nbytes([v.aval for v in eqn.outvars]), k)
                out.append((kind, times * b, axes))
        elif name == "scan":
            out += manual_moves(eqn.params["jaxpr"].jaxpr, sizes, times * eqn.params["length"])
        elif name == "cond":
            branches = [manual_moves(as_jaxpr(b), sizes, times) for b in eqn.params["branches"]]
            out += max(branches, key=lambda m: sum(b for _, b, _ in m), default=[])
        else:
            for sub in sub_jaxprs(eqn):
                out += manual_moves(sub, sizes, times)
    return out


def region_manual_moves(jaxpr, names: Sequence[str], shape: Sequence[int], times: float = 1.0) -> list[Move]:
    """The collectives of every ``shard_map`` on the region mesh (axis ``names`` of sizes ``shape``) in a region's
    jaxpr, each times the trip count of the loops around it."""
    out: list[Move] = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "shard_map":
            try:
                sizes = dict(eqn.params["mesh"].shape)
            except (AttributeError, TypeError, KeyError):
                continue
            manual = set(eqn.params.get("newly_manual_axes") or ())
            if SELF_PRICED_SCOPE in str(eqn.source_info.name_stack):
                continue
            if tuple(sizes) == tuple(names) and tuple(sizes.values()) == tuple(shape) and manual >= set(names):
                out += manual_moves(as_jaxpr(eqn.params["jaxpr"]), sizes, times)
        elif name == "scan":
            out += region_manual_moves(eqn.params["jaxpr"].jaxpr, names, shape, times * eqn.params["length"])
        else:
            for sub in sub_jaxprs(eqn):
                out += region_manual_moves(sub, names, shape, times)
    return out
