"""Small models used by the tests, benchmarks and examples (plain JAX inside nn.Cells; weights are nnx.Params).

Each model has ``make(seed) -> (cell, inputs tuple)`` and works eagerly, in ms.jit regions and under grad.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mshard import nn


def _p(key, *shape, scale=None):
    scale = scale if scale is not None else 1.0 / (shape[0] ** 0.5)
    return nnx.Param(jax.random.normal(key, shape, jnp.float32) * scale)


class MLP(nn.Cell):
    """x @ w1 -> relu -> @ w2."""

    def __init__(self, d_in=64, d_hidden=256, d_out=64, seed=0):
        k = jax.random.split(jax.random.key(seed), 2)
        self.w1, self.w2 = _p(k[0], d_in, d_hidden), _p(k[1], d_hidden, d_out)

    def __call__(self, x):
        return jax.nn.relu(x @ self.w1[...]) @ self.w2[...]


def layer_norm(x, g, b, eps=1e-5):
    m = jnp.mean(x, -1, keepdims=True)
    v = jnp.mean(jnp.square(x - m), -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * g + b


class TransformerBlock(nn.Cell):
    """Pre-LN block: x + attention(ln(x)), then h + mlp(ln(h)); heads split from d_model."""

    def __init__(self, d=64, heads=8, d_ff=256, seed=0):
        k = jax.random.split(jax.random.key(seed), 6)
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (_p(k[i], d, d) for i in range(4))
        self.w_ff1, self.w_ff2 = _p(k[4], d, d_ff), _p(k[5], d_ff, d)
        self.ln1_g, self.ln1_b = nnx.Param(jnp.ones(d)), nnx.Param(jnp.zeros(d))
        self.ln2_g, self.ln2_b = nnx.Param(jnp.ones(d)), nnx.Param(jnp.zeros(d))

    def attention(self, x, q_proj=None):
        b, s, d = x.shape
        h = self.heads
        q = (q_proj(x) if q_proj is not None else x @ self.wq[...]).reshape(b, s, h, d // h)
        k = (x @ self.wk[...]).reshape(b, s, h, d // h)
        v = (x @ self.wv[...]).reshape(b, s, h, d // h)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // h)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v).reshape(b, s, d)
        return o @ self.wo[...]

    def __call__(self, x, q_proj=None):
        h = x + self.attention(layer_norm(x, self.ln1_g[...], self.ln1_b[...]), q_proj)
        f = jax.nn.gelu(layer_norm(h, self.ln2_g[...], self.ln2_b[...]) @ self.w_ff1[...]) @ self.w_ff2[...]
        return h + f


class ConvNet(nn.Cell):
    """conv 3x3 (same) -> relu -> 2x2 max pool -> batch-norm-like normalisation -> dense head. NCHW."""

    def __init__(self, c_in=4, c=16, classes=8, image=8, seed=0):
        k = jax.random.split(jax.random.key(seed), 2)
        self.kernel = _p(k[0], c, c_in, 3, 3, scale=0.2)
        self.scale, self.shift = nnx.Param(jnp.ones(c)), nnx.Param(jnp.zeros(c))
        self.head = _p(k[1], c * (image // 2) ** 2, classes)

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(x, self.kernel[...], (1, 1), "SAME",
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        y = jax.nn.relu(y)
        y = jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        m = jnp.mean(y, (0, 2, 3), keepdims=True)
        v = jnp.var(y, (0, 2, 3), keepdims=True)
        y = (y - m) * jax.lax.rsqrt(v + 1e-5) * self.scale[...][None, :, None, None] + self.shift[...][None, :, None, None]
        return y.reshape(y.shape[0], -1) @ self.head[...]


class SameConvs(nnx.Module):
    """Plain flax, NHWC: three "same" convolutions (3x3 c_in->c, 3x3 c->c, 5x5 c->c_in) with ReLUs between; an
    image batch split over height/width keeps that split through them (halo exchanges)."""

    def __init__(self, c_in=4, c=8, seed=0):
        rngs = nnx.Rngs(seed)
        self.c1 = nnx.Conv(c_in, c, (3, 3), padding="SAME", rngs=rngs)
        self.c2 = nnx.Conv(c, c, (3, 3), padding="SAME", rngs=rngs)
        self.c3 = nnx.Conv(c, c_in, (5, 5), padding="SAME", rngs=rngs)

    def __call__(self, x):
        return self.c3(jax.nn.relu(self.c2(jax.nn.relu(self.c1(x)))))


class EmbedClassifier(nn.Cell):
    """Embedding lookup -> mean over the sequence -> dense -> softmax cross-entropy against labels."""

    def __init__(self, vocab=128, d=32, classes=16, seed=0):
        k = jax.random.split(jax.random.key(seed), 2)
        self.table = _p(k[0], vocab, d, scale=1.0)
        self.out = _p(k[1], d, classes)

    def __call__(self, ids, labels):
        e = jnp.take(self.table[...], ids, axis=0)          # [b, s, d]
        logits = jnp.mean(e, 1) @ self.out[...]
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, logits.shape[-1]) * logp, -1))


def inputs(name: str, seed: int = 1):
    k = jax.random.split(jax.random.key(seed), 2)
    if name == "mlp":
        return (jax.random.normal(k[0], (32, 64)),)
    if name == "transformer":
        return (jax.random.normal(k[0], (8, 16, 64)),)
    if name == "conv":
        return (jax.random.normal(k[0], (16, 4, 8, 8)),)
    if name == "embed":
        return (jax.random.randint(k[0], (16, 8), 0, 128), jax.random.randint(k[1], (16,), 0, 16))
    raise KeyError(name)


MODELS = {"mlp": MLP, "transformer": TransformerBlock, "conv": ConvNet, "embed": EmbedClassifier}
