"""Strategy annotations inside a traced region: one identity primitive, ``mshard_mark``.

A primitive object with a strategy (``ops.MatMul().shard(...)``), a shard-wrapped function and a
sharded Cell do not constrain anything while they are traced. They wrap each input and output
in ``mshard_mark`` (an identity carrying an :class:`OpNote`), so the strategies sit in the jaxpr
next to the exact tensors they govern. After tracing, the planner decides the mesh axes of every
split (it sees producers and consumers), and the executor re-emits each mark as
``with_sharding_constraint`` — or as nothing, in modes that ignore strategies.

The mark is linear: its JVP marks the tangent and its transpose marks the cotangent (role
``"ct"``), so gradients taken inside a region carry the same layouts. Outside a region nothing
is marked: primitive objects and Cells run as plain JAX (PyNative style).
"""

from __future__ import annotations

import enum
import functools
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from mshard._src.values import context
from mshard._src.values.layout import TensorStrategy

mark_p = Primitive("mshard_mark")
mark_p.def_impl(lambda x, **_: x)
mark_p.def_abstract_eval(lambda x, **_: x)
mlir.register_lowering(mark_p, lambda ctx, x, **_: [x])


def _mark_transpose(ct, x, *, note, role, index, **batched):
    if type(ct) is ad.Zero:
        return [ct]
    return [mark_p.bind(ct, note=note, role="ct" if role == "in" else "ct_out", index=index, **batched)]


def _mark_batch(args, dims, **kw):
    """Under ``jax.vmap`` a mark stays a mark; inside :func:`replica_axes` (a data-parallel step running its
    replicas side by side) it also records where the replica dim is and which mesh axes it is split over, so
    the executor constrains the batched tensor to the planned per-replica layout plus the replica split."""
    if dims[0] is not None and _state.replica_axes is not None:
        kw = {**kw, "bdim": int(dims[0]), "replica_axes": _state.replica_axes}
    return mark_p.bind(args[0], **kw), dims[0]


ad.deflinear2(mark_p, _mark_transpose)
batching.primitive_batchers[mark_p] = _mark_batch

_uid = itertools.count()


@dataclass(frozen=True, eq=False)
class OpNote:
    """What one annotated op asked for. Hashes by identity (it is a jaxpr parameter).

    ``in_dims``/``out_dims`` give each tensor dim's loop dim (einsum letters) for primitive
    objects; a shard-wrapped function or Cell has ``in_dims is None`` (its inside is propagated).
    """

    kind: str                                        # "MatMul", "Add", ..., or "shard"
    given_name: str | None                           # the name= argument / Cell path, if any
    in_strategy: tuple[TensorStrategy | None, ...]
    out_strategy: tuple[TensorStrategy | None, ...] | None
    in_shapes: tuple[tuple[int, ...], ...]
    in_dims: tuple[tuple[str | None, ...], ...] | None = None
    out_dims: tuple[tuple[str | None, ...], ...] | None = None
    fixed: frozenset[str] = frozenset()              # loop dims the primitive cannot split (Softmax's axis, ...)
    halo: tuple[tuple[str, int], ...] = ()           # (loop dim, rows beyond a block it reads): a conv window
    halo_apart: frozenset[str] = frozenset()         # loop dims a search never splits with a halo dim (planning/xla_guards.py)
    as_traced: bool = False                          # planned as the JAX it computes, not as one op (Primitive.as_traced)
    uid: int = field(default_factory=lambda: next(_uid))

    @property
    def loop_counts(self) -> dict[str, int]:
        """Split count per loop dim, from the inputs' strategies (validated to agree)."""
        out: dict[str, int] = {}
        for dims, st in zip(self.in_dims or (), self.in_strategy):
            if st is None:
                continue
            for d, c in zip(dims, st.counts):
                if d is not None:
                    out[d] = max(out.get(d, 1), c)
        return out

    @property
    def reduction_dims(self) -> tuple[str, ...]:
        used = {d for od in self.out_dims or () for d in od}
        seen = []
        for dims in self.in_dims or ():
            for d in dims:
                if d is not None and d not in used and d not in seen:
                    seen.append(d)
        return tuple(seen)


def mark(x: Any, note: OpNote, role: str, index: int) -> Any:
    return mark_p.bind(x, note=note, role=role, index=index)


# -- what is being traced now ---------------------------------------------------------------------
class _TraceState(threading.local):
    def __init__(self) -> None:
        self.region = None            # the TraceRecord being traced, or None (eager / plain JAX)
        self.plain = False            # inside recording_into(None): mshard traces plain JAX on purpose
        self.replica_axes: tuple[str, ...] | None = None     # set while replicas are vmapped (see _mark_batch)


_state = _TraceState()


@dataclass
class TraceRecord:
    """Collected while a region is traced: Cell paths and the parameter plans of sharded Cells."""

    device_num: int
    module_paths: dict[int, str] = field(default_factory=dict)        # id(module) -> "dense1.inner"
    param_plans: list[tuple[str, str, Any]] = field(default_factory=list)   # (cell path, key, strategy)
    scope_stack: list[str] = field(default_factory=list)              # paths of the module calls in progress
    hand_written: bool = False        # the region runs a training step written by hand (``ms.jit`` over a closure)
    pipelines: list[str] = field(default_factory=list)   # PipelineCells whose schedule ran in this trace
    zero: bool = False                # an optimizer Cell applied optimizer parallel in this trace (functional_zero)

    def scope_of(self, path: str) -> str:
        """The named scope of a call of the module at ``path``: its path relative to the module call it is made
        in (``blocks.0`` from the root, then ``attention``, then ``query``), so op names read
        ``blocks.0/attention/query/dot_general``."""
        parent = self.scope_stack[-1] if self.scope_stack else ""
        if parent and path.startswith(parent + "."):
            return path[len(parent) + 1:]
        return path


class module_scopes:
    """While a region traces, every call of a plain nnx module (one with no mshard code) of ``classes`` opens
    a ``jax.named_scope`` of its path, as Cells do, so plan op names carry the module path, and a module given
    strategies by ``ms.shard(module, ...)`` runs under them (its inputs, outputs and ``parameter_plan``, whose
    keys are relative to the module), as a sharded Cell does. The classes' own ``__call__`` is restored on exit."""

    def __init__(self, trace: TraceRecord, classes):
        self.trace, self.classes = trace, [c for c in classes if not getattr(c.__call__, "_mshard_wrapped", False)]
        self.saved: list = []

    def __enter__(self):
        trace = self.trace
        for cls in self.classes:
            if "__call__" not in vars(cls):
                continue
            orig = vars(cls)["__call__"]

            def call(self_, *a, _orig=orig, **k):
                path = trace.module_paths.get(id(self_))
                if path is None or current_region() is not trace:
                    return _orig(self_, *a, **k)
                scope = trace.scope_of(path)
                body = functools.partial(_orig, self_)
                if not k:
                    body = _module_strategies[0](self_, body, path)
                trace.scope_stack.append(path)
                try:
                    if scope:
                        with jax.named_scope(scope):
                            return body(*a, **k)
                    return body(*a, **k)
                finally:
                    trace.scope_stack.pop()
            self.saved.append((cls, orig))
            cls.__call__ = call
        return self

    def __exit__(self, *exc) -> None:
        for cls, orig in reversed(self.saved):
            cls.__call__ = orig


def current_region() -> TraceRecord | None:
    return _state.region


on_region_trace: list = []
"""Called with no arguments whenever a region starts tracing (``mshard._src.frontend.direct_call`` switches direct ops back)."""


class recording_into:
    """Context manager: mark annotations while a region is traced (``None``: primitives run plainly inside it)."""

    def __init__(self, trace: TraceRecord | None):
        self.trace = trace

    def __enter__(self) -> TraceRecord:
        for hook in on_region_trace:
            hook()
        self.saved = (_state.region, _state.plain)
        _state.region, _state.plain = self.trace, self.trace is None
        return self.trace

    def __exit__(self, *exc) -> None:
        _state.region, _state.plain = self.saved


class replica_axes:
    """Context manager: marks batched by ``jax.vmap`` inside it are replicas split over mesh ``axes``."""

    def __init__(self, axes: Sequence[str]):
        self.axes = tuple(axes)

    def __enter__(self) -> None:
        self.saved, _state.replica_axes = _state.replica_axes, self.axes

    def __exit__(self, *exc) -> None:
        _state.replica_axes = self.saved


# wraps a module's call in the strategies Cell.shard / ms.shard(module, ...) recorded on it; installed by
# mshard.shard (the front end, a layer above this one) when it is imported: the identity until then
_module_strategies: list[Callable[[Any, Callable, str], Callable]] = [lambda module, body, path: body]


def use_module_strategies(wrap: Callable[[Any, Callable, str], Callable]) -> None:
    """Install ``wrap(module, body, path) -> body`` (:func:`mshard.shard.module_strategies`) for module calls."""
    _module_strategies[0] = wrap


# bumped by every .shard()/recompute(): a region's cache key includes it, so a changed strategy re-traces
_epoch = [0]


def bump_epoch() -> None:
    _epoch[0] += 1
    context._touch()


def epoch() -> int:
    return _epoch[0]


def has_tracers(args: Any) -> bool:
    """Whether any array in ``args`` is a JAX tracer: the call is inside someone else's ``jax.jit``/``grad``
    (not an mshard region), where a sharded function or Cell runs as plain JAX instead of as its own region."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


def in_user_trace(args: Any) -> bool:
    """Whether a call is traced by the user's own ``jax.jit`` / ``grad`` / ``vmap`` (tracers, outside any mshard
    region and outside mshard's own plain tracing): see :mod:`mshard._src.jaxpr.user_trace`."""
    return _state.region is None and not _state.plain and has_tracers(args)


class CallSite(enum.Enum):
    """Where a call of a shard-wrapped function, a Cell or a primitive object runs: the one decision the three share
    (:func:`call_site`); each then does its own thing for each site."""

    REGION = "inside an mshard region being traced"            # mark the call's inputs and outputs
    USER_TRACE = "traced by the user's own jax.jit / grad / vmap"   # constrain the object's region into that trace
    PLAIN = "traced by mshard as plain JAX"                     # a data-parallel replica: run as plain JAX
    EAGER = "eager: concrete arrays, no region"                 # the object's own region runs (PyNative)


def call_site(args: Any) -> CallSite:
    """Where a call with arguments ``args`` runs now.

    >>> import jax.numpy as jnp
    >>> call_site((jnp.ones(2),))
    <CallSite.EAGER: 'eager: concrete arrays, no region'>
    >>> jax.jit(lambda x: print(call_site((x,))) or x)(jnp.ones(2)).shape
    CallSite.USER_TRACE
    (2,)
    """
    if _state.region is not None:
        return CallSite.REGION
    if not has_tracers(args):
        return CallSite.EAGER
    return CallSite.PLAIN if _state.plain else CallSite.USER_TRACE


def annotate_call(fn, args: Sequence[Any], note: OpNote, n_out: int | None = None):
    """Run ``fn(*args)`` with every input and output marked by ``note`` (inside a region)."""
    marked = [mark(a, note, "in", i) if st is not None or note.in_dims is not None else a
              for i, (a, st) in enumerate(zip(args, note.in_strategy))]
    out = fn(*marked)
    leaves, tree = jax.tree.flatten(out)
    leaves = [mark(o, note, "out", j) for j, o in enumerate(leaves)]
    return jax.tree.unflatten(tree, leaves)
