"""Hypothesis: random valid strategies on chains of MatMul / elementwise / reduce / transpose match one device;
random (mostly invalid) strategies give an mshard.errors error, never a raw JAX/XLA error."""

import jax.numpy as jnp
import numpy as np
from helpers import assert_close, on_one_device
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mshard as ms
from mshard import ops
from mshard.errors import MshardError

SIZES = (8, 16)
DIVS = (1, 2, 4, 8)


@st.composite
def split_for(draw, dims, budget=8):
    """Split counts for `dims` whose product divides 8 and each divides its dim."""
    out, left = [], budget
    for d in dims:
        c = draw(st.sampled_from([c for c in DIVS if left % c == 0 and d % c == 0]))
        out.append(c)
        left //= c
    return tuple(out)


@st.composite
def chains(draw):
    b, d = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    steps, shape = [], (b, d)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["matmul", "add", "relu", "transpose", "reduce"]))
        if kind == "matmul":
            n = draw(st.sampled_from(SIZES))
            m, k, nn_ = draw(split_for((shape[0], shape[1], n)))
            steps.append(("matmul", ((m, k), (k, nn_)), n))
            shape = (shape[0], n)
        elif kind in ("add", "relu", "transpose", "reduce"):
            s = draw(split_for(shape))
            steps.append((kind, s, None))
            if kind == "transpose":
                shape = shape[::-1]
            if kind == "reduce":
                shape = (shape[0], 1)
                if shape[1] == 1:
                    pass
    return (b, d), steps


def build(steps, rng):
    fns = []
    for kind, s, n in steps:
        if kind == "matmul":
            op = ops.MatMul().shard(s)
            fns.append(("matmul", op))
        elif kind == "add":
            fns.append(("add", ops.Add().shard((s, s))))
        elif kind == "relu":
            fns.append(("relu", ops.ReLU().shard((s,))))
        elif kind == "transpose":
            fns.append(("transpose", ops.Transpose().shard((s,))))
        else:
            fns.append(("reduce", ops.ReduceSum(keep_dims=True).shard((s,))))
    return fns


def make_program(fns, steps):
    def program(x, *ws):
        it = iter(ws)
        for (kind, op), (_, _, n) in zip(fns, steps, strict=True):
            if kind == "matmul" or kind == "add":
                x = op(x, next(it))
            elif kind == "relu":
                x = op(x)
            elif kind == "transpose":
                x = op(x, (1, 0))
            else:
                x = op(x, 1)
        return x
    return program


def operands(shape0, steps, rng):
    shape, ws = shape0, []
    for kind, s, n in steps:
        if kind == "matmul":
            ws.append(rng.standard_normal((shape[1], n)).astype(np.float32))
            shape = (shape[0], n)
        elif kind == "add":
            ws.append(rng.standard_normal(shape).astype(np.float32))
        elif kind == "transpose":
            shape = shape[::-1]
        elif kind == "reduce":
            shape = (shape[0], 1)
    return ws


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains(), st.integers(0, 2**16))
def test_random_valid_strategies_match_one_device(chain, seed):
    shape0, steps = chain
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape0).astype(np.float32)
    ws = operands(shape0, steps, rng)
    fns = build(steps, rng)
    program = make_program(fns, steps)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        y = ms.jit(program)(jnp.asarray(x), *map(jnp.asarray, ws))
    ref = on_one_device(program, x, *ws)     # primitives outside a region are plain JAX
    # float32: <= 4 ops on unscaled normals, dot products of <= 16 terms reordered by the split (16 * 2**-24 = 1e-6
    # relative each, compounded over <= 4 matmuls that grow |y| ~4x each); atol for sums that cancel near 0
    assert_close(y, ref, rtol=1e-4, atol=1e-4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([1, 2, 3, 4, 5, 8, 16, 0, -2]), min_size=1, max_size=3),
       st.lists(st.sampled_from([1, 2, 3, 4, 5, 8, 16]), min_size=1, max_size=3),
       st.sampled_from([(12, 8), (16, 16), (8, 24)]), st.sampled_from([8, 4, 6]))
def test_random_strategies_never_raise_raw_jax_errors(s1, s2, shape, device_num):
    x = jnp.ones(shape)
    w = jnp.ones((shape[1], 8))
    try:
        with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=device_num):
            mm = ops.MatMul().shard((tuple(s1), tuple(s2)))
            y = ms.jit(lambda x, w: mm(x, w))(x, w)
    except MshardError as e:
        assert isinstance(e, (ValueError, TypeError)) and str(e)
        return
    # ones @ ones: every entry is the integer shape[1] (<= 24), exact in float32 in any order; 1e-5 only rules out noise
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w), rtol=1e-5)
