"""A searched training step's plan is its program, kind by kind, read from the compiled HLO without mshard's code
(tests/helpers.py ``trip_moved``), where steps after the search move a tied operand: the TinyGPT with Megatron
blocks under dynamic_programming, with a comm_fusion setting (the replicas' buckets) and with optimizer level3.

The write-backs (each updated parameter stored in its input's layout) were left in the layout the search gave them
while the parameters they are tied to were stored split: the plan priced gathers the program does not run
(measured: 100,608 B against 384 B with the fusion setting; 75,424 B against 67,136 B under level3)."""

import optax
import pytest
from flax import nnx
from helpers import trip_moved
from train_helpers import TinyGPT, batches, token_loss

import mshard as ms
from mshard import nn

DATA = batches(1, [(16, 8), (16, 8)], seed=2, ints=(32, 32))
SETTINGS = {
    "fused": {"comm_fusion": {"allreduce": {"mode": "size", "config": 32}}},
    "level3": {"enable_parallel_optimizer": True,
               "parallel_optimizer_config": {"optimizer_level": "level3", "parallel_optimizer_threshold": 0}},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_searched_steps_write_backs_keep_their_tie(setting):
    ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="dynamic_programming", device_num=8,
                                 gradients_mean=True, **SETTINGS[setting])
    try:
        net = TinyGPT(nnx.Rngs(0))
        for b in net.blocks:
            b.shard_megatron(2, 4)
        step = nn.TrainOneStepCell(nn.WithLossCell(net, token_loss), optax.sgd(0.1))
        x, y = DATA[0]
        plan = step.plan(x, y)
        compiled = {k: v for k, v in trip_moved(step.lower(x, y).compile().as_text()).items() if v}
    finally:
        ms.reset_auto_parallel_context()
    assert plan.cost.communication == pytest.approx(compiled, abs=0.5)
