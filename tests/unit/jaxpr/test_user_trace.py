"""A sharded function, Cell, plain module or primitive called inside the user's own jax.jit / grad / vmap honours
its strategies (issue 16): its region's plan is constrained into the caller's program, proven by the compiled HLO
and the results' shardings, and the values equal one device. Where no layout can be constrained (a shard_map body)
it runs as plain JAX and warns exactly once."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, split_counts
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from train_helpers import MLP

import mshard as ms
from mshard import ops
from mshard.errors import StrategyIgnoredWarning


def _x(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


@pytest.fixture(autouse=True)
def _semi_auto():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)


def test_a_sharded_function_inside_jit_keeps_its_layout_and_equals_one_device():
    f = ms.shard(lambda x, w: jnp.tanh(x @ w), in_strategy=((2, 1), (1, 4)))
    x, w = _x(16, 32), _x(32, 64, seed=1)
    g = jax.jit(lambda x, w: f(x, w) * 2)
    y = g(x, w)
    assert_close(y, 2 * jnp.tanh(x @ w))
    # the user's jit holds the plan: the operands are laid out (2, 1) and (1, 4) (the compiled program's
    # parameters after SPMD partitioning have those shard shapes) and the product keeps (2, 4)
    hlo = g.lower(x, w).compile().as_text()
    assert "f32[8,32]" in hlo and "f32[32,16]" in hlo, "the operands are not split as the strategy asks"
    assert split_counts(y) == (2, 4)


def test_a_sharded_cell_and_a_plain_module_inside_jit_place_their_parameters():
    net = MLP(nnx.Rngs(0))
    net.shard(in_strategy=((2, 1),), parameter_plan={"fc1.weight": (4, 1)})
    lin = nnx.Linear(32, 64, rngs=nnx.Rngs(1))
    sl = ms.shard(lin, in_strategy=((2, 1),), parameter_plan={"kernel": (1, 4)})
    x = _x(16, 16)
    ref = MLP(nnx.Rngs(0))(x)                              # the same weights, no strategies: plain JAX
    eager = net(x)                                         # its own region
    traced = jax.jit(lambda m, x: m(x))(net, x)
    assert_close(traced, ref)
    assert_close(eager, ref)
    hlo = jax.jit(lambda m, x: m(x)).lower(net, x).compile().as_text()
    w = net.fc1.weight[...]
    assert f"f32[{w.shape[0] // 4},{w.shape[1]}]" in hlo, "fc1.weight is not stored split 4 ways on dim 0"
    x2 = _x(16, 32, seed=2)
    y = nnx.jit(lambda x: sl(x))(x2)
    assert_close(y, x2 @ lin.kernel[...] + lin.bias[...])
    assert split_counts(y) == (2, 4)


def test_under_grad_and_vmap_the_strategies_hold_and_values_equal_one_device():
    f = ms.shard(lambda x: jnp.tanh(x) * 2, in_strategy=((8, 1),))
    x = _x(16, 16)
    g = jax.grad(lambda x: jnp.sum(f(x)))(x)
    assert_close(g, 2 * (1 - jnp.tanh(x) ** 2))
    assert split_counts(g) == (8, 1)                      # before: the gradient came back on one device
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    xs, w = _x(3, 16, 32), _x(32, 64, seed=1)
    y = jax.vmap(lambda a: mm(a, w))(xs)                  # a batch of products, each laid out (2, 4)
    assert_close(y, jnp.einsum("bij,jk->bik", xs, w))
    assert split_counts(y)[1:] == (2, 4)
    gx = jax.jit(jax.grad(lambda a: jnp.sum(mm(a, w) ** 2)))(xs[0])
    assert_close(gx, 2 * (xs[0] @ w) @ w.T, rtol=1e-4, atol=1e-4)   # 64-term sums of 32-term products: 2 roundings


def test_inside_a_shard_map_it_warns_once_and_runs_plain():
    f = ms.shard(lambda x: x * 3, in_strategy=((8, 1),))
    mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
    body = jax.shard_map(lambda x: f(x) + f(x), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    x = _x(16, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = body(x)
        y = jax.shard_map(lambda x: f(x), mesh=mesh, in_specs=P("i"), out_specs=P("i"))(x) + y
    assert_close(y, 9 * x)
    mine = [w for w in caught if issubclass(w.category, StrategyIgnoredWarning)]
    assert len(mine) == 1 and "shard_map" in str(mine[0].message) and "shard(<lambda>)" in str(mine[0].message)


def test_data_parallel_ignores_strategies_inside_jit_as_everywhere():
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    f = ms.shard(lambda x: x + 1, in_strategy=((2, 4),))
    x = _x(16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # no warning: the mode says strategies are ignored
        y = jax.jit(f)(x)
    assert_close(y, x + 1)
    assert len(y.sharding.device_set) == 1
