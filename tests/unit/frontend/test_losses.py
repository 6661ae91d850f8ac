"""Loss Cells against their definitions written out in NumPy (float64)."""

import jax.numpy as jnp
import numpy as np
import pytest

from mshard import nn

# float32 log-softmax of values within +-3 over 5 classes: relative error ~1e-7 per term
TOL = dict(rtol=1e-5, atol=1e-6)


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _ce_ids(logits, ids, weight, ignore, reduction, smoothing):
    lp = _log_softmax(logits)
    c = logits.shape[-1]
    out, wsum = [], 0.0
    for i, y in enumerate(ids):
        if y == ignore:
            out.append(0.0)
            continue
        nll = -lp[i, y] * weight[y]
        smooth = -(lp[i] * weight).sum() / c
        out.append((1 - smoothing) * nll + smoothing * smooth)
        wsum += weight[y]
    out = np.array(out)
    return {"mean": out.sum() / wsum, "sum": out.sum(), "none": out}[reduction]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_with_class_ids(reduction, smoothing, weighted):
    rng = np.random.default_rng(0)
    logits = rng.uniform(-3, 3, (6, 5))
    ids = np.array([0, 4, 2, -100, 1, 4])
    weight = rng.uniform(0.5, 2, 5) if weighted else np.ones(5)
    loss = nn.CrossEntropyLoss(weight=weight if weighted else None, reduction=reduction, label_smoothing=smoothing)
    got = loss(jnp.asarray(logits, jnp.float32), jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got), _ce_ids(logits, ids, weight, -100, reduction, smoothing), **TOL)


def test_cross_entropy_with_probabilities_and_spatial_dims():
    rng = np.random.default_rng(1)
    logits = rng.uniform(-3, 3, (2, 5, 3))            # [N, C, d1]
    probs = rng.dirichlet(np.ones(5), (2, 3)).transpose(0, 2, 1)
    want = -(_log_softmax(logits.transpose(0, 2, 1)) * probs.transpose(0, 2, 1)).sum(-1).mean()
    got = nn.CrossEntropyLoss()(jnp.asarray(logits, jnp.float32), jnp.asarray(probs, jnp.float32))
    np.testing.assert_allclose(float(got), want, **TOL)


def test_cross_entropy_refuses_a_smoothing_out_of_range():
    with pytest.raises(ValueError, match="label_smoothing=1.5"):
        nn.CrossEntropyLoss(label_smoothing=1.5)


def _reduce_np(x, reduction):
    return {"mean": np.mean, "sum": np.sum, "none": lambda v: v}[reduction](x)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_common_losses_equal_their_definitions(reduction):
    """L1, SmoothL1 (both sides of beta), BCE with logits (stable form against the plain formula on moderate
    logits, with weight and pos_weight) and NLL (class weights, an ignored sample), in float64 NumPy."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 5)) * 2, rng.normal(size=(6, 5))
    d = np.abs(x - y)
    np.testing.assert_allclose(np.asarray(nn.L1Loss(reduction)(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))),
                               _reduce_np(d, reduction), **TOL)
    beta = 0.7
    smooth = np.where(d < beta, 0.5 * d ** 2 / beta, d - 0.5 * beta)
    assert (d < beta).any() and (d >= beta).any()
    np.testing.assert_allclose(np.asarray(nn.SmoothL1Loss(beta, reduction)(jnp.asarray(x, jnp.float32),
                                                                            jnp.asarray(y, jnp.float32))),
                               _reduce_np(smooth, reduction), **TOL)
    t = rng.uniform(size=(6, 5))
    w, pw = rng.uniform(0.5, 2, size=(5,)), rng.uniform(0.5, 2, size=(5,))
    sig = 1 / (1 + np.exp(-x))
    bce = -(pw * t * np.log(sig) + (1 - t) * np.log(1 - sig)) * w
    got = nn.BCEWithLogitsLoss(reduction, weight=w, pos_weight=pw)(jnp.asarray(x, jnp.float32), jnp.asarray(t, jnp.float32))
    np.testing.assert_allclose(np.asarray(got), _reduce_np(bce, reduction), **TOL)
    logp = _log_softmax(x)
    ids = np.array([0, 4, 2, -100, 1, 4])
    cw = rng.uniform(0.5, 2, size=(5,))
    per = np.array([0.0 if i == -100 else -logp[k, i] * cw[i] for k, i in enumerate(ids)])
    wsum = sum(cw[i] for i in ids if i != -100)
    want = per.sum() / wsum if reduction == "mean" else _reduce_np(per, reduction)
    got = nn.NLLLoss(weight=cw, reduction=reduction)(jnp.asarray(logp, jnp.float32), jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(got), want, **TOL)
