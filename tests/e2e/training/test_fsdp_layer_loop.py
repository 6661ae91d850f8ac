"""FSDP over a Python loop of layers (issue 39: level3 "all-gathered per layer for the forward and again for the
backward, and never kept whole across layers"; peak temp memory about two layers' weights whole).

L layers, one ``D x D`` parameter each, run by a Python loop, each layer recomputed in the backward
(``Cell.recompute``). Under ``optimizer_level="level3"`` in data_parallel mode each weight is stored split 8 ways.
The data-parallel plan reads a stored-split weight whole where an op computes with the batch (searchers/follow.py:
stored state's axes are taken after the batch's), and XLA gathers it there: once in the forward and once in each
layer's recomputation. On XLA:CPU the step compiles with the memory-optimized schedule and without the all-reduce
combiner (training/train_cells.py, ``compiler_options``), so the gathers and the gradient reductions are not all
hoisted to the start or merged into one. Checked from the compiled program (``memory_analysis``, the HLO's
collectives); values equal one device on every parameter and optimizer leaf.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import split_counts
from train_helpers import assert_params_close, assert_trees_close, batches, mse, reference_train

import mshard as ms
from mshard import nn

L, D, B = 8, 256, 16
W = D * D * 4                   # one layer's weight, bytes
STEPS = 2


class Layer(nn.Cell):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * D ** -0.5)

    def __call__(self, x):
        return jnp.tanh(x @ self.w[...])


class LayerLoop(nn.Cell):
    """L layers, one parameter each, run by a Python loop, each recomputed in the backward."""

    def __init__(self, rngs):
        self.layers = nnx.List([Layer(rngs).recompute() for _ in range(L)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _step(level: str | None, tx, comm_fusion: dict | None = None):
    ms.reset_auto_parallel_context()
    zero = {} if level is None else dict(
        enable_parallel_optimizer=True,
        parallel_optimizer_config={"parallel_optimizer_threshold": 0, "optimizer_level": level})
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True,
                                 **zero, **({"comm_fusion": comm_fusion} if comm_fusion else {}))
    net = LayerLoop(nnx.Rngs(0))
    return net, nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx)


def _collectives(hlo: str) -> list[tuple[str, str]]:
    """(kind, result shape) of every collective of a compiled HLO module, in program text order."""
    pat = r"= (\w+\[[\d,]*\])\{[^}]*\} (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\("
    return [(m.group(2), m.group(1)) for m in re.finditer(pat, hlo)]


# Adam's eps is 1e-6 for the reason tests/e2e/training/test_fsdp_scan_layers.py gives (an entry whose gradient
# cancels to ~1e-4 of the median carries its sum's reordering error into Adam's normalised update)
@pytest.mark.parametrize("tx", [optax.sgd(1e-1), optax.adam(1e-2, eps=1e-6)], ids=["sgd", "adam"])
def test_level3_over_a_python_loop_trains_as_one_device(tx):
    data = batches(STEPS, [(B, D), (B, D)], seed=13)
    net, step = _step("level3", tx)
    ref, ref_opt, ref_losses = reference_train(net, tx, data, mse)
    losses = [float(step(*b)) for b in data]
    # float32 over 8 layers of 256-term dot products and a 16 x 256 mean, reordered by the partitioning, 2 steps:
    # tests/train_helpers.py's PARAM_RTOL reasoning; plain SGD shows a gradient's scale as a step's
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params_close(net, ref)
    assert_trees_close(step.opt_state, ref_opt)
    for layer in net.layers:
        assert split_counts(layer.w[...]) == (8, 1)
    for leaf in jax.tree.leaves(step.opt_state):       # Adam's mu / nu follow their parameter
        if leaf.ndim == 2:
            assert split_counts(leaf) == (8, 1)


def test_level3_over_a_python_loop_holds_about_one_layer_whole_at_a_time():
    (x, y), = batches(1, [(B, D), (B, D)], seed=14)
    _, dp = _step(None, optax.sgd(1e-1))
    dp_mem = dp.lower(x, y).compile().memory_analysis()
    _, step = _step("level3", optax.sgd(1e-1))
    compiled = step.lower(x, y).compile()
    mem, hlo = compiled.memory_analysis(), compiled.as_text()
    # stored: an eighth of every weight, plus the batch (split 8 ways) and a few scalars
    assert mem.argument_size_in_bytes <= L * W // 8 + 2 * B * D * 4 + 64, mem
    # about one layer at a time: the layer gathered, its gradient's partial sum and that sum reduced to a shard,
    # plus the batch's activations saved per layer and their cotangents (2 L B D floats); data parallel holds every
    # gradient whole (L layers) besides its stored weights
    acts = 2 * L * B * D * 4
    assert mem.temp_size_in_bytes <= 3 * W + acts, (mem.temp_size_in_bytes / W, mem)
    assert dp_mem.temp_size_in_bytes >= L * W and dp_mem.argument_size_in_bytes >= L * W, dp_mem
    coll = _collectives(hlo)
    gathers = [shape for kind, shape in coll if kind == "all-gather"]
    # every gather is one layer's weight, twice per layer: the forward's, and the backward's recomputation
    assert gathers == [f"f32[{D},{D}]"] * (2 * L), coll
    # every layer's gradient is reduced by itself (not combined into one reduction of every gradient) straight into
    # the eighth its weight is stored in: a reduce-scatter whose result is that eighth (mshard/_src/planning/
    # scattered_sums.py; XLA's partitioner all-reduces the whole gradient and slices it, twice the bytes), and no
    # activation moves (the batch stays split)
    grads = [shape for kind, shape in coll if kind in ("all-reduce", "reduce-scatter") and shape != "f32[]"]
    assert len(grads) == L and all(kind != "all-reduce" or shape == "f32[]" for kind, shape in coll), coll
    assert set(grads) <= {f"f32[{D},{D // 8}]", f"f32[{D // 8},{D}]"}, coll
    assert not [c for c in coll if c[0] == "all-to-all"], coll
    plan = step.plan(x, y)
    notes = plan.notes
    assert any("optimizer_level level3: each weight is gathered where a layer reads it" in n for n in notes), notes
    # the plan prices the program it runs, kind by kind (ring bytes moved): the recomputation's gathers too (a
    # recomputed layer reads its weight again, and XLA gathers it again: Op.share_scope) and the reduce-scatters
    rep = ms.comm_report(step, x, y)
    assert {k: round(v) for k, v in plan.cost.communication.items()} == {k: round(rep.moved(k)) for k in rep.by_kind}


def test_level3_with_a_comm_fusion_setting_keeps_mindsporess_buckets():
    """A comm_fusion setting for the gathers and reductions keeps MindSpore's buckets: one reduce-scatter per
    bucket, every weight gathered at once (so temp holds every weight whole)."""
    (x, y), = batches(1, [(B, D), (B, D)], seed=15)
    fusion = {"allgather": {"mode": "size", "config": 64}, "reducescatter": {"mode": "size", "config": 64}}
    net, step = _step("level3", optax.sgd(1e-1), fusion)
    compiled = step.lower(x, y).compile()
    coll = _collectives(compiled.as_text())
    assert [k for k, _ in coll].count("reduce-scatter") >= 1, coll
    assert compiled.memory_analysis().temp_size_in_bytes >= L * W
    ref, _, _ = reference_train(net, optax.sgd(1e-1), [(x, y)], mse)
    step(x, y)
    assert_params_close(net, ref)
