"""mshard.nn: Cells (Flax NNX modules), layers, losses and training wrappers with MindSpore's names."""

from .cell import Cell as Cell
from .layers import (Conv2d as Conv2d, Dense as Dense, Dropout as Dropout, Embedding as Embedding,
                     FeedForward as FeedForward, Flatten as Flatten, LayerNorm as LayerNorm, MaxPool2d as MaxPool2d,
                     MultiHeadAttention as MultiHeadAttention, ReLU as ReLU, TransformerBlock as TransformerBlock)
from .loss import MSELoss as MSELoss, SoftmaxCrossEntropyWithLogits as SoftmaxCrossEntropyWithLogits
from .train import (GradAccumulationCell as GradAccumulationCell, MicroBatchInterleaved as MicroBatchInterleaved,
                    TrainOneStepCell as TrainOneStepCell, WithLossCell as WithLossCell)
