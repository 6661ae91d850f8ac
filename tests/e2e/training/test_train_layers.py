"""The nn layers against independent numpy formulas, and sharded (ms.jit, 8 devices) against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close, rand

import mshard as ms
from mshard import nn
from mshard.errors import CellError

# float32: a gather is exact and the one-hot path's matmul adds 9 exact zeros (0 * x), so only a wrong row fails
TOL = dict(rtol=1e-5, atol=1e-5)


def test_embedding_is_a_table_lookup_and_one_hot_agrees():
    emb = nn.Embedding(10, 4, padding_idx=0, rngs=nnx.Rngs(0))
    table = np.asarray(emb.embedding_table[...])
    ids = np.array([[1, 2, 0], [9, 9, 3]])
    np.testing.assert_allclose(np.asarray(emb(ids)), table[ids], **TOL)
    assert not table[0].any()
    emb.use_one_hot = True
    np.testing.assert_allclose(np.asarray(emb(ids)), table[ids], **TOL)


def test_layernorm_matches_the_formula():
    ln = nn.LayerNorm((6,), epsilon=1e-7)
    ln.gamma[...] = jnp.arange(1.0, 7.0)
    ln.beta[...] = jnp.full((6,), 0.5)
    x = np.asarray(rand(0, 3, 5, 6))
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    want = (x - mean) / np.sqrt(var + 1e-7) * np.arange(1.0, 7.0) + 0.5
    # float32: 6-term mean and variance (~6 * 2**-24 = 4e-7) and rsqrt vs numpy's formula (a few ulps), scaled by gamma <= 6
    np.testing.assert_allclose(np.asarray(ln(x)), want, rtol=1e-5, atol=1e-5)


def test_dropout_rate_scale_and_train_mode():
    d = nn.Dropout(keep_prob=0.75, rngs=nnx.Rngs(0))
    assert d.p == 0.25
    y = np.asarray(d(jnp.ones((200, 200))))
    kept = y != 0
    # 40000 Bernoulli(0.75) draws: std sqrt(0.75 * 0.25 / 40000) = 0.0022, so 0.01 is 4.6 sigma; np.allclose's default
    # rtol=1e-5 bounds the float32 rounding of 1 / 0.75 (2**-24)
    assert abs(kept.mean() - 0.75) < 0.01 and np.allclose(y[kept], 1 / 0.75)
    d.set_train(False)
    np.testing.assert_array_equal(np.asarray(d(jnp.ones((3, 3)))), np.ones((3, 3)))
    with pytest.raises(CellError, match="must be in"):
        nn.Dropout(p=1.0, rngs=nnx.Rngs(0))


def _conv_numpy(x, w, pad):
    n = x.shape[0]
    o, _, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), pad, pad))
    out = np.zeros((n, o, xp.shape[2] - kh + 1, xp.shape[3] - kw + 1), np.float32)
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            out[:, :, i, j] = np.einsum("nchw,ochw->no", xp[:, :, i:i + kh, j:j + kw], w)
    return out


def test_conv2d_same_and_valid_and_maxpool():
    conv = nn.Conv2d(3, 4, 3, pad_mode="same", has_bias=True, rngs=nnx.Rngs(0))
    conv.bias[...] = jnp.arange(4.0)
    x = np.asarray(rand(1, 2, 3, 8, 8))
    w = np.asarray(conv.weight[...])
    want = _conv_numpy(x, w, (1, 1)) + np.arange(4.0)[None, :, None, None]
    # float32: 27-term sums (3 channels x 3 x 3) in XLA's order vs numpy einsum's, <= 27 * 2**-24 = 1.6e-6 relative to
    # sum |terms|; atol for outputs that cancel near 0
    np.testing.assert_allclose(np.asarray(conv(x)), want, rtol=1e-4, atol=1e-4)
    valid = nn.Conv2d(3, 4, 3, pad_mode="valid", rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(valid(x)), _conv_numpy(x, w, (0, 0)), rtol=1e-4, atol=1e-4)
    pool = nn.MaxPool2d(2, 2)
    np.testing.assert_array_equal(np.asarray(pool(x)), x.reshape(2, 3, 4, 2, 4, 2).max(axis=(3, 5)))


def _attention_numpy(att, x):
    b, s, h = x.shape
    nh, hd = att.num_heads, att.head_dim

    def dense(d, t):
        return t @ np.asarray(d.weight[...]).T + np.asarray(d.bias[...])
    q, k, v = (dense(d, x).reshape(b, s, nh, hd).transpose(0, 2, 1, 3) for d in (att.query, att.key, att.value))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -1e9)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = (p @ v).transpose(0, 2, 1, 3).reshape(b, s, h)
    return dense(att.projection, ctx)


def test_multi_head_attention_matches_numpy_and_megatron_sharding():
    att = nn.MultiHeadAttention(16, 4, rngs=nnx.Rngs(0))
    x = np.asarray(rand(2, 8, 8, 16))
    want = _attention_numpy(att, x)
    # float32: 16-term projections, 4-term head dots and an 8-key softmax vs numpy (scores in float64): <= 16 * 2**-24
    # = 1e-6 relative per dot over 4 ops, exp turning the scores' error into a relative one; atol for outputs near 0
    np.testing.assert_allclose(np.asarray(att(x)), want, rtol=1e-4, atol=1e-5)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    att.shard_megatron(2, 4)
    f = ms.jit(lambda m, x: m(x))
    # the same bound; the row-parallel projection adds 4 partial sums of 4 terms in another order
    assert_close(f(att, x), want, rtol=1e-4, atol=1e-5)
    rep = ms.comm_report(f, att, x)
    assert rep.count("all-reduce") >= 1       # the row-parallel projection's partial sums


def test_transformer_block_sharded_equals_one_device():
    blk = nn.TransformerBlock(16, 4, 32, rngs=nnx.Rngs(1))
    x = rand(3, 8, 8, 16)
    want = jax.jit(lambda x: blk(x))(x)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    blk.shard_megatron(2, 4)
    # float32: TransformerBlock(16, 4, 32): 16/32-term dot products, 2 layer norms and an 8-key softmax, Megatron's
    # partial sums reordered (<= 32 * 2**-24 = 2e-6 relative per op, ~8 ops); atol for outputs near 0
    assert_close(ms.jit(lambda m, x: m(x))(blk, x), want, rtol=1e-4, atol=1e-5)


def test_losses():
    logits, labels = np.asarray(rand(4, 6, 5)), np.array([0, 4, 2, 1, 3, 3])
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -logp[np.arange(6), labels]
    sparse = nn.SoftmaxCrossEntropyWithLogits(sparse=True)
    # float32 log-softmax over 5 classes vs numpy's float32 formula: exp, a 5-term sum and log (below: a 6-term mean),
    # a few roundings, ~5 * 2**-24 = 3e-7 relative
    np.testing.assert_allclose(np.asarray(sparse(logits, labels)), want, rtol=1e-5)
    dense = nn.SoftmaxCrossEntropyWithLogits(reduction="mean")
    np.testing.assert_allclose(float(dense(logits, np.eye(5)[labels])), want.mean(), rtol=1e-5)
    with pytest.raises(CellError, match="reduction"):
        nn.MSELoss(reduction="avg")
