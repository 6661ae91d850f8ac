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
    The loss is computed in float32 whatever the logits' dtype.

    Args:
        sparse: labels are integer class ids (else one-hot or probability rows shaped like the logits).
        reduction: ``"none"`` (one loss per row), ``"mean"`` or ``"sum"``.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> logits, ids = jnp.zeros((2, 4)), jnp.array([0, 3])
    >>> nn.SoftmaxCrossEntropyWithLogits(sparse=True)(logits, ids).shape
    (2,)
    >>> round(float(nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")(logits, ids)), 4)   # log(4)
    1.3863
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
    """``MSELoss(reduction='mean')``: ``(logits - labels) ** 2``, reduced; called as ``loss(logits, labels)``.

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (the element-wise squares).

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> float(nn.MSELoss()(jnp.array([1.0, 3.0]), jnp.zeros(2)))
    5.0
    >>> nn.MSELoss(reduction="none")(jnp.array([1.0, 3.0]), jnp.zeros(2)).tolist()
    [1.0, 9.0]
    """

    def __init__(self, reduction: str = "mean"):
        self.reduction = _check(reduction, "MSELoss")

    def __call__(self, logits, labels):
        return _reduce(jnp.square(logits - labels), self.reduction)
