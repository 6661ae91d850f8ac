"""mshard: MindSpore's parallel vocabulary over JAX (meshes, PartitionSpecs, jit regions).

>>> import mshard as ms
>>> ms.ParallelMode.SEMI_AUTO_PARALLEL
'semi_auto_parallel'
"""

from . import checkpoint as checkpoint
from . import communication as communication
from . import dataset as dataset
from . import errors as errors
from . import fusion as fusion
from . import nn as nn
from . import ops as ops
from . import parallel as parallel
from .checkpoint import CheckpointConfig as CheckpointConfig
from .checkpoint import CheckpointManager as CheckpointManager
from .checkpoint import infer_predict_layout as infer_predict_layout
from .checkpoint import load_checkpoint as load_checkpoint
from .checkpoint import load_distributed_checkpoint as load_distributed_checkpoint
from .checkpoint import save_checkpoint as save_checkpoint
from .checkpoint import transform_checkpoints as transform_checkpoints
from .comm_report import CommReport as CommReport
from .comm_report import comm_report as comm_report
from .context import ParallelMode as ParallelMode
from .context import get_algo_parameters as get_algo_parameters
from .context import get_auto_parallel_context as get_auto_parallel_context
from .context import get_cost_model_context as get_cost_model_context
from .context import parallel_context as parallel_context
from .context import reset_algo_parameters as reset_algo_parameters
from .context import reset_auto_parallel_context as reset_auto_parallel_context
from .context import reset_cost_model_context as reset_cost_model_context
from .context import set_algo_parameters as set_algo_parameters
from .context import set_auto_parallel_context as set_auto_parallel_context
from .context import set_cost_model_context as set_cost_model_context
from .dryrun import dry_run as dry_run
from .layout import Layout as Layout
from .nn.cell import recompute as recompute
from .plan import Plan as Plan
from .plan import load_plan as load_plan
from .region import Region as Region
from .region import jit as jit
from .shard import shard as shard
from .visualize import visualize as visualize

__all__ = [
                      "CheckpointConfig",
                      "CheckpointManager",
                      "CommReport",
                      "Layout",
                      "ParallelMode",
                      "Plan",
                      "Region",
                      "checkpoint",
                      "comm_report",
                      "communication",
                      "dataset",
                      "dry_run",
                      "errors",
                      "fusion",
                      "get_algo_parameters",
                      "get_auto_parallel_context",
                      "get_cost_model_context",
                      "infer_predict_layout",
                      "jit",
                      "load_checkpoint",
                      "load_distributed_checkpoint",
                      "load_plan",
                      "nn",
                      "ops",
                      "parallel",
                      "parallel_context",
                      "recompute",
                      "reset_algo_parameters",
                      "reset_auto_parallel_context",
                      "reset_cost_model_context",
                      "save_checkpoint",
                      "set_algo_parameters",
                      "set_auto_parallel_context",
                      "set_cost_model_context",
                      "shard",
                      "transform_checkpoints",
                      "visualize",
]
