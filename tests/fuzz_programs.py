"""Random small programs for the differential fuzzer (tests/test_fuzz.py, bench/fuzz.py).

A *case* is plain data (a dict of tuples and numbers, so a failure replays as a standalone script): an input
shape, a chain of steps over the primitive objects of ``mshard.ops`` (every one but the collectives) with random
strategies (valid ones drawn from each primitive's own iteration space, or deliberately invalid ones), a parallel
mode and search mode, a dataset strategy, and whether the chain runs under ``jax.checkpoint`` and as an ``ms.shard``
function with a strategy for its input. A valid strategy
comes as split counts, ``Layout`` calls or ``PartitionSpec``s, sometimes with an ``out_strategy``.
:func:`run_case` runs it through ``ms.jit`` (forward, and the gradient w.r.t. the input and every ``nnx.Param``)
and compares every value with the same chain evaluated in float64 by the independent references of
tests/references.py (never through mshard's primitives, so a primitive wrong everywhere is found too). Tolerances
are derived from float32, per output, from the reduction lengths along the chain (see :func:`tolerances`).

Each op is one entry of :data:`OPS`: a generator ``(rnd, shape) -> step | None`` (None: the op does not apply to an
activation of that shape) giving the constructor arguments, the tensor operands in call order with their roles
(``x``: the activation; ``param``/``pos_param``: an ``nnx.Param``, positive for divisors and variances;
``int:N``: constant indices below N; ``labels``: a constant one-hot), the attributes and the result shape.
"""

from __future__ import annotations

import functools
import math
import random
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mshard as ms
from mshard import ops
from mshard.errors import MshardError
from references import REFERENCES, gradient_length, reduction_length

MODES = (("semi_auto_parallel", None), ("auto_parallel", "sharding_propagation"),
         ("auto_parallel", "recursive_programming"), ("auto_parallel", "dynamic_programming"),
         ("data_parallel", None))
SPLITS = (1, 2, 4, 8)

Shape = tuple[int, ...]


def _step(ctor: dict, tensors: list[tuple[str, Shape]], attrs: tuple, out: Shape, **extra) -> dict[str, Any]:
    return {"ctor": ctor, "roles": tuple(r for r, _ in tensors), "shapes": tuple(s for _, s in tensors),
            "attrs": attrs, "out": out, **extra}


def _unary(rnd, s):
    return _step({}, [("x", s)], (), s)


def _binary(role="param"):
    return lambda rnd, s: _step({}, [("x", s), (role, s)], (), s)


def _matmul(rnd, s):
    if len(s) != 2:
        return None
    tb = rnd.random() < 0.3
    n = rnd.choice([8, 16, 32])
    return _step({"transpose_b": tb}, [("x", s), ("param", (n, s[1]) if tb else (s[1], n))], (), (s[0], n))


def _batch_matmul(rnd, s):
    if len(s) != 3:
        return None
    n = rnd.choice([8, 16])
    return _step({}, [("x", s), ("param", (s[0], s[2], n))], (), s[:-1] + (n,))


def _reduce(rnd, s):
    return _step({"keep_dims": True}, [("x", s)], ((len(s) - 1,),), s[:-1] + (1,))


def _transpose(rnd, s):
    perm = tuple(reversed(range(len(s)))) if len(s) < 4 else (0, 1, 3, 2)     # NCHW stays N and C first
    return _step({}, [("x", s)], (perm,), tuple(s[p] for p in perm))


def _reshape(rnd, s):
    if len(s) == 2 and s[1] % 2 == 0:
        new = (s[0] * 2, s[1] // 2)
    elif len(s) >= 3:
        new = (s[0], math.prod(s[1:]))                      # flatten
    else:
        return None
    return _step({}, [("x", s)], (new,), new)


def _expand(rnd, s):
    return None if len(s) > 3 else _step({}, [("x", s)], (1,), s[:1] + (1,) + s[1:])


def _squeeze(rnd, s):
    ones = [k for k in range(1, len(s)) if s[k] == 1]
    if not ones or len(s) < 3:
        return None
    k = rnd.choice(ones)
    return _step({"axis": (k,)}, [("x", s)], (), s[:k] + s[k + 1:])


def _concat(rnd, s):
    return _step({"axis": -1}, [("x", s), ("param", s)], (), s[:-1] + (2 * s[-1],))


def _strided_slice(rnd, s):
    k = rnd.choice([d for d in range(1, len(s)) if s[d] >= 4] or [None])
    if k is None:
        return None
    begin, end, strides = [0] * len(s), list(s), [1] * len(s)
    begin[k], strides[k] = rnd.choice([0, 1]), 2
    out = tuple(len(range(begin[d], end[d], strides[d])) for d in range(len(s)))
    return _step({}, [("x", s)], (tuple(begin), tuple(end), tuple(strides)), out)


def _gather(rnd, s):
    if len(s) != 2 or s[0] % 2:
        return None
    return _step({}, [("x", s), (f"int:{s[0]}", (s[0] // 2, 2))], (0,), (s[0] // 2, 2, s[1]))


def _one_hot(rnd, s):
    # h * OneHot(indices, width): the strategy covers the (constant) indices
    return None if len(s) != 2 else _step({}, [(f"int:{s[1]}", (s[0],))], (s[1], 1.0, 0.0), s, post="mul_x")


def _sce(rnd, s):
    return None if len(s) != 2 else _step({}, [("x", s), ("labels", s)], (), s, post="sce")


def _layer_norm(rnd, s):
    return _step({"begin_norm_axis": -1, "begin_params_axis": -1}, [("x", s), ("param", s[-1:]), ("param", s[-1:])],
                 (), s, post="first")


def _batch_norm(rnd, s):
    if len(s) != 4:
        return None
    c = (s[1],)
    return _step({"is_training": rnd.random() < 0.5},
                 [("x", s), ("param", c), ("param", c), ("param", c), ("pos_param", c)], (), s)


def _conv(rnd, s):
    if len(s) != 4:
        return None
    k = rnd.choice([1, 3] if min(s[2:]) >= 3 else [1])
    stride = rnd.choice([1, 1, 2])
    pad = rnd.choice(["same", "valid"])
    o = rnd.choice([4, 8])
    if pad == "same":
        hw = tuple(-(-n // stride) for n in s[2:])
    else:
        hw = tuple((n - k) // stride + 1 for n in s[2:])
    return _step({"out_channel": o, "kernel_size": k, "pad_mode": pad, "stride": stride},
                 [("x", s), ("param", (o, s[1], k, k))], (), (s[0], o) + hw)


def _pool(rnd, s):
    if len(s) != 4:
        return None
    k = 2 if all(n % 2 == 0 for n in s[2:]) and rnd.random() < 0.7 else 1
    st = rnd.choice([k, 1])
    hw = tuple((n - k) // st + 1 for n in s[2:])
    return _step({"kernel_size": k, "strides": st}, [("x", s)], (), s[:2] + hw)


OPS: dict[str, tuple[Callable[[], ops.Primitive], Callable]] = {
    # kind: (the primitive's class, the step generator)
    "ReLU": (ops.ReLU, _unary), "Tanh": (ops.Tanh, _unary), "GeLU": (ops.GeLU, _unary),
    "Sigmoid": (ops.Sigmoid, _unary), "Square": (ops.Square, _unary),
    "Exp": (ops.Exp, lambda r, s: {**_unary(r, s), "pre": "tanh"}),
    "Log": (ops.Log, lambda r, s: {**_unary(r, s), "pre": "pos"}),
    "Sqrt": (ops.Sqrt, lambda r, s: {**_unary(r, s), "pre": "pos"}),
    "Cast": (ops.Cast, lambda r, s: _step({}, [("x", s)], ("float32",), s)),
    "Add": (ops.Add, _binary()), "Sub": (ops.Sub, _binary()), "Mul": (ops.Mul, _binary()),
    "RealDiv": (ops.RealDiv, _binary("pos_param")), "Maximum": (ops.Maximum, _binary()),
    "Minimum": (ops.Minimum, _binary()),
    "BiasAdd": (ops.BiasAdd, lambda r, s: None if len(s) == 4 else _step({}, [("x", s), ("param", s[-1:])], (), s)),
    "MatMul": (ops.MatMul, _matmul), "BatchMatMul": (ops.BatchMatMul, _batch_matmul),
    "ReduceSum": (ops.ReduceSum, _reduce), "ReduceMean": (ops.ReduceMean, _reduce),
    "ReduceMax": (ops.ReduceMax, _reduce),
    "Softmax": (ops.Softmax, _unary), "LogSoftmax": (ops.LogSoftmax, _unary),
    "LayerNorm": (ops.LayerNorm, _layer_norm), "SoftmaxCrossEntropyWithLogits": (ops.SoftmaxCrossEntropyWithLogits, _sce),
    "Transpose": (ops.Transpose, _transpose), "Reshape": (ops.Reshape, _reshape),
    "ExpandDims": (ops.ExpandDims, _expand), "Squeeze": (ops.Squeeze, _squeeze), "Concat": (ops.Concat, _concat),
    "StridedSlice": (ops.StridedSlice, _strided_slice), "Gather": (ops.Gather, _gather),
    "OneHot": (ops.OneHot, _one_hot),
    "Conv2D": (ops.Conv2D, _conv), "MaxPool": (ops.MaxPool, _pool), "AvgPool": (ops.AvgPool, _pool),
    "BatchNorm": (ops.BatchNorm, _batch_norm),
}


def make_prim(step: dict[str, Any]) -> ops.Primitive:
    return OPS[step["kind"]][0](**step["ctor"])


def _out_shapes(prim: ops.Primitive, step: dict[str, Any]) -> tuple[Shape, ...]:
    """The primitive's output shapes (a split must divide the output dims it lands on too: a pool's output)."""
    args = [jax.ShapeDtypeStruct(s, jnp.int32 if r.startswith("int:") else jnp.float32)
            for r, s in zip(step["roles"], step["shapes"], strict=True)]
    attrs = [jnp.float32 if a == "float32" else a for a in step["attrs"]]
    out = jax.eval_shape(lambda *t: prim.compute(*t, *attrs), *args)
    return tuple(tuple(o.shape) for o in jax.tree.leaves(out))


def _valid(step: dict[str, Any], rnd: random.Random, devices: int = 8):
    """A strategy drawn from the primitive's iteration space: one split count per loop letter (fixed letters 1),
    dividing every tensor dim it splits, the letters' product dividing ``devices``."""
    prim = make_prim(step)
    in_dims, out_dims, fixed = prim.spec(step["shapes"], step["attrs"])
    sizes: dict[str, int] = {}
    for dims, shape in zip(in_dims + out_dims, step["shapes"] + _out_shapes(prim, step), strict=True):
        for d, n in zip(dims, shape, strict=True):
            if d is not None:
                sizes[d] = math.gcd(sizes.get(d, n), n)
    counts, left = {}, devices
    for letter in sorted(sizes, key=lambda _: rnd.random()):
        options = [c for c in SPLITS if left % c == 0 and sizes[letter] % c == 0 and (c == 1 or letter not in fixed)]
        counts[letter] = rnd.choice(options)
        left //= counts[letter]
    return tuple(tuple(counts.get(d, 1) if d is not None else 1 for d in dims) for dims in in_dims)


def _split(shape: Shape, rnd: random.Random, devices: int = 8) -> tuple[int, ...]:
    """Random split counts for one tensor: each dividing its dim, the product dividing ``devices``."""
    out, left = [1] * len(shape), devices
    for d in sorted(range(len(shape)), key=lambda _: rnd.random()):
        out[d] = rnd.choice([c for c in SPLITS if left % c == 0 and shape[d] % c == 0])
        left //= out[d]
    return tuple(out)


def _invalid(step: dict[str, Any], rnd: random.Random):
    """A strategy the primitive must refuse: more splits than devices, a split not dividing its dim, a split of a
    dim the op cannot split, or (where operands share a loop dim) operands that split the shared dim differently."""
    st = [list(s) for s in _valid(step, rnd)]
    in_dims, _, fixed = make_prim(step).spec(step["shapes"], step["attrs"])
    how = rnd.choice(["too_many", "not_dividing", "disagree", "fixed"])
    if how == "fixed":
        at = [(t, k) for t, dims in enumerate(in_dims) for k, d in enumerate(dims)
              if d in fixed and step["shapes"][t][k] % 2 == 0]
        if at:
            t, k = rnd.choice(at)
            st[t][k] = 2
            return tuple(tuple(s) for s in st), how
    if how == "disagree":
        shared = [(d, [(t, k) for t, dims in enumerate(in_dims) for k, e in enumerate(dims) if e == d])
                  for d in {e for dims in in_dims for e in dims if e is not None}]
        shared = [(d, at) for d, at in shared if len(at) > 1 and d not in fixed and
                  all(step["shapes"][t][k] % 4 == 0 for t, k in at)]
        if shared:
            _, at = rnd.choice(sorted(shared))
            (t0, k0), (t1, k1) = at[0], at[1]
            st[t0][k0], st[t1][k1] = 2, 4
            return tuple(tuple(s) for s in st), how
    if how == "not_dividing":
        at = [(t, k) for t, s in enumerate(step["shapes"]) for k, n in enumerate(s) if n % 8 and n > 1]
        if at:
            t, k = rnd.choice(at)
            st[t][k] = next(c for c in (2, 4, 8) if step["shapes"][t][k] % c)
            for j in range(len(st[t])):       # keep the device count in range, so only the divisibility is wrong
                if j != k:
                    st[t][j] = 1
            return tuple(tuple(s) for s in st), how
    st[0][0] = 16
    return tuple(tuple(s) for s in st), "too_many"


LAYOUT_AXES = ("x", "y", "z")      # every Layout-form strategy of a case uses Layout((2, 2, 2), LAYOUT_AXES)


def _axes_for(step: dict[str, Any], rnd: random.Random) -> tuple:
    """Mesh axes for the step's strategy, for the Layout and PartitionSpec forms: each loop letter's count gets
    its own axes of the (2, 2, 2) layout (a shared letter the same axes on every input)."""
    in_dims, _, _ = make_prim(step).spec(step["shapes"], step["attrs"])
    free, of = list(LAYOUT_AXES), {}
    for dims, counts in zip(in_dims, step["strategy"], strict=True):
        for d, c in zip(dims, counts, strict=True):
            if d is not None and c > 1 and d not in of:
                k = c.bit_length() - 1
                pick = sorted(rnd.sample(free, k), key=LAYOUT_AXES.index)
                free = [a for a in free if a not in pick]
                of[d] = tuple(pick)
    return tuple(tuple(of.get(d, ()) if d is not None else () for d in dims) for dims in in_dims)


def make_case(seed: int, invalid: bool = False) -> dict[str, Any]:
    rnd = random.Random(seed)
    mode, search = MODES[rnd.randrange(len(MODES))]
    batch = rnd.choice([8, 16])
    dataset = rnd.choice(["data_parallel", "full_batch"])
    form = rnd.random()
    if form < 0.2:
        shape: Shape = (batch, rnd.choice([4, 8]), rnd.choice([4, 8]), rnd.choice([4, 8]))    # NCHW
    elif form < 0.4:
        shape = (batch, 4, rnd.choice([8, 16]))
    else:
        shape = (batch, rnd.choice([8, 16, 32]))
    first = shape
    steps: list[dict[str, Any]] = []
    form_w = rnd.choice([1.0, 1.0, 0.5, 0.0])        # the share of tuple strategies; the rest Layouts or PartitionSpecs
    n = rnd.randint(1, 4)
    bad_at = rnd.randrange(n) if invalid else -1
    while len(steps) < n:
        kind = rnd.choice(sorted(OPS))
        step = OPS[kind][1](rnd, shape)
        if step is None or math.prod(step["out"]) > 4096 or 0 in step["out"]:
            continue
        step["kind"] = kind
        step["strategy"], step["invalid"] = None, None
        if len(steps) == bad_at:
            step["strategy"], step["invalid"] = _invalid(step, rnd)
        elif rnd.random() < 0.7:
            step["strategy"] = _valid(step, rnd)
            step["form"] = rnd.choices(["tuple", "layout", "pspec"], [form_w, 1 - form_w, 0.5 * (1 - form_w) if any(
                st.get("form") == "layout" for st in steps) else 0.0])[0]
            if step["form"] != "tuple":
                step["axes"] = _axes_for(step, rnd)
            elif rnd.random() < 0.2:
                step["out_strategy"] = tuple(_split(o, rnd) for o in _out_shapes(make_prim(step), step))
        steps.append(step)
        shape = step["out"]
    return {"seed": seed, "mode": mode, "search_mode": search, "dataset": dataset, "input": first, "steps": steps,
            "remat": rnd.random() < 0.15, "shard_in": _split(first, rnd) if rnd.random() < 0.15 else None,
            "invalid": invalid}


def _const(role: str, shape: Shape, rng: np.random.Generator):
    if role.startswith("int:"):
        return jnp.asarray(rng.integers(0, int(role[4:]), shape), jnp.int32)
    if role == "labels":
        return jax.nn.one_hot(rng.integers(0, shape[-1], shape[:-1]), shape[-1], dtype=jnp.float32)
    raise ValueError(role)


def _strategy_form(step: dict[str, Any]):
    """The step's strategy as the user writes it: split counts, Layout calls or PartitionSpecs."""
    form = step.get("form", "tuple")
    if form == "tuple":
        return step["strategy"]
    one = {"layout": lambda a: (a[0] if len(a) == 1 else a) if a else "None",
           "pspec": lambda a: (a[0] if len(a) == 1 else a) if a else None}[form]
    make = ms.Layout((2, 2, 2), LAYOUT_AXES) if form == "layout" else (lambda *d: jax.sharding.PartitionSpec(*d))
    return tuple(make(*(one(a) for a in t)) for t in step["axes"])


def param_values(case: dict[str, Any]) -> list[np.ndarray]:
    """The case's parameters in step order, float32: N(0, 1) / sqrt(fan-in), ``pos_param`` as |v| + 0.5."""
    rng = np.random.default_rng(case["seed"])
    out = []
    for step in case["steps"]:
        for role, shp in zip(step["roles"], step["shapes"], strict=True):
            if role in ("param", "pos_param"):
                fan = math.prod(shp[1:]) if len(shp) >= 2 else 1
                v = rng.standard_normal(shp) / math.sqrt(fan)
                out.append(np.asarray(np.abs(v) + 0.5 if role == "pos_param" else v, np.float32))
    return out


_PRE = {"tanh": jnp.tanh, "pos": lambda v: jnp.abs(v) + 1.0, None: lambda v: v}


class Program(nnx.Module):
    """The case's chain; parameters are ``nnx.Param`` (scaled 1/sqrt(fan-in): values stay O(1) along the chain)."""

    def __init__(self, case: dict[str, Any]):
        self.remat, self.shard_in = case["remat"], case.get("shard_in")
        prims = []
        for step in case["steps"]:
            p = make_prim(step)
            if step["strategy"] is not None:
                p = p.shard(_strategy_form(step), step.get("out_strategy"))
            prims.append(p)
        self.prims = tuple(prims)
        self.params = nnx.List([nnx.Param(jnp.asarray(v)) for v in param_values(case)])
        self.seed = case["seed"]
        self.steps = tuple((st["roles"], st["shapes"], tuple(_frozen(a) for a in st["attrs"]), st.get("pre"),
                            st.get("post"))
                           for st in case["steps"])

    def chain(self, params, x):
        h, kp = x, 0
        rng = np.random.default_rng(self.seed + 3)       # the constants (indices, labels): the same on every call
        for p, (roles, shapes, attrs, pre, post) in zip(self.prims, self.steps, strict=True):
            h = _PRE[pre](h)
            args = []
            for role, shp in zip(roles, shapes, strict=True):
                if role == "x":
                    args.append(h)
                elif role in ("param", "pos_param"):
                    args.append(params[kp])
                    kp += 1
                else:
                    args.append(_const(role, shp, rng))
            out = p(*args, *(jnp.float32 if a == "float32" else a for a in attrs))
            if post == "first":
                out = out[0]
            elif post == "sce":
                out = out[0][:, None] + out[1]
            elif post == "mul_x":
                out = h * out
            h = out
        return h

    def __call__(self, x):
        params = [p[...] for p in self.params]
        body = functools.partial(jax.checkpoint(self.chain) if self.remat else self.chain, params)
        if self.shard_in is not None:     # the chain as an ms.shard function with the input's strategy
            body = ms.shard(body, in_strategy=(self.shard_in,))
        return body(x)


def _frozen(a):
    return tuple(_frozen(x) for x in a) if isinstance(a, (list, tuple)) else a


# float32 against the exact (float64) chain, rtol = atol per value. A float32 sum of n terms makes n - 1 roundings
# of at most 2**-24 of a partial sum each, in whatever order a partitioning adds them; with O(1) terms (the 1/sqrt(fan-
# in) parameter scale keeps the values O(1) along the chain) they come to ~n * 2**-24 (random in sign; (n - 1) *
# 2**-24 * sum|terms| at worst), and every elementwise step adds 2**-24 relative. An error made at one step reaches
# the value scaled by the later steps, so a value is off by about the sum of the reduction lengths of the steps it
# depends on times 2**-24 (tests/references.py's lengths: a forward sum of each step; for a gradient also the backward
# sums it flows through), times the later steps' amplification: C = 16 covers that, the pre-shifts keeping exp, log,
# sqrt, the divisions and the norms' rsqrt well conditioned (|d log|, |d sqrt| <= 1 on [1, inf), exp of tanh <= e,
# divisors >= 0.5). FLOOR: a few units in the last place of the transcendental functions' float32 results.
C_CHAIN = 16
FLOOR = 1e-6


def _lengths(case: dict[str, Any]) -> list[tuple[int, tuple[int, ...]]]:
    """Per step: (the longest sum of one output element, per tensor input the backward's own sum over the output
    elements one of its elements feeds), from tests/references.py."""
    out = []
    for step in case["steps"]:
        prim = _reference_prim(step)
        args = (*step["shapes"], *step["attrs"])
        n = reduction_length(prim, *args)
        out.append((n, tuple(g - n for g in gradient_length(prim, *args))))
    return out


def tolerances(case: dict[str, Any]) -> list[float]:
    """rtol = atol per compared value, in :func:`check_case`'s order: the output, the input's gradient, each
    parameter's gradient. The output depends on every step's forward sums; a gradient also on the backward sums of
    the steps it flows back through (the input's: every step's via its activation operand; a parameter's: its own
    step's for that operand and the later steps' for their activation)."""
    lengths = _lengths(case)
    fwd = sum(n for n, _ in lengths)
    back = []                                  # per step, the backward sum through its activation operand
    for step, (_, fan) in zip(case["steps"], lengths, strict=True):
        back.append(fan[step["roles"].index("x")] if "x" in step["roles"] else 1)      # OneHot: h * onehot
    tol = [C_CHAIN * fwd * 2.0 ** -24 + FLOOR, C_CHAIN * (fwd + sum(back)) * 2.0 ** -24 + FLOOR]
    for j, (step, (_, fan)) in enumerate(zip(case["steps"], lengths, strict=True)):
        for role, f in zip(step["roles"], fan, strict=True):
            if role in ("param", "pos_param"):
                tol.append(C_CHAIN * (fwd + f + sum(back[j + 1:])) * 2.0 ** -24 + FLOOR)
    return tol


def tolerance(case: dict[str, Any]) -> float:
    """The loosest of :func:`tolerances` (rtol = atol)."""
    return max(tolerances(case))


def check_case(case: dict[str, Any]) -> tuple[str, str]:
    """-> (outcome, detail). Outcomes: ``equal`` (a valid case equals the float64 reference), ``refused`` (an invalid strategy
    raised an mshard error), ``meeting`` (valid per op, but two user splits meet in one op and their product does
    not fit the devices: the LayoutError of DESIGN invariant 4, raised by the forward pass already), ``finding``
    (anything else: wrong values, a refused valid case, an accepted invalid one, a non-mshard exception)."""
    ms.reset_auto_parallel_context()
    kw = {"parallel_mode": case["mode"], "device_num": 8, "dataset_strategy": case["dataset"]}
    if case["search_mode"]:
        kw["search_mode"] = case["search_mode"]
    ms.set_auto_parallel_context(**kw)
    x = jnp.asarray(np.random.default_rng(case["seed"] + 1).standard_normal(case["input"]), jnp.float32)
    y = None
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
        if case["invalid"]:
            return "refused", f"{type(e).__name__}: {e}"
        meet = getattr(e, "meeting", None)
        if meet and y is None and meet["device_num"] % math.prod(meet["splits"]):
            return "meeting", f"{type(e).__name__}: {e}"
        return "finding", f"valid case refused{' under grad only' if y is not None else ''}: {type(e).__name__}: {e}"
    except Exception as e:   # every other exception is a finding
        return "finding", f"{type(e).__module__}.{type(e).__name__}: {str(e)[:300]}"
    if case["invalid"]:
        return "finding", "invalid strategy accepted: " + repr([s["strategy"] for s in case["steps"] if s["invalid"]])
    # the exact value: the same chain in float64 by tests/references.py (no mshard primitive), every value compared
    exact = _float64_reference(case, x, out_w)
    got = [y, gx, *jax.tree.leaves(gm)]
    if len(got) != len(exact):
        return "finding", f"{len(got)} outputs and gradients, the reference has {len(exact)}"
    names = ["output", "grad x"] + [f"grad param {i}" for i in range(len(got) - 2)]
    for what, a, t, tol in zip(names, got, exact, tolerances(case), strict=True):
        a = np.asarray(a, np.float64)
        if a.shape != t.shape:
            return "finding", f"{what} has shape {a.shape}, the reference {t.shape}"
        err = np.abs(a - t)
        if not np.all(err <= tol * (1 + np.abs(t))):
            return "finding", (f"{what} differs from the float64 reference: max |diff| {float(np.max(err)):.3g} (tol "
                               f"{tol:.2g}, {int(np.sum(~(err <= tol * (1 + np.abs(t)))))} of {t.size} values)")
    return "equal", ""


def _reference_prim(step: dict[str, Any]) -> ops.Primitive:
    """The step's primitive object, read by the references for its attributes only (never called)."""
    prim = make_prim(step)
    if step["kind"] == "BiasAdd" and len(step["shapes"][0]) > 2:
        # mshard's BiasAdd adds over the last dim (its docstring; MindSpore's NCHW BiasAdd would add over dim 1,
        # tests/test_primitive_references.py XFAILS): beyond 2-D the fuzzer's step is MindSpore's channel-last one
        prim.data_format = "NHWC"
    return prim


def reference_chain(case: dict[str, Any], params: list, x):
    """The case's chain evaluated by tests/references.py: the same parameters, constants, steps, attributes and
    pre/post-processing as :meth:`Program.chain`, in the dtype of ``x`` (a ``Cast`` to float32 rounds there, as the
    program does, and the chain carries on in that dtype)."""
    h, kp = x, 0
    rng = np.random.default_rng(case["seed"] + 3)       # the constants, drawn in Program.chain's order
    for step in case["steps"]:
        h = _PRE[step.get("pre")](h)
        args = []
        for role, shp in zip(step["roles"], step["shapes"], strict=True):
            if role == "x":
                args.append(h)
            elif role in ("param", "pos_param"):
                args.append(params[kp])
                kp += 1
            else:
                args.append(_const(role, shp, rng))
        attrs = [jnp.float32 if a == "float32" else a for a in step["attrs"]]
        out = REFERENCES[step["kind"]](_reference_prim(step), *args, *attrs)
        post = step.get("post")
        if post == "first":
            out = out[0]
        elif post == "sce":
            out = out[0][:, None] + out[1]
        elif post == "mul_x":
            out = h * out
        h = out.astype(x.dtype)
    return h


def _float64_reference(case: dict[str, Any], x, out_w) -> list[np.ndarray]:
    """Output, input gradient and parameter gradients (of sum(out * out_w)) of the case in float64, by
    :func:`reference_chain` (one compiled program)."""
    with jax.enable_x64(True):
        params = [jnp.asarray(p, jnp.float64) for p in param_values(case)]
        x64, w64 = jnp.asarray(x, jnp.float64), jnp.asarray(out_w, jnp.float64)

        def loss(params, v):
            y = reference_chain(case, params, v)
            return jnp.sum(y * w64), y
        (gp, gx), y = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x64)
        return [np.asarray(v, np.float64) for v in [y, gx, *gp]]


def run_case(case: dict[str, Any]) -> str | None:
    """None if the case holds (equal to the float64 reference, or refused as it must be); else the finding, one
    line."""
    outcome, detail = check_case(case)
    return detail[:500] if outcome == "finding" else None


def describe(case: dict[str, Any]) -> str:
    return (f"seed {case['seed']} {case['mode']}/{case['search_mode']} {case['dataset']} input {case['input']}"
            f"{' remat' if case['remat'] else ''}{' ms.shard' + str(case['shard_in']) if case.get('shard_in') else ''}: " +
            " -> ".join(f"{s['kind']}{s['strategy'] or ''}{_form_note(s)}"
                        f"{' out ' + str(s['out_strategy']) if s.get('out_strategy') else ''}" for s in case["steps"]))


def _form_note(step: dict[str, Any]) -> str:
    return "" if step.get("form", "tuple") == "tuple" else f"[{step['form']} {step['axes']}]"


def script(case: dict[str, Any], finding: str) -> str:
    """A standalone script that replays a case (run from the repository root)."""
    return (f"# mshard differential fuzzer finding: {finding}\n# {describe(case)}\n"
            "import os, sys\n"
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
            "sys.path[:0] = ['.']; sys.path.append('tests')\n"
            "from fuzz_programs import run_case\n"
            f"case = {case!r}\n"
            "print(run_case(case) or 'ok: equals the float64 reference')\n")
