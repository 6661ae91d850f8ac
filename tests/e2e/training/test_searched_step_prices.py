"""A searched training step's plan is its program, kind by kind, read from the compiled HLO without mshard's code
(tests/helpers.py ``trip_moved``), where steps after the search move a tied operand: the TinyGPT with Megatron
blocks under dynamic_programming, with a comm_fusion setting (the replicas' buckets) and with optimizer level3.

The write-backs (each updated parameter stored in its input's layout) were left in the layout the search gave them
while the parameters they are tied to were stored split: the plan priced gathers the program does not run
(measured: 100,608 B against 384 B with the fusion setting; 75,424 B against 67,136 B under level3).

Optimizer level3 with a reduce-scatter fusion setting (the gradients reduce-scattered in buckets, a ``shard_map``
manual over the whole mesh), semi_auto and sharding_propagation: two more ways the plan was not the program.
- semi_auto: the move of a gradient into its bucket's ``in_specs`` (its last dim split 8 ways, the bucket reads it
  split on dim 0 over one axis) was priced as the executor's direct collectives (an all-to-all and an all-gather),
  but the program left it to XLA at the ``shard_map``'s boundary, which gathers the whole tensor (its "involuntary
  full rematerialization"): 59,936 B gathered and 24,000 B all-to-all, planned 50,464 B and 28,736 B. The executor
  now moves a fully manual ``shard_map``'s operands itself (mshard/_src/runtime/emit.py ``_shard_map_ins``).
- sharding_propagation: the backward of the head's reshape (merging two dims) followed its cotangent's split of the
  inner dim alone, a strategy no candidate list holds (searchers/follow.py ``_keep_nesting``). The plan priced it
  free, XLA ran a 1,536 B all-to-all (7,168 B compiled, 5,632 B planned)."""

import numpy as np
import optax
import pytest
from flax import nnx
from helpers import trip_moved
from train_helpers import TinyGPT, assert_params_close, batches, reference_train, token_loss

import mshard as ms
from mshard import nn

DATA = batches(1, [(16, 8), (16, 8)], seed=2, ints=(32, 32))
SETTINGS = {
    "fused": {"comm_fusion": {"allreduce": {"mode": "size", "config": 32}}},
    "level3": {"enable_parallel_optimizer": True,
               "parallel_optimizer_config": {"optimizer_level": "level3", "parallel_optimizer_threshold": 0}},
}


def _planned_and_compiled(batch, train=(), **ctx):
    """The TinyGPT with Megatron blocks under ``ctx``: its step planned and compiled on ``batch``, then trained on
    ``train`` (SGD). -> (network, plan, bytes per kind of the compiled step, losses); the context is reset."""
    ms.set_auto_parallel_context(device_num=8, gradients_mean=True, **ctx)
    try:
        net = TinyGPT(nnx.Rngs(0))
        for b in net.blocks:
            b.shard_megatron(2, 4)
        step = nn.TrainOneStepCell(nn.WithLossCell(net, token_loss), optax.sgd(0.1))
        plan = step.plan(*batch)
        compiled = {k: v for k, v in trip_moved(step.lower(*batch).compile().as_text()).items() if v}
        losses = [float(step(*d)) for d in train]
    finally:
        ms.reset_auto_parallel_context()
    return net, plan, compiled, losses


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_searched_steps_write_backs_keep_their_tie(setting):
    _, plan, compiled, _ = _planned_and_compiled(DATA[0], parallel_mode="auto_parallel",
                                                 search_mode="dynamic_programming", **SETTINGS[setting])
    assert plan.cost.communication == pytest.approx(compiled, abs=0.5)


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation"])
def test_a_level3_step_with_fused_reduce_scatters_is_priced_as_compiled(mode):
    data = batches(2, [(16, 8), (16, 8)], seed=2, ints=(32, 32))
    search = {"parallel_mode": "semi_auto_parallel"} if mode == "semi_auto" else {
        "parallel_mode": "auto_parallel", "search_mode": mode}
    net, plan, compiled, losses = _planned_and_compiled(data[0], data, **search, **SETTINGS["level3"],
                                                        comm_fusion={"reducescatter": {"mode": "size", "config": 32}})
    assert plan.cost.communication == pytest.approx(compiled, abs=0.5)
    ref, _, ref_losses = reference_train(TinyGPT(nnx.Rngs(0)), optax.sgd(0.1), data, token_loss)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)       # float32 loss of a 32-term softmax, reordered
    assert_params_close(net, ref)
