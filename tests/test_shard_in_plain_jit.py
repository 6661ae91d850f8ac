"""A sharded function or Cell called inside the user's own jax.jit / grad runs as plain JAX there (it is its
own mshard region only when called with concrete arrays)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import assert_close
from train_helpers import MLP

import mshard as ms


def test_sharded_cell_and_function_inside_plain_jit():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    net = MLP(nnx.Rngs(0))
    net.shard(in_strategy=((2, 1),), parameter_plan={"fc1.weight": (4, 1)})
    f = ms.shard(lambda x: jnp.tanh(x) * 2, in_strategy=((8, 1),))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 16)), jnp.float32)
    eager_cell, eager_f = net(x), f(x)                     # concrete arrays: each runs as its own region
    assert len(eager_f.sharding.device_set) == 8
    assert_close(jax.jit(lambda m, x: m(x))(net, x), eager_cell)
    assert_close(jax.jit(f)(x), eager_f)
    g = jax.grad(lambda x: jnp.sum(f(x)))(x)               # and under a plain grad
    assert_close(g, 2 * (1 - jnp.tanh(x) ** 2))
