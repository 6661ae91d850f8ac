"""``ms.parallel``: MindSpore 2.6's ``mindspore.parallel`` names (``AutoParallel``, ``Layout``, ``shard``,
``parallel.nn``, and the distributed checkpoint functions).

>>> from mshard.parallel import AutoParallel, Layout
>>> Layout((2, 4), ("dp", "mp"))("dp", "mp").dims
(('dp',), ('mp',))
"""

from mshard._src.edges.checkpoint.api import load_distributed_checkpoint as load_distributed_checkpoint
from mshard._src.edges.checkpoint.api import transform_checkpoints as transform_checkpoints
from mshard._src.frontend.auto_parallel import AutoParallel as AutoParallel
from mshard._src.frontend.shard import shard as shard
from mshard._src.values.context import set_op_strategy_config as set_op_strategy_config
from mshard._src.values.layout import Layout as Layout
from mshard._src.values.names import missing_names
from mshard.parallel import auto_parallel as auto_parallel
from mshard.parallel import nn as nn

__all__ = ["AutoParallel", "Layout", "auto_parallel", "load_distributed_checkpoint", "nn", "set_op_strategy_config",
           "shard", "transform_checkpoints"]

__getattr__ = missing_names(__name__, __all__)      # a name not offered says so, and what to use
