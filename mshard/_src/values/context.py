"""The parallel context: MindSpore's ``set_auto_parallel_context`` and friends over immutable values.

The context is a frozen :class:`ParallelContext` value; the setters validate and swap in a new
value, so a region can snapshot it, a cache can key on it and a wrapper (MindSpore 2.5's
``AutoParallel``) can own one. ``parallel_context(...)`` is the scoped form.

>>> import mshard as ms
>>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
>>> ms.get_auto_parallel_context("parallel_mode")
'semi_auto_parallel'
>>> with ms.parallel_context(parallel_mode="data_parallel"):
...     ms.get_auto_parallel_context("parallel_mode")
'data_parallel'
>>> ms.get_auto_parallel_context("parallel_mode")
'semi_auto_parallel'
>>> ms.reset_auto_parallel_context()

Differences from MindSpore: the context is process-global like MindSpore's, but ``device_num``
defaults to ``jax.device_count()`` and may be smaller (the region then uses the first
``device_num`` devices); ``search_mode`` is honoured in semi_auto_parallel when set explicitly.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import enum
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
from jax._src import xla_bridge as _xla_bridge  # backends_are_initialized: JAX has no public form of it

from mshard._src.values.errors import ContextError, ContextTypeError


class ParallelMode(enum.StrEnum):
    """MindSpore's parallel modes. A member equals its string, and every place that takes a mode takes either.

    ``ParallelMode.MODE_LIST`` (MindSpore's attribute) is the tuple of the five strings.

    Args:
        value: a mode's string (``"stand_alone"``, ``"data_parallel"``, ``"semi_auto_parallel"``,
            ``"auto_parallel"``, ``"hybrid_parallel"``); ``ParallelMode(value)`` is its member.

    >>> ParallelMode("semi_auto_parallel") is ParallelMode.SEMI_AUTO_PARALLEL
    True
    >>> ParallelMode.DATA_PARALLEL == "data_parallel"
    True
    """

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    HYBRID_PARALLEL = "hybrid_parallel"


ParallelMode.MODE_LIST = tuple(m.value for m in ParallelMode)     # MindSpore's own attribute


class SearchMode(enum.StrEnum):
    """MindSpore's ``search_mode`` values: the searchers of auto_parallel (and sharding_propagation in semi_auto).

    A member equals its string. ``ilp`` is mshard's own searcher (not in MindSpore).

    Args:
        value: a search mode's string (``"recursive_programming"``, ``"sharding_propagation"``,
            ``"dynamic_programming"``, ``"ilp"``); ``SearchMode(value)`` is its member.

    >>> SearchMode("ilp") is SearchMode.ILP
    True
    >>> SearchMode.SHARDING_PROPAGATION == "sharding_propagation"
    True
    """

    RECURSIVE_PROGRAMMING = "recursive_programming"
    SHARDING_PROPAGATION = "sharding_propagation"
    DYNAMIC_PROGRAMMING = "dynamic_programming"
    ILP = "ilp"


class OptimizerLevel(enum.StrEnum):
    """MindSpore's optimizer parallel levels: level1 shards the optimizer state and the update, level2 the gradients
    too (mshard's level1 already reduce-scatters them: the same program), level3 the stored weights too (FSDP).

    Set it as ``parallel_optimizer_config={"optimizer_level": ...}`` with ``enable_parallel_optimizer=True``.

    Args:
        value: a level's string (``"level1"``, ``"level2"``, ``"level3"``); ``OptimizerLevel(value)`` is its member.

    >>> import mshard as ms
    >>> OptimizerLevel("level3") is OptimizerLevel.LEVEL3
    True
    >>> ms.set_auto_parallel_context(enable_parallel_optimizer=True,
    ...                              parallel_optimizer_config={"optimizer_level": "level3"})
    >>> ms.get_auto_parallel_context("parallel_optimizer_config")["optimizer_level"]
    'level3'
    >>> ms.reset_auto_parallel_context()
    """

    LEVEL1 = "level1"
    LEVEL2 = "level2"
    LEVEL3 = "level3"


OPTIMIZER_LEVELS = tuple(m.value for m in OptimizerLevel)
SEARCH_MODES = tuple(m.value for m in SearchMode)
FUSION_KINDS = ("allreduce", "allgather", "reducescatter")
FUSION_MODES = ("auto", "size", "index")


def _default_comm_fusion() -> dict:
    return {"allreduce": {"mode": "auto", "config": None}}


@dataclass(frozen=True)
class ParallelContext:
    """One immutable snapshot of every ``set_auto_parallel_context`` key (docs/design.md §2).

    The setters validate and swap in a new value; :func:`parallel_context` yields it and a region snapshots it.
    Building one directly validates nothing: do it only to pass a context to a function that takes one
    (e.g. ``ms.fusion.fusion_setting``). Why the context is a value: docs/context.md.

    Args:
        parallel_mode: the :class:`ParallelMode` (default ``stand_alone``).
        device_num: the devices regions use; None: every device (``jax.device_count()``).
        search_mode: the :class:`SearchMode` of auto_parallel (default ``recursive_programming``).
        dataset_strategy: ``"data_parallel"``, ``"full_batch"`` or a tuple of per-input split tuples.
        gradients_mean: MindSpore's mean-or-sum flag; mshard always computes the global-batch gradient
            (MindSpore's True) and warns under an explicit False (docs/gradients.md).
        pipeline_stages: the number of pipeline stages (1: no pipeline).
        pipeline_config: ``{"pipeline_interleave": bool, "pipeline_scheduler": "1f1b" | "gpipe"}``.
        enable_parallel_optimizer: whether the optimizer is sharded over the data-parallel devices.
        parallel_optimizer_config: ``{"optimizer_weight_shard_size", "parallel_optimizer_threshold" (KB),
            "optimizer_level"}``.
        comm_fusion: ``{kind: {"mode": "auto" | "size" | "index", "config": ...}}`` for the gradient buckets.
        all_reduce_fusion_config: increasing gradient indices that split the all-reduce buckets, or None.
        strategy_ckpt_config: ``{"save_file": path, "load_file": path, "only_trainable_params": bool}``.
        offload_config: MindSpore's ``set_offload_context`` dict; ``{"offload_param": "cpu"}`` keeps a training
            step's optimizer state in host memory between steps (:func:`set_offload_context`).
        search_mode_explicit: True once ``search_mode`` was set (semi_auto_parallel then honours
            ``sharding_propagation``).
        gradients_mean_explicit: True once ``gradients_mean`` was set (only then does False warn).

    >>> ctx = ParallelContext(parallel_mode="data_parallel", device_num=8)
    >>> ctx.parallel_mode == "data_parallel", ctx.devices
    (True, 8)
    """

    parallel_mode: ParallelMode = ParallelMode.STAND_ALONE
    device_num: int | None = None               # None: jax.device_count()
    search_mode: SearchMode = SearchMode.RECURSIVE_PROGRAMMING
    dataset_strategy: Any = "data_parallel"     # "data_parallel" | "full_batch" | tuple of split tuples
    gradients_mean: bool = False
    pipeline_stages: int = 1
    pipeline_config: dict = field(default_factory=lambda: {"pipeline_interleave": False,
                                                           "pipeline_scheduler": "1f1b"})
    enable_parallel_optimizer: bool = False
    parallel_optimizer_config: dict = field(default_factory=lambda: {
        "optimizer_weight_shard_size": -1, "parallel_optimizer_threshold": 64, "optimizer_level": "level1"})
    comm_fusion: dict = field(default_factory=_default_comm_fusion)
    all_reduce_fusion_config: tuple[int, ...] | None = None
    strategy_ckpt_config: dict = field(default_factory=lambda: {
        "save_file": "", "load_file": "", "only_trainable_params": True})
    offload_config: dict = field(default_factory=lambda: {"offload_param": ""})
    search_mode_explicit: bool = False          # set by set_auto_parallel_context(search_mode=...)
    gradients_mean_explicit: bool = False       # set by set_auto_parallel_context(gradients_mean=...)

    @property
    def devices(self) -> int:
        """The device count regions use (``device_num`` or every device). The first read initialises JAX's backend,
        so the setters never read it (MindSpore's order, ``set_auto_parallel_context`` before
        ``communication.init()``, must work): the checks that need the device count run here, when a region is
        built."""
        have = jax.device_count()
        if self.device_num is not None and self.device_num > have:
            _too_many(self.device_num, have)
        n = self.device_num or have
        if self.device_num is None:
            _check_device_count(self, n)
        return n

    def cache_key(self) -> str:
        return repr(self)


PUBLIC_KEYS = tuple(f.name for f in dataclasses.fields(ParallelContext) if not f.name.endswith("_explicit"))


# -- validators: one per key (a registry, not an if-chain) ---------------------------------------
def _type(key: str, value: Any, types: tuple, what: str) -> None:
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        raise ContextTypeError(f"set_auto_parallel_context: {key} must be {what}, got {value!r} "
                               f"({type(value).__name__}).")


def did_you_mean(value: Any, choices) -> str:
    """``" Did you mean 'x'?"`` for the closest of ``choices`` to a misspelt ``value`` (a prefix counts too:
    'semi_auto' -> 'semi_auto_parallel'), else ``""``."""
    if not isinstance(value, str):
        return ""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    close = close or [c for c in choices if c.startswith(value) and len(value) >= 3][:1]
    return f" Did you mean {close[0]!r}?" if close else ""


def _one_of(key: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed:
        raise ContextError(f"set_auto_parallel_context: unknown {key} {value!r}.{did_you_mean(value, allowed)} "
                           f"Expected one of {', '.join(map(repr, allowed))}.")
    return value


def _v_mode(v, ctx):
    _type("parallel_mode", v, (str,), "a string")
    return ParallelMode(_one_of("parallel_mode", v, ParallelMode.MODE_LIST))


def _v_search(v, ctx):
    _type("search_mode", v, (str,), "a string")
    return SearchMode(_one_of("search_mode", v, SEARCH_MODES))


def _v_device_num(v, ctx):
    if v is None:
        return None
    _type("device_num", v, (int,), "a positive int")
    have = jax.device_count() if _backend_up() else None
    if v < 1 or (have is not None and v > have):
        _too_many(v, have)
    return v


def _too_many(v: int, have: int | None):
    bound = "the devices of the job" if have is None else have
    raise ContextError(f"set_auto_parallel_context: device_num={v} but this process sees "
                       f"{'no devices yet' if have is None else f'{have} device(s)'}; use 1 <= device_num <= {bound} "
                       f"(or launch more devices, e.g. XLA_FLAGS=--xla_force_host_platform_device_count={v} on CPU).")


def _backend_up() -> bool:
    """Whether JAX's backend is initialised already, so reading the device count initialises nothing. Before
    ``jax.distributed.initialize`` (``ms.communication.init``) it must not be read: MindSpore's scripts set the
    context first."""
    up = getattr(_xla_bridge, "backends_are_initialized", None)
    return bool(up()) if up is not None else False


def _v_bool(key):
    def check(v, ctx):
        _type(key, v, (bool,), "True or False")
        return v
    return check


def _v_stages(v, ctx):
    _type("pipeline_stages", v, (int,), "a positive int")
    if v < 1:
        raise ContextError(f"set_auto_parallel_context: pipeline_stages={v}; it must be >= 1.")
    return v


def _split_tuple(key: str, t: Any, n: int | None) -> tuple[int, ...]:
    if not isinstance(t, (tuple, list)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in t):
        raise ContextTypeError(f"set_auto_parallel_context: {key} entries must be tuples of ints, got {t!r}.")
    if any(s < 1 for s in t):
        raise ContextError(f"set_auto_parallel_context: {key} entry {tuple(t)} has a split < 1; "
                           f"every split count must be a positive int.")
    prod = math.prod(t)
    if n is not None and n % prod:
        raise ContextError(f"set_auto_parallel_context: {key} entry {tuple(t)} splits over {prod} devices, "
                           f"which does not divide device_num={n}; use splits whose product divides {n}.")
    return tuple(t)


def _v_dataset(v, ctx):
    if isinstance(v, str):
        return _one_of("dataset_strategy", v, ("data_parallel", "full_batch"))
    if isinstance(v, (tuple, list)) and v:
        return tuple(_split_tuple("dataset_strategy", t, ctx.device_num) for t in v)
    raise ContextTypeError(f"set_auto_parallel_context: dataset_strategy must be 'data_parallel', "
                           f"'full_batch' or a tuple of per-input split tuples like ((8, 1),), got {v!r}.")


def _config_items(name: str, v: Any, defaults: dict) -> tuple[dict, list[tuple[str, Any]]]:
    """A copy of ``defaults`` to update and the (key, value) pairs of the dict ``v``, every key known."""
    if not isinstance(v, dict):
        raise ContextTypeError(f"set_auto_parallel_context: {name} must be a dict, got {v!r}.")
    for k in v:
        if k not in defaults:
            raise ContextError(f"set_auto_parallel_context: unknown {name} key {k!r}; expected {sorted(defaults)}.")
    return dict(defaults), list(v.items())


def _v_pconfig(v, ctx):
    out, items = _config_items("pipeline_config", v, ParallelContext().pipeline_config)
    for k, x in items:
        if k == "pipeline_interleave":
            _type(f"pipeline_config[{k!r}]", x, (bool,), "True or False")
        else:
            _type(f"pipeline_config[{k!r}]", x, (str,), "'1f1b' or 'gpipe'")
            _one_of(f"pipeline_config[{k!r}]", x, ("1f1b", "gpipe"))
        out[k] = x
    return out


def _v_popt(v, ctx):
    out, items = _config_items("parallel_optimizer_config", v, ParallelContext().parallel_optimizer_config)
    for k, x in items:
        if k == "optimizer_level":
            _type(f"parallel_optimizer_config[{k!r}]", x, (str,), "'level1', 'level2' or 'level3'")
            out[k] = OptimizerLevel(_one_of(f"parallel_optimizer_config[{k!r}]", x, OPTIMIZER_LEVELS))
            continue
        _type(f"parallel_optimizer_config[{k!r}]", x, (int,), "an int")
        if k == "optimizer_weight_shard_size" and x != -1 and x < 1:
            raise ContextError(f"set_auto_parallel_context: optimizer_weight_shard_size={x}; use -1 (the "
                               f"whole data-parallel group) or a positive int.")
        if k == "parallel_optimizer_threshold" and x < 0:
            raise ContextError(f"set_auto_parallel_context: parallel_optimizer_threshold={x} KB must be >= 0.")
        out[k] = x
    return out


def _v_fusion(v, ctx):
    if not isinstance(v, dict):
        raise ContextTypeError(f"set_auto_parallel_context: comm_fusion must be a dict like "
                               f"{{'allreduce': {{'mode': 'auto', 'config': None}}}}, got {v!r}.")
    out = {}
    for kind, cfg in v.items():
        _one_of("comm_fusion kind", kind, FUSION_KINDS)
        if not isinstance(cfg, dict) or "mode" not in cfg:
            raise ContextError(f"set_auto_parallel_context: comm_fusion[{kind!r}] must be a dict with a 'mode' "
                               f"('auto', 'size' or 'index') and a 'config', got {cfg!r}.")
        mode = _one_of(f"comm_fusion[{kind!r}] mode", cfg["mode"], FUSION_MODES)
        conf = cfg.get("config")
        if mode == "auto" and conf is not None:
            raise ContextError(f"set_auto_parallel_context: comm_fusion[{kind!r}] mode 'auto' takes config=None "
                               f"(64 MB buckets), got {conf!r}.")
        if mode == "size" and (not isinstance(conf, (int, float)) or isinstance(conf, bool) or conf <= 0):
            raise ContextError(f"set_auto_parallel_context: comm_fusion[{kind!r}] mode 'size' needs config=a "
                               f"positive bucket size in MB, got {conf!r}.")
        if mode == "index":
            if kind != "allreduce":
                raise ContextError(f"set_auto_parallel_context: comm_fusion mode 'index' is only for 'allreduce', "
                                   f"not {kind!r}; use 'auto' or 'size'.")
            conf = _increasing("comm_fusion['allreduce'] config", conf)
        out[kind] = {"mode": mode, "config": conf}
    return out


def _increasing(key: str, v: Any) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in v):
        raise ContextTypeError(f"set_auto_parallel_context: {key} must be a list of ints like [20, 35], got {v!r}.")
    if any(i <= 0 for i in v) or any(b <= a for a, b in zip(v, v[1:])):
        raise ContextError(f"set_auto_parallel_context: {key} {list(v)} must be strictly increasing positive "
                           f"gradient indices, e.g. [20, 35].")
    return tuple(v)


def _v_arfc(v, ctx):
    return None if v is None else _increasing("all_reduce_fusion_config", v)


def _v_ckpt(v, ctx):
    out, items = _config_items("strategy_ckpt_config", v, ParallelContext().strategy_ckpt_config)
    for k, x in items:
        if k == "only_trainable_params":
            _type(f"strategy_ckpt_config[{k!r}]", x, (bool,), "True or False")
        else:
            _type(f"strategy_ckpt_config[{k!r}]", x, (str,), "a file path string ('' for none)")
        out[k] = x
    return out


# MindSpore's set_offload_context keys with no meaning here: accepted, recorded, no effect
_OFFLOAD_ACCEPTED = ("offload_path", "offload_checkpoint", "offload_ddr_size", "offload_cpu_size", "offload_disk_size",
                     "enable_aio", "aio_block_size", "aio_queue_depth", "enable_pinned_mem", "auto_offload",
                     "host_mem_block_size")


def _v_offload(v, ctx):
    if not isinstance(v, dict):
        raise ContextTypeError(f"set_offload_context: offload_config must be a dict like {{'offload_param': 'cpu'}}, "
                               f"got {type(v).__name__}.")
    out = dict(ctx.offload_config)
    for k, x in v.items():
        if k == "offload_param":
            if x not in ("", "cpu", "disk"):
                raise ContextError(f"set_offload_context: offload_param={x!r}; expected 'cpu' (or '' for none).")
            if x == "disk":
                raise ContextError("set_offload_context: offload_param='disk' is not offered: JAX offloads to host "
                                   "memory only; use 'cpu'.")
        elif k not in _OFFLOAD_ACCEPTED:
            raise ContextError(f"set_offload_context: unknown key {k!r}."
                               f"{did_you_mean(k, ('offload_param',) + _OFFLOAD_ACCEPTED)}")
        out[k] = x
    return out


_VALIDATORS: dict[str, Callable[[Any, ParallelContext], Any]] = {
    "parallel_mode": _v_mode,
    "device_num": _v_device_num,
    "search_mode": _v_search,
    "dataset_strategy": _v_dataset,
    "gradients_mean": _v_bool("gradients_mean"),
    "pipeline_stages": _v_stages,
    "pipeline_config": _v_pconfig,
    "enable_parallel_optimizer": _v_bool("enable_parallel_optimizer"),
    "parallel_optimizer_config": _v_popt,
    "comm_fusion": _v_fusion,
    "all_reduce_fusion_config": _v_arfc,
    "strategy_ckpt_config": _v_ckpt,
    "offload_config": _v_offload,
}
# device_num first: other checks (dataset_strategy, pipeline_stages) depend on it
_ORDER = ("device_num",) + tuple(k for k in _VALIDATORS if k != "device_num")

_current = ParallelContext()


def current() -> ParallelContext:
    """The current context value (what a region snapshots)."""
    return _current


_stamp = object()
"""Replaced whenever the context, the algorithm parameters, the cost-model context or a strategy (the annotation
epoch) changes: a fast path built under one stamp is valid while ``_stamp`` is that object (one identity check
per eager call instead of four)."""


_on_touch: list = []
"""Called with no arguments on every :func:`_touch` (``mshard._src.frontend.direct_call`` switches direct ops back)."""


def _touch() -> None:
    global _stamp
    _stamp = object()
    for hook in _on_touch:
        hook()


def stamp() -> object:
    """The current :data:`_stamp` (what a fast path records when it is built)."""
    return _stamp


def _with(base: ParallelContext, **kwargs: Any) -> ParallelContext:
    for k in kwargs:
        if k not in _VALIDATORS:
            raise ContextError(f"set_auto_parallel_context: unknown key {k!r}.{did_you_mean(k, PUBLIC_KEYS)} Valid "
                               f"keys are {', '.join(PUBLIC_KEYS)}.")
    ctx = base
    for k in _ORDER:
        if k in kwargs:
            ctx = dataclasses.replace(ctx, **{k: _VALIDATORS[k](kwargs[k], ctx)})
    if "search_mode" in kwargs:
        ctx = dataclasses.replace(ctx, search_mode_explicit=True)
    if "gradients_mean" in kwargs:
        ctx = dataclasses.replace(ctx, gradients_mean_explicit=True)
    if _backend_up():
        _check_device_count(ctx, ctx.devices)
    elif ctx.device_num is not None:     # the rest when a region reads the device count (ParallelContext.devices)
        _check_device_count(ctx, ctx.device_num)
    return ctx


def _check_device_count(ctx: ParallelContext, n: int) -> None:
    """The checks of the keys that depend on the device count ``n``."""
    if n % ctx.pipeline_stages:
        raise ContextError(f"set_auto_parallel_context: pipeline_stages={ctx.pipeline_stages} does not divide "
                           f"device_num={n}; choose a divisor of {n}.")
    for t in ctx.dataset_strategy if isinstance(ctx.dataset_strategy, tuple) else ():
        _split_tuple("dataset_strategy", t, n)
    shard = ctx.parallel_optimizer_config["optimizer_weight_shard_size"]
    if shard != -1 and n % shard:
        raise ContextError(f"set_auto_parallel_context: optimizer_weight_shard_size={shard} does not divide "
                           f"device_num={n}; use a divisor of the data-parallel size or -1.")


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Set keys of the parallel context (MindSpore's ``set_auto_parallel_context``; docs/design.md §2).

    Each key is validated now, and nothing changes if one is bad (:class:`~mshard.errors.ContextError`, or
    ``ContextTypeError`` for a wrong type, naming the key and the closest valid value). Checks that need the
    device count wait until a region reads it, so the context may be set before ``communication.init()``.
    Differences from MindSpore: ``device_num`` may be smaller than the device count (the first ``device_num``
    devices are used); more in docs/context.md.

    Args:
        **kwargs: the keys to set, each a field of :class:`ParallelContext`: ``parallel_mode``, ``device_num``,
            ``search_mode``, ``dataset_strategy``, ``gradients_mean``, ``pipeline_stages``, ``pipeline_config``,
            ``enable_parallel_optimizer``, ``parallel_optimizer_config``, ``comm_fusion``,
            ``all_reduce_fusion_config``, ``strategy_ckpt_config``. A config dict updates only the keys it names.

    >>> import mshard as ms
    >>> ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    >>> ms.get_auto_parallel_context("gradients_mean")
    True
    >>> ms.reset_auto_parallel_context()
    """
    global _current
    _current = _with(_current, **kwargs)
    _touch()


def set_offload_context(offload_config: dict) -> None:
    """MindSpore's ``set_offload_context``: ``{"offload_param": "cpu"}`` keeps every training step's optimizer state
    in host memory (JAX's ``pinned_host`` memory kind) between steps; the step moves it to the device for the
    update and back. ``""`` turns it off. MindSpore's other keys (``offload_path``, ``enable_aio``, ...) are accepted
    and have no effect; ``"disk"`` is refused.

    Differences from MindSpore: what is offloaded is the optimizer state (MindSpore's ``offload_param`` also moves
    weights the forward is not using); the weights stay on the device.

    Args:
        offload_config: the keys to set.

    >>> import mshard as ms
    >>> ms.set_offload_context(offload_config={"offload_param": "cpu"})
    >>> ms.get_offload_context()["offload_param"]
    'cpu'
    >>> ms.reset_auto_parallel_context()
    """
    set_auto_parallel_context(offload_config=offload_config)


def get_offload_context() -> dict:
    """MindSpore's ``get_offload_context``: the offload settings (a copy).

    Returns:
        The ``offload_config`` dict (``offload_param``: ``"cpu"`` or ``""``).

    >>> import mshard as ms
    >>> ms.get_offload_context()["offload_param"]
    ''
    """
    return dict(_current.offload_config)


def get_auto_parallel_context(key: str) -> Any:
    """The value of one key of the parallel context (MindSpore's ``get_auto_parallel_context``).

    ``device_num`` resolves to the device count regions use; a mode is MindSpore's string (the context holds it as
    :class:`ParallelMode` / :class:`SearchMode`, equal to it).

    Args:
        key: one of the keys :func:`set_auto_parallel_context` takes; another raises
            :class:`~mshard.errors.ContextError`.

    Returns:
        The key's value, a copy: mutating it changes nothing.

    >>> import mshard as ms
    >>> ms.get_auto_parallel_context("pipeline_stages"), ms.get_auto_parallel_context("parallel_mode")
    (1, 'stand_alone')
    """
    if key not in _VALIDATORS:
        raise ContextError(f"get_auto_parallel_context: unknown key {key!r}.{did_you_mean(key, PUBLIC_KEYS)} Valid keys "
                           f"are {', '.join(PUBLIC_KEYS)}.")
    if key == "device_num":
        return _current.devices
    value = getattr(_current, key)
    if key == "all_reduce_fusion_config" and value is not None:
        return list(value)
    return _plain(copy.deepcopy(value))


def _plain(value: Any) -> Any:
    """Enum members as their strings, inside dicts too (MindSpore's getters return strings)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def reset_auto_parallel_context() -> None:
    """Put every key of the parallel context back to its default (MindSpore's ``reset_auto_parallel_context``).

    The defaults: stand_alone, every device, recursive_programming, data_parallel dataset, no pipeline, no
    parallel optimizer, 64 MB automatic fusion buckets.

    >>> import mshard as ms
    >>> ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    >>> ms.reset_auto_parallel_context()
    >>> ms.get_auto_parallel_context("parallel_mode"), ms.get_auto_parallel_context("device_num")
    ('stand_alone', 8)
    """
    global _current
    _current = ParallelContext()
    _touch()


@contextlib.contextmanager
def parallel_context(**kwargs: Any) -> Iterator[ParallelContext]:
    """Scoped ``set_auto_parallel_context``: the previous context comes back on exit, also on error.

    Not in MindSpore (2.5's ``AutoParallel`` wrapper owns a context the same way).

    Args:
        **kwargs: the keys to set inside the block, as for :func:`set_auto_parallel_context`.

    Returns:
        A context manager; ``with parallel_context(...) as ctx`` gives the new :class:`ParallelContext`.

    >>> import mshard as ms
    >>> with ms.parallel_context(parallel_mode="auto_parallel", device_num=8) as ctx:
    ...     ctx.parallel_mode
    <ParallelMode.AUTO_PARALLEL: 'auto_parallel'>
    """
    global _current
    saved = _current
    _current = _with(saved, **kwargs)
    _touch()
    try:
        yield _current
    finally:
        _current = saved
        _touch()


# -- algorithm parameters and cost model context ----------------------------------------------
@dataclass(frozen=True)
class AlgoParameters:
    """The ``set_algo_parameters`` keys (MindSpore names): one immutable value, what ``get_algo_parameters()`` returns.

    Args:
        fully_use_devices: whether the searchers keep only strategies that use every device for the ops a user
            output depends on (default True).
        elementwise_op_strategy_follow: whether an elementwise op takes its consumer's strategy (default False).
        tensor_slice_align_enable: accepted for MindSpore scripts; mshard's searchers do not use it.
        tensor_slice_align_size: accepted for MindSpore scripts (a positive int); not used.

    >>> AlgoParameters().fully_use_devices, AlgoParameters(fully_use_devices=False).fully_use_devices
    (True, False)
    """

    fully_use_devices: bool = True
    elementwise_op_strategy_follow: bool = False
    tensor_slice_align_enable: bool = False
    tensor_slice_align_size: int = 16


@dataclass(frozen=True)
class CostModelContext:
    """The ``set_cost_model_context`` keys: one immutable value, what ``get_cost_model_context()`` returns.

    The searchers minimise alpha*compute + beta*communication + gamma*memory.

    Args:
        device_memory_capacity: bytes per device a plan may use (default 16 GiB).
        costmodel_alpha: the weight of compute time.
        costmodel_beta: the weight of communication.
        costmodel_gamma: the weight of memory.
        costmodel_state_weight: what a byte of parameter or optimizer state stored per device costs, in bytes moved
            over the slowest link (default 0.1; 0: storage is only in the gamma term). Not in MindSpore: it keeps a
            cost-model search from replicating a large weight to save a small collective.
        axis_bandwidth: bytes/s per mesh axis, one per axis of the region mesh; None: uniform.

    >>> CostModelContext().costmodel_beta, CostModelContext(costmodel_beta=100.0).costmodel_beta
    (400.0, 100.0)
    """

    device_memory_capacity: float = 16 * 2**30
    costmodel_alpha: float = 1.0
    costmodel_beta: float = 400.0
    costmodel_gamma: float = 0.001
    costmodel_state_weight: float = 0.1
    axis_bandwidth: tuple[float, ...] | None = None


_algo = AlgoParameters()
_cost = CostModelContext()


def _replace_checked(value, fname: str, kwargs: dict):
    names = {f.name: f for f in dataclasses.fields(value)}
    out = {}
    for k, v in kwargs.items():
        if k not in names:
            raise ContextError(f"{fname}: unknown key {k!r}.{did_you_mean(k, names)} Valid keys are {', '.join(names)}.")
        default = getattr(type(value)(), k)
        if isinstance(default, bool):
            if not isinstance(v, bool):
                raise ContextTypeError(f"{fname}: {k} must be True or False, got {v!r}.")
        elif k == "axis_bandwidth":
            if v is not None:
                if not isinstance(v, (list, tuple)) or not all(
                        isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 for b in v):
                    raise ContextError(f"{fname}: axis_bandwidth must be None or a list of positive bytes/s, "
                                       f"one per mesh axis, got {v!r}.")
                v = tuple(float(b) for b in v)
        else:
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ContextTypeError(f"{fname}: {k} must be a number, got {v!r}.")
            if v < 0 or (k in ("device_memory_capacity", "tensor_slice_align_size") and v <= 0):
                raise ContextError(f"{fname}: {k}={v} must be positive.")
            v = type(default)(v)
        out[k] = v
    return dataclasses.replace(value, **out)


def set_algo_parameters(**kwargs: Any) -> None:
    """Set the searchers' algorithm parameters (MindSpore's ``set_algo_parameters``).

    Each key is validated now (an unknown key or a wrong type raises :class:`~mshard.errors.ContextError`).

    Args:
        **kwargs: the keys to set, fields of :class:`AlgoParameters`: ``fully_use_devices``,
            ``elementwise_op_strategy_follow``, ``tensor_slice_align_enable``, ``tensor_slice_align_size``.

    >>> import mshard as ms
    >>> ms.set_algo_parameters(fully_use_devices=False)
    >>> ms.get_algo_parameters("fully_use_devices")
    False
    >>> ms.reset_algo_parameters()
    """
    global _algo
    _algo = _replace_checked(_algo, "set_algo_parameters", kwargs)
    _touch()


def set_op_strategy_config(mode: str = "SAVE", path: str = "") -> None:
    """Save the strategies a search gives every op to a JSON file, or load them (MindSpore's
    ``mindspore.parallel.set_op_strategy_config``).

    ``mode="SAVE"`` makes the next plan write every op's strategy, the propagated ones included, to ``path``;
    ``mode="LOAD"`` gives the ops of later plans the strategies in ``path``, so a net with no ``shard`` call
    plans as the saved one did. It is ``strategy_ckpt_config`` with one of its two files set (the other
    cleared), in mshard's strategy-file format (:func:`mshard.load_plan` reads it).

    Args:
        mode: ``"SAVE"`` or ``"LOAD"``.
        path: an absolute path ending in ``.json``.

    Raises:
        ContextError: another mode, a relative path, or a path that does not end in ``.json`` (MindSpore
            raises ``KeyError`` for these; mshard's errors are ``ValueError`` subclasses).

    >>> import mshard as ms
    >>> ms.set_op_strategy_config(mode="SAVE", path="/tmp/mshard_doc/strategy.json")
    >>> ms.get_auto_parallel_context("strategy_ckpt_config")["save_file"]
    '/tmp/mshard_doc/strategy.json'
    >>> ms.reset_auto_parallel_context()
    """
    if mode not in ("SAVE", "LOAD"):
        raise ContextError(f"set_op_strategy_config: mode={mode!r}; use 'SAVE' or 'LOAD'.")
    if not isinstance(path, str) or not os.path.isabs(path) or not path.endswith(".json"):
        raise ContextError(f"set_op_strategy_config: path={path!r}; give an absolute path ending in .json, "
                           f"e.g. '/tmp/strategy.json'.")
    save, load = (path, "") if mode == "SAVE" else ("", path)
    set_auto_parallel_context(strategy_ckpt_config={"save_file": save, "load_file": load})


def _get(value, fname: str, key: str | None) -> Any:
    if key is None:
        return value
    if not hasattr(value, key):
        fields = [f.name for f in dataclasses.fields(value)]
        raise ContextError(f"{fname}: unknown key {key!r}.{did_you_mean(key, fields)} Valid keys are "
                           f"{', '.join(fields)}.")
    return getattr(value, key)


def get_algo_parameters(key: str | None = None) -> Any:
    """The searchers' algorithm parameters (MindSpore's ``get_algo_parameters``).

    Args:
        key: a field of :class:`AlgoParameters`; None: all of them.

    Returns:
        The key's value, or the whole :class:`AlgoParameters` when ``key`` is None.

    >>> import mshard as ms
    >>> ms.get_algo_parameters("fully_use_devices"), ms.get_algo_parameters().tensor_slice_align_size
    (True, 16)
    """
    return _get(_algo, "get_algo_parameters", key)


def reset_algo_parameters() -> None:
    """Put every algorithm parameter back to its default (MindSpore's ``reset_algo_parameters``).

    >>> import mshard as ms
    >>> ms.set_algo_parameters(elementwise_op_strategy_follow=True)
    >>> ms.reset_algo_parameters()
    >>> ms.get_algo_parameters("elementwise_op_strategy_follow")
    False
    """
    global _algo
    _algo = AlgoParameters()
    _touch()


def set_cost_model_context(**kwargs: Any) -> None:
    """Set the searchers' cost weights and machine (MindSpore's ``set_cost_model_context``).

    A plan's cost is alpha*compute + beta*communication + gamma*memory. Each key is validated now.

    Args:
        **kwargs: the keys to set, fields of :class:`CostModelContext`: ``device_memory_capacity``,
            ``costmodel_alpha``, ``costmodel_beta``, ``costmodel_gamma``, ``costmodel_state_weight``, ``axis_bandwidth``.

    >>> import mshard as ms
    >>> ms.set_cost_model_context(costmodel_beta=100.0)
    >>> ms.get_cost_model_context("costmodel_beta")
    100.0
    >>> ms.reset_cost_model_context()
    """
    global _cost
    _cost = _replace_checked(_cost, "set_cost_model_context", kwargs)
    _touch()


def get_cost_model_context(key: str | None = None) -> Any:
    """The searchers' cost weights and machine (MindSpore's ``get_cost_model_context``).

    Args:
        key: a field of :class:`CostModelContext`; None: all of them.

    Returns:
        The key's value, or the whole :class:`CostModelContext` when ``key`` is None.

    >>> import mshard as ms
    >>> ms.get_cost_model_context("costmodel_beta"), ms.get_cost_model_context().axis_bandwidth
    (400.0, None)
    """
    return _get(_cost, "get_cost_model_context", key)


def reset_cost_model_context() -> None:
    """Put every cost-model key back to its default (MindSpore's ``reset_cost_model_context``).

    >>> import mshard as ms
    >>> ms.set_cost_model_context(axis_bandwidth=[1e9, 1e11])
    >>> ms.reset_cost_model_context()
    >>> ms.get_cost_model_context("axis_bandwidth") is None
    True
    """
    global _cost
    _cost = CostModelContext()
    _touch()
