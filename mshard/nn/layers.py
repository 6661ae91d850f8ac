"""Layers with MindSpore's names and parameter layouts, built on flax.nnx.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from mshard import nn
>>> d = nn.Dense(4, 8, rngs=nnx.Rngs(0))
>>> d.weight[...].shape      # MindSpore layout: [out_channels, in_channels]
(8, 4)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from .. import ops
from .cell import Cell

_ACT: dict[str, Callable] = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jnp.tanh,
                             "sigmoid": jax.nn.sigmoid}


class Dense(Cell):
    """``Dense(in_channels, out_channels, has_bias=True, activation=None, *, rngs)``: y = x @ W^T + b.

    ``weight`` is ``[out_channels, in_channels]`` and the matmul is ``ops.MatMul(transpose_b=True)``
    (``self.matmul``), as in MindSpore, so ``dense.matmul.shard(((2, 1), (4, 1)))`` is column parallel.
    Inputs of rank > 2 are flattened to 2-D around the matmul.
    """

    def __init__(self, in_channels: int, out_channels: int, has_bias: bool = True,
                 activation: str | Callable | None = None, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        init = jax.nn.initializers.lecun_normal()
        self.weight = nnx.Param(init(rngs.params(), (out_channels, in_channels), dtype))
        self.bias = nnx.Param(jnp.zeros((out_channels,), dtype)) if has_bias else None
        self.matmul = ops.MatMul(transpose_b=True)
        self.bias_add = ops.BiasAdd()
        self.activation = _ACT[activation] if isinstance(activation, str) else activation
        self.in_channels, self.out_channels = in_channels, out_channels

    def __call__(self, x):
        lead = x.shape[:-1]
        if x.ndim != 2:
            x = x.reshape(-1, x.shape[-1])
        y = self.matmul(x, self.weight[...])
        if self.bias is not None:
            y = self.bias_add(y, self.bias[...])
        if self.activation is not None:
            y = self.activation(y)
        return y.reshape(*lead, self.out_channels) if len(lead) != 1 else y


class ReLU(Cell):
    """``nn.ReLU()``."""

    def __init__(self):
        self.relu = ops.ReLU()

    def __call__(self, x):
        return self.relu(x)
