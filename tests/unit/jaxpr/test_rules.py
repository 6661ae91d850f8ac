"""Table-driven tests of mshard._src.jaxpr.rules: every registered rule, checked against shapes and against XLA.

For each case the target primitive's iteration space must fit the equation's shapes; then, for
each loop dim the rule lets a strategy split (in 2, over mesh axis ``d0``), the primitive runs under
``jax.jit`` with its operands and results constrained to the layouts the rule implies. The result
must equal the unsharded one, and the compiled HLO must hold the collective the rule predicts:
none for a free dim, an all-reduce (or reduce-scatter) for a split reduction dim. A sweep checks
that every registered primitive has a case or a reason in ``UNTESTED``.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mshard._src.jaxpr import rules

MESH = jax.make_mesh((2, 2, 2), ("d0", "d1", "d2"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
RNG = np.random.default_rng(0)


def f32(*shape, lo=0.2, hi=0.9):
    return jnp.asarray(RNG.uniform(lo, hi, shape), jnp.float32)


def i32(*shape, hi=5):
    return jnp.asarray(RNG.integers(0, hi, shape), jnp.int32)


def b8(*shape):
    return jnp.asarray(RNG.integers(0, 2, shape).astype(bool))


def c64(*shape):
    return jnp.asarray(RNG.uniform(0.2, 0.9, shape) + 1j * RNG.uniform(0.2, 0.9, shape), jnp.complex64)


KEY = jax.random.key(0)
KEYS4 = jax.random.split(KEY, 4)


@dataclass
class Case:
    id: str
    prim: str
    fn: Callable
    args: tuple
    max_splits: int = 99               # family members check only their first splittable dim
    expect_unsplittable: set = field(default_factory=set)   # loop dims the rule must keep whole
    expect_reduce: str | None = None


# -- the elementwise families: one case per primitive --------------------------------------------
X, Y = f32(4, 6), f32(4, 6)
UNARY_CASES = {
    "abs": (lax.abs, (X,)), "acos": (lax.acos, (X,)), "acosh": (lambda x: lax.acosh(x + 1.0), (X,)),
    "asin": (lax.asin, (X,)), "asinh": (lax.asinh, (X,)), "atan": (lax.atan, (X,)),
    "atanh": (lax.atanh, (X,)),
    "bessel_i0e": (lax.bessel_i0e, (X,)), "bessel_i1e": (lax.bessel_i1e, (X,)), "cbrt": (lax.cbrt, (X,)),
    "ceil": (lax.ceil, (X,)), "clz": (lax.clz, (i32(4, 6),)), "conj": (lax.conj, (c64(4, 6),)),
    "cos": (lax.cos, (X,)), "cosh": (lax.cosh, (X,)), "digamma": (lax.digamma, (X,)), "erf": (lax.erf, (X,)),
    "erf_inv": (lax.erf_inv, (X,)), "erfc": (lax.erfc, (X,)), "exp": (lax.exp, (X,)),
    "exp2": (lax.exp2, (X,)),
    "expm1": (lax.expm1, (X,)), "floor": (lax.floor, (X,)), "imag": (lax.imag, (c64(4, 6),)),
    "is_finite": (lax.is_finite, (X,)), "lgamma": (lax.lgamma, (X,)), "log": (lax.log, (X,)),
    "log1p": (lax.log1p, (X,)), "logistic": (lax.logistic, (X,)), "neg": (lax.neg, (X,)),
    "not": (lax.bitwise_not, (b8(4, 6),)), "population_count": (lax.population_count, (i32(4, 6),)),
    "real": (lax.real, (c64(4, 6),)), "round": (lax.round, (X,)), "rsqrt": (lax.rsqrt, (X,)),
    "sign": (lax.sign, (X - 0.5,)), "sin": (lax.sin, (X,)), "sinh": (lax.sinh, (X,)),
    "sqrt": (lax.sqrt, (X,)),
    "square": (lax.square, (X,)), "tan": (lax.tan, (X,)), "tanh": (lax.tanh, (X,)),
    "integer_pow": (lambda x: lax.integer_pow(x, 3), (X,)),
    "convert_element_type": (lambda x: x.astype(jnp.int32), (X * 10,)), "copy": (jnp.copy, (X,)),
    "reduce_precision": (lambda x: lax.reduce_precision(x, 5, 10), (X,)),
    "stop_gradient": (lax.stop_gradient, (X,)), "name": (lambda x: checkpoint_name(x, "h"), (X,)),
    "sharding_constraint": (lambda x: lax.with_sharding_constraint(x, NamedSharding(MESH, P("d1"))), (X,)),
    "random_seed": (jax.vmap(jax.random.key), (i32(4, hi=100),)),
    "random_clone": (jax.vmap(jax.random.clone), (KEYS4,)),
}
NARY_CASES = {
    "add": (lax.add, (X, Y)), "sub": (lax.sub, (X, Y)), "mul": (lambda x: x * 2.0, (X,)),
    "div": (lax.div, (X, Y)), "rem": (lax.rem, (X, Y)), "pow": (lax.pow, (X, Y)), "max": (lax.max, (X, Y)),
    "min": (lax.min, (X, Y)), "atan2": (lax.atan2, (X, Y)), "nextafter": (lax.nextafter, (X, Y)),
    "and": (lax.bitwise_and, (i32(4, 6), i32(4, 6))), "or": (lax.bitwise_or, (b8(4, 6), b8(4, 6))),
    "xor": (lax.bitwise_xor, (i32(4, 6), i32(4, 6))), "eq": (lax.eq, (i32(4, 6), i32(4, 6))),
    "ne": (lax.ne, (X, Y)), "lt": (lax.lt, (X, Y)), "le": (lax.le, (X, Y)), "gt": (lax.gt, (X, Y)),
    "ge": (lax.ge, (X, Y)), "shift_left": (lax.shift_left, (i32(4, 6), i32(4, 6))),
    "shift_right_arithmetic": (lax.shift_right_arithmetic, (i32(4, 6), i32(4, 6))),
    "shift_right_logical": (lax.shift_right_logical, (i32(4, 6), i32(4, 6))),
    "complex": (lax.complex, (X, Y)), "igamma": (lax.igamma, (X, Y)), "igammac": (lax.igammac, (X, Y)),
    "igamma_grad_a": (lax.igamma_grad_a, (X, Y)),
    "polygamma": (lambda x: lax.polygamma(jnp.ones_like(x), x), (X,)), "zeta": (lax.zeta, (X + 1.5, Y)),
    "regularized_incomplete_beta": (lax.betainc, (X, Y, f32(4, 6))),
    "add_any": (jax.grad(lambda x: (x * x + jnp.sin(x)).sum()), (X,)),
    "select_n": (lax.select_n, (b8(4, 6), X, Y)), "clamp": (lambda x: lax.clamp(0.3, x, 0.7), (X,)),
    "mulhi": (lax.mulhi, (i32(4, 6, hi=1000), i32(4, 6, hi=1000))),
    "random_fold_in": (jax.vmap(jax.random.fold_in), (KEYS4, i32(4))),
}

CASES: list[Case] = [Case(n, n, fn, args, max_splits=1)
                     for n, (fn, args) in {**UNARY_CASES, **NARY_CASES}.items()]

# -- structured rules: every splittable dim is checked --------------------------------------------
NHWC = ("NHWC", "HWIO", "NHWC")
dn = lambda c, b=((), ()): (c, b)
CASES += [
    Case("matmul", "dot_general", lambda x, w: x @ w, (f32(8, 4), f32(4, 6)), expect_reduce="sum"),
    Case("matmul_tb", "dot_general", lambda x, w: lax.dot_general(x, w, dn(((1,), (1,)))),
         (f32(8, 4), f32(6, 4))),
    Case("bmm", "dot_general", lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), (f32(2, 4, 6), f32(2, 6, 8))),
    Case("attn_scores", "dot_general", lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
         (f32(2, 4, 2, 6), f32(2, 4, 2, 6))),
    Case("reduce_sum", "reduce_sum", lambda x: x.sum(1), (f32(4, 6, 8),), expect_reduce="sum"),
    Case("reduce_max", "reduce_max", lambda x: x.max((0, 2)), (f32(4, 6, 8),), expect_reduce="max"),
    Case("reduce_min", "reduce_min", lambda x: x.min(-1), (f32(4, 6),), expect_reduce="min"),
    Case("reduce_prod", "reduce_prod", lambda x: x.prod(0), (f32(4, 6, lo=0.9, hi=1.1),),
         expect_reduce="prod"),
    Case("reduce_and", "reduce_and", lambda x: x.all(1), (b8(4, 6),), expect_reduce="and"),
    Case("reduce_or", "reduce_or", lambda x: x.any(1), (b8(4, 6),), expect_reduce="or"),
    Case("reduce_xor", "reduce_xor", lambda x: lax.reduce(x, 0, lax.bitwise_xor, (1,)), (i32(4, 6),),
         expect_unsplittable={"i1"}),
    Case("reduce_generic", "reduce", lambda x, y: lax.reduce((x, y), (0.0, 1.0),
         lambda a, b: (a[0] + b[0], a[1] * b[1]), (1,)), (f32(4, 6), f32(4, 6)), expect_unsplittable={"i1"}),
    Case("argmax", "argmax", lambda x: jnp.argmax(x, 1), (f32(4, 6),), expect_unsplittable={"i1"}),
    Case("argmin", "argmin", lambda x: jnp.argmin(x, 0), (f32(4, 6),), expect_unsplittable={"i0"}),
    Case("broadcast_in_dim", "broadcast_in_dim", lambda x: lax.broadcast_in_dim(x, (2, 4, 6), (1, 2)),
         (f32(4, 1),)),
    Case("expand_dims", "broadcast_in_dim", lambda x: jnp.expand_dims(x, 1), (f32(4, 6),)),
    Case("reshape_merge", "reshape", lambda x: x.reshape(24, 8), (f32(4, 6, 8),)),
    Case("reshape_split", "reshape", lambda x: x.reshape(4, 6, 8), (f32(24, 8),)),
    Case("reshape_heads", "reshape", lambda x: x.reshape(2, 4, 4, 4), (f32(2, 4, 16),)),
    Case("reshape_merge_heads", "reshape", lambda x: x.reshape(2, 4, 16), (f32(2, 4, 4, 4),)),
    Case("reshape_ones", "reshape", lambda x: x.reshape(4, 6), (f32(4, 1, 6),)),
    Case("reshape_odd", "reshape", lambda x: x.reshape(4, 6), (f32(6, 4),)),
    Case("transpose", "transpose", lambda x: x.transpose(2, 0, 1), (f32(2, 4, 6),)),
    Case("squeeze", "squeeze", lambda x: lax.squeeze(x, (1,)), (f32(4, 1, 6),)),
    Case("concatenate", "concatenate", lambda x, y: jnp.concatenate([x, y], 1), (f32(4, 6), f32(4, 2)),
         expect_unsplittable={"i1"}),
    Case("split", "split", lambda x: jnp.split(x, 2, axis=1), (f32(4, 8),), expect_unsplittable={"a0", "a1"}),
    Case("slice", "slice", lambda x: x[:, 2:5], (f32(4, 8),), expect_unsplittable={"i1"}),
    Case("slice_strided", "slice", lambda x: x[::2], (f32(8, 6),), expect_unsplittable={"i0"}),
    Case("dynamic_slice", "dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, 0), (2, 6)),
         (f32(4, 6), jnp.int32(1)), expect_unsplittable={"i0"}),
    Case("dynamic_update_slice", "dynamic_update_slice",
         lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)), (f32(4, 8), f32(4, 2), jnp.int32(3)),
         expect_unsplittable={"i1"}),
    Case("pad", "pad", lambda x: lax.pad(x, 0.0, [(1, 1, 0), (0, 0, 0)]), (f32(4, 6),),
         expect_unsplittable={"i0"}),
    Case("rev", "rev", lambda x: lax.rev(x, (1,)), (f32(4, 6),), expect_unsplittable={"i1"}),
    Case("tile", "tile", lambda x: jnp.tile(x, (1, 2)), (f32(4, 6),), expect_unsplittable={"i1"}),
    Case("iota", "iota", lambda: lax.broadcasted_iota(jnp.int32, (4, 6), 1), ()),
    Case("bitcast_same", "bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.uint32), (X,)),
    Case("bitcast_wider", "bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.uint8), (X,)),
    Case("bitcast_narrower", "bitcast_convert_type", lambda x: lax.bitcast_convert_type(x, jnp.float32),
         (jnp.zeros((4, 6, 4), jnp.uint8),)),
    # gather / scatter
    Case("embedding", "gather", lambda t, i: t[i], (f32(8, 6), i32(2, 4, hi=8)), expect_reduce="sum"),
    Case("take", "gather", lambda t, i: jnp.take(t, i, axis=0), (f32(8, 6), i32(2, 4, hi=8))),
    Case("gather_cols", "gather", lambda x, i: x[:, i], (f32(4, 8), i32(6, hi=8))),
    Case("gather_points", "gather", lambda x, i, j: x[i, j], (f32(4, 8), i32(6, hi=4), i32(6, hi=8))),
    Case("take_along_axis", "gather", lambda x, i: jnp.take_along_axis(x, i, axis=1),
         (f32(4, 8), i32(4, 2, hi=8))),
    Case("gather_window", "gather", lambda x, i: lax.gather(
        x, i, lax.GatherDimensionNumbers(offset_dims=(1, 2), collapsed_slice_dims=(), start_index_map=(0,)),
        (2, 6), mode="clip"), (f32(4, 6), i32(3, 1, hi=3)), expect_unsplittable={"o0"}),
    Case("embedding_grad", "scatter-add", jax.grad(lambda t, i: (t[i] ** 2).sum()),
         (f32(8, 6), i32(2, 4, hi=8)), expect_reduce="sum"),
    Case("scatter_add", "scatter-add", lambda x, i, u: x.at[i].add(u), (f32(8, 6), i32(4, hi=8), f32(4, 6))),
    Case("scatter_sub", "scatter-sub", lambda x, i, u: x.at[i].subtract(u),
         (f32(8, 6), i32(4, hi=8), f32(4, 6))),
    Case("scatter_mul", "scatter-mul", lambda x, i, u: x.at[i].multiply(u),
         (f32(8, 6), i32(4, hi=8), f32(4, 6))),
    Case("scatter_min", "scatter-min", lambda x, i, u: x.at[i].min(u), (f32(8, 6), i32(4, hi=8), f32(4, 6))),
    Case("scatter_max", "scatter-max", lambda x, i, u: x.at[i].max(u), (f32(8, 6), i32(4, hi=8), f32(4, 6))),
    Case("scatter_set", "scatter", lambda x, i, u: x.at[i].set(u), (f32(8, 6), jnp.arange(4) * 2, f32(4, 6)),
         expect_unsplittable={"u0", "p0"}),
    Case("scatter_slice", "scatter", lambda x: x.at[:, 1:3].set(0.0), (f32(4, 6),)),
    # convolutions
    Case("conv3x3", "conv_general_dilated",
         lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=NHWC),
         (f32(2, 6, 6, 4), f32(3, 3, 4, 6)), expect_unsplittable={"k0", "k1"}),     # s0, s1: halo dims
    Case("conv1x1", "conv_general_dilated",
         lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID"), (f32(2, 4, 6, 6), f32(6, 4, 1, 1))),
    Case("conv_strided", "conv_general_dilated",
         lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "VALID"), (f32(2, 4, 8, 8), f32(6, 4, 2, 2))),
    Case("conv_grouped", "conv_general_dilated",
         lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=2),
         (f32(2, 4, 6, 6), f32(6, 2, 3, 3)), expect_unsplittable={"c", "o"}),
    Case("conv_grad_kernel", "conv_general_dilated",
         lambda x, w: jax.grad(lambda w: lax.conv_general_dilated(x, w, (1, 1), "SAME").sum())(w),
         (f32(2, 4, 6, 6), f32(6, 4, 3, 3))),
    # windows
    Case("avg_pool", "reduce_window_sum",
         lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
         (f32(2, 6, 6, 4),),
         expect_unsplittable={"i1", "i2"}),
    Case("max_pool", "reduce_window_max",
         lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
         (f32(2, 6, 6, 4),)),
    Case("min_pool", "reduce_window_min",
         lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 3), (1, 1), "SAME"), (f32(4, 6),)),
    Case("prod_pool", "reduce_window",
         lambda x: lax.reduce_window(x, 1.0, lax.mul, (1, 2), (1, 2), "VALID"), (f32(4, 6),)),
    Case("max_pool_grad", "select_and_scatter_add",
         jax.grad(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID").sum()),
         (f32(4, 6),)),
    Case("max_pool_jvp", "select_and_gather_add",
         lambda x, t: jax.jvp(lambda y: lax.reduce_window(y, -jnp.inf, lax.max, (1, 2), (1, 2), "VALID"),
                              (x,), (t,))[1], (f32(4, 6), f32(4, 6))),
    # scans, sorts
    Case("cumsum", "cumsum", lambda x: lax.cumsum(x, 1), (f32(4, 6),), expect_unsplittable={"i1"}),
    Case("cumprod", "cumprod", lambda x: lax.cumprod(x, 0), (f32(4, 6),)),
    Case("cummax", "cummax", lambda x: lax.cummax(x, 1), (f32(4, 6),)),
    Case("cummin", "cummin", lambda x: lax.cummin(x, 1), (f32(4, 6),)),
    Case("cumlogsumexp", "cumlogsumexp", lambda x: lax.cumlogsumexp(x, 1), (f32(4, 6),)),
    Case("sort", "sort", lambda x: lax.sort(x, dimension=0), (f32(4, 6),), expect_unsplittable={"i0"}),
    Case("sort_kv", "sort", lambda k, v: lax.sort((k, v), dimension=1, num_keys=1), (f32(4, 6), f32(4, 6))),
    Case("top_k", "top_k", lambda x: lax.top_k(x, 3), (f32(4, 6),)),
    Case("approx_top_k", "approx_top_k", lambda x: lax.approx_max_k(x, 2), (f32(4, 6),)),
    # identities of several operands
    Case("optimization_barrier", "optimization_barrier", lambda x, y: lax.optimization_barrier((x, y)),
         (f32(4, 6), f32(2,))),
    Case("device_put", "device_put", lambda x: jax.device_put(x), (X,)),
    # random
    Case("rng_bit_generator", "rng_bit_generator", lambda k: lax.rng_bit_generator(k, (4, 6)),
         (jnp.zeros(4, jnp.uint32),)),
    Case("rng_uniform", "rng_uniform", lambda: lax.rng_uniform(0.0, 1.0, (4,)), ()),
    Case("random_gamma", "random_gamma", lambda a: jax.random.gamma(KEY, a), (X + 1,)),
    Case("random_bits", "random_bits", lambda k: jax.random.bits(k, (4, 6)), (KEY,)),
    Case("random_bits_batched", "random_bits", jax.vmap(lambda k: jax.random.bits(k, (3,))), (KEYS4,)),
    Case("random_split", "random_split", jax.vmap(lambda k: jax.random.split(k, 2)), (KEYS4,)),
    Case("random_wrap", "random_wrap", jax.random.wrap_key_data, (jnp.ones((4, 2), jnp.uint32),)),
    Case("random_unwrap", "random_unwrap", jax.random.key_data, (KEYS4,)),
    Case("threefry2x32", "threefry2x32", jax.extend.random.threefry_2x32,
         (jnp.ones(2, jnp.uint32), jnp.arange(8, dtype=jnp.uint32))),
    # control flow (scan, while, cond: their carry and operands keep their layouts) and opaque ops (one replicated op)
    Case("scan", "scan", lambda x: lax.scan(lambda c, a: (c + a, c * a), jnp.zeros(6), x), (f32(4, 6),)),
    Case("while", "while", lambda x: lax.while_loop(lambda a: a.sum() < 100, lambda a: a + 1, x), (X,)),
    Case("cond", "cond", lambda p, x: lax.cond(p, lambda a: a + 1, lambda a: a - 1, x), (jnp.bool_(True), X)),
    Case("shard_map", "shard_map",
         lambda x: jax.shard_map(lambda a: a * 2, mesh=MESH, in_specs=P(), out_specs=P())(x), (X,)),
    Case("custom_linear_solve", "custom_linear_solve",
         lambda b: lax.custom_linear_solve(lambda v: 2 * v, b, lambda mv, v: v / 2), (f32(4),)),
    Case("pure_callback", "pure_callback",
         lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x), (X,)),
    Case("fft", "fft", jnp.fft.fft, (c64(4, 8),)),
    Case("cholesky", "cholesky", lambda a: lax.linalg.cholesky(a, symmetrize_input=False),
         (jnp.eye(4) * 2.0,)),
    Case("triangular_solve", "triangular_solve",
         lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True),
         (jnp.eye(4) * 2.0, f32(4, 3))),
    Case("lu", "lu", lambda a: lax.linalg.lu(a), (jnp.eye(4) * 2.0 + 0.1,)),
    Case("qr", "qr", lambda a: jnp.linalg.qr(a), (f32(4, 4),)),
    Case("eigh", "eigh", lambda a: jnp.linalg.eigh(a), (jnp.eye(4) * 2.0,)),
    Case("svd", "svd", lambda a: jnp.linalg.svd(a), (f32(4, 4),)),
]

# registered but without a case here, each with the reason
UNTESTED = {
    **{n: "inlined by mshard._src.jaxpr.op_graph (tests/unit/jaxpr/test_op_graph.py); its fallback rule is replicated_rule"
       for n in rules.INLINE},
    "mshard_mark": "defined by mshard.ops; traced in tests/unit/jaxpr/test_op_graph.py with a stand-in primitive",
    "copy_p": "an old name of copy",
    "zeros_like": "only inside JAX's AD machinery, never in a traced jaxpr",
    "reshard": "needs Explicit mesh axes; same rule as sharding_constraint",
    "pvary": "only inside shard_map bodies, which are one replicated op",
    "io_callback": "same rule as pure_callback", "debug_callback": "same rule as pure_callback",
    "debug_print": "replicated_rule (ops.Print gathers what it prints); run inside a region in "
                   "tests/unit/frontend/test_mindspore_ops.py",
    "custom_partitioning": "replicated_rule, as shard_map", "ffi_call": "replicated_rule, as shard_map",
    "linear_call": "replicated_rule, as shard_map", "run_state": "replicated_rule, as shard_map",
    "select_and_scatter": "only from lax internals; same window_rule as select_and_scatter_add",
    "random_gamma_grad": "lax expands it into elementwise ops before tracing; elementwise_rule",
    "empty2": "only from JAX's partial evaluation of a differentiated cond (iota_rule); traced in "
              "tests/e2e/search/test_branch_bodies.py",
}

# (case id, loop dim): why XLA's compiled HLO differs from the rule's prediction (numbers still match)
_ITERATIVE = "XLA expands it into a while loop whose convergence test all-reduces a flag over the whole array"
KNOWN_COMM = {
    ("igamma", "i0"): _ITERATIVE, ("igammac", "i0"): _ITERATIVE, ("igamma_grad_a", "i0"): _ITERATIVE,
    ("regularized_incomplete_beta", "i0"): _ITERATIVE,
    ("sharding_constraint", "i0"): ("the constraint moves the split to its own axis d1 (a "
                                    "collective-permute); the rule sees an identity, fixing the "
                                    "layout is the caller's job"),
    **{("while", d): ("the condition sums the whole carry (a.sum() < 100): a split carry's partial sums are "
                      "all-reduced every iteration; the rule does not price the condition or the body "
                      "(mshard._src.jaxpr.rules.while_carry_rule), only the layout the carry keeps"
                      ) for d in ("c0_0", "c0_1")},
    **{("cond", d): ("the operand is read split and the result asked whole: the branch (a + 1) computes split and "
                     "its result is gathered; the rule does not price the branches "
                     "(mshard._src.jaxpr.rules.cond_branches_rule), the planned branches do "
                     "(mshard._src.planning.scan_bodies)") for d in ("k1_0", "k1_1")},
    ("scan", "c0_0"): ("a split carry keeps its layout across steps, but the body meets the replicated "
                       "scanned input and XLA gathers inside it; the rule does not price the body "
                       "(mshard._src.jaxpr.rules.scan_carry_rule), only the layout the carry leaves in"),
}
# case ids whose sharded program does not compile on the CPU backend: only the space is checked
KNOWN_NO_RUN = {
    "mulhi": "CPU: 'failed to legalize mhlo.unknown' for a sharded mulhi",
}

COLLECTIVE = re.compile(
    r"\s(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)(?:-start)?\(")


# -- harness ---------------------------------------------------------------------------------------
def _bind(eqn, vals):
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _find(jaxpr, consts, args, prim):
    """The first equation of ``prim`` (inlined sub-jaxprs searched too) and its operand values."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        if eqn.primitive.name == prim:
            return eqn, vals
        key = rules.INLINE.get(eqn.primitive.name)
        sub = eqn.params.get(key) if key else None
        if sub is not None:
            inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
            found = _find(inner, getattr(sub, "consts", []), vals, prim)
            if found is not None:
                return found
        env.update(zip(eqn.outvars, _bind(eqn, vals), strict=True))
    return None


def _target(case):
    cj = jax.make_jaxpr(case.fn)(*case.args)
    found = _find(cj.jaxpr, cj.consts, case.args, case.prim)
    assert found is not None, f"{case.id}: no {case.prim} equation in\n{cj}"
    return found


def _shape(v):
    return tuple(getattr(v.aval, "shape", ()))


def _np(x):
    if jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def _splittable(s: rules.IterSpace) -> list[str]:
    """The loop dims a split over 2 devices may take alone: not unsplittable, even, and not a minor part of a dim
    made of several loop dims (split only after the parts before it are split whole)."""
    minor = {d for labels in (*s.in_dims, *s.out_dims) for lab in labels if isinstance(lab, tuple) for d in lab[1:]}
    return [d for d, n in s.dims.items()
            if d not in s.unsplittable and d not in minor and n % 2 == 0 and s.split_divides.get(d, 2) % 2 == 0]


def _spec(labels, d):
    """The layout of a tensor with loop dims ``labels`` when loop dim ``d`` is split over ``d0`` (a dim made of
    several loop dims is split when its major one is)."""
    major = lambda lab: lab[0] if isinstance(lab, tuple) else lab
    return NamedSharding(MESH, P(*["d0" if major(lab) == d else None for lab in labels]))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule(case: Case):
    eqn, vals = _target(case)
    in_shapes, out_shapes = [_shape(v) for v in eqn.invars], [_shape(v) for v in eqn.outvars]
    s = rules.iteration_space(case.prim, in_shapes, out_shapes, eqn.params)   # warnings are errors
    assert case.prim in rules.RULES
    s.check(in_shapes, out_shapes)
    assert case.expect_unsplittable <= s.unsplittable, (case.expect_unsplittable, s)
    if case.expect_reduce is not None:
        assert s.reduce == case.expect_reduce and s.reduction_dims

    if case.id in KNOWN_NO_RUN:
        return
    ref = [_np(o) for o in _bind(eqn, vals)]
    for d in _splittable(s)[:case.max_splits]:
        def f(*ops, d=d):
            ops = [lax.with_sharding_constraint(x, _spec(lab, d)) for x, lab in zip(ops, s.in_dims, strict=True)]
            outs = _bind(eqn, ops)
            return [lax.with_sharding_constraint(o, _spec(lab, d)) for o, lab in zip(outs, s.out_dims, strict=True)]
        args = [jnp.asarray(v) for v in vals]
        compiled = jax.jit(f).lower(*args).compile()
        for r, g in zip(ref, compiled(*args), strict=True):
            # float32 on inputs in [0.2, 0.9]: splitting a dim over 2 devices reorders sums of up to 72 positive terms
            # (conv_grad_kernel: 2 x 6 x 6), <= 72 * 2**-24 = 4.3e-6 relative; special functions compiled for the shard's shape
            # may vectorise differently (a few ulps, compounded over betainc's continued-fraction iterations); atol: outputs ~ 0
            np.testing.assert_allclose(_np(g), r, rtol=2e-5, atol=1e-5, err_msg=f"{case.id}: split {d}")
        kinds = set(COLLECTIVE.findall(compiled.as_text()))
        # a reduction dim: partial sums combined; a halo dim (a "same" window): the neighbours' rows exchanged
        want = {"all-reduce"} if d in s.reduction_dims else {"collective-permute"} if d in s.halo else set()
        ok = kinds <= {"all-reduce", "reduce-scatter"} and bool(kinds) if d in s.reduction_dims else kinds == want
        if (case.id, d) in KNOWN_COMM:
            continue
        assert ok, (f"{case.id}: splitting {d} ({s.dims[d]}) gave collectives {sorted(kinds)}, "
                    f"rule predicts {sorted(want) or 'none'}\n{s}")


def test_every_registered_rule_is_covered():
    tested = {c.prim for c in CASES}
    missing = set(rules.RULES) - tested - set(UNTESTED)
    assert not missing, f"registered rules without a case or a reason in UNTESTED: {sorted(missing)}"
    assert not (tested & set(UNTESTED)), "a primitive is both tested and listed as untested"


def test_families_registered():
    for n in rules.UNARY + rules.NARY:
        assert rules.RULES[n] is rules.elementwise_rule
    assert {c.prim for c in CASES} >= set(rules.UNARY + rules.NARY) - set(UNTESTED)


# -- specific iteration spaces ----------------------------------------------------------------------
def test_dot_general_spaces():
    s = rules.iteration_space("dot_general", [(8, 4), (6, 4)], [(8, 6)],
                              {"dimension_numbers": (((1,), (1,)), ((), ()))})
    assert s.in_dims == (("m0", "k0"), ("n0", "k0")) and s.out_dims == (("m0", "n0"),)
    s = rules.iteration_space("dot_general", [(2, 4, 6), (2, 6, 8)], [(2, 4, 8)],
                              {"dimension_numbers": (((2,), (1,)), ((0,), (0,)))})
    assert list(s.dims) == ["b0", "m0", "n0", "k0"] and s.reduction_dims == ("k0",)


def test_elementwise_broadcasting():
    s = rules.elementwise_rule([(4, 6), (), (1, 6), (6,)], [(4, 6)])
    assert s.in_dims == (("i0", "i1"), (), (None, "i1"), ("i1",))


def test_embedding_space():
    eqn, _ = _target(Case("e", "gather", lambda t, i: t[i], (f32(10, 8), i32(2, 3, hi=10))))
    s = rules.iteration_space("gather", [_shape(v) for v in eqn.invars], [_shape(v) for v in eqn.outvars],
                              eqn.params)
    assert s.in_dims == (("v", "o0"), ("g0", "g1", None)) and s.out_dims == (("g0", "g1", "o0"),)
    assert s.reduction_dims == ("v",) and s.reduce == "sum" and not s.unsplittable
    grad = jax.grad(lambda t, i: t[i].sum())
    eqn, _ = _target(Case("g", "scatter-add", grad, (f32(10, 8), i32(2, 3, hi=10))))
    s = rules.iteration_space("scatter-add", [_shape(v) for v in eqn.invars],
                              [_shape(v) for v in eqn.outvars], eqn.params)
    assert s.in_dims == (("p0", "p1"), ("u0", "u1", None), ("u0", "u1", "p1"))
    assert s.out_dims == (("p0", "p1"),)
    assert set(s.reduction_dims) == {"u0", "u1"} and s.reduce == "sum" and not s.unsplittable


def test_reshape_runs_and_split_divides():
    assert rules.reshape_runs((2, 4, 16), (2, 4, 4, 4)) == [([0], [0]), ([1], [1]), ([2], [2, 3])]
    # 16 -> (4, 4): the 16 is made of the two new dims (a tuple of loop dims, major first)
    s = rules.iteration_space("reshape", [(2, 4, 16)], [(2, 4, 4, 4)], {"new_sizes": (2, 4, 4, 4),
                                                                        "dimensions": None})
    assert s.in_dims == (("r0", "r1", ("r2_0", "r2_1")),) and s.out_dims == (("r0", "r1", "r2_0", "r2_1"),)
    assert not s.split_divides and not s.unsplittable and s.dims["r2_0"] == s.dims["r2_1"] == 4
    # (4, 6) -> 24: the merge, the other way round
    s = rules.iteration_space("reshape", [(4, 6, 8)], [(24, 8)], {"new_sizes": (24, 8), "dimensions": None})
    assert s.in_dims == (("r0_0", "r0_1", "r1"),) and s.out_dims == ((("r0_0", "r0_1"), "r1"),)
    # (6, 4) -> (4, 6): no common factors (6 is no multiple of 4): the leading dims share a loop dim whose split
    # must divide both, gcd(6, 4) = 2; the rest is replicated / unsplittable
    s = rules.iteration_space("reshape", [(6, 4)], [(4, 6)], {"new_sizes": (4, 6), "dimensions": None})
    assert s.in_dims == (("r0", None),) and s.out_dims == (("r0", "r0_1"),)
    assert s.split_divides == {"r0": 2} and s.unsplittable == {"r0_1"}
    assert rules.common_factors((64, 8), (4, 128)) == [4, 16, 8] and rules.common_factors((6, 4), (4, 6)) is None


def test_conv_spaces():
    eqn, _ = _target(CASES[[c.id for c in CASES].index("conv1x1")])
    s = rules.iteration_space(eqn.primitive.name, [_shape(v) for v in eqn.invars],
                              [_shape(v) for v in eqn.outvars], eqn.params)
    assert s.in_dims == (("n", "c", "s0", "s1"), ("o", "c", "k0", "k1"))
    assert s.out_dims == (("n", "o", "s0", "s1"),)
    assert s.reduction_dims == ("c", "k0", "k1") and "s0" not in s.unsplittable


# -- unknown primitives and failing rules -----------------------------------------------------------
def _primitive(name, same_shape=True):
    p = jcore.Primitive(name)
    if same_shape:
        p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    else:
        p.def_abstract_eval(lambda x: jax.core.ShapedArray((x.shape[0] * 2,), x.dtype))
    return p


def test_unknown_primitive_warns_once_and_follows_operand():
    name = "mshard_test_unknown_elementwise"
    with pytest.warns(rules.UnknownPrimitiveWarning, match=name):
        s = rules.iteration_space(name, [(4, 6), (6,)], [(4, 6)], {})
    assert s.in_dims == (("f0_0", "f0_1"), (None,)) and s.out_dims == (("f0_0", "f0_1"),)
    assert not s.unsplittable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rules.iteration_space(name, [(2,)], [(2,)], {})   # no second warning


def test_unknown_primitive_replicates_other_shapes():
    name = "mshard_test_unknown_reshaping"
    with pytest.warns(rules.UnknownPrimitiveWarning, match=name) as rec:
        s = rules.iteration_space(name, [(4, 6)], [(24,), (3,)], {})
    assert len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rules.iteration_space(name, [(4, 6)], [(24,)], {})
    assert s.in_dims == ((None, None),) and set(s.dims) == s.unsplittable and len(s.dims) == 2


def test_unknown_primitive_traced_without_crash():
    from mshard._src.jaxpr.op_graph import jaxpr_to_graph
    from searchers import DeviceMesh

    prim = _primitive("mshard_test_unknown_in_trace")
    prim2 = _primitive("mshard_test_unknown_in_trace_2", same_shape=False)
    cj = jax.make_jaxpr(lambda x: prim2.bind(prim.bind(jnp.sin(x))))(f32(4, 6))
    with pytest.warns(rules.UnknownPrimitiveWarning) as rec:
        r = jaxpr_to_graph(cj, DeviceMesh.prime(8), ["data"], ["x"])
    assert sorted(str(w.message).split("'")[1] for w in rec) == [prim.name, prim2.name]
    assert [op.kind for op in r.graph.ops] == ["data", "sin", prim.name, prim2.name]


def test_failing_rule_falls_back(monkeypatch):
    def broken(in_shapes, out_shapes, **params):
        raise KeyError("boom")
    monkeypatch.setitem(rules.RULES, "mshard_test_broken", broken)
    with pytest.warns(rules.RuleFailureWarning, match="mshard_test_broken"):
        s = rules.iteration_space("mshard_test_broken", [(4,)], [(4,)], {})
    assert s.in_dims == (("f0_0",),)


RESHAPE_PAIRS = [((64, 8), (4, 128)), ((2, 64), (128,)), ((8, 16), (8, 4, 4)), ((4, 6, 8), (24, 8)),
                 ((16, 4), (2, 8, 4)), ((4, 2, 8), (4, 16)), ((8, 4, 4), (8, 16)), ((12, 8), (8, 12))]


@pytest.mark.parametrize("shape, new", RESHAPE_PAIRS, ids=[f"{a}->{b}" for a, b in RESHAPE_PAIRS])
def test_every_reshape_candidate_moves_nothing_in_xla(shape, new):
    """Every candidate strategy of a reshape on 8 devices (2, 2, 2), its operand and result constrained to the layouts
    it gives (a merged dim: its loop dims' axes, major first), compiles with no collective at all and computes the
    reshape: XLA's partitioner, not mshard, says that each of these layout pairs is the same data."""
    from searchers import DeviceMesh, Graph
    from searchers.graph import operand_layout, result_layout
    from searchers.strategies import enumerate_strategies
    s = rules.reshape_rule([shape], [new])
    g = Graph(DeviceMesh((2, 2, 2), ("d0", "d1", "d2")))
    x = g.source("x", shape)
    g.add_op("r", "reshape", s.dims, [x], s.in_dims, s.out_dims, out_shapes=[new],
             unsplittable=s.unsplittable, split_limit=dict(s.split_divides) or None)
    op = g.ops[1]
    names = ("d0", "d1", "d2")
    spec = lambda lay: P(*[tuple(names[a] for a in axes) or None for axes in lay])
    val = jnp.arange(math.prod(shape), dtype=jnp.float32).reshape(shape)
    cands = enumerate_strategies(op, g.mesh)
    # some candidate splits 4 ways at least (8 where the run has common factors; (12, 8) -> (8, 12) has none, and
    # its leading dims share a split dividing both, gcd(12, 8) = 4)
    assert max(len([a for axes in c for a in axes]) for c in cands) == (2 if shape == (12, 8) else 3)
    for c in cands:
        lin, lout = operand_layout(op, c, 0), result_layout(op, c)
        f = jax.jit(lambda v, lin=lin, lout=lout: lax.with_sharding_constraint(
            lax.with_sharding_constraint(v, NamedSharding(MESH, spec(lin))).reshape(new),
            NamedSharding(MESH, spec(lout))))
        compiled = f.lower(val).compile()
        kinds = set(COLLECTIVE.findall(compiled.as_text()))
        assert not kinds, (shape, new, c, lin, lout, kinds)
        np.testing.assert_array_equal(np.asarray(compiled(val)), np.asarray(val).reshape(new))
