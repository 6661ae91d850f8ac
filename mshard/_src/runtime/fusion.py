"""Communication fusion: MindSpore's ``comm_fusion`` and ``all_reduce_fusion_config`` as gradient buckets.

MindSpore fuses the gradient collectives of a training step into buckets:

* ``comm_fusion={"allreduce": {"mode": "auto", "config": None}}`` (default): buckets of up to 64 MB;
* ``{"mode": "size", "config": 32}``: buckets of up to 32 MB;
* ``{"mode": "index", "config": [20, 35]}`` (allreduce only), or ``all_reduce_fusion_config=[20, 35]``:
  gradients 0-19 in one all-reduce, 20-34 in a second, the rest in a third;
* the same ``auto``/``size`` modes for ``"reducescatter"`` (optimizer-parallel gradients) and
  ``"allgather"`` (optimizer-parallel parameters).

In a hybrid-parallel step each device holds slices of the model-parallel gradients; a bucket is then one
all-reduce over the data-parallel replicas of the concatenation of the device's own slices
(:func:`all_reduce_sharded_buckets`), as MindSpore fuses the gradient all-reduces of each device.
Here a bucket is one explicit collective on the concatenation of its gradients
(:func:`all_reduce_buckets`, :func:`reduce_scatter_buckets`, :func:`all_gather_buckets`): the
per-replica gradients ``[dp, ...]`` are flattened into one ``[dp, n]`` array per bucket and reduced
over the replica axis with one explicit collective (``psum`` / ``psum_scatter`` / ``all_gather`` in a
``jax.shard_map``). Each bucket's collective takes a zero derived from the previous bucket's result,
so XLA's collective combiner (which on CPU merges every independent all-reduce into one) cannot
merge buckets back together. Gradients are numbered in parameter order
(the order of ``nnx.state(network)``, i.e. sorted attribute paths), as MindSpore numbers its
gradient all-reduces. ``all_reduce_fusion_config``, when set, takes precedence over
``comm_fusion["allreduce"]``.

>>> plan_buckets([4, 4, 4, 4], "index", (1, 3))
[[0], [1, 2], [3]]
>>> plan_buckets([40 * 2**20] * 3, "auto", None)
[[0], [1], [2]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mshard._src.values import context as ctxmod

AUTO_THRESHOLD_MB = 64


def fusion_setting(kind: str, ctx: ctxmod.ParallelContext | None = None) -> tuple[str, Any]:
    """The fusion setting of one collective kind: ``all_reduce_fusion_config`` if set (all-reduce only), else
    ``comm_fusion[kind]``, else the automatic 64 MB buckets.

    Args:
        kind: ``"allreduce"``, ``"reducescatter"`` or ``"allgather"``.
        ctx: the :class:`~mshard.context.ParallelContext` to read; None: the current one.

    Returns:
        ``(mode, config)``: ``("auto", None)``, ``("size", MB)`` or ``("index", gradient indices)``; pass it to
        :func:`plan_buckets`.

    >>> from mshard.context import ParallelContext
    >>> fusion_setting("allreduce"), fusion_setting("allreduce", ParallelContext(all_reduce_fusion_config=(20, 35)))
    (('auto', None), ('index', (20, 35)))
    """
    ctx = ctx or ctxmod.current()
    if kind == "allreduce" and ctx.all_reduce_fusion_config is not None:
        return "index", tuple(ctx.all_reduce_fusion_config)
    cfg = ctx.comm_fusion.get(kind)
    if cfg is None:
        return "auto", None
    return cfg["mode"], cfg["config"]


def is_default(ctx: ctxmod.ParallelContext | None = None) -> bool:
    """True when the context asks for nothing beyond the 64 MB automatic buckets."""
    ctx = ctx or ctxmod.current()
    return ctx.all_reduce_fusion_config is None and all(
        fusion_setting(k, ctx) == ("auto", None) for k in ("allreduce", "reducescatter", "allgather"))


def plan_buckets(nbytes: Sequence[int], mode: str, config: Any) -> list[list[int]]:
    """Group gradients ``0..n-1`` into the buckets a training step fuses into one collective each.

    Gradients are numbered in parameter order, as MindSpore numbers its gradient all-reduces.

    Args:
        nbytes: each gradient's size in bytes, in order.
        mode: ``"auto"`` (buckets of up to 64 MB), ``"size"`` (up to ``config`` MB) or ``"index"``.
        config: None for ``"auto"``, the bucket size in MB for ``"size"``, the increasing gradient indices where
            a new bucket starts for ``"index"``.

    Returns:
        The buckets, each a non-empty list of gradient indices, in order (a gradient larger than the limit has
        a bucket of its own).

    >>> plan_buckets([4, 4, 4, 4], "index", (1, 3))
    [[0], [1, 2], [3]]
    >>> plan_buckets([10 * 2**20] * 3 + [40 * 2**20], "size", 32)
    [[0, 1, 2], [3]]
    """
    n = len(nbytes)
    if n == 0:
        return []
    if mode == "index":
        bounds = [0] + [min(int(b), n) for b in config] + [n]
        out = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
        return [b for b in out if b]
    limit = (AUTO_THRESHOLD_MB if mode == "auto" else float(config)) * 2**20
    out: list[list[int]] = [[]]
    size = 0
    for i, nb in enumerate(nbytes):
        if out[-1] and size + nb > limit:
            out.append([])
            size = 0
        out[-1].append(i)
        size += nb
    return out


def _axes(axes: Sequence[str]):
    axes = tuple(axes)
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def ordered_after(x, token):
    """``x`` plus a zero computed from ``token``: a data dependency XLA keeps, so whatever consumes the result
    runs after ``token`` exists. Used to order a bucket's collective after the previous bucket's (so XLA's
    collective combiner cannot merge them; ``optimization_barrier`` is expanded before the combiner runs) and
    a recomputation after the cotangent that needs it (:meth:`mshard.nn.Cell.recompute`).
    ``select(isfinite(t), t, 0) * 0`` is 0 for every ``t`` (NaN and inf included) and XLA does not fold it."""
    t = jnp.asarray(token)
    return x + (jnp.where(jnp.isfinite(t), t, jnp.zeros_like(t)) * 0).astype(x.dtype)


def _smap(fn, mesh: Mesh, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _start(token):
    return jnp.zeros((), jnp.float32) if token is None else token


def _split_cols(red, pieces, shapes, out, idx, lead: bool):
    off = 0
    for i, k, shape in zip(idx, pieces, shapes):
        out[i] = (red[:, off:off + k] if lead else red[off:off + k]).reshape(shape)
        off += k


def all_reduce_buckets(stacked: Sequence[jax.Array], buckets: list[list[int]], mesh: Mesh,
                       dp_axes: Sequence[str], token: Any = None) -> tuple[list[jax.Array], Any]:
    """Sum per-replica gradients ``[dp, *shape]`` (dim 0 over ``dp_axes``) over the replicas: one all-reduce
    (``psum``) per bucket, on the concatenation of the bucket's flattened gradients.

    Returns the reduced (replicated) gradients in input order and a token (a scalar of the last bucket, as
    each device holds it: it is only used as a local data dependency) that orders later collectives after
    this one.
    """
    out: list[Any] = [None] * len(stacked)
    dp = _axes(dp_axes)
    for b in buckets:
        flat = jnp.concatenate([stacked[i].reshape(stacked[i].shape[0], -1) for i in b], axis=1)
        red = _smap(lambda f, t: jax.lax.psum(ordered_after(f[0], t), tuple(dp_axes)), mesh,
                    (P(dp, None), P()), P())(flat, _start(token))
        _split_cols(red, [int(np.prod(stacked[i].shape[1:])) for i in b], [stacked[i].shape[1:] for i in b],
                    out, b, lead=False)
        token = red[0]
    return out, token


def _local_buckets(arrays: Sequence[jax.Array], buckets: list[list[int]], mesh: Mesh, in_specs: Sequence[P],
                   out_specs: Sequence[P], rows: int, collective, shape_of, token: Any) -> tuple[list[jax.Array], Any]:
    """One collective per bucket on each device's own slices (a ``shard_map`` over every mesh axis): the
    bucket's local pieces, each reshaped to ``[rows, -1]``, are concatenated along dim 1, ``collective`` runs
    on that (after the previous bucket's token), and each result piece is cut back and reshaped by
    ``shape_of(local piece)``."""
    out: list[Any] = [None] * len(arrays)
    for b in buckets:
        def body(t, *locs):
            res = collective(ordered_after(jnp.concatenate([x.reshape(rows, -1) for x in locs], axis=1), t))
            pieces, off = [], 0
            for x in locs:
                n = x.size // rows
                pieces.append(res[:, off:off + n].reshape(shape_of(x)))
                off += n
            return (res[0, 0], *pieces)
        ins = (P(),) + tuple(in_specs[i] for i in b)
        outs = (P(),) + tuple(out_specs[i] for i in b)
        token, *res = _smap(body, mesh, ins, outs)(_start(token), *[arrays[i] for i in b])
        for i, r in zip(b, res):
            out[i] = r
    return out, token


def all_reduce_sharded_buckets(stacked: Sequence[jax.Array], specs: Sequence[P], buckets: list[list[int]],
                               mesh: Mesh, dp_axes: Sequence[str], token: Any = None) -> tuple[list[jax.Array], Any]:
    """:func:`all_reduce_buckets` for gradients that are also split over other (model-parallel) axes:
    ``stacked[i]`` is ``[dp, *shape]``, dim 0 over ``dp_axes`` and the rest laid out as ``specs[i]``. Each
    device reduces its own slices: one all-reduce per bucket, over ``dp_axes``, of the concatenation of its
    local pieces of the bucket's gradients, as MindSpore fuses the gradient all-reduces of a hybrid-parallel
    step. Returns the reduced gradients (laid out as ``specs``) in input order and a token."""
    dp = _axes(dp_axes)
    return _local_buckets(stacked, buckets, mesh, [P(dp, *sp) for sp in specs], specs, 1,
                          lambda f: jax.lax.psum(f, tuple(dp_axes)), lambda x: x.shape[1:], token)


def reduce_scatter_sharded_buckets(stacked: Sequence[jax.Array], specs: Sequence[P], zero_specs: Sequence[P],
                                   buckets: list[list[int]], mesh: Mesh, dp_axes: Sequence[str],
                                   shard_axes: Sequence[str], token: Any = None) -> tuple[list[jax.Array], Any]:
    """:func:`reduce_scatter_buckets` for gradients also split over model-parallel axes: ``stacked[i]`` is
    ``[dp, *shape]`` (dim 0 over ``dp_axes``, the rest as ``specs[i]``); each device reduce-scatters its own
    slices over ``shard_axes`` on their dim 0 (one collective per bucket, plus a ``psum`` over data-parallel
    axes not sharded over), giving each gradient in its optimizer-parallel layout ``zero_specs[i]``.

    Only the replicas' gradients differ: over a shard axis that is not a data-parallel one (a parameter no
    strategy splits, stored over the model-parallel devices too) every device holds the same gradient, so each
    takes its own chunk of it and the sum runs over the data-parallel shard axes alone. Summed over every shard
    axis, such a gradient came out times the model-parallel count (4 on dp 2 x mp 4)."""
    dp = _axes(dp_axes)
    rest = tuple(a for a in dp_axes if a not in shard_axes)
    keep = tuple(a for a in shard_axes if a in dp_axes)
    sizes = [mesh.shape[a] for a in shard_axes]
    s = int(np.prod(sizes))

    def collective(f):
        x = f.reshape(*sizes, f.shape[1])                  # row r of f: the chunk of shard index r, major first
        for k in reversed(range(len(shard_axes))):
            if shard_axes[k] not in dp_axes:               # the same gradient on each: this device's own chunk
                x = jax.lax.dynamic_index_in_dim(x, jax.lax.axis_index(shard_axes[k]), axis=k, keepdims=False)
        x = x.reshape(-1, f.shape[1])
        red = jax.lax.psum_scatter(x, keep, scatter_dimension=0, tiled=True) if keep else x
        return jax.lax.psum(red, rest) if rest else red
    return _local_buckets(stacked, buckets, mesh, [P(dp, *sp) for sp in specs], zero_specs, s, collective,
                          lambda x: (x.shape[1] // s, *x.shape[2:]), token)


def all_gather_sharded_buckets(shards: Sequence[jax.Array], zero_specs: Sequence[P], specs: Sequence[P],
                               buckets: list[list[int]], mesh: Mesh, shard_axes: Sequence[str],
                               token: Any = None) -> tuple[list[jax.Array], Any]:
    """Gather optimizer-parallel parameters (``zero_specs``: dim 0 also over ``shard_axes``) back to their
    layouts ``specs``, each device gathering its own model-parallel slices: one all-gather per bucket."""
    s = int(np.prod([mesh.shape[a] for a in shard_axes]))
    return _local_buckets(shards, buckets, mesh, zero_specs, specs, 1,
                          lambda f: jax.lax.all_gather(f, tuple(shard_axes), axis=0, tiled=True),
                          lambda x: (s * x.shape[0], *x.shape[1:]), token)


def reduce_scatter_buckets(stacked: Sequence[jax.Array], buckets: list[list[int]], mesh: Mesh,
                           dp_axes: Sequence[str], shard_axes: Sequence[str], token: Any = None):
    """Sum per-replica gradients ``[dp, n0, ...]`` over the replicas into dim-0 shards over ``shard_axes``:
    one reduce-scatter (``psum_scatter``, plus a ``psum`` over data-parallel axes not sharded over) per bucket.
    Every gradient's dim 0 must divide by the shard count."""
    out: list[Any] = [None] * len(stacked)
    dp, sh = _axes(dp_axes), _axes(shard_axes)
    rest = tuple(a for a in dp_axes if a not in shard_axes)
    s = int(np.prod([mesh.shape[a] for a in shard_axes]))

    def body(f, t):
        x = jax.lax.psum_scatter(ordered_after(f[0], t), tuple(shard_axes), scatter_dimension=0, tiled=True)
        x = jax.lax.psum(x, rest) if rest else x
        return x, x[0, 0]        # the token: this device's own element, no communication
    for b in buckets:
        pieces = [stacked[i].reshape(stacked[i].shape[0], s, -1) for i in b]
        flat = jnp.concatenate(pieces, axis=2)
        red, token = _smap(body, mesh, (P(dp, None, None), P()), (P(sh, None), P()))(flat, _start(token))
        _split_cols(red, [p.shape[2] for p in pieces], [stacked[i].shape[1:] for i in b], out, b, lead=True)
        for i in b:
            out[i] = jax.lax.with_sharding_constraint(out[i], NamedSharding(mesh, P(sh)))
    return out, token


def all_gather_buckets(shards: Sequence[jax.Array], buckets: list[list[int]], mesh: Mesh,
                       shard_axes: Sequence[str], token: Any = None):
    """Gather dim-0-sharded arrays (over ``shard_axes``) to replicated ones: one all-gather per bucket."""
    out: list[Any] = [None] * len(shards)
    sh = _axes(shard_axes)
    s = int(np.prod([mesh.shape[a] for a in shard_axes]))
    for b in buckets:
        pieces = [shards[i].reshape(s, -1) for i in b]
        flat = jnp.concatenate(pieces, axis=1)
        full = _smap(lambda f, t: jax.lax.all_gather(ordered_after(f, t), tuple(shard_axes), axis=0, tiled=True), mesh,
                     (P(sh, None), P()), P())(flat, _start(token))
        _split_cols(full, [p.shape[1] for p in pieces], [shards[i].shape for i in b], out, b, lead=True)
        token = full[0, 0]
    return out, token
