"""FSDP over a scan of layers (issue 39: level3 "all-gathered per layer ... never kept whole across layers"; peak
temp memory about two layers' weights whole).

The weights of L layers are one stacked parameter ``[L, D, D]`` that ``jax.lax.scan`` runs layer by layer, as the
public flax LLMs write their blocks. Under ``optimizer_level="level3"`` mshard stores the stack split on dim 1 (each
layer's dim 0; the scanned dim stays whole), gathers each layer's slice inside the loop where the body reads it
(inside its ``jax.checkpoint``, so the backward gathers it again rather than saving it), and reduces each layer's
gradient to its shard inside the backward loop. Checked from the compiled program: ``memory_analysis`` and where
the collectives are in the HLO; values equal one device on every parameter and optimizer leaf.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import hlo_collectives, loop_bodies, loop_moved, split_counts
from train_helpers import assert_params_close, assert_trees_close, batches, mse, reference_train

import mshard as ms
from mshard import nn

L, D, B = 8, 256, 16
W = D * D * 4                   # one layer's weight, bytes
STEPS = 2


class LayerStack(nn.Cell):
    """L tanh layers of D x D weights stacked in one parameter, run by ``jax.lax.scan``; each layer is recomputed in
    the backward (``jax.checkpoint``) unless ``remat`` is False."""

    def __init__(self, rngs, remat: bool = True):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (L, D, D)) * D ** -0.5)
        self.remat = remat

    def __call__(self, x):
        body = lambda h, w: (jnp.tanh(h @ w), None)
        h, _ = jax.lax.scan(jax.checkpoint(body) if self.remat else body, x, self.w[...])
        return h


def _step(mode: str, level: str | None, tx, remat: bool = True):
    ms.reset_auto_parallel_context()
    zero = {} if level is None else dict(
        enable_parallel_optimizer=True,
        parallel_optimizer_config={"parallel_optimizer_threshold": 0, "optimizer_level": level})
    ms.set_auto_parallel_context(parallel_mode=mode, device_num=8, gradients_mean=True, **zero)
    net = LayerStack(nnx.Rngs(0), remat=remat)
    return net, nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx)


# Adam's eps is 1e-6, not 1e-8: Adam scales every entry's update to about lr whatever its gradient, so an entry whose
# gradient is a near-total cancellation of its 16 batch terms (|g| ~ 3e-8 here, 1e-4 of the median) carries that
# sum's reordering error (~2**-24 of its terms) into the update at up to 1e-3 relative; with eps = 1e-6 such an
# entry's update is lr * g / eps, whose error lr * 2**-24 * |terms| / eps stays below PARAM_ATOL, and every other
# entry is normalised as with the default
@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto_parallel"])
@pytest.mark.parametrize("tx", [optax.sgd(1e-1), optax.adam(1e-2, eps=1e-6)], ids=["sgd", "adam"])
def test_level3_over_a_scan_of_layers_trains_as_one_device(mode, tx):
    data = batches(STEPS, [(B, D), (B, D)], seed=11)
    net, step = _step(mode, "level3", tx)
    ref, ref_opt, ref_losses = reference_train(net, tx, data, mse)
    losses = [float(step(*b)) for b in data]
    # float32 over 8 layers of 256-term dot products and a 16 x 256 mean, reordered by the partitioning, 2 steps:
    # tests/train_helpers.py's PARAM_RTOL reasoning; plain SGD shows a gradient's scale (an 8x reduction, a
    # gradient summed over the replicas) as an 8x step
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    assert_trees_close(step.opt_state, ref_opt)
    assert split_counts(net.w[...]) == (1, 8, 1)       # each layer's dim 0 over the 8 devices; the scanned dim whole
    for leaf in jax.tree.leaves(step.opt_state):       # Adam's mu / nu follow their parameter
        if leaf.ndim == 3:
            assert split_counts(leaf) == (1, 8, 1)
    assert step.parallel_optimizer_info["network.backbone.w"]["dim"] == 1
    notes = step.plan(*data[0]).notes
    assert any("network.backbone.w (8, 256, 256) is a stack a scan reads slice by slice" in n for n in notes), notes


def _collectives(hlo: str) -> list[tuple[str, str, str]]:
    """(computation, kind, result shape) of every collective of one array (no tuple) but the permutes."""
    return [(c.computation, c.kind, c.result) for c in hlo_collectives(hlo)
            if c.kind != "collective-permute" and not c.result.startswith("(")]


@pytest.mark.parametrize("remat", [True, False], ids=["remat", "no_remat"])
def test_level3_over_a_scan_of_layers_holds_one_layer_whole_at_a_time(remat):
    (x, y), = batches(1, [(B, D), (B, D)], seed=12)
    _, dp = _step("data_parallel", None, optax.sgd(1e-1), remat)
    dp_mem = dp.lower(x, y).compile().memory_analysis()
    _, step = _step("data_parallel", "level3", optax.sgd(1e-1), remat)
    compiled = step.lower(x, y).compile()
    mem, hlo = compiled.memory_analysis(), compiled.as_text()
    # stored: an eighth of the stack (plus the batch and two scalars)
    assert mem.argument_size_in_bytes <= L * W // 8 + 2 * B * D * 4 + 64, mem
    # at most three layers' weights whole at once: the layer gathered for the step, its gradient's partial sum, and
    # that sum reduced (now reduce-scattered straight into its shard: an eighth), plus the
    # batch's activations saved per layer and their cotangents (2 L B D floats); data parallel holds the whole
    # stack's gradient (L layers) besides its stored weights
    acts = 2 * L * B * D * 4
    assert mem.temp_size_in_bytes <= 3 * W + acts, (mem.temp_size_in_bytes / W, mem)
    assert dp_mem.temp_size_in_bytes >= L * W and dp_mem.argument_size_in_bytes >= L * W, dp_mem
    # every gather is one layer's slice, made inside a loop (the forward's, and the backward's recomputation or
    # its saved slice); every reduction of a weight's gradient is one layer's, inside the backward loop; nothing
    # moves the whole stack
    bodies = loop_bodies(hlo)
    coll = _collectives(hlo)
    gathers = [c for c in coll if c[1] == "all-gather"]
    assert gathers and all(shape == f"f32[{D},{D}]" and comp in bodies for comp, _, shape in gathers), coll
    grads = [c for c in coll if c[1] in ("all-reduce", "reduce-scatter") and c[2] != "f32[]"]
    assert grads and all(comp in bodies and shape in (f"f32[{D // 8},{D}]", f"f32[{D},{D // 8}]")
                         for comp, _, shape in grads), coll
    assert not any(shape.startswith(f"f32[{L},") for _, _, shape in coll), coll



@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto_parallel"])
@pytest.mark.parametrize("remat", [True, False], ids=["remat", "no_remat"])
def test_level3_over_a_scan_reduce_scatters_each_layers_gradient_and_the_plan_prices_the_loop(mode, remat):
    """The scan's body is planned as a region of its own (mshard/_src/planning/scan_bodies.py ``plan_scan_bodies``):
    each layer's gradient, a partial sum over the 8 batch devices, is reduce-scattered inside the backward loop into
    the eighth its layer is stored in (it was all-reduced whole there, f32[256, 256], and sliced), and the plan
    prices every step of every loop: its bytes equal the compiled program's, kind by kind, each collective in a
    loop body counted once per layer. The reference is the HLO itself, read by tests/helpers.py ``loop_moved``."""
    (x, y), = batches(1, [(B, D), (B, D)], seed=12)
    _, step = _step(mode, "level3", optax.sgd(1e-1), remat)
    hlo = step.lower(x, y).compile().as_text()
    moved = {k: v for k, v in loop_moved(hlo, L).items() if v}      # both loops run L steps
    assert [k for _, k, sh in _collectives(hlo) if sh == f"f32[{D},{D}]" and k == "all-reduce"] == []
    assert moved["reduce-scatter"] == L * W * 7 / 8          # each layer's gradient once, into its eighth
    predicted = step.plan(x, y).cost.communication
    assert predicted == pytest.approx(moved, abs=0.5), (predicted, moved)
