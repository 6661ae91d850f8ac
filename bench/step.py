"""Per-step time of mshard's TrainOneStepCell against a hand-written jax.jit step with identical shardings,
and per-device memory of each training feature on and off.

    python bench/step.py [--steps 10] [--repeats 7] [--size tiny|small|medium] [--modes data_parallel,semi_auto_parallel]
                         [--features optimizer_parallel,optimizer_level2,optimizer_level3,recompute,
                                     grad_accumulation,pipeline]
    python bench/step.py --smoke          # a 1-layer model, 2 steps, 1 repeat, Megatron + 2 features: that it runs

Time: a 4-layer GPT (nn.TransformerBlock) trained with AdamW. The hand-written step is plain JAX: one
``jax.jit`` of ``nnx.value_and_grad`` + ``optax`` over the TrainOneStepCell's state pytree, with
``in_shardings``/``out_shardings`` taken from the arrays mshard placed (parameters, optimizer state, data)
and the state donated; it is called in the usual functional loop (``state, loss = step(state, x, y)``).
Runs alternate (mshard, hand-written, mshard's compiled step called directly, ...), ``--steps`` steps each
after a warm-up; the reported ratio is the median over ``--repeats`` of (mshard time / hand-written time),
target <= 1.02, and the Python overhead ratio is mshard's step against its own executable called directly.
In semi_auto_parallel (Megatron: dp=2, mp=devices/2) the hand-written step is the GPT forward in plain JAX
with Megatron's layouts written by hand (``with_sharding_constraint`` on q/k/v, heads, scores, context,
the MLP's hidden activation, the block outputs, and the layer norms and residual adds batch-split and
replicated over the model-parallel devices, as in Megatron: :func:`megatron_forward`), the same shardings
mshard's ``shard_megatron`` asks for; the collectives of both compiled steps are printed side by side. A
second hand-written step leaves the layer norms and residual adds to XLA (which then splits them over
every device, as sequence parallelism does): its ratio is printed too. Megatron with
``all_reduce_fusion_config`` (per-replica gradients, bucketed) is timed against Megatron without it. Each training
feature of ``--features`` is timed in data_parallel against a hand-written step that does the same: optimizer
parallel (the hand-written jit gets the ZeRO-sharded optimizer state mshard placed, and XLA partitions the update),
recompute (the same recomputing blocks, ``jax.checkpoint``), gradient accumulation over 2 micro-batches (a
``lax.scan`` of value_and_grad over the micro-batches, then one update), and MindSpore's optimizer levels
(``parallel_optimizer_config={"optimizer_level": ...}`` with ``enable_parallel_optimizer=True``): level2, which
mshard compiles to level1's program, and level3 (FSDP, ZeRO-3: the parameters are stored in their ZeRO layout too,
so the step's inputs and updated weights stay sharded and are gathered where they compute), each against the same
plain jit of value_and_grad + optax with the shardings mshard placed (for level3 the parameters come in sharded and
XLA gathers them). The pipeline row (``pipeline_stages=2``, nn.PipelineCell over 4 micro-batches, 1f1b; the
embeddings on stage 0, the blocks split evenly, the final norm and head on the last stage) is NOT like-for-like: a
hand-written pipeline is out of scope, so its baseline is the hand-written data-parallel jit step of the same model
without stages (its JSON row says so in ``baseline``): the ratio is pipeline against data parallel.

Memory: the compiled step's ``memory_analysis()`` per device, for optimizer parallel (argument bytes and
optimizer-state bytes from shard shapes), recompute of every block (temp bytes) and gradient accumulation
over 2 micro-batches (temp bytes), each against the same step without the feature; optimizer level2 and level3
(FSDP) against level1 (argument bytes, and for level3 the parameter bytes from shard shapes: level3's arguments
are smaller by (n-1)/n of the parameter bytes that ZeRO shards, i.e. those of at least
``parallel_optimizer_threshold`` (64 KB); the smoke model has none); recompute's temp bytes per
route (TrainOneStepCell in data_parallel and Megatron, ms.jit of nnx.grad, plain flax modules through
ms.recompute: :func:`recompute_routes`); and the parameter
bytes per device (shard shapes) with Megatron against data parallel. Everything printed also goes to
``bench/out/step.json`` (``--out``).

Python overhead: mshard's per-step Python (the executable stubbed out) against flattening the same state
pytree, which the hand-written call also does.

Devices: 8 simulated CPU devices unless JAX sees accelerators (then every accelerator). On CPU, keep
``--steps`` small: many asynchronously queued 8-device executions can exhaust XLA:CPU's collective
rendezvous (a 40 s termination timeout) on a loaded 2-core machine, for mshard and hand-written alike.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import _cpu8  # noqa: F401  first: 8 simulated CPU devices before JAX is imported, quiet XLA, paths
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from gpt import GPT
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mshard as ms
from mshard import nn
from mshard._src.runtime.fastcall import fast_call, module_variables

SIZES = {"smoke": dict(vocab=32, hidden=16, heads=4, ffn=32, seq=8, batch=16, layers=1),
         "tiny": dict(vocab=64, hidden=32, heads=4, ffn=128, seq=16, batch=16, layers=4),
         "small": dict(vocab=256, hidden=128, heads=4, ffn=512, seq=64, batch=16, layers=4),
         "medium": dict(vocab=512, hidden=256, heads=8, ffn=1024, seq=128, batch=32, layers=4),
         # weights much larger than a device's activations (32 tokens per device): what FSDP is for
         "wide": dict(vocab=256, hidden=512, heads=8, ffn=2048, seq=16, batch=16, layers=8)}
LOSS = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
# training features timed (data_parallel) against a hand-written step doing the same: make_step's keywords
FEATURES = {"optimizer_parallel": {"zero": True},
            "optimizer_level2": {"zero": True, "level": "level2"},
            "optimizer_level3": {"zero": True, "level": "level3"},        # FSDP
            "recompute": {"recompute": True},
            "grad_accumulation": {"micro": 2},
            "pipeline": {"pipeline": (2, 4)}}                            # (stages, micro-batches)
# make_step keywords the hand-written step does not do: its model is built without them (then it is not like-for-like)
HAND_WRITTEN_WITHOUT = ("pipeline",)
BASELINES = {"pipeline": "hand-written data-parallel jax.jit without stages (pipeline vs data parallel, not "
                         "like-for-like)"}


def batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, cfg["vocab"], size=(cfg["batch"], cfg["seq"] + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def make_step(cfg, mode, n, *, megatron=False, recompute=False, micro=None, zero=False, level="level1",
              pipeline=None):
    """``zero``: optimizer parallel at ``level`` (MindSpore's optimizer_level; level3 is FSDP); ``micro``: gradient
    accumulation over that many micro-batches; ``pipeline``: (stages, micro-batches) of an nn.PipelineCell."""
    stages, micro_size = pipeline or (1, None)
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode=mode, device_num=n, gradients_mean=True, pipeline_stages=stages,
                                 enable_parallel_optimizer=zero, parallel_optimizer_config={"optimizer_level": level})
    net = GPT(nnx.Rngs(0), **{k: v for k, v in cfg.items() if k != 'batch'})
    for block in net.blocks:
        if megatron:
            block.shard_megatron(2, n // 2)
        if recompute:
            block.recompute()
    loss = nn.WithLossCell(stage_cells(net, stages) if pipeline else net, LOSS)
    loss = nn.PipelineCell(loss, micro_size) if pipeline else loss
    return nn.TrainOneStepCell(nn.GradAccumulationCell(loss, micro) if micro else loss, optax.adamw(1e-3))


def stage_cells(net, stages):
    """``net``'s cells on ``stages`` pipeline stages: the embeddings on the first, the blocks split evenly, the final
    norm and the head on the last (as tests/e2e/pipeline/test_pipeline.py's staged GPT)."""
    net.embedding.pipeline_stage = net.position.pipeline_stage = 0
    for i, block in enumerate(net.blocks):
        block.pipeline_stage = i * stages // len(net.blocks)
    net.final_norm.pipeline_stage = net.head.pipeline_stage = stages - 1
    return net


def placed(cfg, mode, n, **kw):
    """make_step's step run twice (compiled, its state placed) and the batch placed under its context."""
    step = make_step(cfg, mode, n, **kw)
    data = ms.dataset.shard_batch(batch(cfg))
    for _ in range(2):
        step(*data)
    return step, data


def hand_written(step, data, micro=None):
    """jax.jit of value_and_grad + optax over the TrainOneStepCell's state, with the shardings mshard placed.
    ``micro``: the gradient accumulated over that many micro-batches by a ``lax.scan`` (the network is then a
    GradAccumulationCell, whose loss cell the scan differentiates)."""
    gdef, state = nnx.split(step)
    state_sh = jax.tree.map(lambda a: a.sharding, state)
    data_sh = tuple(x.sharding for x in data)

    def accumulated(net, x, y):
        gd, params, rest = nnx.split(net.network, nnx.Param, ...)
        xs, ys = (a.reshape(micro, a.shape[0] // micro, *a.shape[1:]) for a in (x, y))

        def body(acc, d):
            loss, g = jax.value_and_grad(lambda p: nnx.merge(gd, p, rest)(*d))(params)
            return jax.tree.map(jnp.add, acc, (loss, g)), None
        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, g), _ = jax.lax.scan(body, zero, (xs, ys))
        g = jax.tree.map(lambda v: v / micro, g)
        # the accumulation cell's parameters are its loss cell's, one level down: the same leaves in order
        return loss / micro, jax.tree.unflatten(jax.tree.structure(nnx.state(net, nnx.Param)), jax.tree.leaves(g))

    def fn(state, x, y):
        m = nnx.merge(gdef, state)
        net, opt = m.network, m.optimizer
        loss, g = accumulated(net, x, y) if micro else nnx.value_and_grad(lambda n: n(x, y))(net)
        opt.update(net, g)
        return nnx.state(m), loss

    jitted = jax.jit(fn, in_shardings=(state_sh, *data_sh), out_shardings=(state_sh, None), donate_argnums=0)
    return jitted, jax.tree.map(lambda a: jax.device_put(jnp.copy(a), a.sharding), state)


def megatron_forward(net, ids, mesh, dp, mp, exact=True):
    """The GPT forward in plain JAX with Megatron's layouts written by hand (``with_sharding_constraint``
    where Megatron puts them): q/k/v and the first MLP Dense column parallel (hidden split over ``mp``),
    attention heads split over ``mp``, the projections row parallel (one all-reduce each), layer norms and
    residual adds batch-split over ``dp`` and replicated over ``mp`` (``exact``; with ``exact=False`` they
    are left to XLA). The Cells are called outside an mshard region: plain JAX."""
    def C(x, *spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

    def R(x):                          # Megatron's replicated-over-mp activations
        return C(x, dp, None, None) if exact else x

    b, s = ids.shape
    x = C(net.embedding(ids) + net.position(jnp.arange(s))[None], dp, None, None)
    for blk in net.blocks:
        att = blk.attention
        h = R(blk.layernorm1(x))
        heads = [C(C(d(h), dp, None, mp).reshape(b, s, att.num_heads, att.head_dim).transpose(0, 2, 1, 3),
                   dp, mp, None, None) for d in (att.query, att.key, att.value)]
        q, k, v = heads
        scores = C(jnp.einsum("bhsd,bhtd->bhst", q, k) * (1.0 / np.sqrt(att.head_dim)), dp, mp, None, None)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), dtype=bool)), scores, jnp.asarray(-1e9, scores.dtype))
        probs = C(jax.nn.softmax(scores, axis=-1), dp, mp, None, None)
        ctx = C(jnp.einsum("bhst,bhtd->bhsd", probs, v), dp, mp, None, None)
        ctx = C(ctx.transpose(0, 2, 1, 3).reshape(b, s, att.hidden_size), dp, None, mp)
        x = R(x + C(att.projection(ctx), dp, None, None))
        f = C(blk.output.mapping(R(blk.layernorm2(x))), dp, None, mp)
        x = R(x + C(blk.output.projection(f), dp, None, None))
    return net.head(net.final_norm(x))


def hand_written_megatron(step, data, exact=True):
    """jax.jit of value_and_grad + optax with Megatron written by hand (:func:`megatron_forward`), the
    parameters and optimizer state on the shardings mshard placed; the model-parallel mesh axes are read off
    the placed query weight (its dim 0), the data-parallel axes are the rest of the mesh."""
    gdef, state = nnx.split(step)
    state_sh = jax.tree.map(lambda a: a.sharding, state)
    data_sh = tuple(x.sharding for x in data)
    net0 = step.network.backbone_network
    wq = net0.blocks[0].attention.query.weight[...].sharding
    mesh, mp = wq.mesh, wq.spec[0]
    mp_axes = (mp,) if isinstance(mp, str) else tuple(mp)
    dp = tuple(a for a in mesh.axis_names if a not in mp_axes)     # Megatron: the rest of the mesh is data parallel

    def fn(state, x, y):
        m = nnx.merge(gdef, state)
        net, opt = m.network, m.optimizer
        loss, g = nnx.value_and_grad(lambda n: LOSS(megatron_forward(n.backbone, x, mesh, dp, mp, exact), y))(net)
        opt.update(net, g)
        return nnx.state(m), loss

    jitted = jax.jit(fn, in_shardings=(state_sh, *data_sh), out_shardings=(state_sh, None), donate_argnums=0)
    return jitted, jax.tree.map(lambda a: jax.device_put(jnp.copy(a), a.sharding), state)


def timed(fn, steps):
    t0 = time.perf_counter()
    out = None
    for _ in range(steps):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def bench_time(cfg, mode, n, steps, repeats, megatron=False, **feature):
    """``feature``: one of make_step's training features (zero=True at an optimizer level, recompute=True, micro=k),
    also in the hand-written step (the same optimizer-state and, at level3, parameter shardings; the same
    recomputing blocks; a scanned accumulation). The keywords of :data:`HAND_WRITTEN_WITHOUT` (a pipeline) are
    mshard's only: the hand-written step is then that of the same model without them, placed and compiled under
    its own context before mshard's step is made."""
    hw_feature = {k: v for k, v in feature.items() if k not in HAND_WRITTEN_WITHOUT}
    base, data_hw = placed(cfg, mode, n, megatron=megatron, **hw_feature)      # compile and place
    jitted, state = (hand_written_megatron(base, data_hw) if megatron else
                     hand_written(base, data_hw, micro=feature.get("micro")))
    box = [state]
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    rep_hw = ms.comm_report(jitted, state, *data_hw)

    def hand():
        box[0], loss = jitted(box[0], *data_hw)
        return loss
    for _ in range(2):
        hand()                                        # compiled before a pipeline's context replaces this one
    step, data = placed(cfg, mode, n, megatron=megatron, **feature) if hw_feature != feature else (base, data_hw)
    rep_ms = ms.comm_report(step, *data)
    comm = {k: {"mshard": [rep_ms.count(k), rep_ms.bytes(k)], "hand_written": [rep_hw.count(k), rep_hw.bytes(k)]}
            for k in kinds if rep_ms.count(k) or rep_hw.count(k)}

    free = None
    if megatron:                                      # Megatron with layer norms / residuals left to XLA
        jf, sf = hand_written_megatron(step, data, exact=False)
        fbox = [sf]
        rep_f = ms.comm_report(jf, sf, *data)
        for k in kinds:
            if k in comm or rep_f.count(k):
                comm.setdefault(k, {"mshard": [rep_ms.count(k), rep_ms.bytes(k)],
                                    "hand_written": [rep_hw.count(k), rep_hw.bytes(k)]})
                comm[k]["hand_written_ln_free"] = [rep_f.count(k), rep_f.bytes(k)]

        def free():
            fbox[0], loss = jf(fbox[0], *data)
            return loss
        for _ in range(2):
            free()
    comp, variables = compiled_step(step, data)      # the compiled step mshard calls (bench only: internals)

    def direct():                                     # the same executable with no mshard Python around it
        vals = [v.get_raw_value() for v in variables]
        outs = comp.jitted(*vals, *data)
        n_user = len(outs) - len(comp.changed)
        for i, x in zip(comp.changed, outs[n_user:]):
            variables[i].set_raw_value(x)
        return outs[0]

    ms_t, hw_t, dr_t, ratios, overhead, free_r = [], [], [], [], [], []
    for _ in range(repeats):
        a = timed(lambda: step(*data), steps)
        b = timed(hand, steps)
        c = timed(direct, steps)
        if free is not None:
            free_r.append(a / timed(free, steps))
        ms_t.append(a)
        hw_t.append(b)
        dr_t.append(c)
        ratios.append(a / b)
        overhead.append(a / c)
    med = statistics.median
    extra = {"ratio_vs_ln_free_median": med(free_r), "ratios_vs_ln_free": free_r} if free_r else {}
    return med(ms_t), med(hw_t), med(dr_t), med(ratios), ratios, med(overhead), comm, extra


def compiled_step(step, data):
    """The step region's compiled program for ``data`` and the TrainOneStepCell's Variables in its parameter order
    (bench only: internals)."""
    comp = step._rt.region._prepare((*data, step, step._rt.last), {})[0]
    return comp, module_variables([step])


def python_overhead(cfg, n, calls=2000):
    """Per-step Python time of mshard's step with the compiled executable stubbed out (bench only: internals),
    and of flattening the same state pytree, which a hand-written ``jitted(state, ...)`` call also pays."""
    step = make_step(cfg, "data_parallel", n)
    data = ms.dataset.shard_batch(batch(cfg))
    for _ in range(2):
        jax.block_until_ready(step(*data))
    comp, variables = compiled_step(step, data)
    loss = jnp.zeros(())

    class Stub:
        def __init__(self, comp):
            self.changed, self.out_tree, self.in_shardings = comp.changed, comp.out_tree, comp.in_shardings

        def jitted(self, *args):
            return [loss] + [args[i] for i in self.changed]
    real = step._rt.fast
    step._rt.fast = fast_call(Stub(comp), variables, data, donate=False)   # mshard's fast path, no executable
    t0 = time.perf_counter()
    for _ in range(calls):
        step(*data)
    ms_us = (time.perf_counter() - t0) / calls * 1e6
    step._rt.fast = real
    _, state = nnx.split(step)
    t0 = time.perf_counter()
    for _ in range(calls):
        jax.tree.flatten(state)
    return ms_us, (time.perf_counter() - t0) / calls * 1e6, len(variables)


def per_device_bytes(tree):
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def bench_memory(cfg, n):
    data = batch(cfg)
    rows = []

    def mem(**kw):
        step = make_step(cfg, "data_parallel", n, **kw)
        step(*data)
        return step, step.lower(*data).compile().memory_analysis()

    off_s, off = mem()
    on_s, on = mem(zero=True)
    rows.append(("optimizer parallel: optimizer state B/device", per_device_bytes(off_s.opt_state),
                 per_device_bytes(on_s.opt_state)))
    rows.append(("optimizer parallel: step arguments B/device", off.argument_size_in_bytes, on.argument_size_in_bytes))
    for level in ("level2", "level3"):
        lv_s, lv = mem(zero=True, level=level)
        rows.append((f"optimizer {level} vs level1: step arguments B/device", on.argument_size_in_bytes,
                     lv.argument_size_in_bytes))
    # level3 (FSDP) stores the ZeRO-sharded parameters sharded: (n-1)/n of their bytes leave the arguments
    rows.append(("optimizer level3 vs level1: parameter B/device", per_device_bytes(nnx.state(on_s.network, nnx.Param)),
                 per_device_bytes(nnx.state(lv_s.network, nnx.Param))))
    _, rc = mem(recompute=True)
    rows.append(("recompute (every block): temp B/device", off.temp_size_in_bytes, rc.temp_size_in_bytes))
    _, acc = mem(micro=2)
    rows.append(("accumulation (2 micro-batches): temp B/device", off.temp_size_in_bytes, acc.temp_size_in_bytes))
    return rows


def bench_fused(cfg, n, steps, repeats, config=(40, 80)):
    """Megatron with ``all_reduce_fusion_config`` (per-replica gradients, bucketed all-reduces over the 2
    replicas) against the same step without it (XLA places and combines the reductions)."""
    def make(fused):
        step = make_step(cfg, "semi_auto_parallel", n, megatron=True)
        if fused:
            ms.set_auto_parallel_context(all_reduce_fusion_config=list(config))
        data = ms.dataset.shard_batch(batch(cfg))
        for _ in range(2):
            step(*data)
        rep = ms.comm_report(step, *data)
        return step, data, sum(c.kind == "all-reduce" and c.group_size == 2 for c in rep.collectives)
    plain, dp_, n_plain = make(False)
    fused, df, n_fused = make(True)
    ratios = []
    for _ in range(repeats):
        a = timed(lambda: plain(*dp_), steps)
        b = timed(lambda: fused(*df), steps)
        ratios.append(b / a)
    return {"config": list(config), "ratio_median": statistics.median(ratios), "ratios": ratios,
            "replica_all_reduces": {"fused": n_fused, "xla": n_plain}}


class _PlainFFN(nnx.Module):
    """A plain flax block (not a Cell), for the route ``ms.recompute(module)``."""

    def __init__(self, hidden, ffn, rngs):
        self.up, self.down = nnx.Linear(hidden, ffn, rngs=rngs), nnx.Linear(ffn, hidden, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class _PlainStack(nn.Cell):
    def __init__(self, hidden, ffn, recompute, rngs):
        self.blocks = nnx.List([_PlainFFN(hidden, ffn, rngs) for _ in range(4)])
        for b in self.blocks if recompute else ():
            ms.recompute(b)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def recompute_routes(cfg, n):
    """Temp bytes per device with every block recomputed against without, per route: TrainOneStepCell in
    data_parallel (the per-replica path) and in Megatron semi_auto, ms.jit of nnx.grad, and plain flax modules
    made to recompute with ms.recompute (TrainOneStepCell, data_parallel)."""
    data = batch(cfg)
    rows = []

    def temp_step(mode, megatron, on):
        step = make_step(cfg, mode, n, megatron=megatron, recompute=on)
        return step.lower(*data).compile().memory_analysis().temp_size_in_bytes

    def temp_grad(on):
        step = make_step(cfg, "data_parallel", n, recompute=on)
        net = step.network
        f = ms.jit(nnx.grad(lambda m, x, y: m(x, y)))
        return f.lower(net, *data).compile().memory_analysis().temp_size_in_bytes

    def temp_plain(on):
        ms.reset_auto_parallel_context()
        ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=n, gradients_mean=True)
        # 8x the GPT's tokens: at the GPT's own 1,024 rows (128 a device) the blocks' insides are a small part of the
        # step's temp (its gradients), and recompute changes nothing measurable, for Cells and plain modules alike
        x = np.random.default_rng(0).standard_normal((8 * cfg["batch"] * cfg["seq"], cfg["hidden"])).astype(np.float32)
        step = nn.TrainOneStepCell(nn.WithLossCell(_PlainStack(cfg["hidden"], cfg["ffn"], on, nnx.Rngs(0)),
                                                   nn.MSELoss()), optax.sgd(1e-2))
        return step.lower(x, x).compile().memory_analysis().temp_size_in_bytes
    rows.append(("recompute route TrainOneStepCell data_parallel: temp B/device",
                 temp_step("data_parallel", False, False), temp_step("data_parallel", False, True)))
    if n % 2 == 0 and n > 1:
        rows.append((f"recompute route TrainOneStepCell Megatron (dp=2, mp={n // 2}): temp B/device",
                     temp_step("semi_auto_parallel", True, False), temp_step("semi_auto_parallel", True, True)))
    rows.append(("recompute route ms.jit(nnx.grad) data_parallel: temp B/device", temp_grad(False), temp_grad(True)))
    rows.append(("recompute route ms.recompute(plain nnx module): temp B/device", temp_plain(False), temp_plain(True)))
    return rows


def megatron_parameter_bytes(cfg, n):
    """Per-device parameter bytes of the GPT placed data parallel (replicated) and with Megatron (dp=2)."""
    out = []
    for mode, megatron in (("data_parallel", False), ("semi_auto_parallel", True)):
        step = make_step(cfg, mode, n, megatron=megatron)
        data = ms.dataset.shard_batch(batch(cfg))
        step(*data)
        out.append(per_device_bytes(nnx.state(step.network, nnx.Param)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--modes", default="data_parallel,semi_auto_parallel")
    ap.add_argument("--features", default=",".join(FEATURES),
                    help="training features timed on data_parallel against the same hand-written step: "
                         "optimizer_parallel (ZeRO, optimizer_level level1), optimizer_level2, optimizer_level3 "
                         "(FSDP), recompute, grad_accumulation (2 micro-batches), pipeline (pipeline_stages=2, "
                         "4 micro-batches; against the hand-written data-parallel step without stages, not "
                         "like-for-like)")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "step.json"))
    ap.add_argument("--smoke", action="store_true", help="1-layer model, 2 steps, 1 repeat: checks that it runs")
    args = ap.parse_args(argv)
    if args.smoke:
        # the Megatron mode (its fused step too) and two features: every code path of the bench, not every row
        args.size, args.steps, args.repeats = "smoke", 2, 1
        args.modes, args.features = "semi_auto_parallel", "optimizer_level3,pipeline"
    cfg = SIZES[args.size]
    n = jax.device_count()
    report: dict = {"devices": n, "platform": jax.devices()[0].platform, "model": dict(cfg),
                    "steps": args.steps, "repeats": args.repeats, "time": [], "memory": []}
    print(f"devices: {n} x {jax.devices()[0].platform}; model {args.size}: {cfg}")
    for mode in args.modes.split(","):
        megatron = mode == "semi_auto_parallel" and n % 2 == 0 and n > 1
        a, b, c, r, rs, ov, comm, extra = bench_time(cfg, mode, n, args.steps, args.repeats, megatron=megatron)
        label = mode + (f" (Megatron dp=2, mp={n // 2})" if megatron else "")
        baseline = "hand-written Megatron jax.jit" if megatron else "hand-written jax.jit"
        print(f"{label}: mshard {a * 1e3:.2f} ms/step, {baseline} {b * 1e3:.2f} ms/step, "
              f"ratio (median of {len(rs)}) {r:.3f} [{', '.join(f'{x:.3f}' for x in rs)}]; "
              f"mshard's own executable called directly {c * 1e3:.2f} ms/step (Python overhead ratio {ov:.3f})")
        print("  collectives (count, bytes) mshard vs hand-written: "
              + "; ".join(f"{k} {v['mshard']} vs {v['hand_written']}" for k, v in comm.items()))
        if extra:
            print(f"  against Megatron with layer norms and residuals left to XLA (which then splits them over all "
                  f"{n} devices): ratio (median) {extra['ratio_vs_ln_free_median']:.3f}; collectives "
                  + "; ".join(f"{k} {v.get('hand_written_ln_free')}" for k, v in comm.items()))
        report["time"].append({"mode": mode, "megatron": megatron, "baseline": baseline, "mshard_s": a,
                               "hand_written_s": b, "direct_s": c, "ratio_median": r, "ratios": rs,
                               "python_overhead_ratio": ov, "collectives": comm, **extra})
    for name, feature in FEATURES.items():
        if name not in args.features.split(","):
            continue
        a, b, c, r, rs, ov, comm, _ = bench_time(cfg, "data_parallel", n, args.steps, args.repeats, **feature)
        baseline = BASELINES.get(name, "hand-written jax.jit")
        print(f"data_parallel + {name}: mshard {a * 1e3:.2f} ms/step, {baseline} {b * 1e3:.2f} ms/step, "
              f"ratio (median of {len(rs)}) {r:.3f} [{', '.join(f'{x:.3f}' for x in rs)}]; Python overhead ratio "
              f"{ov:.3f}; collectives mshard vs hand-written: "
              + "; ".join(f"{k} {v['mshard']} vs {v['hand_written']}" for k, v in comm.items()))
        report["time"].append({"mode": "data_parallel", "feature": name, "megatron": False,
                               "baseline": baseline, "mshard_s": a, "hand_written_s": b, "direct_s": c,
                               "ratio_median": r, "ratios": rs, "python_overhead_ratio": ov, "collectives": comm})
    if "semi_auto_parallel" in args.modes and n % 2 == 0 and n > 1:
        fz = bench_fused(cfg, n, args.steps, args.repeats)
        report["fused_megatron"] = fz
        print(f"Megatron + all_reduce_fusion_config={fz['config']} against Megatron without it: ratio (median) "
              f"{fz['ratio_median']:.3f}; all-reduces over the 2 replicas: {fz['replica_all_reduces']}")
    ms_us, flat_us, nvars = python_overhead(cfg, n, calls=20 if args.smoke else 2000)
    report["python_us"] = {"mshard_step": ms_us, "flatten_state": flat_us, "variables": nvars}
    print(f"per-step Python of mshard's step (executable stubbed): {ms_us:.0f} us for {nvars} Variables; flattening "
          f"the same state for a hand-written jitted(state, ...) call: {flat_us:.0f} us")
    if not args.skip_memory:
        print(f"\nper-device memory on {n} devices (compiled memory_analysis / shard shapes):")
        # the smoke run measures the optimizer-parallel rows only: recompute's temp bytes per route and Megatron's
        # parameter bytes are the training tests' own (test_train_memory, test_train), 10 more compiles here
        rows = bench_memory(cfg, n) + ([] if args.smoke else recompute_routes(cfg, n))
        if n % 2 == 0 and n > 1 and not args.smoke:
            dp_b, mt_b = megatron_parameter_bytes(cfg, n)
            rows.append((f"Megatron (dp=2, mp={n // 2}) vs data parallel: parameter B/device", dp_b, mt_b))
        for name, off, on in rows:
            print(f"  {name:62s} off {off:>12,}   on {on:>12,}   on/off {on / off:.3f}")
            report["memory"].append({"feature": name, "off": off, "on": on, "ratio": on / off})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
