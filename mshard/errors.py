"""One error hierarchy for mshard, rooted in ``MshardError``: every error mshard raises is a subclass of
``ValueError`` or ``TypeError`` from here.

>>> import mshard as ms
>>> issubclass(ms.errors.StrategyError, (ValueError, ms.errors.MshardError))
True
"""

from mshard._src.values.errors import CellError as CellError
from mshard._src.values.errors import CellTypeError as CellTypeError
from mshard._src.values.errors import CheckpointError as CheckpointError
from mshard._src.values.errors import CheckpointTypeError as CheckpointTypeError
from mshard._src.values.errors import CommFusionWarning as CommFusionWarning
from mshard._src.values.errors import ContextError as ContextError
from mshard._src.values.errors import ContextTypeError as ContextTypeError
from mshard._src.values.errors import DatasetStrategyError as DatasetStrategyError
from mshard._src.values.errors import GradientsMeanWarning as GradientsMeanWarning
from mshard._src.values.errors import LayoutError as LayoutError
from mshard._src.values.errors import MshardError as MshardError
from mshard._src.values.errors import OptimizerParallelError as OptimizerParallelError
from mshard._src.values.errors import ParameterPlanError as ParameterPlanError
from mshard._src.values.errors import PipelineError as PipelineError
from mshard._src.values.errors import PlanError as PlanError
from mshard._src.values.errors import RegionTypeError as RegionTypeError
from mshard._src.values.errors import SearchError as SearchError
from mshard._src.values.errors import SearchGraphError as SearchGraphError
from mshard._src.values.errors import SearchLimitError as SearchLimitError
from mshard._src.values.errors import StrategyError as StrategyError
from mshard._src.values.errors import StrategyIgnoredWarning as StrategyIgnoredWarning
from mshard._src.values.errors import StrategyTypeError as StrategyTypeError

__all__ = [
    "CellError",
    "CellTypeError",
    "CheckpointError",
    "CheckpointTypeError",
    "CommFusionWarning",
    "ContextError",
    "ContextTypeError",
    "DatasetStrategyError",
    "GradientsMeanWarning",
    "LayoutError",
    "MshardError",
    "OptimizerParallelError",
    "ParameterPlanError",
    "PipelineError",
    "PlanError",
    "RegionTypeError",
    "SearchError",
    "SearchGraphError",
    "SearchLimitError",
    "StrategyError",
    "StrategyIgnoredWarning",
    "StrategyTypeError",
]
