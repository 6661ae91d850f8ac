"""Repeated eager calls of a primitive with a strategy, with no Python frame between the user's call and
``jax.jit``'s C++ dispatch.

After :data:`HITS` calls on the eager fast path (:mod:`mshard._src.runtime.fastcall`) with the same kind of arguments, the op
is switched to a subclass of its own class (same name, same behaviour otherwise) whose ``__call__`` is a C-level
attribute read of a per-op ``jax.jit``: ``op(x, w)`` then costs what ``jax.jit(f)(x, w)`` costs. That ``jax.jit``
wraps the op's ordinary call, so what it compiles is the op's region traced into it (the planned layouts, the same
program), and a call it has not seen (new shapes or dtypes, a Python scalar) is traced again through the ordinary
path: no check is skipped, only repeated.

Everything that could make a cached call stale switches the op back to its own class first:

- the context, the algorithm or cost parameters, a strategy (``op.shard``, ``recompute``, any ``bump_epoch``):
  :func:`mshard.context._touch` calls :func:`revert_all`;
- an mshard region being traced (a primitive inside a region is annotated, not run): ``annotate.recording_into``;
- any attribute set on the op.

Measured by ``bench/eager.py`` (``eager_primitive`` against ``jax_jit_matmul``).

>>> import jax.numpy as jnp, mshard as ms
>>> from mshard import ops
>>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
>>> mm = ops.MatMul().shard(((2, 1), (1, 4)))
>>> x, w = jnp.ones((16, 32)), jnp.ones((32, 64))
>>> outs = [mm(x, w) for _ in range(HITS + 2)]
>>> type(mm).__name__, is_direct(mm), outs[-1].sharding.spec == outs[0].sharding.spec
('MatMul', True, True)
>>> ms.reset_auto_parallel_context(); is_direct(mm)
False
"""

from __future__ import annotations

import operator
import weakref
from typing import Any

import jax

from mshard._src.jaxpr import marks
from mshard._src.values import context as ctxmod

HITS = 3                                      # fast-path hits before an op's calls go direct
_direct: weakref.WeakSet = weakref.WeakSet()  # the ops whose class is now their direct subclass
_classes: dict[type, type] = {}               # an op class -> its direct subclass


def is_direct(op: Any) -> bool:
    """Whether ``op``'s calls currently go straight to its ``jax.jit``."""
    return type(op) in _classes.values()


def _direct_class(base: type) -> type:
    cls = _classes.get(base)
    if cls is None:
        def __setattr__(self, name, value):
            revert(self)
            object.__setattr__(self, name, value)
        # property(attrgetter): reading __call__ runs no Python frame, and neither does the jax.jit it returns
        cls = type(base.__name__, (base,), {"__call__": property(operator.attrgetter("_direct_call")),
                                             "__setattr__": __setattr__,
                                             "__module__": base.__module__, "__qualname__": base.__qualname__})
        _classes[base] = cls
    return cls


def enable(op: Any, stamp: object) -> None:
    """Switch ``op`` (just called ``HITS`` times on its fast path) to direct calls; its ``jax.jit`` is kept
    across reverts while the context stamp is the same, so switching back and forth compiles it once."""
    base = type(op)
    if base in _classes.values():
        return
    d = op.__dict__
    if d.get("_direct_stamp") is not stamp:
        call = base.__call__

        def traced(*args):
            return call(op, *args)
        static = () if op.n_tensors is None else tuple(range(op.n_tensors, op.n_tensors + 8))
        d["_direct_call"] = jax.jit(traced, static_argnums=static)
        d["_direct_stamp"] = stamp
    op.__class__ = _direct_class(base)
    _direct.add(op)


def revert(op: Any) -> None:
    """``op``'s class back to its own (its next calls take the ordinary path)."""
    cls = type(op)
    if cls in _classes.values():
        object.__setattr__(op, "__class__", cls.__mro__[1])
        op.__dict__["_fast_hits"] = 0
        _direct.discard(op)


def revert_all() -> None:
    """Every direct op back to its own class (the context or a strategy changed, or a region is traced: also the
    op's own region, traced inside its ``jax.jit`` the first time; the op goes direct again after ``HITS`` more
    calls, and that ``jax.jit`` is then compiled already)."""
    if _direct:
        for op in list(_direct):
            revert(op)


ctxmod._on_touch.append(revert_all)
marks.on_region_trace.append(revert_all)
