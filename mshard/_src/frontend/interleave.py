"""MindSpore's ``interleaved_parallel``: a primitive object computed in copies of one loop dim on each device.

A ``Layout`` axis named ``"interleaved_parallel"`` is not devices (:data:`mshard._src.values.layout.INTERLEAVED`).
A dim laid out over it is split over its device axes as usual, and each device's block of it is cut into that many
copies; the op runs once per copy and the results are put back where the copies came from. The copies are
independent programs, so XLA's scheduler can overlap one copy's collectives with the next one's compute (what
MindSpore's micro-interleaving is for); their values are the op's. One exception: copies of a dot whose partial sums
are read split further over the reduced axes are put back first and reduce-scattered once
(:mod:`mshard._src.planning.joined_sums`): MindSpore's bytes in one collective, where MindSpore runs one per copy
into its interleaved tensor map and overlaps them.

Each cut is local: a dim of size ``N`` split ``n`` ways over devices is seen as ``[n, k, N / (n k)]`` (a reshape
that keeps the devices' blocks), copy ``i`` is ``[:, i]``, and the results are stacked back the same way.

>>> import jax.numpy as jnp
>>> x = jnp.arange(8.0)
>>> [take(x, 0, 2, 2, i).tolist() for i in range(2)]     # 2 devices' blocks [0..3], [4..7], 2 copies each
[[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0]]
>>> bool((put([take(x, 0, 2, 2, i) for i in range(2)], 0, 2, 2) == x).all())
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mshard._src.values.errors import StrategyError
from mshard._src.values.layout import INTERLEAVED, TensorStrategy


def take(x, axis: int, n: int, k: int, i: int):
    """Copy ``i`` of ``k`` of each of the ``n`` device blocks of ``x``'s dim ``axis``."""
    s = x.shape
    y = x.reshape(s[:axis] + (n, k, s[axis] // (n * k)) + s[axis + 1:])
    return jax.lax.index_in_dim(y, i, axis + 1, keepdims=False).reshape(s[:axis] + (s[axis] // k,) + s[axis + 1:])


def put(parts: Sequence, axis: int, n: int, k: int):
    """The inverse of :func:`take`: ``k`` copies stacked back into their device blocks."""
    s = parts[0].shape
    blocks = [p.reshape(s[:axis] + (n, 1, s[axis] // n) + s[axis + 1:]) for p in parts]
    return jnp.concatenate(blocks, axis + 1).reshape(s[:axis] + (s[axis] * k,) + s[axis + 1:])


def interleaved_dim(where: str, strategy: Sequence[TensorStrategy | None],
                    in_dims: Sequence[Sequence[str | None]]) -> tuple[str, int, int] | None:
    """(loop dim, device split, copies) that a strategy's ``interleaved_parallel`` asks, or None. One loop dim at
    most; its inputs must agree."""
    found: dict[str, tuple[int, int]] = {}
    for i, (st, dims) in enumerate(zip(strategy, in_dims)):
        if st is None or st.copies is None:
            continue
        for d, (letter, k) in enumerate(zip(dims, st.copies)):
            if k == 1:
                continue
            if letter is None:
                raise StrategyError(f"{where} input {i}: dim {d} is broadcast, so it cannot be computed in "
                                    f"{INTERLEAVED} copies; lay it out without {INTERLEAVED!r}.")
            if found.setdefault(letter, (st.counts[d], k)) != (st.counts[d], k):
                raise StrategyError(f"{where}: inputs disagree on the {INTERLEAVED} copies of a shared dim; give it "
                                    f"the same layout in every input.")
    if len(found) > 1:
        raise StrategyError(f"{where}: {INTERLEAVED} is given on {len(found)} loop dims; an op is computed in copies "
                            f"of one dim (MindSpore's Layout allows the alias once).")
    return next(((d, n, k) for d, (n, k) in found.items()), None)


def in_copies(fn: Callable, where: str, letter: str, n: int, k: int, shapes, in_dims, out_dims,
              each: Callable | None = None, merge: Callable | None = None) -> Callable:
    """``fn`` computed in ``k`` copies of loop dim ``letter`` (split ``n`` ways over devices): every input and
    output dim of that loop dim is cut by :func:`take` and put back by :func:`put`. The dim must be in every
    output (a copy of a reduced dim would give a partial result) and divide into ``n * k`` blocks. ``each(i, fn,
    parts)`` runs copy ``i`` (default ``fn(*parts)``; in a region, the copy annotated as the op, so it computes
    in the op's layout); ``merge(put_all, outs)`` puts the copies' results back (default ``put_all(*outs)``; in a
    region, annotated so the results stay where the copies computed them)."""
    for i, (shape, dims) in enumerate(zip(shapes, in_dims)):
        for d, lt in enumerate(dims):
            if lt == letter and shape[d] % (n * k):
                raise StrategyError(f"{where} input {i}: dim {d} (size {shape[d]}) is split {n} ways over devices "
                                    f"and {k} {INTERLEAVED} copies, which does not divide it; use a size divisible "
                                    f"by {n * k} or fewer copies.")
    for j, dims in enumerate(out_dims):
        if letter not in dims:
            raise StrategyError(f"{where}: {INTERLEAVED} asks the op in copies of a dim that output {j} does not "
                                f"keep (it is reduced); copies of it would give partial results. Interleave a dim "
                                f"the outputs keep, such as the batch or the rows.")

    def run(*tensors):
        outs, tree = [], None
        for i in range(k):
            part = [take(t, dims.index(letter), n, k, i) if letter in dims else t
                    for t, dims in zip(tensors, in_dims)]
            leaves, tree = jax.tree.flatten(fn(*part) if each is None else each(i, fn, part))
            outs.append(leaves)
        def put_all(*flat):
            merged = [put(flat[j * k:(j + 1) * k], dims.index(letter), n, k) for j, dims in enumerate(out_dims)]
            return merged[0] if len(merged) == 1 else tuple(merged)
        flat = [o[j] for j in range(len(out_dims)) for o in outs]
        merged = put_all(*flat) if merge is None else merge(put_all, flat)
        return jax.tree.unflatten(tree, jax.tree.leaves(merged))
    return run
