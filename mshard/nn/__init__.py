"""mshard.nn: Cells (Flax NNX modules), layers, losses and training wrappers with MindSpore's names."""

from .cell import Cell as Cell
from .cell import recompute as recompute
from .layers import Conv2d as Conv2d
from .layers import Dense as Dense
from .layers import Dropout as Dropout
from .layers import Embedding as Embedding
from .layers import FeedForward as FeedForward
from .layers import Flatten as Flatten
from .layers import LayerNorm as LayerNorm
from .layers import MaxPool2d as MaxPool2d
from .layers import MultiHeadAttention as MultiHeadAttention
from .layers import ReLU as ReLU
from .layers import TransformerBlock as TransformerBlock
from .loss import MSELoss as MSELoss
from .loss import SoftmaxCrossEntropyWithLogits as SoftmaxCrossEntropyWithLogits
from .pipeline import Pipeline as Pipeline
from .pipeline import PipelineCell as PipelineCell
from .train import GradAccumulationCell as GradAccumulationCell
from .train import MicroBatchInterleaved as MicroBatchInterleaved
from .train import TrainOneStepCell as TrainOneStepCell
from .train import WithLossCell as WithLossCell
