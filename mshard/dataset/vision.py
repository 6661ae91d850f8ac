"""MindSpore's ``mindspore.dataset.vision`` transforms the tutorials use, for ``Dataset.map``.

>>> import numpy as np
>>> from mshard.dataset import vision
>>> vision.HWC2CHW()(np.zeros((28, 28, 1), np.uint8)).shape
(1, 28, 28)
"""

from mshard._src.runtime.data_transforms import HWC2CHW as HWC2CHW
from mshard._src.runtime.data_transforms import Normalize as Normalize
from mshard._src.runtime.data_transforms import Rescale as Rescale
from mshard._src.values.names import missing_names

__all__ = ["HWC2CHW", "Normalize", "Rescale"]

__getattr__ = missing_names(__name__, __all__)      # a name not offered says so, and what to use
