"""MindSpore 2.6's AutoParallel wrapper (issue 16): a script in its style runs, each mode equals one device, and
the wrapper's settings stay with the network (the global context is untouched)."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import MLP, assert_params_close, assert_trees_close, batches, mse, reference_train

import mshard as ms
from mshard import nn
from mshard.errors import ContextError
from mshard.parallel.auto_parallel import AutoParallel

DATA = batches(2, [(32, 16), (32, 8)], seed=4)


def _script(parallel_mode, strategy_file):
    """A MindSpore 2.6 AutoParallel training script, mshard's imports in place of mindspore's:
    ``from mindspore.communication import init`` -> ``from mshard.communication import init``,
    ``from mindspore.parallel.auto_parallel import AutoParallel`` -> ``from mshard.parallel.auto_parallel ...``."""
    from mshard import nn
    from mshard.communication import init
    from mshard.parallel.auto_parallel import AutoParallel

    init(quiet=True)
    net = MLP(nnx.Rngs(0))
    net.fc1.matmul.shard(((2, 1), (4, 1)))
    net.fc2.matmul.shard(((2, 4), (1, 4)))
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.adam(1e-2))
    parallel_net = AutoParallel(train_step, parallel_mode=parallel_mode)
    parallel_net.dataset_strategy("data_parallel")
    parallel_net.hsdp()
    parallel_net.enable_gradients_mean()
    parallel_net.save_param_strategy_file(strategy_file)
    parallel_net.no_init_parameters_in_compile()
    return [float(parallel_net(x, y)) for x, y in DATA], parallel_net, net, train_step


@pytest.mark.parametrize("mode", ["semi_auto", "sharding_propagation", "recursive_programming"])
def test_a_mindspore_26_script_runs_and_equals_one_device(tmp_path, mode):
    ref, ref_opt, ref_losses = reference_train(MLP(nnx.Rngs(0)), optax.adam(1e-2), DATA, mse)
    losses, pnet, net, train_step = _script(mode, tmp_path / "strategy.json")
    # float32 over 2 Adam steps: tests/train_helpers.py's reasoning
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    assert_params_close(net, ref)                                             # every parameter and Adam leaf
    assert_trees_close(train_step.opt_state, ref_opt)
    assert ms.get_auto_parallel_context("parallel_mode") == "stand_alone"      # the global context untouched
    plan = json.loads((tmp_path / "strategy.json").read_text())
    assert plan["format"] and plan["ops"]                                       # the strategy file was written
    want = {"semi_auto": "semi_auto_parallel"}.get(mode, "auto_parallel")
    assert pnet.settings["parallel_mode"] == want and pnet.settings["enable_parallel_optimizer"]
    assert pnet.optimizer is pnet.network.optimizer                             # the wrapped cell's attributes


def test_bad_settings_are_refused_when_made():
    from mshard.parallel.auto_parallel import AutoParallel
    with pytest.raises(ContextError, match="Did you mean 'semi_auto'"):
        AutoParallel(lambda x: x, parallel_mode="semi_aut")
    p = AutoParallel(ms.jit(lambda x: x + 1))
    with pytest.raises(ContextError, match="dataset_strategy"):
        p.dataset_strategy("full_batches")
    assert "dataset_strategy" not in p.settings                # a refused setting changes nothing
    assert float(p(jnp.ones((8,)))[0]) == 2.0


def _reference_sgd(w, b, data, lr):
    """One device, plain JAX: SGD on the MSE of x @ w.T + b, step by step."""
    import jax
    import jax.numpy as jnp

    def loss(p, x, y):
        return jnp.mean((x @ p[0].T + p[1] - y) ** 2)

    p = (jnp.asarray(w), jnp.asarray(b))
    for x, y in data:
        g = jax.grad(loss)(p, x, y)
        p = tuple(a - lr * ga for a, ga in zip(p, g, strict=True))
    return [np.asarray(a) for a in p]


@pytest.mark.parametrize("order", ["step(AutoParallel(net))", "AutoParallel(step(net))", "Model(AutoParallel(net))"])
def test_auto_parallel_composes_with_train_one_step_cell_and_model_in_either_order(order):
    """MindSpore wraps either way round (issue 41: TrainOneStepCell(AutoParallel(net)) raised a flax IndexError).
    The step runs under the wrapper's settings (the column-parallel strategy applies: the weight is stored split
    4 ways) and equals one device; the global context stays as it was. Tolerance: an 8-term dot product in float32."""
    import jax.numpy as jnp
    import optax

    rng = np.random.default_rng(0)
    data = [(jnp.asarray(rng.normal(size=(16, 8)), jnp.float32), jnp.asarray(rng.normal(size=(16, 4)), jnp.float32))
            for _ in range(3)]
    net = nn.Dense(8, 4, weight_init="normal", bias_init="zeros")
    w0, b0 = np.asarray(net.weight[...]), np.asarray(net.bias[...])
    net.matmul.shard(((2, 1), (4, 1)))
    if order == "step(AutoParallel(net))":
        step = nn.TrainOneStepCell(AutoParallel(nn.WithLossCell(net, nn.MSELoss()), "semi_auto"), optax.sgd(0.1))
        for x, y in data:
            step(x, y)
    elif order == "AutoParallel(step(net))":
        step = AutoParallel(nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), optax.sgd(0.1)), "semi_auto")
        for x, y in data:
            step(x, y)
    else:
        model = ms.Model(AutoParallel(net, "semi_auto"), nn.MSELoss(), optax.sgd(0.1))
        model.train(1, data)
    assert ms.get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert net.weight[...].sharding.shard_shape((4, 8)) == (1, 8)
    want_w, want_b = _reference_sgd(w0, b0, data, 0.1)
    np.testing.assert_allclose(np.asarray(net.weight[...]), want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(net.bias[...]), want_b, rtol=1e-5, atol=1e-6)
