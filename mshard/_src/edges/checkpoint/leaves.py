"""What a checkpoint holds: every ``nnx.Variable`` of the object, by its dotted path.

Parameters, the optimizer state (ZeRO-sharded or not), the optimizer's step count, RNG keys and counts and any
other variable (BatchNorm statistics) are leaves. A typed PRNG key is stored as its key data (uint32) with its
implementation's name, and rebuilt on load.

>>> from flax import nnx
>>> [l.name for l in leaves_of(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))]
['bias', 'kernel']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mshard._src.values.errors import CheckpointTypeError


@dataclass(frozen=True)
class Leaf:
    name: str                 # "network.backbone.l1.kernel"
    path: tuple               # the key path in nnx.to_pure_dict(nnx.state(obj))
    kind: str                 # the Variable type: Param, OptVariable, RngKey, ...
    value: jax.Array          # the stored form (key data for a PRNG key)
    key_impl: str | None      # the PRNG implementation of a key leaf


def _part(k) -> Any:
    if isinstance(k, jax.tree_util.DictKey):
        return k.key
    if isinstance(k, jax.tree_util.SequenceKey):
        return k.idx
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    return str(k)


def is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def leaves_of(obj: Any) -> list[Leaf]:
    """The array leaves of ``obj`` (an nnx Module: Cell, TrainOneStepCell, plain flax module), in state order."""
    if not isinstance(obj, nnx.Module):
        raise CheckpointTypeError(f"checkpoint: expected an nnx Module, Cell or TrainOneStepCell, got "
                                  f"{type(obj).__name__}; pass the network or the training step itself.")
    out = []
    state = nnx.state(obj)
    for path, v in jax.tree.leaves_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable)):
        x = v.get_value() if isinstance(v, nnx.Variable) else v
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            continue
        parts = tuple(_part(k) for k in path)
        impl = None
        if is_key(x):
            impl = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        elif not isinstance(x, jax.Array):
            x = jnp.asarray(x)
        out.append(Leaf(".".join(map(str, parts)), parts, type(v).__name__, x, impl))
    return out


def assign(obj: nnx.Module, values: dict[tuple, Any]) -> None:
    """Write ``values`` (key path -> array, in stored form) into ``obj``'s variables."""
    state = nnx.state(obj)
    pure = nnx.to_pure_dict(state)
    for path, x in values.items():
        node = pure
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = x
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(obj, state)
