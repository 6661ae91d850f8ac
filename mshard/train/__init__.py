"""``mshard.train``: MindSpore's ``mindspore.train``: ``Model``, the callbacks and the metrics.

>>> from mshard.train import Model, LossMonitor, CheckpointConfig
>>> CheckpointConfig(save_checkpoint_steps=10, keep_checkpoint_max=2, integrated_save=True).keep_checkpoint_max
2
"""

from mshard._src.edges.callbacks import Callback as Callback
from mshard._src.edges.callbacks import CheckpointConfig as CheckpointConfig
from mshard._src.edges.callbacks import LossMonitor as LossMonitor
from mshard._src.edges.callbacks import ModelCheckpoint as ModelCheckpoint
from mshard._src.edges.callbacks import RunContext as RunContext
from mshard._src.edges.callbacks import TimeMonitor as TimeMonitor
from mshard._src.edges.metrics import Accuracy as Accuracy
from mshard._src.edges.metrics import Loss as Loss
from mshard._src.edges.metrics import Metric as Metric
from mshard._src.edges.model import Model as Model

__all__ = [
    "Accuracy",
    "Callback",
    "CheckpointConfig",
    "Loss",
    "LossMonitor",
    "Metric",
    "Model",
    "ModelCheckpoint",
    "RunContext",
    "TimeMonitor",
]
