"""Layout changes the executor runs itself, where XLA's would move more.

XLA's partitioner realises a ``with_sharding_constraint`` from one layout to another with the
collectives :mod:`searchers.xla_reshard` simulates; for some pairs (an axis moving to another dim
while another axis is added or removed, say) it gathers the whole tensor and slices it. There,
:func:`redistribute` runs the direct steps of :mod:`searchers.direct_reshard` instead: one
``all_to_all`` / ``all_gather`` / local slice per moved mesh axis, inside a ``jax.shard_map`` over
the region's mesh. Its gradient is the reverse change, chosen the same way (a layout change is a
permutation of where the values live, so its transpose is the change back). The cost model prices
the same choice (``searchers.cost.redistribution_steps``), so a plan's predicted bytes are the
program's.

>>> import jax, jax.numpy as jnp, numpy as np
>>> from mshard._src.values.layout import prime_mesh, jax_mesh
>>> mesh = prime_mesh(8)                                   # axes of 2 x 2 x 2
>>> a, b, c = mesh.names
>>> x = jnp.arange(16 * 32.).reshape(16, 32)
>>> f = jax.jit(lambda x: redistribute(x, ((a,), (b,)), ((), (b, a, c)), mesh))
>>> bool(np.array_equal(f(x), x)), is_direct(((a,), (b,)), ((), (b, a, c)), mesh, x.shape)
(True, True)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding

from mshard._src.values.layout import DeviceMesh, DimAxes, axes_by_index, jax_mesh, spec_of
from searchers.direct_reshard import cheaper_than_xla, plan


def _canon(lay: DimAxes) -> DimAxes:
    return tuple(tuple(d) for d in lay)


def is_direct(src: DimAxes, dst: DimAxes, mesh: DeviceMesh, shape: Sequence[int]) -> bool:
    """Whether :func:`redistribute` runs the pair's direct steps (they move fewer bytes than XLA's, and every
    dim divides by its split on both sides)."""
    src, dst = _canon(src), _canon(dst)
    if src == dst or len(src) != len(shape) or len(dst) != len(shape):
        return False
    for lay in (src, dst):
        for n, axes in zip(shape, lay, strict=True):
            if n % math.prod(mesh.count((a,)) for a in axes):
                return False
    return cheaper_than_xla(axes_by_index(src, mesh), axes_by_index(dst, mesh), tuple(mesh.shape))


def redistribute(x: jax.Array, src: DimAxes, dst: DimAxes, mesh: DeviceMesh) -> jax.Array:
    """``x`` (laid out as ``src``) in layout ``dst``: the direct steps where :func:`is_direct`, else
    ``with_sharding_constraint`` (XLA's own change). Differentiable: the gradient takes the reverse change."""
    src, dst = _canon(src), _canon(dst)
    if not is_direct(src, dst, mesh, x.shape):
        return jax.lax.with_sharding_constraint(x, NamedSharding(jax_mesh(mesh), spec_of(dst)))
    return _direct(src, dst, mesh)(x)


@functools.cache
def _direct(src: DimAxes, dst: DimAxes, mesh: DeviceMesh):
    jm = jax_mesh(mesh)
    moves = plan(axes_by_index(src, mesh), axes_by_index(dst, mesh), tuple(mesh.shape))

    def body(x):
        for m in moves:
            name = mesh.names[m.axis]
            if m.kind == "slice":
                size = x.shape[m.dim] // mesh.shape[m.axis]
                x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(name) * size, size, axis=m.dim)
            elif m.kind == "all-to-all":      # one axis, or a dim's whole stack together (major first)
                group = tuple(mesh.names[a] for a in m.group) if len(m.group) > 1 else name
                x = jax.lax.all_to_all(x, group, split_axis=m.dim, concat_axis=m.src_dim, tiled=True)
            else:
                x = jax.lax.all_gather(x, name, axis=m.src_dim, tiled=True)
        return x

    run = jax.shard_map(body, mesh=jm, in_specs=spec_of(src), out_specs=spec_of(dst), check_vma=False)

    @jax.custom_vjp
    def change(x):
        return run(jax.lax.with_sharding_constraint(x, NamedSharding(jm, spec_of(src))))

    def fwd(x):
        return change(x), None

    def bwd(_, ct):
        return (redistribute(ct, dst, src, mesh),)

    change.defvjp(fwd, bwd)
    return change
