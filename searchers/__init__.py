"""searchers: strategy search for mshard on a plain operator graph (numpy/scipy only, no JAX)."""

from .graph import (DeviceMesh as DeviceMesh, Graph as Graph, Op as Op, Tensor as Tensor,
                    Strategy as Strategy, TensorLayout as TensorLayout, ms_strategy as ms_strategy,
                    operand_layout as operand_layout, result_layout as result_layout,
                    partial_axes as partial_axes, prime_factors as prime_factors, replicated as replicated)
