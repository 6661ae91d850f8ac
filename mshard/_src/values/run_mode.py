"""MindSpore's ``set_context`` / ``get_context``: the execution mode and device target of a script.

mshard runs what JAX runs. In both modes training steps, ``ms.jit`` regions and sharded Cells compile one XLA
program. The mode decides how a user's Cell without a strategy runs when called outside a jitted region:
``PYNATIVE_MODE`` (MindSpore 2's default, and mshard's) runs it op by op (JAX's eager mode); ``GRAPH_MODE`` compiles
the call into one region, planned under the parallel context, as MindSpore's static graph does
(:func:`mshard._src.frontend.cell.graph_region`). mshard's own layers (``nn.Dense``, ...) called directly run op by
op in either mode. ``device_target`` names the backend a user
expects; JAX picks the backend itself, and a target with no device of that kind fails early.
"""

from __future__ import annotations

from typing import Any

import jax

from mshard._src.values.context import did_you_mean
from mshard._src.values.errors import ContextError, ContextTypeError

GRAPH_MODE = 0
PYNATIVE_MODE = 1

_TARGETS = {"CPU": "cpu", "GPU": "gpu", "Ascend": None}
# keys MindSpore's set_context takes that have no meaning on XLA: accepted, recorded, no effect
_ACCEPTED = ("device_id", "max_device_memory", "save_graphs", "save_graphs_path", "jit_config", "jit_level",
             "enable_graph_kernel", "graph_kernel_flags", "memory_optimize_level", "max_call_depth", "runtime_num_threads",
             "deterministic", "pynative_synchronize", "enable_compile_cache", "compile_cache_path", "inter_op_parallel_num",
             "print_file_path", "env_config_path", "precompile_only", "ascend_config", "gpu_config", "mempool_block_size",
             "op_timeout", "aoe_tune_mode", "check_bprop", "enable_reduce_precision", "variable_memory_max_size")
_context: dict[str, Any] = {"mode": PYNATIVE_MODE, "device_target": "CPU"}


def graph_mode() -> bool:
    """Whether ``set_context(mode=GRAPH_MODE)`` is in force (a user's Cell called eagerly is compiled)."""
    return _context["mode"] == GRAPH_MODE


def set_context(**kwargs: Any) -> None:
    """Set MindSpore's execution context keys (``mode``, ``device_target``, and MindSpore's other keys).

    ``mode`` is ``ms.GRAPH_MODE`` or ``ms.PYNATIVE_MODE`` (``GRAPH_MODE``: a user's Cell called eagerly is compiled, module doc).
    ``device_target`` ``"CPU"`` / ``"GPU"`` must have such a device (``"Ascend"`` is refused: XLA has no Ascend
    backend here). MindSpore's tuning keys (``max_device_memory``, ``jit_config``, ``save_graphs``, ...) are accepted
    and have no effect on XLA. An unknown key raises ``ContextError`` with the nearest name.

    Args:
        **kwargs: the keys to set.

    >>> import mshard as ms
    >>> ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", max_device_memory="8GB")
    >>> ms.get_context("mode") == ms.GRAPH_MODE
    True
    """
    for key, value in kwargs.items():
        if key == "mode":
            if value not in (GRAPH_MODE, PYNATIVE_MODE) or isinstance(value, bool):
                raise ContextError(f"set_context: mode must be ms.GRAPH_MODE (0) or ms.PYNATIVE_MODE (1), got {value!r}.")
        elif key == "device_target":
            if not isinstance(value, str):
                raise ContextTypeError(f"set_context: device_target must be a string, got {type(value).__name__}.")
            if value not in _TARGETS:
                raise ContextError(f"set_context: unknown device_target {value!r}.{did_you_mean(value, _TARGETS)} "
                                   f"Expected one of 'CPU', 'GPU'.")
            platform = _TARGETS[value]
            if platform is None:
                raise ContextError("set_context: device_target='Ascend' has no XLA backend here; use 'CPU' or 'GPU' "
                                   "(or leave it out: JAX picks its default backend).")
            if platform != "cpu" and not _has(platform):
                raise ContextError(f"set_context: device_target={value!r} but JAX sees no {platform} device; leave "
                                   f"device_target out or set it to 'CPU'.")
        elif key not in _ACCEPTED:
            raise ContextError(f"set_context: unknown key {key!r}.{did_you_mean(key, ('mode', 'device_target') + _ACCEPTED)}")
    _context.update(kwargs)


def get_context(key: str) -> Any:
    """The value of one ``set_context`` key (MindSpore's ``get_context``).

    Args:
        key: the key, e.g. ``"mode"``.

    Returns:
        Its value (``mode`` defaults to ``PYNATIVE_MODE``, ``device_target`` to ``"CPU"``, the others to None).

    >>> import mshard as ms
    >>> ms.get_context("device_target")
    'CPU'
    """
    if key not in ("mode", "device_target") + _ACCEPTED:
        raise ContextError(f"get_context: unknown key {key!r}.{did_you_mean(key, ('mode', 'device_target') + _ACCEPTED)}")
    return _context.get(key)


def _has(platform: str) -> bool:
    try:
        return bool(jax.devices(platform))
    except RuntimeError:
        return False


def set_memory(init_size: str = "2GB", increase_size: str = "2GB", max_size: str = "1024GB",
               optimize_level: str = "O0", huge_page_reserve_size: str = "0GB") -> None:
    """MindSpore's ``runtime.set_memory``: accepted, recorded, and without effect. XLA sizes its own memory pool;
    on a GPU set ``XLA_PYTHON_CLIENT_MEM_FRACTION`` before JAX starts instead.

    Args:
        init_size: MindSpore's initial pool size.
        increase_size: MindSpore's pool growth step.
        max_size: MindSpore's pool limit.
        optimize_level: MindSpore's memory optimisation level.
        huge_page_reserve_size: MindSpore's huge page reserve.

    >>> from mshard import runtime
    >>> runtime.set_memory(max_size="16GB")
    """
    _context["memory"] = dict(init_size=init_size, increase_size=increase_size, max_size=max_size,
                              optimize_level=optimize_level, huge_page_reserve_size=huge_page_reserve_size)
