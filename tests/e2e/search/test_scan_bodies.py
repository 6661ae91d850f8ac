"""A scan's body is planned as a region of its own, and the plan prices every step of it (issue 40: "the plan
is the program"; mshard/_src/planning/scan_bodies.py ``plan_scan_bodies``).

Three loops, each differentiated (so a forward loop and a backward loop, both planned): an RNN whose weight is a
loop constant, read with a scanned input; a stack of layers read slice by slice; a ``fori_loop`` (a scan with a
counter). For each, in the data-parallel default, semi_auto, and the searched plans on a split and on a whole
batch: the value and every gradient equal plain JAX on one device, the plan's bytes equal the compiled
program's, kind by kind, and the program moves no more than the same step with its bodies left to XLA.

The reference for the bytes is the compiled HLO itself, read here without mshard's code: each collective's result
shapes (a tuple-shaped one counts every element), its replica group's size k, the ring formulas (all-reduce
2 S (k-1)/k, all-gather S (k-1)/k of its result, reduce-scatter S (k-1) of its result, all-to-all S (k-1)/k, a
permute S), times the trip count for a collective inside a while loop's body (tests/helpers.py ``loop_moved``).
Before the bodies were planned, the plans predicted 7 B (the loss's all-reduce) or 0 B for programs that moved
12,288 to 45,255 B.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import loop_moved

import mshard as ms
from mshard._src.planning import search

R = np.random.default_rng(3)
B, D, L = 16, 32, 4
X = jnp.asarray(R.normal(size=(B, D)), jnp.float32)
W = jnp.asarray(R.normal(size=(D, D)) * D ** -0.5, jnp.float32)
WS = jnp.asarray(R.normal(size=(L, D, D)) * D ** -0.5, jnp.float32)
XS = jnp.asarray(R.normal(size=(B, L, D)), jnp.float32)
C = jnp.asarray(R.normal(size=(B, D)), jnp.float32)          # weighs every output element differently


def rnn(x, w, xs):
    def body(h, xt):
        h = jnp.tanh(h @ w + xt)
        return h, jnp.sum(h, axis=1)
    h, ys = jax.lax.scan(body, x, xs.transpose(1, 0, 2))
    return jnp.sum(h * C) + jnp.sum(ys ** 2)


def layers(x, ws):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.sum(h * C)


def fori(x, w):
    return jnp.sum(jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x) * C)


PROGRAMS = {"rnn": (rnn, (X, W, XS), L), "layers": (layers, (X, WS), L), "fori": (fori, (X, W), 3)}
MODES = {
    "data_parallel": dict(parallel_mode="data_parallel"),
    "semi_auto": dict(parallel_mode="semi_auto_parallel"),
    "dynamic_programming": dict(parallel_mode="auto_parallel", search_mode="dynamic_programming"),
    "sharding_propagation/full_batch": dict(parallel_mode="auto_parallel", search_mode="sharding_propagation",
                                            dataset_strategy="full_batch"),
    "dynamic_programming/full_batch": dict(parallel_mode="auto_parallel", search_mode="dynamic_programming",
                                           dataset_strategy="full_batch"),
}
def _compiled(name, mode):
    f, args, _ = PROGRAMS[name]
    grad = jax.value_and_grad(f, argnums=tuple(range(len(args))))
    params = (args[0], nnx.Param(args[1]), *args[2:])     # the weights as parameters, the rest as data
    with ms.parallel_context(device_num=8, **MODES[mode]):
        step = ms.jit(lambda x, w, *rest: grad(x, w[...], *rest))
        got = step(*params)
        plan = step.plan(*params)
        hlo = step.lower(*params).compile().as_text()
    return got, plan, hlo


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_a_differentiated_loop_is_planned_step_by_step_and_priced_as_it_runs(name, mode, monkeypatch):
    f, args, trips = PROGRAMS[name]
    want_v, want_g = jax.value_and_grad(f, argnums=tuple(range(len(args))))(*args)
    (got_v, got_g), plan, hlo = _compiled(name, mode)
    # float32: 32-term dot products and 16-row sums over up to 4 steps, reordered by the partitioning
    np.testing.assert_allclose(float(got_v), float(want_v), rtol=1e-5)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    assert sum("its body is planned as a region of its own" in n for n in plan.notes) == 2, plan.notes
    moved = {k: v for k, v in loop_moved(hlo, trips).items() if v}
    assert plan.cost.communication == pytest.approx(moved, abs=0.5), (plan.cost.communication, moved)
    # the obvious baseline: the same step with its loops' bodies left to XLA's partitioner (as before they were
    # planned); the planned program moves no more (a carry is kept where its body leaves it where that moves less)
    monkeypatch.setattr(search, "plan_scan_bodies", lambda *a, **k: {})
    _, _, xlas = _compiled(name, mode)
    assert sum(moved.values()) <= sum(loop_moved(xlas, trips).values()) + 0.5, (moved, loop_moved(xlas, trips))


def _marked(x, w):
    """A loop whose body holds an op object with a strategy: a column-parallel MatMul (rows over 2, columns over 4),
    read again by the next step in its rows-only layout."""
    mm = ms.ops.MatMul().shard(((2, 1), (1, 4)))
    h, _ = jax.lax.scan(lambda h, _: (jnp.tanh(mm(h, w)), None), x, None, length=3)
    return jnp.sum(h * C)


@pytest.mark.parametrize("mode", ["semi_auto", "dynamic_programming"])
def test_a_loop_body_with_a_strategy_is_planned_around_it_and_priced(mode, monkeypatch):
    """A body with marks was left to XLA's partitioner and unpriced (the plan predicted the loss's 7 B); it is now
    planned with the mark fixed to the user's strategy (prepare.fix_marks), and the plan's bytes equal the
    program's, kind by kind. Values and gradients equal plain JAX on one device (the MatMul as ``x @ w``)."""
    ref = lambda x, w: jnp.sum(jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)[0] * C)
    want_v, want_g = jax.value_and_grad(ref, argnums=(0, 1))(X, W)
    grad = jax.value_and_grad(_marked, argnums=(0, 1))
    with ms.parallel_context(device_num=8, **MODES[mode]):
        step = ms.jit(lambda x, w: grad(x, w[...]))
        got_v, got_g = step(X, nnx.Param(W))
        plan = step.plan(X, nnx.Param(W))
        hlo = step.lower(X, nnx.Param(W)).compile().as_text()
    # float32: 32-term dot products over 3 steps, reordered by the partitioning
    np.testing.assert_allclose(float(got_v), float(want_v), rtol=1e-5)
    for g, w in zip(got_g, want_g, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
    assert sum("its body is planned as a region of its own" in n for n in plan.notes) == 2, plan.notes
    moved = {k: v for k, v in loop_moved(hlo, 3).items() if v}
    assert sum(moved.values()) > 7, moved          # the body moves something: the carry between the two layouts
    assert plan.cost.communication == pytest.approx(moved, abs=0.5), (plan.cost.communication, moved)
