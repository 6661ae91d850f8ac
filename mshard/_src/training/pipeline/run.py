"""Run a pipeline schedule as one SPMD program: a ``lax.scan`` over the schedule's ticks inside a ``jax.shard_map``
that is manual over the stage mesh axes (the other axes stay Auto: XLA's partitioner places the data- and
model-parallel collectives inside each stage), activations and their cotangents sent to the next / previous stage
with ``lax.ppermute`` every tick. Where a stage is data parallel (no operator strategies), the ``shard_map`` is
manual over its data-parallel axes too (:class:`_Replicas`): each device runs its replica of the schedule on its
rows and the gradients are summed over the replicas once, after the ticks, not in every backward branch.

Every tick each stage looks up its own entry of the table (:mod:`mshard._src.training.pipeline.schedule`) and runs one branch of a
``lax.switch``: idle (nothing: bubble ticks are free by construction, no FLOPs), the forward of its virtual stage
on one micro-batch, or its backward. Kept per stage: its inputs (a ring of ``K`` micro-batch slots per chunk, ``K``
the most the schedule keeps alive, :func:`ring_size`), the cotangents received (the same), and each forward's
residuals until its backward (:class:`_Residuals`: the stages are different functions, so the ring holds the union
of their residual signatures). The backward then recomputes nothing, except the cells with ``recompute()``
(``jax.checkpoint``), whose residuals are their inputs: where forwards are recomputed is the recompute setting's
choice. ``keep_residuals=False`` keeps only the stage inputs and recomputes each stage's whole forward at backward
time (what ``bench/pipeline.py`` measures against). Measured (bench/pipeline.py, examples GPT, S=2 and 4, M=8,
CPU, the stages data parallel inside): keeping residuals compiles to 33% fewer FLOPs but 4.7x (S=2) / 6.6x (S=4)
the temp memory, and on a 2-core CPU runs 1.45x / 1.14x slower (the residual ring's memory traffic outweighs the
saved small matmuls); with the blocks' ``recompute()`` set, memory comes close to the whole-stage recompute's and
time is between the two.

:func:`run_gpipe_keeping_residuals` is the other executor: gpipe's forward ticks as one scan that JAX
differentiates, so every forward's residuals are kept until its backward (no recompute; memory grows with M).

The gradient is the sum over micro-batches of ``d(loss_i / M) / d params`` (the mean loss's gradient; with replicas
inside the stages, the mean over the replicas of each one's sum). A parameter
one stage owns (:mod:`mshard._src.training.pipeline.storage`) arrives split over the stages, is gathered whole onto its stage by
one ``all_to_all`` and its gradient leaves split the same way; a parameter two stages use (a tied embedding and
head) arrives whole and its gradient is psum-ed over the stages, so it gets both contributions and every stage
holds the same value after the update. The loss lives on the last stage and is psum-ed likewise.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from mshard._src.jaxpr.manual_collectives import SELF_PRICED_SCOPE
from mshard._src.training.pipeline.schedule import BWD, FWD, IDLE, Schedule
from mshard._src.training.pipeline.storage import StageStorage

_TICKS: list | None = None


@contextlib.contextmanager
def record_ticks():
    """Record what each pipeline tick ran, from the running program. In a program *traced* inside the block, the
    branch a stage runs at each tick also returns ``(kind, micro_batch, chunk)`` (the idle branch returns
    ``IDLE``); the executor's scan collects them per stage and every run of the program appends
    ``(stage, tick, kind, micro_batch, chunk)`` for each tick that did work, kind ``FWD`` / ``BWD``. Yields the list
    they are appended to. For tests and benchmarks (a measured bubble); :func:`run_pipeline` only (gpipe without
    recompute runs :func:`run_gpipe_keeping_residuals`, whose backward is JAX's transpose of its forward scan).

    >>> with record_ticks() as ticks:
    ...     pass                        # build and run a pipelined step here
    >>> ticks
    []
    """
    global _TICKS
    prev, _TICKS = _TICKS, []
    try:
        yield _TICKS
    finally:
        _TICKS = prev


def _append_ticks(sink: list, marks) -> None:
    """``marks[s, t] = (kind, micro, chunk)`` from a run -> ``sink`` entries for the ticks that did work."""
    marks = np.asarray(marks)
    sink.extend((s, t, int(k), int(i), int(c)) for s in range(marks.shape[0]) for t in range(marks.shape[1])
                for k, i, c in [marks[s, t]] if k != IDLE)


def ring_size(sched: Schedule) -> int:
    """The fewest slots per chunk so that no stage input or cotangent is overwritten before its backward reads it
    (a value arriving at tick ``a`` is written before that tick's compute)."""
    when, V = sched.when(), sched.stages * sched.chunks
    need = 1
    for vs in range(V):
        for i in range(sched.micro):
            b = when[(BWD, i, vs)]
            for k in range(1, sched.micro - i):
                arrive_f = when[(FWD, i + k, vs - 1)] + 1 if vs > 0 else when[(FWD, i + k, vs)]
                arrive_b = when[(BWD, i + k, vs + 1)] + 1 if vs < V - 1 else b + 1
                if arrive_f <= b or arrive_b <= b:
                    need = max(need, k + 1)
    return need


class _Residuals:
    """Where each virtual stage's backward finds what its forward kept (``keep_residuals``).

    ``jax.vjp`` of a stage returns its backward as a pytree whose leaves are the residuals. A leaf that is one of
    the stage's own inputs (a parameter, the stage input, a data or RNG leaf: ``jax.vjp`` hands those back as the
    same object) is read again at backward time; every other leaf is stored in a ring of ``K`` micro-batch slots
    per chunk. The stages are different functions with different residuals, so the ring holds, for each
    (shape, dtype), the most leaves of that signature any stage keeps, and each stage uses its own of them."""

    def __init__(self):
        self.where: dict[int, list] = {}          # vs -> per leaf ("in", k) | ("ring", slot index)
        self.slots: list[tuple[tuple[int, ...], Any]] = []     # ring slot index -> (shape, dtype)

    @staticmethod
    def split(leaves, inputs) -> tuple[list, list]:
        """-> (per leaf ("in", k) or ("ring", None), the ring leaves in order)."""
        ids = {id(x): k for k, x in enumerate(inputs)}
        where, kept = [], []
        for x in leaves:
            k = ids.get(id(x))
            if k is not None and inputs[k] is x:
                where.append(("in", k))
            else:
                where.append(("ring", None))
                kept.append(x)
        return where, kept

    def add(self, vs: int, where: list, kept: list) -> None:
        used: dict[tuple, int] = {}
        out, it = [], iter(kept)
        for w in where:
            if w[0] == "in":
                out.append(w)
                continue
            x = next(it)
            sig = (tuple(x.shape), jnp.dtype(x.dtype))
            n = used.get(sig, 0)
            used[sig] = n + 1
            idx = [j for j, sl in enumerate(self.slots) if sl == sig]
            if n >= len(idx):
                self.slots.append(sig)
                idx.append(len(self.slots) - 1)
            out.append(("ring", idx[n]))
        self.where[vs] = out

    def pack(self, vs: int, kept: list) -> tuple:
        vals = [jnp.zeros(sh, dt) for sh, dt in self.slots]
        it = iter(kept)
        for w in self.where[vs]:
            if w[0] == "ring":
                vals[w[1]] = next(it)
        return tuple(vals)

    def unpack(self, vs: int, ring_vals: tuple, inputs: list) -> list:
        return [inputs[w[1]] if w[0] == "in" else ring_vals[w[1]] for w in self.where[vs]]

    def check(self, vs: int, where: list) -> None:
        if [w[0] for w in where] != [w[0] for w in self.where[vs]] or \
                [w for w in where if w[0] == "in"] != [w for w in self.where[vs] if w[0] == "in"]:
            raise AssertionError(f"pipeline: virtual stage {vs}'s residuals differ between two traces of it")


def run_pipeline(stage_fn: Callable, params: Any, data: Any, carry: Sequence[jax.ShapeDtypeStruct],
                 sched: Schedule, mesh: jax.sharding.Mesh, stage_axes: tuple[str, ...], consts: Any = (),
                 param_specs: Sequence[Any] | None = None, keep_residuals: bool = True,
                 storage: StageStorage | None = None, data_specs: Sequence[Any] | None = None,
                 carry_specs: Sequence[Any] | None = None, replica_axes: tuple[str, ...] = ()):
    """-> (mean loss over the micro-batches, gradient of it w.r.t. ``params``), both replicated over the stages.

    ``stage_fn(vs, params, consts, carry, d) -> (carry, loss)`` runs virtual stage ``vs`` (static) on one
    micro-batch ``d`` (``consts``: inputs not differentiated, e.g. RNG state); ``carry`` is a tuple of arrays
    shaped as ``carry`` (what one stage hands the next); ``loss`` is a float32 scalar, used from the last virtual
    stage only. ``data`` leaves are ``[M, ...]`` (micro-batch first). ``param_specs`` (one PartitionSpec per
    leaf of ``params``, over the axes inside a stage) lays the parameters and their gradient sums out inside the
    stage as its operator strategies use them.

    ``storage`` (:mod:`mshard._src.training.pipeline.storage`): the parameters a stage owns arrive split over the
    stage axes on their stage dim, are gathered whole onto their stage only, and their gradients leave split the
    same way; the others
    (all of them without ``storage``) arrive whole and their gradients are summed over the stages.

    ``data_specs`` (per data leaf) and ``carry_specs`` (per carry slot): PartitionSpecs inside a stage (``None``:
    left to XLA) for one micro-batch's data and the activations handed on, so the devices of a stage share the
    micro-batch (data parallel) rather than each computing all of it.

    ``replica_axes``: the axes inside a stage that are data-parallel replicas (:func:`_replicated`): the
    ``shard_map`` is manual over them too, each device runs its replica of the schedule on its rows of every
    micro-batch (``data_specs`` say which data leaves are split; ``carry`` and ``stage_fn`` are one replica's), and
    the gradients are summed over the replicas once, after the ticks.

    ``keep_residuals``: each forward keeps its residuals (:class:`_Residuals`) until its backward, which then
    recomputes nothing; a cell with ``recompute()`` (``jax.checkpoint``) keeps only its inputs and is recomputed
    there, as the recompute setting says. ``False``: a stage keeps only its inputs and its backward recomputes
    the whole stage's forward (``jax.vjp`` at backward time).
    """
    S, M, v = sched.stages, sched.micro, sched.chunks
    V = S * v
    K = ring_size(sched)
    table = np.asarray(sched.table)
    fwd_perm = [(j, (j + 1) % S) for j in range(S)]
    bwd_perm = [(j, (j - 1) % S) for j in range(S)]
    res = _Residuals() if keep_residuals else None
    st = storage if storage is not None else StageStorage.build([set()] * len(params), params, None, S)
    rep, param_specs, data_specs, lay_d, lay_c = _replicated(mesh, stage_axes, replica_axes, data, data_specs,
                                                             carry_specs, param_specs)

    def plist(vs, pw):
        """Virtual stage ``vs``'s parameter list from ``pw = (own, p)`` (its own gathered, the shared whole)."""
        ps = st.params_for(vs % S, pw[0], pw[1])
        if param_specs is not None:
            ps = [lax.with_sharding_constraint(x, sp) for x, sp in zip(ps, param_specs)]
        return ps

    def grads_of(vs, gp, pw):
        """A parameter gradient list -> (this stage's own, per group; the shared ones, zeros for the owned)."""
        return st.own_grads(vs % S, gp), [jnp.zeros(x.shape, x.dtype) if st.split(j) else g
                                          for j, (g, x) in enumerate(zip(gp, pw[1]))]

    def stage_vjp(vs, ps, h, d):
        """(stage output, loss), its backward, and the inputs a residual may be."""
        cs = consts_in[0]
        out, vjp = jax.vjp(lambda p, h: stage_fn(vs, p, cs, h, d), ps, h)
        return out, vjp, list(ps) + list(h) + jax.tree.leaves(d) + jax.tree.leaves(cs)

    def fwd_branch(vs):
        def f(pw, h, d, g_h, r):
            zeros_r = tuple(map(jnp.zeros_like, r))
            ps = plist(vs, pw)
            zeros_g = (st.zeros_own(), [jnp.zeros(x.shape, x.dtype) for x in pw[1]])
            if res is None:
                h2, loss = stage_fn(vs, ps, consts_in[0], h, d)
                return h2, loss.astype(jnp.float32), zeros_g, tuple(map(jnp.zeros_like, h)), zeros_r
            (h2, loss), vjp, inputs = stage_vjp(vs, ps, h, d)
            where, kept = res.split(jax.tree.leaves(vjp), inputs)
            res.check(vs, where)
            return (h2, loss.astype(jnp.float32), zeros_g, tuple(map(jnp.zeros_like, h)), res.pack(vs, kept))
        return f

    def bwd_branch(vs):
        def f(pw, h, d, g_h, r):
            last = vs == V - 1
            ps = plist(vs, pw)
            if res is None:
                (h2, loss), vjp = jax.vjp(lambda p, h: stage_fn(vs, p, consts_in[0], h, d), ps, h)
            else:
                # the backward's structure from this trace, its residuals from the forward's tick: the forward
                # traced here to get that structure computes nothing used, and is removed as dead code
                (h2, loss), vjp, inputs = stage_vjp(vs, ps, h, d)
                leaves, treedef = jax.tree.flatten(vjp)
                res.check(vs, res.split(leaves, inputs)[0])
                vjp = jax.tree.unflatten(treedef, res.unpack(vs, r, inputs))
            g_out = tuple(jnp.zeros_like(x) for x in h2) if last else g_h
            gp, gh = vjp((g_out, jnp.asarray(1.0 / M if last else 0.0, loss.dtype)))
            return (tuple(map(jnp.zeros_like, h2)), jnp.zeros((), jnp.float32), grads_of(vs, gp, pw), gh,
                    tuple(map(jnp.zeros_like, r)))
        return f

    branches_f = [fwd_branch(vs) for vs in range(V)]
    branches_b = [bwd_branch(vs) for vs in range(V)]

    consts_in: list = [None]

    def probe(pw, d, zeros_c) -> None:
        """Every virtual stage's residual structure, from an abstract trace of its forward."""
        got: dict = {}
        for vs in range(V):
            def leaves_of(pw, h, d, vs=vs, got=got):
                _, vjp, inputs = stage_vjp(vs, plist(vs, pw), h, d)
                where, kept = res.split(jax.tree.leaves(vjp), inputs)
                got[vs] = where
                return kept
            shapes = jax.eval_shape(leaves_of, pw, zeros_c, jax.tree.map(lambda x: x[0], d))
            res.add(vs, got[vs], shapes)

    def local(p, cs, d):
        consts_in[0] = cs
        s = lax.axis_index(stage_axes)
        tab = jnp.asarray(table)
        ring_f = lay_c(tuple(jnp.zeros((v, K) + c.shape, c.dtype) for c in carry), 2)
        ring_b = lay_c(tuple(jnp.zeros((v, K) + c.shape, c.dtype) for c in carry), 2)
        zeros_c = lay_c(tuple(jnp.zeros(c.shape, c.dtype) for c in carry))
        pw = (st.gather(p, stage_axes, mesh), list(p))      # this stage's own parameters whole; the shared ones
        gacc = (st.zeros_own(), [jnp.zeros(x.shape, x.dtype) for x in p])
        if param_specs is not None:
            gacc = (gacc[0], [x if st.split(j) else lax.with_sharding_constraint(x, sp)
                              for j, (x, sp) in enumerate(zip(gacc[1], param_specs))])
        if res is not None:
            probe(pw, d, zeros_c)
        # one spare slot (K): the ticks that keep nothing write their (zero) residuals there, so the store is an
        # unconditional in-place update instead of a select that reads the slot back
        ring_r = tuple(jnp.zeros((v, K + 1) + sh, dt) for sh, dt in (res.slots if res is not None else ()))

        def store(ring, vals, ok, c, i):
            slot = i % K
            return tuple(r.at[c, slot].set(jnp.where(ok, x, r[c, slot])) for r, x in zip(ring, vals))

        def tick(state, t):
            ring_f, ring_b, ring_r, gacc, lacc, recv_f, recv_b = state
            prev = tab[jnp.maximum(t - 1, 0)]
            started = t > 0
            left, right = (s - 1) % S, (s + 1) % S
            kf, i_f, c_f = prev[left, 0], prev[left, 1], prev[left, 2]
            vs_left = c_f * S + left
            ok_f = started & (kf == FWD) & (vs_left < V - 1)
            ring_f = store(ring_f, recv_f, ok_f, jnp.where(s == 0, c_f + 1, c_f), i_f)
            kb, i_b, c_b = prev[right, 0], prev[right, 1], prev[right, 2]
            vs_right = c_b * S + right
            ok_b = started & (kb == BWD) & (vs_right > 0)
            ring_b = store(ring_b, recv_b, ok_b, jnp.where(s == S - 1, c_b - 1, c_b), i_b)
            k, i, c = tab[t, s, 0], tab[t, s, 1], tab[t, s, 2]
            vs = jnp.clip(c * S + s, 0, V - 1)
            slot = i % K
            h = tuple(r[c, slot] for r in ring_f)
            g_h = tuple(r[c, slot] for r in ring_b)
            r_in = tuple(r[c, slot] for r in ring_r)
            di = lay_d(jax.tree.map(lambda x: x[i], d))

            def idle(pw, h, di, g_h, r):
                return (zeros_c, jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, gacc), zeros_c,
                        tuple(map(jnp.zeros_like, r)), jnp.asarray([IDLE, -1, -1], jnp.int32))

            def fwd(pw, h, di, g_h, r):
                return lax.switch(vs, branches_f, pw, h, di, g_h, r) + (jnp.stack([FWD, i, c]).astype(jnp.int32),)

            def bwd(pw, h, di, g_h, r):
                return lax.switch(vs, branches_b, pw, h, di, g_h, r) + (jnp.stack([BWD, i, c]).astype(jnp.int32),)

            # mark: what the branch that ran says it did (record_ticks; dead code unless recorded)
            send_f, loss, gp, send_b, r_out, mark = lax.switch(k, [idle, fwd, bwd], pw, h, di, g_h, r_in)
            to = jnp.where(k == FWD, slot, K)
            ring_r = tuple(r.at[c, to].set(x) for r, x in zip(ring_r, r_out))
            lacc = lacc + jnp.where((k == FWD) & (vs == V - 1), loss, 0.0)
            gacc = jax.tree.map(jnp.add, gacc, gp)
            recv_f = tuple(lax.ppermute(x, stage_axes, fwd_perm) for x in lay_c(send_f))
            recv_b = tuple(lax.ppermute(x, stage_axes, bwd_perm) for x in lay_c(send_b))
            return (ring_f, ring_b, ring_r, gacc, lacc, recv_f, recv_b), mark

        init = (ring_f, ring_b, ring_r, gacc, jnp.zeros((), jnp.float32), zeros_c, zeros_c)
        (_, _, _, gacc, lacc, _, _), marks = lax.scan(tick, init, jnp.arange(sched.ticks))
        split = st.scatter(gacc[0], stage_axes, mesh)
        g = [rep.mean(split[j]) if st.split(j) else rep.mean(x, stage_axes) for j, x in enumerate(gacc[1])]
        return rep.mean(lacc, stage_axes) / M, g, marks[None]

    spec_p = [st.spec(j, stage_axes) for j in range(len(params))]
    spec_c = jax.tree.map(lambda _: P(), consts)
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec_p, spec_c, rep.data_specs), out_specs=(P(), spec_p, P(stage_axes)),
                      axis_names=set(stage_axes) | set(replica_axes), check_vma=False)
    with jax.named_scope(SELF_PRICED_SCOPE):           # training/pipeline/price.py prices it
        loss, grads, marks = f(list(params), consts, data if replica_axes else _lay_micro(data, data_specs, mesh))
    if _TICKS is not None:
        jax.debug.callback(functools.partial(_append_ticks, _TICKS), marks)
    return loss, grads


def run_gpipe_keeping_residuals(stage_fn: Callable, params: Any, data: Any, carry: Sequence[jax.ShapeDtypeStruct],
                                sched: Schedule, mesh: jax.sharding.Mesh, stage_axes: tuple[str, ...],
                                consts: Any = (), param_specs: Sequence[Any] | None = None,
                                storage: StageStorage | None = None, data_specs: Sequence[Any] | None = None,
                                carry_specs: Sequence[Any] | None = None, replica_axes: tuple[str, ...] = ()):
    """GPipe without recomputation: the forward ticks of the schedule (every forward, in its table order) as one
    scan, differentiated by JAX (``jax.value_and_grad`` of the ``shard_map``; the backward is the scan's
    transpose, ``ppermute`` transposes to the reverse permute). Each stage keeps the residuals of its forwards
    until the backward, instead of their inputs: no forward is recomputed, memory grows with the micro-batches.
    A bubble tick runs the idle branch of a ``lax.switch`` (nothing). Same contract as :func:`run_pipeline`."""
    S, M = sched.stages, sched.micro
    fwd_ticks = M + S - 1
    table = np.asarray(sched.table)[:fwd_ticks]
    assert sched.name == "gpipe" and sched.chunks == 1 and np.all(table[:, :, 0] != BWD)
    fwd_perm = [(j, j + 1) for j in range(S - 1)]

    st = storage if storage is not None else StageStorage.build([set()] * len(params), params, None, S)
    rep, param_specs, data_specs, lay_d, lay_c = _replicated(mesh, stage_axes, replica_axes, data, data_specs,
                                                             carry_specs, param_specs)

    def local(p, cs, d):
        s = lax.axis_index(stage_axes)
        tab = jnp.asarray(table)
        pw = (st.gather(p, stage_axes, mesh), list(p))       # the transpose (all_to_all) sends the gradients back split

        def plist(vs):
            ps = st.params_for(vs, pw[0], pw[1])
            if param_specs is not None:
                ps = [lax.with_sharding_constraint(x, sp) for x, sp in zip(ps, param_specs)]
            return ps
        zeros_c = lay_c(tuple(jnp.zeros(c.shape, c.dtype) for c in carry))
        branches = [lambda _, h, di, vs=vs: _as_f32(stage_fn(vs, plist(vs), cs, h, di)) for vs in range(S)]

        def idle(p, h, di):
            return zeros_c, jnp.zeros((), jnp.float32)

        def tick(state, t):
            recv, lacc = state
            k, i = tab[t, s, 0], tab[t, s, 1]
            di = lay_d(jax.tree.map(lambda x: x[i], d))
            out, loss = lax.switch(jnp.where(k == FWD, s + 1, 0), [idle] + branches, p, recv, di)
            lacc = lacc + jnp.where((k == FWD) & (s == S - 1), loss, 0.0)
            return (tuple(lax.ppermute(x, stage_axes, fwd_perm) for x in lay_c(out)), lacc), None

        vary = lambda x: lax.pcast(x, stage_axes, to="varying")
        init = (tuple(vary(x) for x in zeros_c), vary(jnp.zeros((), jnp.float32)))
        (_, lacc), _ = lax.scan(tick, init, jnp.arange(fwd_ticks))
        return rep.mean(lacc, stage_axes) / M

    spec_p = [st.spec(j, stage_axes) for j in range(len(params))]
    f = jax.shard_map(local, mesh=mesh, in_specs=(spec_p, jax.tree.map(lambda _: P(), consts), rep.data_specs),
                      out_specs=P(), axis_names=set(stage_axes) | set(replica_axes), check_vma=False)
    data = data if replica_axes else _lay_micro(data, data_specs, mesh)
    with jax.named_scope(SELF_PRICED_SCOPE):           # training/pipeline/price.py prices it
        return jax.value_and_grad(lambda p: f(p, consts, data))(list(params))


class _Replicas:
    """How a pipeline's ``shard_map`` treats the data-parallel devices inside a stage. Without replica axes it is
    manual over the stage axes only (XLA's partitioner splits a micro-batch's rows over the others, as
    ``data_specs`` lay them out, and sums each backward's gradient over them in the branch that computes it, once
    per micro-batch: a partial sum cannot leave a ``lax.switch``). With them it is manual over those axes too: each
    device runs its replica of every stage on its rows, keeps its own gradient sum over the ticks, and the sums are
    reduced over the replicas once, after the ticks (MindSpore's data parallel inside a stage)."""

    def __init__(self, mesh, axes: tuple[str, ...], data, data_specs):
        self.axes = tuple(axes)
        self.n = math.prod(mesh.shape[a] for a in self.axes)
        leaves, tree = jax.tree.flatten(data)
        specs = list(data_specs or ()) + [None] * len(leaves)
        self.data_specs = jax.tree.unflatten(tree, [P(None, self.axes) if self.axes and sp is not None else P()
                                                    for _, sp in zip(leaves, specs)])

    def mean(self, x, stage_axes: tuple[str, ...] = ()):
        """``x`` summed over ``stage_axes`` and averaged over the replicas: one all-reduce."""
        axes = tuple(stage_axes) + self.axes
        if not axes:
            return x
        y = lax.psum(x, axes)
        return y / self.n if self.n > 1 else y


def _replicated(mesh, stage_axes, replica_axes, data, data_specs, carry_specs, param_specs):
    """-> (the :class:`_Replicas`, and the parameter and data layouts and the constrainers a runner uses inside its
    ``shard_map``): with replica axes, each device's data and carry are one replica's, so nothing is laid out over
    them, and over every axis manual nothing is left to lay out."""
    if set(stage_axes) & set(replica_axes):
        raise AssertionError(f"pipeline: replica axes {replica_axes} overlap the stage axes {stage_axes}")
    rep = _Replicas(mesh, replica_axes, data, data_specs)
    if replica_axes:
        data_specs = carry_specs = None
        if set(stage_axes) | set(replica_axes) == set(mesh.axis_names):
            param_specs = None
    return (rep, param_specs, data_specs) + _constrainers(data_specs, carry_specs)


def _constrainers(data_specs, carry_specs):
    """-> (lay out one micro-batch's data, lay out a tuple of carry-shaped values with ``lead`` leading dims) inside
    the ``shard_map`` (its mesh's Auto axes), as the specs say; identities where they say nothing."""
    def lay_d(di):
        if not data_specs:
            return di
        leaves, tree = jax.tree.flatten(di)
        return jax.tree.unflatten(tree, [x if sp is None else lax.with_sharding_constraint(x, sp)
                                         for x, sp in zip(leaves, data_specs)])

    def lay_c(xs, lead: int = 0):
        if not carry_specs:
            return xs
        return tuple(x if sp is None else lax.with_sharding_constraint(x, P(*(None,) * lead, *sp))
                     for x, sp in zip(xs, carry_specs))
    return lay_d, lay_c


def _lay_micro(data, data_specs, mesh):
    """The ``[M, rows, ...]`` data laid out as one micro-batch is inside a stage (dim 1 as its dim 0)."""
    if not data_specs:
        return data
    leaves, tree = jax.tree.flatten(data)
    return jax.tree.unflatten(tree, [
        x if sp is None else lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, P(None, *sp)))
        for x, sp in zip(leaves, data_specs)])


def _as_f32(out):
    h, loss = out
    return tuple(h), loss.astype(jnp.float32)
