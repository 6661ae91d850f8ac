"""``ms.infer_predict_layout``: the layout every variable of a network takes in its inference plan.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> import mshard as ms
>>> lay = infer_predict_layout(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), jnp.ones((8, 4)))
>>> sorted(lay)
['bias', 'kernel']
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from mshard._src.frontend.cell import cell_region
from mshard._src.runtime.region import Region
from mshard._src.values.errors import CheckpointTypeError


def infer_predict_layout(net: nnx.Module, *inputs: Any) -> dict[str, jax.sharding.NamedSharding]:
    """Plan ``net(*inputs)`` under the current context (tracing only) and return each variable's sharding, by its
    path in ``net``: pass it to :func:`load_distributed_checkpoint` as ``predict_strategy``.

    A Cell with a ``shard`` configuration is planned as its own region (as when it is called); any other module
    as ``ms.jit(lambda m, *x: m(*x))``. Differences from MindSpore: the values are ``NamedSharding``s, not
    device-matrix/tensor-map lists.
    """
    if not isinstance(net, nnx.Module):
        raise CheckpointTypeError(f"infer_predict_layout: net must be an nnx Module or Cell, got {type(net).__name__}.")
    if getattr(net, "_mshard_shard", None) is not None:
        return cell_region(net).param_shardings(net, *inputs)
    return Region(lambda m, *a: m(*a), name=type(net).__name__).param_shardings(net, *inputs)
