"""Dry run (msrun's simulation level): plan and compile the first jitted region for many devices, run nothing.

``mshard run --dry_run --worker_num=N train.py`` starts ``train.py`` in one process with N simulated CPU devices
and ``MSHARD_DRY_RUN=1``; ``with ms.dry_run(): ...`` does the same inside a process that already has the
devices. The first region the script calls (``ms.jit``, a sharded Cell, a ``TrainOneStepCell`` step) is traced,
planned and compiled from the arguments' shapes alone (parameters are not placed, data is not moved), its plan
summary, collectives and compiled per-device memory are printed, and :class:`DryRunComplete` ends the script
(exit code 0; the ``with`` block swallows it and keeps the report).

>>> import jax.numpy as jnp, mshard as ms
>>> ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
>>> with ms.dry_run(quiet=True) as dr:
...     ms.jit(lambda x: x * 2)(jnp.ones((8, 4)))
...     print("not reached")
>>> dr.report["devices"], sorted(dr.report["memory"])[:2]
(8, ['alias_bytes', 'argument_bytes'])
>>> ms.reset_auto_parallel_context()
"""

from __future__ import annotations

import contextlib
import os
import sys

import jax

from mshard._src.values.errors import ContextError
from mshard._src.values.hlo import CommReport

__all__ = ["DryRunComplete", "active", "dry_run"]

_SCOPES: list = []


class DryRunComplete(SystemExit):
    """Raised after the first compiled region of a dry run (exit code 0)."""

    def __init__(self, report: dict):
        super().__init__(0)
        self.report = report


def active() -> bool:
    return bool(_SCOPES) or os.environ.get("MSHARD_DRY_RUN", "") not in ("", "0")


class _Scope:
    report: dict | None = None


@contextlib.contextmanager
def dry_run(quiet: bool = False):
    """Dry run (msrun's simulation level) inside a process: the first region call in the block is planned and
    compiled for the current devices from its arguments' shapes, nothing runs, and the block ends there.

    The report (plan summary, collectives, compiled per-device memory) is printed unless ``quiet``.
    ``mshard run --dry_run --worker_num=N train.py`` does the same for a whole script on N simulated devices.

    Args:
        quiet: whether to skip printing the report (it is kept in ``dr.report`` either way).

    Returns:
        A context manager; ``with ms.dry_run() as dr`` gives the scope, whose ``report`` is a dict (``region``,
        ``devices``, ``memory``, ``collectives``, ``summary``) after the block, None if no region was called.

    >>> import jax.numpy as jnp, mshard as ms
    >>> with ms.parallel_context(parallel_mode="data_parallel", device_num=8), ms.dry_run(quiet=True) as dr:
    ...     ms.jit(lambda x: x.sum())(jnp.ones((8, 4)))
    ...     print("not reached")
    >>> dr.report["devices"], dr.report["collectives"]["total_count"]
    (8, 1)
    """
    scope = _Scope()
    scope.quiet = quiet
    _SCOPES.append(scope)
    try:
        yield scope
    except DryRunComplete as e:
        scope.report = e.report
    finally:
        _SCOPES.remove(scope)


def stop_after(region, comp, args: tuple, flat: list) -> None:
    """Compile ``comp`` for abstract arguments laid out as planned, print the report, raise DryRunComplete."""
    abstract = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for x, sh in zip(flat, comp.in_shardings)]
    try:
        compiled = comp.jitted.lower(*abstract).compile()
    except jax.errors.JaxRuntimeError as e:
        if "Multiprocess computations aren't implemented" not in str(e):
            raise
        raise ContextError(f"dry run: XLA's CPU backend cannot compile a program for {jax.device_count()} simulated "
                           f"devices (it stops at 2048 with JAX 0.10 here: {e}). Dry-run at most 2048 devices, e.g. "
                           f"--worker_num=256 --sim_devices_per_worker=8.") from e
    mem = compiled.memory_analysis()
    memory = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "temp", "alias",
                                                                           "generated_code")}
    memory = {f"{k}_bytes": v for k, v in memory.items()}
    comm = CommReport.from_hlo(compiled.as_text())
    try:
        summary = str(region.plan(*args).summary(max_rows=20))
    except Exception as e:
        summary = f"(no plan summary: {e})"
    report = {"region": region.name, "devices": len(comp.in_shardings[0].device_set) if comp.in_shardings
              else jax.device_count(), "memory": memory, "collectives": comm.as_dict(), "summary": summary}
    quiet = bool(_SCOPES) and getattr(_SCOPES[-1], "quiet", False)
    if not quiet:
        out = sys.stdout
        out.write(f"mshard dry run: region {region.name!r} on {report['devices']} devices (compiled, not run)\n")
        out.write(summary + "\n")
        out.write(str(comm) + "\n")
        out.write("per-device memory: " + ", ".join(f"{k} {v:,} B" for k, v in memory.items()) + "\n")
        out.flush()
    raise DryRunComplete(report)
