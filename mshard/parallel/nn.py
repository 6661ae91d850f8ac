"""``mshard.parallel.nn``: MindSpore 2.6's ``mindspore.parallel.nn`` names for accumulation, interleaving and
pipeline wrappers.

>>> from mshard.parallel.nn import GradAccumulation, Pipeline
>>> GradAccumulation.__name__, Pipeline.__name__
('GradAccumulationCell', 'Pipeline')
"""

from mshard._src.frontend.optimizers import PipelineGradReducer as PipelineGradReducer
from mshard._src.frontend.wrapper_cells import GradAccumulationCell as GradAccumulation
from mshard._src.frontend.wrapper_cells import MicroBatchInterleaved as MicroBatchInterleaved
from mshard._src.training.pipeline.cells import Pipeline as Pipeline

__all__ = ["GradAccumulation", "MicroBatchInterleaved", "Pipeline", "PipelineGradReducer"]
