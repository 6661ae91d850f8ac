"""MindSpore's ``ops.Dropout`` and ``ops.Print`` (issue 41), and ``nn.Dropout`` without ``rngs``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import mshard as ms
from mshard import nn, ops
from mshard.errors import CellError


def test_ops_dropout_returns_the_scaled_output_and_its_mask_and_draws_a_new_mask_each_call():
    ms.set_seed(5)
    d = ops.Dropout(keep_prob=0.8)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(100, 100)), jnp.float32)
    out, mask = d(x)
    m = np.asarray(mask)
    assert set(np.unique(m)) == {0.0, 1.0}
    # kept elements are x / keep_prob, dropped ones 0 (float32 division, one rounding)
    np.testing.assert_allclose(np.asarray(out), np.asarray(x) * m / np.float32(0.8), rtol=1e-6)
    # 10,000 Bernoulli(0.8) draws: a two-sided binomial test at 1e-6 (fails only on a wrong keep probability)
    assert stats.binomtest(int(m.sum()), m.size, 0.8).pvalue > 1e-6
    _, mask2 = d(x)
    assert not np.array_equal(np.asarray(mask2), m)              # its RNG state advanced
    ms.set_seed(5)
    _, again = ops.Dropout(keep_prob=0.8)(x)
    np.testing.assert_array_equal(np.asarray(again), m)          # the global seed decides the stream
    _, fixed1 = ops.Dropout(keep_prob=0.8, Seed0=7, Seed1=1)(x)
    ms.set_seed(99)
    _, fixed2 = ops.Dropout(keep_prob=0.8, Seed0=7, Seed1=1)(x)
    np.testing.assert_array_equal(np.asarray(fixed1), np.asarray(fixed2))   # nonzero seeds: their own stream
    with pytest.raises(CellError, match="keep_prob"):
        ops.Dropout(keep_prob=0.0)


def test_ops_dropout_inside_a_cell_draws_a_new_mask_each_jitted_step():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dropout = ops.Dropout(keep_prob=0.5)

        def construct(self, x):
            return self.dropout(x)[1]

    ms.set_seed(0)
    net = Net()
    step = ms.jit(lambda n, x: n(x))
    x = jnp.ones((64,))
    a, b = np.asarray(step(net, x)), np.asarray(step(net, x))
    assert not np.array_equal(a, b)                      # the state written back after each call
    ms.set_seed(0)
    ref = Net()
    np.testing.assert_array_equal(np.asarray(ref(x)), a)  # eager draws the same first mask


def test_nn_dropout_without_rngs_is_seeded_by_set_seed():
    ms.set_seed(3)
    a = np.asarray(nn.Dropout(p=0.5)(jnp.ones(256)))
    ms.set_seed(3)
    b = np.asarray(nn.Dropout(p=0.5)(jnp.ones(256)))
    np.testing.assert_array_equal(a, b)
    assert set(np.unique(a)) == {0.0, 2.0}


def test_ops_print_prints_eagerly_and_on_every_run_of_a_compiled_step(capfd):
    p = ops.Print()
    assert p("eager", jnp.arange(3)) is None
    assert capfd.readouterr().out == "eager [0 1 2]\n"

    @ms.jit
    def f(x):
        p("step", x)
        return x + 1

    f(jnp.zeros(2))
    f(jnp.ones(2))
    jax.effects_barrier()
    assert capfd.readouterr().out == "step [0. 0.]\nstep [1. 1.]\n"
