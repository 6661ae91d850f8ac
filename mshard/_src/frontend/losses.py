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


class CrossEntropyLoss(Cell):
    """``CrossEntropyLoss(weight=None, ignore_index=-100, reduction='mean', label_smoothing=0.0)``: MindSpore's
    (and torch's) cross entropy of logits ``[N, C]`` (or ``[N, C, d1, ...]``) against class ids ``[N]`` or class
    probabilities ``[N, C]``.

    With class ids, ``weight[c]`` weighs each sample and ``'mean'`` divides by the sum of the weights of the samples
    not ignored; ``ignore_index`` drops samples. ``label_smoothing`` mixes the target with the uniform distribution.
    The loss is computed in float32 whatever the logits' dtype.

    Args:
        weight: per-class weights ``[C]``, or None.
        ignore_index: a class id whose samples are left out (class-id labels only).
        reduction: ``'mean'``, ``'sum'`` or ``'none'``.
        label_smoothing: in ``[0, 1]``.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> round(float(nn.CrossEntropyLoss()(jnp.zeros((2, 4)), jnp.array([1, 3]))), 6)   # log(4)
    1.386294
    """

    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        if not 0.0 <= label_smoothing <= 1.0:
            raise CellError(f"CrossEntropyLoss: label_smoothing={label_smoothing!r}; expected a value in [0, 1].")
        self.weight = None if weight is None else jnp.asarray(weight, jnp.float32)
        self.ignore_index = int(ignore_index)
        self.reduction = _check(reduction, "CrossEntropyLoss")
        self.label_smoothing = float(label_smoothing)

    def __call__(self, logits, labels):
        logits = jnp.moveaxis(logits.astype(jnp.float32), 1, -1) if logits.ndim > 2 else logits.astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        c = logits.shape[-1]
        w = jnp.ones((c,), jnp.float32) if self.weight is None else self.weight
        if jnp.issubdtype(labels.dtype, jnp.integer):
            keep = labels != self.ignore_index
            ids = jnp.where(keep, labels, 0)
            nll = -jnp.take_along_axis(logp, ids[..., None], axis=-1)[..., 0]
            smooth = -jnp.sum(logp * w, axis=-1) / c
            per = (1 - self.label_smoothing) * nll * w[ids] + self.label_smoothing * smooth
            per = jnp.where(keep, per, 0.0)
            if self.reduction == "mean":
                return jnp.sum(per) / jnp.sum(jnp.where(keep, w[ids], 0.0))
            return _reduce(per, self.reduction)
        target = labels.astype(jnp.float32)
        if labels.ndim > 2:
            target = jnp.moveaxis(target, 1, -1)
        target = (1 - self.label_smoothing) * target + self.label_smoothing / c
        per = -jnp.sum(logp * target * w, axis=-1)
        return _reduce(per, self.reduction)
