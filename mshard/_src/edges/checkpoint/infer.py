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
    """MindSpore's ``infer_predict_layout``: the layout every variable of ``net`` takes in the plan of
    ``net(*inputs)`` under the current context (tracing only: nothing runs and nothing moves).

    A Cell with a ``shard`` configuration is planned as its own region (as when it is called); any other module
    as ``ms.jit(lambda m, *x: m(*x))``. Differences from MindSpore: the values are ``NamedSharding``s, not
    device-matrix/tensor-map lists.

    Args:
        net: the network to plan (a Cell or any nnx module).
        *inputs: example inputs of one inference call (arrays, or ``jax.ShapeDtypeStruct``s).

    Returns:
        ``{variable path in net: NamedSharding}``: pass it to :func:`load_distributed_checkpoint` as
        ``predict_strategy``.

    >>> import jax.numpy as jnp, mshard as ms
    >>> from flax import nnx
    >>> with ms.parallel_context(parallel_mode="data_parallel", device_num=8):
    ...     lay = infer_predict_layout(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), jnp.ones((8, 4)))
    >>> lay["kernel"].spec, len(lay["kernel"].device_set)
    (P(None, None), 8)
    """
    if not isinstance(net, nnx.Module):
        raise CheckpointTypeError(f"infer_predict_layout: net must be an nnx Module or Cell, got {type(net).__name__}.")
    if getattr(net, "_mshard_shard", None) is not None:
        return cell_region(net).param_shardings(net, *inputs)
    return Region(lambda m, *a: m(*a), name=type(net).__name__).param_shardings(net, *inputs)
