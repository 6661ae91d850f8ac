"""Plain flax nnx modules wherever a Cell is accepted (issue 16): ms.shard(module, ..., parameter_plan=...) with
flax paths or MindSpore names, equal to one device, with the collectives of the same plan on a Cell."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import assert_params_close, assert_trees_close, mse, reference_train

import mshard as ms
from mshard.errors import ParameterPlanError


class MLP(nnx.Module):
    """A plain flax MLP, no mshard code."""

    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 256, rngs=rngs)
        self.l2 = nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)
# float32: 64- and 256-term dot products, the 256-term one summed in 4 partial sums across devices
RTOL, ATOL = 1e-5, 1e-5


@pytest.mark.parametrize("plan", [{"kernel": (1, 4)}, {"weight": (1, 4)}])
def test_a_flax_linear_takes_a_parameter_plan_by_flax_path_or_mindspore_name(plan):
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    lin = nnx.Linear(64, 256, rngs=nnx.Rngs(0))
    want = np.asarray(lin(X))
    y = ms.shard(lin, in_strategy=((2, 1),), parameter_plan=plan)(X)
    np.testing.assert_allclose(np.asarray(y), want, rtol=RTOL, atol=ATOL)
    assert lin.kernel[...].sharding.shard_shape((64, 256)) == (64, 64)       # the user's split, placed
    assert y.sharding.shard_shape(y.shape) == (8, 64)


def test_a_flax_mlp_with_megatron_plan_compiles_to_one_all_reduce_and_equals_one_device():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    net = MLP(nnx.Rngs(0))
    want = np.asarray(net(X))
    f = ms.shard(net, in_strategy=((2, 1),),
                 parameter_plan={"l1.kernel": (1, 4), "l1.bias": (4,), "l2.weight": (4, 1)})
    np.testing.assert_allclose(np.asarray(f(X)), want, rtol=RTOL, atol=ATOL)
    rep = ms.comm_report(f.region(), net, X)
    # Megatron: the row-parallel l2's partial sums, [16, 64] float32 split 2 ways on the batch: one all-reduce of
    # 8 x 64 x 4 bytes
    assert rep.total_count == rep.count("all-reduce") == 1 and rep.bytes("all-reduce") == 8 * 64 * 4, rep
    assert net.l2.kernel[...].sharding.shard_shape((256, 64)) == (64, 64)


def test_repeated_unbound_calls_see_written_values_and_assigned_sub_modules():
    """``f = ms.shard(net, ...)``; ``f(x)`` repeatedly takes a cached path (no graph split per call): a value
    written into a Variable, a Variable assigned, and a sub-module assigned between calls are each seen."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    net = MLP(nnx.Rngs(0))
    f = ms.shard(net, in_strategy=((2, 1),), parameter_plan={"l1.kernel": (1, 4)})
    for _ in range(2):
        f(X)
    changes = (
        lambda: net.l2.bias.set_value(net.l2.bias.get_value() + 1.0),              # a value written
        lambda: setattr(net.l2, "bias", nnx.Param(jnp.full((64,), 3.0))),         # a Variable assigned
        lambda: setattr(net, "l2", nnx.Linear(256, 64, rngs=nnx.Rngs(7))),        # a sub-module assigned
    )
    for change in changes:
        change()
        want = np.asarray(ms.shard(nnx.clone(net), in_strategy=((2, 1),))(X))
        for _ in range(2):
            np.testing.assert_allclose(np.asarray(f(X)), want, rtol=RTOL, atol=ATOL)
    assert net.l1.kernel[...].sharding.shard_shape((64, 256)) == (64, 64)


def test_an_ambiguous_or_unknown_key_is_an_error_naming_the_parameters():
    class Both(nnx.Module):
        def __init__(self, rngs):
            self.kernel = nnx.Param(jnp.ones((4, 4)))
            self.embedding = nnx.Param(jnp.ones((4, 4)))

        def __call__(self, x):
            return x @ self.kernel[...] + x @ self.embedding[...]

    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    with pytest.raises(ParameterPlanError, match=r"could mean \['kernel', 'embedding'\]"):
        ms.shard(Both(nnx.Rngs(0)), in_strategy=((2, 1),), parameter_plan={"weight": (1, 2)})(jnp.ones((8, 4)))
    with pytest.raises(ParameterPlanError, match="matches no parameter"):
        ms.shard(MLP(nnx.Rngs(0)), in_strategy=((2, 1),), parameter_plan={"l3.kernel": (1, 2)})(X)


@pytest.mark.parametrize("tx", [optax.adam, optax.sgd])
def test_train_one_step_cell_over_a_plain_flax_module_equals_one_device(tx):
    """Every parameter and optimizer leaf against one device, under Adam and plain SGD (where a gradient's scale
    shows in the parameters)."""
    rng = np.random.default_rng(1)
    data = [(rng.normal(size=(32, 64)).astype(np.float32), rng.normal(size=(32, 64)).astype(np.float32))
            for _ in range(2)]
    ref, ref_opt, ref_losses = reference_train(MLP(nnx.Rngs(0)), tx(1e-3), data, mse)
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True)
    net = MLP(nnx.Rngs(0))
    step = ms.nn.TrainOneStepCell(ms.nn.WithLossCell(net, mse), tx(1e-3))
    # float32, 2 steps: tests/train_helpers.py's reasoning
    np.testing.assert_allclose([float(step(*b)) for b in data], ref_losses, rtol=2e-5)
    assert_params_close(net, ref)
    assert_trees_close(step.opt_state, ref_opt)


def test_op_names_carry_the_module_path_and_the_summary_groups_by_module():
    from gpt import GPT
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    plan = ms.shard(MLP(nnx.Rngs(0)), in_strategy=((2, 1),)).plan(X)
    names = [o.name for o in plan.ops]
    assert "l1/dot_general" in names and "l2/dot_general" in names      # a plain flax module's own path
    g = GPT(nnx.Rngs(0), vocab=32, hidden=32, heads=4, ffn=32, seq=8, layers=2)
    for b in g.blocks:
        b.shard_megatron(2, 4)
    plan = ms.jit(lambda m, x: m(x)).plan(g, jnp.zeros((8, 8), jnp.int32))
    names = [o.name for o in plan.ops]
    assert "blocks.1/attention/query/MatMul" in names and "embedding/Gather" in names, names[:20]
    rows = plan.by_module()
    assert sum(r["ops"] for r in rows) == len(plan.ops)
    assert {r["module"] for r in rows} == {n.rsplit("/", 1)[0] if "/" in n else "(top)" for n in names}
    q = next(r for r in rows if r["module"] == "blocks.1/attention/query")
    assert q["kinds"]["MatMul"] == 1 and q["fixed"] >= 1                  # the Megatron strategy is the user's
    text = str(plan.summary(max_rows=100, group_by="module"))
    assert "blocks.0/attention/query" in text and "blocks.0/attention/query/MatMul" not in text
    with pytest.raises(ms.errors.PlanError, match="group_by"):
        plan.summary(group_by="layer")


def test_visualize_shows_every_shard_with_its_devices_and_mesh_coordinates():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((2, 4), ("dp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.device_put(np.zeros((4, 6, 8), np.float32), NamedSharding(mesh, P(None, "dp", "mp")))
    v = ms.visualize(x)
    assert v.shard_shape == (4, 3, 2) and len(v.rows) == 8
    want = {(r["slices"], tuple(r["devices"])) for r in v.rows}
    # each device's own index ranges, from JAX
    assert want == {("[" + ", ".join(":" if (s.start in (0, None) and s.stop in (n, None)) else f"{s.start}:{s.stop}"
                                     for s, n in zip(idx, x.shape, strict=True)) + "]", (d.id,))
                    for d, idx in x.sharding.devices_indices_map(x.shape).items()}
    rep = ms.visualize(NamedSharding(mesh, P("mp")), shape=(8, 2))           # replicated over dp: 2 devices a shard
    assert [len(r["devices"]) for r in rep.rows] == [2] * 4 and "dp=1, mp=3" in rep.rows[3]["coords"]
    assert "<table>" in v._repr_html_() and "mesh coordinates" in str(v)
    with pytest.raises(ms.errors.StrategyTypeError, match="has no sharding"):
        ms.visualize(np.zeros(3))
