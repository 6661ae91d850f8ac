"""MindSpore's Parameter, initializer, Tensor, dtypes and seed (issue 41), against their documented definitions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mshard as ms
from mshard import nn
from mshard.common.initializer import HeUniform, Normal, TruncatedNormal, XavierUniform, initializer
from mshard.errors import CellError, CellTypeError


def test_a_parameter_is_an_nnx_param_and_a_frozen_one_is_not_trained():
    w = ms.Parameter(initializer("ones", [2, 3], ms.float32), name="w")
    assert isinstance(w, nnx.Param) and w.name == "w" and w[...].dtype == jnp.float32
    frozen = ms.Parameter(ms.Tensor([1.0, 2.0]), requires_grad=False)
    assert not isinstance(frozen, nnx.Param) and isinstance(frozen, nnx.Variable)

    class Net(nn.Cell):
        def __init__(self):
            self.w = w
            self.scale = frozen
            self.inner = nn.Dense(3, 1, weight_init="zeros", bias_init="zeros")

        def construct(self, x):
            return self.inner(x @ self.w[...]) * self.scale[...][0]

    net = Net()
    assert net(jnp.ones((4, 2))).shape == (4, 1)                      # construct is the forward
    assert [tuple(p[...].shape) for p in net.trainable_params()] == [(1,), (1, 3), (2, 3)]
    assert len(net.get_parameters()) == 4
    assert len(net.trainable_params(recurse=False)) == 1


def test_the_seed_makes_initialisation_repeatable():
    ms.set_seed(7)
    a = [initializer("normal", [3]), nn.Dense(4, 2).weight[...]]
    ms.set_seed(7)
    b = [initializer("normal", [3]), nn.Dense(4, 2).weight[...]]
    ms.set_seed(8)
    c = initializer("normal", [3])
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    assert not np.array_equal(np.asarray(a[0]), np.asarray(c))


@pytest.mark.parametrize("init, shape, bound", [
    # the documented ranges: U(-b, b) with b = gain * sqrt(6 / (fan_in + fan_out)) or gain * sqrt(3 / fan_in)
    (XavierUniform(), (64, 32), math.sqrt(6 / (32 + 64))),
    (HeUniform(), (64, 32), math.sqrt(2) * math.sqrt(3 / 32)),
    ("uniform", (1000,), 0.07),
    (TruncatedNormal(0.1), (4000,), 0.2),
])
def test_bounded_initializers_stay_in_their_documented_range(init, shape, bound):
    x = np.asarray(initializer(init, shape))
    assert x.shape == shape and np.abs(x).max() <= bound
    assert np.abs(x).max() > 0.8 * bound            # and fill it (4000 draws leave no 20% gap at the edge)


def test_normal_has_its_sigma():
    x = np.asarray(initializer(Normal(0.02), (200, 200)))
    assert abs(x.std() - 0.02) < 0.001 and abs(x.mean()) < 0.001     # 40k draws: std error of the std ~1e-4


def test_constants_arrays_and_bad_input():
    assert initializer(0.5, [2]).tolist() == [0.5, 0.5]
    assert initializer(np.arange(3.0), [3]).tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(CellError, match="unknown initializer 'gaussian'"):
        initializer("gaussian", [2])
    with pytest.raises(CellError, match=r"shape \(3,\), not the shape \(4,\)"):
        initializer(np.arange(3.0), [4])
    with pytest.raises(CellTypeError, match="give the shape"):
        initializer("normal")
    with pytest.raises(CellTypeError, match="default_input is None"):
        ms.Parameter(None)


def test_dense_takes_mindspore_initializers_and_needs_no_rngs():
    d = nn.Dense(3, 2, weight_init="ones", bias_init=0.5)
    assert d(jnp.ones((1, 3))).tolist() == [[3.5, 3.5]]
    d = nn.Dense(100, 50)                              # MindSpore's defaults: both U(+-1/sqrt(in))
    assert np.abs(np.asarray(d.weight[...])).max() <= 0.1 and np.abs(np.asarray(d.bias[...])).max() <= 0.1


def test_set_context_takes_mindsporess_keys_and_refuses_unknown_ones():
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", max_device_memory="8GB", jit_config={"jit_level": "O0"})
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    with pytest.raises(ms.errors.ContextError, match="Did you mean 'device_target'"):
        ms.set_context(device_targt="CPU")
    with pytest.raises(ms.errors.ContextError, match="Ascend"):
        ms.set_context(device_target="Ascend")
    with pytest.raises(ms.errors.ContextError, match="GRAPH_MODE"):
        ms.set_context(mode=3)


def test_graph_mode_compiles_a_user_cell_call_and_pynative_runs_it_op_by_op():
    """MindSpore's two modes: under PYNATIVE_MODE (the default) a user's Cell called eagerly runs op by op (each
    op sees concrete arrays); under GRAPH_MODE the call is one compiled region (the ops see tracers, the region's
    plan exists), with the same value."""
    seen = []

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = ms.Parameter(jnp.arange(6.0).reshape(3, 2))

        def construct(self, x):
            seen.append(isinstance(x, jax.core.Tracer))
            return jnp.tanh(x @ self.w[...])

    net, x = Net(), jnp.ones((4, 3))
    assert ms.get_context("mode") == ms.PYNATIVE_MODE
    eager = net(x)
    assert seen == [False]
    ms.set_context(mode=ms.GRAPH_MODE)
    compiled = net(x)
    assert seen[1:] == [True]                         # traced once, inside the region
    net(x)
    assert len(seen) == 2                             # the second call reuses the compiled program
    from mshard._src.frontend.cell import graph_region
    assert graph_region(net).plan(net, x) is not None
    np.testing.assert_array_equal(np.asarray(compiled), np.asarray(eager))
    ms.set_context(mode=ms.PYNATIVE_MODE)
    net(x)
    assert seen[-1] is False
