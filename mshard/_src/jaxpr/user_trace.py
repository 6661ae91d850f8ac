"""A sharded function, Cell, module or primitive called on tracers outside any mshard region: inside the user's
own ``jax.jit``, ``jax.grad`` or ``jax.vmap`` (MindSpore's ``shard`` used in a program mshard does not own).

In the modes that honour strategies (semi_auto_parallel, auto_parallel) the call runs its own region's plan,
traced into the caller's program: its inputs (and a Cell's or module's parameters) are constrained to the planned
layouts (``with_sharding_constraint``) and the region's program, with every layout it pins, is inlined. Where no
layout can be constrained (inside a ``shard_map``, whose axes are manual; a program that cannot hold the region's
mesh) it runs as plain JAX and warns once per sharded object. data_parallel and stand_alone ignore strategies
there as everywhere: plain JAX, no warning.

>>> import jax, jax.numpy as jnp, mshard as ms
>>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
>>> f = ms.shard(lambda x: x * 2, in_strategy=((8,),))
>>> len(jax.jit(f)(jnp.ones(16)).sharding.device_set)
8
>>> ms.reset_auto_parallel_context()
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import AxisType

from mshard._src.values import context as ctxmod
from mshard._src.values.errors import MshardError, StrategyIgnoredWarning

_warned: set[int] = set()      # ids of the sharded objects that warned (once each)


def _manual_axes() -> tuple[str, ...]:
    """The manual mesh axes of the program being traced (a ``shard_map`` body), if any."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Manual)


def call_in_user_trace(owner: Any, where: str, region_call: Callable[[], Any], plain_call: Callable[[], Any]):
    """``region_call()`` (the object's region, constrained into the caller's trace) where the mode honours
    strategies and the layouts can be constrained; else ``plain_call()``, warning once per ``owner`` when
    strategies are dropped."""
    if ctxmod.current().parallel_mode not in ("semi_auto_parallel", "auto_parallel"):
        return plain_call()
    manual = _manual_axes()
    if manual:
        reason = f"it is traced inside a shard_map (manual mesh axes {manual}), where no layout can be constrained"
    else:
        try:
            return region_call()
        except MshardError:
            raise
        except (ValueError, TypeError) as e:       # JAX refused the constraints in the caller's program
            reason = f"the caller's program refused its layouts ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    if id(owner) not in _warned:
        _warned.add(id(owner))
        warnings.warn(f"{where}: called inside a traced program that mshard does not own and {reason}; its strategies "
                      f"are not applied there (it runs as plain JAX). Call it outside the shard_map, or give the "
                      f"layouts with the shard_map's in_specs.", StrategyIgnoredWarning, stacklevel=4)
    return plain_call()
