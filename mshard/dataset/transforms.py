"""MindSpore's ``mindspore.dataset.transforms`` the tutorials use, for ``Dataset.map``.

>>> import numpy as np
>>> from mshard.dataset import transforms
>>> transforms.TypeCast(np.int32)(np.array([1], np.uint8)).dtype
dtype('int32')
"""

from mshard._src.runtime.data_transforms import Compose as Compose
from mshard._src.runtime.data_transforms import TypeCast as TypeCast
from mshard._src.values.names import missing_names

__all__ = ["Compose", "TypeCast"]

__getattr__ = missing_names(__name__, __all__)      # a name not offered says so, and what to use
