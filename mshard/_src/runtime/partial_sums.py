"""Partial sums added before they are reduced: a tied parameter's gradient in a hand-written step (issue 40).

A parameter read twice (a tied embedding: a gather, and the output projection) has a gradient that is the sum of
two contributions, each computed from the split batch: a ``dot_general`` that contracts the split batch and a
``scatter-add`` of the split batch's rows. Each is a partial sum per device. XLA's partitioner reduces each where
it is made (the plan lays its result out whole), so the step all-reduces the parameter's bytes twice, and XLA:CPU
has no pass that turns ``all-reduce(a) + all-reduce(b)`` into ``all-reduce(a + b)``. ``nn.TrainOneStepCell`` avoids
it by running its data-parallel replicas side by side (``mshard._src.training.train_cells``); a step written as
``ms.jit(nnx.value_and_grad(...))`` is one traced program, so the emitter does it here:

* :func:`partial_sum_pairs` finds each ``add_any`` whose two operands are each made by such an op, read by nothing
  else, through a chain of transposes or dtype casts (the transpose of ``x @ embed.T``);
* :func:`local_partial` computes such an op on each device's blocks in a ``jax.shard_map``, stacked on a new
  leading dim split over the reduced mesh axes (:class:`Stacked`: device ``i``'s partial sum is row ``i``);
* the chain acts on the stack, the ``add_any`` adds the stacks, and :func:`materialize` sums the leading dim,
  which XLA runs as one all-reduce over those axes.

:func:`materialize` also reduce-scatters. Where the layout the sum goes to (``Stacked.target``) splits a dim further
over some of the partial sum's axes (a row-parallel MatMul read split by rows: Megatron's sequence parallelism,
MindSpore's ``out_strategy`` of a MatMul), each device sums only its block: ``psum_scatter`` over those axes (half
an all-reduce's bytes) and ``psum`` over the others. The planner asks for it on one op too, a dot or a sum over
split dims (``reduce_sum``: a bias's gradient) (``mshard._src.planning.scattered_sums``): XLA's partitioner
all-reduces the whole result and slices it.

Where a layout is unknown or the op's split is not a partial sum of this form, nothing changes: the ops are bound
as traced.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from mshard._src.jaxpr.sum_pairs import partial_sum_pairs
from mshard._src.values.layout import DimAxes, jax_mesh, spec_of

__all__ = ["Stacked", "add", "chain_op", "concatenate", "local_partial", "materialize", "partial_sum_pairs", "scattered_dims"]



@dataclass(frozen=True)
class Stacked:
    """A partial sum held per device: ``value[i]`` is device group ``i``'s part (``value`` has one more leading
    dim than the traced result, split over ``axes``); ``layout``: the other dims' layout; ``target``: where the
    sum goes."""

    value: jax.Array
    axes: tuple[str, ...]
    layout: DimAxes
    target: DimAxes | None = None       # the layout the plan gives the sum (None: ``layout``)


def local_partial(eqn, invals, layouts, mesh) -> Stacked | None:
    """``eqn`` (a root) computed per device on operands laid out as ``layouts`` (``DimAxes`` each), as a
    :class:`Stacked` partial sum; None where its split is not a partial sum over some mesh axes."""
    rule = _RULES.get(eqn.primitive.name)
    found = None if rule is None else rule(eqn, layouts)
    if found is None:
        return None
    axes, out_layout, local = found
    params = eqn.params

    def body(*xs):
        return local(xs, params)[None]
    run = jax.shard_map(body, mesh=jax_mesh(mesh), in_specs=tuple(spec_of(lay) for lay in layouts),
                        out_specs=PartitionSpec(axes, *spec_of(out_layout)), check_vma=False)
    return Stacked(run(*invals), axes, out_layout)


def _dot(eqn, layouts):
    """A dot_general whose contracting dims are split on the same axes on both sides (those axes are the partial
    sum's); batch dims split alike; no axis used twice in the result."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ll, rl = layouts
    if any(tuple(ll[i]) != tuple(rl[j]) for i, j in (*zip(lc, rc), *zip(lb, rb))):
        return None
    axes = tuple(a for d in lc for a in ll[d])
    lfree = [d for d in range(len(ll)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rl)) if d not in rc and d not in rb]
    out = tuple(tuple(ll[d]) for d in (*lb, *lfree)) + tuple(tuple(rl[d]) for d in rfree)
    used = [a for d in out for a in d]
    if not axes or len(set(used)) != len(used) or set(used) & set(axes):
        return None

    def local(xs, params):
        return jax.lax.dot_general_p.bind(*xs, **params)
    return axes, out, local


def _scatter_add(eqn, layouts):
    """A scatter-add (a gather's transpose) of updates split only on their scatter dims, the indices alike, into an
    operand kept whole: each device adds its rows into the operand (counted once: on the first device of each
    group) and the parts sum to the whole."""
    dn = eqn.params["dimension_numbers"]
    op_lay, idx_lay, upd_lay = layouts
    if dn.operand_batching_dims or any(op_lay):
        return None
    scatter_dims = [d for d in range(len(upd_lay)) if d not in dn.update_window_dims]
    if any(upd_lay[d] for d in dn.update_window_dims):
        return None
    idx_dims = list(range(len(idx_lay)))
    del idx_dims[-1]           # the index vector dim (jax.lax.scatter puts it last)
    if len(idx_dims) != len(scatter_dims) or idx_lay[-1] or any(
            tuple(idx_lay[i]) != tuple(upd_lay[d]) for i, d in zip(idx_dims, scatter_dims)):
        return None
    axes = tuple(a for d in scatter_dims for a in upd_lay[d])
    if not axes:
        return None
    prim = eqn.primitive

    def local(xs, params):
        operand, indices, updates = xs
        first = jax.lax.axis_index(axes) == 0
        operand = jnp.where(first, operand, jnp.zeros_like(operand))
        return prim.bind(operand, indices, updates, **params)
    return axes, tuple(() for _ in op_lay), local


def _reduce_sum(eqn, layouts):
    """A sum over dims split on some axes (a bias's gradient over the split batch): those axes are the partial
    sum's; the kept dims keep their layout."""
    (lay,) = layouts
    summed = set(eqn.params["axes"])
    axes = tuple(a for d in sorted(summed) for a in lay[d])
    if not axes:
        return None
    prim = eqn.primitive

    def local(xs, params):
        return prim.bind(*xs, **params)
    return axes, tuple(tuple(lay[d]) for d in range(len(lay)) if d not in summed), local


_RULES = {"dot_general": _dot, "scatter-add": _scatter_add, "reduce_sum": _reduce_sum}


def chain_op(eqn, x: Stacked, layout: DimAxes | None = None) -> Stacked | None:
    """A transpose, a cast, a mark (the value as it is: the parts are not the marked value) or a reshape applied to
    every device's part. A reshape's result is held in ``layout`` (the plan's, which keeps each device's block);
    None where it is not known. The target stays the final value's (``joined_sums``: no transpose after a join)."""
    if eqn.primitive.name == "mshard_mark":
        return x
    if eqn.primitive.name == "reshape":
        if layout is None or eqn.params.get("dimensions") is not None:
            return None
        v = x.value.reshape((x.value.shape[0], *eqn.params["new_sizes"]))
        return Stacked(v, x.axes, tuple(tuple(d) for d in layout), x.target)
    if eqn.primitive.name == "transpose":
        perm = eqn.params["permutation"]
        return Stacked(jnp.transpose(x.value, (0, *[p + 1 for p in perm])), x.axes,
                       tuple(x.layout[p] for p in perm), None if x.target is None else tuple(x.target[p] for p in perm))
    return Stacked(eqn.primitive.bind(x.value, **eqn.params), x.axes, x.layout, x.target)


def concatenate(eqn, parts, layout: DimAxes | None, target: DimAxes | None) -> Stacked | None:
    """Parts held alike, concatenated per device (the put-back of ``interleaved_parallel`` copies), to be summed
    into ``target``; None where their axes or layouts differ or the result's layout is not known."""
    first = parts[0]
    if layout is None or any(p.axes != first.axes or p.layout != first.layout for p in parts):
        return None
    v = jnp.concatenate([p.value for p in parts], axis=eqn.params["dimension"] + 1)
    return Stacked(v, first.axes, tuple(tuple(d) for d in layout),
                   None if target is None else tuple(tuple(d) for d in target))


def add(a: Stacked, b: Stacked) -> Stacked | None:
    """Two parts held alike, added per device; None where their axes or layouts differ."""
    if a.axes != b.axes or a.layout != b.layout:
        return None
    return Stacked(a.value + b.value, a.axes, a.layout)


def scattered_dims(layout: DimAxes, target: DimAxes, axes) -> dict[int, tuple[str, ...]] | None:
    """Per dim, the partial-sum ``axes`` that ``target`` splits it over after ``layout``'s own (its stack's tail):
    the dims a reduce-scatter leaves split. ``{}`` where ``target`` is ``layout``; None where ``target`` is not
    ``layout`` with some of ``axes`` appended to its dims' stacks.

    >>> scattered_dims(((), ("a",)), (("p",), ("a", "q")), ("p", "q", "r"))
    {0: ('p',), 1: ('q',)}
    >>> scattered_dims((("a",),), (("q", "a"),), ("q",)) is None
    True
    """
    if len(layout) != len(target):
        return None
    out: dict[int, tuple[str, ...]] = {}
    for d, (have, want) in enumerate(zip(layout, target)):
        have, want = tuple(have), tuple(want)
        if want[:len(have)] != have:
            return None
        if len(want) > len(have):
            out[d] = want[len(have):]
    used = [a for extra in out.values() for a in extra]
    if any(a not in axes for a in used) or len(set(used)) != len(used):
        return None
    return out


def materialize(x, mesh=None):
    """The sum of the parts; anything else as it is. One all-reduce over their axes, or, where ``x.target`` splits
    dims further over some of them (:func:`scattered_dims`, given the ``mesh``), a reduce-scatter over those and
    an all-reduce over the rest, which leaves the sum in ``x.target``."""
    if not isinstance(x, Stacked):
        return x
    extra = scattered_dims(x.layout, x.target, x.axes) if x.target is not None and mesh is not None else None
    if not extra:
        return jnp.sum(x.value, axis=0)
    rest = tuple(a for a in x.axes if all(a not in e for e in extra.values()))

    def body(v):
        v = v[0]
        for d, axes in extra.items():
            v = jax.lax.psum_scatter(v, axes, scatter_dimension=d, tiled=True)
        return jax.lax.psum(v, rest) if rest else v
    return jax.shard_map(body, mesh=jax_mesh(mesh), in_specs=PartitionSpec(x.axes, *spec_of(x.layout)),
                         out_specs=spec_of(x.target), check_vma=False)(x.value)
