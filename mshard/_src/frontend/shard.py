"""``ms.shard``: MindSpore's functional shard, as a call and as a decorator.

Inside a region the wrapped function's inputs and outputs are marked with their strategies and
its inside is propagated (by XLA's SPMD propagation from those layouts), as in MindSpore's
functional shard. Called outside a region, the shard-wrapped function is its own region: it is
jitted with the in_strategy as the layout of its arguments.

>>> import jax.numpy as jnp, mshard as ms
>>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
>>> @ms.shard(in_strategy=((2, 1), (1, 4)))
... def matmul(x, w):
...     return x @ w
>>> matmul(jnp.ones((8, 16)), jnp.ones((16, 8))).shape
(8, 8)
>>> ms.reset_auto_parallel_context()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from mshard._src.jaxpr import marks
from mshard._src.jaxpr.marks import CallSite, OpNote, annotate_call
from mshard._src.jaxpr.user_trace import call_in_user_trace
from mshard._src.runtime.fastcall import MISS
from mshard._src.runtime.region import BoundRegion, Region
from mshard._src.values.errors import StrategyError
from mshard._src.values.layout import check_fits, normalize_in_strategy


def _out_strategy(out_strategy, where: str):
    if out_strategy is None:
        return None
    return normalize_in_strategy(out_strategy, None, where + " out_strategy")


class ShardedFunction:
    """A function with MindSpore strategies for its inputs/outputs (and parameters when it is a Cell call)."""

    def __init__(self, fn: Callable, in_strategy, out_strategy=None, parameter_plan=None, name: str | None = None,
                 cell_path: str = ""):
        self.fn = fn
        self.cell_path = cell_path
        self.name = name or getattr(fn, "__name__", "shard")
        where = f"shard({self.name})"
        self.in_strategy = normalize_in_strategy(in_strategy, None, where)
        self.out_strategy = _out_strategy(out_strategy, where)
        self.parameter_plan = dict(parameter_plan or {})
        self._region: Region | None = None
        functools.update_wrapper(self, fn, updated=())

    def _note(self, args, device_num: int) -> OpNote:
        where = f"shard({self.name})"
        if len(self.in_strategy) != len(args):
            raise StrategyError(f"{where}: in_strategy has {len(self.in_strategy)} entries but the function is "
                                f"called with {len(args)} argument(s); give one strategy (or None) per argument.")
        shapes = []
        for i, (a, st) in enumerate(zip(args, self.in_strategy)):
            shape = tuple(getattr(a, "shape", ()))
            if st is not None:
                if not hasattr(a, "shape"):
                    raise StrategyError(f"{where}: input {i} has strategy {st.counts} but is {type(a).__name__}, "
                                        f"not an array; use None for non-array arguments.")
                check_fits(st, shape, device_num, f"{where} input {i}")
            shapes.append(shape)
        return OpNote("shard", self.name, self.in_strategy, self.out_strategy, tuple(shapes))

    def __call__(self, *args):
        site = marks.call_site(args)
        if site is CallSite.USER_TRACE:
            return call_in_user_trace(self, f"shard({self.name})", lambda: self.region()(*args),
                                      lambda: self.fn(*args))
        if site is CallSite.PLAIN:
            return self.fn(*args)
        if site is CallSite.EAGER:
            return self.region()(*args)
        trace = marks.current_region()
        note = self._note(args, trace.device_num)
        trace.param_plans.extend((self.cell_path, k, v) for k, v in self.parameter_plan.items())
        out = annotate_call(self.fn, args, note)
        if self.out_strategy is not None:
            n_out = len(jax.tree.leaves(out))
            if len(self.out_strategy) != n_out:
                raise StrategyError(f"shard({self.name}): out_strategy has {len(self.out_strategy)} entries but the "
                                    f"function returns {n_out} array(s).")
            for j, (o, st) in enumerate(zip(jax.tree.leaves(out), self.out_strategy)):
                if st is not None:
                    check_fits(st, o.shape, trace.device_num, f"shard({self.name}) output {j}")
        return out

    # the region API, for a shard-wrapped function used directly
    def lower(self, *args):
        return self.region().lower(*args)

    def region(self) -> Region:
        """The region this function runs as when called outside one (made once)."""
        if self._region is None:
            self._region = Region(self, data_strategy=self.in_strategy, name=self.name)
        return self._region


class ShardedModule:
    """``ms.shard(module, in_strategy, out_strategy, parameter_plan)`` for a plain nnx module (a flax layer or
    model with no mshard code): calling it runs ``module(*args)`` as its own region with the module as the
    region's parameter argument, so ``parameter_plan`` keys are the module's own parameter paths (``kernel``,
    ``l1.kernel``; MindSpore names such as ``l1.weight`` where they map to one parameter).

    As MindSpore's ``shard`` of a Cell, the strategies are also recorded on the module (a static attribute,
    kept by ``nnx.clone``/``split``/``merge``): wherever the module is called inside a region (``ms.jit``, a
    ``TrainOneStepCell`` over a model that contains it) its inputs and parameters are laid out as given.
    """

    def __init__(self, module, in_strategy, out_strategy=None, parameter_plan=None):
        self.module = module
        self.in_strategy, self.out_strategy = in_strategy, out_strategy
        self.parameter_plan = dict(parameter_plan or {})
        self.name = type(module).__name__
        inner = normalize_in_strategy(in_strategy, None, f"shard({self.name})")
        module._mshard_shard = (tuple(in_strategy) if isinstance(in_strategy, (tuple, list)) else (in_strategy,),
                                None if out_strategy is None else tuple(out_strategy),
                                tuple(sorted(self.parameter_plan.items())))
        marks.bump_epoch()
        self._region = Region(self._body, data_strategy=(None, *inner), name=self.name)
        self._bound = BoundRegion(self._region, (module,), check_structure=True)

    def _body(self, module, *args):
        return module(*args)             # its recorded strategies apply (annotate.module_scopes)

    def __call__(self, *args):
        # a repeated eager call: the compiled program on the module's Variables, no graph split (its structure is
        # compared instead, so an assigned sub-module or Variable goes through the region again); tracers miss
        out = self._bound.call_fast(args)
        if out is not MISS:
            return out
        site = marks.call_site(args)
        if site is CallSite.EAGER and marks.in_user_trace(nnx.state(self.module)):
            site = CallSite.USER_TRACE            # the module's Variables are traced by the user's own jax.jit
        if site is CallSite.USER_TRACE:
            return call_in_user_trace(self, f"shard({self.name})", lambda: self._region(self.module, *args),
                                      lambda: self.module(*args))
        if site is CallSite.PLAIN:
            return self.module(*args)
        return self._bound(*args)

    def region(self) -> Region:
        return self._region

    def lower(self, *args):
        return self._region.lower(self.module, *args)

    def plan(self, *args):
        return self._region.plan(self.module, *args)

    def bind(self):
        """The region bound to the module (:meth:`Region.bind`): repeated calls skip the module traversal."""
        return self._region.bind(self.module)


def module_strategies(module: Any, body: Callable, path: str) -> Callable:
    """``body`` (a module's call, traced inside a region) wrapped in the strategies ``Cell.shard`` /
    ``ms.shard(module, ...)`` recorded on ``module`` (its ``_mshard_shard``), or ``body`` itself where none are."""
    cfg = getattr(module, "_mshard_shard", None)
    if cfg is None:
        return body
    in_s, out_s, plan = cfg
    return ShardedFunction(body, in_s, out_s, dict(plan), name=path or type(module).__name__, cell_path=path)


marks.use_module_strategies(module_strategies)


def shard(fn: Callable | None = None, in_strategy: Any = None, out_strategy: Any = None,
          parameter_plan: dict | None = None, device: str = "CPU", level: int = 0):
    """MindSpore's ``shard``: give a function (or Cell) input/output strategies.

    Use as ``ms.shard(fn, in_strategy, out_strategy)`` or as ``@ms.shard(in_strategy=...)``.
    For a Cell it is ``cell.shard(...)``; for a plain nnx module it returns a :class:`ShardedModule` whose
    ``parameter_plan`` names the module's parameters (``{"kernel": (1, 4)}``). ``device``/``level`` are accepted for MindSpore
    compatibility and ignored. Inside a region the inside of ``fn`` is propagated from these layouts; called
    outside one, ``fn`` runs as its own jitted region with ``in_strategy`` as its arguments' layout.

    Args:
        fn: a function, a Cell or a plain nnx module; None for the decorator form.
        in_strategy: one strategy per positional input, e.g. ``((2, 1), (1, 4))`` (None for a non-array input).
        out_strategy: one strategy per output, or None to leave the outputs to propagation.
        parameter_plan: parameter path -> strategy, for a Cell or module, e.g. ``{"dense1.weight": (1, 8)}``.
        device: MindSpore's target device; ignored.
        level: MindSpore's propagation level; ignored.

    Returns:
        The sharded callable: for a function a wrapper with its strategies; for a Cell the Cell itself
        (``cell.shard(...)``); for a plain nnx module a :class:`ShardedModule`; with ``fn=None`` a decorator.

    >>> import jax.numpy as jnp, mshard as ms
    >>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    >>> f = ms.shard(lambda x: x * 2, in_strategy=((8,),))
    >>> f(jnp.ones(16)).shape
    (16,)
    >>> ms.reset_auto_parallel_context()
    """
    if fn is None:
        return lambda f: shard(f, in_strategy, out_strategy, parameter_plan)
    if in_strategy is None:
        raise StrategyError("shard: in_strategy is required (one strategy per input, e.g. ((2, 1), (1, 4))).")
    if isinstance(fn, nnx.Module) and hasattr(fn, "shard"):
        return fn.shard(in_strategy, out_strategy, parameter_plan)
    if isinstance(fn, nnx.Module):
        return ShardedModule(fn, in_strategy, out_strategy, parameter_plan)
    return ShardedFunction(fn, in_strategy, out_strategy, parameter_plan)
