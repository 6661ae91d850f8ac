"""mshard: MindSpore's parallel vocabulary over JAX (meshes, PartitionSpecs, jit regions).

>>> import mshard as ms
>>> ms.ParallelMode.SEMI_AUTO_PARALLEL
'semi_auto_parallel'
"""

from . import errors as errors
from . import nn as nn
from . import ops as ops
from .comm_report import CommReport as CommReport, comm_report as comm_report
from .context import (ParallelMode as ParallelMode, get_algo_parameters as get_algo_parameters,
                      get_auto_parallel_context as get_auto_parallel_context,
                      get_cost_model_context as get_cost_model_context, parallel_context as parallel_context,
                      reset_algo_parameters as reset_algo_parameters,
                      reset_auto_parallel_context as reset_auto_parallel_context,
                      reset_cost_model_context as reset_cost_model_context,
                      set_algo_parameters as set_algo_parameters,
                      set_auto_parallel_context as set_auto_parallel_context,
                      set_cost_model_context as set_cost_model_context)
from .layout import Layout as Layout
from .plan import Plan as Plan, load_plan as load_plan
from .region import Region as Region, jit as jit
from .shard import shard as shard

__all__ = ["errors", "nn", "ops", "CommReport", "comm_report", "ParallelMode", "get_algo_parameters",
           "get_auto_parallel_context", "get_cost_model_context", "parallel_context", "reset_algo_parameters",
           "reset_auto_parallel_context", "reset_cost_model_context", "set_algo_parameters",
           "set_auto_parallel_context", "set_cost_model_context", "Layout", "Plan", "load_plan", "Region", "jit", "shard"]
