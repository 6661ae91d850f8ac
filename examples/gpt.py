"""A small GPT built from mshard.nn layers, shared by examples/train_gpt.py, bench/step.py and the tests.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> net = GPT(nnx.Rngs(0), vocab=32, hidden=16, heads=2, ffn=32, seq=8, layers=1)
>>> net(jnp.zeros((2, 8), jnp.int32)).shape
(2, 8, 32)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from mshard import nn


class GPT(nn.Cell):
    """Token and position embeddings, ``layers`` pre-LN :class:`mshard.nn.TransformerBlock`, a final
    LayerNorm and a bias-free head to ``vocab`` logits; ``ids: [batch, seq]`` int32."""

    def __init__(self, rngs: nnx.Rngs, *, vocab: int, hidden: int, heads: int, ffn: int, seq: int, layers: int = 4):
        self.embedding = nn.Embedding(vocab, hidden, rngs=rngs)
        self.position = nn.Embedding(seq, hidden, rngs=rngs)
        self.blocks = nnx.List([nn.TransformerBlock(hidden, heads, ffn, rngs=rngs) for _ in range(layers)])
        self.final_norm = nn.LayerNorm((hidden,))
        self.head = nn.Dense(hidden, vocab, has_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.embedding(ids) + self.position(jnp.arange(ids.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))
