"""A storage layout is not a compute strategy (docs/design.md invariant 4; issue 39): a ``parameter_plan``, a Cell's
``in_strategy`` and a ``dataset_strategy`` say how a tensor is stored. Where one meets another user split in an op
and they cannot take disjoint mesh axes, the tensor is stored as asked and redistributed where the op computes,
and the plan says so, naming both. Only two op strategies that cannot be disjoint are refused.

The configuration this gives is FSDP: the batch and every weight split over the same mesh axes.
"""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import split_counts
from train_helpers import MLP, assert_params_close, assert_trees_close, batches, mse, reference_train

import mshard as ms
from mshard import nn

STEPS = 2
# every weight split 8 ways on its dim 0, over the same axes as the 8-way batch split: nothing is left whole
FSDP = {"fc1.weight": (8, 1), "fc2.weight": (8, 1), "fc3.weight": (8, 1)}


@pytest.mark.parametrize("tx", [optax.sgd(1e-1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_fsdp_by_parameter_plan_trains_as_one_device_and_stores_an_eighth(tx):
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True)
    data = batches(STEPS, [(32, 16), (32, 8)], seed=3)
    net = MLP(nnx.Rngs(0))
    ref, ref_opt, ref_losses = reference_train(net, tx, data, mse)
    net.shard(in_strategy=((8, 1),), parameter_plan=FSDP)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx)
    losses = [float(step(*b)) for b in data]
    # float32, as tests/train_helpers.py's PARAM_RTOL says: 16/64-term dot products and a 256-term mean reordered by
    # the partitioning, over 2 steps; plain SGD shows a gradient scaled by the 8 replicas as an 8x step
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    assert_trees_close(step.opt_state, ref_opt)
    for name in FSDP:
        w = getattr(net, name.split(".")[0]).weight[...]
        assert split_counts(w) == (8, 1), name                     # stored as the parameter_plan says
    for leaf in jax.tree.leaves(step.opt_state):                 # Adam's mu / nu follow their parameter
        if leaf.ndim == 2:
            assert split_counts(leaf) == (8, 1)
    notes = [n for n in step.plan(*data[0]).notes if "storage layout" in n]
    assert any("parameter_plan['network.backbone.fc1.weight']" in n for n in notes), notes



def test_accumulation_over_a_megatron_parameter_plan_trains_as_one_step_on_the_whole_batch():
    """Issue 39: GradAccumulationCell over a Megatron parameter_plan raised LayoutError ('... meet in op scan'): the
    differentiated scan of the micro-batches carried claims from its constants to every same-shaped tensor
    (mshard._src.jaxpr.split_meetings.OPAQUE). Plain SGD: an accumulated gradient summed instead of averaged would move 2x as far."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True)
    data = batches(STEPS, [(32, 16), (32, 8)], seed=5)
    net = MLP(nnx.Rngs(0))
    ref, _, ref_losses = reference_train(net, optax.sgd(1e-1), data, mse)
    net.shard(in_strategy=((2, 1),), parameter_plan={"fc1.weight": (4, 1), "fc2.weight": (1, 4)})
    step = nn.TrainOneStepCell(nn.GradAccumulationCell(nn.WithLossCell(net, mse), 2), optax.sgd(1e-1))
    losses = [float(step(*b)) for b in data]
    # float32, PARAM_RTOL's reasoning (tests/train_helpers.py); the loss is the mean of the two micro-batch means
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    assert split_counts(net.fc1.weight[...]) == (4, 1) and split_counts(net.fc2.weight[...]) == (1, 4)


MEGATRON = {"fc1.weight": (4, 1), "fc2.weight": (1, 4)}


@pytest.mark.parametrize("wrap, plan", [("accumulation", "fsdp"), ("interleaved", "fsdp"), ("interleaved", "megatron")])
def test_micro_batch_wrappers_over_fsdp_and_megatron_train_as_one_step_on_the_whole_batch(wrap, plan):
    """Issue 39, accumulation with any user strategy: GradAccumulationCell and MicroBatchInterleaved over an FSDP
    parameter_plan (batch and weights over the same 8 devices) and MicroBatchInterleaved over a Megatron one (the
    accumulation case is the test above). Plain SGD: a micro-batch gradient summed instead of averaged would move
    2x as far, and every parameter is compared with one device."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True)
    data = batches(STEPS, [(32, 16), (32, 8)], seed=5)
    net = MLP(nnx.Rngs(0))
    ref, _, ref_losses = reference_train(net, optax.sgd(1e-1), data, mse)
    layout, batch = (FSDP, (8, 1)) if plan == "fsdp" else (MEGATRON, (2, 1))
    net.shard(in_strategy=(batch,), parameter_plan=layout)
    inner = nn.WithLossCell(net, mse)
    cell = nn.GradAccumulationCell(inner, 2) if wrap == "accumulation" else nn.MicroBatchInterleaved(inner, 2)
    step = nn.TrainOneStepCell(cell, optax.sgd(1e-1))
    losses = [float(step(*b)) for b in data]
    # float32, PARAM_RTOL's reasoning (tests/train_helpers.py); the loss is the mean of the two micro-batch means
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    for name, counts in layout.items():
        assert split_counts(getattr(net, name.split(".")[0]).weight[...]) == counts, name   # stored as asked


# the MLP's parameters: fc1 64x16 + 64, fc2 64x64 + 64, fc3 8x64 + 8 float32 values
PARAM_BYTES = 4 * (64 * 16 + 64 + 64 * 64 + 64 + 8 * 64 + 8)


def _zero_step(mode: str, level: str, tx):
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode=mode, device_num=8, gradients_mean=True, enable_parallel_optimizer=True,
                                 parallel_optimizer_config={"parallel_optimizer_threshold": 0, "optimizer_level": level})
    net = MLP(nnx.Rngs(0))
    return net, nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx)


@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto_parallel"])
@pytest.mark.parametrize("tx", [optax.sgd(1e-1), optax.adam(1e-2)], ids=["sgd", "adam"])
def test_optimizer_level3_stores_the_weights_sharded_and_trains_as_one_device(mode, tx):
    """MindSpore's optimizer_level "level3" (FSDP): the weights are stored sharded over the data-parallel devices as
    their optimizer state is (every dim 0 here divides by 8), gathered where they compute."""
    data = batches(STEPS, [(32, 16), (32, 8)], seed=6)
    net, step = _zero_step(mode, "level3", tx)
    ref, ref_opt, ref_losses = reference_train(net, tx, data, mse)
    losses = [float(step(*b)) for b in data]
    # float32, PARAM_RTOL's reasoning (tests/train_helpers.py); plain SGD shows a gradient's scale
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    assert_trees_close(step.opt_state, ref_opt)
    for leaf in jax.tree.leaves(nnx.state(net, nnx.Param)) + [x for x in jax.tree.leaves(step.opt_state) if x.ndim]:
        assert split_counts(leaf)[0] == 8, leaf.shape


def test_optimizer_level3_holds_an_eighth_of_the_weights_and_gathers_each_once_per_step():
    """Data parallel, plain SGD (no optimizer state): level1 holds every weight whole on every device, level3 an
    eighth of each (memory_analysis: the step's arguments). The level3 step gathers every parameter whole once (the
    backward reuses the forward's gather) and reduces each gradient once to its shard (per device, from the compiled
    HLO): 6 all-gathers of the parameters' bytes, and 6 reductions of them, one per parameter and not combined (a
    level3 step compiles without XLA:CPU's all-reduce combiner), plus the loss's. Each gradient is a sum over the
    split batch (a weight's a MatMul, a bias's a reduce_sum and a reshape) read in the shard its parameter is stored
    in: reduce-scattered into it (mshard/_src/planning/scattered_sums.py, through the ops that pass it on), half an
    all-reduce's bytes, as MindSpore's level3 does. XLA's partitioner would all-reduce each whole and slice it."""
    (x, y), = batches(1, [(32, 16), (32, 8)], seed=7)
    data = (x.nbytes + y.nbytes) // 8                 # the batch, split 8 ways
    args = {}
    for level in ("level1", "level3"):
        _, step = _zero_step("data_parallel", level, optax.sgd(1e-1))
        args[level] = step.lower(x, y).compile().memory_analysis().argument_size_in_bytes
        if level == "level3":
            report = ms.comm_report(step, x, y)
            predicted = step.plan(x, y).cost.communication
    # 16 B: the scalar state a step may take besides its parameters (an RNG key and counter, a step count)
    assert PARAM_BYTES + data <= args["level1"] <= PARAM_BYTES + data + 16, args
    assert PARAM_BYTES // 8 + data <= args["level3"] <= PARAM_BYTES // 8 + data + 16, args
    assert report.count("all-gather") == 6 and report.bytes("all-gather") == PARAM_BYTES, report.by_kind
    # each gradient reduce-scattered into its eighth (a reduce-scatter's bytes are its result's); the loss all-reduced
    assert report.count("reduce-scatter") == 6 and report.bytes("reduce-scatter") == PARAM_BYTES // 8, report.by_kind
    assert report.count("all-reduce") == 1 and report.bytes("all-reduce") == 4, report.by_kind
    # the plan prices the program it runs, kind by kind (ring bytes moved)
    assert predicted == {k: report.moved(k) for k in report.by_kind}, (predicted, report.by_kind)


def test_optimizer_level2_is_level1s_program():
    """mshard's level1 already reduce-scatters the gradients of the parameters it shards (MindSpore's level2 adds
    exactly that): "level2" is accepted and compiles to level1's program."""
    (x, y), = batches(1, [(32, 16), (32, 8)], seed=8)
    text, comm = {}, {}
    for level in ("level1", "level2"):
        _, step = _zero_step("data_parallel", level, optax.adam(1e-2))
        text[level] = step.lower(x, y).as_text()         # the program mshard emits (no source locations)
        comm[level] = ms.comm_report(step, x, y).as_dict()
    assert text["level1"] == text["level2"]
    assert comm["level1"] == comm["level2"] and comm["level2"]["by_kind"]["reduce-scatter"]["count"] == 1, comm
