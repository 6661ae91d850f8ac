"""Gradient communication fusion (comm_fusion, all_reduce_fusion_config) as seen in the compiled step's HLO.

The MLP's gradients, in parameter order (sorted paths), and their float32 sizes:
fc1.bias 64 (256 B), fc1.weight 64x16 (4096 B), fc2.bias 64 (256 B), fc2.weight 64x64 (16384 B),
fc3.bias 8 (32 B), fc3.weight 8x64 (2048 B). The loss's own all-reduce (the mean of the replicas' losses,
a 4-byte f32[]) may be merged into any gradient all-reduce by XLA; it is counted apart below.
"""

import re
import warnings

import numpy as np
import optax
import pytest
from flax import nnx
from helpers import trip_moved
from train_helpers import MLP, assert_params_close, assert_trees_close, batches, mse, reference_train

import mshard as ms
from mshard import nn
from mshard.errors import CommFusionWarning
from mshard.fusion import plan_buckets

SIZES = [256, 4096, 256, 16384, 32, 2048]


def gradient_collectives(step, data, kind, group_size=None):
    """Sizes of the ``kind`` collectives in the compiled step (over ``group_size`` devices, where given), without the
    4-byte f32[] loss reduction."""
    out = []
    for c in ms.comm_report(step, *data).collectives:
        if c.kind != kind or (group_size is not None and c.group_size != group_size):
            continue
        shape = c.text.split("=", 1)[1].split(kind)[0]
        scalar = 4 * len(re.findall(r"f32\[\]", shape))
        if c.nbytes - scalar:
            out.append(c.nbytes - scalar)
    return out


def make_step(**ctx):
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True, **ctx)
    net = MLP(nnx.Rngs(0))
    return net, nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.adam(1e-2))


DATA = batches(2, [(32, 16), (32, 8)])


def test_plan_buckets_modes():
    assert plan_buckets(SIZES, "index", (2, 4)) == [[0, 1], [2, 3], [4, 5]]
    assert plan_buckets(SIZES, "index", (20, 35)) == [[0, 1, 2, 3, 4, 5]]          # indices past the end
    assert plan_buckets(SIZES, "size", 0.01) == [[0, 1, 2], [3], [4, 5]]           # 10485 B buckets
    assert plan_buckets(SIZES, "auto", None) == [[0, 1, 2, 3, 4, 5]]               # 64 MB
    assert plan_buckets([40 << 20, 30 << 20, 1 << 20], "auto", None) == [[0], [1, 2]]


def test_default_auto_fusion_is_one_all_reduce_of_every_gradient():
    _, step = make_step()
    assert gradient_collectives(step, DATA[0], "all-reduce") == [sum(SIZES)]


@pytest.mark.parametrize("ctx, buckets", [
    (dict(all_reduce_fusion_config=[2, 4]), [[0, 1], [2, 3], [4, 5]]),
    (dict(all_reduce_fusion_config=[1]), [[0], [1, 2, 3, 4, 5]]),
    (dict(comm_fusion={"allreduce": {"mode": "index", "config": [3, 5]}}), [[0, 1, 2], [3, 4], [5]]),
    (dict(comm_fusion={"allreduce": {"mode": "size", "config": 0.01}}), [[0, 1, 2], [3], [4, 5]]),
    (dict(comm_fusion={"allreduce": {"mode": "size", "config": 0.001}}), [[0], [1], [2], [3], [4], [5]]),
])
def test_gradient_all_reduces_follow_the_fusion_config(ctx, buckets):
    net, step = make_step(**ctx)
    got = gradient_collectives(step, DATA[0], "all-reduce")
    assert sorted(got) == sorted(sum(SIZES[i] for i in b) for b in buckets)
    # and the step still trains exactly like one device
    ref, _, _ = reference_train(net, optax.adam(1e-2), DATA, mse)
    for b in DATA:
        step(*b)
    assert_params_close(net, ref)


def test_optimizer_parallel_reduce_scatter_and_all_gather_buckets():
    net, step = make_step(enable_parallel_optimizer=True,
                          parallel_optimizer_config={"parallel_optimizer_threshold": 0},
                          comm_fusion={"reducescatter": {"mode": "size", "config": 0.005},
                                       "allgather": {"mode": "auto", "config": None}})
    # every gradient is ZeRO-sharded: reduce-scatter buckets of <= 5242 B, one all-gather of all parameters
    rs = gradient_collectives(step, DATA[0], "reduce-scatter")
    expect = [sum(SIZES[i] for i in b) // 8 for b in plan_buckets(SIZES, "size", 0.005)]
    assert sorted(rs) == sorted(expect) == [260, 576, 2048]     # [fc1.*, fc2.bias] [fc2.weight] [fc3.*], / 8
    assert gradient_collectives(step, DATA[0], "all-gather") == [sum(SIZES)]
    assert gradient_collectives(step, DATA[0], "all-reduce") == []
    ref, _, _ = reference_train(net, optax.adam(1e-2), DATA, mse)
    for b in DATA:
        step(*b)
    assert_params_close(net, ref)


# Megatron on the MLP (dp=2, mp=4: fc1 column parallel, fc2 row parallel, fc3 replicated): the slice of each
# gradient a device holds, in parameter order. fc1.bias 64/4 floats, fc1.weight [64, 16] split 4 ways on dim 0,
# fc2.bias 64 (not split), fc2.weight [64, 64] split 4 ways on dim 1, fc3 whole.
MP_SIZES = [64 * 4 // 4, 64 * 16 * 4 // 4, 64 * 4, 64 * 64 * 4 // 4, 32, 2048]


def train_like_one_device(net, data, tx=lambda: optax.adam(1e-2), wrap=None, grad_scale=1.0, opt_state=True):
    """Train ``net`` with TrainOneStepCell and check losses, parameters (and optimizer state) against one device."""
    ref, ref_opt, ref_losses = reference_train(net, tx(), data, mse, grad_scale=grad_scale)
    inner = nn.WithLossCell(net, mse)
    step = nn.TrainOneStepCell(wrap(inner) if wrap else inner, tx())
    losses = [float(step(*b)) for b in data]
    # float32: the MLP's 16/64-term dot products and 256-term MSE mean reordered by the partitioning, random-signed
    # roundings ~sqrt(n) * 2**-24 <= 1e-6 relative per op, over 2-3 steps (the parameters' own drift: PARAM_RTOL)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    if opt_state:
        assert_trees_close(step.opt_state, ref_opt)
    return step


@pytest.mark.parametrize("ctx", [
    dict(all_reduce_fusion_config=[2, 4]),
    dict(all_reduce_fusion_config=[1]),
    dict(comm_fusion={"allreduce": {"mode": "size", "config": 0.001}}),
])
def test_fusion_buckets_in_a_megatron_step_match_one_device(ctx):
    """semi_auto_parallel with Megatron strategies: each replica's gradient slices are all-reduced over the 2
    data-parallel devices in the configured buckets; training (dropout included) equals one device."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True, **ctx)
    mode, config = ms.fusion.fusion_setting("allreduce")
    data = batches(3, [(32, 16), (32, 8)], seed=21)
    net = MLP(nnx.Rngs(21), dropout=0.25).megatron(2, 4)
    step = train_like_one_device(net, data)
    got = replica_all_reduces(step, data[0], DP_PAIRS)
    assert sorted(got) == sorted(sum(MP_SIZES[i] for i in b) for b in plan_buckets(MP_SIZES, mode, config))
    assert net.fc1.weight[...].sharding.shard_shape((64, 16)) == (16, 16)        # still model parallel


def test_megatron_step_without_a_fusion_setting_leaves_the_reductions_to_xla():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True)
    net = MLP(nnx.Rngs(0)).megatron(2, 4)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.adam(1e-2))
    step(*DATA[0])
    # the gradient of the global loss: XLA's partitioner places the reductions (some span all 8 devices, for
    # the ops it splits 8 ways) and XLA:CPU's combiner merges those over the 2 replicas into one
    assert len(replica_all_reduces(step, DATA[0], DP_PAIRS)) == 1


# Megatron's dp=2 x mp=4 on 8 devices: devices 0-3 and 4-7 are the model-parallel groups (dp is the outer axis),
# so the data-parallel replicas of a weight slice are the pairs {i, i + 4}
DP_PAIRS = {frozenset({i, i + 4}) for i in range(4)}
ALL_8 = {frozenset(range(8))}


def replica_all_reduces(step, data, groups):
    """Sizes of the all-reduces over the device ``groups``, less the 4-byte f32[] loss mean XLA may merge in."""
    out = []
    for c in ms.comm_report(step, *data).collectives:
        if c.kind == "all-reduce" and {frozenset(g) for g in c.groups} == groups:
            shape = c.text.split("=", 1)[1].split("all-reduce")[0]
            out.append(c.nbytes - 4 * len(re.findall(r"f32\[\]", shape)))
    return [x for x in out if x]


def slice_bytes(step):
    """Bytes of each gradient slice a device holds, in parameter order, from the layouts the step reports
    (``parallel_optimizer_info``): the whole gradient over the product of its layout's axes (2 devices each)."""
    info = step.parallel_optimizer_info
    out = []
    for name in sorted(info):
        if name.split(".")[-1] in ("weight", "bias"):
            axes = [a for d in info[name]["layout"] for a in d]
            out.append(int(np.prod(info[name]["shape"])) * 4 // 2 ** len(axes))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sharding_propagation", "dynamic_programming", "recursive_programming", "ilp"])
def test_fusion_buckets_in_a_searched_megatron_step(mode):
    """auto_parallel: the Megatron strategies are fixed, the search plans the rest. The replicas lie along the
    batch's mesh axes that the user's strategies split no weight over (here Megatron's dp: the pairs {i, i + 4}),
    even where the search split a bias or fc3 over them too; every weight stays whole over the replicas
    (in its searched layout on the model-parallel axes), each replica computes its own gradient, and each
    device all-reduces its slices over the replicas in the [2, 4] buckets. Training (dropout included) equals one
    device."""
    ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8,
                                 gradients_mean=True, all_reduce_fusion_config=[2, 4])
    data = batches(2, [(32, 16), (32, 8)], seed=21)
    net = MLP(nnx.Rngs(21), dropout=0.25).megatron(2, 4)          # each replica draws its rows of the mask
    step = train_like_one_device(net, data, opt_state=False)
    slices = slice_bytes(step)
    # the user's Megatron weights keep their 4-way model-parallel slices
    assert slices[1] == 64 * 16 * 4 // 4 and slices[3] == 64 * 64 * 4 // 4
    got = replica_all_reduces(step, data[0], DP_PAIRS)
    assert sorted(got) == sorted(sum(slices[i] for i in b) for b in plan_buckets(slices, "index", (2, 4)))


@pytest.mark.slow
def test_fusion_buckets_in_a_searched_step_without_strategies():
    """auto_parallel, no strategies: the batch is split over all 8 devices, so all 8 are replicas and every
    gradient is reduced whole, in the buckets of all_reduce_fusion_config — whatever layouts the search gave
    the weights (they are whole inside each replica); also with GradAccumulationCell."""
    ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8,
                                 gradients_mean=True, all_reduce_fusion_config=[2, 4])
    data = batches(2, [(32, 16), (32, 8)], seed=3)
    for wrap in (None, lambda n: nn.GradAccumulationCell(n, 2)):
        net = MLP(nnx.Rngs(3))
        step = train_like_one_device(net, data, tx=lambda: optax.sgd(1e-2), wrap=wrap, opt_state=False)
        expect = [sum(SIZES[i] for i in b) for b in plan_buckets(SIZES, "index", (2, 4))]
        assert sorted(replica_all_reduces(step, data[0], ALL_8)) == sorted(expect) == [2080, 4352, 16640]


def test_searched_megatron_step_with_optimizer_parallel_buckets():
    """A searched step with optimizer parallel: weight-gradient slices are reduce-scattered over the 2 replicas
    in 1 KB reducescatter buckets (half of each slice per device), the biases all-reduced in the [2, 4] buckets."""
    ms.set_auto_parallel_context(
        parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8, gradients_mean=True,
        all_reduce_fusion_config=[2, 4], enable_parallel_optimizer=True,
        parallel_optimizer_config={"parallel_optimizer_threshold": 1},
        comm_fusion={"reducescatter": {"mode": "size", "config": 0.001}, "allgather": {"mode": "auto", "config": None}})
    data = batches(2, [(32, 16), (32, 8)], seed=5)
    net = MLP(nnx.Rngs(5)).megatron(2, 4)
    step = train_like_one_device(net, data)
    slices = slice_bytes(step)
    info = step.parallel_optimizer_info
    zero = [i for i, nm in enumerate(sorted(info)) if info[nm]["sharded"]]
    assert [sorted(info)[i].split(".")[-1] for i in zero] == ["weight"] * 3          # the >= 1 KB ones
    weights = [slices[i] for i in zero]
    expect = [sum(weights[i] for i in b) // 2 for b in plan_buckets(weights, "size", 0.001)]
    assert sorted(gradient_collectives(step, data[0], "reduce-scatter", group_size=2)) == sorted(expect)
    # besides the replicas' gradient buckets, one reduce-scatter over the 4 model-parallel devices: the row-parallel
    # [64, 64] layer's partial result ([16, 64] f32 on each device of a replica) read split by columns 4 ways is
    # reduce-scattered there (mshard/_src/planning/scattered_sums.py), [16, 16]
    assert gradient_collectives(step, data[0], "reduce-scatter", group_size=4) == [16 * 16 * 4]
    biases = [slices[i] for i in range(6) if i not in zero]
    assert sorted(replica_all_reduces(step, data[0], DP_PAIRS)) == sorted(
        sum(biases[i] for i in b) for b in plan_buckets(biases, "index", (2, 4)))


@pytest.mark.parametrize("case", ["accumulation", "recompute", "sum"])
def test_fused_megatron_step_with_accumulation_recompute_or_gradient_sum(case):
    """GradAccumulationCell inside every replica; recomputed layers; an explicit gradients_mean=False (MindSpore's
    sum over the 2 replicas is not applied: one device's gradient, and a GradientsMeanWarning). The Megatron weights keep their slices although their first use is inside the micro-batch
    loop or the recomputed call, so the replicas are still the 2 data-parallel devices."""
    mean = case != "sum"
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=mean,
                                 all_reduce_fusion_config=[2, 4])
    data = batches(3, [(32, 16), (32, 8)], seed=5)
    net = MLP(nnx.Rngs(5)).megatron(2, 4)
    if case == "recompute":
        net.recompute()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ms.errors.GradientsMeanWarning)
        step = train_like_one_device(net, data, tx=lambda: optax.sgd(1e-2),
                                     wrap=(lambda n: nn.GradAccumulationCell(n, 2)) if case == "accumulation" else None,
                                     opt_state=False)
    assert any(issubclass(w.category, ms.errors.GradientsMeanWarning) for w in caught) == (not mean)
    assert net.fc1.weight[...].sharding.shard_shape((64, 16)) == (16, 16)
    assert net.fc2.weight[...].sharding.shard_shape((64, 64)) == (64, 16)
    got = replica_all_reduces(step, data[0], DP_PAIRS)
    assert sorted(got) == sorted(sum(MP_SIZES[i] for i in b) for b in plan_buckets(MP_SIZES, "index", (2, 4)))


def test_fused_step_with_cell_shard_and_parameter_plan():
    """The strategies come from Cell.shard + parameter_plan (the Cell's inside is propagated)."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True,
                                 all_reduce_fusion_config=[2, 4])
    data = batches(3, [(32, 16), (32, 8)], seed=7)
    net = MLP(nnx.Rngs(7))
    net.shard(in_strategy=((2, 1),), parameter_plan={"fc1.weight": (4, 1), "fc2.weight": (1, 4)})
    step = train_like_one_device(net, data, opt_state=False)
    assert len(replica_all_reduces(step, data[0], DP_PAIRS)) == 3


def test_fused_megatron_step_with_optimizer_parallel_buckets():
    """Optimizer parallel on top of Megatron: each device reduce-scatters its weight-gradient slices over the
    2 replicas (reducescatter buckets), updates its half, and all-gathers it back (allgather buckets)."""
    ms.set_auto_parallel_context(
        parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True, all_reduce_fusion_config=[2, 4],
        enable_parallel_optimizer=True, parallel_optimizer_config={"parallel_optimizer_threshold": 1},
        comm_fusion={"reducescatter": {"mode": "size", "config": 0.001}, "allgather": {"mode": "auto", "config": None}})
    data = batches(3, [(32, 16), (32, 8)], seed=5)
    net = MLP(nnx.Rngs(5)).megatron(2, 4)
    step = train_like_one_device(net, data)
    # the weights (>= 1 KB) are optimizer-parallel: Adam's moments halved again on dim 0 over the replicas
    mu = step.opt_state[0].mu["backbone"]
    assert mu["fc1"]["weight"].sharding.shard_shape((64, 16)) == (64 // 8, 16)
    assert mu["fc2"]["weight"].sharding.shard_shape((64, 64)) == (64 // 2, 64 // 4)
    # weight slices 1024 / 4096 / 2048 B: one reduce-scatter each (1 KB buckets), half of each slice per device
    weights = [MP_SIZES[1], MP_SIZES[3], MP_SIZES[5]]
    expect = [sum(weights[i] for i in b) // 2 for b in plan_buckets(weights, "size", 0.001)]
    assert sorted(gradient_collectives(step, data[0], "reduce-scatter")) == sorted(expect) == [512, 1024, 2048]
    # the updated halves come back in one all-gather (auto: 64 MB buckets)
    assert gradient_collectives(step, data[0], "all-gather").count(sum(weights)) == 1
    # the biases are all-reduced over the replicas in the allreduce buckets ([2, 4] over the 3 biases: 2 buckets)
    assert sorted(replica_all_reduces(step, data[0], DP_PAIRS)) == sorted([MP_SIZES[0] + MP_SIZES[2], MP_SIZES[4]])


def test_fused_step_falls_back_when_a_replica_cannot_hold_the_strategy():
    """A batch of 2 split over 2 replicas leaves 1 row each, which x:(2, 1) cannot split: the step says so and
    trains through XLA's reductions instead (full_batch: the labels are not split 8 ways)."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True,
                                 all_reduce_fusion_config=[2, 4], dataset_strategy="full_batch")
    data = batches(2, [(2, 16), (2, 8)], seed=8)
    net = MLP(nnx.Rngs(8)).megatron(2, 4)
    with pytest.warns(CommFusionWarning, match="do not fit one replica"):
        train_like_one_device(net, data, tx=lambda: optax.sgd(1e-2), opt_state=False)


@pytest.mark.parametrize("setting", ["allreduce", "level3"])
def test_a_fused_conv_step_whose_devices_are_all_replicas_runs_each_replica_on_its_slice(setting):
    """semi_auto with no strategies and a fusion setting: all 8 devices are replicas. Run side by side under
    jax.vmap, a convolution's weight gradient became a grouped convolution, which the plan keeps whole: the batch
    and an activation were gathered for it (examples/models.py's ConvNet: 71,680 B all-gathered beside the 18,599 B
    of the buckets). Each device now runs its replica on its own slice in a shard_map, as a data-parallel step
    does: the step moves the buckets' bytes alone, the plan says so, and 2 SGD steps of three "same" convolutions
    (no cross-row op: each replica's mean loss over equal slices averages to the batch's) equal one device's."""
    from models import SameConvs
    from train_helpers import params_of
    fused = ({"comm_fusion": {"allreduce": {"mode": "size", "config": 32}}} if setting == "allreduce" else
             {"enable_parallel_optimizer": True, "comm_fusion": {"reducescatter": {"mode": "size", "config": 32}},
              "parallel_optimizer_config": {"optimizer_level": "level3", "parallel_optimizer_threshold": 0}})
    data = batches(2, [(16, 8, 8, 4), (16, 8, 8, 4)], seed=4)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True, **fused)
    try:
        net = SameConvs()
        step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.sgd(0.1))
        plan = step.plan(*data[0])
        compiled = {k: v for k, v in trip_moved(step.lower(*data[0]).compile().as_text()).items() if v}
        losses = [float(step(*d)) for d in data]
    finally:
        ms.reset_auto_parallel_context()
    assert plan.cost.communication == pytest.approx(compiled, abs=0.5)
    # the buckets alone: an all-reduce of every gradient, or (level3) a reduce-scatter of every gradient and the
    # all-gather of the updated shards; what is gathered is then the parameters' bytes times 7/8, nothing more
    nbytes = sum(int(np.prod(x.shape)) * 4 for x in params_of(SameConvs()))
    assert compiled.get("all-gather", 0.0) <= nbytes * 7 / 8 + 0.5, compiled
    ref, _, ref_losses = reference_train(SameConvs(), optax.sgd(0.1), data, mse)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)      # a mean of 4,096 float32 squares, reordered
    assert_params_close(net, ref)
