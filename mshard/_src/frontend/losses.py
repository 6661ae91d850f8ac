"""Loss Cells with MindSpore's names: ``loss_fn(logits, labels) -> loss``.

>>> import jax.numpy as jnp
>>> from mshard import nn
>>> float(nn.MSELoss()(jnp.ones(4), jnp.zeros(4)))
1.0
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mshard._src.frontend.cell import Cell
from mshard._src.values.errors import CellError

_REDUCTIONS = ("mean", "sum", "none")


def _reduce(x, reduction: str):
    if reduction == "mean":
        return jnp.mean(x)
    if reduction == "sum":
        return jnp.sum(x)
    return x


def _check(reduction: str, where: str) -> str:
    if reduction not in _REDUCTIONS:
        raise CellError(f"{where}: reduction={reduction!r}; expected one of {_REDUCTIONS}.")
    return reduction


class SoftmaxCrossEntropyWithLogits(Cell):
    """``SoftmaxCrossEntropyWithLogits(sparse=False, reduction='none')``: cross entropy over the last dim.

    ``sparse=True`` takes integer class ids (any leading shape), else one-hot/probability labels.
    Use ``reduction='mean'`` for training (MindSpore's default is ``'none'``, per-sample losses).
    """

    def __init__(self, sparse: bool = False, reduction: str = "none"):
        self.sparse = sparse
        self.reduction = _check(reduction, "SoftmaxCrossEntropyWithLogits")

    def __call__(self, logits, labels):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        if self.sparse:
            loss = -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
        else:
            loss = -jnp.sum(labels * logp, axis=-1)
        return _reduce(loss, self.reduction)


class MSELoss(Cell):
    """``MSELoss(reduction='mean')``: (x - y)**2, reduced."""

    def __init__(self, reduction: str = "mean"):
        self.reduction = _check(reduction, "MSELoss")

    def __call__(self, logits, labels):
        return _reduce(jnp.square(logits - labels), self.reduction)
