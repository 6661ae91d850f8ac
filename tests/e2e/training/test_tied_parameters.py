"""A tied parameter's gradient is reduced once (issue 40).

A decoder whose output projection is its input embedding reads the embedding twice: its gradient is the sum of
the gather's scatter-add and the output matmul's contribution, each a partial sum over the split batch. Summed
first and reduced once, the step all-reduces the embedding's bytes once, as data parallel does. Before this fix a
searched step reduced each contribution by itself (XLA's partitioner reduces a dot or scatter result where it
is made, and XLA:CPU has no pass that reassociates two all-reduces into one): 147,460 B against data
parallel's 81,924 B on this model. A step written by hand (``ms.jit`` of ``nnx.value_and_grad`` + the update) is
reduced once too: the emitter adds the partial sums before reducing them.

Every weight and SGD-momentum leaf after 3 steps equals plain flax + optax on one device (momentum carries a
gradient-scale bug into every later step)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import PARAM_ATOL, PARAM_RTOL, params_of, reference_train

import mshard as ms
from mshard import nn, ops

pytestmark = pytest.mark.slow

V, D, B, S = 256, 64, 8, 16
RNG = np.random.default_rng(3)
DATA = [(RNG.integers(0, V, (B, S)).astype(np.int32), RNG.integers(0, V, (B, S)).astype(np.int32))
        for _ in range(3)]


class TiedDecoder(nn.Cell):
    """Embedding -> tanh(x W) -> logits against the same embedding."""

    def __init__(self, rngs, strategy=None):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (V, D)) * 0.02)
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) * 0.1)
        self.matmul = ops.MatMul()
        if strategy:
            self.matmul.shard(strategy)

    def __call__(self, tokens):
        x = self.embed[...][tokens]
        h = jnp.tanh(self.matmul(x.reshape(-1, D), self.w[...]))
        return (h @ self.embed[...].T).reshape(*tokens.shape, V)


def _loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _tx():
    return optax.sgd(0.5, momentum=0.9)


def _all_reduce_bytes(hlo: str) -> tuple[int, int]:
    """(bytes of the gradient reductions, the psum over the data-parallel replicas; bytes of the other
    all-reduces), each counted from the result buffers of the compiled step's all-reduces."""
    sizes = {"f32": 4, "s32": 4}
    grads = other = 0
    for line in hlo.splitlines():
        if " all-reduce(" not in line:
            continue
        result = line.split(" all-reduce(")[0].split("=", 1)[1]
        n = sum(sizes[t] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                for t, dims in re.findall(r"(f32|s32)\[([0-9,]*)\]", result))
        if "psum" in line:
            grads += n
        else:
            other += n
    return grads, other


# Expected bytes, derived from the model (f32): every gradient once plus the loss, 4 B. semi_auto's strategy
# ((2, 1), (1, 4)) splits w's columns 4 ways, so a replica (2 of them, over the batch) reduces the whole embedding
# and a quarter of w; inside a replica h is split by columns, so the logits h @ embed.T (64 rows x 256 per
# replica) and the backward's dx = dh @ w.T (64 x 64) are all-reduced over the 4 devices of w's split.
WHOLE = 4 * (V * D + D * D) + 4
EXPECTED = {
    "data_parallel": (WHOLE, 0),
    "dynamic_programming": (WHOLE, 0),
    "recursive_programming": (WHOLE, 0),
    "semi_auto_strategy": (4 * (V * D + D * D // 4) + 4, 4 * (B * S // 2) * (V + D)),
}


CASES = {
    "data_parallel": dict(parallel_mode="data_parallel"),
    "dynamic_programming": dict(parallel_mode="auto_parallel", search_mode="dynamic_programming"),
    "recursive_programming": dict(parallel_mode="auto_parallel", search_mode="recursive_programming"),
    "semi_auto_strategy": dict(parallel_mode="semi_auto_parallel"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_tied_embedding_is_reduced_once_and_trains_as_on_one_device(case):
    from mshard._src.edges.comm_report import CommReport, hlo_text

    strategy = ((2, 1), (1, 4)) if case == "semi_auto_strategy" else None
    with ms.parallel_context(device_num=8, gradients_mean=True, **CASES[case]):
        step = nn.TrainOneStepCell(nn.WithLossCell(TiedDecoder(nnx.Rngs(0), strategy), _loss), _tx())
        hlo = hlo_text(step, *DATA[0])
        notes = step.plan(*DATA[0]).notes
        for tokens, labels in DATA:
            step(tokens, labels)
    # the embedding's gradient reduced once: before this fix each searched case all-reduced 65,536 B more (and
    # semi_auto 4 all-reduces of 217,092 B in all)
    assert _all_reduce_bytes(hlo) == EXPECTED[case], [ln for ln in hlo.splitlines() if " all-reduce(" in ln]
    if case != "data_parallel":
        assert any("tied parameters network.backbone.embed" in n for n in notes), notes
    ref_net, ref_state, _ = reference_train(TiedDecoder(nnx.Rngs(0)), _tx(), DATA, _loss)
    # float32 SGD with momentum, 3 steps: each gradient is a sum of 128-token contributions reordered by the split
    # batch (<= 128 * 2**-24 relative), carried by the momentum into later updates: the training tests' bound
    for got, want in zip(params_of(step.network), params_of(ref_net), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=PARAM_RTOL, atol=PARAM_ATOL)
    got_m = [x for x in jax.tree.leaves(step.opt_state) if getattr(x, "ndim", 0) == 2]
    want_m = [x for x in jax.tree.leaves(ref_state) if getattr(x, "ndim", 0) == 2]
    assert len(got_m) == len(want_m) == 2
    for got, want in zip(got_m, want_m, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=PARAM_RTOL, atol=PARAM_ATOL)


def test_a_parameter_read_once_is_not_tied():
    """The step plan names a parameter tied only when the forward reads it more than once."""
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode="dynamic_programming", device_num=8):
        step = nn.TrainOneStepCell(nn.WithLossCell(TiedDecoder(nnx.Rngs(0)), _loss), _tx())
        # embed: the gather and the output matmul; w: one matmul
        assert step._rt.plan(step, DATA[0]).tied == ("network.backbone.embed",)


@pytest.mark.parametrize("case", list(CASES))
def test_a_hand_written_step_reduces_a_tied_embedding_once(case):
    """The same model trained by a step written as ``ms.jit`` of ``nnx.value_and_grad`` and ``opt.update`` (one
    traced program: no replicas to run side by side). The emitter adds the two partial sums per device and reduces
    their sum once (mshard/_src/runtime/partial_sums.py): the compiled step all-reduces the bytes TrainOneStepCell's
    does, both columns of EXPECTED together (XLA combines them into one all-reduce here, so no psum tells the
    gradient's apart). Before: 147,460 B in the three data-parallel cases, 217,092 B under the semi_auto strategy
    (the embedding's gradient reduced twice). Every weight and momentum leaf after 3 steps equals one device's."""
    from mshard._src.edges.comm_report import CommReport, hlo_text

    strategy = ((2, 1), (1, 4)) if case == "semi_auto_strategy" else None
    with ms.parallel_context(device_num=8, gradients_mean=True, **CASES[case]):
        net = TiedDecoder(nnx.Rngs(0), strategy)
        opt = nnx.Optimizer(net, _tx(), wrt=nnx.Param)

        @ms.jit
        def step(net, opt, tokens, labels):
            loss, grads = nnx.value_and_grad(lambda n: _loss(n(tokens), labels))(net)
            opt.update(net, grads)
            return loss
        hlo = hlo_text(step, net, opt, *DATA[0])
        predicted = step.plan(net, opt, *DATA[0]).cost.communication["all-reduce"]
        for tokens, labels in DATA:
            step(net, opt, tokens, labels)
    assert sum(_all_reduce_bytes(hlo)) == sum(EXPECTED[case]), [ln for ln in hlo.splitlines() if " all-reduce(" in ln]
    # the plan prices the sum's one reduction (mshard/_src/planning/fused_sums.py): its all-reduce bytes are the
    # cost model's ring formula, 2 * S * (k - 1) / k per device, applied to each all-reduce the compiled step runs
    # (before: the embedding's gradient priced twice, 258,055 B predicted against 143,367 B in data parallel)
    ring = sum(c.nbytes * 2 * (c.group_size - 1) / c.group_size
               for c in CommReport.from_hlo(hlo).collectives if c.kind == "all-reduce")
    assert predicted == pytest.approx(ring, rel=1e-9)
    ref_net, ref_state, _ = reference_train(TiedDecoder(nnx.Rngs(0)), _tx(), DATA, _loss)
    # the bound of the test above (the same sums, the same 3 steps of momentum)
    for got, want in zip(params_of(net), params_of(ref_net), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=PARAM_RTOL, atol=PARAM_ATOL)
    got_m = [x for x in jax.tree.leaves(nnx.state(opt)) if getattr(x, "ndim", 0) == 2]
    want_m = [x for x in jax.tree.leaves(ref_state) if getattr(x, "ndim", 0) == 2]
    assert len(got_m) == len(want_m) == 2
    for got, want in zip(got_m, want_m, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=PARAM_RTOL, atol=PARAM_ATOL)
