"""MindSpore's optimizer Cells (issue 41): each optimizer's optax ``tx`` against an independent float64 NumPy
implementation of MindSpore's update (written from MindSpore's formulas and kernels, not from optax), step by step,
every parameter and every optimizer-state leaf; then ``nn.TrainOneStepCell`` given an optimizer Cell (all or some of
the network's parameters) against plain ``jax.grad`` on one device with the NumPy update.

Tolerance (unit tests): float32 ``tx`` against the float64 reference over STEPS steps; each step is ~10 float32
operations per element with O(1) operands, each rounding <= 2**-24 relative (6e-8), so the parameters and moments
differ by a few 1e-6 relative at most (Adam's ``m / (sqrt(v) + eps)`` keeps the relative error of its operands):
RTOL 1e-5, and ATOL 1e-6 for entries that cancel near 0 (biases and LayerNorm's beta start at 0).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import on_one_device
from train_helpers import PARAM_ATOL, PARAM_RTOL, batches

import mshard as ms
from mshard import nn
from mshard._src.frontend.optimizers import SGD, Adam, AdamWeightDecay, Momentum, Optimizer
from mshard.errors import CellError, CellTypeError

STEPS = 4
RTOL, ATOL = 1e-5, 1e-6


class Net(nn.Cell):
    """4 -> 8 -> LayerNorm -> 3: weights, biases, and LayerNorm's gamma/beta (MindSpore skips their weight decay)."""

    def __init__(self, rngs):
        self.fc1 = nn.Dense(4, 8, rngs=rngs)
        self.ln = nn.LayerNorm(8)
        self.fc2 = nn.Dense(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.ln(self.fc1(x)))


def trainable(net):
    """The network's nnx.Param Variables (what ``net.trainable_params()`` returns)."""
    return jax.tree.leaves(nnx.state(net, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))


def _name(path):
    return ".".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))


def named(tree):
    """{dotted path: float64 array} of a Param-shaped tree."""
    return {_name(p): np.asarray(x, np.float64) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def lr_at(lr, t):
    """MindSpore's learning rate at step t (0-based): a float, a callable, or a list whose last value holds."""
    if callable(lr):
        return float(lr(t))
    if isinstance(lr, list):
        return lr[min(t, len(lr) - 1)]
    return lr


def decays(name):
    """MindSpore's decay_filter for ungrouped parameters."""
    return "beta" not in name and "gamma" not in name


# -- float64 references: MindSpore's update, one parameter at a time ------------------------------------
def ref_sgd(p, grads, learning_rate, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, loss_scale=1.0):
    """nn.SGD: scale_grad, then ops.SGD's kernel (weight decay on every parameter; stat = 1 makes accum = g)."""
    accum = {k: np.zeros_like(v) for k, v in p.items()}
    stat = dict.fromkeys(p, 1.0)
    for t, g in enumerate(grads):
        for k in p:
            gn = g[k] / loss_scale
            if weight_decay > 0:
                gn = gn + p[k] * weight_decay
            if momentum > 0:
                if stat[k] > 0:
                    accum[k] = gn
                    stat[k] = 0.0
                else:
                    accum[k] = accum[k] * momentum + (1.0 - dampening) * gn
                gn = gn + accum[k] * momentum if nesterov else accum[k]
            p[k] = p[k] - lr_at(learning_rate, t) * gn
    return p, {"accum": accum}


def ref_momentum(p, grads, learning_rate, momentum, weight_decay=0.0, loss_scale=1.0, use_nesterov=False):
    """nn.Momentum: decay_weight (wd * loss_scale, filtered), scale_grad, ops.ApplyMomentum."""
    moments = {k: np.zeros_like(v) for k, v in p.items()}
    for t, g in enumerate(grads):
        for k in p:
            gk = g[k] + weight_decay * loss_scale * p[k] if weight_decay > 0 and decays(k) else g[k]
            gk = gk * (1.0 / loss_scale)
            moments[k] = moments[k] * momentum + gk
            step = gk + momentum * moments[k] if use_nesterov else moments[k]
            p[k] = p[k] - lr_at(learning_rate, t) * step
    return p, {"trace": moments}


def ref_adam(p, grads, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, use_nesterov=False, weight_decay=0.0,
             loss_scale=1.0):
    """nn.Adam: decay_weight, scale_grad, beta powers, ops.Adam (ApplyAdam)."""
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    beta1_power = beta2_power = 1.0
    for t, g in enumerate(grads):
        beta1_power *= beta1
        beta2_power *= beta2
        l = lr_at(learning_rate, t) * np.sqrt(1.0 - beta2_power) / (1.0 - beta1_power)
        for k in p:
            gk = g[k] + weight_decay * loss_scale * p[k] if weight_decay > 0 and decays(k) else g[k]
            gk = gk * (1.0 / loss_scale)
            m[k] = beta1 * m[k] + (1.0 - beta1) * gk
            v[k] = beta2 * v[k] + (1.0 - beta2) * gk * gk
            num = m[k] * beta1 + (1.0 - beta1) * gk if use_nesterov else m[k]
            p[k] = p[k] - l * num / (np.sqrt(v[k]) + eps)
    return p, {"m": m, "v": v}


def ref_adam_weight_decay(p, grads, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0):
    """nn.AdamWeightDecay's _update_run_op: no bias correction, decay added to the update (filtered)."""
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads):
        for k in p:
            m[k] = beta1 * m[k] + (1.0 - beta1) * g[k]
            v[k] = beta2 * v[k] + (1.0 - beta2) * np.square(g[k])
            update = m[k] / (eps + np.sqrt(v[k]))
            if weight_decay > 0 and decays(k):
                update = weight_decay * p[k] + update
            p[k] = p[k] - lr_at(learning_rate, t) * update
    return p, {"m": m, "v": v}


def check_state(state, want, steps, prefix=""):
    """Every leaf of the optax state: a step counter equals ``steps``; every other leaf is ``want[field][name]``,
    and every entry of ``want`` is some leaf."""
    seen = set()
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        field = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)][-1]
        if field == "count":
            assert int(x) == steps, path
            continue
        name = _name(path)
        assert name.startswith(prefix), path
        np.testing.assert_allclose(np.asarray(x), want[field][name[len(prefix):]], rtol=RTOL, atol=ATOL,
                                   err_msg=str(path))
        seen.add((field, name[len(prefix):]))
    assert seen == {(f, k) for f, d in want.items() for k in d}


CASES = [
    (SGD, ref_sgd, dict(learning_rate=0.1)),
    (SGD, ref_sgd, dict(learning_rate=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01, loss_scale=4.0)),
    (SGD, ref_sgd, dict(learning_rate=[0.1, 0.05], momentum=0.9, nesterov=True, weight_decay=0.01)),
    (Momentum, ref_momentum, dict(learning_rate=0.1, momentum=0.9, weight_decay=0.01, loss_scale=4.0)),
    (Momentum, ref_momentum, dict(learning_rate=lambda s: 0.1 / (1.0 + s), momentum=0.8, use_nesterov=True,
                                  weight_decay=0.05)),
    (Adam, ref_adam, dict(learning_rate=1e-2, weight_decay=0.01, loss_scale=4.0)),
    (Adam, ref_adam, dict(learning_rate=[1e-2, 5e-3, 2e-3], beta1=0.8, eps=1e-3, use_nesterov=True)),
    (AdamWeightDecay, ref_adam_weight_decay, dict(learning_rate=1e-2, weight_decay=0.1)),
    (AdamWeightDecay, ref_adam_weight_decay, dict(learning_rate=[1e-2, 5e-3], beta1=0.8, eps=1e-3,
                                                  weight_decay=0.05)),
]


@pytest.mark.parametrize("cls,ref,kw", CASES, ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(CASES)])
def test_tx_follows_mindspores_update(cls, ref, kw):
    net = Net(nnx.Rngs(0))
    opt = cls(trainable(net), **kw)
    params = nnx.as_pure(nnx.state(net, nnx.Param))
    rng = np.random.default_rng(1)
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape).astype(np.float32)), params)
             for _ in range(STEPS)]
    state = opt.tx.init(params)
    for g in grads:
        updates, state = opt.tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    want_p, want_s = ref(named(nnx.as_pure(nnx.state(net, nnx.Param))), [named(g) for g in grads], **kw)
    got = named(params)
    assert got.keys() == want_p.keys()
    for k in got:
        np.testing.assert_allclose(got[k], want_p[k], rtol=RTOL, atol=ATOL, err_msg=k)
    check_state(state, want_s, STEPS)


def test_weight_decay_skips_beta_and_gamma_except_in_sgd():
    net = Net(nnx.Rngs(0))
    params = nnx.as_pure(nnx.state(net, nnx.Param))
    zeros = jax.tree.map(jnp.zeros_like, params)
    for cls, kw in ((Momentum, dict(momentum=0.0)), (Adam, {}), (AdamWeightDecay, {})):
        opt = cls(trainable(net), learning_rate=0.1, weight_decay=0.5, **kw)
        moved = named(opt.tx.update(zeros, opt.tx.init(params), params)[0])
        assert not moved["ln.gamma"].any() and not moved["ln.beta"].any(), cls.__name__
        assert moved["fc1.weight"].any()
    sgd = SGD(trainable(net), learning_rate=0.1, weight_decay=0.5)
    assert named(sgd.tx.update(zeros, sgd.tx.init(params), params)[0])["ln.gamma"].all()


# -- TrainOneStepCell with an optimizer Cell ----------------------------------------------------------
def reference_momentum(net, data, lr, momentum, weight_decay, which):
    """Plain jax.grad of the MSE on device 0, and MindSpore's Momentum update (float64) of the parameters in
    ``which``; the others keep their values. -> (parameters, moments, losses)."""
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)
    params = nnx.as_pure(params)
    p = named(params)
    moments = {k: np.zeros_like(p[k]) for k in which}

    def loss_fn(ps, x, y):
        return jnp.mean((nnx.merge(graphdef, ps, rest)(x) - y) ** 2)

    losses = []
    for x, y in data:
        cur = jax.tree_util.tree_map_with_path(lambda path, a: jnp.asarray(p[_name(path)], a.dtype), params)
        loss, g = on_one_device(jax.value_and_grad(loss_fn), cur, x, y)
        losses.append(float(loss))
        g = named(g)
        for k in which:
            gk = g[k] + weight_decay * p[k] if decays(k) else g[k]
            moments[k] = moments[k] * momentum + gk
            p[k] = p[k] - lr * moments[k]
    return p, moments, losses


@pytest.mark.parametrize("subset", [None, "fc2."])
def test_train_one_step_cell_with_momentum_matches_one_device(subset):
    """data_parallel on 8 devices, 3 steps of a 16-row batch; ``subset``: the optimizer holds only fc2's
    parameters, and the others must keep their values exactly. Tolerance: tests/train_helpers.py (PARAM_RTOL)."""
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True)
    data = batches(3, [(16, 4), (16, 3)], seed=2)
    net, twin = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    before = named(nnx.as_pure(nnx.state(net, nnx.Param)))
    which = [k for k in before if subset is None or k.startswith(subset)]
    params = [v for k, v in zip(before, trainable(net), strict=True) if k in which]
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                               Momentum(params, learning_rate=0.05, momentum=0.9, weight_decay=0.01))
    losses = [float(step(x, y)) for x, y in data]
    want_p, want_m, want_losses = reference_momentum(twin, data, 0.05, 0.9, 0.01, which)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got = named(nnx.as_pure(nnx.state(net, nnx.Param)))
    assert got.keys() == want_p.keys()
    for k in got:
        if k in which:
            np.testing.assert_allclose(got[k], want_p[k], rtol=PARAM_RTOL, atol=PARAM_ATOL, err_msg=k)
        else:
            np.testing.assert_array_equal(got[k], before[k], err_msg=k)
    # every leaf of the optax state is a moment of a parameter the optimizer holds (optax.trace's accumulator)
    leaves = jax.tree_util.tree_flatten_with_path(step.opt_state)[0]
    assert sorted(_name(path) for path, _ in leaves) == sorted("backbone." + k for k in which)
    for path, x in leaves:
        np.testing.assert_allclose(np.asarray(x), want_m[_name(path)[len("backbone."):]], rtol=PARAM_RTOL,
                                   atol=PARAM_ATOL, err_msg=str(path))
    ms.reset_auto_parallel_context()


@pytest.mark.parametrize("jitted", [False, True])
def test_functional_step_with_momentum_matches_one_device(jitted):
    """MindSpore's functional style: value_and_grad over net.trainable_params() and optimizer(grads), eagerly or in
    an @ms.jit step that closes over the network and the optimizer (data_parallel, 8 devices). The same float64
    Momentum reference as above; tolerance: tests/train_helpers.py (PARAM_RTOL)."""
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True)
    data = batches(3, [(16, 4), (16, 3)], seed=2)
    net, twin = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    optimizer = Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9, weight_decay=0.01)
    loss_fn = nn.MSELoss()

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, net.trainable_params())

    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        optimizer(grads)
        return loss

    step = ms.jit(train_step) if jitted else train_step
    losses = [float(step(jnp.asarray(x), jnp.asarray(y))) for x, y in data]
    names = list(named(nnx.as_pure(nnx.state(net, nnx.Param))))
    want_p, want_m, want_losses = reference_momentum(twin, data, 0.05, 0.9, 0.01, names)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got = named(nnx.as_pure(nnx.state(net, nnx.Param)))
    assert got.keys() == want_p.keys()
    for k in got:
        np.testing.assert_allclose(got[k], want_p[k], rtol=PARAM_RTOL, atol=PARAM_ATOL, err_msg=k)
    # the optimizer's state: one momentum per parameter, in the parameters' order
    state = optimizer.state_variables()[len(optimizer.parameters):]
    by_name = {p.name: np.asarray(v[...]) for p, v in zip(optimizer.parameters, state, strict=True)}
    assert sorted(by_name) == sorted(want_m)
    for k, m in by_name.items():
        np.testing.assert_allclose(m, want_m[k], rtol=PARAM_RTOL, atol=PARAM_ATOL, err_msg=k)
    ms.reset_auto_parallel_context()


# -- what is not supported, and wrong arguments --------------------------------------------------------
def _grouped(net):
    """MindSpore's group parameters over Net: fc1 and the LayerNorm (gamma/beta: decayed, since a group's weight
    decay covers all of it) with lr 0.05 and weight decay 0.1; fc2 with the optimizer's lr 0.1 and no decay;
    ``order_params`` in the network's order."""
    ps = trainable(net)
    names = [p.name for p in net.trainable_params()]
    by = dict(zip(names, net.trainable_params(), strict=True))
    first = [by[n] for n in names if n.startswith(("fc1.", "ln."))]
    second = [by[n] for n in names if n.startswith("fc2.")]
    groups = [{"params": first, "lr": 0.05, "weight_decay": 0.1}, {"params": second}, {"order_params": ps}]
    return groups, {n: (0.05, 0.1) if n.startswith(("fc1.", "ln.")) else (0.1, 0.0) for n in names}


def _momentum_by_group(p, grads, per, momentum):
    """float64 ApplyMomentum with each parameter's own (lr, weight decay), decay on every decayed parameter."""
    moments = {k: np.zeros_like(v) for k, v in p.items()}
    for g in grads:
        for k in p:
            lr, wd = per[k]
            gk = g[k] + wd * p[k]
            moments[k] = moments[k] * momentum + gk
            p[k] = p[k] - lr * moments[k]
    return p, moments


def test_group_parameters_follow_each_groups_lr_and_weight_decay():
    """The optimizer called as ``optimizer(grads)`` (the functional form), and inside TrainOneStepCell against
    plain jax.grad on one device: every parameter and moment equals MindSpore's update with its group's settings."""
    net = Net(nnx.Rngs(0))
    groups, per = _grouped(net)
    opt = Momentum(groups, learning_rate=0.1, momentum=0.9)
    assert [p.name for p in opt.parameters] == [p.name for p in net.trainable_params()]
    start = {p.name: np.asarray(p[...], np.float64) for p in net.trainable_params()}
    rng = np.random.default_rng(1)
    grads = [{p.name: rng.normal(size=p[...].shape) for p in opt.parameters} for _ in range(STEPS)]
    for g in grads:
        opt([jnp.asarray(g[p.name], jnp.float32) for p in opt.parameters])
    want_p, want_m = _momentum_by_group(dict(start), grads, per, 0.9)
    for p in opt.parameters:
        np.testing.assert_allclose(np.asarray(p[...]), want_p[p.name], rtol=RTOL, atol=ATOL, err_msg=p.name)
    # the moments: each parameter's, under its own key in its group's branch of the state
    state_leaves = opt.state_variables()[len(opt.parameters):]
    tree = jax.tree.unflatten(opt._state_def, [v[...] for v in state_leaves])
    moments = {str(path[-1].key).split(".", 1)[1]: np.asarray(x) for path, x in
               jax.tree_util.tree_flatten_with_path(tree)[0] if isinstance(path[-1], jax.tree_util.DictKey)}
    assert moments.keys() == want_m.keys()
    for k, m in moments.items():
        np.testing.assert_allclose(m, want_m[k], rtol=RTOL, atol=ATOL, err_msg=k)
    assert per["ln.gamma"] == (0.05, 0.1)           # the group's decay reaches gamma/beta (MindSpore's rule)
    with pytest.raises(CellError, match="more than one group"):
        Momentum([{"params": trainable(net)}, {"params": trainable(net)[:1]}], learning_rate=0.1, momentum=0.9)
    with pytest.raises(CellError, match="group 0 has keys"):
        Momentum([{"params": trainable(net), "momentum": 0.5}], learning_rate=0.1, momentum=0.9)

    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8, gradients_mean=True)
    net, twin = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    groups, per = _grouped(net)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), Momentum(groups, learning_rate=0.1, momentum=0.9))
    data = batches(3, [(16, 4), (16, 3)], seed=2)
    graphdef, params, rest = nnx.split(twin, nnx.Param, ...)
    p = named(nnx.as_pure(params))
    moments = {k: np.zeros_like(v) for k, v in p.items()}
    for x, y in data:
        step(x, y)
        cur = jax.tree_util.tree_map_with_path(lambda path, a: jnp.asarray(p[_name(path)], a.dtype),
                                               nnx.as_pure(params))
        g = named(on_one_device(jax.grad(lambda ps, x, y: jnp.mean((nnx.merge(graphdef, ps, rest)(x) - y) ** 2)),
                                cur, x, y))
        for k in p:
            lr, wd = per[k]
            moments[k] = moments[k] * 0.9 + g[k] + wd * p[k]
            p[k] = p[k] - lr * moments[k]
    got = named(nnx.as_pure(nnx.state(net, nnx.Param)))
    for k in got:
        np.testing.assert_allclose(got[k], p[k], rtol=PARAM_RTOL, atol=PARAM_ATOL, err_msg=k)
    ms.reset_auto_parallel_context()


def test_calling_the_cell_with_the_wrong_gradients_or_the_base_class_raises():
    net = Net(nnx.Rngs(0))
    ps = trainable(net)
    opt = Momentum(ps, learning_rate=0.1, momentum=0.9)
    with pytest.raises(CellError, match=r"Momentum: 1 gradients for 6 parameters"):
        opt([jnp.zeros(3)])
    with pytest.raises(CellError, match="no update rule"):
        Optimizer(ps, 0.1)


def test_bad_arguments_raise():
    net = Net(nnx.Rngs(0))
    ps = trainable(net)
    with pytest.raises(CellError, match="nesterov"):
        SGD(ps, momentum=0.9, dampening=0.1, nesterov=True)
    with pytest.raises(CellTypeError, match="nnx.Param"):
        Adam([p[...] for p in ps])
    with pytest.raises(CellError, match="learning_rate"):
        Momentum(ps, learning_rate=-0.1, momentum=0.9)
    with pytest.raises(CellError, match="not parameters of the network"):
        nn.TrainOneStepCell(nn.WithLossCell(Net(nnx.Rngs(1)), nn.MSELoss()), Momentum(ps, 0.1, 0.9))
    with pytest.raises(CellTypeError, match="optimizer Cell.*optax GradientTransformation"):
        nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), "sgd")
