"""MindSpore's per-row dataset transforms that the distributed tutorials map over MNIST and CIFAR rows
(``dataset.vision``: ``Rescale``, ``Normalize``, ``HWC2CHW``; ``dataset.transforms``: ``TypeCast``), on NumPy
arrays, for ``Dataset.map``.

>>> import numpy as np
>>> from mshard._src.runtime.data_transforms import HWC2CHW, Normalize, Rescale, TypeCast
>>> img = np.full((28, 28, 1), 255, np.uint8)
>>> x = HWC2CHW()(Normalize(mean=(0.5,), std=(0.5,))(Rescale(1.0 / 255.0, 0.0)(img)))
>>> x.shape, x.dtype, float(x.max()), TypeCast(np.int32)(np.array([3], np.uint8)).dtype
((1, 28, 28), dtype('float32'), 1.0, dtype('int32'))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mshard._src.values.errors import DatasetStrategyError


class Rescale:
    """MindSpore's ``vision.Rescale(rescale, shift)``: ``x * rescale + shift`` as float32.

    Args:
        rescale: the scale factor.
        shift: the offset added after scaling.
    """

    def __init__(self, rescale: float, shift: float):
        self.rescale, self.shift = float(rescale), float(shift)

    def __call__(self, img: Any) -> np.ndarray:
        return (np.asarray(img, np.float32) * np.float32(self.rescale) + np.float32(self.shift)).astype(np.float32)


class Normalize:
    """MindSpore's ``vision.Normalize(mean, std, is_hwc=True)``: ``(x - mean) / std`` per channel, the channel the
    last dim (``is_hwc``) or the first.

    Args:
        mean: one value per channel.
        std: one value per channel (none zero).
        is_hwc: whether the image is [H, W, C] (True) or [C, H, W].
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], is_hwc: bool = True):
        self.mean = np.asarray(mean, np.float32).reshape(-1)
        self.std = np.asarray(std, np.float32).reshape(-1)
        if self.mean.shape != self.std.shape or not self.mean.size or not np.all(self.std != 0):
            raise DatasetStrategyError(f"Normalize: mean={tuple(mean)} and std={tuple(std)} must give one value per "
                                       f"channel each, with no std of 0.")
        self.is_hwc = is_hwc

    def __call__(self, img: Any) -> np.ndarray:
        x = np.asarray(img, np.float32)
        axis = -1 if self.is_hwc else (0 if x.ndim == 3 else -1)
        if x.ndim < 2 or (x.shape[axis] != self.mean.size and self.mean.size != 1):
            raise DatasetStrategyError(f"Normalize: an image of shape {x.shape} has {x.shape[axis] if x.ndim else 0} "
                                       f"channels on its {'last' if self.is_hwc else 'first'} dim, but mean/std give "
                                       f"{self.mean.size}; pass is_hwc={not self.is_hwc} or one value per channel.")
        shape = [1] * x.ndim
        shape[axis] = self.mean.size        # one value (any channel count) or one per channel
        return ((x - self.mean.reshape(shape)) / self.std.reshape(shape)).astype(np.float32)


class HWC2CHW:
    """MindSpore's ``vision.HWC2CHW()``: an [H, W, C] image as [C, H, W] (an [H, W] image gains C = 1)."""

    def __call__(self, img: Any) -> np.ndarray:
        x = np.asarray(img)
        if x.ndim == 2:
            return x[None]
        if x.ndim != 3:
            raise DatasetStrategyError(f"HWC2CHW: expected an [H, W, C] image, got shape {x.shape}.")
        return np.ascontiguousarray(np.transpose(x, (2, 0, 1)))


class TypeCast:
    """MindSpore's ``transforms.TypeCast(dtype)``: the column cast to ``dtype`` (``ms.int32``, ``np.float32``, ...).

    Args:
        dtype: the dtype to cast to.
    """

    def __init__(self, dtype: Any):
        self.dtype = np.dtype(dtype)

    def __call__(self, x: Any) -> np.ndarray:
        return np.asarray(x).astype(self.dtype)


class Compose:
    """MindSpore's ``transforms.Compose(transforms)``: the transforms applied in turn.

    Args:
        transforms: a list of callables.
    """

    def __init__(self, transforms: Sequence[Any]):
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x
