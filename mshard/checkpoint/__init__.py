"""Distributed checkpoints: save sharded, load into any strategy, device count or process count, verified.

The implementation is in ``mshard/_src/edges/checkpoint/``: ``api`` (save/load), ``store`` (the on-disk format),
``checksum`` (content checksums) and ``manager`` (keep the last N). The format is in docs/checkpoint.md.
"""

from mshard._src.edges.checkpoint.api import LoadResult as LoadResult
from mshard._src.edges.checkpoint.api import ParamDict as ParamDict
from mshard._src.edges.checkpoint.api import SaveHandle as SaveHandle
from mshard._src.edges.checkpoint.api import load_checkpoint as load_checkpoint
from mshard._src.edges.checkpoint.api import load_distributed_checkpoint as load_distributed_checkpoint
from mshard._src.edges.checkpoint.api import load_param_into_net as load_param_into_net
from mshard._src.edges.checkpoint.api import save_checkpoint as save_checkpoint
from mshard._src.edges.checkpoint.api import transform_checkpoints as transform_checkpoints
from mshard._src.edges.checkpoint.infer import infer_predict_layout as infer_predict_layout
from mshard._src.edges.checkpoint.manager import CheckpointConfig as CheckpointConfig
from mshard._src.edges.checkpoint.manager import CheckpointManager as CheckpointManager

__all__ = ["CheckpointConfig", "CheckpointManager", "LoadResult", "ParamDict", "SaveHandle", "infer_predict_layout",
           "load_checkpoint", "load_distributed_checkpoint", "load_param_into_net", "save_checkpoint",
           "transform_checkpoints"]
