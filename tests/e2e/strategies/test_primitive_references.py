"""Every primitive of ``mshard.ops`` against an independent float64 reference (issue 37).

The rest of the suite judges partitioned runs against mshard's own primitives run on one device, so a primitive that
computes the wrong thing everywhere (a transposed output, a softmax over the wrong axis) would pass it. Here each
primitive, called eagerly in stand_alone mode and with a non-trivial strategy inside ``ms.jit`` in
semi_auto_parallel on 8 devices, must equal its reference in tests/references.py (written from MindSpore's
documented semantics, never calling mshard) computed in float64: every output value, and every value of the gradient
of every float input of a loss that weighs each output element differently.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from references import REFERENCES, gradient_length, reduction_length, reference

import mshard as ms
from mshard import ops

SEMI = {"parallel_mode": "semi_auto_parallel", "device_num": 8, "dataset_strategy": "full_batch"}

# float32 against the exact (float64) value, rtol = atol = C * n * 2**-24 + FLOOR for a value that depends on float
# sums of at most n terms. A float32 sum of n terms makes n - 1 roundings, each at most 2**-24 of a partial sum, in
# whatever order a partitioning adds them: at worst (n - 1) * 2**-24 * sum|terms|, all in one direction. The terms
# here have rms <= 1 (N(0, 1) inputs; the operands a sum contracts over are scaled by 1/sqrt(n)), so the partial
# sums are ~sqrt(k) and the roundings, random in sign, add up to ~n * 2**-24 / sqrt(2) absolute, relative to the
# value when it is large; C = 8 leaves a margin of 10 over that for the tail of those roundings and each product's
# or elementwise function's own rounding (2**-24 relative). FLOOR: float32 transcendental functions (exp, tanh, log,
# sigmoid, GeLU's tanh form, whose 1 + tanh(z) cancels for negative inputs) are off by a few units in the last
# place of O(1) values: 2**-20 = 16 units of 2**-24.
U = 2.0 ** -24
C = 8
FLOOR = 2.0 ** -20


def tolerance(n: int) -> float:
    """rtol = atol for a float32 value that depends on float sums of at most ``n`` terms (see above)."""
    return C * n * U + FLOOR


def r(seed: int, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def pos(seed: int, *shape: int) -> np.ndarray:
    """Positive values away from 0 (divisors, log/sqrt arguments, variances)."""
    return np.abs(r(seed, *shape)) + np.float32(0.5)


IDS = np.random.default_rng(9).integers(0, 32, (8, 4)).astype(np.int32)
LABELS = np.eye(16, dtype=np.float32)[np.random.default_rng(3).integers(0, 16, 8)]

# (id, primitive factory, tensor inputs, attribute arguments, a valid strategy splitting some dim 2-way or more).
# Weights that are summed over are scaled 1/sqrt(n) (see the tolerance).
CASES: list[tuple[str, Callable[[], Any], list[np.ndarray], list[Any], tuple]] = [
    ("MatMul", lambda: ops.MatMul(), [r(0, 8, 16), r(1, 16, 8, scale=0.25)], [], ((2, 2), (2, 2))),
    ("MatMul-ta", lambda: ops.MatMul(transpose_a=True), [r(0, 16, 8), r(1, 16, 8, scale=0.25)], [], ((2, 2), (2, 2))),
    ("MatMul-tb", lambda: ops.MatMul(transpose_b=True), [r(0, 8, 16), r(1, 4, 16, scale=0.25)], [], ((2, 4), (1, 4))),
    ("MatMul-ta-tb", lambda: ops.MatMul(transpose_a=True, transpose_b=True), [r(0, 16, 8), r(1, 4, 16, scale=0.25)],
     [], ((2, 2), (2, 2))),
    ("BatchMatMul", lambda: ops.BatchMatMul(), [r(0, 4, 8, 16), r(1, 4, 16, 8, scale=0.25)], [],
     ((2, 2, 2), (2, 2, 1))),
    # the weight's batch dim broadcasts (size 1)
    ("BatchMatMul-tb-broadcast", lambda: ops.BatchMatMul(transpose_b=True), [r(0, 4, 8, 16), r(1, 1, 8, 16, scale=0.25)],
     [], ((2, 1, 2), (1, 2, 2))),
    ("Add", lambda: ops.Add(), [r(0, 8, 16), r(1, 16)], [], ((2, 4), (4,))),
    ("Sub", lambda: ops.Sub(), [r(0, 8, 16), r(1, 8, 16)], [], ((8, 1), (8, 1))),
    ("Mul", lambda: ops.Mul(), [r(0, 8, 16), r(1, 8, 16)], [], ((2, 2), (2, 2))),
    ("RealDiv", lambda: ops.RealDiv(), [r(0, 8, 16), pos(1, 8, 16)], [], ((4, 2), (4, 2))),
    ("Maximum", lambda: ops.Maximum(), [r(0, 8, 16), r(1, 8, 16)], [], ((1, 8), (1, 8))),
    ("Minimum", lambda: ops.Minimum(), [r(0, 8, 16), r(1, 8, 16)], [], ((2, 4), (2, 4))),
    ("BiasAdd", lambda: ops.BiasAdd(), [r(0, 8, 16), r(1, 16)], [], ((2, 4), (4,))),
    ("ReLU", lambda: ops.ReLU(), [r(0, 8, 16)], [], ((4, 2),)),
    ("GeLU", lambda: ops.GeLU(), [r(0, 8, 16, scale=2.0)], [], ((4, 2),)),
    ("Tanh", lambda: ops.Tanh(), [r(0, 8, 16)], [], ((8, 1),)),
    ("Sigmoid", lambda: ops.Sigmoid(), [r(0, 8, 16, scale=2.0)], [], ((2, 4),)),
    ("Exp", lambda: ops.Exp(), [r(0, 8, 16)], [], ((2, 4),)),
    ("Log", lambda: ops.Log(), [pos(0, 8, 16)], [], ((2, 4),)),
    ("Sqrt", lambda: ops.Sqrt(), [pos(0, 8, 16)], [], ((2, 4),)),
    ("Square", lambda: ops.Square(), [r(0, 8, 16)], [], ((2, 4),)),
    ("Cast", lambda: ops.Cast(), [r(0, 8, 16)], [jnp.float16], ((2, 4),)),
    ("ReduceSum", lambda: ops.ReduceSum(keep_dims=False), [r(0, 8, 16)], [1], ((2, 4),)),
    ("ReduceSum-all", lambda: ops.ReduceSum(keep_dims=False), [r(0, 8, 16)], [()], ((2, 4),)),
    ("ReduceMean", lambda: ops.ReduceMean(keep_dims=True), [r(0, 8, 16)], [0], ((2, 4),)),
    ("ReduceMax", lambda: ops.ReduceMax(keep_dims=False), [r(0, 8, 16)], [-1], ((4, 2),)),
    ("Softmax", lambda: ops.Softmax(axis=-1), [r(0, 8, 16)], [], ((8, 1),)),
    ("Softmax-axis0", lambda: ops.Softmax(axis=0), [r(0, 8, 16)], [], ((1, 8),)),
    ("LogSoftmax", lambda: ops.LogSoftmax(axis=0), [r(0, 8, 16)], [], ((1, 8),)),
    ("LayerNorm", lambda: ops.LayerNorm(begin_norm_axis=1, begin_params_axis=1), [r(0, 8, 16), r(1, 16), r(2, 16)],
     [], ((8, 1), (1,), (1,))),
    # normalised over the last dim, gamma and beta over the last two
    ("LayerNorm-3d", lambda: ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=1, epsilon=1e-5),
     [r(0, 2, 4, 16), r(1, 4, 16), r(2, 4, 16)], [], ((2, 2, 1), (2, 1), (2, 1))),
    # the class dim split too: the softmax's sums cross devices
    ("SoftmaxCrossEntropyWithLogits", lambda: ops.SoftmaxCrossEntropyWithLogits(), [r(0, 8, 16), LABELS], [],
     ((2, 4), (2, 4))),
    ("Transpose", lambda: ops.Transpose(), [r(0, 8, 16)], [(1, 0)], ((2, 4),)),
    ("Transpose-3d", lambda: ops.Transpose(), [r(0, 4, 8, 2)], [(2, 0, 1)], ((2, 4, 1),)),
    ("Reshape", lambda: ops.Reshape(), [r(0, 64, 8)], [(8, -1)], ((8, 1),)),
    # the batch split 2 and the first flattened dim 4: the leading dim of the merged run
    ("Flatten", lambda: ops.Flatten(), [r(0, 8, 4, 2, 3)], [], ((2, 4, 1, 1),)),
    ("ExpandDims", lambda: ops.ExpandDims(), [r(0, 8, 16)], [-1], ((2, 4),)),
    ("Squeeze", lambda: ops.Squeeze(axis=1), [r(0, 8, 1, 16)], [], ((8, 1, 1),)),
    ("Squeeze-all", lambda: ops.Squeeze(), [r(0, 8, 1, 16, 1)], [], ((2, 1, 4, 1),)),
    ("Concat", lambda: ops.Concat(axis=1), [r(0, 8, 16), r(1, 8, 4)], [], ((8, 1), (8, 1))),
    ("StridedSlice", lambda: ops.StridedSlice(), [r(0, 8, 16)], [(0, 2), (8, 10), (1, 1)], ((8, 1),)),
    ("StridedSlice-step", lambda: ops.StridedSlice(), [r(0, 8, 16)], [(0, 1), (8, -1), (1, 3)], ((4, 1),)),
    ("Gather", lambda: ops.Gather(), [r(0, 32, 16), IDS], [0], ((1, 4), (2, 1))),
    ("Gather-vocab-split", lambda: ops.Gather(), [r(0, 32, 16), IDS], [0], ((8, 1), (1, 1))),
    ("Gather-axis1", lambda: ops.Gather(), [r(0, 16, 32), IDS], [1], ((2, 1), (2, 2))),
    ("OneHot", lambda: ops.OneHot(), [IDS[:, 0].copy()], [32, 1.5, -0.5], ((8,),)),
    ("OneHot-axis0", lambda: ops.OneHot(axis=0), [IDS.copy()], [32, 1.0, 0.0], ((2, 4),)),
    ("Conv2D-same", lambda: ops.Conv2D(8, 3, pad_mode="same"), [r(0, 4, 3, 8, 8), r(1, 8, 3, 3, 3, scale=0.2)], [],
     ((2, 1, 2, 2), (1, 1, 1, 1))),
    ("Conv2D-valid", lambda: ops.Conv2D(8, 3), [r(0, 4, 3, 8, 8), r(1, 8, 3, 3, 3, scale=0.2)], [],
     ((4, 1, 1, 1), (2, 1, 1, 1))),
    ("Conv2D-same-stride2", lambda: ops.Conv2D(4, (3, 2), pad_mode="same", stride=2),
     [r(0, 2, 4, 7, 6), r(1, 4, 4, 3, 2, scale=0.2)], [], ((2, 1, 1, 1), (2, 1, 1, 1))),
    ("Conv2D-pad-dilation", lambda: ops.Conv2D(4, 3, pad_mode="pad", pad=1, dilation=2),
     [r(0, 2, 4, 8, 8), r(1, 4, 4, 3, 3, scale=0.2)], [], ((2, 2, 1, 1), (1, 2, 1, 1))),
    # the batch split over all 8 devices (a 2-way split computes a wrong weight gradient: FOUND below)
    ("Conv2D-group", lambda: ops.Conv2D(4, 3, group=2), [r(0, 8, 4, 6, 6), r(1, 4, 2, 3, 3, scale=0.25)], [],
     ((8, 1, 1, 1), (1, 1, 1, 1))),
    ("MaxPool", lambda: ops.MaxPool(kernel_size=2, strides=2), [r(0, 4, 4, 8, 8)], [], ((2, 2, 2, 1),)),
    ("MaxPool-same", lambda: ops.MaxPool(kernel_size=3, strides=2, pad_mode="same"), [r(0, 2, 4, 7, 6)], [],
     ((2, 4, 1, 1),)),
    ("AvgPool", lambda: ops.AvgPool(kernel_size=3, strides=1), [r(0, 4, 4, 8, 8)], [], ((4, 2, 1, 1),)),
    ("AvgPool-same", lambda: ops.AvgPool(kernel_size=2, strides=1, pad_mode="same"), [r(0, 2, 4, 5, 5)], [],
     ((2, 4, 1, 1),)),
    ("BatchNorm-training", lambda: ops.BatchNorm(is_training=True), [r(0, 4, 8, 4, 4), r(1, 8), r(2, 8), r(3, 8),
                                                                     pos(4, 8)], [], ((2, 4, 1, 1),) + ((4,),) * 4),
    ("BatchNorm", lambda: ops.BatchNorm(), [r(0, 4, 8, 4, 4), r(1, 8), r(2, 8), r(3, 8), pos(4, 8)], [],
     ((2, 2, 2, 1),) + ((2,),) * 4),
]


def _is_float(a) -> bool:
    return jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)


def _loss(fn: Callable, tensors: Sequence, floats: Sequence[int], weights: Sequence) -> Callable:
    """loss(float inputs) = sum over outputs of sum(out * w), w random per element; returns (loss, outputs)."""
    def loss(fl):
        args = list(tensors)
        for i, v in zip(floats, fl, strict=True):
            args[i] = v
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        return sum(jnp.sum(o * w) for o, w in zip(outs, weights, strict=True)), outs
    return loss


def _mismatch(what: str, got, want, tol: float) -> str | None:
    """None if every value of ``got`` is within rtol = atol = tol of ``want`` (NaN never is)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape}, reference {want.shape}"
    want_dtype = np.float32 if want.dtype == np.float64 else want.dtype
    if got.dtype != want_dtype:
        return f"{what}: dtype {got.dtype}, reference {want.dtype}"
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bad = ~(err <= tol * (1.0 + np.abs(want.astype(np.float64))))
    if bad.any():
        at = np.unravel_index(np.argmax(np.where(bad, err, -1.0)), err.shape) if err.ndim else ()
        return (f"{what}: {int(bad.sum())} of {bad.size} values off (tol {tol:.2g}); worst at {tuple(map(int, at))}: "
                f"{got[at]!r} vs reference {want[at]!r}")
    return None


def compare(make: Callable[[], Any], tensors: Sequence[np.ndarray], attrs: Sequence[Any], strategy: tuple,
            modes: Sequence[str] = ("stand_alone", "semi_auto_parallel")) -> list[str]:
    """The mismatches of the primitive ``make()`` against its float64 reference: outputs and the gradients of every
    float input, eagerly in stand_alone and with ``strategy`` inside ``ms.jit`` in semi_auto_parallel."""
    ref_prim = make()
    floats = [i for i, t in enumerate(tensors) if _is_float(t)]
    shapes = [tuple(t.shape) for t in tensors]
    n_out = reduction_length(ref_prim, *shapes, *attrs)
    n_grad = gradient_length(ref_prim, *shapes, *attrs)
    with jax.enable_x64(True):
        t64 = [jnp.asarray(t, jnp.float64) if i in floats else jnp.asarray(t) for i, t in enumerate(tensors)]
        shaped = jax.eval_shape(lambda *t: reference(ref_prim, *t, *attrs), *t64)
        outs = shaped if isinstance(shaped, tuple) else (shaped,)
        weights = [r(100 + k, *o.shape) for k, o in enumerate(outs)]
        loss64 = _loss(lambda *t: reference(ref_prim, *t, *attrs), t64, floats,
                       [jnp.asarray(w, jnp.float64) for w in weights])
        g64, want = jax.jit(jax.grad(loss64, has_aux=True))([t64[i] for i in floats])
        want, g64 = [np.asarray(o) for o in want], [np.asarray(g) for g in g64]
    with ms.parallel_context(parallel_mode="stand_alone"):
        got = jax.eval_shape(lambda *t: make()(*t, *attrs), *[jnp.asarray(t) for t in tensors])
    got = got if isinstance(got, tuple) else (got,)
    if [tuple(o.shape) for o in got] != [tuple(o.shape) for o in outs]:
        return [f"output shapes {[tuple(o.shape) for o in got]}, reference {[tuple(o.shape) for o in outs]}"]
    problems = []
    for mode in modes:
        prim = make()
        args = [jnp.asarray(t) for t in tensors]
        if mode == "stand_alone":
            loss = _loss(lambda *t: prim(*t, *attrs), args, floats, [jnp.asarray(w) for w in weights])
            with ms.parallel_context(parallel_mode="stand_alone"):
                out = prim(*args, *attrs)                                   # eager: plain JAX on one device
                # the gradient as one program (op-by-op, each op's backward compiles apart: seconds for LayerNorm)
                grads = jax.jit(jax.grad(loss, has_aux=True))([args[i] for i in floats])[0] if floats else []
        else:
            prim.shard(strategy)
            with ms.parallel_context(**SEMI):
                if floats:
                    grads, out = ms.jit(lambda *t: jax.grad(_loss(lambda *a: prim(*a, *attrs), t, floats,
                                                                  [jnp.asarray(w) for w in weights]),
                                                            has_aux=True)([t[i] for i in floats]))(*args)
                else:
                    out, grads = ms.jit(lambda *t: prim(*t, *attrs))(*args), []
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) != len(want):
            problems.append(f"{mode}: {len(outs)} outputs, reference {len(want)}")
            continue
        for k, (o, w) in enumerate(zip(outs, want, strict=True)):
            problems.append(_mismatch(f"{mode} output {k}", o, w, tolerance(n_out)))
        for i, g, w in zip(floats, grads, g64, strict=True):
            problems.append(_mismatch(f"{mode} grad of input {i}", g, w, tolerance(n_grad[i])))
    return [p for p in problems if p]


# What the references found: a known disagreement (a strict xfail: an AssertionError of the comparison, a value or a
# shape off), or a case that was wrong until mshard was fixed
FOUND = [
    # mshard's BiasAdd added over the last dim; MindSpore's adds over channel dim 1 (NCHW): with W == C it was silently
    # wrong. Now MindSpore's, and data_format="NHWC" adds over the last dim
    pytest.param(lambda: ops.BiasAdd(), [r(0, 2, 4, 3, 4), r(1, 4)], [], ((2, 1, 1, 1), (1,)), id="BiasAdd-nchw"),
    pytest.param(lambda: ops.BiasAdd(), [r(0, 2, 4, 3, 4), r(1, 4)], [], ((1, 4, 1, 1), (4,)), id="BiasAdd-nchw-c-split"),
    pytest.param(lambda: ops.BiasAdd("NHWC"), [r(0, 2, 3, 4, 4), r(1, 4)], [], ((1, 1, 2, 4), (4,)), id="BiasAdd-nhwc"),
    pytest.param(lambda: ops.BiasAdd(), [r(0, 2, 4, 2, 2, 2), r(1, 4)], [], ((2, 2, 1, 1, 1), (2,)), id="BiasAdd-ncdhw"),
    pytest.param(lambda: ops.Conv2D(4, 3, pad_mode="pad", pad=(1, 0, 2, 1)), [r(0, 2, 4, 6, 6),
                                                                            r(1, 4, 4, 3, 3, scale=0.2)], [],
                 ((2, 1, 1, 1), (1, 1, 1, 1)), id="Conv2D-pad-4-tuple"),      # MindSpore's (top, bottom, left, right)
    # XLA's own grouped weight gradient is 4x here (plain jax.jit too): mshard computes it group by group
    pytest.param(lambda: ops.Conv2D(4, 3, group=2), [r(0, 2, 4, 6, 6), r(1, 4, 2, 3, 3, scale=0.25)], [],
                 ((2, 1, 1, 1), (1, 1, 1, 1)), id="Conv2D-group-batch-2-of-8"),
]


@pytest.mark.parametrize("make, tensors, attrs, strategy", [c[1:] for c in CASES] + FOUND,
                         ids=[c[0] for c in CASES] + [p.id for p in FOUND])
def test_primitive_equals_its_float64_reference(make, tensors, attrs, strategy):
    problems = compare(make, tensors, attrs, strategy)
    assert not problems, "\n".join(problems)


COLLECTIVES = {n for n, c in vars(ops).items() if inspect.isclass(c) and c.__module__ == "mshard._src.frontend.comm_ops"}


def test_every_primitive_has_a_reference_and_a_case():
    """A primitive added to mshard.ops without a reference here would be judged only against itself (the
    collectives of mshard/_src/frontend/comm_ops.py aside: tests/unit/frontend/test_primitive_ops.py and test_hybrid check them by definition)."""
    prims = {n for n, c in vars(ops).items() if inspect.isclass(c) and issubclass(c, ops.Primitive)
             and c is not ops.Primitive} - COLLECTIVES
    assert COLLECTIVES and "MatMul" in prims
    assert prims == set(REFERENCES), f"no reference: {prims - set(REFERENCES)}; not a primitive: {set(REFERENCES) - prims}"
    tested = {type(c[1]()).__name__ for c in CASES}
    assert tested == prims, f"no case: {prims - tested}"


def test_reduction_lengths():
    """The lengths the tolerances come from (Conv2D's is C_in * kh * kw per group, not C * H * W)."""
    assert reduction_length(ops.MatMul(), (8, 16), (16, 4)) == 16
    assert reduction_length(ops.MatMul(transpose_a=True), (16, 8), (16, 4)) == 16
    assert reduction_length(ops.Conv2D(8, 3, group=2), (2, 4, 16, 16), (8, 2, 3, 3)) == 18
    assert reduction_length(ops.ReduceSum(), (8, 16, 4), (0, 2)) == 32
    assert reduction_length(ops.ReduceSum(), (8, 16)) == 128
    assert reduction_length(ops.ReduceMax(), (8, 16), 1) == 1
    assert reduction_length(ops.LayerNorm(begin_norm_axis=1), (2, 4, 8), (4, 8), (4, 8)) == 32
    assert reduction_length(ops.BatchNorm(is_training=True), (4, 8, 2, 2), *[(8,)] * 4) == 16
    assert reduction_length(ops.Add(), (8, 16), (16,)) == 1
    assert gradient_length(ops.MatMul(), (8, 16), (16, 4)) == (16 + 4, 16 + 8)
    assert gradient_length(ops.Add(), (8, 16), (16,)) == (2, 9)


def _transposed(orig):
    return lambda self, *a: orig(self, *a).T


def _softmax_axis0(self, x):
    return jax.nn.softmax(x, axis=0)


@pytest.mark.parametrize("cls, wrong, case", [
    (ops.MatMul, _transposed, ("MatMul", lambda: ops.MatMul(), [r(0, 8, 8), r(1, 8, 8, scale=0.35)], [],
                               ((2, 2), (2, 2)))),
    (ops.Softmax, lambda orig: _softmax_axis0, ("Softmax", lambda: ops.Softmax(), [r(0, 8, 8)], [], ((8, 1),))),
], ids=["matmul-transposed", "softmax-wrong-axis"])
def test_a_planted_wrong_primitive_is_found(monkeypatch, cls, wrong, case):
    """The check can fail: a primitive made subtly wrong (square operands, so the shapes still agree) is reported,
    eagerly and under a strategy, in its output and its gradients."""
    _, make, tensors, attrs, strategy = case
    assert not compare(make, tensors, attrs, strategy, modes=("stand_alone",))
    monkeypatch.setattr(cls, "compute", wrong(cls.compute))
    problems = compare(make, tensors, attrs, strategy)
    for mode in ("stand_alone", "semi_auto_parallel"):
        assert any(p.startswith(f"{mode} output 0") for p in problems), problems
        assert any(p.startswith(f"{mode} grad of input 0") for p in problems), problems
