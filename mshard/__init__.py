"""mshard: MindSpore's parallel vocabulary over JAX (meshes, PartitionSpecs, jit regions).

>>> import mshard as ms
>>> ms.ParallelMode.SEMI_AUTO_PARALLEL == "semi_auto_parallel"
True
"""

from mshard import checkpoint as checkpoint
from mshard import common as common
from mshard import communication as communication
from mshard import dataset as dataset
from mshard import errors as errors
from mshard import fusion as fusion
from mshard import nn as nn
from mshard import ops as ops
from mshard import parallel as parallel
from mshard import runtime as runtime
from mshard import train as train
from mshard._src.edges.callbacks import CheckpointConfig as CheckpointConfig
from mshard._src.edges.comm_report import CommReport as CommReport
from mshard._src.edges.comm_report import comm_report as comm_report
from mshard._src.edges.model import Model as Model
from mshard._src.edges.visualize import visualize as visualize
from mshard._src.frontend.cell import recompute as recompute
from mshard._src.frontend.functional import jit as jit
from mshard._src.frontend.functional import value_and_grad as value_and_grad
from mshard._src.frontend.parameter import Parameter as Parameter
from mshard._src.frontend.parameter import Tensor as Tensor
from mshard._src.frontend.parameter import bfloat16 as bfloat16
from mshard._src.frontend.parameter import bool_ as bool_
from mshard._src.frontend.parameter import float16 as float16
from mshard._src.frontend.parameter import float32 as float32
from mshard._src.frontend.parameter import float64 as float64
from mshard._src.frontend.parameter import int8 as int8
from mshard._src.frontend.parameter import int16 as int16
from mshard._src.frontend.parameter import int32 as int32
from mshard._src.frontend.parameter import int64 as int64
from mshard._src.frontend.parameter import uint8 as uint8
from mshard._src.frontend.shard import shard as shard
from mshard._src.runtime.dryrun import dry_run as dry_run
from mshard._src.runtime.region import Region as Region
from mshard._src.values.layout import Layout as Layout
from mshard._src.values.names import missing_names
from mshard._src.values.plan import Plan as Plan
from mshard._src.values.plan import load_plan as load_plan
from mshard._src.values.run_mode import GRAPH_MODE as GRAPH_MODE
from mshard._src.values.run_mode import PYNATIVE_MODE as PYNATIVE_MODE
from mshard._src.values.run_mode import get_context as get_context
from mshard._src.values.run_mode import set_context as set_context
from mshard._src.values.seed import get_seed as get_seed
from mshard._src.values.seed import set_seed as set_seed
from mshard.checkpoint import CheckpointManager as CheckpointManager
from mshard.checkpoint import infer_predict_layout as infer_predict_layout
from mshard.checkpoint import load_checkpoint as load_checkpoint
from mshard.checkpoint import load_distributed_checkpoint as load_distributed_checkpoint
from mshard.checkpoint import load_param_into_net as load_param_into_net
from mshard.checkpoint import save_checkpoint as save_checkpoint
from mshard.checkpoint import transform_checkpoints as transform_checkpoints
from mshard.context import ParallelMode as ParallelMode
from mshard.context import get_algo_parameters as get_algo_parameters
from mshard.context import get_auto_parallel_context as get_auto_parallel_context
from mshard.context import get_cost_model_context as get_cost_model_context
from mshard.context import get_offload_context as get_offload_context
from mshard.context import parallel_context as parallel_context
from mshard.context import reset_algo_parameters as reset_algo_parameters
from mshard.context import reset_auto_parallel_context as reset_auto_parallel_context
from mshard.context import reset_cost_model_context as reset_cost_model_context
from mshard.context import set_algo_parameters as set_algo_parameters
from mshard.context import set_auto_parallel_context as set_auto_parallel_context
from mshard.context import set_cost_model_context as set_cost_model_context
from mshard.context import set_offload_context as set_offload_context
from mshard.context import set_op_strategy_config as set_op_strategy_config

__all__ = [
                      "GRAPH_MODE",
                      "PYNATIVE_MODE",
                      "CheckpointConfig",
                      "CheckpointManager",
                      "CommReport",
                      "Layout",
                      "Model",
                      "ParallelMode",
                      "Parameter",
                      "Plan",
                      "Region",
                      "Tensor",
                      "bfloat16",
                      "bool_",
                      "checkpoint",
                      "comm_report",
                      "common",
                      "communication",
                      "dataset",
                      "dry_run",
                      "errors",
                      "float16",
                      "float32",
                      "float64",
                      "fusion",
                      "get_algo_parameters",
                      "get_auto_parallel_context",
                      "get_context",
                      "get_cost_model_context",
                      "get_offload_context",
                      "get_seed",
                      "infer_predict_layout",
                      "int8",
                      "int16",
                      "int32",
                      "int64",
                      "jit",
                      "load_checkpoint",
                      "load_distributed_checkpoint",
                      "load_param_into_net",
                      "load_plan",
                      "nn",
                      "ops",
                      "parallel",
                      "parallel_context",
                      "recompute",
                      "reset_algo_parameters",
                      "reset_auto_parallel_context",
                      "reset_cost_model_context",
                      "runtime",
                      "save_checkpoint",
                      "set_algo_parameters",
                      "set_auto_parallel_context",
                      "set_context",
                      "set_cost_model_context",
                      "set_offload_context",
                      "set_op_strategy_config",
                      "set_seed",
                      "shard",
                      "train",
                      "transform_checkpoints",
                      "uint8",
                      "value_and_grad",
                      "visualize",
]

__getattr__ = missing_names(__name__, __all__)      # a name not offered says so, and what to use
