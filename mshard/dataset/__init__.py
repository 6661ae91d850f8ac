"""``ms.dataset``: host batches -> global ``jax.Array`` laid out by ``dataset_strategy``.

>>> import numpy as np, mshard as ms
>>> ms.dataset.shard_batch(np.zeros((8, 2), np.float32)).shape
(8, 2)
"""

from mshard._src.runtime.data_sources import Dataset as Dataset
from mshard._src.runtime.data_sources import GeneratorDataset as GeneratorDataset
from mshard._src.runtime.data_sources import NumpySlicesDataset as NumpySlicesDataset
from mshard._src.runtime.dataset import batch_shardings as batch_shardings
from mshard._src.runtime.dataset import shard_batch as shard_batch
from mshard._src.values.names import missing_names
from mshard.dataset import transforms as transforms
from mshard.dataset import vision as vision

__all__ = [
    "Dataset",
    "GeneratorDataset",
    "NumpySlicesDataset",
    "batch_shardings",
    "shard_batch",
    "transforms",
    "vision",
]

__getattr__ = missing_names(__name__, __all__)      # a name not offered says so, and what to use
