"""A ``while_loop``'s body and a ``cond``'s branches are planned as regions of their own, like a scan's body
(mshard/_src/planning/scan_bodies.py ``_plan_branched``; rules ``while_carry_rule``, ``cond_branches_rule``).

The user's Megatron MLP (MindSpore's tutorial strategies: the first MatMul ((2, 1), (1, 4)), the second
((2, 4), (4, 1)), semi_auto on 8 devices) runs inside a decode-style ``while_loop`` and inside one branch of a
``cond``. Before, both were one op whose operands were replicated: the weights, split by the strategies inside,
were gathered whole for the loop or the branch (125,952 B of all-gather per device beside the MLP's own 6,144 B
all-reduce), and the plan priced a gather but not the body.

Also: a differentiated cond (its forward's residuals, its transposed branches), a scan of layers inside a decode
loop (a loop planned inside a loop's body), and a training step through a branch (every parameter after 2 SGD
steps against float64 numpy).

Expected bytes come from the model, not from the plan: the second MatMul is row parallel, so each device holds a
partial sum of its 16 rows x 64 columns of float32 (4,096 B), all-reduced over the 4 model-parallel devices
(ring: 2 S (k - 1) / k = 6,144 B), once per iteration. The HLO is read without mshard's code (tests/helpers.py
``trip_moved``: a while body counted by its trip count where the module says it, once where it does not).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_plan_program
from flax import nnx
from helpers import time_limit, trip_moved

import mshard as ms
from mshard import nn, ops

R = np.random.default_rng(7)
X = jnp.asarray(R.normal(size=(32, 64)), jnp.float32)
W1 = jnp.asarray(R.normal(size=(64, 256)) * 0.1, jnp.float32)
W2 = jnp.asarray(R.normal(size=(256, 64)) * 0.1, jnp.float32)
ROW_PARALLEL_AR = 2 * (16 * 64 * 4) * 3 / 4       # one all-reduce of the row-parallel MatMul's output, per device
STEPS = 3
# float32 sums of 64 and 256 products, reordered by the splits: <= 256 * 2**-24 ~ 1.5e-5 of the largest partial sum
# per layer; the loop's tanh does not amplify it, three iterations stay under 1e-4 relative
TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(autouse=True)
def _semi_auto():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    yield
    ms.reset_auto_parallel_context()


def _mlp():
    mm1 = ops.MatMul().shard(((2, 1), (1, 4)))
    mm2 = ops.MatMul().shard(((2, 4), (4, 1)))
    return lambda x, w1, w2: mm2(jax.nn.relu(mm1(x, w1)), w2)


def _ref_mlp(x, w1, w2):           # float64 numpy: shares nothing with mshard
    return np.maximum(x @ w1, 0) @ w2


def _np64(*a):
    return [np.asarray(v, np.float64) for v in a]


def _assert_plan_is_program(f, *args):
    plan = f.plan(*args)
    moved = trip_moved(f.lower(*args).compile().as_text())
    assert plan.cost.communication == pytest.approx(moved), (plan.cost.communication, moved)
    return moved


@pytest.mark.parametrize("bound", ["static", "argument", "data"])
def test_a_while_loop_reads_megatron_weights_where_they_arrive(bound):
    mlp = _mlp()

    def decode(x, w1, w2, n):
        stop = STEPS if bound == "static" else n         # a Python bound XLA counts; an argument it does not

        def test(c):                                     # "data": also a test of the carry (an early stop)
            return (c[0] < stop) & (jnp.max(jnp.abs(c[1])) > 1e-3) if bound == "data" else c[0] < stop
        return jax.lax.while_loop(test, lambda c: (c[0] + 1, jnp.tanh(mlp(c[1], w1, w2))), (0, x))[1]
    f = ms.jit(decode)
    args = (X, W1, W2, jnp.int32(STEPS))
    x, w1, w2 = _np64(X, W1, W2)
    for _ in range(STEPS):
        x = np.tanh(_ref_mlp(x, w1, w2))
    np.testing.assert_allclose(np.asarray(f(*args)), x, **TOL)
    moved = _assert_plan_is_program(f, *args)
    # XLA reads the static trip count (3 iterations); a bound read from an argument counts once, as the plan says.
    # The test of the carry reduces its rows, split over the 2 data-parallel devices: a max of 4 B all-reduced
    # over 2 (2 x 4 x 1/2 = 4 B), once per test
    assert moved == {"all-reduce": ROW_PARALLEL_AR * (STEPS if bound == "static" else 1) + 4 * (bound == "data")}
    assert any(("times 3 iterations" if bound == "static" else "trip count is not known") in n
               for n in f.plan(*args).notes)


@pytest.mark.parametrize("flag", [False, True])
def test_a_branch_reads_megatron_weights_where_they_arrive(flag):
    mlp = _mlp()
    f = ms.jit(lambda p, x, w1, w2: jax.lax.cond(p, lambda: jnp.tanh(x), lambda: mlp(x, w1, w2)))
    args = (jnp.bool_(flag), X, W1, W2)
    x, w1, w2 = _np64(X, W1, W2)
    np.testing.assert_allclose(np.asarray(f(*args)), np.tanh(x) if flag else _ref_mlp(x, w1, w2), **TOL)
    # the costlier branch priced (one runs); trip_moved counts every branch, and the tanh branch moves nothing
    assert _assert_plan_is_program(f, *args) == {"all-reduce": ROW_PARALLEL_AR}


def test_a_gradient_through_a_branch_equals_one_device_and_moves_what_the_mlp_alone_moves():
    mlp = _mlp()

    def loss(w1, w2, p, x):
        return jnp.sum(jax.lax.cond(p, lambda: jnp.tanh(x), lambda: mlp(x, w1, w2)) ** 2)
    g = ms.jit(jax.grad(loss, argnums=(0, 1)))
    args = (W1, W2, jnp.bool_(False), X)
    x, w1, w2 = _np64(X, W1, W2)
    h = x @ w1
    dy = 2 * (np.maximum(h, 0) @ w2)
    dh = (dy @ w2.T) * (h > 0)
    for got, want in zip(g(*args), (x.T @ dh, np.maximum(h, 0).T @ dy), strict=True):
        # the gradients sum 32 rows of products of the forward's outputs: 32x the forward's bound on each term
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # the forward's all-reduce; each weight's gradient is a partial sum over the 2 data-parallel devices (its
    # model-parallel quarter: 64 x 256 / 4 floats = 16,384 B), all-reduced over 2: 2 S (2 - 1) / 2 = S each
    assert _assert_plan_is_program(g, *args) == {"all-reduce": ROW_PARALLEL_AR + 2 * 16_384}


# the predicate reads x (x[0, 0], gathered whole from its data-parallel rows: 32 x 64 floats x 7/8 = 7,168 B), so x
# arrives split over all 8 devices, and the MLP's branch gathers it to its 2 row blocks (16 x 64 floats x 3/4 = 3,072
# B); the other branch returns x. Forward: the MLP's all-reduce, then its rows sliced to x's layout (planned as an
# all-reduce: a reduce-scatter in a branch compiles to a reduce-scatter, an all-gather and a slice). Gradient: both
# branches read x in (2, 1) (the tanh branch's residual): 3,072 B each, and trip_moved counts every branch, the plan
# the costlier; the rest is the MLP's own gradient (ROW_PARALLEL_AR + 2 * 16,384).
GATHER_X, X_TO_ROWS = 32 * 64 * 4 * 7 / 8, 16 * 64 * 4 * 3 / 4


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_a_branch_whose_predicate_reads_the_data_moves_the_mlps_bytes_and_the_gathers_of_x(grad):
    mlp = _mlp()

    def fwd(w1, w2, x):
        return jax.lax.cond(x[0, 0] > -1e9, lambda: mlp(x, w1, w2), lambda: jnp.tanh(x))
    x, w1, w2 = _np64(X, W1, W2)
    if grad:
        f = ms.jit(jax.grad(lambda w1, w2, x: jnp.sum(fwd(w1, w2, x) ** 2), argnums=(0, 1)))
        h = x @ w1
        dy = 2 * (np.maximum(h, 0) @ w2)
        for got, want in zip(f(W1, W2, X), (x.T @ ((dy @ w2.T) * (h > 0)), np.maximum(h, 0).T @ dy), strict=True):
            # as in the gradient test above
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    else:
        f = ms.jit(fwd)
        np.testing.assert_allclose(np.asarray(f(W1, W2, X)), _ref_mlp(x, w1, w2), **TOL)
    plan = f.plan(W1, W2, X).cost.communication
    moved = trip_moved(f.lower(W1, W2, X).compile().as_text())
    mlp_bytes = ROW_PARALLEL_AR + (2 * 16_384 if grad else 0)
    assert moved == {"all-reduce": mlp_bytes, "all-gather": GATHER_X + X_TO_ROWS * (2 if grad else 1)}
    assert plan == {"all-reduce": mlp_bytes, "all-gather": GATHER_X + X_TO_ROWS}


class _Layers(nnx.Module):
    """L Megatron MLP layers, their weights stacked, run by a scan (a flax LLM's scanned layers)."""

    def __init__(self, mlp, n: int = 2):
        self.w1 = nnx.Param(jnp.stack([W1 * (k + 1) / n for k in range(n)]))
        self.w2 = nnx.Param(jnp.stack([W2] * n))
        self.mlp = mlp

    def __call__(self, h):
        return jax.lax.scan(lambda h, w: (jnp.tanh(self.mlp(h, w[0], w[1])), None), h, (self.w1[...], self.w2[...]))[0]


@pytest.mark.parametrize("outer", ["while", "scan"])
def test_a_scan_of_layers_inside_a_decode_loop_is_planned_and_priced(outer):
    net = _Layers(_mlp())

    def decode(net, x):
        if outer == "while":
            return jax.lax.while_loop(lambda c: c[0] < STEPS, lambda c: (c[0] + 1, net(c[1])), (0, x))[1]
        return jax.lax.scan(lambda h, _: (net(h), None), x, None, length=STEPS)[0]
    f = ms.jit(decode)
    h = _np64(X)[0]
    for _ in range(STEPS):
        for w1, w2 in zip(np.asarray(net.w1[...], np.float64), np.asarray(net.w2[...], np.float64), strict=True):
            h = np.tanh(_ref_mlp(h, w1, w2))
    np.testing.assert_allclose(np.asarray(f(net, X)), h, **TOL)
    moved = _assert_plan_is_program(f, net, X)
    # x arrives split over every device and is gathered to the MLP's 2 row blocks once (X_TO_ROWS); every layer of
    # every iteration all-reduces its row-parallel output. Before the inner loop was planned the plan said 0 B and
    # the program gathered the carry into the rows at every layer (18,432 B)
    assert moved == {"all-reduce": ROW_PARALLEL_AR * 2 * STEPS, "all-gather": X_TO_ROWS}


class _BranchNet(nn.Cell):
    def __init__(self):
        self.w1, self.w2 = nnx.Param(W1), nnx.Param(W2)
        self.mlp = _mlp()

    def __call__(self, x, p, y):
        out = jax.lax.cond(p, lambda: jnp.tanh(x), lambda: self.mlp(x, self.w1[...], self.w2[...]))
        return jnp.mean((out - y) ** 2)


def test_a_training_step_through_a_branch_equals_one_device_on_every_parameter():
    net = _BranchNet()
    step = nn.TrainOneStepCell(net, optax.sgd(0.1))
    y = jnp.full((32, 64), 0.1, jnp.float32)
    args = (X, jnp.bool_(False), y)
    moved = _assert_plan_is_program(step, *args)
    for _ in range(2):
        step(*args)
    x, w1, w2, t = _np64(X, W1, W2, y)
    for _ in range(2):                  # float64 numpy SGD on the MLP's branch, written out
        h = x @ w1
        dy = 2 * (np.maximum(h, 0) @ w2 - t) / t.size
        w1, w2 = w1 - 0.1 * x.T @ ((dy @ w2.T) * (h > 0)), w2 - 0.1 * np.maximum(h, 0).T @ dy
    for got, want in ((net.w1, w1), (net.w2, w2)):
        # SGD steps of 0.1 x gradients summed over 32 rows: the float32 forward's relative error (TOL) on updates
        # that change the weights by about 1e-3 of their size
        np.testing.assert_allclose(np.asarray(got[...]), want, rtol=1e-5, atol=1e-6)
    # the MLP's own step: its row-parallel all-reduce, each weight's gradient over the 2 data-parallel devices
    # (2 x 16,384 B), the loss's mean (4 B over 8 devices: 2 x 4 x 7/8 = 7 B); x arrives split over the 8 devices
    # (dataset_strategy) and is gathered into the MLP's 2 row blocks (X_TO_ROWS). Before: 214,016 B of all-gather
    # (the weights whole for the branch)
    assert moved == {"all-reduce": ROW_PARALLEL_AR + 2 * 16_384 + 7, "all-gather": X_TO_ROWS}


class _LoopedBranch(nnx.Module):
    """A cond inside a fori_loop (a scan) over an MLP whose weights are the module's parameters, no strategy."""

    def __init__(self):
        self.w1, self.w2 = nnx.Param(W1), nnx.Param(W2)

    def __call__(self, x, p):
        def mlp(h):
            return jnp.tanh(jax.nn.relu(h @ self.w1[...]) @ self.w2[...])
        return jax.lax.fori_loop(0, 2, lambda i, h: jax.lax.cond(p, lambda: jnp.tanh(h), lambda: mlp(h)), x)


@pytest.mark.parametrize("mode", ["sharding_propagation", "dynamic_programming"])
def test_a_searched_plan_with_a_branch_in_a_loop_replays_from_its_strategy_file(mode, tmp_path, monkeypatch):
    """Issue 40's exact replay with control flow: the searched plan, saved and loaded in semi_auto, compiles to the
    same collectives one by one, and both programs equal one device on the output and every gradient. The
    differentiated cond reads every residual (about 20 loop dims): dynamic_programming took 311 s to enumerate its
    strategies, and moved 89,088 B, until such an op was searched whole and its boundary set after (search.py
    ``_wide_loops``); now about 2 s and 7,168 B. 60 s separates the two on a loaded machine."""
    monkeypatch.setitem(test_plan_program.MODELS, "looped_branch", _LoopedBranch)
    inputs = test_plan_program.inputs
    monkeypatch.setattr(test_plan_program, "inputs",
                        lambda model: (X, jnp.bool_(False)) if model == "looped_branch" else inputs(model))
    with time_limit(60, f"{mode} searching and replaying a branch in a loop"):
        plan, _ = test_plan_program.search_and_replay("looped_branch", mode, tmp_path)
    # the input x gathered whole from its data-parallel rows for the loop (32 x 64 floats x 7/8); the weights
    # are whole (no strategy, and the loop reads them whole), so nothing else moves
    assert plan.cost.communication == {"all-gather": 32 * 64 * 4 * 7 / 8}
