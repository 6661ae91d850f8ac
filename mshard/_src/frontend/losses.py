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


class L1Loss(Cell):
    """``L1Loss(reduction='mean')``: ``|logits - labels|``, reduced.

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> float(nn.L1Loss()(jnp.array([1.0, -3.0]), jnp.zeros(2)))
    2.0
    """

    def __init__(self, reduction: str = "mean"):
        self.reduction = _check(reduction, "L1Loss")

    def __call__(self, logits, labels):
        return _reduce(jnp.abs(logits - labels), self.reduction)


class SmoothL1Loss(Cell):
    """``SmoothL1Loss(beta=1.0, reduction='none')``: ``0.5 d**2 / beta`` where ``|d| < beta``, else
    ``|d| - 0.5 beta`` (``d = logits - labels``); MindSpore's default reduction is ``'none'``.

    Args:
        beta: the threshold between the quadratic and the linear part (> 0).
        reduction: ``"none"``, ``"mean"`` or ``"sum"``.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> nn.SmoothL1Loss()(jnp.array([0.5, 3.0]), jnp.zeros(2)).tolist()
    [0.125, 2.5]
    """

    def __init__(self, beta: float = 1.0, reduction: str = "none"):
        if not beta > 0:
            raise CellError(f"SmoothL1Loss: beta={beta} must be > 0.")
        self.beta = float(beta)
        self.reduction = _check(reduction, "SmoothL1Loss")

    def __call__(self, logits, labels):
        d = jnp.abs(logits - labels)
        loss = jnp.where(d < self.beta, 0.5 * d * d / self.beta, d - 0.5 * self.beta)
        return _reduce(loss, self.reduction)


class BCEWithLogitsLoss(Cell):
    """``BCEWithLogitsLoss(reduction='mean', weight=None, pos_weight=None)``: binary cross entropy of logits
    against targets in ``[0, 1]``, computed stably (``max(x, 0) - x y + log(1 + exp(-|x|))``, with ``pos_weight``
    weighing the positive term and ``weight`` each element).

    Args:
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        weight: a weight broadcast against the loss, or None.
        pos_weight: a weight of the positive examples broadcast against the loss (per class), or None.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> round(float(nn.BCEWithLogitsLoss()(jnp.zeros(3), jnp.ones(3))), 4)          # log(2)
    0.6931
    """

    def __init__(self, reduction: str = "mean", weight=None, pos_weight=None):
        self.reduction = _check(reduction, "BCEWithLogitsLoss")
        self.weight = None if weight is None else jnp.asarray(weight, jnp.float32)
        self.pos_weight = None if pos_weight is None else jnp.asarray(pos_weight, jnp.float32)

    def __call__(self, logits, labels):
        x, y = logits.astype(jnp.float32), labels.astype(jnp.float32)
        log_sig_neg = jax.nn.log_sigmoid(-x)          # log(1 - sigmoid(x))
        log_sig = jax.nn.log_sigmoid(x)
        pw = 1.0 if self.pos_weight is None else self.pos_weight
        loss = -(pw * y * log_sig + (1.0 - y) * log_sig_neg)
        if self.weight is not None:
            loss = loss * self.weight
        return _reduce(loss, self.reduction)


class NLLLoss(Cell):
    """``NLLLoss(weight=None, ignore_index=-100, reduction='mean')``: the negative log likelihood of log
    probabilities ``[N, C]`` at class ids ``[N]``; ``'mean'`` divides by the summed weights of the samples not
    ignored, as MindSpore's (and torch's).

    Args:
        weight: per-class weights ``[C]``, or None.
        ignore_index: a class id whose samples are left out.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> logp = jnp.log(jnp.array([[0.5, 0.5], [0.25, 0.75]]))
    >>> round(float(nn.NLLLoss()(logp, jnp.array([0, 1]))), 4)              # -(log 0.5 + log 0.75) / 2
    0.4904
    """

    def __init__(self, weight=None, ignore_index: int = -100, reduction: str = "mean"):
        self.weight = None if weight is None else jnp.asarray(weight, jnp.float32)
        self.ignore_index = int(ignore_index)
        self.reduction = _check(reduction, "NLLLoss")

    def __call__(self, logits, labels):
        labels = labels.astype(jnp.int32)
        keep = labels != self.ignore_index
        safe = jnp.where(keep, labels, 0)
        picked = -jnp.take_along_axis(logits.astype(jnp.float32), safe[:, None], axis=1)[:, 0]
        w = jnp.ones_like(picked) if self.weight is None else self.weight[safe]
        w = jnp.where(keep, w, 0.0)
        loss = picked * w
        if self.reduction == "mean":
            return jnp.sum(loss) / jnp.sum(w)
        return _reduce(loss, self.reduction)
