"""ms.value_and_grad, ops.GradOperation and ms.jit over closures (issue 41), against jax.grad written out by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mshard as ms
from mshard import nn, ops
from mshard.errors import CellTypeError

X = jnp.array([1.0, -2.0, 3.0])
Y = jnp.array([0.5, 0.25, -1.0])


def _params():
    return ms.Parameter(jnp.array([0.3, -0.1, 0.2])), ms.Parameter(jnp.array(1.5))


def _loss(w, b, x, y):
    return jnp.sum((w * x + b) ** 2 * y)


def test_value_and_grad_positions_weights_and_aux():
    w, b = _params()
    f = lambda x, y: _loss(w[...], b[...], x, y)          # noqa: E731
    want = jax.grad(_loss, argnums=(0, 1, 2, 3))(w[...], b[...], X, Y)
    value, (gx, gw) = ms.value_and_grad(f, (0, 1), [w, b])(X, Y)
    assert float(value) == pytest.approx(float(_loss(w[...], b[...], X, Y)))
    for got, exp in zip(list(gx) + list(gw), [want[2], want[3], want[0], want[1]], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(exp), rtol=1e-6)
    (value, aux), gw = ms.value_and_grad(lambda x, y: (f(x, y), x * 2), None, [w], has_aux=True)(X, Y)
    np.testing.assert_allclose(np.asarray(aux), np.asarray(X * 2))
    np.testing.assert_allclose(np.asarray(gw[0]), np.asarray(want[0]), rtol=1e-6)
    with pytest.raises(CellTypeError, match="both None"):
        ms.value_and_grad(f, None, None)


@pytest.mark.parametrize("get_all, get_by_list", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("sens", [False, True])
def test_grad_operation_returns_mindspores_structure(get_all, get_by_list, sens):
    w, b = _params()
    f = lambda x, y: (w[...] * x + b[...]) * y          # noqa: E731  (a vector: sensitivity or a sum)
    s = jnp.array([1.0, 2.0, -1.0])
    scalar = lambda w_, b_, x, y: jnp.sum(((w_ * x + b_) * y) * (s if sens else 1.0))     # noqa: E731
    want = jax.grad(scalar, argnums=(0, 1, 2, 3))(w[...], b[...], X, Y)
    g = ops.GradOperation(get_all=get_all, get_by_list=get_by_list, sens_param=sens)(
        f if sens else (lambda x, y: jnp.sum(f(x, y))), [w, b])
    out = g(X, Y, s) if sens else g(X, Y)
    if get_all and get_by_list:
        got, exp = list(out[0]) + list(out[1]), [want[2], want[3], want[0], want[1]]
    elif get_all:
        got, exp = list(out), [want[2], want[3]]
    elif get_by_list:
        got, exp = list(out), [want[0], want[1]]
    else:
        got, exp = [out], [want[2]]
    for a, e in zip(got, exp, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6)


def test_jit_over_a_closure_writes_back_and_sees_its_own_writes():
    """An @ms.jit step that updates a Parameter it closes over: each call sees the previous call's value (the
    region's parameters are written back), eagerly and jitted alike."""
    counter = ms.Parameter(jnp.zeros(()))
    net = nn.Dense(3, 1, weight_init="ones", bias_init="zeros")

    def step(x):
        counter[...] = counter[...] + 1
        return net(x)[0, 0] * counter[...]

    jitted = ms.jit(step)
    outs = [float(jitted(jnp.ones((1, 3)))) for _ in range(3)]
    assert outs == [3.0, 6.0, 9.0] and float(counter[...]) == 3.0
    assert float(step(jnp.ones((1, 3)))) == 12.0                 # and eagerly, from where the jitted calls left it
