"""mshard: MindSpore's parallel vocabulary over JAX (meshes, PartitionSpecs, jit regions).

>>> import mshard as ms
>>> ms.ParallelMode.SEMI_AUTO_PARALLEL
'semi_auto_parallel'
"""

from . import dataset as dataset
from . import errors as errors
from . import fusion as fusion
from . import nn as nn
from . import ops as ops
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
from .layout import Layout as Layout
from .plan import Plan as Plan
from .plan import load_plan as load_plan
from .region import Region as Region
from .region import jit as jit
from .shard import shard as shard

__all__ = [
                      "CommReport",
                      "Layout",
                      "ParallelMode",
                      "Plan",
                      "Region",
                      "comm_report",
                      "dataset",
                      "errors",
                      "fusion",
                      "get_algo_parameters",
                      "get_auto_parallel_context",
                      "get_cost_model_context",
                      "jit",
                      "load_plan",
                      "nn",
                      "ops",
                      "parallel_context",
                      "reset_algo_parameters",
                      "reset_auto_parallel_context",
                      "reset_cost_model_context",
                      "set_algo_parameters",
                      "set_auto_parallel_context",
                      "set_cost_model_context",
                      "shard",
]
