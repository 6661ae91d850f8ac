"""mshard: MindSpore's parallel vocabulary over JAX (meshes, PartitionSpecs, jit regions).

>>> import mshard as ms
>>> ms.ParallelMode.SEMI_AUTO_PARALLEL == "semi_auto_parallel"
True
"""

from mshard import checkpoint as checkpoint
from mshard import communication as communication
from mshard import dataset as dataset
from mshard import errors as errors
from mshard import fusion as fusion
from mshard import nn as nn
from mshard import ops as ops
from mshard import parallel as parallel
from mshard._src.edges.comm_report import CommReport as CommReport
from mshard._src.edges.comm_report import comm_report as comm_report
from mshard._src.edges.visualize import visualize as visualize
from mshard._src.frontend.cell import recompute as recompute
from mshard._src.frontend.shard import shard as shard
from mshard._src.runtime.dryrun import dry_run as dry_run
from mshard._src.runtime.region import Region as Region
from mshard._src.runtime.region import jit as jit
from mshard._src.values.layout import Layout as Layout
from mshard._src.values.plan import Plan as Plan
from mshard._src.values.plan import load_plan as load_plan
from mshard.checkpoint import CheckpointConfig as CheckpointConfig
from mshard.checkpoint import CheckpointManager as CheckpointManager
from mshard.checkpoint import infer_predict_layout as infer_predict_layout
from mshard.checkpoint import load_checkpoint as load_checkpoint
from mshard.checkpoint import load_distributed_checkpoint as load_distributed_checkpoint
from mshard.checkpoint import save_checkpoint as save_checkpoint
from mshard.checkpoint import transform_checkpoints as transform_checkpoints
from mshard.context import ParallelMode as ParallelMode
from mshard.context import get_algo_parameters as get_algo_parameters
from mshard.context import get_auto_parallel_context as get_auto_parallel_context
from mshard.context import get_cost_model_context as get_cost_model_context
from mshard.context import parallel_context as parallel_context
from mshard.context import reset_algo_parameters as reset_algo_parameters
from mshard.context import reset_auto_parallel_context as reset_auto_parallel_context
from mshard.context import reset_cost_model_context as reset_cost_model_context
from mshard.context import set_algo_parameters as set_algo_parameters
from mshard.context import set_auto_parallel_context as set_auto_parallel_context
from mshard.context import set_cost_model_context as set_cost_model_context

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
