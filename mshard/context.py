"""The parallel context (MindSpore's ``mindspore.context`` names): ``set_auto_parallel_context`` and friends.

>>> import mshard as ms
>>> with ms.context.parallel_context(parallel_mode="data_parallel") as ctx:
...     ctx.parallel_mode == "data_parallel"
True
"""

from mshard._src.values.context import OPTIMIZER_LEVELS as OPTIMIZER_LEVELS
from mshard._src.values.context import SEARCH_MODES as SEARCH_MODES
from mshard._src.values.context import AlgoParameters as AlgoParameters
from mshard._src.values.context import CostModelContext as CostModelContext
from mshard._src.values.context import OptimizerLevel as OptimizerLevel
from mshard._src.values.context import ParallelContext as ParallelContext
from mshard._src.values.context import ParallelMode as ParallelMode
from mshard._src.values.context import SearchMode as SearchMode
from mshard._src.values.context import get_algo_parameters as get_algo_parameters
from mshard._src.values.context import get_auto_parallel_context as get_auto_parallel_context
from mshard._src.values.context import get_cost_model_context as get_cost_model_context
from mshard._src.values.context import get_offload_context as get_offload_context
from mshard._src.values.context import parallel_context as parallel_context
from mshard._src.values.context import reset_algo_parameters as reset_algo_parameters
from mshard._src.values.context import reset_auto_parallel_context as reset_auto_parallel_context
from mshard._src.values.context import reset_cost_model_context as reset_cost_model_context
from mshard._src.values.context import set_algo_parameters as set_algo_parameters
from mshard._src.values.context import set_auto_parallel_context as set_auto_parallel_context
from mshard._src.values.context import set_cost_model_context as set_cost_model_context
from mshard._src.values.context import set_offload_context as set_offload_context
from mshard._src.values.context import set_op_strategy_config as set_op_strategy_config

__all__ = [
    "OPTIMIZER_LEVELS",
    "SEARCH_MODES",
    "AlgoParameters",
    "CostModelContext",
    "OptimizerLevel",
    "ParallelContext",
    "ParallelMode",
    "SearchMode",
    "get_algo_parameters",
    "get_auto_parallel_context",
    "get_cost_model_context",
    "get_offload_context",
    "parallel_context",
    "reset_algo_parameters",
    "reset_auto_parallel_context",
    "reset_cost_model_context",
    "set_algo_parameters",
    "set_auto_parallel_context",
    "set_cost_model_context",
    "set_offload_context",
    "set_op_strategy_config",
]
