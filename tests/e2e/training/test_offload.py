"""Host offload of the optimizer state (issue 39): ``ms.set_offload_context(offload_config={"offload_param": "cpu"})``
keeps a TrainOneStepCell's optimizer state in host memory (``pinned_host``) between steps; the step moves it to the
device for the update and back.

What the CPU simulation can show: the memory kind of every stored array and of every compiled input, the values
(equal to one device, and bit for bit to the same step without offload), and a checkpoint round trip. What it cannot:
the device memory saved (XLA:CPU's ``memory_analysis`` does not split host from device arguments, and both are the
same RAM), nor the transfer time; the device bytes below are summed from the arrays' own memory kinds."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import on_one_device
from train_helpers import MLP, PARAM_ATOL, PARAM_RTOL, batches, mse

import mshard as ms
from mshard import nn
from mshard.errors import ContextError

DATA = batches(3, [(32, 16), (32, 8)], seed=3)
MODES = {"data_parallel": dict(parallel_mode="data_parallel"),
         "megatron": dict(parallel_mode="semi_auto_parallel")}


def _train(mode, offload, steps=DATA):
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(device_num=8, gradients_mean=True, **MODES[mode])
    ms.set_offload_context(offload_config={"offload_param": "cpu" if offload else ""})
    net = MLP(nnx.Rngs(3))
    if mode == "megatron":
        net = net.megatron(2, 4)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.adam(1e-2))
    losses = [float(step(x, y)) for x, y in steps]
    return step, losses


def _device_bytes(arrays):
    """Bytes per device of the arrays kept in device memory (their shard shapes)."""
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in arrays
               if x.sharding.memory_kind in (None, "device"))


def _reference():
    """3 Adam steps of the same MLP, plain jax.grad + optax on one device."""
    graphdef, params, rest = nnx.split(MLP(nnx.Rngs(3)), nnx.Param, ...)
    params = nnx.as_pure(params)
    tx = optax.adam(1e-2)
    state = tx.init(params)

    def one(params, state, x, y):
        g = jax.grad(lambda p: mse(nnx.merge(graphdef, p, rest)(x), y))(params)
        updates, state = tx.update(g, state, params)
        return optax.apply_updates(params, updates), state
    for x, y in DATA:
        params, state = on_one_device(one, params, state, x, y)
    return params, state


@pytest.mark.parametrize("mode", sorted(MODES))
def test_offloaded_optimizer_state_lives_in_host_memory_and_trains_like_one_device(mode):
    step, losses = _train(mode, offload=True)
    compiled = step.lower(*DATA[0]).compile()          # under the offload context it was trained in
    kinds = {s.memory_kind for s in jax.tree.leaves(compiled.input_shardings)}
    assert kinds == {"device", "pinned_host"}
    plain, plain_losses = _train(mode, offload=False)
    state = jax.tree.leaves(step.opt_state)
    params = jax.tree.leaves(nnx.as_pure(nnx.state(step.network, nnx.Param)))
    assert state and all(x.sharding.memory_kind == "pinned_host" for x in state)
    assert all(x.sharding.memory_kind == "device" for x in params)
    # the same program but for where the state waits between steps: bit for bit the same training
    assert losses == plain_losses
    for a, b in zip(state, jax.tree.leaves(plain.opt_state), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(params, jax.tree.leaves(nnx.as_pure(nnx.state(plain.network, nnx.Param))), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # and equal to one device, every parameter and Adam leaf
    want_p, want_s = _reference()
    for a, b in zip(params, jax.tree.leaves(want_p), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=PARAM_RTOL, atol=PARAM_ATOL)
    got_s = [np.asarray(x) for x in state if x.ndim]
    want = [np.asarray(x) for x in jax.tree.leaves(want_s) if np.ndim(x)]
    assert len(got_s) == len(want) == 2 * len(params)
    for a, b in zip(got_s, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    # device memory: what stays on the device is the parameters; Adam's two moments (2x the parameters) left it
    kept = _device_bytes(params + state)
    assert kept == _device_bytes(params) and _device_bytes(jax.tree.leaves(plain.opt_state)) > 2 * kept * 0.99
    ms.reset_auto_parallel_context()


def test_an_offloaded_step_saves_loads_and_resumes_bit_for_bit(tmp_path):
    step, _ = _train("data_parallel", offload=True, steps=DATA[:2])
    ms.save_checkpoint(step, tmp_path).wait()
    again = nn.TrainOneStepCell(nn.WithLossCell(MLP(nnx.Rngs(9)), mse), optax.adam(1e-2))
    r = ms.load_checkpoint(tmp_path, again, inputs=DATA[0])
    assert (r.param_not_load, r.ckpt_not_load) == ([], [])
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(again.opt_state))
    assert float(again(*DATA[2])) == float(step(*DATA[2]))
    for a, b in zip(jax.tree.leaves(again.opt_state), jax.tree.leaves(step.opt_state), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    ms.reset_auto_parallel_context()


def test_offload_context_keys():
    ms.set_offload_context(offload_config={"offload_param": "cpu", "offload_path": "/tmp", "enable_aio": False})
    assert ms.get_offload_context()["offload_param"] == "cpu"
    assert ms.get_auto_parallel_context("offload_config")["offload_path"] == "/tmp"
    with pytest.raises(ContextError, match="disk.*not offered"):
        ms.set_offload_context(offload_config={"offload_param": "disk"})
    with pytest.raises(ContextError, match="Did you mean 'offload_param'"):
        ms.set_offload_context(offload_config={"offload_parm": "cpu"})
    ms.reset_auto_parallel_context()
    assert ms.get_offload_context()["offload_param"] == ""
    assert jnp.zeros(1).sharding.memory_kind == "device"


def test_a_hand_written_step_refuses_offload_rather_than_ignore_it():
    """Only TrainOneStepCell keeps the optimizer state in host memory; an ms.jit step that updates parameters
    under the setting raises (in stand_alone too), naming the setting and the fix, and updates nothing."""
    ms.set_offload_context(offload_config={"offload_param": "cpu"})
    net = MLP(nnx.Rngs(3))
    opt = nnx.Optimizer(net, optax.adam(1e-2), wrt=nnx.Param)

    @ms.jit
    def step(net, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda n: mse(n(x), y))(net)
        opt.update(net, grads)
        return loss
    before = np.asarray(net.fc1.weight[...])
    with pytest.raises(ContextError, match="offload_param.*nn.TrainOneStepCell"):
        step(net, opt, *DATA[0])
    np.testing.assert_array_equal(np.asarray(net.fc1.weight[...]), before)
    ms.reset_auto_parallel_context()


def _host_puts(jaxpr) -> int:
    """device_put equations to host memory in a jaxpr and every jaxpr nested in it."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and any("Host" in str(d) for d in eqn.params["devices"]):
            n += 1
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _host_puts(inner)
    return n


def _train_offloading_activations(mode, offload):
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(device_num=8, gradients_mean=True, **MODES[mode])
    net = MLP(nnx.Rngs(3))
    if mode == "megatron":
        net = net.megatron(2, 4)
    if offload:
        for layer in (net.fc1, net.fc2, net.fc3):
            layer.offload()
    step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.adam(1e-2))
    puts = _host_puts(step.jaxpr(*DATA[0]).jaxpr)
    for x, y in DATA:
        step(x, y)
    ms.reset_auto_parallel_context()
    return step, puts


@pytest.mark.parametrize("mode", sorted(MODES))
def test_offloaded_activations_go_to_host_memory_and_train_like_one_device(mode):
    """``Cell.offload()`` (MindSpore's name): each layer's matmul result, which its backward reads, is moved to host
    memory in the forward and back in the backward. The traced step holds those moves; XLA:CPU compiles them away
    (host and device are one RAM), so the device memory saved cannot be measured here. The values equal one device
    on every parameter and Adam leaf."""
    step, puts = _train_offloading_activations(mode, True)
    _, plain = _train_offloading_activations(mode, False)
    assert plain == 0
    # fc1's and fc2's matmul results feed their ReLU's backward, fc3's feeds nothing: at least one move per
    # ReLU'd layer
    assert puts >= 2, puts
    ref_params, ref_state = _reference()
    for got, want in zip(jax.tree.leaves(nnx.as_pure(nnx.state(step.network, nnx.Param))),
                         jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=PARAM_RTOL, atol=PARAM_ATOL)
    got_state = [x for x in jax.tree.leaves(nnx.as_pure(nnx.state(step.optimizer, nnx.OptState))) if x.ndim]
    want_state = [x for x in jax.tree.leaves(ref_state) if x.ndim]
    for got, want in zip(got_state, want_state, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=PARAM_RTOL, atol=PARAM_ATOL)
