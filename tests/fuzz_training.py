"""Training cases of the differential fuzzer (tests/fuzz_programs.py, ``case["train"]``): the case's program as the
backbone of ``TrainOneStepCell(WithLossCell(cell, loss), optax.sgd(lr))`` (optionally through
``GradAccumulationCell(., 2)``, with the parallel optimizer at threshold 0 KB, with the cell recomputed, and as a pure
data-parallel step whose replicas run the program on their rows), trained 2 steps on 2 batches. After every step each
parameter is compared with the plain SGD step p - lr * g taken from the parameters the step started from, g the
float64 gradient of tests/references.py's chain (never mshard's training code), and the step's reported loss with
the float64 loss there. Plain SGD: a gradient scaled by the replica count, summed instead of averaged over
micro-batches, or reduced over the wrong devices moves the parameters by that much.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from fuzz_programs import (
    C_CHAIN,
    FLOAT32_SLACK,
    FLOOR,
    Program,
    cond_predicate,
    reference_chain,
    refusal,
    set_context,
    tolerances,
    with_float32_error,
)

import mshard as ms
from mshard import nn
from mshard.errors import MshardError


class ProgramCell(nn.Cell):
    """The program as a Cell (what ``.recompute()`` applies to)."""

    def __init__(self, program: Program):
        self.program = program

    def __call__(self, x):
        return self.program(x)


def row_loss(y, label):
    """A batch-mean loss: per batch row, its output values weighed by its label row, averaged over the rows. A slice of
    the batch (a micro-batch, a replica's rows) averages its own rows, so the mean over equal slices is this loss (the
    training cases' programs that may run on slices map row i to row i alone: fuzz_programs.Draw.separable)."""
    return jnp.sum(y.reshape(label.shape[0], -1) * label) / label.shape[0]


def batches(case: dict[str, Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The steps' (input, label) batches, float32; the label has a row of the output's values per batch row."""
    b = case["input"][0]
    out = math.prod(case["steps"][-1]["out"])
    assert out % b == 0, f"output of {out} values for a batch of {b}"
    rng = np.random.default_rng(case["seed"] + 20)
    return [(rng.standard_normal(case["input"]).astype(np.float32), rng.standard_normal((b, out // b)).astype(np.float32))
            for _ in range(case["train"]["steps"])]


def _reference_step(case: dict[str, Any], dtype=np.float64):
    """``(params, x, label) ->`` the float64 (``dtype``: float32 for the one-device float32 chain) loss, output and
    parameter gradients of :func:`row_loss` at ``params`` (one compiled program for every step of the case)."""
    @functools.partial(jax.jit, static_argnums=3)
    def step(p, x, label, pred):
        def loss(p):
            y = reference_chain(case, p, x, (), pred)
            return jnp.sum(y.reshape(label.shape[0], -1) * label) / label.shape[0], y
        return jax.value_and_grad(loss, has_aux=True)(p)

    def run(params, x, label):
        with jax.enable_x64(dtype == np.float64), warnings.catch_warnings():
            # in float32 a reference's float64 cast is float32 (fuzz_programs._case_reference)
            warnings.filterwarnings("ignore", "Explicitly requested dtype float64", UserWarning)
            (value, y), g = step([jnp.asarray(p, dtype) for p in params], jnp.asarray(x, dtype),
                                 jnp.asarray(label, dtype), cond_predicate(x))
            return float(value), np.asarray(y, np.float64), [np.asarray(v, np.float64) for v in g]
    return run


def _forward_runs(case: dict[str, Any]) -> bool:
    """Whether the program's forward alone is accepted (a meeting of user splits is one only if the forward raises it,
    as fuzz_programs.check_case classifies it; the step plans its forward first, then its gradient)."""
    set_context(case)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ms.jit(lambda m, x: m(x))(Program(case), jnp.zeros(case["input"], jnp.float32))
    except MshardError:
        return False
    return True


def check_training(case: dict[str, Any]) -> tuple[str, str]:
    """-> (outcome, detail), as fuzz_programs.check_case's."""
    t = case["train"]
    zero = {"enable_parallel_optimizer": True, "parallel_optimizer_config": {"parallel_optimizer_threshold": 0}}
    set_context(case, gradients_mean=True, **(zero if t["zero"] else {}))
    data = batches(case)
    before, after, losses = [], [], []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net = Program(case)
            cell = ProgramCell(net)
            if t["recompute"]:
                cell.recompute()
            loss_cell = nn.WithLossCell(cell, row_loss)
            if t["accum"]:
                loss_cell = nn.GradAccumulationCell(loss_cell, 2)
            step = nn.TrainOneStepCell(loss_cell, optax.sgd(t["lr"]))
            for x, label in data:
                before.append([np.asarray(p[...]) for p in net.params])
                losses.append(float(step(jnp.asarray(x), jnp.asarray(label))))
                after.append([np.asarray(p[...]) for p in net.params])
    except MshardError as e:
        return refusal(case, e, bool(losses) or _forward_runs(case))
    except Exception as e:   # every other exception is a finding
        return "finding", f"{type(e).__module__}.{type(e).__name__}: {str(e)[:300]}"
    tol = tolerances(case)
    tol_y, tol_g = tol[0], tol[2:]
    lr = t["lr"]
    reference, float32 = _reference_step(case), _reference_step(case, np.float32)
    for k, ((x, label), p0, p1, got) in enumerate(zip(data, before, after, losses, strict=True)):
        value, y, g = reference(p0, x, label)
        value32, _, g32 = float32(p0, x, label)      # the chain's own float32 error (fuzz_programs.FLOAT32_SLACK)
        tol_step = with_float32_error(tol_g, g32, g)
        # the loss, sum_j w_j y_j with w = label / B: each y_j off by tol_y (1 + |y_j|) (fuzz_programs.tolerances),
        # and the float32 sum of its y.size terms adds C_CHAIN * y.size * 2**-24 of sum |w_j y_j|
        w = np.abs(label.reshape(-1)) / label.shape[0]
        yy = np.abs(y.reshape(-1))
        bound = (tol_y * np.sum(w * (1 + yy)) + C_CHAIN * y.size * 2.0 ** -24 * np.sum(w * yy) + FLOOR
                 + FLOAT32_SLACK * abs(value32 - value))
        if not abs(got - value) <= bound:
            return "finding", (f"step {k + 1}: the loss differs from the float64 reference: {got!r}, not {value!r} (|diff| "
                               f"{abs(got - value):.3g} > {bound:.2g})")
        # p1 = p0 - lr * g32 in float32: g32 is off its float64 value by tol_g (1 + |g|) (the gradient's own tolerance
        # in fuzz_programs.tolerances: row_loss weighs the outputs by label / B, so its gradients and their errors are
        # those of check_case's O(1)-weighted sum divided by B), and the update rounds twice (lr * g, then p - that):
        # at most 2**-23 (|p0| + lr |g|). Divided by lr, the bound is a gradient tolerance: the check is
        # |(p0 - p1) / lr - g| <= tol_g (1 + |g|) + 2**-23 (|p0| / lr + |g|)
        names = [f"step {k + 1} param {i}" for i in range(len(g))]
        moved = [(np.asarray(a, np.float64) - b) / lr for a, b in zip(p0, p1, strict=True)]
        slack = [2.0 ** -23 * (np.abs(a) / lr + np.abs(gi)) for a, gi in zip(p0, g, strict=True)]
        bad = _compare_with_slack(names, moved, g, tol_step, slack)
        if bad:
            return "finding", f"SGD step differs from the float64 reference: {bad}"
    return "equal", ""


def _compare_with_slack(names, got, exact, tols, slack) -> str | None:
    """fuzz_programs.compare with an absolute allowance per value (the update's own roundings)."""
    for what, a, t, tol, s in zip(names, got, exact, tols, slack, strict=True):
        if a.shape != t.shape:
            return f"{what} has shape {a.shape}, the reference {t.shape}"
        err = np.abs(a - t)
        ok = err <= tol * (1 + np.abs(t)) + s
        if not np.all(ok):
            return (f"{what}: max |(p0 - p1) / lr - g| {float(np.max(err)):.3g} (tol {tol:.2g}, {int(np.sum(~ok))} of "
                    f"{t.size} values)")
    return None
