"""Random small programs for the differential fuzzer (tests/e2e/fuzz/test_fuzz.py, bench/fuzz.py).

A *case* is plain data (a dict of tuples and numbers, so a failure replays as a standalone script): an input
shape, a chain of steps over the primitive objects of ``mshard.ops`` (every one but the collectives) with random
strategies (valid ones drawn from each primitive's own iteration space, or deliberately invalid ones), a device count
(8, 4 or 2) and the device matrix of its Layouts ((2, 2, 2), (2, 4), (4, 2), (8,); (2, 2), (4,); (2,)), a parallel
mode and search mode (ilp too), a dataset strategy, and whether the chain runs under ``jax.checkpoint`` and as an
``ms.shard`` function with a strategy for its input. A valid strategy comes as split counts, ``Layout`` calls or
``PartitionSpec``s, sometimes with an ``out_strategy``. Some cases have feature dims of 64-128, a step inside
``jax.lax.scan`` (repeated) or ``jax.lax.cond``, ``mshard.nn.Dropout`` after a step (the reference draws the same
mask: :func:`dropout_masks`), or are training cases (tests/fuzz_training.py).
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
import itertools
import math
import random
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from references import REFERENCES, gradient_length, reduction_length

import mshard as ms
from mshard import nn, ops
from mshard.errors import MshardError

MODES = (("semi_auto_parallel", None), ("auto_parallel", "sharding_propagation"),
         ("auto_parallel", "recursive_programming"), ("auto_parallel", "dynamic_programming"),
         ("data_parallel", None))
# drawn from the case's second stream (:func:`_extra`), so the draws of MODES above keep their seeds' cases
EXTRA_MODES = (("auto_parallel", "ilp"),)
SPLITS = (1, 2, 4, 8)
# device_num, and the device matrices a case's Layout-form strategies use (the product is device_num)
DEVICES = (8, 8, 4, 2)
MESHES = {8: ((2, 2, 2), (2, 4), (4, 2), (8,)), 4: ((2, 2), (4,)), 2: ((2,),)}
DIMS, BIG_DIMS = (8, 16, 32), (64, 128)     # feature dims; a "big" case draws from both

Shape = tuple[int, ...]


def _step(ctor: dict, tensors: list[tuple[str, Shape]], attrs: tuple, out: Shape, **extra) -> dict[str, Any]:
    return {"ctor": ctor, "roles": tuple(r for r, _ in tensors), "shapes": tuple(s for _, s in tensors),
            "attrs": attrs, "out": out, **extra}


def _unary(rnd, s):
    return _step({}, [("x", s)], (), s)


class Draw(random.Random):
    """The generators' random stream, with the case's kind: ``big`` (feature dims up to 128) and ``separable``
    (every step maps batch row i to output row i alone, with no constant or parameter of the batch's size: the
    program runs on a slice of the batch as well, as GradAccumulationCell's micro-batches and a pure data-parallel
    step's replicas run it)."""

    big = False
    separable = False

    def dims(self, small=DIMS):
        return self.choice(small + BIG_DIMS if self.big else small)


def _separable(rnd: random.Random) -> bool:
    """A generator may get a plain random.Random (tests/unit/planning/test_axis_assignment.py writes cases out with one): not separable."""
    return getattr(rnd, "separable", False)


def _binary(role="param"):
    # separable: the parameter broadcasts over the batch (MindSpore's broadcast of a lower-rank operand)
    return lambda rnd, s: _step({}, [("x", s), (role, s[1:] if _separable(rnd) else s)], (), s)


def _matmul(rnd, s):
    if len(s) != 2:
        return None
    tb = rnd.random() < 0.3
    n = rnd.dims() if isinstance(rnd, Draw) else rnd.choice(DIMS)
    return _step({"transpose_b": tb}, [("x", s), ("param", (n, s[1]) if tb else (s[1], n))], (), (s[0], n))


def _batch_matmul(rnd, s):
    if len(s) != 3:
        return None
    n = rnd.choice([8, 16])
    w = (s[2], n) if _separable(rnd) else (s[0], s[2], n)     # separable: one weight for every row
    return _step({}, [("x", s), ("param", w)], (), s[:-1] + (n,))


def _reduce(rnd, s):
    return _step({"keep_dims": True}, [("x", s)], ((len(s) - 1,),), s[:-1] + (1,))


def _transpose(rnd, s):
    if _separable(rnd):            # the batch stays dim 0
        if len(s) < 3:
            return None
        perm = (0, 2, 1) if len(s) == 3 else (0, 1, 3, 2)
        return _step({}, [("x", s)], (perm,), tuple(s[p] for p in perm))
    perm = tuple(reversed(range(len(s)))) if len(s) < 4 else (0, 1, 3, 2)     # NCHW stays N and C first
    return _step({}, [("x", s)], (perm,), tuple(s[p] for p in perm))


def _reshape(rnd, s):
    if len(s) == 2 and s[1] % 2 == 0:
        new = (s[0] * 2, s[1] // 2)
    elif len(s) >= 3:
        new = (s[0], math.prod(s[1:]))                      # flatten
    else:
        return None
    # separable: the batch dim as -1 (MindSpore's inferred dim), so a slice of the batch reshapes too
    return _step({}, [("x", s)], ((-1, *new[1:]) if _separable(rnd) else new,), new)


def _flatten(rnd, s):
    return None if len(s) < 3 else _step({}, [("x", s)], (), (s[0], math.prod(s[1:])))


def _expand(rnd, s):
    return None if len(s) > 3 else _step({}, [("x", s)], (1,), s[:1] + (1,) + s[1:])


def _squeeze(rnd, s):
    ones = [k for k in range(1, len(s)) if s[k] == 1]
    if not ones or len(s) < 3:
        return None
    k = rnd.choice(ones)
    return _step({"axis": (k,)}, [("x", s)], (), s[:k] + s[k + 1:])


def _concat(rnd, s):
    if _separable(rnd):            # a parameter of the batch's size would not slice: h with h
        return _step({"axis": -1}, [("x", s), ("x", s)], (), s[:-1] + (2 * s[-1],))
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
    if _separable(rnd):            # columns of every row (axis 1), the same for each row
        if len(s) != 2 or s[1] % 2:
            return None
        return _step({}, [("x", s), (f"int:{s[1]}", (s[1] // 2, 2))], (1,), (s[0], s[1] // 2, 2))
    if len(s) != 2 or s[0] % 2:
        return None
    return _step({}, [("x", s), (f"int:{s[0]}", (s[0] // 2, 2))], (0,), (s[0] // 2, 2, s[1]))


def _one_hot(rnd, s):
    # h * (1 + OneHot(indices, width)): the strategy covers the (constant) indices, one per batch row. Not h * OneHot:
    # a row with one nonzero left a norm after it dividing by a near-zero deviation (seed 1129)
    if len(s) != 2 or _separable(rnd):
        return None
    return _step({}, [(f"int:{s[1]}", (s[0],))], (s[1], 1.0, 0.0), s, post="mul_x")


def _sce(rnd, s):
    if len(s) != 2 or _separable(rnd):          # constant labels, one row per batch row
        return None
    return _step({}, [("x", s), ("labels", s)], (), s, post="sce")


def _layer_norm(rnd, s):
    return _step({"begin_norm_axis": -1, "begin_params_axis": -1}, [("x", s), ("param", s[-1:]), ("param", s[-1:])],
                 (), s, post="first")


def _batch_norm(rnd, s):
    if len(s) != 4:
        return None
    c = (s[1],)
    # in training the statistics are the batch's: not separable (a slice of the batch has its own)
    return _step({"is_training": rnd.random() < 0.5 and not _separable(rnd)},
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
    # GeLU on tanh(h): its tanh form's derivative cancels in float32 (1 - tanh(z)**2 near tanh = -1) and is scaled by
    # ~|h|**3 in its tail (seed 581: |h| = 6 after a RealDiv, 3x its tolerance on one device alone)
    "ReLU": (ops.ReLU, _unary), "Tanh": (ops.Tanh, _unary), "GeLU": (ops.GeLU, lambda r, s: {**_unary(r, s), "pre": "tanh"}),
    # Square on tanh(h): h**2 of a large h (|x / p| up to 6 after a RealDiv) scales the backward of the steps after it
    # by 2|h|, beyond C_CHAIN (seed 1335: a saturated tanh's float32 derivative 0 where float64's is 1e-7, x 144)
    "Sigmoid": (ops.Sigmoid, _unary), "Square": (ops.Square, lambda r, s: {**_unary(r, s), "pre": "tanh"}),
    "Exp": (ops.Exp, lambda r, s: {**_unary(r, s), "pre": "tanh"}),
    "Log": (ops.Log, lambda r, s: {**_unary(r, s), "pre": "pos"}),
    "Sqrt": (ops.Sqrt, lambda r, s: {**_unary(r, s), "pre": "pos"}),
    "Cast": (ops.Cast, lambda r, s: _step({}, [("x", s)], ("float32",), s)),
    "Add": (ops.Add, _binary()), "Sub": (ops.Sub, _binary()), "Mul": (ops.Mul, _binary()),
    "RealDiv": (ops.RealDiv, _binary("pos_param")), "Maximum": (ops.Maximum, _binary()),
    "Minimum": (ops.Minimum, _binary()),
    # MindSpore's BiasAdd: the bias along channel dim 1 (NCHW; the last dim of a 2-D input)
    "BiasAdd": (ops.BiasAdd, lambda r, s: _step({}, [("x", s), ("param", s[1:2])], (), s)),
    "MatMul": (ops.MatMul, _matmul), "BatchMatMul": (ops.BatchMatMul, _batch_matmul),
    "ReduceSum": (ops.ReduceSum, _reduce), "ReduceMean": (ops.ReduceMean, _reduce),
    "ReduceMax": (ops.ReduceMax, _reduce),
    "Softmax": (ops.Softmax, _unary), "LogSoftmax": (ops.LogSoftmax, _unary),
    "LayerNorm": (ops.LayerNorm, _layer_norm), "SoftmaxCrossEntropyWithLogits": (ops.SoftmaxCrossEntropyWithLogits, _sce),
    "Transpose": (ops.Transpose, _transpose), "Reshape": (ops.Reshape, _reshape), "Flatten": (ops.Flatten, _flatten),
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


def _take(free: tuple[int, ...], c: int) -> tuple[int, ...] | None:
    """The mesh axis sizes left after a split of ``c`` takes some of ``free`` (None: no subset multiplies to c).
    In every mesh of :data:`MESHES` a product has one subset up to axes of equal size, so the choice is free."""
    if c == 1:
        return free
    for k in range(1, len(free) + 1):
        for pick in itertools.combinations(range(len(free)), k):
            if math.prod(free[i] for i in pick) == c:
                return tuple(n for i, n in enumerate(free) if i not in pick)
    return None


def _fit(free: tuple[int, ...], counts) -> bool:
    """Whether splits of ``counts`` take disjoint axes of a mesh of axis sizes ``free``."""
    for c in counts:
        free = _take(free, c)
        if free is None:
            return False
    return True


def _valid(step: dict[str, Any], rnd: random.Random, mesh: tuple[int, ...] = (2, 2, 2)):
    """A strategy drawn from the primitive's iteration space: one split count per loop letter (fixed letters 1),
    dividing every tensor dim it splits, the letters taking disjoint axes of the mesh (axis sizes ``mesh``; of
    (2, 2, 2), any counts whose product divides 8). A reshape's split must also be a block split of the new shape
    (:func:`_blocks_stay_blocks`): drawn again until it is (all ones at worst)."""
    if step["kind"] in ("Reshape", "Flatten"):
        new = _out_shapes(make_prim(step), step)[0]
        for _ in range(64):
            st = _drawn(step, rnd, mesh)
            if _blocks_stay_blocks(step["shapes"][0], new, st[0]):
                return st
        return tuple((1,) * len(shape) for shape in step["shapes"])
    return _drawn(step, rnd, mesh)


def _blocks_stay_blocks(shape: Shape, new: Shape, counts: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` split ``counts`` (a block per device) is, reshaped to ``new``, split into blocks
    too: every device's elements, placed in the new shape, fill a box of contiguous ranges (numpy on the flat
    indices; independent of mshard's reshape rule)."""
    idx = np.arange(math.prod(shape)).reshape(shape)
    step_of = [n // c for n, c in zip(shape, counts, strict=True)]
    boxes = set()
    for corner in itertools.product(*[range(0, n, b) for n, b in zip(shape, step_of, strict=True)]):
        flat = idx[tuple(slice(c, c + b) for c, b in zip(corner, step_of, strict=True))].ravel()
        where = np.unravel_index(flat, new)
        lengths = tuple(int(w.max() - w.min() + 1) for w in where)
        starts = [int(w.min()) for w in where]
        if math.prod(lengths) != flat.size or any(len(np.unique(w)) != n for w, n in zip(where, lengths, strict=True)):
            return False
        if any(a % n for a, n in zip(starts, lengths, strict=True)):      # on the grid of equal blocks
            return False
        boxes.add(lengths)
    return len(boxes) == 1


def _drawn(step: dict[str, Any], rnd: random.Random, mesh: tuple[int, ...]):
    prim = make_prim(step)
    in_dims, out_dims, fixed = prim.spec(step["shapes"], step["attrs"])
    sizes: dict[str, int] = {}
    for dims, shape in zip(in_dims + out_dims, step["shapes"] + _out_shapes(prim, step), strict=True):
        for d, n in zip(dims, shape, strict=True):
            if d is not None:
                sizes[d] = math.gcd(sizes.get(d, n), n)
    counts, free = {}, tuple(mesh)
    for letter in sorted(sizes, key=lambda _: rnd.random()):
        options = [c for c in SPLITS if _take(free, c) is not None and sizes[letter] % c == 0
                   and (c == 1 or letter not in fixed)]
        counts[letter] = rnd.choice(options)
        free = _take(free, counts[letter])
    return tuple(tuple(counts.get(d, 1) if d is not None else 1 for d in dims) for dims in in_dims)


def _split(shape: Shape, rnd: random.Random, mesh: tuple[int, ...] = (2, 2, 2)) -> tuple[int, ...]:
    """Random split counts for one tensor: each dividing its dim, taking disjoint axes of the mesh."""
    out, free = [1] * len(shape), tuple(mesh)
    for d in sorted(range(len(shape)), key=lambda _: rnd.random()):
        out[d] = rnd.choice([c for c in SPLITS if _take(free, c) is not None and shape[d] % c == 0])
        free = _take(free, out[d])
    return tuple(out)


def _invalid(step: dict[str, Any], rnd: random.Random, devices: int = 8):
    """A strategy the primitive must refuse: more splits than devices, a split not dividing its dim, a split of a
    dim the op cannot split, or (where operands share a loop dim) operands that split the shared dim differently."""
    st = [list(s) for s in _valid(step, rnd, (2,) * (devices.bit_length() - 1))]
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
        lo, hi = (2, 4) if devices >= 4 else (1, 2)       # each within the devices: only the disagreement is wrong
        shared = [(d, [(t, k) for t, dims in enumerate(in_dims) for k, e in enumerate(dims) if e == d])
                  for d in {e for dims in in_dims for e in dims if e is not None}]
        shared = [(d, at) for d, at in shared if len(at) > 1 and d not in fixed and
                  all(step["shapes"][t][k] % hi == 0 for t, k in at)]
        if shared:
            _, at = rnd.choice(sorted(shared))
            (t0, k0), (t1, k1) = at[0], at[1]
            st[t0][k0], st[t1][k1] = lo, hi
            return tuple(tuple(s) for s in st), how
    if how == "not_dividing":
        at = [(t, k) for t, s in enumerate(step["shapes"]) for k, n in enumerate(s)
              if n > 1 and any(n % c for c in (2, 4, 8) if c <= devices)]
        if at:
            t, k = rnd.choice(at)
            st[t][k] = next(c for c in (2, 4, 8) if c <= devices and step["shapes"][t][k] % c)
            for j in range(len(st[t])):       # keep the device count in range, so only the divisibility is wrong
                if j != k:
                    st[t][j] = 1
            return tuple(tuple(s) for s in st), how
    st[0][0] = 2 * devices
    return tuple(tuple(s) for s in st), "too_many"


LAYOUT_AXES = ("x", "y", "z")      # a case's Layout is Layout(case["mesh"], LAYOUT_AXES[:len(case["mesh"])])


def _axes_for(step: dict[str, Any], rnd: random.Random, mesh: tuple[int, ...] = (2, 2, 2)) -> tuple:
    """Mesh axes for the step's strategy, for the Layout and PartitionSpec forms: each loop letter's count gets
    its own axes of the layout (a shared letter the same axes on every input; :func:`_valid` drew counts that fit)."""
    in_dims, _, _ = make_prim(step).spec(step["shapes"], step["attrs"])
    names = LAYOUT_AXES[:len(mesh)]
    size = dict(zip(names, mesh, strict=True))
    free, of = list(names), {}
    for dims, counts in zip(in_dims, step["strategy"], strict=True):
        for d, c in zip(dims, counts, strict=True):
            if d is not None and c > 1 and d not in of:
                if all(size[a] == 2 for a in free):
                    pick = sorted(rnd.sample(free, c.bit_length() - 1), key=LAYOUT_AXES.index)
                else:
                    pick = rnd.choice([p for k in range(1, len(free) + 1) for p in itertools.combinations(free, k)
                                       if math.prod(size[a] for a in p) == c])
                free = [a for a in free if a not in pick]
                of[d] = tuple(pick)
    return tuple(tuple(of.get(d, ()) if d is not None else () for d in dims) for dims in in_dims)


TRAIN_SHARE, CONTROL_SHARE, DROPOUT_SHARE, ILP_SHARE, BIG_SHARE = 0.25, 0.2, 0.15, 0.12, 0.25


def _extra(seed: int) -> Draw:
    """The case's second stream: device count, mesh, big dims, ilp, training, scan/cond, dropout (drawn apart from
    the first, so a seed with 8 devices, the (2, 2, 2) mesh and none of these draws the steps it drew before them)."""
    return Draw(f"mshard-fuzz-extra-{seed}")


def _train_variant(ex: random.Random) -> dict[str, Any]:
    """A training case: 2 steps of TrainOneStepCell(WithLossCell(program, loss), optax.sgd(lr)), optionally through
    GradAccumulationCell(., 2), with the parallel optimizer (threshold 0 KB), with the program's Cell recomputed, and
    as a pure data-parallel step (data_parallel mode on a split batch)."""
    return {"lr": ex.choice([0.05, 0.1]), "steps": 2, "accum": ex.random() < 0.35, "zero": ex.random() < 0.35,
            "recompute": ex.random() < 0.35, "pure_dp": ex.random() < 0.3}


def _wrappable(step: dict[str, Any]) -> bool:
    """A step that can run inside jax.lax.scan / cond: it keeps its activation's shape and takes no constants (a scan
    body is traced once, so constants drawn per call would be drawn once there and per iteration in the reference)."""
    roles = step["roles"]
    # not Square: r squarings multiply a value's relative error by 2 ** r
    return (step["invalid"] is None and step["kind"] != "Square" and roles.count("x") == 1
            and step["shapes"][roles.index("x")] == step["out"] and all(r in ("x", "param", "pos_param") for r in roles))


def make_case(seed: int, invalid: bool = False) -> dict[str, Any]:
    rnd, ex = Draw(seed), _extra(seed)
    devices = ex.choice(DEVICES)
    mesh = ex.choice(MESHES[devices])
    rnd.big = ex.random() < BIG_SHARE
    train = None if invalid or ex.random() >= TRAIN_SHARE else _train_variant(ex)
    ilp = ex.random() < ILP_SHARE
    control = ex.random() < CONTROL_SHARE
    dropout = not invalid and train is None and ex.random() < DROPOUT_SHARE
    mode, search = MODES[rnd.randrange(len(MODES))]
    if ilp:
        mode, search = EXTRA_MODES[0]
    batch = rnd.choice([8, 16])
    dataset = rnd.choice(["data_parallel", "full_batch"])
    if train is not None:
        if train["pure_dp"]:          # data_parallel on a split batch: the step's replicas run the program side by side
            mode, search, dataset = "data_parallel", None, "data_parallel"
        elif train["zero"]:           # the parallel optimizer shards over the data-parallel devices: a split batch
            dataset = "data_parallel"
        # a micro-batch of half the batch still spans the devices; a step that may run as pure data parallel (its
        # replicas run the program on their rows) or with micro-batches draws a program that runs on a slice too
        batch = 16 if train["accum"] else batch
        rnd.separable = train["accum"] or (dataset == "data_parallel" and mode != "auto_parallel")
    form = rnd.random()
    if form < 0.2:
        shape: Shape = (batch, rnd.choice([4, 8]), rnd.choice([4, 8]), rnd.choice([4, 8]))    # NCHW
    elif form < 0.4:
        shape = (batch, 4, rnd.choice([8, 16] + ([64] if rnd.big else [])))
    else:
        shape = (batch, rnd.dims())
    first = shape
    steps: list[dict[str, Any]] = []
    form_w = rnd.choice([1.0, 1.0, 0.5, 0.0])        # the share of tuple strategies; the rest Layouts or PartitionSpecs
    # strategies are drawn on the Layout's mesh where a case may name it; tuple-only cases on the prime mesh
    on = tuple(mesh) if form_w < 1.0 else (2,) * (devices.bit_length() - 1)
    n = rnd.randint(1, 4)
    bad_at = rnd.randrange(n) if invalid else -1
    cap = 16384 if rnd.big else 4096

    def more() -> bool:         # a training case trains parameters: it draws steps with some until it has one
        return len(steps) < n or (train is not None and
                                  not any(r in ("param", "pos_param") for st in steps for r in st["roles"]))
    while more():
        kind = rnd.choice(sorted(OPS) if len(steps) < n else ["Add", "BiasAdd", "LayerNorm", "MatMul", "Mul"])
        step = OPS[kind][1](rnd, shape)
        if step is None or math.prod(step["out"]) > cap or 0 in step["out"]:
            continue
        step["kind"] = kind
        step["strategy"], step["invalid"] = None, None
        if len(steps) == bad_at:
            step["strategy"], step["invalid"] = _invalid(step, rnd, devices)
        elif rnd.random() < 0.7:
            step["strategy"] = _valid(step, rnd, on)
            step["form"] = rnd.choices(["tuple", "layout", "pspec"], [form_w, 1 - form_w, 0.5 * (1 - form_w) if any(
                st.get("form") == "layout" for st in steps) else 0.0])[0]
            if step["form"] != "tuple":
                step["axes"] = _axes_for(step, rnd, on)
            elif rnd.random() < 0.2:
                step["out_strategy"] = tuple(_split(o, rnd, on) for o in _out_shapes(make_prim(step), step))
        if control and step["invalid"] is None and _wrappable(step) and ex.random() < 0.5:
            # no cond in a separable program: its predicate reads the first row of whatever slice runs it
            step["wrap"] = ex.choice([("scan", 2), ("scan", 3)] + ([] if rnd.separable else [("cond",)]))
        if dropout and ex.random() < 0.4:
            step["dropout"] = ex.choice([0.25, 0.5])
        steps.append(step)
        shape = step["out"]
    case = {"seed": seed, "mode": mode, "search_mode": search, "dataset": dataset, "input": first, "steps": steps,
            "remat": rnd.random() < 0.15, "shard_in": _split(first, rnd, on) if rnd.random() < 0.15 else None,
            "invalid": invalid}
    case.update({"devices": devices, "mesh": tuple(mesh), "train": train})
    if any(st.get("dropout") for st in steps):
        # a Dropout advances its nnx key stream, which nnx refuses inside a plain JAX transform (jax.checkpoint, the
        # ms.shard function): those cases draw no Dropout
        case["remat"], case["shard_in"] = False, None
    return case


def region_mesh(case: dict[str, Any]) -> tuple[int, ...]:
    """The axis sizes of the mesh the case's region runs on: its Layout's where a step names it, else one axis of 2
    per factor of device_num (mshard's prime mesh)."""
    if any(st.get("form") == "layout" for st in case["steps"]):
        return case.get("mesh", (2, 2, 2))
    return (2,) * (case.get("devices", 8).bit_length() - 1)


def _const(role: str, shape: Shape, rng: np.random.Generator):
    if role.startswith("int:"):
        return jnp.asarray(rng.integers(0, int(role[4:]), shape), jnp.int32)
    if role == "labels":
        return jax.nn.one_hot(rng.integers(0, shape[-1], shape[:-1]), shape[-1], dtype=jnp.float32)
    raise ValueError(role)


def _strategy_form(step: dict[str, Any], mesh: tuple[int, ...] = (2, 2, 2)):
    """The step's strategy as the user writes it: split counts, Layout calls (on the case's device matrix
    ``mesh``) or PartitionSpecs."""
    form = step.get("form", "tuple")
    if form == "tuple":
        return step["strategy"]
    one = {"layout": lambda a: (a[0] if len(a) == 1 else a) if a else "None",
           "pspec": lambda a: (a[0] if len(a) == 1 else a) if a else None}[form]
    make = ms.Layout(mesh, LAYOUT_AXES[:len(mesh)]) if form == "layout" else (lambda *d: jax.sharding.PartitionSpec(*d))
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


def _dropout_seed(case: dict[str, Any], j: int) -> int:
    return case["seed"] + 10 + j


class Program(nnx.Module):
    """The case's chain; parameters are ``nnx.Param`` (scaled 1/sqrt(fan-in): values stay O(1) along the chain). A
    step may run inside ``jax.lax.scan`` (the step repeated) or ``jax.lax.cond`` (the step if the input's first element
    is positive, else the identity), and be followed by an ``mshard.nn.Dropout``."""

    def __init__(self, case: dict[str, Any]):
        self.remat, self.shard_in = case["remat"], case.get("shard_in")
        prims = []
        for step in case["steps"]:
            p = make_prim(step)
            if step["strategy"] is not None:
                p = p.shard(_strategy_form(step, case.get("mesh", (2, 2, 2))), step.get("out_strategy"))
            prims.append(p)
        self.prims = tuple(prims)
        self.params = nnx.List([nnx.Param(jnp.asarray(v)) for v in param_values(case)])
        self.drops = nnx.List([nn.Dropout(p=st["dropout"], rngs=nnx.Rngs(dropout=_dropout_seed(case, j)))
                               for j, st in enumerate(case["steps"]) if st.get("dropout")])
        self.seed = case["seed"]
        self.steps = tuple((st["roles"], st["shapes"], tuple(_frozen(a) for a in st["attrs"]), st.get("pre"),
                            st.get("post"), st.get("wrap"), bool(st.get("dropout")))
                           for st in case["steps"])

    def chain(self, params, x):
        h, kp, kd = x, 0, 0
        rng = np.random.default_rng(self.seed + 3)       # the constants (indices, labels): the same on every call
        for p, (roles, shapes, attrs, pre, post, wrap, drop) in zip(self.prims, self.steps, strict=True):
            mine = [params[kp + i] for i in range(sum(r in ("param", "pos_param") for r in roles))]
            kp += len(mine)
            consts = [_const(r, shp, rng) for r, shp in zip(roles, shapes, strict=True) if r not in NOT_CONST]
            apply = functools.partial(_apply_step, p, roles, attrs, pre, post, mine, consts)
            if wrap is None:
                h = apply(h)
            elif wrap[0] == "scan":
                h, _ = jax.lax.scan(lambda c, _: (apply(c), None), h, None, length=wrap[1])
            else:
                h = jax.lax.cond(x.reshape(-1)[0] > 0, apply, lambda c: c, h)
            if drop:
                h = self.drops[kd](h)
                kd += 1
        return h

    def __call__(self, x):
        params = [p[...] for p in self.params]
        body = functools.partial(jax.checkpoint(self.chain) if self.remat else self.chain, params)
        if self.shard_in is not None:     # the chain as an ms.shard function with the input's strategy
            body = ms.shard(body, in_strategy=(self.shard_in,))
        return body(x)


NOT_CONST = ("x", "param", "pos_param")     # the roles that are not constants


def _apply_step(prim, roles, attrs, pre, post, params, consts, h, fn=None):
    """One step on activation ``h``: the pre-shift, the call (``prim``, or ``fn(*inputs, *attrs)`` for the reference)
    with the step's parameters and constants in call order, and the post-processing."""
    h = _PRE[pre](h)
    ps, cs, args = iter(params), iter(consts), []
    for role in roles:
        args.append(h if role == "x" else next(ps) if role in ("param", "pos_param") else next(cs))
    out = (fn or prim)(*args, *(jnp.float32 if a == "float32" else a for a in attrs))
    if post == "first":
        out = out[0]
    elif post == "sce":
        out = out[0][:, None] + out[1]
    elif post == "mul_x":
        out = h * (1.0 + out)
    return out


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
        # a step scanned r times: its sums r times over (and a parameter's gradient a sum of the r iterations')
        r = step["wrap"][1] if step.get("wrap") and step["wrap"][0] == "scan" else 1
        out.append((r * n, tuple(r * (g - n) for g in gradient_length(prim, *args))))
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
        back.append(fan[step["roles"].index("x")] if "x" in step["roles"] else 1)      # OneHot: h * (1 + onehot)
    tol = [C_CHAIN * fwd * 2.0 ** -24 + FLOOR, C_CHAIN * (fwd + sum(back)) * 2.0 ** -24 + FLOOR]
    for j, (step, (_, fan)) in enumerate(zip(case["steps"], lengths, strict=True)):
        for role, f in zip(step["roles"], fan, strict=True):
            if role in ("param", "pos_param"):
                tol.append(C_CHAIN * (fwd + f + sum(back[j + 1:])) * 2.0 ** -24 + FLOOR)
    # a Dropout scales what it keeps by 1 / (1 - p), and with it an error made before it (forward) or after it (the
    # backward's): beyond C_CHAIN's amplification, so the tolerances grow by that (seed 789: 2 Dropouts, tanh's
    # saturated derivative 1 - tanh**2, off by 2**-23 absolute, carried 2.67x further than without them)
    gain = math.prod(1.0 / (1.0 - st["dropout"]) for st in case["steps"] if st.get("dropout"))
    return [t * gain for t in tol]


def tolerance(case: dict[str, Any]) -> float:
    """The loosest of :func:`tolerances` (rtol = atol)."""
    return max(tolerances(case))


def set_context(case: dict[str, Any], **extra) -> None:
    ms.reset_auto_parallel_context()
    kw = {"parallel_mode": case["mode"], "device_num": case.get("devices", 8), "dataset_strategy": case["dataset"], **extra}
    if case["search_mode"]:
        kw["search_mode"] = case["search_mode"]
    ms.set_auto_parallel_context(**kw)


def refusal(case: dict[str, Any], e: MshardError, forward_ran: bool) -> tuple[str, str]:
    """The outcome of an mshard error: ``refused`` for an invalid case, ``meeting`` where two user splits meet in one
    op and cannot take disjoint axes of the region's mesh, else a ``finding`` (a valid case refused)."""
    if case["invalid"]:
        return "refused", f"{type(e).__name__}: {e}"
    meet = getattr(e, "meeting", None)
    if meet and not forward_ran and not _fit(region_mesh(case), meet["splits"]):
        return "meeting", f"{type(e).__name__}: {e}"
    return "finding", f"valid case refused{' under grad only' if forward_ran else ''}: {type(e).__name__}: {e}"


def compare(names, got, exact, tols) -> str | None:
    """The first value of ``got`` off its float64 value by more than its tolerance (rtol = atol), or None."""
    if len(got) != len(exact):
        return f"{len(got)} outputs and gradients, the reference has {len(exact)}"
    for what, a, t, tol in zip(names, got, exact, tols, strict=True):
        a = np.asarray(a, np.float64)
        if a.shape != t.shape:
            return f"{what} has shape {a.shape}, the reference {t.shape}"
        err = np.abs(a - t)
        if not np.all(err <= tol * (1 + np.abs(t))):
            return (f"{what} differs from the float64 reference: max |diff| {float(np.max(err)):.3g} (tol "
                    f"{tol:.2g}, {int(np.sum(~(err <= tol * (1 + np.abs(t)))))} of {t.size} values)")
    return None


def check_case(case: dict[str, Any]) -> tuple[str, str]:
    """-> (outcome, detail). Outcomes: ``equal`` (a valid case equals the float64 reference), ``refused`` (an invalid strategy
    raised an mshard error), ``meeting`` (valid per op, but two user splits meet in one op and cannot take disjoint
    axes of the region's mesh: the LayoutError of docs/design.md invariant 4, raised by the forward pass already), ``finding``
    (anything else: wrong values, a refused valid case, an accepted invalid one, a non-mshard exception). A training
    case (``case["train"]``) is checked by tests/fuzz_training.py."""
    if case.get("train"):
        from fuzz_training import check_training
        return check_training(case)
    set_context(case)
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
        return refusal(case, e, y is not None)
    except Exception as e:   # every other exception is a finding
        return "finding", f"{type(e).__module__}.{type(e).__name__}: {str(e)[:300]}"
    if case["invalid"]:
        return "finding", "invalid strategy accepted: " + repr([s["strategy"] for s in case["steps"] if s["invalid"]])
    # the exact value: the same chain in float64 by tests/references.py (no mshard primitive), every value compared
    exact = _case_reference(case, x, out_w)
    got = [y, gx, *jax.tree.leaves(gm)]
    names = ["output", "grad x"] + [f"grad param {i}" for i in range(len(got) - 2)]
    tols = with_float32_error(tolerances(case), _case_reference(case, x, out_w, np.float32), exact)
    bad = compare(names, got, exact, tols)
    return ("finding", bad) if bad else ("equal", "")


def _reference_prim(step: dict[str, Any]) -> ops.Primitive:
    """The step's primitive object, read by the references for its attributes only (never called)."""
    return make_prim(step)


def dropout_masks(case: dict[str, Any], call: int) -> list[np.ndarray]:
    """The keep-masks of the case's Dropouts on the program's ``call``-th call (from 0): each Dropout's key is the
    ``call``-th of its own nnx stream (``nnx.Rngs(dropout=seed)``, forked as the Dropout forks it), the mask that key's
    ``jax.random.bernoulli`` draws for the whole activation (mshard draws it so under any partitioning: the
    partitionable threefry makes the bits independent of the sharding). Drawn in float32 as the Dropout draws it."""
    out = []
    for j, st in enumerate(case["steps"]):
        if st.get("dropout"):
            stream = nnx.Rngs(dropout=_dropout_seed(case, j))["dropout"].fork()
            for _ in range(call):
                stream()
            out.append(np.asarray(jax.random.bernoulli(stream(), 1.0 - st["dropout"], st["out"])))
    return out


def cond_predicate(x) -> bool:
    """The branch a ``jax.lax.cond`` step takes for input ``x``: an exact comparison of one input value."""
    return bool(np.asarray(x).reshape(-1)[0] > 0)


def reference_chain(case: dict[str, Any], params: list, x, masks=(), pred: bool | None = None):
    """The case's chain evaluated by tests/references.py: the same parameters, constants, steps, attributes and
    pre/post-processing as :meth:`Program.chain`, in the dtype of ``x`` (a ``Cast`` to float32 rounds there, as the
    program does, and the chain carries on in that dtype). A scanned step is applied its count of times in a loop,
    a cond step where ``pred`` (:func:`cond_predicate` of the input), a Dropout multiplies by its mask in ``masks``
    and 1 / (1 - p)."""
    h, kp = x, 0
    rng = np.random.default_rng(case["seed"] + 3)       # the constants, drawn in Program.chain's order
    masks = iter(masks)
    for step in case["steps"]:
        roles = step["roles"]
        mine = [params[kp + i] for i in range(sum(r in ("param", "pos_param") for r in roles))]
        kp += len(mine)
        consts = [_const(r, shp, rng) for r, shp in zip(roles, step["shapes"], strict=True) if r not in NOT_CONST]
        fn = functools.partial(REFERENCES[step["kind"]], _reference_prim(step))
        wrap = step.get("wrap")
        reps = wrap[1] if wrap and wrap[0] == "scan" else 0 if wrap and not pred else 1
        for _ in range(reps):
            h = _apply_step(None, roles, step["attrs"], step.get("pre"), step.get("post"), mine, consts, h,
                            fn=fn).astype(x.dtype)
        if step.get("dropout"):
            h = h * jnp.asarray(next(masks), x.dtype) / (1.0 - step["dropout"])
    return h


# The model above bounds the float32 error of a chain whose steps amplify an error by at most C_CHAIN. A chain can
# amplify more: a norm of values that an earlier norm or a subtraction left nearly equal divides by a small
# deviation (seeds 320911, 330277 and 332375: BatchNorm, LayerNorm and Square chains; on 332375 plain JAX in
# float32 on one device is off the float64 chain by 8.6e-5 relative, 6x the model's bound, exactly as far as the
# sharded program and as mshard on one device). The same chain evaluated in float32 on one device (tests/references.py, no mshard code) measures that
# amplification: a correct program rounds the same terms in another order, each rounding bounded alike, so its error
# is of the same size; FLOAT32_SLACK = 4 leaves room for the realised errors of two orders to differ, while a wrong
# program (a sum missing a device's part, a value from the wrong slice) is off by O(|value|), far beyond both.
FLOAT32_SLACK = 4.0


def float32_error(approx: np.ndarray, exact: np.ndarray) -> float:
    """The largest error of a float32 evaluation relative to 1 + |exact| (the form the tolerances take)."""
    approx, exact = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
    return float(np.max(np.abs(approx - exact) / (1 + np.abs(exact)), initial=0.0))


def with_float32_error(tols: list[float], float32: list, exact: list) -> list[float]:
    """Each tolerance, at least FLOAT32_SLACK times the one-device float32 chain's own error on that value."""
    return [max(t, FLOAT32_SLACK * float32_error(a, e)) for t, a, e in zip(tols, float32, exact, strict=True)]


def _case_reference(case: dict[str, Any], x, out_w, dtype=np.float64) -> list[np.ndarray]:
    """Output, input gradient and parameter gradients (of sum(out * out_w)) of the case in float64 (``dtype``:
    float32 for the one-device float32 chain), by :func:`reference_chain`: the output with the Dropout masks of the
    program's first call, the gradients with its second's (the forward and the gradient are two calls)."""
    pred, m0, m1 = cond_predicate(x), dropout_masks(case, 0), dropout_masks(case, 1)
    with jax.enable_x64(dtype == np.float64), warnings.catch_warnings():
        # in float32 a reference's float64 cast is float32 (the one-device float32 chain is wanted): JAX says so
        warnings.filterwarnings("ignore", "Explicitly requested dtype float64", UserWarning)
        params = [jnp.asarray(p, dtype) for p in param_values(case)]
        x64, w64 = jnp.asarray(x, dtype), jnp.asarray(out_w, dtype)

        def loss(params, v, masks):
            y = reference_chain(case, params, v, masks, pred)
            return jnp.sum(y * w64), y
        (gp, gx), y = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x64, m1)
        if m0:                              # the forward's own masks
            y = jax.jit(lambda p, v: reference_chain(case, p, v, m0, pred))(params, x64)
        return [np.asarray(v, np.float64) for v in [y, gx, *gp]]


def run_case(case: dict[str, Any]) -> str | None:
    """None if the case holds (equal to the float64 reference, or refused as it must be); else the finding, one
    line."""
    outcome, detail = check_case(case)
    return detail[:500] if outcome == "finding" else None


def describe(case: dict[str, Any]) -> str:
    train = case.get("train")
    return (f"seed {case['seed']} {case['mode']}/{case['search_mode']} {case.get('devices', 8)} devices {case['dataset']} "
            f"input {case['input']}{' remat' if case['remat'] else ''}"
            f"{' ms.shard' + str(case['shard_in']) if case.get('shard_in') else ''}"
            f"{' train ' + variant(case) if train else ''}: " +
            " -> ".join(f"{_wrap_note(s)}{s['kind']}{s['strategy'] or ''}{_form_note(s, case)}"
                        f"{' out ' + str(s['out_strategy']) if s.get('out_strategy') else ''}"
                        f"{' dropout ' + str(s['dropout']) if s.get('dropout') else ''}" for s in case["steps"]))


def variant(case: dict[str, Any]) -> str:
    """A training case's variant: plain, or the accumulation / parallel optimizer / recompute it adds."""
    t = case.get("train")
    if not t:
        return "none"
    return "+".join(k for k in ("accum", "zero", "recompute") if t[k]) or "plain"


def features(case: dict[str, Any]) -> list[str]:
    """The case's generators beyond the primitives and the mode, as names (bench/fuzz.py counts outcomes by them)."""
    out = [f"devices {case.get('devices', 8)}", f"train {variant(case)}"]
    if case.get("train") and case["train"]["pure_dp"]:
        out.append("train pure_dp")
    if any(st.get("form") == "layout" for st in case["steps"]):
        out.append(f"layout {region_mesh(case)}")
    out += sorted({f"wrap {st['wrap'][0]}" for st in case["steps"] if st.get("wrap")})
    if any(st.get("dropout") for st in case["steps"]):
        out.append("dropout")
    if any(max(st["out"] + st["shapes"][0]) >= 64 for st in case["steps"]):
        out.append("dims >= 64")
    return out


def _wrap_note(step: dict[str, Any]) -> str:
    w = step.get("wrap")
    return "" if not w else f"scan{w[1]} " if w[0] == "scan" else "cond "


def _form_note(step: dict[str, Any], case: dict[str, Any]) -> str:
    return "" if step.get("form", "tuple") == "tuple" else f"[{step['form']} {region_mesh(case)} {step['axes']}]"


def script(case: dict[str, Any], finding: str) -> str:
    """A standalone script that replays a case (run from the repository root)."""
    return (f"# mshard differential fuzzer finding: {finding}\n# {describe(case)}\n"
            "import os, sys\n"
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'\n"
            "sys.path[:0] = ['.']; sys.path.append('tests')\n"
            "from fuzz_programs import run_case\n"
            f"case = {case!r}\n"
            "print(run_case(case) or 'ok: equals the float64 reference')\n")
