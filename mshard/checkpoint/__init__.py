"""Distributed checkpoints: save sharded, load into any strategy, device count or process count, verified.

See :mod:`mshard.checkpoint.api` (save/load), :mod:`mshard.checkpoint.store` (the on-disk format),
:mod:`mshard.checkpoint.checksum` (content checksums) and :mod:`mshard.checkpoint.manager` (keep the last N).
"""

from .api import LoadResult as LoadResult
from .api import SaveHandle as SaveHandle
from .api import load_checkpoint as load_checkpoint
from .api import load_distributed_checkpoint as load_distributed_checkpoint
from .api import save_checkpoint as save_checkpoint
from .api import transform_checkpoints as transform_checkpoints
from .infer import infer_predict_layout as infer_predict_layout
from .manager import CheckpointConfig as CheckpointConfig
from .manager import CheckpointManager as CheckpointManager

__all__ = ["CheckpointConfig", "CheckpointManager", "LoadResult", "SaveHandle", "infer_predict_layout",
           "load_checkpoint", "load_distributed_checkpoint", "save_checkpoint", "transform_checkpoints"]
