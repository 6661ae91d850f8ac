"""semi_auto's backward keeps the forward's model-parallel layouts when the loss is data parallel (issue 40).

A Megatron MLP (``in_strategy ((2, 1),)``, w1 split by columns 4 ways, w2 by rows) trained with the dataset split
over all 8 devices: the loss's unannotated ops compute in the labels' data-parallel layout, so the cotangent
arrives split 8 ways by rows. semi_auto's default (follow the operands, the most split first) made the backward
follow it: ``dh = dy @ w2.T`` gathered w2 whole (49,152 B predicted), ``dw2`` was computed whole and all-reduced
over all 8 devices, the ReLU's mask moved by an all-to-all: 156,676 B per device. MindSpore derives the backward
from the forward's strategies; a derived op now takes its operands' axes in the order of least cost
(``searchers.follow.cheapest_follow``): the cotangent is gathered to the forward's ``(2, 1)`` once.

Expected bytes per device, derived from the model (f32; batch 32, d_in 64, d_hidden 256, d_out 64; 2 replicas
over the batch x 4-way model parallel):
- the row-parallel output's partial sums ([16, 64] per device) reduce-scattered over the 4 devices of a replica
  into the loss's 8-way rows, [4, 64] per device -> 1,024 B (the Cell's out mark passes it on untouched, so the
  loss's layout decides: ``mshard/_src/planning/scattered_sums.py``; MindSpore all-reduces, 4,096 B, and slices);
- the cotangent gathered from 8-way to 2-way rows: [16, 64] -> 4,096 B;
- each weight's gradient shard ([64, 64] of w1 and of w2) all-reduced over the 2 replicas: 2 x 16,384 B;
- the loss, 4 B.
Every parameter after two SGD steps equals plain JAX on one device (SGD: a gradient of the wrong scale shows).
"""

import jax
import numpy as np
import optax
import pytest
from models import MLP, inputs
from train_helpers import assert_params_close, mse, reference_train

import mshard as ms
from mshard import nn

pytestmark = pytest.mark.slow

EXPECTED = 4 * (4 * 64) + 4 * (16 * 64) + 2 * 4 * (64 * 64) + 4


def _megatron(m):
    m.shard(in_strategy=((2, 1),), parameter_plan={"w1": (1, 4), "w2": (4, 1)})
    return m


def test_a_megatron_step_with_a_data_parallel_loss_keeps_its_backward_model_parallel():
    (x,) = inputs("mlp")
    y = np.asarray(jax.random.normal(jax.random.key(5), (x.shape[0], 64)))
    data = [(x, y), (x * 0.5, y)]
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True,
                             dataset_strategy="data_parallel"):
        net = _megatron(MLP())
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optax.sgd(0.1))
        rep = ms.comm_report(step, *data[0])
        plan = step.plan(*data[0])
        for batch in data:
            step(*batch)
    got = {k: (v["count"], v["bytes"]) for k, v in rep.by_kind.items()}
    assert sum(b for _, b in got.values()) == EXPECTED, got
    assert set(got) == {"all-reduce", "all-gather", "reduce-scatter"}, got
    assert got["reduce-scatter"] == (1, 4 * (4 * 64)), got
    # the plan prices the program it runs, kind by kind (ring bytes moved)
    assert {k: round(v) for k, v in plan.cost.communication.items()} == {
        k: round(rep.moved(k)) for k in rep.by_kind}, (plan.cost.communication, rep.by_kind)
    ref, _, _ = reference_train(MLP(), optax.sgd(0.1), data, mse)
    assert_params_close(net, ref)
