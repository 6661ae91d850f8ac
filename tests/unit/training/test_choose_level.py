"""memory_fit.choose_level: the lowest optimizer level whose predicted step fits device_memory_capacity."""

import dataclasses

from mshard._src.training.memory_fit import StepMemory, choose_level
from mshard._src.values import context as ctxmod

GIB = 2.0 ** 30


def _fit(ctx, capacity, by_level):
    """plan_with returns the level it was planned under; measure looks its memory up in ``by_level``."""
    seen = []

    def plan_with(c):
        level = c.parallel_optimizer_config.get("optimizer_level") if c.enable_parallel_optimizer else None
        seen.append(level)
        return level

    return choose_level(ctx, capacity, plan_with, lambda level: by_level[level]), seen


def _mem(total_gib):
    return StepMemory(params=1.0, opt_state=1.0, peak=total_gib * GIB)


def test_a_step_that_fits_is_planned_once_and_unchanged():
    (plan, notes), seen = _fit(ctxmod.ParallelContext(), 16 * GIB, {None: _mem(10)})
    assert plan is None and notes == [] and seen == [None]


def test_the_lowest_level_that_fits_is_chosen_and_said():
    levels = {None: _mem(24), "level1": _mem(15), "level2": _mem(14), "level3": _mem(12)}
    (plan, notes), seen = _fit(ctxmod.ParallelContext(), 16 * GIB, levels)
    assert plan == "level1" and seen == [None, "level1"]
    assert "optimizer parallel level1 chosen" in notes[0] and "24.00 GiB" in notes[0], notes


def test_when_no_level_fits_the_least_is_kept_and_the_note_says_so():
    levels = {None: _mem(40), "level1": _mem(30), "level2": _mem(29), "level3": _mem(20)}
    (plan, notes), seen = _fit(ctxmod.ParallelContext(), 16 * GIB, levels)
    assert plan == "level3" and seen == [None, "level1", "level2", "level3"]
    assert "no optimizer level fits" in notes[0] and "level3 needs least: 20.00 GiB" in notes[0], notes


def test_a_users_own_optimizer_level_is_kept():
    ctx = dataclasses.replace(ctxmod.ParallelContext(), enable_parallel_optimizer=True,
                              parallel_optimizer_config={"optimizer_level": "level1"})
    (plan, notes), seen = _fit(ctx, 16 * GIB, {"level1": _mem(20), "level3": _mem(10)})
    assert plan == "level1" and seen == ["level1"]
    assert "under the optimizer level you set (level1)" in notes[0], notes
