"""optax transformations that branch (``optax.MultiSteps``: accumulate or apply; ``optax.apply_if_finite``: apply or
skip) put a ``cond`` around the update. Before a cond's branches were planned (mshard/_src/planning/scan_bodies.py
``_plan_branched``), its operands were replicated: a Megatron step gathered every model-parallel weight and its
Adam moments whole for the update's cond (the MLP below, dp 2 x mp 4, Adam under MultiSteps: 396,288 B of
all-gather per device, beside the step's own 38,919 B). Now the branches read them where they are stored.

Checked: every parameter and optimizer leaf against plain nnx + optax on one device (tests/train_helpers.py
``reference_train``), no all-gather with a parameter's whole shape (the batch, 32 rows, gives no activation a
parameter's shape), and the plan equals the program. ``TrainOneStepCell`` takes an ``optax.MultiSteps`` as it is
(its ``gradient_transformation()``).
"""

import numpy as np
import optax
import pytest
from flax import nnx
from helpers import trip_moved
from train_helpers import MLP, assert_params_close, assert_trees_close, batches, mse, params_of, reference_train

import mshard as ms
from mshard import nn

STEPS = 4       # MultiSteps(every_k=2) applies twice


def _multisteps():
    return optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)


def _apply_if_finite():
    return optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3)


@pytest.mark.parametrize("make", [_multisteps, _apply_if_finite], ids=["multisteps", "apply_if_finite"])
def test_a_branching_optax_update_keeps_megatron_weights_where_they_are_stored(make):
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True)
    data = batches(STEPS, [(32, 16), (32, 8)], seed=5)
    net = MLP(nnx.Rngs(0)).megatron(2, 4)
    tx = make()
    ref, ref_opt, ref_losses = reference_train(
        net, tx.gradient_transformation() if isinstance(tx, optax.MultiSteps) else tx, data, mse)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx)
    plan = step.plan(*data[0])
    hlo = step.lower(*data[0]).compile().as_text()
    assert plan.cost.communication == pytest.approx(trip_moved(hlo))
    losses = [float(step(*b)) for b in data]
    # float32: the MLP's 16/64-term dot products reordered by the splits (test_train.py's bound), over 4 steps
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    assert_trees_close(step.opt_state, ref_opt)
    whole = {tuple(x.shape) for x in params_of(net) if len(x.shape) > 1}
    gathered = [line.split(" all-gather(")[0] for line in hlo.splitlines() if " all-gather(" in line]
    assert not [g for g in gathered if any(f"f32[{','.join(map(str, s))}]" in g for s in whole)], gathered
