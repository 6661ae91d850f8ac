"""A training step that fits ``device_memory_capacity``: the step's predicted bytes per device, and the optimizer
level a cost-model search raises it to when the plan does not fit.

The prediction (:class:`StepMemory`) is the cost model's: the searched step's peak over program order
(``Plan.peak_bytes``, :mod:`searchers.memory`: every live value in its planned layout, the parameters, the
optimizer state, the gradients and the activations the backward reads included), beside the exact stored bytes of
the parameters and of the optimizer state under the step's layouts (its ZeRO layouts where optimizer parallel
shards them).

The fit (:func:`choose_level`): with a cost-model searcher (one registered with ``cost_model=True``:
recursive_programming, dynamic_programming, ilp) and ``enable_parallel_optimizer`` not set by the user, a step
whose prediction exceeds ``device_memory_capacity`` gets the lowest optimizer level (level1, level2, level3) whose
prediction fits, as a MindSpore user would switch optimizer parallel on by hand. Where none fits, the step keeps the
level that needs least and the plan says so. A user's own ``enable_parallel_optimizer`` is kept; the plan notes
when it does not fit.

>>> m = StepMemory(params=4e9, opt_state=8e9, peak=18e9)
>>> m.total / 2**30 > 16, m.describe()
(True, '16.76 GiB per device (stored: params 3.73 GiB, optimizer state 7.45 GiB)')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

LEVELS = ("level1", "level2", "level3")


@dataclass(frozen=True)
class StepMemory:
    """Predicted bytes per device of a training step (module doc)."""

    params: float          # the parameters as stored
    opt_state: float       # the optimizer state as stored
    peak: float            # the cost model's peak of the whole step

    @property
    def total(self) -> float:
        return max(self.peak, self.params + self.opt_state)

    def describe(self) -> str:
        return (f"{size(self.total)} per device (stored: params {size(self.params)}, optimizer state "
                f"{size(self.opt_state)})")


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1 (``16.00 GiB``, ``3.01 MiB``)."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def choose_level(ctx: Any, capacity: float, plan_with: Callable[[Any], Any],
                 measure: Callable[[Any], StepMemory]) -> tuple[Any, list[str]]:
    """The step plan that fits ``capacity`` (module doc) and the notes that say what was chosen. ``plan_with(ctx)``
    plans the step under a context; ``measure(plan)`` predicts it."""
    plan = plan_with(ctx)
    mem = measure(plan)
    if mem.total <= capacity:
        return plan, []
    if ctx.enable_parallel_optimizer:
        level = ctx.parallel_optimizer_config.get("optimizer_level", "level1")
        return plan, [f"memory: the step needs {mem.describe()} under the optimizer level you set ({level}), over "
                      f"device_memory_capacity {size(capacity)}; a higher optimizer_level, more devices or "
                      f"recompute() would lower it"]
    tried = [("no optimizer parallel", mem, plan)]
    for level in LEVELS:
        cfg = dict(ctx.parallel_optimizer_config, optimizer_level=level)
        trial = plan_with(dataclasses.replace(ctx, enable_parallel_optimizer=True, parallel_optimizer_config=cfg))
        m = measure(trial)
        tried.append((f"optimizer level {level}", m, trial))
        if m.total <= capacity:
            return trial, [f"memory: the step without optimizer parallel does not fit device_memory_capacity "
                           f"{size(capacity)} ({mem.describe()}); optimizer parallel {level} chosen: {m.describe()}"]
    name, m, best = min(tried, key=lambda t: t[1].total)
    return best, [f"memory: no optimizer level fits device_memory_capacity {size(capacity)}; {name} needs "
                  f"least: {m.describe()}. Use more devices, recompute() or offload"]
