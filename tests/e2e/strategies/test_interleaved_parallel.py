"""MindSpore's ``interleaved_parallel`` Layout alias: a dim computed in copies on each device (issue 40).

``Layout((2, 2, 2, 2), ("dp", "mp", "sp", "interleaved_parallel"))`` is 8 devices: the interleaved axis is copies
on each device, not devices. A dim laid out ``("dp", "interleaved_parallel")`` is split over dp, and each device's
block is computed in 2 copies, one op each (so one copy's collective can overlap the next one's compute). Checked
here, each against an oracle that does not share mshard's code:

- the device mesh and the strategy the Layout gives (its device splits, its copies);
- the cut into copies against a numpy slicing of each device's block;
- an interleaved MatMul, forward and gradients, equal to plain JAX on one device; its compiled program has the
  2 copies and moves the bytes of the same MatMul laid out without the alias;
- the errors: copies of a reduced dim, copies that do not divide a device's block, and copies of two loop dims;
- a training step (SGD with momentum) on such layouts: weights and momentum equal one device's;
- ``to_dict()`` against the tensor maps MindSpore's test prints.

MindSpore's save/load test 4 (a network of these Layouts saved and loaded) is in
tests/e2e/search/test_mindspore_out_strategy_propagation.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close

import mshard as ms
from mshard import Layout, ops
from mshard._src.frontend.interleave import put, take
from mshard._src.values.layout import to_tensor_strategy

IP = "interleaved_parallel"
SEMI = dict(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
R = np.random.default_rng(41)


def _arr(*shape):
    return jnp.asarray(R.normal(size=shape), jnp.float32)


def test_the_interleaved_axis_is_copies_not_devices():
    lay = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
    assert (lay.mesh.shape, lay.mesh.names, lay.copies) == ((2, 2, 2), ("dp", "mp", "sp"), 2)
    st = to_tensor_strategy(lay(("dp", IP, "mp"), "sp"), "x")
    assert (st.counts, st.axes, st.copies) == ((4, 2), (("dp", "mp"), ("sp",)), (2, 1))
    assert to_tensor_strategy(lay("dp", "sp"), "x").copies is None
    with pytest.raises(ms.errors.LayoutError, match="not devices"):
        Layout((2,), (IP,))


@pytest.mark.parametrize("n, k", [(1, 2), (2, 2), (4, 2), (2, 4)])
def test_copies_are_slices_of_each_devices_block(n, k):
    x = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    block = 32 // n
    for i in range(k):      # copy i: rows [i*r, (i+1)*r) of every device's block, blocks in device order
        want = np.concatenate([x[b * block:(b + 1) * block][i * block // k:(i + 1) * block // k] for b in range(n)])
        np.testing.assert_array_equal(np.asarray(take(jnp.asarray(x), 0, n, k, i)), want)
    parts = [take(jnp.asarray(x), 0, n, k, i) for i in range(k)]
    np.testing.assert_array_equal(np.asarray(put(parts, 0, n, k)), x)


def _run(x_layout, w_layout, x, w, out_layout=None):
    mm = ops.MatMul().shard((x_layout, w_layout), out_strategy=None if out_layout is None else (out_layout,))
    c = _arr(x.shape[0], w.shape[1])

    def loss(x, w):
        return jnp.sum(mm(x, w) * c)
    with ms.parallel_context(**SEMI):
        f = ms.jit(lambda x, w: mm(x, w[...]))
        plan = f.plan(x, nnx.Param(w))
        rep = ms.comm_report(f, x, nnx.Param(w))
        y = f(x, nnx.Param(w))
        g = ms.jit(lambda x, w: jax.grad(loss, argnums=(0, 1))(x, w[...]))(x, nnx.Param(w))
        jaxpr = str(jax.make_jaxpr(lambda x, w: f(x, w))(x, nnx.Param(w)))
    return plan, {k: (v["count"], v["bytes"]) for k, v in rep.by_kind.items()}, y, g, c, jaxpr


def test_an_interleaved_matmul_computes_in_copies_as_the_whole_op_does():
    x, w = _arr(64, 32), _arr(32, 16)
    ip = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
    whole = Layout((2, 2, 2), ("dp", "mp", "sp"))
    plan, comm, y, g, c, jaxpr = _run(ip(("dp", IP), "mp"), ip("mp", "sp"), x, w)
    plan0, comm0, _, _, _, jaxpr0 = _run(whole("dp", "mp"), whole("mp", "sp"), x, w)
    assert plan.strategy_of("MatMul") == plan0.strategy_of("MatMul") == ((2, 2), (2, 2))
    assert plan.op("MatMul").copies == ((2, 1), (1, 1)) and plan0.op("MatMul").copies == ()
    assert (jaxpr.count("dot_general"), jaxpr0.count("dot_general")) == (2, 1)     # the copies are 2 ops
    # each copy reduces its [16, 8] partial sums over mp; the whole op reduces [32, 8]: the same bytes
    assert comm == comm0 and sum(b for _, b in comm.values()) == 32 * 8 * 4
    # the plan is the program: it predicts the ring bytes of that all-reduce over mp's 2 devices, 2 S (k - 1) / k
    assert plan.cost.communication == {"all-reduce": 2 * 32 * 8 * 4 * (2 - 1) / 2}
    # float32: 8-term partial sums over mp added in another order (<= 32 * 2**-24 relative each)
    assert_close(y, x @ w)
    assert_close(g, jax.grad(lambda x, w: jnp.sum((x @ w) * c), argnums=(0, 1))(x, w))


def test_copies_read_split_over_their_reduced_axis_are_put_back_and_reduce_scattered_once():
    """MindSpore's save/load test 4 in one op: rows ``("dp", IP)``, contraction over mp, out_strategy rows
    ``("dp", IP, "mp")``. Device (dp, mp) reads copy mp of its dp rows whole, which no layout of a copy says; the
    copies' partial sums are put back and the put-back is reduce-scattered over mp (joined_sums). The program moves
    what the op computed whole moves (a reduce-scatter straight into the out_strategy, scattered_sums), and the
    plan prices it; outputs and gradients equal plain JAX on one device."""
    x, w = _arr(64, 32), _arr(32, 16)
    ip = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
    whole = Layout((2, 2, 2), ("dp", "mp", "sp"))
    plan, comm, y, g, c, jaxpr = _run(ip(("dp", IP), "mp"), ip("mp", "sp"), x, w, ip(("dp", IP, "mp"), "sp"))
    plan0, comm0, *_ = _run(whole("dp", "mp"), whole("mp", "sp"), x, w, whole(("dp", "mp"), "sp"))
    assert plan.op("MatMul").copies == ((2, 1), (1, 1)) and jaxpr.count("dot_general") == 2
    # each device's partial sums are [32, 8] f32, 1,024 B, over mp's 2 devices: a reduce-scatter moves S (k-1)/k,
    # half an all-reduce's 2 S (k-1)/k; the copies all-reduced each [16, 8] before joined_sums, 1,024 B in all
    assert comm == comm0 == {"reduce-scatter": (1, 32 * 8 * 4 // 2)}
    assert plan.cost.communication == plan0.cost.communication == {"reduce-scatter": 32 * 8 * 4 / 2}
    # float32: 8-term partial sums over mp added in another order (<= 32 * 2**-24 relative each)
    assert_close(y, x @ w)
    assert_close(g, jax.grad(lambda x, w: jnp.sum((x @ w) * c), argnums=(0, 1))(x, w))


def test_an_interleaved_op_called_eagerly_computes_its_copies():
    x, w = _arr(16, 8), _arr(8, 8)
    lay = Layout((4, 2, 2), ("dp", "mp", IP))
    mm = ops.MatMul().shard((lay(("dp", IP), "None"), lay("None", "mp")))
    with ms.parallel_context(**SEMI):
        y = mm(x, w)
    # float32: 8-term dot products, split over devices and copies (<= 8 * 2**-24 relative each)
    assert_close(y, x @ w)


@pytest.mark.parametrize("x_dims, w_dims, shape, match", [
    ((("dp", IP), "mp"), ("mp", "sp"), (6, 32), "does not divide"),          # 6 rows: 2 devices x 2 copies
    (("dp", ("mp", IP)), (("mp",), "sp"), (64, 32), "does not keep"),        # k is reduced
    ((("dp", IP), "mp"), ("mp", "sp"), (64, 32), None),
])
def test_copies_of_a_reduced_dim_or_an_uneven_block_are_refused(x_dims, w_dims, shape, match):
    lay = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
    mm = ops.MatMul().shard((lay(*x_dims), lay(*w_dims)))
    x, w = _arr(*shape), _arr(shape[1], 16)
    with ms.parallel_context(**SEMI):
        f = ms.jit(lambda x, w: mm(x, w))
        if match is None:        # float32: 32-term dot products reordered by the split (<= 32 * 2**-24 relative)
            assert_close(f(x, w), x @ w)
        else:
            with pytest.raises(ms.errors.StrategyError, match=match):
                f(x, w)


def test_copies_of_two_loop_dims_are_refused():
    lay = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
    mm = ops.MatMul().shard((lay(("dp", IP), "mp"), lay("mp", ("sp", IP))))
    with ms.parallel_context(**SEMI), pytest.raises(ms.errors.StrategyError, match="2 loop dims"):
        ms.jit(lambda x, w: mm(x, w))(_arr(64, 32), _arr(32, 16))


def test_a_reshape_in_copies_is_refused():
    """A Reshape is planned as the JAX reshape it computes, whole on each device's block: asked in copies, it says so
    (it said the rows were reduced, which they are not)."""
    lay = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
    r = ops.Reshape().shard((lay(("dp", IP), "None"),))
    with ms.parallel_context(**SEMI), pytest.raises(ms.errors.StrategyError, match="Reshape is computed whole"):
        ms.jit(lambda x: r(x, (4, -1)))(_arr(64, 8))


def test_data_parallel_mode_computes_the_op_whole():
    """data_parallel ignores strategies (MindSpore's too): the op is one dot, its batch split 8 ways."""
    lay = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
    mm = ops.MatMul().shard((lay(("dp", IP), "mp"), lay("mp", "sp")))
    x, w = _arr(64, 32), _arr(32, 16)
    with ms.parallel_context(parallel_mode="data_parallel", device_num=8), \
            pytest.warns(ms.errors.StrategyIgnoredWarning, match="ignores the strategies"):
        f = ms.jit(lambda x, w: mm(x, w[...]))
        jaxpr = str(jax.make_jaxpr(lambda x, w: f(x, w))(x, nnx.Param(w)))
        comm = ms.comm_report(f, x, nnx.Param(w))
        y = f(x, nnx.Param(w))
    assert jaxpr.count("dot_general") == 1 and comm.total_count == 0
    # float32: each device's rows computed whole, the same 32-term dot products (XLA may order them otherwise)
    assert_close(y, x @ w)


def test_to_dict_gives_mindspores_tensor_maps():
    """The tensor maps MindSpore's save/load test 4 expects for these layouts (its IR prints them): axes counted
    from the last of (dp, mp, sp, interleaved_parallel), so dp is 3 and the interleaved axis 0."""
    lay = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
    want = {(("dp", IP), "mp"): ((3, 0), 2), ("mp", "sp"): (2, 1), (("dp", IP, "mp"), "sp"): ((3, 0, 2), 1),
            ("sp", "None"): (1, -1), (("dp", IP, "mp", "sp"), "None"): ((3, 0, 2, 1), -1)}
    for dims, tensor_map in want.items():
        d = lay(*dims).to_dict()
        assert (d["device_matrix"], d["tensor_map"], d["interleaved_parallel"]) == ((2, 2, 2, 2), tensor_map, True)
        assert d["alias_name"] == ("dp", "mp", "sp", IP) and d["rank_list"] == list(range(8))
    # test 5's layouts, without the alias
    d = Layout((2, 2, 2), ("dp", "mp", "sp"))(("dp", "mp"), "sp").to_dict()
    assert (d["tensor_map"], d["interleaved_parallel"]) == (((2, 1), 0), False)


class _FFN(nnx.Module):
    """Two MatMuls whose rows are computed in 2 copies (the Megatron pair, rows over dp)."""

    def __init__(self, rngs: nnx.Rngs):
        lay = Layout((2, 2, 2, 2), ("dp", "mp", "sp", IP))
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (32, 64)) * 0.1)
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (64, 16)) * 0.1)
        self.mm1 = ops.MatMul().shard((lay(("dp", IP), "None"), lay("None", "mp")))
        self.mm2 = ops.MatMul().shard((lay(("dp", IP), "mp"), lay("mp", "None")))

    def __call__(self, x):
        return self.mm2(jnp.tanh(self.mm1(x, self.w1)), self.w2)


def test_a_training_step_with_interleaved_layouts_trains_as_on_one_device():
    """TrainOneStepCell, SGD with momentum, 3 steps: every weight and momentum leaf equals plain JAX + optax on
    one device (no shared code: the reference is written out here)."""
    x, y = _arr(64, 32), _arr(64, 16)
    with ms.parallel_context(**SEMI):
        net = _FFN(nnx.Rngs(0))
        step = ms.nn.TrainOneStepCell(ms.nn.WithLossCell(net, ms.nn.MSELoss()), optax.sgd(0.1, momentum=0.9))
        for _ in range(3):
            step(x, y)
    ref = _FFN(nnx.Rngs(0))
    params = (ref.w1[...], ref.w2[...])
    tx = optax.sgd(0.1, momentum=0.9)
    state = tx.init(params)
    for _ in range(3):
        g = jax.grad(lambda p: jnp.mean((jnp.tanh(x @ p[0]) @ p[1] - y) ** 2))(params)
        upd, state = tx.update(g, state, params)
        params = optax.apply_updates(params, upd)
    # float32: 32- and 64-term dot products reordered by the splits, 3 steps (each ~1e-6 relative)
    assert_close((net.w1[...], net.w2[...]), params)
    leaves = [leaf for leaf in jax.tree.leaves(nnx.state(step)) if getattr(leaf, "shape", ()) in ((32, 64), (64, 16))]
    assert len(leaves) == 4          # the two weights, then their momentum traces
    # the same bound: the traces are sums of the 3 steps' gradients
    assert_close(leaves[2:], list(state[0].trace))
