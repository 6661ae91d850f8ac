"""mshard.nn: Cells (Flax NNX modules) and layers with MindSpore's names."""

from .cell import Cell as Cell
from .layers import Dense as Dense, ReLU as ReLU
