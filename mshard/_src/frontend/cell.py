"""``nn.Cell``: a Flax NNX Module that speaks MindSpore (shard, recompute, pipeline_stage).

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from mshard import nn
>>> class Net(nn.Cell):
...     def __init__(self, rngs):
...         self.dense1 = nn.Dense(4, 8, rngs=rngs)
...     def __call__(self, x):
...         return self.dense1(x)
>>> Net(nnx.Rngs(0))(jnp.ones((2, 4))).shape
(2, 8)

Differences from MindSpore: a Cell is an ``nnx.Module``; its parameters are ``nnx.Param``
variables and parameter paths are attribute paths (``"dense1.weight"``). A Cell with a shard
configuration called outside a region runs as its own jitted region (MindSpore's PyNative shard).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mshard._src.frontend.parameter import FrozenParameter
from mshard._src.frontend.shard import module_strategies
from mshard._src.jaxpr import marks
from mshard._src.jaxpr.marks import CallSite
from mshard._src.jaxpr.user_trace import call_in_user_trace
from mshard._src.runtime.fusion import ordered_after
from mshard._src.runtime.region import Region
from mshard._src.values import run_mode
from mshard._src.values.errors import CellError, CellTypeError, ParameterPlanError, PipelineError, StrategyTypeError
from mshard._src.values.layout import normalize_in_strategy


def _wrap_call(call: Callable) -> Callable:
    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        cfg = getattr(self, "_mshard_shard", None)
        site = marks.call_site(args)
        if site is not CallSite.REGION:
            sharded = cfg is not None and not kwargs
            if sharded and site is CallSite.EAGER:
                return cell_region(self)(self, *args)
            if site is CallSite.EAGER and not kwargs and run_mode.graph_mode() and _compiled_in_graph_mode(self):
                return graph_region(self)(self, *args)
            if sharded and site is CallSite.USER_TRACE:
                return call_in_user_trace(self, f"Cell {type(self).__name__}", lambda: cell_region(self)(self, *args),
                                          lambda: _plain(self, call, args, kwargs))
            return _plain(self, call, args, kwargs)
        trace = marks.current_region()
        path = trace.module_paths.get(id(self), "")
        scope = trace.scope_of(path) if path else None
        body = functools.partial(call, self)
        if getattr(self, "_mshard_recompute", None) is not None:
            body = _remat(self, call, path, trace, self._mshard_recompute or None)
        trace.scope_stack.append(path)
        try:
            with jax.named_scope(scope) if scope else _null():
                if cfg is None:
                    return body(*args, **kwargs)
                return module_strategies(self, lambda *a: body(*a, **kwargs), path)(*args)
        finally:
            trace.scope_stack.pop()
    __call__._mshard_wrapped = True
    return __call__


def _construct_call(self, *args, **kwargs):
    return self.construct(*args, **kwargs)


def _plain(self, call, args, kwargs):
    """A Cell's call outside any region, as plain JAX (recomputed where it asks, also when traced outside a
    region: a data-parallel replica, the user's own jax.jit / grad)."""
    policy = getattr(self, "_mshard_recompute", None)
    if policy is not None and marks.has_tracers(args):
        return _remat(self, call, "", None, policy or None)(*args, **kwargs)
    return call(self, *args, **kwargs)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


def register_paths(trace: marks.TraceRecord, module: nnx.Module, prefix: str) -> None:
    """Give a module re-made by ``nnx.merge`` inside a region (and its sub-Cells) their attribute paths."""
    for p, sub in nnx.iter_graph(module):
        if isinstance(sub, nnx.Module):
            rel = ".".join(map(str, p))
            trace.module_paths[id(sub)] = ".".join(x for x in (prefix, rel) if x)


def _remat(cell: Cell, call: Callable, path: str, trace, policy) -> Callable:
    """``jax.checkpoint`` around ``call(cell, ...)``, functional over the Cell's state.

    The Cell is split and re-merged inside the checkpointed function (nnx state must not be mutated
    across JAX trace levels), its sub-Cells keep their paths (op names, parameter plans), and state
    it writes (a Dropout's RNG count) is written back after.
    """
    graphdef, state = nnx.split(cell)
    leaves, tree = jax.tree.flatten(state)

    def run(*args, **kwargs):
        changed: list[int] = []

        def pure(flat, *a):
            m = nnx.merge(graphdef, jax.tree.unflatten(tree, list(flat)))
            if trace is not None:
                register_paths(trace, m, path)
            out = call(m, *a, **kwargs)
            new = jax.tree.leaves(nnx.state(m))
            changed[:] = [i for i, (x, y) in enumerate(zip(new, flat)) if x is not y]
            return out, [new[i] for i in changed]

        out, written = _ordered_checkpoint(pure, policy)(leaves, *args)
        if changed:
            new = list(leaves)
            for i, x in zip(changed, written):
                new[i] = x
            nnx.update(cell, jax.tree.unflatten(tree, new))
        return out
    return run


def _ordered_checkpoint(fn: Callable, policy) -> Callable:
    """``jax.checkpoint(fn, policy)`` whose backward recomputation is data-dependent on the incoming cotangent.

    ``fn(state_leaves, *activations)``. jax.checkpoint orders the recomputation with an optimization barrier,
    which XLA:CPU expands before scheduling, so the recomputation can be hoisted into the forward pass and
    CSE'd away (no memory saved). Here the saved residuals other than the state (the activations, and the
    values the policy saves) pass through :func:`fusion.ordered_after` with a cotangent element first, which
    keeps each recomputation after its layer's cotangent on every backend.
    """
    ck = jax.checkpoint(fn, policy=policy)
    keep: list[bool] = []

    @jax.custom_vjp
    def run(*xs):
        return fn(*xs)

    def fwd(*xs):
        out, vjp = jax.vjp(ck, *xs)
        state = {id(x) for x in jax.tree.leaves(xs[0])}
        keep[:] = [id(r) in state for r in jax.tree.leaves(vjp)]
        return out, vjp

    def bwd(vjp, ct):
        cts = [c for c in jax.tree.leaves(ct) if hasattr(c, "dtype") and jnp.issubdtype(c.dtype, jnp.floating)
               and c.size]
        if cts:
            # a scalar every device holds: the sum is partitioned as local sums and one 4-byte all-reduce, where
            # an element (reshape(-1)[0]) made XLA all-gather the whole cotangent of a batch-split activation
            t = jnp.sum(cts[0])
            leaves, tree = jax.tree.flatten(vjp)
            leaves = [r if k or not jnp.issubdtype(r.dtype, jnp.floating) else ordered_after(r, t)
                      for r, k in zip(leaves, keep)]
            vjp = jax.tree.unflatten(tree, leaves)
        return vjp(ct)

    run.defvjp(fwd, bwd)
    return run


_POLICIES = ("everything_saveable", "nothing_saveable", "dots_saveable", "checkpoint_dots",
             "dots_with_no_batch_dims_saveable", "checkpoint_dots_with_no_batch_dims")
_MS_RECOMPUTE_KWARGS = ("mp_comm_recompute", "parallel_optimizer_comm_recompute", "recompute_slice_activation")


_regions: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


_graph_regions: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _compiled_in_graph_mode(cell: Cell) -> bool:
    """A user's Cell (a class defined outside mshard) is compiled whole when called under ``GRAPH_MODE``; mshard's
    own Cells (layers, wrappers, training cells) run as they always do: a layer op by op, a training cell as its
    own region."""
    return not type(cell).__module__.startswith("mshard.")


def graph_region(cell: Cell) -> Region:
    """The region a user's Cell without a shard configuration runs as when called eagerly under ``GRAPH_MODE``
    (MindSpore's static graph): one jitted program, planned under the current parallel context, made once per
    Cell."""
    region = _graph_regions.get(cell)
    if region is None:
        region = _graph_regions[cell] = Region(lambda c, *a: c(*a), name=type(cell).__name__)
    return region


def cell_region(cell: Cell) -> Region:
    """The region a Cell with a shard configuration (``cell.shard(...)``) runs as when called outside one: made
    once per configuration and kept while the Cell lives."""
    cfg = cell._mshard_shard
    key = cfg
    entry = _regions.get(cell)
    if entry is None or entry[0] != key:
        data_strategy = (None,) + tuple(normalize_in_strategy(cfg[0], None, type(cell).__name__))
        entry = (key, Region(lambda c, *a: c(*a), data_strategy=data_strategy, name=type(cell).__name__))
        _regions[cell] = entry
    return entry[1]


class Cell(nnx.Module):
    """Base class of mshard models; subclass it like ``nnx.Module`` (or MindSpore's ``nn.Cell``).

    Sub-Cells and ``nnx.Param`` variables are attributes, and parameter paths are attribute paths
    (``"dense1.weight"``). MindSpore's methods: :meth:`shard` (input/output strategies and a ``parameter_plan``),
    :meth:`recompute`, :meth:`set_train`, and the ``pipeline_stage`` / ``pipeline_segment`` properties. A Cell
    with a shard configuration called outside a region runs as its own jitted region (MindSpore's PyNative shard).
    Differences from MindSpore: a Cell is an ``nnx.Module`` (``nnx.split``/``merge``/``state`` work on it), its
    forward is ``__call__`` (not ``construct``), and Dropout is active until ``set_train(False)``.

    Args:
        none: ``Cell`` itself takes no arguments; a subclass's ``__init__`` takes what it needs (often ``rngs``).

    >>> import jax.numpy as jnp, mshard as ms
    >>> from flax import nnx
    >>> from mshard import nn
    >>> class Net(nn.Cell):
    ...     def __init__(self, rngs):
    ...         self.dense1 = nn.Dense(4, 8, rngs=rngs)
    ...     def __call__(self, x):
    ...         return self.dense1(x)
    >>> net = Net(nnx.Rngs(0))
    >>> net(jnp.ones((2, 4))).shape, net.pipeline_stage
    ((2, 8), 0)
    >>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    >>> net = net.shard(((2, 1),), parameter_plan={"dense1.weight": (4, 1)})
    >>> net(jnp.ones((8, 4))).shape, net.dense1.weight[...].sharding.shard_shape((8, 4))
    ((8, 8), (2, 4))
    >>> ms.reset_auto_parallel_context()
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "construct" in cls.__dict__ and "__call__" not in cls.__dict__:
            cls.__call__ = _construct_call          # MindSpore's forward: a Cell that defines construct runs it
        call = cls.__dict__.get("__call__")
        if call is not None and not getattr(call, "_mshard_wrapped", False):
            cls.__call__ = _wrap_call(call)

    def shard(self, in_strategy: Any, out_strategy: Any = None, parameter_plan: dict | None = None,
              device: str = "CPU", level: int = 0) -> Cell:
        """Strategies for this Cell's inputs/outputs and a ``parameter_plan`` ``{"dense1.weight": (1, 8)}``.

        Inside a region the Cell's inside is propagated from these layouts (MindSpore's functional shard).
        Parameter paths are relative to this Cell; a key matching no parameter is an error.
        """
        where = f"{type(self).__name__}.shard"
        normalize_in_strategy(in_strategy, None, where)
        if parameter_plan is not None and not isinstance(parameter_plan, dict):
            raise StrategyTypeError(f"{where}: parameter_plan must be a dict like {{'dense1.weight': (1, 8)}}, got "
                                    f"{parameter_plan!r}.")
        paths = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(self))}
        for key in parameter_plan or {}:
            if key not in paths:
                raise ParameterPlanError(f"{where}: parameter_plan key {key!r} matches no parameter of "
                                         f"{type(self).__name__}; its parameters are {sorted(paths)[:8]}.")
        self._mshard_shard = (tuple(in_strategy) if isinstance(in_strategy, (tuple, list)) else (in_strategy,),
                              None if out_strategy is None else tuple(out_strategy),
                              tuple(sorted((parameter_plan or {}).items())))
        marks.bump_epoch()
        return self

    def recompute(self, policy: Callable | str | None = None, **kwargs: Any) -> Cell:
        """Recompute this Cell's activations in the backward pass (``jax.checkpoint`` around ``__call__``).

        ``policy``: a ``jax.checkpoint_policies`` policy or its name, e.g. ``"dots_saveable"`` (keep the
        matmul outputs, recompute the rest); ``None`` saves nothing but the Cell's inputs. Applies whenever the
        Cell's call is traced: inside a region (``ms.jit``, ``TrainOneStepCell``) or the user's own
        ``jax.jit``/``jax.grad``; an eager call runs plainly. MindSpore's ``mp_comm_recompute``,
        ``parallel_optimizer_comm_recompute`` and ``recompute_slice_activation`` are accepted and have no
        effect (XLA decides which collectives to redo). ``nn.Cell.recompute(module)`` (or
        :func:`recompute`) on a plain ``nnx.Module`` makes that module recompute too.
        """
        return recompute(self, policy, **kwargs)

    def offload(self, backward_prefetch: str | int = "Auto") -> Cell:
        """MindSpore's ``Cell.offload``: keep this Cell's saved activations in host memory from its forward to its
        backward. It is ``recompute(policy="offload")``: each matmul result the backward needs is moved to JAX's
        ``pinned_host`` memory kind and back (JAX's ``offload_dot_with_no_batch_dims`` policy); the rest is
        recomputed.

        Args:
            backward_prefetch: MindSpore's prefetch point for the backward: accepted, no effect (XLA schedules the
                transfer back).

        Returns:
            This Cell.

        >>> from mshard import nn
        >>> cell = nn.Dense(4, 4).offload()
        >>> cell._mshard_recompute is not None
        True
        """
        return recompute(self, "offload")

    def trainable_params(self, recurse: bool = True) -> list[nnx.Param]:
        """MindSpore's ``trainable_params``: the Cell's trained parameters (its ``nnx.Param`` Variables, each once,
        in the order of ``nnx.state``), what an optimizer Cell takes.

        Args:
            recurse: include the sub-Cells' parameters (False: only those held directly by this Cell).

        Returns:
            A list of ``nnx.Param`` Variables.

        >>> from flax import nnx
        >>> from mshard import nn
        >>> [tuple(p[...].shape) for p in nn.Dense(4, 2, rngs=nnx.Rngs(0)).trainable_params()]
        [(2,), (2, 4)]
        """
        return self._variables(nnx.Param, recurse)

    def get_parameters(self, expand: bool = True) -> list[nnx.Variable]:
        """MindSpore's ``get_parameters``: every parameter, trained or not (``Parameter(requires_grad=False)``).

        Args:
            expand: include the sub-Cells' parameters.

        Returns:
            A list of Variables.

        >>> import mshard as ms
        >>> from mshard import nn
        >>> class Net(nn.Cell):
        ...     def __init__(self):
        ...         self.w = ms.Parameter(ms.Tensor([1.0]))
        ...         self.scale = ms.Parameter(ms.Tensor(2.0), requires_grad=False)
        >>> len(Net().get_parameters()), len(Net().trainable_params())
        (2, 1)
        """
        return self._variables(nnx.Any(nnx.Param, FrozenParameter), expand)

    def _variables(self, which, recurse: bool) -> list[nnx.Variable]:
        out, seen = [], set()
        for path, v in nnx.iter_graph(self):
            if (isinstance(v, nnx.Variable) and id(v) not in seen and (recurse or len(path) == 1)
                    and nnx.filterlib.to_predicate(which)(path, v)):
                seen.add(id(v))
                if getattr(v, "name", None) is None:         # MindSpore names a parameter by its attribute path
                    v.set_metadata("name", ".".join(map(str, path)))
                out.append(v)
        return out

    def set_train(self, mode: bool = True) -> Cell:
        """MindSpore's ``set_train``: ``False`` makes Dropout deterministic in this Cell and below (nnx's
        ``eval()``), ``True`` (the nnx default) enables it again (nnx's ``train()``)."""
        self.set_attributes(deterministic=not mode, use_running_average=not mode, raise_if_not_found=False)
        return self

    def set_comm_fusion(self, fusion_type: int, recurse: bool = True) -> Cell:
        """MindSpore's ``set_comm_fusion``: the fusion index of this Cell's parameters' gradient collectives
        (``recurse``: and its sub-Cells'). Recorded (``comm_fusion_index``); XLA fuses collectives itself, so it
        does not change the program (``comm_fusion`` in the parallel context sizes mshard's own buckets)."""
        if not isinstance(fusion_type, int) or isinstance(fusion_type, bool) or fusion_type < 0:
            raise CellTypeError(f"{type(self).__name__}.set_comm_fusion({fusion_type!r}): the fusion index is an "
                                f"int >= 0.")
        cells = [m for _, m in nnx.iter_graph(self) if isinstance(m, Cell)] if recurse else [self]
        for c in cells:
            c._mshard_fusion = fusion_type
        return self

    @property
    def comm_fusion_index(self) -> int | None:
        """The index ``set_comm_fusion`` gave this Cell, or None."""
        return getattr(self, "_mshard_fusion", None)

    @property
    def pipeline_stage(self) -> int:
        return getattr(self, "_mshard_stage", 0)

    @pipeline_stage.setter
    def pipeline_stage(self, stage: int) -> None:
        if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
            raise PipelineError(f"{type(self).__name__}.pipeline_stage = {stage!r}: a stage is an int >= 0.")
        self._mshard_stage = stage

    @property
    def pipeline_segment(self) -> int:
        """The chunk (virtual stage ``segment * pipeline_stages + pipeline_stage``) of the interleaved schedule."""
        return getattr(self, "_mshard_segment", 0)

    @pipeline_segment.setter
    def pipeline_segment(self, segment: int) -> None:
        if not isinstance(segment, int) or isinstance(segment, bool) or segment < 0:
            raise PipelineError(f"{type(self).__name__}.pipeline_segment = {segment!r}: a segment is an int >= 0.")
        self._mshard_segment = segment


_recomputing: dict[type, type] = {}      # a plain nnx.Module class -> its subclass whose __call__ recomputes


def recompute(module: nnx.Module, policy: Callable | str | None = None, **kwargs: Any) -> nnx.Module:
    """Make ``module`` (a Cell or any ``nnx.Module``) recompute its activations in the backward pass; returns it.

    A plain ``nnx.Module`` becomes an instance of a subclass of its class whose ``__call__`` is checkpointed
    as a Cell's is (its parameters, paths and ``nnx.split``/``merge`` are unchanged). Anything that is not an
    nnx module, or a module with no ``__call__``, raises ``CellTypeError``. ``cell.recompute(policy)`` calls it.

    Args:
        module: the Cell or ``nnx.Module`` whose ``__call__`` is recomputed.
        policy: a ``jax.checkpoint_policies`` policy or its name (``"dots_saveable"``: keep the matmul outputs;
            ``"offload"``: keep them in host memory, ``pinned_host``); None saves nothing but the module's inputs.
        **kwargs: MindSpore's ``mp_comm_recompute``, ``parallel_optimizer_comm_recompute`` and
            ``recompute_slice_activation``: accepted, no effect (XLA decides which collectives to redo).

    Returns:
        ``module`` itself (a plain ``nnx.Module``'s class is switched to the recomputing subclass).

    >>> from flax import nnx
    >>> import mshard as ms
    >>> lin = ms.recompute(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    >>> isinstance(lin, nnx.Linear), lin._mshard_recompute
    (True, False)
    """
    who = f"{type(module).__name__}.recompute"
    if not isinstance(module, nnx.Module):
        raise CellTypeError(f"recompute: {module!r} is not an nnx.Module (a Cell or a flax module); recompute wraps "
                            f"a module's __call__ in jax.checkpoint. For a function, use jax.checkpoint(fn).")
    for k in kwargs:
        if k not in _MS_RECOMPUTE_KWARGS:
            raise CellTypeError(f"{who}: unknown argument {k!r}; expected policy= or one of {_MS_RECOMPUTE_KWARGS}.")
    if isinstance(policy, str):
        if policy == "offload":         # saved matmul results to host memory (JAX's memory kinds), the rest recomputed
            policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
        elif policy not in _POLICIES:
            raise CellError(f"{who}: unknown policy {policy!r}; use one of {_POLICIES + ('offload',)} or a "
                            f"jax.checkpoint_policies callable.")
        else:
            policy = getattr(jax.checkpoint_policies, policy)
    cls = type(module)
    call = next((c.__dict__["__call__"] for c in cls.__mro__ if "__call__" in c.__dict__), None)
    if not getattr(call, "_mshard_wrapped", False):
        if call is None:
            raise CellTypeError(f"{who}: {cls.__name__} defines no __call__, so there is nothing to recompute; call "
                                f"recompute on the module whose __call__ runs the layers.")
        sub = _recomputing.get(cls)
        if sub is None:
            sub = type(cls.__name__, (cls,), {"__call__": _wrap_call(call), "__module__": cls.__module__,
                                              "__qualname__": cls.__qualname__})
            _recomputing[cls] = sub
        object.__setattr__(module, "__class__", sub)
    module._mshard_recompute = policy if policy is not None else False
    marks.bump_epoch()
    return module
