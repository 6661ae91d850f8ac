"""mshard.nn: Cells (Flax NNX modules), layers, losses and training wrappers with MindSpore's names."""

from mshard._src.frontend.cell import Cell as Cell
from mshard._src.frontend.cell import recompute as recompute
from mshard._src.frontend.containers import CellList as CellList
from mshard._src.frontend.containers import SequentialCell as SequentialCell
from mshard._src.frontend.layers import Conv2d as Conv2d
from mshard._src.frontend.layers import Dense as Dense
from mshard._src.frontend.layers import Dropout as Dropout
from mshard._src.frontend.layers import Embedding as Embedding
from mshard._src.frontend.layers import FeedForward as FeedForward
from mshard._src.frontend.layers import Flatten as Flatten
from mshard._src.frontend.layers import LayerNorm as LayerNorm
from mshard._src.frontend.layers import MaxPool2d as MaxPool2d
from mshard._src.frontend.layers import MultiHeadAttention as MultiHeadAttention
from mshard._src.frontend.layers import ReLU as ReLU
from mshard._src.frontend.layers import TransformerBlock as TransformerBlock
from mshard._src.frontend.losses import BCEWithLogitsLoss as BCEWithLogitsLoss
from mshard._src.frontend.losses import CrossEntropyLoss as CrossEntropyLoss
from mshard._src.frontend.losses import L1Loss as L1Loss
from mshard._src.frontend.losses import MSELoss as MSELoss
from mshard._src.frontend.losses import NLLLoss as NLLLoss
from mshard._src.frontend.losses import SmoothL1Loss as SmoothL1Loss
from mshard._src.frontend.losses import SoftmaxCrossEntropyWithLogits as SoftmaxCrossEntropyWithLogits
from mshard._src.frontend.optimizers import SGD as SGD
from mshard._src.frontend.optimizers import Adam as Adam
from mshard._src.frontend.optimizers import AdamWeightDecay as AdamWeightDecay
from mshard._src.frontend.optimizers import DistributedGradReducer as DistributedGradReducer
from mshard._src.frontend.optimizers import Momentum as Momentum
from mshard._src.frontend.optimizers import Optimizer as Optimizer
from mshard._src.frontend.parameter import no_init_parameters as no_init_parameters
from mshard._src.training.pipeline.cells import Pipeline as Pipeline
from mshard._src.training.pipeline.cells import PipelineCell as PipelineCell
from mshard._src.training.train_cells import GradAccumulationCell as GradAccumulationCell
from mshard._src.training.train_cells import MicroBatchInterleaved as MicroBatchInterleaved
from mshard._src.training.train_cells import TrainOneStepCell as TrainOneStepCell
from mshard._src.training.train_cells import WithLossCell as WithLossCell
from mshard._src.values.names import missing_names

__all__ = [
    "SGD",
    "Adam",
    "AdamWeightDecay",
    "BCEWithLogitsLoss",
    "Cell",
    "CellList",
    "Conv2d",
    "CrossEntropyLoss",
    "Dense",
    "DistributedGradReducer",
    "Dropout",
    "Embedding",
    "FeedForward",
    "Flatten",
    "GradAccumulationCell",
    "L1Loss",
    "LayerNorm",
    "MSELoss",
    "MaxPool2d",
    "MicroBatchInterleaved",
    "Momentum",
    "MultiHeadAttention",
    "NLLLoss",
    "Optimizer",
    "Pipeline",
    "PipelineCell",
    "ReLU",
    "SequentialCell",
    "SmoothL1Loss",
    "SoftmaxCrossEntropyWithLogits",
    "TrainOneStepCell",
    "TransformerBlock",
    "WithLossCell",
    "no_init_parameters",
    "recompute",
]

__getattr__ = missing_names(__name__, __all__)      # a name not offered says so, and what to use
