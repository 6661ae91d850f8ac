"""searchers: strategy search for mshard on a plain operator graph (numpy/scipy only, no JAX)."""

from .graph import DeviceMesh as DeviceMesh
from .graph import Graph as Graph
from .graph import Op as Op
from .graph import Strategy as Strategy
from .graph import Tensor as Tensor
from .graph import TensorLayout as TensorLayout
from .graph import operand_layout as operand_layout
from .graph import partial_axes as partial_axes
from .graph import prime_factors as prime_factors
from .graph import replicated as replicated
from .graph import result_layout as result_layout
from .graph import split_counts as split_counts
