"""Random small programs for the differential fuzzer (tests/test_fuzz.py, bench/fuzz.py).

A *case* is plain data (JSON-able, so a failure replays as a standalone script): a batch and a width, a chain
of steps over primitive objects of ``mshard.ops`` with random strategies (valid ones drawn from each primitive's
own iteration space, or deliberately invalid ones), a parallel mode and a search mode, and a dataset strategy.
:func:`run_case` runs it through ``ms.jit`` (forward, and the gradient w.r.t. the input and every ``nnx.Param``)
and compares with the same Cell called outside any region, on one device. Tolerances are derived from float32:
each step's result sums at most ``n`` products, so a partitioned run that reorders those sums differs by at most
about ``n * 2**-24`` relative per step; the chain compounds that over its steps (see :func:`tolerance`).
"""

from __future__ import annotations

import math
import random
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mshard as ms
from mshard import nn, ops
from mshard.errors import MshardError

KINDS = ("relu", "tanh", "gelu", "square", "sigmoid", "add_param", "mul_param", "bias", "matmul", "softmax",
         "transpose", "reduce_sum", "reshape", "batch_matmul")
MODES = (("semi_auto_parallel", None), ("auto_parallel", "sharding_propagation"),
         ("auto_parallel", "recursive_programming"), ("auto_parallel", "dynamic_programming"),
         ("data_parallel", None))
SPLITS = (1, 2, 4, 8)


def _prim(kind: str):
    return {"relu": ops.ReLU, "tanh": ops.Tanh, "gelu": ops.GeLU, "square": ops.Square, "sigmoid": ops.Sigmoid,
            "add_param": ops.Add, "mul_param": ops.Mul, "bias": ops.BiasAdd, "matmul": ops.MatMul,
            "softmax": ops.Softmax, "transpose": ops.Transpose, "reduce_sum": lambda: ops.ReduceSum(keep_dims=True),
            "reshape": ops.Reshape, "batch_matmul": ops.BatchMatMul}[kind]()


def _operands(kind: str, shape: tuple[int, ...], width: int) -> tuple[list[tuple[int, ...]], tuple, tuple[int, ...]]:
    """(operand shapes: the activation first, then parameters; attrs; result shape)."""
    if kind in ("add_param", "mul_param"):
        return [shape, shape], (), shape
    if kind == "bias":
        return [shape, shape[-1:]], (), shape
    if kind == "matmul":
        return [shape, (shape[-1], width)], (), shape[:-1] + (width,)
    if kind == "batch_matmul":
        return [shape, (shape[0], shape[-1], width)], (), shape[:-1] + (width,)
    if kind == "transpose":
        perm = tuple(reversed(range(len(shape))))
        return [shape], (perm,), tuple(shape[p] for p in perm)
    if kind == "reduce_sum":
        return [shape], ((len(shape) - 1,),), shape[:-1] + (1,)
    if kind == "reshape":
        new = (shape[0] * 2, shape[1] // 2) + tuple(shape[2:]) if shape[1] % 2 == 0 else shape
        return [shape], (new,), new
    return [shape], (), shape


def _valid(kind: str, shapes, attrs, rnd: random.Random, devices: int = 8):
    """A strategy drawn from the primitive's iteration space: one split count per loop letter (fixed letters 1),
    dividing every tensor dim it splits, the letters' product dividing ``devices``."""
    in_dims, _, fixed = _prim(kind).spec(shapes, attrs)
    sizes: dict[str, int] = {}
    for dims, shape in zip(in_dims, shapes):
        for d, n in zip(dims, shape):
            if d is not None:
                sizes[d] = math.gcd(sizes.get(d, n), n)
    counts, left = {}, devices
    for letter in sorted(sizes, key=lambda _: rnd.random()):
        options = [c for c in SPLITS if left % c == 0 and sizes[letter] % c == 0 and (c == 1 or letter not in fixed)]
        counts[letter] = rnd.choice(options)
        left //= counts[letter]
    return tuple(tuple(counts.get(d, 1) if d is not None else 1 for d in dims) for dims in in_dims)


def _invalid(kind: str, shapes, attrs, rnd: random.Random):
    """A strategy the primitive must refuse: more splits than devices, a split not dividing its dim, or (for an
    op whose operands share a loop dim) operands that split the shared dim differently."""
    st = [list(s) for s in _valid(kind, shapes, attrs, rnd)]
    how = rnd.choice(["too_many", "not_dividing", "disagree"])
    if how == "disagree" and len(st) > 1 and len(st[1]) and st[0][-1] in (1, 2):
        st[1][0 if kind in ("matmul", "bias") else -1] = 4 if st[0][-1] != 4 else 2
        if kind in ("matmul",) or kind == "bias" or kind.endswith("_param"):
            return tuple(tuple(s) for s in st), how
    if how == "not_dividing" and shapes[0][-1] % 16:
        st[0][-1] = 16
        return tuple(tuple(s) for s in st), how
    st[0] = [16] + st[0][1:]
    return tuple(tuple(s) for s in st), "too_many"


def make_case(seed: int, invalid: bool = False) -> dict[str, Any]:
    rnd = random.Random(seed)
    mode, search = MODES[rnd.randrange(len(MODES))]
    batch, width = rnd.choice([8, 16]), rnd.choice([8, 16, 32])
    dataset = rnd.choice(["data_parallel", "full_batch"]) if batch % 8 == 0 else "full_batch"
    three_d = rnd.random() < 0.25
    shape: tuple[int, ...] = (batch, 4, width) if three_d else (batch, width)
    steps = []
    bad_at = rnd.randrange(4) if invalid else -1
    for i in range(rnd.randint(1, 4)):
        pool = [k for k in KINDS if (k != "batch_matmul" or len(shape) == 3) and
                (k not in ("reshape", "matmul") or len(shape) == 2)]
        kind = rnd.choice(pool)
        shapes, attrs, out = _operands(kind, shape, rnd.choice([8, 16, 32]))
        strategy, how = None, None
        if i == bad_at:
            strategy, how = _invalid(kind, shapes, attrs, rnd)
        elif rnd.random() < 0.7:
            strategy = _valid(kind, shapes, attrs, rnd)
        steps.append({"kind": kind, "shapes": shapes, "attrs": attrs, "strategy": strategy, "invalid": how})
        shape = out
    return {"seed": seed, "mode": mode, "search_mode": search, "dataset": dataset, "input": (batch, 4, width)
            if three_d else (batch, width), "steps": steps, "invalid": invalid and bad_at < len(steps)}


class Program(nn.Cell):
    def __init__(self, case: dict[str, Any]):
        rng = np.random.default_rng(case["seed"])
        self.prims = []
        self.params = nnx.List() if hasattr(nnx, "List") else []
        for step in case["steps"]:
            p = _prim(step["kind"])
            if step["strategy"] is not None:
                p = p.shard(step["strategy"])
            self.prims.append(p)
            for shp in step["shapes"][1:]:
                fan = shp[-2] if len(shp) >= 2 else 1
                self.params.append(nnx.Param(jnp.asarray(rng.standard_normal(shp) / math.sqrt(fan), jnp.float32)))
        self.prims = tuple(self.prims)
        self.steps = tuple((len(st["shapes"]) - 1, tuple(_frozen(a) for a in st["attrs"])) for st in case["steps"])

    def __call__(self, x):
        k = 0
        h = x
        for p, (n, attrs) in zip(self.prims, self.steps):
            args = [h] + [self.params[k + j][...] for j in range(n)] + list(attrs)
            k += n
            h = p(*args)
        return h


def _frozen(a):
    return tuple(_frozen(x) for x in a) if isinstance(a, (list, tuple)) else a


def tolerance(case: dict[str, Any]) -> float:
    """rtol = atol for the comparison: per step, a sum of at most n float32 products reordered by the partitioning
    is off by <= n * 2**-24 relative (n: the step's longest reduction, softmax and sums included); the steps
    compound; the gradient doubles the chain; x8 covers magnitudes growing through the chain (O(1) by the 1/sqrt(fan)
    parameter scale)."""
    n = 1
    for s in case["steps"]:
        n = max(n, s["shapes"][0][-1])
    return 8 * 2 * len(case["steps"]) * n * 2.0 ** -24 + 1e-6


def run_case(case: dict[str, Any]) -> str | None:
    """None if the case holds; else a one-line description of the failure."""
    ms.reset_auto_parallel_context()
    kw = {"parallel_mode": case["mode"], "device_num": 8, "dataset_strategy": case["dataset"]}
    if case["search_mode"]:
        kw["search_mode"] = case["search_mode"]
    ms.set_auto_parallel_context(**kw)
    x = jnp.asarray(np.random.default_rng(case["seed"] + 1).standard_normal(case["input"]), jnp.float32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net = Program(case)
            y = ms.jit(lambda m, x: m(x))(net, x)
            out_w = jnp.asarray(np.random.default_rng(case["seed"] + 2).standard_normal(y.shape), jnp.float32)

            def loss(m, x):
                return jnp.sum(m(x) * out_w)
            gm, gx = ms.jit(lambda m, x: nnx.grad(loss, argnums=(0, 1))(m, x))(net, x)
    except MshardError as e:
        return None if case["invalid"] else f"valid case refused: {type(e).__name__}: {e}"
    except Exception as e:   # noqa: BLE001 - every other exception is a finding
        return f"{type(e).__module__}.{type(e).__name__}: {str(e)[:300]}"
    if case["invalid"]:
        return "invalid strategy accepted: " + repr([s["strategy"] for s in case["steps"] if s["invalid"]])
    ref = Program(case)
    y0 = ref(x)
    gm0, gx0 = nnx.grad(loss, argnums=(0, 1))(ref, x)
    tol = tolerance(case)
    pairs = [("output", y, y0), ("grad x", gx, gx0)] + [
        (f"grad param {i}", a, b) for i, (a, b) in enumerate(zip(jax.tree.leaves(gm), jax.tree.leaves(gm0)))]
    for what, a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or not np.allclose(a, b, rtol=tol, atol=tol):
            err = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("nan")
            return f"{what} differs from one device: max |diff| {err:.3g} (tol {tol:.2g})"
    return None


def script(case: dict[str, Any], finding: str) -> str:
    """A standalone script that replays a case."""
    return (f"# mshard differential fuzzer finding: {finding}\n"
            "import os, sys\n"
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
            "sys.path[:0] = ['.']; sys.path.append('tests')\n"
            "from fuzz_programs import run_case\n"
            f"case = {case!r}\n"
            "print(run_case(case) or 'ok: equals one device')\n")
