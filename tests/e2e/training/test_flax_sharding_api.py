"""flax's sharding API as users write it, trained under mshard equal to one device (issue 39).

The model (``tests/flax_sharded_llm.py``) annotates its weights with ``nnx.with_partitioning`` for an
``fsdp x tp`` mesh and its activations with ``out_sharding=`` (the Explicit-axes form) or
``with_sharding_constraint`` (the Auto-axes form). It is created under ``jax.set_mesh`` and trained by the flax
step users write, with ``@nnx.jit`` replaced by ``@ms.jit``.

The reference is the same model with no activation annotation, trained by plain flax + optax under ``jax.jit`` on
one device: it shares no mshard code. SGD with momentum: the momentum leaf is the sum of the gradients, so a
gradient-scale bug shows in it and in every weight (Adam would normalise it away).
"""

import contextlib
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax_sharded_llm import Config, Decoder, loss_fn
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from train_helpers import assert_trees_close

import mshard as ms

SIZES = {"fsdp": 2, "tp": 4}
RNG = np.random.default_rng(4)
DATA = [(RNG.integers(0, 64, (8, 16)).astype(np.int32), RNG.integers(0, 64, (8, 16)).astype(np.int32))
        for _ in range(3)]


def _tx():
    return optax.sgd(0.1, momentum=0.9)


def _flax_step(model, opt, tokens, labels):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, labels)
    opt.update(model, grads)
    return loss


def _reference():
    model = Decoder(Config(style="none"), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    step = nnx.jit(_flax_step)
    losses = [float(step(model, opt, t, lab)) for t, lab in DATA]
    return model, opt, losses


@pytest.fixture(scope="module")
def reference():
    return _reference()


def _token_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _train(style: str, axis_type: AxisType, mode: str, ambient: bool, cell: bool = False):
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(axis_type,) * 2)
    ms.set_auto_parallel_context(parallel_mode=mode, device_num=8)
    with jax.set_mesh(mesh):
        model = Decoder(Config(style=style), rngs=nnx.Rngs(0))
    if cell:        # MindSpore's form, built with no mesh around it
        step = ms.nn.TrainOneStepCell(ms.nn.WithLossCell(model, _token_loss), _tx())
        opt, region = step.optimizer, None
    else:
        with jax.set_mesh(mesh):
            opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
        region = ms.jit(_flax_step)
        step = functools.partial(region, model, opt)
    losses = []
    for t, lab in DATA:
        # placed as the public examples place their batches: split over fsdp
        t, lab = (jax.device_put(a, NamedSharding(mesh, P("fsdp", None))) for a in (t, lab))
        if ambient:
            with jax.set_mesh(mesh):
                losses.append(float(step(t, lab)))
        else:       # no mesh around the call: the mesh is the one the parameters were created on
            losses.append(float(step(t, lab)))
    jaxpr = region.jaxpr(model, opt, *DATA[0]) if region is not None else None
    ms.reset_auto_parallel_context()
    return model, opt, losses, jaxpr


def _stored_as_annotated(model, opt, sizes=SIZES):
    """Every weight and its momentum are stored as its flax names say, on the mesh of ``sizes`` (2 x 4)."""
    params = [v for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
    moments = jax.tree.leaves(nnx.state(opt, nnx.OptState))
    moments = [m for m in moments if getattr(m, "ndim", 0) > 0]
    assert len(params) == len(moments)
    for v, m in zip(params, moments, strict=True):
        names = v.get_metadata()["out_sharding"]
        want = tuple(n // (sizes[a] if a else 1) for n, a in zip(v.shape, names, strict=True))
        x = v[...]
        assert x.sharding.shard_shape(x.shape) == want, (names, x.sharding)
        assert m.sharding.shard_shape(m.shape) == want, (names, m.sharding)


CASES = {
    # (activation style, the mesh's axis types, mode, a mesh set around the call)
    "out_sharding_explicit_mesh": ("explicit", AxisType.Explicit, "semi_auto_parallel", True),
    "out_sharding_auto_mesh": ("explicit", AxisType.Auto, "semi_auto_parallel", True),
    "out_sharding_mesh_from_parameters": ("explicit", AxisType.Explicit, "semi_auto_parallel", False),
    "constraints_auto_mesh": ("constraint", AxisType.Auto, "semi_auto_parallel", True),
    "out_sharding_auto_parallel": ("explicit", AxisType.Explicit, "auto_parallel", True),
    "out_sharding_train_one_step_cell": ("explicit", AxisType.Explicit, "semi_auto_parallel", False, True),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_flax_model_written_for_sharding_trains_like_one_device(case, reference):
    ref_model, ref_opt, ref_losses = reference
    model, opt, losses, jaxpr = _train(*CASES[case])
    # float32 softmax over 64 logits and sums over 8 x 16 tokens, reordered by the split reductions: a few ulps
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
    assert_trees_close(nnx.state(opt, nnx.OptState), nnx.state(ref_opt, nnx.OptState))
    _stored_as_annotated(model, opt)
    if jaxpr is None:
        return
    # the activations' annotations reach the planner as layouts: each is a constraint in the region's program
    specs = {tuple(e.params["sharding"].spec) for e in jaxpr.eqns if e.primitive.name == "sharding_constraint"}
    assert {("fsdp", None, "tp", None), ("fsdp", None, "tp"), ("fsdp", None, None)} <= specs, specs
    # and no sharding type is left in it: the types were erased to those constraints
    assert all(getattr(v.aval, "sharding", None) is None or all(a is None for a in v.aval.sharding.spec)
               for e in jaxpr.eqns for v in e.outvars)


def _names_only(style: str, mesh=None):
    """The model and its optimizer created with flax's names and no mesh (flax allows that only with eager sharding
    off), trained by the flax step under ``ms.jit``, under ``mesh`` if one is given."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    with nnx.use_eager_sharding(False):
        model = Decoder(Config(style=style), rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
    region = ms.jit(_flax_step)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        plan = region.plan(model, opt, *DATA[0])
        losses = [float(region(model, opt, t, lab)) for t, lab in DATA] if mesh is None else None
    ms.reset_auto_parallel_context()
    return model, opt, plan, losses


@pytest.mark.slow
def test_names_that_no_mesh_sizes_get_the_cheapest_mesh_mshard_makes(reference):
    """Names with no mesh anywhere (not on a Variable, not on a value, not around the call): mshard gives the 8
    devices to ``fsdp`` and ``tp`` in every way that splits each (2 x 4, 4 x 2), plans the step under each, keeps
    the cheapest by the cost model, and trains equal to one device with every weight and momentum stored as its
    names say on that mesh. Checked against the same step planned under each candidate mesh set by hand."""
    ref_model, ref_opt, ref_losses = reference
    model, opt, plan, losses = _names_only("constraint")
    # float32 softmax over 64 logits and sums over 8 x 16 tokens, reordered by the split reductions: a few ulps
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
    assert_trees_close(nnx.state(opt, nnx.OptState), nnx.state(ref_opt, nnx.OptState))
    chosen = dict(model.embed[...].sharding.mesh.shape)
    _stored_as_annotated(model, opt, chosen)
    costs = {}
    for sizes in ((2, 4), (4, 2)):
        mesh = jax.make_mesh(sizes, ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
        costs[sizes] = _names_only("constraint", mesh)[2].cost.total
    assert plan.cost.total == min(costs.values()), (chosen, plan.cost.total, costs)
    assert costs[(chosen["fsdp"], chosen["tp"])] == plan.cost.total
    assert any(n.startswith(f"mesh from flax's names: {chosen}") for n in plan.notes), plan.notes
    # MindSpore's form: a TrainOneStepCell over the same names-only model takes the same mesh and values
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    with nnx.use_eager_sharding(False):
        model = Decoder(Config(style="constraint"), rngs=nnx.Rngs(0))
    step = ms.nn.TrainOneStepCell(ms.nn.WithLossCell(model, _token_loss), _tx())
    losses = [float(step(t, lab)) for t, lab in DATA]
    ms.reset_auto_parallel_context()
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
    assert_trees_close(nnx.state(step.optimizer, nnx.OptState), nnx.state(ref_opt, nnx.OptState))
    assert dict(model.embed[...].sharding.mesh.shape) == chosen
    _stored_as_annotated(model, step.optimizer, chosen)


def test_the_model_is_valid_explicit_sharding_code_under_plain_jax():
    """The ``"explicit"`` model is what a user of JAX's explicit sharding writes: plain ``jax.jit`` on an Explicit
    mesh traces its training step (so the test above is not of a program JAX itself refuses)."""
    mesh = jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        model = Decoder(Config(style="explicit"), rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, _tx(), wrt=nnx.Param)
        t = jax.device_put(DATA[0][0], P("fsdp", None))
        graph, state = nnx.split((model, opt))

        def pure(state, t):
            m, o = nnx.merge(graph, state)
            return _flax_step(m, o, t, t)

        out = jax.eval_shape(pure, state, t)
    assert out.shape == ()
