"""A small decoder written for flax's sharding API as the public flax / JAX LLM examples write one (issue 39).

Weights are annotated with ``nnx.with_partitioning`` for an ``fsdp x tp`` mesh (FSDP on the model dim, tensor
parallel on heads and the FFN); activations are annotated one of three ways (``Config.style``):

- ``"explicit"``: ``out_sharding=`` on the einsums and the embedding lookup, the form for a mesh with Explicit axes;
- ``"constraint"``: ``jax.lax.with_sharding_constraint``, the form for a mesh with Auto axes;
- ``"none"``: no annotation at all: the one-device reference, which imports nothing from mshard.

The output embedding is tied to the input one. Under plain ``jax.jit`` on an Explicit mesh the ``"explicit"``
model trains as written (its logits are gathered over ``tp`` before optax's integer cross entropy, which JAX's
sharding types need).
"""
import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    d: int = 32
    heads: int = 4
    ffn: int = 64
    layers: int = 2
    style: str = "explicit"     # how activations are annotated: "explicit", "constraint" or "none" (module doc)


def _param(cfg, rngs, shape, names, init=None):
    init = init or nnx.initializers.normal(0.02)
    if cfg.style != "none":          # the reference is plain flax: no annotation, no mesh
        init = nnx.with_partitioning(init, names)
    return nnx.Param(init(rngs.params(), shape))


def einsum(cfg, eq, a, b, spec):
    if cfg.style == "explicit":
        return jnp.einsum(eq, a, b, out_sharding=spec)
    y = jnp.einsum(eq, a, b)
    return jax.lax.with_sharding_constraint(y, spec) if cfg.style == "constraint" else y


class RMSNorm(nnx.Module):
    def __init__(self, cfg, rngs):
        self.scale = _param(cfg, rngs, (cfg.d,), (None,), nnx.initializers.ones)

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * self.scale[...]


class Attention(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = cfg
        hd = cfg.d // cfg.heads
        self.wq = _param(cfg, rngs, (cfg.d, cfg.heads, hd), ("fsdp", "tp", None))
        self.wk = _param(cfg, rngs, (cfg.d, cfg.heads, hd), ("fsdp", "tp", None))
        self.wv = _param(cfg, rngs, (cfg.d, cfg.heads, hd), ("fsdp", "tp", None))
        self.wo = _param(cfg, rngs, (cfg.heads, hd, cfg.d), ("tp", None, "fsdp"))

    def __call__(self, x):
        c = self.cfg
        spec = P("fsdp", None, "tp", None)
        q = einsum(c, "bsd,dnh->bsnh", x, self.wq[...], spec)
        k = einsum(c, "bsd,dnh->bsnh", x, self.wk[...], spec)
        v = einsum(c, "bsd,dnh->bsnh", x, self.wv[...], spec)
        s = jnp.einsum("bqnh,bknh->bnqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        n = x.shape[1]
        mask = jnp.tril(jnp.ones((n, n), bool))
        s = jnp.where(mask, s, -1e9)
        w = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bnqk,bknh->bqnh", w, v)
        return einsum(c, "bsnh,nhd->bsd", o, self.wo[...], P("fsdp", None, None))


class MLP(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = cfg
        self.up = _param(cfg, rngs, (cfg.d, cfg.ffn), ("fsdp", "tp"))
        self.down = _param(cfg, rngs, (cfg.ffn, cfg.d), ("tp", "fsdp"))

    def __call__(self, x):
        h = jax.nn.gelu(einsum(self.cfg, "bsd,df->bsf", x, self.up[...], P("fsdp", None, "tp")))
        return einsum(self.cfg, "bsf,fd->bsd", h, self.down[...], P("fsdp", None, None))


class Block(nnx.Module):
    def __init__(self, cfg, rngs):
        self.n1, self.attn = RMSNorm(cfg, rngs), Attention(cfg, rngs)
        self.n2, self.mlp = RMSNorm(cfg, rngs), MLP(cfg, rngs)

    def __call__(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Decoder(nnx.Module):
    def __init__(self, cfg, rngs):
        self.cfg = cfg
        self.embed = _param(cfg, rngs, (cfg.vocab, cfg.d), ("tp", "fsdp"), nnx.initializers.normal(1.0))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg, rngs)

    def __call__(self, tokens):
        c = self.cfg
        if c.style == "explicit":
            x = self.embed[...].at[tokens].get(out_sharding=P("fsdp", None, None))
        else:
            x = jnp.take(self.embed[...], tokens, axis=0)
            if c.style == "constraint":
                x = jax.lax.with_sharding_constraint(x, P("fsdp", None, None))
        for b in self.blocks:
            x = b(x)
        return einsum(c, "bsd,vd->bsv", self.norm(x), self.embed[...], P("fsdp", None, None))   # tied


def loss_fn(model, tokens, labels):
    logits = model(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
