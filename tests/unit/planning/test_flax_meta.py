"""flax's own sharding API as user strategies (issue 16): a model whose parameters carry ``nnx.with_partitioning``
names runs in mshard unchanged, without a global mesh at the call, its parameters stored as the names ask and its
values equal to one device; names no mesh can size are an error, and a parameter_plan wins over the names."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_close
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from train_helpers import assert_params_close, assert_trees_close, reference_train

import mshard as ms
from mshard import nn
from mshard.errors import ParameterPlanError

MESH = dict(axis_shapes=(2, 4), axis_names=("data", "model"))


def _mesh():
    return jax.make_mesh(MESH["axis_shapes"], MESH["axis_names"], axis_types=(AxisType.Auto,) * 2)


class FlaxMLP(nnx.Module):
    """A Megatron MLP written for flax's sharding API only (the public flax examples' style, no mshard code)."""

    def __init__(self, rngs, mesh=None):
        init = nnx.initializers.lecun_normal()
        kw = {} if mesh is None else {"mesh": mesh}
        self.l1 = nnx.Linear(32, 128, kernel_init=nnx.with_partitioning(init, (None, "model"), **kw), rngs=rngs)
        self.l2 = nnx.Linear(128, 32, kernel_init=nnx.with_partitioning(init, ("model", None), **kw), rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _x():
    return jnp.asarray(np.random.default_rng(0).normal(size=(16, 32)), jnp.float32)


def _reference(model, x):
    k1, b1 = np.asarray(model.l1.kernel[...]), np.asarray(model.l1.bias[...])
    k2, b2 = np.asarray(model.l2.kernel[...]), np.asarray(model.l2.bias[...])
    return np.maximum(np.asarray(x) @ k1 + b1, 0) @ k2 + b2


def _check_megatron(model, out, compiled_text):
    assert model.l1.kernel[...].sharding.shard_shape((32, 128)) == (32, 32)      # (None, "model"): 4 column slices
    assert model.l2.kernel[...].sharding.shard_shape((128, 32)) == (32, 32)      # ("model", None): 4 row slices
    assert compiled_text.count("all-reduce(") + compiled_text.count("all-reduce-start(") == 1   # Megatron's one
    assert "all-gather" not in compiled_text                                    # nothing gathers a weight


def test_a_model_created_under_a_mesh_runs_as_its_names_ask_without_the_mesh():
    # the batch on the mesh's 2-way "data" axis, as the flax examples lay it out (the 4-way "model" axis is the
    # weights')
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy=((2, 1),))
    with jax.set_mesh(_mesh()):
        model = FlaxMLP(nnx.Rngs(0))
    x = _x()
    ref = _reference(model, x)
    f = ms.jit(lambda m, x: m(x))                       # no mesh around the call
    out = f(model, x)
    # 128-term sums reordered by the row split and the all-reduce: ~sqrt(128) * 2**-24 relative, inside 1e-5
    assert_close(out, ref)
    _check_megatron(model, out, f.lower(model, x).compile().as_text())


def test_names_with_their_mesh_in_the_metadata_need_no_mesh_anywhere():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    with nnx.use_eager_sharding(False):                 # flax places nothing: the values are on one device
        model = FlaxMLP(nnx.Rngs(0), mesh=_mesh())
    assert len(model.l1.kernel[...].sharding.device_set) == 1
    x = _x()
    f = ms.shard(model, in_strategy=((2, 1),))
    out = f(x)
    assert_close(out, _reference(model, x))
    _check_megatron(model, out, f.lower(x).compile().as_text())
    assert f.plan(x).param_specs["l1.kernel"] == P(None, "model")


def test_names_no_mesh_sizes_get_a_mesh_mshard_makes_from_them():
    """One name, 8 devices: the only way to split it is all 8 (planning/flax_meta.py mesh_sizes); the kernels are
    stored split as named on that mesh and the output equals one device."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    with nnx.use_eager_sharding(False):
        model = FlaxMLP(nnx.Rngs(0))
    f = ms.jit(lambda m, x: m(x))
    out = f(model, _x())
    assert_close(out, _reference(model, _x()))
    assert dict(model.l1.kernel[...].sharding.mesh.shape) == {"model": 8}
    assert model.l1.kernel[...].sharding.shard_shape((32, 128)) == (32, 16)
    assert any(n.startswith("mesh from flax's names: {'model': 8}") for n in f.plan(model, _x()).notes)


def test_names_that_no_way_of_giving_the_devices_splits_are_an_error_naming_the_fixes():
    """A 6-wide dim named for 8 devices: no size of at least 2 both makes 8 and divides 6."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
    with nnx.use_eager_sharding(False):
        lin = nnx.Linear(32, 6, kernel_init=init, rngs=nnx.Rngs(0))
    with pytest.raises(ParameterPlanError, match=r"\('model',\).*8 devices.*mesh="):
        ms.jit(lambda m, x: m(x))(lin, _x())
    ms.set_auto_parallel_context(parallel_mode="data_parallel")      # data_parallel ignores strategies: it runs
    assert ms.jit(lambda m, x: m(x))(lin, _x()).shape == (16, 6)


def test_a_parameter_plan_wins_over_the_names():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    with nnx.use_eager_sharding(False):
        model = FlaxMLP(nnx.Rngs(0), mesh=_mesh())
    f = ms.shard(model, in_strategy=((2, 1),), parameter_plan={"l1.kernel": P(None, None), "l2.kernel": P(None, None)})
    x = _x()
    out = f(x)
    assert_close(out, _reference(model, x))
    assert model.l1.kernel[...].sharding.shard_shape((32, 128)) == (32, 128)
    assert model.l2.kernel[...].sharding.shard_shape((128, 32)) == (128, 32)


def test_adam_moments_follow_their_parameter_where_a_parameter_plan_overrides_the_names():
    """Issue 39: the nnx.Optimizer a TrainOneStepCell builds copies each parameter's names into Adam's moments; the
    moments are stored as their parameter is, also where a parameter_plan overrides the names (l1's kernel whole,
    l2's still split by its names), and every parameter and moment equals one device."""
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            with nnx.use_eager_sharding(False):
                self.m = FlaxMLP(nnx.Rngs(0), mesh=_mesh())

        def __call__(self, x):
            return self.m(x)

    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True)
    net = Net()
    net.shard(in_strategy=((2, 1),), parameter_plan={"m.l1.kernel": P(None, None)})
    rng = np.random.default_rng(0)
    data = [tuple(rng.normal(size=(16, 32)).astype(np.float32) for _ in range(2)) for _ in range(2)]

    def mse(p, y):
        return jnp.mean((p - y) ** 2)

    tx = optax.adam(1e-2, eps=1e-3)    # eps 1e-3: an update stays linear in a tiny gradient (see test_train.py)
    ref, ref_opt, _ = reference_train(net, tx, data, mse)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), tx)
    for batch in data:
        step(*batch)
    assert_params_close(net, ref)
    assert_trees_close(step.opt_state, ref_opt)
    for name, want in (("l1", (32, 128)), ("l2", (32, 32))):
        w = getattr(net.m, name).kernel[...]
        assert w.sharding.shard_shape(w.shape) == want
        for moment in (step.opt_state[0].mu, step.opt_state[0].nu):
            leaf = moment["backbone"]["m"][name]["kernel"]
            assert leaf.sharding.shard_shape(leaf.shape) == want, (name, leaf.sharding)
