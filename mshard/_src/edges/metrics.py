"""MindSpore's evaluation metrics for ``Model.eval``: ``Accuracy`` and ``Loss`` (``clear`` / ``update`` / ``eval``).

Values are read back to the host (``numpy``); an array split over several processes is gathered first, so every
process counts the whole global batch.

>>> import numpy as np
>>> acc = Accuracy()
>>> acc.update(np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), np.array([1, 0, 0]))
>>> round(acc.eval(), 4)
0.6667
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from mshard._src.values.errors import CellError, CellTypeError

__all__ = ["Accuracy", "Loss", "Metric", "get_metrics", "to_host"]


def to_host(x: Any) -> np.ndarray:
    """``x`` as a numpy array on this host; a ``jax.Array`` split over several processes is gathered whole.

    Args:
        x: an array (numpy, ``jax.Array``) or a number.

    Returns:
        The whole value as a numpy array.

    >>> import jax.numpy as jnp
    >>> to_host(jnp.arange(3)).tolist()
    [0, 1, 2]
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)


class Metric:
    """The base of the metrics (MindSpore's ``nn.Metric``): ``clear()`` resets, ``update(*outputs)`` accumulates a
    batch, ``eval()`` gives the value over every batch since ``clear``.

    >>> class Count(Metric):
    ...     def clear(self): self.n = 0
    ...     def update(self, *inputs): self.n += len(inputs[0])
    ...     def eval(self): return self.n
    >>> m = Count(); m.update([1, 2]); m.update([3]); m.eval()
    3
    """

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        raise NotImplementedError

    def update(self, *inputs) -> None:
        raise NotImplementedError

    def eval(self) -> Any:
        raise NotImplementedError


class Accuracy(Metric):
    """MindSpore's ``Accuracy``: the fraction of samples whose prediction is right.

    ``update(y_pred, y)``: for ``"classification"`` ``y_pred`` is ``[N, C]`` scores (the argmax is the prediction)
    and ``y`` class indices ``[N]`` or one-hot ``[N, C]``; for ``"multilabel"`` a sample is right when every
    rounded score equals its 0/1 label.

    Args:
        eval_type: ``"classification"`` (default) or ``"multilabel"``.

    >>> import numpy as np
    >>> m = Accuracy()
    >>> m.update(np.array([[0.2, 0.8], [0.6, 0.4]]), np.array([[0, 1], [0, 1]]))
    >>> m.eval()
    0.5
    """

    def __init__(self, eval_type: str = "classification"):
        if eval_type not in ("classification", "multilabel"):
            raise CellError(f"Accuracy: eval_type={eval_type!r} must be 'classification' or 'multilabel'.")
        self._type = eval_type
        super().__init__()

    def clear(self) -> None:
        """Forget every batch seen."""
        self._correct, self._total = 0, 0

    def update(self, *inputs) -> None:
        """Count one batch: ``update(y_pred, y)``."""
        if len(inputs) != 2:
            raise CellTypeError(f"Accuracy.update: expected (y_pred, y), got {len(inputs)} input(s).")
        y_pred, y = to_host(inputs[0]), to_host(inputs[1])
        if self._type == "multilabel":
            if y_pred.shape != y.shape:
                raise CellError(f"Accuracy.update: multilabel y_pred {y_pred.shape} and y {y.shape} must have one "
                                f"shape.")
            right = np.all(np.round(y_pred) == y, axis=tuple(range(1, y.ndim)))
        else:
            if y_pred.ndim < 2:
                raise CellError(f"Accuracy.update: y_pred of shape {y_pred.shape} must be [N, C] class scores.")
            if y.ndim == y_pred.ndim:
                y = y.argmax(axis=1)
            if y.shape != (y_pred.shape[0],) + y_pred.shape[2:]:
                raise CellError(f"Accuracy.update: y of shape {y.shape} does not fit y_pred {y_pred.shape}; give class "
                                f"indices [N] or one-hot [N, C].")
            right = y_pred.argmax(axis=1) == y
        self._correct += int(np.sum(right))
        self._total += int(right.size)

    def eval(self) -> float:
        """The accuracy over every batch since ``clear``."""
        if self._total == 0:
            raise CellError("Accuracy.eval: no samples yet; call update(y_pred, y) (Model.eval does) before eval().")
        return self._correct / self._total


class Loss(Metric):
    """MindSpore's ``Loss``: the mean over batches of each batch's (mean) loss.

    >>> m = Loss()
    >>> m.update(1.0); m.update([2.0, 4.0])
    >>> m.eval()
    2.0
    """

    def clear(self) -> None:
        """Forget every batch seen."""
        self._sum, self._total = 0.0, 0

    def update(self, *inputs) -> None:
        """Add one batch's loss: ``update(loss)``, a scalar or a 1-D array (its mean)."""
        if len(inputs) != 1:
            raise CellTypeError(f"Loss.update: expected one loss, got {len(inputs)} input(s).")
        loss = to_host(inputs[0])
        if loss.ndim > 1:
            raise CellError(f"Loss.update: the loss must be a scalar or 1-D, got shape {loss.shape}.")
        self._sum += float(loss.reshape(-1).mean())
        self._total += 1

    def eval(self) -> float:
        """The mean loss over every batch since ``clear``."""
        if self._total == 0:
            raise CellError("Loss.eval: no batches yet; call update(loss) (Model.eval does) before eval().")
        return self._sum / self._total


_NAMES = {"accuracy": Accuracy, "acc": Accuracy, "loss": Loss}


def get_metrics(metrics: Mapping[str, Metric] | Iterable[str] | None) -> dict[str, Metric]:
    """MindSpore's ``Model(metrics=...)``: a dict ``{name: Metric}`` as given, or a set/list of names
    (``"accuracy"``/``"acc"``, ``"loss"``) made into fresh metrics.

    Args:
        metrics: None, a dict of metrics or an iterable of metric names.

    Returns:
        ``{name: Metric}`` (names in sorted order for a set).

    >>> sorted(get_metrics({"acc", "loss"}))
    ['acc', 'loss']
    """
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        bad = [k for k, v in metrics.items() if not isinstance(k, str) or not isinstance(v, Metric)]
        if bad:
            raise CellTypeError(f"Model: metrics entries {bad} must map a str name to a Metric (e.g. "
                                f"{{'accuracy': Accuracy()}}).")
        return dict(metrics)
    if isinstance(metrics, str) or not isinstance(metrics, Iterable):
        raise CellTypeError(f"Model: metrics={metrics!r} must be a dict {{name: Metric}} or a set of names "
                            f"({sorted(_NAMES)}).")
    names = sorted(metrics) if isinstance(metrics, (set, frozenset)) else list(metrics)
    unknown = [n for n in names if n not in _NAMES]
    if unknown:
        raise CellError(f"Model: metrics names {unknown} are not offered; use {sorted(_NAMES)} or pass a dict "
                        f"{{name: Metric}} of your own Metric subclasses.")
    return {n: _NAMES[n]() for n in names}
