"""A MatMul's partial sums read split over the axes they are reduced on are reduce-scattered (issue 40).

A MatMul that splits its contraction computes a partial sum on each device. XLA's partitioner all-reduces it where
it is made and the reader slices its block, ``2 S (k-1)/k`` bytes per device; MindSpore runs a MatMul whose
out_strategy splits its result over its reduced devices as a ReduceScatter, ``S (k-1)/k``, and so does mshard now
where every reader wants the result split further over the reduced axes (mshard/_src/planning/scattered_sums.py).

Independent reasons for the figures: the partial result is x @ w over a split contraction, [64, 128] f32 = 32 KiB
on each device; the ring formulas are the cost model's (docs/algorithms.md), applied to the compiled HLO's
collectives by ``CommReport.moved``. Values: plain JAX on one device, the output and both gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close

import mshard as ms
from mshard import ops

R = np.random.default_rng(11)
X = jnp.asarray(R.normal(size=(64, 32)), jnp.float32)
W = jnp.asarray(R.normal(size=(32, 128)), jnp.float32)
C = jnp.asarray(R.normal(size=(64, 128)), jnp.float32)       # weighs every output element differently
S = 64 * 128 * 4                                             # the partial result on each device, bytes

# ReLU's strategy -> (reduce-scatter bytes moved, all-reduce bytes moved) of the forward's reduction of the partial
# sums over all 8 devices: a reduce-scatter over the axes the ReLU splits the result on, of the [64, 128]; an
# all-reduce over the rest, of what is left on each device
CASES = {
    ((8, 1),): (S * 7 / 8, 0.0),              # rows over (d0, d1, d2): one 8-way reduce-scatter
    ((1, 8),): (S * 7 / 8, 0.0),              # columns: the same, scattered on dim 1
    ((2, 4),): (S / 2 + S / 2 * 3 / 4, 0.0),  # rows over d0, then columns over (d1, d2): two reduce-scatters
    ((4, 1),): (S * 3 / 4, 2 * S / 4 / 2),    # rows over (d0, d1); the [16, 128] left all-reduced over d2
}


def _net(relu_strategy):
    mm = ops.MatMul().shard(((1, 8), (8, 1)))          # the contraction split 8 ways: partial sums on every device
    relu = ops.ReLU().shard(relu_strategy)
    return lambda x, w: relu(mm(x, w[...]))


@pytest.mark.parametrize("relu_strategy", list(CASES))
def test_partial_sums_read_split_are_reduce_scattered(relu_strategy):
    f = _net(relu_strategy)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        g = ms.jit(f)
        plan = g.plan(X, nnx.Param(W))
        rep = ms.comm_report(g, X, nnx.Param(W))
        y = g(X, nnx.Param(W))
    rs, ar = CASES[relu_strategy]
    assert rep.moved("reduce-scatter") == rs and rep.moved("all-reduce") == ar, rep.by_kind
    assert set(rep.by_kind) <= {"reduce-scatter", "all-reduce"}          # nothing gathered or sliced by a collective
    # the plan prices what the program runs (before: an all-reduce of 2 S 7/8 = 57,344 B for each case)
    assert plan.cost.communication == {k: v for k, v in (("reduce-scatter", rs), ("all-reduce", ar)) if v}
    # float32: 32-term dot products reordered by the 8-way split (<= 32 * 2**-24 relative each)
    assert_close(y, jax.nn.relu(X @ W))


@pytest.mark.parametrize("relu_strategy", [((8, 1),), ((2, 4),)])
def test_a_step_through_a_reduce_scatter_gives_one_devices_gradients(relu_strategy):
    """The gradient of a reduce-scatter is an all-gather: the backward of the region, traced with the forward, and
    JAX's transpose of the emitted collective, give the output and both gradients of one device."""
    f = _net(relu_strategy)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        step = ms.jit(lambda x, w: jax.value_and_grad(lambda x, w: jnp.sum(f(x, w) * C), argnums=(0, 1))(x, w))
        (val, (gx, gw)) = step(X, W)
        rep = ms.comm_report(step, X, W)
    assert rep.moved("reduce-scatter") > 0, rep.by_kind      # the forward's reduction is still scattered in a step

    def ref(x, w):
        return jnp.sum(jax.nn.relu(x @ w) * C)
    want_val, (want_x, want_w) = jax.value_and_grad(ref, argnums=(0, 1))(X, W)
    # float32: 32- to 64-term dot products reordered by the splits; the loss sums 8,192 such products
    assert_close(val, want_val, rtol=1e-4)
    assert_close(gx, want_x)
    assert_close(gw, want_w)


def test_a_result_read_in_two_layouts_is_all_reduced():
    """A partial result read whole by one reader and split by another is all-reduced once, as before: a
    reduce-scatter would leave the whole reader a gather to make."""
    mm = ops.MatMul().shard(((1, 8), (8, 1)))
    relu, tanh = ops.ReLU().shard(((8, 1),)), ops.Tanh().shard(((1, 1),))
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        def net(x, w):
            h = mm(x, w[...])
            return relu(h), tanh(h)
        g = ms.jit(net)
        rep = ms.comm_report(g, X, nnx.Param(W))
        y, z = g(X, nnx.Param(W))
    assert "reduce-scatter" not in rep.by_kind and rep.moved("all-reduce") > 0, rep.by_kind
    assert_close(y, jax.nn.relu(X @ W))
    assert_close(z, jnp.tanh(X @ W))


def test_partial_sums_read_in_another_axis_order_are_scattered_then_permuted():
    """A MatMul with rows over c and the contraction over (a, b), read as rows over (a, b, c): its result is not
    its own layout with axes appended (c comes last there), so it is reduce-scattered into rows (c, a, b), then
    permuted to (a, b, c). Partial result [32, 128] f32 per device (16 KiB): the 4-way reduce-scatter moves 3/4 of
    it, the permute each device's [8, 128] (4 KiB); the all-reduce alone would move 2 x 3/4 of it."""
    lay = ms.Layout((2, 2, 2), ("a", "b", "c"))
    mm = ops.MatMul().shard((lay("c", ("a", "b")), lay(("a", "b"), "None")))
    relu = ops.ReLU().shard((lay(("a", "b", "c"), "None"),))
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        g = ms.jit(lambda x, w: relu(mm(x, w[...])))
        plan = g.plan(X, nnx.Param(W))
        rep = ms.comm_report(g, X, nnx.Param(W))
        y = g(X, nnx.Param(W))
    local = 32 * 128 * 4
    want = {"reduce-scatter": local * 3 / 4, "collective-permute": local / 4}
    assert {k: rep.moved(k) for k in rep.by_kind} == want, rep.by_kind
    assert plan.cost.communication == want
    assert_close(y, jax.nn.relu(X @ W))


@pytest.mark.parametrize("primitive", [True, False], ids=["ReduceSum", "jnp.sum"])
def test_a_sum_over_the_split_batch_read_split_is_reduce_scattered(primitive):
    """A sum over the rows of x split 8 ways (a bias's gradient over the split batch) is a partial sum on each
    device, [128] f32 (512 B). Read split 8 ways by the ReLU, the 8-way reduce-scatter moves 7/8 of it, where the
    all-reduce XLA's partitioner emits moves twice that; through a transpose and a reshape that only pass it on
    (``jnp.sum`` of the transposed x, reshaped to [1, 128]), the same."""
    xs = jnp.asarray(R.normal(size=(64, 128)), jnp.float32)
    relu = ops.ReLU().shard(((8,),) if primitive else ((1, 8),))
    split = ops.ReLU().shard(((8, 1),))                   # x's rows over all 8 devices
    if primitive:
        total = ops.ReduceSum().shard(((8, 1),))

        def net(x):
            return relu(total(split(x), 0))

        def ref(x):
            return jax.nn.relu(jnp.sum(jax.nn.relu(x), 0))
    else:
        def net(x):
            return relu(jnp.sum(split(x).T, 1).reshape(1, 128))

        def ref(x):
            return jax.nn.relu(jnp.sum(jax.nn.relu(x), 0).reshape(1, 128))
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        g = ms.jit(net)
        plan = g.plan(xs)
        rep = ms.comm_report(g, xs)
        y = g(xs)
    want = {"reduce-scatter": 128 * 4 * 7 / 8}
    assert {k: rep.moved(k) for k in rep.by_kind} == want, rep.by_kind
    assert plan.cost.communication == want
    # float32: 64-term sums reordered by the split (<= 64 * 2**-24 relative each)
    assert_close(y, ref(xs))


@pytest.mark.parametrize("axis", [0, 1])
def test_two_matmuls_concatenated_and_read_split_are_reduce_scattered_once(axis):
    """Two MatMuls with the contraction split 8 ways, their results concatenated (rows or columns) and read by a
    ReLU split by rows: neither result alone is read in a layout of its own, so neither is scattered on its own
    (scattered_sums). Their partial sums are concatenated per device and the join reduce-scattered once
    (mshard/_src/planning/joined_sums.py): S (k-1)/k of the joined [128, 128] or [64, 256], where XLA's partitioner
    all-reduced both, 2 S (k-1)/k. Output and all three gradients equal plain JAX on one device."""
    w2 = jnp.asarray(R.normal(size=(32, 128)), jnp.float32)
    mm1, mm2 = (ops.MatMul().shard(((1, 8), (8, 1))) for _ in range(2))
    relu = ops.ReLU().shard(((8, 1),))

    def f(x, w1, w2):
        return relu(jnp.concatenate([mm1(x, w1[...]), mm2(x, w2[...])], axis=axis))

    def ref(x, w1, w2):
        return jnp.sum(jax.nn.relu(jnp.concatenate([x @ w1, x @ w2], axis=axis)) * c)
    c = jnp.asarray(R.normal(size=(128, 128) if axis == 0 else (64, 256)), jnp.float32)
    args = (X, nnx.Param(W), nnx.Param(w2))
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        g = ms.jit(f)
        plan = g.plan(*args)
        rep = ms.comm_report(g, *args)
        y = g(*args)
        grads = ms.jit(lambda x, w1, w2: jax.grad(lambda *a: jnp.sum(f(*a) * c), argnums=(0, 1, 2))(x, w1, w2))(
            X, W, w2)
    joined = 2 * S                           # both partial results on each device, bytes
    assert rep.by_kind.keys() == {"reduce-scatter"} and rep.moved("reduce-scatter") == joined * 7 / 8, rep.by_kind
    assert plan.cost.communication == {"reduce-scatter": joined * 7 / 8}    # before: all-reduce 2 * joined * 7/8
    # float32: 32-term dot products reordered by the 8-way split (<= 32 * 2**-24 relative each)
    assert_close(y, jax.nn.relu(jnp.concatenate([X @ W, X @ w2], axis=axis)))
    # the gradients sum 64 or 128 such products per entry, weighed by c
    assert_close(grads, jax.grad(ref, argnums=(0, 1, 2))(X, W, w2))
