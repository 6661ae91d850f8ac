"""Pipeline parallel (issue 15): training through nn.PipelineCell / nn.Pipeline equals one device, every schedule,
heterogeneous stages (embedding first, head and loss last), any block count, tied parameters, the stage helper, and
every setting that cannot run is a PipelineError.

Tolerances. The loss of each step: rtol 1e-4, as examples/train_gpt.py (float32 sums over <= 512 tokens reordered by
the micro-batching and the partitioning). Parameters after 3 AdamW steps: AdamW's update m/(sqrt(v)+eps) is
Lipschitz in the gradient with constant ~1/eps, so the tests use eps = lr = 1e-3 (with the default 1e-8 a gradient
within float32 rounding of zero may flip its whole step); each step then moves a parameter by at most the gradient's
own error, which is float32 reordering of a sum over 512 token terms: 512 * 2**-24 * sum|terms| <= 3e-5 with
|g| <= 1, so 3 steps stay within 1e-4.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import busiest_stage_moved, hlo_collectives, loop_computations, replica_groups
from reference import train_one_device
from train_gpt import LOSS, make_gpt, synthetic_batches

import mshard as ms
from mshard import nn
from mshard._src.training.pipeline.run import record_ticks
from mshard.errors import ContextError, PipelineError, StrategyError

LR = 1e-3
TX = optax.adamw(LR, eps=LR)


def staged_gpt(layers: int, S: int, *, segments: int = 1):
    """The GPT of examples/ with the embeddings on stage 0, the blocks spread evenly, the norm and head last."""
    net = make_gpt(nnx.Rngs(0), layers=layers)
    V = S * segments
    net.embedding.pipeline_stage = net.position.pipeline_stage = 0
    for i, b in enumerate(net.blocks):
        vs = min(i * V // layers, V - 1)
        b.pipeline_stage, b.pipeline_segment = vs % S, vs // S
    net.final_norm.pipeline_stage = net.head.pipeline_stage = S - 1
    net.final_norm.pipeline_segment = net.head.pipeline_segment = segments - 1
    return net


def train_both(net, S, M, *, sched="1f1b", interleave=False, mode="semi_auto_parallel", steps=3, report=False,
               wrap=lambda cell: cell, inspect=None, **ctx):
    """Train ``net`` on one device and in the pipeline; ``inspect(step, batch)`` runs inside the context after the
    steps (its result is dropped: it records what it needs)."""
    data = synthetic_batches(steps)
    _, _, ref_losses = ref_out = train_one_device(net, TX, data, LOSS, grad_scale=ctx.pop("grad_scale", 1.0))
    with ms.parallel_context(parallel_mode=mode, device_num=8, pipeline_stages=S, gradients_mean=True,
                             pipeline_config={"pipeline_scheduler": sched, "pipeline_interleave": interleave}, **ctx):
        mine = nnx.clone(net)
        step = nn.TrainOneStepCell(wrap(nn.PipelineCell(nn.WithLossCell(mine, LOSS), M)), TX)
        losses = [float(step(*b)) for b in data]
        rep = ms.comm_report(step, *data[0]) if report else None
        if inspect is not None:
            inspect(step, data[0])
    return mine, losses, ref_out[0], ref_losses, rep


def _crossings(rep):
    """The collective-permutes of float32 values: the activations (and cotangents) the stages pass on. The int32 token
    batch may be permuted too, where the reshape that cuts it into micro-batches meets the stages' layout."""
    return [c for c in rep.collectives
            if c.kind == "collective-permute" and c.text.split("= ", 1)[1].startswith("f32[")]


def assert_equal_training(mine, losses, ref, ref_losses):
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for a, b in zip(jax.tree.leaves(nnx.state(mine, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


# (layers, S, M, schedule): S = 2, 4; M = 4, 8; both schedules; 5 blocks on 4 stages (any block count: stages of
# 2, 1, 1 and 1 blocks, the embeddings on the first and the head on the last; 3 blocks on 2 stages are the stage
# helper's test below)
@pytest.fixture(scope="module")
def two_stages():
    """The 2-block GPT on 2 stages, 4 micro-batches, 1f1b, trained beside one device (train_both's tuple), and
    the step's plan and comm report on one batch: the one compiled step two tests read."""
    seen = {}

    def inspect(step, batch):
        seen["plan"] = step.plan(*batch)
        seen["whole"] = sum(x.nbytes for x in jax.tree.leaves(nnx.state(step.network, nnx.Param)))
    return train_both(staged_gpt(2, 2), 2, 4, report=True, inspect=inspect), seen


@pytest.mark.slow
# the GPT on 4 stages under 1f1b with 8 micro-batches is heavy (~30 s on 2 cores): CI runs 1f1b on 2 stages and 4
# stages under gpipe; the schedule's tables for every S, M are tests/unit/training/test_pipeline_schedule.py's, which compiles nothing
@pytest.mark.parametrize("layers,S,M,sched", [(2, 2, 4, "1f1b"), pytest.param(4, 4, 8, "1f1b", marks=pytest.mark.heavy(30)),
                                              (5, 4, 4, "gpipe")])
def test_gpt_trains_as_on_one_device(layers, S, M, sched, request):
    if (layers, S, M, sched) == (2, 2, 4, "1f1b"):
        mine, losses, ref, ref_losses, rep = request.getfixturevalue("two_stages")[0]
    else:
        mine, losses, ref, ref_losses, rep = train_both(staged_gpt(layers, S), S, M, sched=sched, report=True)
    assert_equal_training(mine, losses, ref, ref_losses)
    # the stages talk by collective-permute: one [micro-batch, seq, hidden] activation forward and its cotangent
    # back per tick (the loop body holds each once). The rest of a stage is data parallel: the micro-batch's 16 / M
    # rows are split over the stage's 8 / S devices as far as they divide, so each device sends its own rows only,
    # f32 [16 / M / min(16 / M, 8 / S), 32, 64]
    rows = 16 // M
    share = rows // min(rows, 8 // S)
    permutes = _crossings(rep)
    assert len(permutes) == 2 and all(c.nbytes == share * 32 * 64 * 4 for c in permutes), permutes
    # the int32 token batch, split 8 ways by rows, is cut into micro-batches by a reshape and moved to the stages'
    # layout: at most what gathering it whole on every device moves (the input and the labels, [16, 32] each)
    tokens = [c for c in rep.collectives if c.text.split("= ", 1)[1].startswith("s32[")]
    assert sum(c.nbytes for c in tokens) <= 2 * 16 * 32 * 4, tokens
    # parameter memory drops S-fold: every parameter of this GPT is used by one stage and its dim 0 divides by S,
    # so it is stored split over the S stages (mshard._src.training.pipeline.storage) and one device holds 1/S of each
    leaves = jax.tree.leaves(nnx.state(mine, nnx.Param))
    assert all(x.sharding.shard_shape(x.shape) == (x.shape[0] // S,) + x.shape[1:] for x in leaves)
    # each stage gets its own parameters whole by all-to-all over the stages, and their gradients back the same way
    assert any(c.kind == "all-to-all" and c.group_size == S for c in rep.collectives)


def _all_reduces_and_replicas(hlo: str, w) -> tuple[list, frozenset]:
    """-> ([(inside a while loop?, device groups) per all-reduce of the compiled step], the groups of a stage's
    data-parallel replicas). Logical device i is the i-th of the mesh's devices; the mesh axes are (stage, inside,
    inside), the weight ``w`` is split over one inner axis (model parallel) and the other is the replicas'."""
    names = w.sharding.mesh.axis_names
    mp = {a for e in w.sharding.spec if e is not None for a in ((e,) if isinstance(e, str) else e)} - {names[0]}
    (dp,) = [k for k in (1, 2) if names[k] not in mp]
    ids = np.moveaxis(np.arange(8).reshape(w.sharding.mesh.devices.shape), dp, -1).reshape(-1, 2)
    loops = loop_computations(hlo)
    return ([(c.computation in loops, replica_groups(c.line)) for c in hlo_collectives(hlo) if c.kind == "all-reduce"],
            frozenset(frozenset(r.tolist()) for r in ids))


@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
def test_a_stage_with_strategies_sums_over_its_replicas_once_per_step(sched):
    """The fast tier's check of a stage with operator strategies (a column- then a row-parallel Dense, dp 2 x mp 2
    inside each of 2 stages): the devices of a stage that hold the same weight slices are data-parallel replicas,
    each runs the schedule on its rows, and the gradients are all-reduced over them once per step, after the ticks
    loop; inside the loop only the model-parallel devices all-reduce (the row-parallel product). Before, every
    backward branch all-reduced its gradients over the replicas, once per micro-batch. Every parameter after 2 SGD
    steps equals one device's."""
    data, mse = _dense_batches(2, 32), _mse

    def net():
        n = _TwoDense(nnx.Rngs(0))
        n.fc1.matmul.shard(((2, 1), (2, 1)))            # weights are [out, in]: column-parallel
        n.fc1.bias_add.shard(((2, 2), (2,)))
        n.fc2.matmul.shard(((2, 2), (1, 2)))            # row-parallel: sums over the 2 model-parallel devices
        n.fc2.bias_add.shard(((2, 1), (1,)))
        return n
    ref, _, ref_losses = train_one_device(net(), optax.sgd(0.1), data, mse)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2, gradients_mean=True,
                             pipeline_config={"pipeline_scheduler": sched}):
        mine = net()
        step = nn.TrainOneStepCell(nn.PipelineCell(nn.WithLossCell(mine, mse), 4), optax.sgd(0.1))
        hlo = step.lower(*data[0]).compile().as_text()
        losses = [float(step(*b)) for b in data]
    reduced, replicas = _all_reduces_and_replicas(hlo, mine.fc1.weight[...])
    assert (False, replicas) in reduced and (True, replicas) not in reduced, reduced
    # each stage's own weights come whole over the stages by one all-to-all of every device's model-parallel slices
    # (pipeline/storage.py _a2a), the gradients go back so: no weight is gathered over the model-parallel devices
    # (left to XLA, the all-to-all's operand was gathered whole first). A bias split over them has no other dim to
    # split over the stages, so its stage pieces interleave with its slices and XLA gathers it: only stacks of 1-D
    # parameters ([stages, slots, length]) may be gathered
    gathered = [c for c in hlo_collectives(hlo) if c.kind == "all-gather" and c.result.startswith("f32")]
    assert all(c.result.count(",") == 2 for c in gathered), gathered
    # float32: 8/32-term dot products (split in two partial sums) and a 256-element mean, reordered
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_params_close(mine, ref)


@pytest.mark.slow
def test_megatron_inside_the_stages_dp_mp_pp_2x2x2():
    """dp x mp x pp = 2 x 2 x 2: Megatron strategies (dp 2, mp 2) on every block, two stages of 4 devices. The
    strategies are planned on one stage's devices and hold inside it: the weights are stored and updated in their
    Megatron slices (nothing gathers them), the row-parallel products all-reduce over the 2 model-parallel devices of
    a stage, and the stages exchange the activation by collective-permute."""
    net = staged_gpt(4, 2)
    for b in net.blocks:
        b.shard_megatron(data_parallel=2, model_parallel=2)
    seen = {}
    mine, losses, ref, ref_losses, rep = train_both(net, 2, 4, report=True, inspect=lambda step, batch: seen.update(
        hlo=step.lower(*batch).compile().as_text()))
    assert_equal_training(mine, losses, ref, ref_losses)
    w = mine.blocks[0].output.mapping.weight[...]
    # the devices of a stage that hold the same Megatron slices are data-parallel replicas: each runs the schedule on
    # its rows and the gradients are all-reduced over them once per step, after the ticks loop; inside the loop only
    # the model-parallel devices all-reduce (the row-parallel products). Before, every backward branch all-reduced
    # its gradients over the replicas too, once per micro-batch (1,690,628 B all-reduced per device, now 1,008,646 B).
    reduced, replicas = _all_reduces_and_replicas(seen["hlo"], w)
    assert (False, replicas) in reduced and (True, replicas) not in reduced, reduced
    # stored split over the 2 stages on dim 0 (stage 0 alone uses it) and in its Megatron slice over the 2 mp devices
    assert w.sharding.shard_shape(w.shape) in ((w.shape[0] // 4, w.shape[1]), (w.shape[0] // 2, w.shape[1] // 2))
    reduces = [c for c in rep.collectives if c.kind == "all-reduce"]
    assert reduces and all(c.group_size in (2, 4, 8) for c in reduces)
    weight_bytes = {int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(nnx.state(mine.blocks[0], nnx.Param))}
    assert not [c for c in rep.collectives if c.kind == "all-gather" and c.nbytes in weight_bytes
                and c.text.split("= ", 1)[1].startswith("f32[")]          # the weights are float32 (tokens: int32)


@pytest.mark.slow
@pytest.mark.parametrize("sched", ["1f1b"])     # gpipe with recompute runs the same (recomputing) executor
def test_composes_with_optimizer_parallel_and_recompute(sched):
    """ZeRO-1 (every parameter's optimizer state sharded over the data-parallel devices) and recomputed blocks
    inside the stages (for gpipe: the recomputing executor instead of the one keeping residuals): the same
    training. One block per stage (a second adds compile time and no new path)."""
    net = staged_gpt(2, 2)
    for b in net.blocks:
        b.recompute()
    mine, losses, ref, ref_losses, _ = train_both(net, 2, 4, sched=sched, enable_parallel_optimizer=True,
                                                  parallel_optimizer_config={"parallel_optimizer_threshold": 0})
    assert_equal_training(mine, losses, ref, ref_losses)


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["micro_batch_interleaved", "grad_accumulation"])
def test_composes_with_micro_batch_interleaved_and_gradient_accumulation(wrapper):
    """MicroBatchInterleaved inside the PipelineCell (each micro-batch runs as two interleaved slices), and
    GradAccumulationCell outside it (two whole pipeline passes per step, gradients averaged): the same training
    as one device on the full batch (both average a mean loss over equal row sets)."""
    if wrapper == "micro_batch_interleaved":
        def wrap(pc):
            pc.network = nn.MicroBatchInterleaved(pc.network, 2)
            return pc
    else:
        def wrap(pc):
            return nn.GradAccumulationCell(pc, 2)
    mine, losses, ref, ref_losses, _ = train_both(staged_gpt(2, 2), 2, 4, wrap=wrap)
    assert_equal_training(mine, losses, ref, ref_losses)


@pytest.mark.slow
def test_stages_keep_their_residuals_unless_recompute_is_set(monkeypatch):
    """Without a recompute setting a stage's backward uses the residuals its forward kept: the compiled step does
    no forward twice. A matmul's backward is two matmuls of its size (input and weight gradients), so a step that
    recomputes each stage's forward does ~4 forward-equivalents of FLOPs per micro-batch and one keeping residuals
    ~3 (ratio ~0.75; below 0.85 leaves room for the elementwise ops, which do not follow the 1:2 rule; XLA's cost
    analysis counts the tick loop's body once, and both programs run the same loop, so the ratio holds). Keeping
    them costs memory (more temp bytes). Both compute the same loss."""
    import functools

    import mshard._src.training.pipeline.cells as nn_pipeline
    from mshard._src.training.pipeline import run
    x, y = synthetic_batches(1)[0]
    got = {}
    for keep in (True, False):
        monkeypatch.setattr(nn_pipeline, "run_pipeline", functools.partial(run.run_pipeline,
                                                                           keep_residuals=keep))
        with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2,
                                 gradients_mean=True):
            step = nn.TrainOneStepCell(nn.PipelineCell(nn.WithLossCell(staged_gpt(2, 2), LOSS), 4), TX)
            compiled = step.lower(x, y).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            got[keep] = (cost["flops"], compiled.memory_analysis().temp_size_in_bytes, float(step(x, y)))
    assert got[True][0] < 0.85 * got[False][0], got
    assert got[True][1] > got[False][1], got
    np.testing.assert_allclose(got[True][2], got[False][2], rtol=1e-6)    # one float32 loss, reordered sums


def assert_ran_the_schedule(ticks, S, M, v, name, steps):
    """What the running program did, from its tick trace (mshard._src.training.pipeline.run.record_ticks: each stage calls
    back from inside the branch it runs), against what the schedule promises, derived here and not read from its
    table: every stage ran the forward and the backward of every (micro-batch, chunk) once per step; each ran after
    what it needs (a forward after the previous virtual stage's, a backward after the next one's and after its own
    forward); 1f1b keeps at most S - s micro-batches in flight on stage s; and the measured bubble, idle stage-ticks
    over all stage-ticks up to the last tick that ran, is the textbook (S-1)/(v*M+S-1)."""
    one = set(ticks)
    assert len(ticks) == steps * len(one), "the steps did not all run the same ticks"
    ran = {(k, i, c * S + s): t for s, t, k, i, c in one}
    assert len(ran) == len(one) == 2 * M * S * v, "an operation ran twice in a step, or one never ran"
    assert len({(s, t) for s, t, *_ in one}) == len(one), "a stage ran two operations in one tick"
    V = S * v
    for i in range(M):
        for vs in range(V):
            f, b = ran[(1, i, vs)], ran[(2, i, vs)]
            assert b > f and (vs == 0 or f > ran[(1, i, vs - 1)]) and (vs == V - 1 or b > ran[(2, i, vs + 1)]), \
                (i, vs, f, b)
    if name == "1f1b":
        for s in range(S):
            order = sorted((t, k) for (k, i, vs), t in ran.items() if vs % S == s)
            live = np.cumsum([1 if k == 1 else -1 for _, k in order])
            assert live.max() <= S - s, (s, live)
    T = max(t for _, t, *_ in one) + 1
    np.testing.assert_allclose(1 - len(one) / (S * T), (S - 1) / (v * M + S - 1), rtol=1e-12)


def _dense_batches(seed: int, rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two (input, target) batches of ``rows`` x 8 normal float32 values for :class:`_TwoDense`."""
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(rows, 8)).astype(np.float32), rng.normal(size=(rows, 8)).astype(np.float32))
            for _ in range(2)]


def _mse(p, y):
    return jnp.mean((p - y) ** 2)


def _assert_params_close(net, ref) -> None:
    """Every parameter of ``net`` against ``ref``'s after the same SGD steps: float32 dot products over 8 or 32 terms
    and a mean over the batch, summed in another order (per micro-batch, replica and model-parallel slice)."""
    for a, b in zip(jax.tree.leaves(nnx.state(net, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


class _TwoDense(nn.Cell):
    def __init__(self, rngs):
        self.fc1 = nn.Dense(8, 32, activation="relu", rngs=rngs)
        self.fc2 = nn.Dense(32, 8, rngs=rngs)
        self.fc1.pipeline_stage, self.fc2.pipeline_stage = 0, 1

    def __call__(self, x):
        return self.fc2(self.fc1(x))


@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
def test_a_small_pipeline_trains_as_on_one_device_under_sgd(sched):
    """The fast tier's pipeline check: two Dense stages, 4 micro-batches, 2 plain-SGD steps (a gradient off by the
    micro-batch count, or one micro-batch's activation or cotangent paired with another's data, shows in the
    parameters; AdamW would normalise the first away). Every parameter and the executed schedule."""
    data, mse = _dense_batches(0, 16), _mse
    ref, _, ref_losses = train_one_device(_TwoDense(nnx.Rngs(0)), optax.sgd(0.1), data, mse)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2, gradients_mean=True,
                             pipeline_config={"pipeline_scheduler": sched}), record_ticks() as ticks:
        net = _TwoDense(nnx.Rngs(0))
        step = nn.TrainOneStepCell(nn.PipelineCell(nn.WithLossCell(net, mse), 4), optax.sgd(0.1))
        losses = [float(step(*b)) for b in data]
    # float32: 8/32-term dot products and a 128-element mean, summed per micro-batch in another order
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_params_close(net, ref)
    if sched == "1f1b":         # gpipe without recompute runs JAX's transpose of its forward scan: no tick trace
        assert_ran_the_schedule(ticks, 2, 4, 1, "1f1b", steps=2)


@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
@pytest.mark.parametrize("passes", [1, 2], ids=["", "accumulated"])
def test_a_pipelined_steps_plan_prices_its_stages_collectives(sched, passes):
    """The plan of a pipelined step is its program, kind by kind, for the busiest stage's devices: the permutes
    of every tick, the all-to-alls that bring each stage its parameters and take their gradients back, the loss
    summed over the stages, and the gradient reductions over a stage's data-parallel devices
    (mshard/_src/training/pipeline/price.py). Before, the pipeline's shard_map was a boundary the plan did not look
    into: the 2-stage GPT's plan said 0 B for a program that moves 1,736,964 B per device on its busiest stage."""
    data = [np.ones((16, 8), np.float32), np.ones((16, 8), np.float32)]
    mse = _mse
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2, gradients_mean=True,
                             pipeline_config={"pipeline_scheduler": sched}):
        cell = nn.PipelineCell(nn.WithLossCell(_TwoDense(nnx.Rngs(0)), mse), 4)
        step = nn.TrainOneStepCell(cell if passes == 1 else nn.GradAccumulationCell(cell, passes), optax.sgd(0.1))
        plan = step.plan(*data)
        hlo = step.lower(*data).compile().as_text()
    rep = plan.pipeline
    want = busiest_stage_moved(hlo, 2, 4, 1, rep.ticks, sched == "gpipe")
    assert {"collective-permute", "all-to-all", "all-reduce"} <= set(want), want
    assert plan.cost.communication == pytest.approx(want, abs=0.5)
    assert any(n.startswith("pipeline: its stages' own collectives") for n in plan.notes)


@pytest.mark.parametrize("sched", ["1f1b", "gpipe"])
@pytest.mark.parametrize("passes", [1, 2], ids=["", "accumulated"])
def test_a_data_parallel_stage_reduces_its_gradients_once_per_step(sched, passes):
    """Inside a stage without operator strategies the devices are data-parallel replicas: each runs the schedule on
    its rows of every micro-batch and the gradients are summed over the replicas once per pass, after the ticks
    (mshard/_src/training/pipeline/run.py ``_Replicas``). Left to XLA, a stage's gradient was reduced inside every
    backward branch, once per micro-batch: the 2-stage GPT (1f1b, 4 micro-batches) all-reduced 1,347,076 B per
    device where it now all-reduces 331,015 B.

    The expected all-reduce bytes are the ring formula (2 S (k-1)/k) on the shapes, not the plan's figure: every
    parameter of the two Dense stages is owned by one stage and stored split over the 2 stages, so after the
    stages' all-to-all each device holds half of each gradient and sums it over the 4 replicas of its stage; the
    loss (4 B) is summed over all 8 devices, per pass, and gpipe's backward (JAX's transpose of its forward) sums
    the loss's cotangent once more. Every parameter after 2 SGD steps equals one device's."""
    # 32 rows: a micro-batch of a pass holds 32 / passes / 4 >= 4 rows, split over all 4 devices of a stage
    data, mse = _dense_batches(1, 32), _mse
    # the accumulated step's loss is the mean of its passes' mean losses over equal parts: the whole batch's
    ref, _, ref_losses = train_one_device(_TwoDense(nnx.Rngs(0)), optax.sgd(0.1), data, mse)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2, gradients_mean=True,
                             pipeline_config={"pipeline_scheduler": sched}):
        net = _TwoDense(nnx.Rngs(0))
        cell = nn.PipelineCell(nn.WithLossCell(net, mse), 4)
        step = nn.TrainOneStepCell(cell if passes == 1 else nn.GradAccumulationCell(cell, passes), optax.sgd(0.1))
        plan = step.plan(*data[0])
        hlo = step.lower(*data[0]).compile().as_text()
        losses = [float(step(*b)) for b in data]
    ring = lambda nbytes, k: 2 * nbytes * (k - 1) / k
    params = sum(x.nbytes for x in jax.tree.leaves(nnx.state(net, nnx.Param)))
    # gpipe's loss cotangent is a constant, the same in every pass: XLA sums it once per step
    want = passes * (ring(params / 2, 4) + ring(4, 8)) + (ring(4, 8) if sched == "gpipe" else 0)
    moved = busiest_stage_moved(hlo, 2, 4, 1, plan.pipeline.ticks, sched == "gpipe")
    assert moved["all-reduce"] == pytest.approx(want, abs=0.5), (moved, want)
    assert plan.cost.communication["all-reduce"] == pytest.approx(want, abs=0.5)
    assert "each device runs its replica of the stage" in plan.pipeline.in_stage, plan.pipeline.in_stage
    # float32: 8/32-term dot products and a 256-element mean, summed per replica and micro-batch in another order
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_params_close(net, ref)


@pytest.mark.slow
def test_four_stage_1f1b_trains_as_on_one_device_and_runs_its_schedule():
    """The smallest 4-stage 1f1b (4 blocks, 4 micro-batches) in CI: every parameter after 3 steps equals one
    device, and the executed tick trace is the schedule's (bubble 3/7 measured)."""
    with record_ticks() as ticks:
        mine, losses, ref, ref_losses, _ = train_both(staged_gpt(4, 4), 4, 4, sched="1f1b")
    assert_equal_training(mine, losses, ref, ref_losses)
    assert_ran_the_schedule(ticks, 4, 4, 1, "1f1b", steps=3)


@pytest.mark.slow
def test_interleaved_gpt_trains_as_on_one_device():
    with record_ticks() as ticks:
        mine, losses, ref, ref_losses, _ = train_both(staged_gpt(4, 2, segments=2), 2, 4, interleave=True)
    assert_equal_training(mine, losses, ref, ref_losses)
    assert_ran_the_schedule(ticks, 2, 4, 2, "interleaved", steps=3)


@pytest.mark.slow
def test_stage_helper_balances_the_cells_when_none_has_a_stage():
    from mshard._src.training.pipeline.stages import auto_stages
    net = make_gpt(nnx.Rngs(0), layers=3)
    ids = jax.ShapeDtypeStruct((4, 32), jnp.int32)
    assign, cost = auto_stages(nn.WithLossCell(net, LOSS), lambda m, *d: m(*d), [ids, ids], 2)
    # contiguous in call order: embeddings and the first blocks on 0, the rest with the head on 1
    order = ["backbone.embedding", "backbone.position"] + [f"backbone.blocks.{i}" for i in range(3)] + \
        ["backbone.final_norm", "backbone.head"]
    stages = [assign[c] for c in order]
    assert stages == sorted(stages) and set(stages) == {0, 1}
    assert max(cost) <= 0.75 * sum(cost)        # three equal blocks and a head: no stage carries 3/4 of the work
    mine, losses, ref, ref_losses, _ = train_both(net, 2, 4)
    assert_equal_training(mine, losses, ref, ref_losses)


class TiedLM(nn.Cell):
    """An embedding on stage 0 whose table is also the head of stage 1 (a tied embedding and head)."""

    def __init__(self):
        self.embedding = nn.Embedding(64, 32, rngs=nnx.Rngs(0))
        self.block = nn.Dense(32, 32, rngs=nnx.Rngs(1))
        self.embedding.pipeline_stage, self.block.pipeline_stage = 0, 1

    def __call__(self, ids):
        h = jnp.tanh(self.block(self.embedding(ids)))
        return h @ self.embedding.embedding_table[...].T


@pytest.mark.slow
def test_a_parameter_two_stages_use_stays_one_parameter():
    data = synthetic_batches(3)
    _, _, ref_losses = ref_out = train_one_device(TiedLM(), TX, data, LOSS)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2,
                             gradients_mean=True):
        net = TiedLM()
        step = nn.TrainOneStepCell(nn.PipelineCell(nn.WithLossCell(net, LOSS), 4), TX)
        losses = [float(step(*b)) for b in data]
    # both stages' gradients reach the one table: it trains as on one device
    assert_equal_training(net, losses, ref_out[0], ref_losses)
    # the table both stages use is stored whole on every device; the block only stage 1 uses, split over the 2
    table, kernel = net.embedding.embedding_table[...], net.block.weight[...]
    assert table.sharding.shard_shape(table.shape) == table.shape
    assert kernel.sharding.shard_shape(kernel.shape) == (kernel.shape[0] // 2, kernel.shape[1])


@pytest.mark.slow
def test_pipeline_form_with_stage_config_and_gradients_mean_false():
    """nn.Pipeline(stage_config=...) and an explicit gradients_mean=False: 4 data-parallel replicas inside each of
    the 2 stages on 8 devices; the step warns that MindSpore's sum is not applied and computes one device's
    gradient (plain SGD, where a 4x gradient would show)."""
    data = synthetic_batches(2)
    net = make_gpt(nnx.Rngs(0), layers=2)
    ref, _, ref_losses = train_one_device(net, optax.sgd(0.01), data, LOSS)
    config = {"backbone.embedding": 0, "backbone.position": 0, "backbone.blocks.0": 0, "backbone.blocks.1": 1,
              "backbone.final_norm": 1, "backbone.head": 1}
    with ms.parallel_context(parallel_mode="data_parallel", device_num=8, pipeline_stages=2, gradients_mean=False):
        mine = nnx.clone(net)
        step = nn.TrainOneStepCell(nn.Pipeline(nn.WithLossCell(mine, LOSS), 4, stage_config=config), optax.sgd(0.01))
        with pytest.warns(ms.errors.GradientsMeanWarning, match="4 data-parallel replicas"):
            losses = [float(step(*b)) for b in data]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    # SGD: a parameter's error is lr * its gradient's error (4 x float32 reordering over 512 terms, <= 1.2e-4)
    for a, b in zip(jax.tree.leaves(nnx.state(mine, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=0.01 * 1.2e-4 * 2)


def _step(net, S=2, M=4, **ctx):
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=S, **ctx)
    return nn.TrainOneStepCell(nn.PipelineCell(nn.WithLossCell(net, LOSS), M), TX)


@pytest.mark.parametrize("case,match", [
    ("micro_size", r"micro_size=1 is smaller than pipeline_stages=2"),
    ("stage_range", r"pipeline_stage of backbone.head is 3; with pipeline_stages=2"),
    ("empty", r"stage\(s\) \[1\] of 2 have no cell"),
    ("batch", r"batch dim 16 .* not divisible by micro_size 3"),
    ("no_pipeline_cell", r"pipeline_stages=2, but the training step's network is a WithLossCell"),
    ("order", r"uses a value computed on the later stage 1"),
    ("interleave", r"pipeline_interleave=True, but no cell has a pipeline_segment"),
    ("strategy", r"must divide device_num=4"),
    ("accumulation_inside", r"GradAccumulationCell \(the network\) inside a PipelineCell"),
])
def test_settings_that_cannot_run_are_errors(case, match):
    x, y = synthetic_batches(1)[0]
    net = staged_gpt(2, 2)
    try:
        if case == "micro_size":
            step = _step(net, M=1)
        elif case == "stage_range":
            net.head.pipeline_stage = 3
            step = _step(net)
        elif case == "empty":
            for c in (net.blocks[1], net.final_norm, net.head):
                c.pipeline_stage = 0
            step = _step(net)
        elif case == "batch":
            step = _step(net, M=3)
        elif case == "no_pipeline_cell":
            ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2)
            step = nn.TrainOneStepCell(nn.WithLossCell(net, LOSS), TX)
        elif case == "order":
            net.embedding.pipeline_stage = 1
            net.blocks[0].pipeline_stage = 0
            step = _step(net)
        elif case == "interleave":
            step = _step(net, pipeline_config={"pipeline_interleave": True})
        elif case == "accumulation_inside":
            ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, pipeline_stages=2)
            step = nn.TrainOneStepCell(nn.PipelineCell(nn.GradAccumulationCell(nn.WithLossCell(net, LOSS), 2), 4),
                                       TX)
        else:          # a strategy for 8 devices, where a stage has 4
            net.blocks[0].shard_megatron(data_parallel=2, model_parallel=4)
            step = _step(net)
        # a strategy for more devices than a stage has is the StrategyError of one stage's devices
        with pytest.raises(StrategyError if case == "strategy" else PipelineError, match=match):
            step(x, y)
    finally:
        ms.reset_auto_parallel_context()


def test_stage_counts_that_do_not_divide_the_devices_are_refused():
    with pytest.raises(ContextError, match="pipeline_stages=3 does not divide device_num=8"):
        ms.set_auto_parallel_context(device_num=8, pipeline_stages=3)
    with pytest.raises(ContextError, match="pipeline_scheduler"):
        ms.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "zb"})
    ms.reset_auto_parallel_context()


@pytest.mark.slow
def test_the_plan_shows_every_stage_and_what_crosses_between_them(two_stages):
    (*_, comm), seen = two_stages
    plan, whole = seen["plan"], seen["whole"]
    rep = plan.pipeline
    assert (rep.schedule, rep.stages, rep.micro_size, rep.ticks) == ("1f1b", 2, 4, 10)
    assert rep.bubble == pytest.approx(1 / 5)                        # (S-1)/(M+S-1)
    s0, s1 = rep.stage_info
    assert {"backbone.embedding", "backbone.blocks.0"} <= set(s0.cells) and "backbone.head" in s1.cells
    # the one activation crossing: [16 / 4 sequences, 32 tokens, 64 hidden] float32
    (b,) = rep.boundaries
    assert b.tensors == (((4, 32, 64), "float32"),) and b.nbytes == 4 * 32 * 64 * 4
    # inside a stage the 4 rows are split over the stage's 4 devices (data parallel): the plan says so, and what it
    # says one device sends is what the compiled program's collective-permute moves
    assert len(b.layouts) == 1 and b.layouts[0].count("x") == 1 and b.layouts[0].endswith(", -, -)")
    assert b.device_nbytes == b.nbytes // 4 and "data parallel" in rep.in_stage
    permutes = _crossings(comm)
    assert permutes and all(c.nbytes == b.device_nbytes for c in permutes)
    # every op of the forward has a stage; the head's matmul is on the last one
    assert all(st in (-1, 0, 1) for st in rep.op_stage.values())
    assert any(st == 1 and "head" in name and "dot_general" in name for name, st in rep.op_stage.items())
    text = plan.summary()
    assert "stage 0 -> 1: float32[4, 32, 64]" in text and "pipeline: 1f1b, 2 stages" in text
    # the parameters one device stores: each one stage alone uses, split over the 2 stages (the GPT's dims divide)
    assert rep.stored_param_bytes == (whole // 2, whole)
    assert f"parameters stored per device across the stages: {whole // 2:,} B of {whole:,} B (2.00x less)" in text
