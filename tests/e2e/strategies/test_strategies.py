"""Every strategy form and mode: sharded result == one device, and output shardings as asked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, on_one_device, rand, split_counts
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mshard as ms
from mshard import Layout, nn, ops

SEMI = dict(parallel_mode="semi_auto_parallel", device_num=8)


def mlp_inputs():
    return rand(0, 16, 32), rand(1, 32, 64), rand(2, 64, 32)


def mlp(x, w1, w2):
    return jax.nn.relu(x @ w1) @ w2


def test_tuple_strategies_on_primitives_megatron():
    ms.set_auto_parallel_context(**SEMI)
    mm1 = ops.MatMul().shard(((2, 1), (1, 4)))
    relu = ops.ReLU().shard(((2, 4),))
    mm2 = ops.MatMul().shard(((2, 4), (4, 1)))
    f = ms.jit(lambda x, w1, w2: mm2(relu(mm1(x, w1)), w2))
    args = mlp_inputs()
    y = f(*args)
    assert_close(y, on_one_device(mlp, *args))
    assert split_counts(y) == (2, 1)     # MatMul ((2,4),(4,1)): rows 2-way, the 4-way contraction all-reduced


def test_functional_shard_call_and_decorator_and_ops_shard():
    ms.set_auto_parallel_context(**SEMI)
    args = mlp_inputs()
    ref = on_one_device(mlp, *args)
    f = ms.shard(mlp, in_strategy=((2, 1), (1, 4), (4, 1)), out_strategy=((2, 1),))
    y = f(*args)
    assert_close(y, ref)
    assert split_counts(y) == (2, 1)

    @ms.shard(in_strategy=((8, 1), (1, 1), (1, 1)), out_strategy=((8, 1),))
    def dp_mlp(x, w1, w2):
        return mlp(x, w1, w2)
    y2 = dp_mlp(*args)
    assert_close(y2, ref)
    assert split_counts(y2) == (8, 1)
    g = ops.shard(mlp, in_strategy=((1, 1), (1, 8), (8, 1)), out_strategy=((1, 8),))
    y3 = g(*args)
    assert_close(y3, ref)
    assert split_counts(y3) == (1, 8)


def test_layout_strategies_and_multi_axis_dim():
    ms.set_auto_parallel_context(**SEMI)
    layout = Layout((2, 4), ("dp", "mp"))
    mm1 = ops.MatMul().shard((layout("dp", "None"), layout("None", "mp")))
    mm2 = ops.MatMul().shard((layout("dp", "mp"), layout("mp", "None")))
    args = mlp_inputs()
    f = ms.jit(lambda x, w1, w2: mm2(jax.nn.relu(mm1(x, w1)), w2))
    y = f(*args)
    assert_close(y, on_one_device(mlp, *args))
    assert y.sharding.mesh.axis_names == ("dp", "mp") and dict(y.sharding.mesh.shape) == {"dp": 2, "mp": 4}
    assert split_counts(y) == (2, 1)
    # one tensor dim over both axes
    both = ms.shard(lambda x: x * 2.0, in_strategy=(layout(("dp", "mp"), "None"),),
                    out_strategy=(layout(("dp", "mp"), "None"),))
    z = both(args[0])
    assert_close(z, args[0] * 2.0)
    assert z.sharding.spec == P(("dp", "mp"), None)


def test_jax_forms_partitionspec_and_namedsharding():
    ms.set_auto_parallel_context(**SEMI)
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    args = mlp_inputs()
    f = ms.shard(mlp, in_strategy=(NamedSharding(mesh, P("data", None)), P(None, "model"), P("model", None)),
                 out_strategy=(P("data", None),))
    y = f(*args)
    assert_close(y, on_one_device(mlp, *args))
    assert y.sharding.spec == P("data", None) and y.sharding.mesh.axis_names == ("data", "model")


def test_different_factorizations_in_one_region():
    ms.set_auto_parallel_context(**SEMI)
    a = ops.MatMul().shard(((2, 1), (1, 4)))
    b = ops.MatMul().shard(((4, 1), (1, 2)))
    x, w1, w3 = rand(0, 16, 32), rand(1, 32, 64), rand(3, 64, 8)
    f = ms.jit(lambda x, w1, w3: b(a(x, w1), w3))
    y = f(x, w1, w3)
    assert_close(y, on_one_device(lambda x, w1, w3: x @ w1 @ w3, x, w1, w3))
    assert split_counts(y) == (4, 2)
    # one jit: a single compiled module whose mesh is the prime-factor mesh
    assert dict(y.sharding.mesh.shape) == {"d0": 2, "d1": 2, "d2": 2}


def test_megatron_hlo_equals_handwritten_jit():
    """x:(2,1), w1:(1,4), w2:(4,1): the same collectives as jax.jit with NamedSharding on a (2,4) mesh."""
    ms.set_auto_parallel_context(**SEMI)
    args = mlp_inputs()
    f = ms.shard(mlp, in_strategy=((2, 1), (1, 4), (4, 1)))
    mine = ms.comm_report(f, *args)
    mesh = jax.make_mesh((2, 4), ("dp", "mp"), axis_types=(AxisType.Auto,) * 2)
    hand = jax.jit(mlp, in_shardings=(NamedSharding(mesh, P("dp", None)), NamedSharding(mesh, P(None, "mp")),
                                      NamedSharding(mesh, P("mp", None))))
    theirs = ms.CommReport.from_hlo(hand.lower(*args).compile().as_text())
    assert theirs.count("all-reduce") == 1 and theirs.total_count == 1   # the textbook Megatron MLP
    assert mine.by_kind == theirs.by_kind
    # forward of one (16/2, 32) f32 partial result = 8*32*4 bytes
    assert mine.bytes("all-reduce") == 8 * 32 * 4
    # the primitive-object form gives the same
    mm1, mm2 = ops.MatMul().shard(((2, 1), (1, 4))), ops.MatMul().shard(((2, 4), (4, 1)))
    relu = ops.ReLU().shard(((2, 4),))
    g = ms.jit(lambda x, w1, w2: mm2(relu(mm1(x, w1)), w2))
    assert ms.comm_report(g, *args).by_kind == theirs.by_kind


def test_transpose_b_and_out_strategy_reduce_scatter():
    ms.set_auto_parallel_context(**SEMI)
    x, w = rand(0, 64, 32), rand(1, 8, 32)
    m = ops.MatMul(transpose_b=True).shard(((4, 2), (1, 2)))
    f = ms.jit(lambda x, w: m(x, w))
    y = f(x, w)
    assert_close(y, on_one_device(lambda x, w: x @ w.T, x, w))
    assert split_counts(y) == (4, 1)
    assert ms.comm_report(f, x, w).count("all-reduce") == 1
    m8 = ops.MatMul(transpose_b=True).shard(((4, 2), (1, 2)), out_strategy=((8, 1),))
    g = ms.jit(lambda x, w: m8(x, w))
    y8 = g(x, w)
    assert_close(y8, on_one_device(lambda x, w: x @ w.T, x, w))
    assert split_counts(y8) == (8, 1)
    # XLA's partitioner runs the out_strategy as an all-reduce and a slice (the hand-written jit below); mshard runs
    # MindSpore's ReduceScatter (mshard/_src/planning/scattered_sums.py): the [16, 8] partial sums over the 2-way
    # k split, [8, 8] per device, half the all-reduce's bytes
    mesh = y8.sharding.mesh
    lay = g.layouts(x, w)
    hand = jax.jit(lambda x, w: x @ w.T, in_shardings=tuple(NamedSharding(mesh, P(*s)) for s in (
        [lay.marks[k] for k in sorted(lay.marks) if k[1] == "in"][0], [lay.marks[k] for k in sorted(lay.marks)
                                                                      if k[1] == "in"][1])),
        out_shardings=NamedSharding(mesh, P(("d0", "d1", "d2"), None)))
    theirs = ms.CommReport.from_hlo(hand.lower(x, w).compile().as_text())
    mine = ms.comm_report(g, x, w)
    assert theirs.total_count == 1 and theirs.moved("all-reduce") == 2 * 16 * 8 * 4 / 2
    assert mine.total_count == 1 and mine.moved("reduce-scatter") == 16 * 8 * 4 / 2


class Net(nn.Cell):
    def __init__(self, rngs):
        self.dense1 = nn.Dense(32, 64, rngs=rngs)
        self.dense2 = nn.Dense(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.dense2(jax.nn.relu(self.dense1(x)))


def net_reference(net, x):
    w1, b1 = np.asarray(net.dense1.weight[...]), np.asarray(net.dense1.bias[...])
    w2, b2 = np.asarray(net.dense2.weight[...]), np.asarray(net.dense2.bias[...])
    return on_one_device(lambda x: jax.nn.relu(x @ w1.T + b1) @ w2.T + b2, x)


def test_cell_shard_with_parameter_plan_eager_and_in_region():
    ms.set_auto_parallel_context(**SEMI)
    net = Net(nnx.Rngs(0))
    x = rand(5, 16, 32)
    ref = net_reference(net, x)
    eager = net(x)                      # no shard config: plain JAX
    assert_close(eager, ref)
    # the batch split and the weight splits meet in dense1's matmul: 8-way data leaves no axis apart for them. Both are
    # storage layouts (docs/design.md invariant 4): stored as asked, redistributed where the matmul computes, and the
    # plan says so (issue 39; a LayoutError before)
    net.shard(in_strategy=((8, 1),), parameter_plan={"dense1.weight": (4, 1), "dense2.weight": (1, 4)})
    assert_close(net(x), ref)
    assert split_counts(net.dense1.weight[...]) == (4, 1)
    notes = ms.jit(lambda n, x: n(x)).plan(net, x).notes
    assert any("parameter_plan['dense1.weight']" in n and "Net input 0" in n and "storage layout" in n for n in notes)
    net.shard(in_strategy=((2, 1),), parameter_plan={"dense1.weight": (4, 1), "dense2.weight": (1, 4)})
    y = net(x)                          # a sharded Cell called eagerly runs as its own region
    assert_close(y, ref)
    assert split_counts(net.dense1.weight[...]) == (4, 1)
    assert split_counts(net.dense2.weight[...]) == (1, 4)
    # parameters were placed once: a second call moves nothing and gives the same
    placed = net.dense1.weight[...]
    assert_close(net(x), ref)
    assert net.dense1.weight[...] is placed
    # the same Cell inside a bigger region
    f = ms.jit(lambda net, x: net(x) * 2.0)
    assert_close(f(net, x), ref * 2.0)


def test_modes_stand_alone_data_parallel_semi_auto():
    net = Net(nnx.Rngs(1))
    x = rand(6, 16, 32)
    ref = net_reference(net, x)

    def loss(net, x):
        return jnp.mean(net(x) ** 2)
    f = ms.jit(lambda net, x: (net(x), nnx.grad(loss)(net, x)))
    ms.set_auto_parallel_context(parallel_mode="stand_alone")
    y0, g0 = f(net, x)
    assert len(y0.sharding.device_set) == 1
    assert_close(y0, ref)
    ms.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
    y1, g1 = f(net, x)
    assert_close(y1, ref)
    assert split_counts(y1) == (8, 1)                           # batch split over all devices
    assert split_counts(net.dense1.weight[...]) == (1, 1)       # params replicated
    assert_close(g1, g0)                                        # mean of per-device grads == full-batch grad
    rep = ms.comm_report(f, net, x)
    assert rep.count("all-reduce") >= 1 and set(rep.by_kind) == {"all-reduce"}
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")   # nothing annotated: data parallel
    y2, g2 = f(net, x)
    assert_close(y2, ref)
    assert split_counts(y2) == (8, 1)
    assert_close(g2, g0)


def test_strategies_ignored_in_data_parallel_and_stand_alone():
    mm = ops.MatMul().shard(((1, 1), (1, 8)))
    x, w = rand(0, 16, 32), rand(1, 32, 64)
    f = ms.jit(lambda x, w: mm(x, w))
    ms.set_auto_parallel_context(parallel_mode="data_parallel")
    with pytest.warns(ms.errors.StrategyIgnoredWarning, match=r"ignores the strategies of \['MatMul'\]"):
        y = f(x, w)
    assert split_counts(y) == (8, 1)
    assert_close(y, on_one_device(lambda x, w: x @ w, x, w))
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    assert split_counts(f(x, w)) == (1, 8)


def test_eager_primitives_and_cache():
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    x, w = rand(0, 16, 32), rand(1, 32, 64)
    assert_close(mm(x, w), x @ w)          # outside a region: plain JAX
    ms.set_auto_parallel_context(**SEMI)
    f = ms.jit(lambda x, w: mm(x, w))
    f(x, w)
    f(x, w)
    assert len(f._cache) == 1
    f(rand(2, 32, 32), w)                  # new shapes: a new trace
    assert len(f._cache) == 2
    ms.set_auto_parallel_context(device_num=4)   # new context: a new trace, on 4 devices, where 2x4 cannot hold
    with pytest.raises(ms.errors.StrategyError, match="exceeds device_num=4"):
        f(x, w)
    mm.shard(((2, 1), (1, 2)))
    y = f(x, w)
    assert len(y.sharding.device_set) == 4 and split_counts(y) == (2, 2)
    assert isinstance(f.lower(x, w), jax.stages.Lowered)


def test_parameter_plan_megatron_cell_gives_one_all_reduce():
    """Column-parallel dense1 ([out,in] weight split on out) and row-parallel dense2: one all-reduce, like Megatron."""
    ms.set_auto_parallel_context(**SEMI)
    net = Net(nnx.Rngs(3))
    x = rand(7, 16, 32)
    ref = net_reference(net, x)
    net.shard(in_strategy=((2, 1),), parameter_plan={"dense1.weight": (4, 1), "dense2.weight": (1, 4)})
    assert_close(net(x), ref)
    rep = ms.comm_report(net, x)
    assert rep.by_kind.keys() == {"all-reduce"} and rep.count("all-reduce") == 1
    assert rep.bytes("all-reduce") == (16 // 2) * 16 * 4      # one (8, 16) f32 partial sum per device


def test_parameters_are_sliced_as_their_first_annotated_consumer_asks():
    """MindSpore slices a parameter by the strategy of the op that uses it: no replicated copy, no gather."""
    ms.set_auto_parallel_context(**SEMI)
    x = rand(0, 16, 32)
    w1, w2 = nnx.Param(rand(1, 32, 64)), nnx.Param(rand(2, 64, 32))
    mm1, mm2 = ops.MatMul().shard(((2, 1), (1, 4))), ops.MatMul().shard(((2, 4), (4, 1)))
    f = ms.jit(lambda x, a, b: mm2(jax.nn.relu(mm1(x, a[...])), b[...]))
    y = f(x, w1, w2)
    assert_close(y, on_one_device(mlp, x, w1[...], w2[...]))
    assert split_counts(w1[...]) == (1, 4) and split_counts(w2[...]) == (4, 1)
    rep = ms.comm_report(f, x, w1, w2)
    assert rep.by_kind.keys() == {"all-reduce"} and rep.count("all-reduce") == 1
