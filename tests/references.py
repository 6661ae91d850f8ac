"""Independent references for the primitives of ``mshard.ops`` (issue 37: a green suite means a right program).

Each reference is written from MindSpore's documented semantics of the primitive (and mshard's docstring where it
narrows them), in plain ``jax.numpy`` / ``jax.lax`` on whatever dtype it is given: callers run them in float64
(``with jax.enable_x64(True):``) as the exact value a float32 run is judged against. They are differentiable by
``jax.grad``. They never call mshard: ``mshard.ops`` only names the classes, and a reference reads the
attributes it needs (``transpose_a``, ``keep_dims``, ``axis``, ``pad_mode``, ``stride``, ...) from the primitive
object it is given. They are deliberately written another way than the obvious one where there is one (products
summed by broadcasting instead of ``dot_general``, convolution and pooling as sums of shifted strided slices, a
gather as a one-hot contraction), so a wrong lowering in mshard is not repeated here.

:data:`REFERENCES` maps a primitive class name to ``ref(prim, *inputs)``, the inputs as the primitive is called
(tensors, then its attribute arguments: ``ReduceSum``'s axis, ``Transpose``'s perm, ``OneHot``'s depth, ...).
:func:`reduction_length` and :func:`gradient_length` give the longest float sum one output (or gradient) element
depends on, for float32 tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Shape = tuple[int, ...]


# -- helpers ---------------------------------------------------------------------------------------------------------
def _axes(axis: Any, rank: int) -> tuple[int, ...]:
    """MindSpore's reduction axis: () or None is every dim; ints may be negative."""
    if axis is None or axis == () or axis == []:
        return tuple(range(rank))
    axis = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    return tuple(sorted({int(a) % rank for a in axis}))


def _pair(v: Any) -> tuple[int, int]:
    """An int, a pair, or MindSpore's 4-tuple ``(1, 1, h, w)`` form of a kernel, stride or dilation."""
    if isinstance(v, (int, np.integer)):
        return int(v), int(v)
    v = tuple(int(a) for a in v)
    return (v[0], v[0]) if len(v) == 1 else v[-2:]


def _sum(x, axes: Sequence[int], keepdims: bool = False):
    return jnp.sum(x, axis=tuple(axes), keepdims=keepdims)


def _max(x, axes: Sequence[int], keepdims: bool = False):
    return jnp.max(x, axis=tuple(axes), keepdims=keepdims)


def _matmul_last2(a, b):
    """[..., m, k] x [..., k, n] -> [..., m, n] as the sum over k of broadcast products (no dot_general)."""
    return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)


def _swap_last2(a):
    return jnp.swapaxes(a, -1, -2)


# -- elementwise -----------------------------------------------------------------------------------------------------
def _binary(fn: Callable) -> Callable:
    def ref(prim, x, y):
        return fn(x, y)
    return ref


def _unary(fn: Callable) -> Callable:
    def ref(prim, x):
        return fn(x)
    return ref


def _gelu(x):
    """MindSpore's GeLU: the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def _bias_add(prim, x, bias):
    """MindSpore's BiasAdd: ``bias`` (C,) added along the channel dim of ``x``: dim 1 for NCHW (its default data
    format; for a 2-D [N, C] input the last dim), the last dim for NHWC."""
    fmt = getattr(prim, "data_format", "NCHW")
    c = x.ndim - 1 if fmt == "NHWC" else 1
    return x + bias.reshape((1,) * c + (-1,) + (1,) * (x.ndim - c - 1))


def _cast(prim, x, dtype):
    return x.astype(jnp.dtype(dtype))


# -- matmul ----------------------------------------------------------------------------------------------------------
def _matmul(prim, x, w):
    """MindSpore's MatMul: x [m, k] (or [k, m] with transpose_a) times w [k, n] (or [n, k] with transpose_b)."""
    a = x.T if prim.transpose_a else x
    b = w.T if prim.transpose_b else w
    return _matmul_last2(a, b)


def _batch_matmul(prim, x, w):
    """MindSpore's BatchMatMul: the last two dims as MatMul's, the leading (batch) dims broadcast."""
    a = _swap_last2(x) if prim.transpose_a else x
    b = _swap_last2(w) if prim.transpose_b else w
    return _matmul_last2(a, b)


# -- reductions and normalisations -----------------------------------------------------------------------------------
def _reduce_sum(prim, x, axis=()):
    return _sum(x, _axes(axis, x.ndim), prim.keep_dims)


def _reduce_mean(prim, x, axis=()):
    ax = _axes(axis, x.ndim)
    return _sum(x, ax, prim.keep_dims) / math.prod(x.shape[a] for a in ax)


def _reduce_max(prim, x, axis=()):
    return _max(x, _axes(axis, x.ndim), prim.keep_dims)


def _shifted(x, ax):
    """x minus its max over ``ax`` (the max as a constant: softmax is invariant to the shift)."""
    return x - jax.lax.stop_gradient(_max(x, ax, keepdims=True))


def _softmax(prim, x):
    ax = _axes(prim.axis, x.ndim)
    e = jnp.exp(_shifted(x, ax))
    return e / _sum(e, ax, keepdims=True)


def _log_softmax(prim, x):
    ax = _axes(prim.axis, x.ndim)
    z = _shifted(x, ax)
    return z - jnp.log(_sum(jnp.exp(z), ax, keepdims=True))


def _layer_norm(prim, x, gamma, beta):
    """MindSpore's LayerNorm: normalise over the dims from begin_norm_axis on, y = (x - mean) / sqrt(var + eps) *
    gamma + beta with gamma, beta of shape x.shape[begin_params_axis:]; returns (y, mean, variance), the statistics
    keeping the normalised dims as 1 and the variance the biased (population) one."""
    ax = tuple(range(prim.begin_norm_axis % x.ndim, x.ndim))
    n = math.prod(x.shape[a] for a in ax)
    mean = _sum(x, ax, keepdims=True) / n
    var = _sum((x - mean) ** 2, ax, keepdims=True) / n
    y = (x - mean) / jnp.sqrt(var + prim.epsilon) * gamma + beta
    return y, mean, var


def _softmax_cross_entropy(prim, logits, labels):
    """MindSpore's SoftmaxCrossEntropyWithLogits: (loss [N] = -sum(labels * log softmax(logits)), dlogits [N, C] =
    softmax(logits) - labels)."""
    z = _shifted(logits, (logits.ndim - 1,))
    logp = z - jnp.log(jnp.sum(jnp.exp(z), axis=-1, keepdims=True))
    return -jnp.sum(labels * logp, axis=-1), jnp.exp(logp) - labels


# -- shape ops -------------------------------------------------------------------------------------------------------
def _transpose(prim, x, perm):
    return jnp.transpose(x, tuple(perm))


def _reshape(prim, x, shape):
    shape = tuple(int(d) for d in shape)
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        shape = tuple(x.size // known if d == -1 else d for d in shape)
    if math.prod(shape) != x.size:
        raise ValueError(f"Reshape: {x.shape} has {x.size} elements, {shape} does not")
    return x.reshape(shape)


def _flatten(prim, x):
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))


def _expand_dims(prim, x, axis):
    a = axis if axis >= 0 else axis + x.ndim + 1
    return x.reshape(x.shape[:a] + (1,) + x.shape[a:])


def _squeeze(prim, x):
    """MindSpore's Squeeze(axis): drop the given size-1 dims, or every size-1 dim when axis is ()."""
    ax = prim.axis
    drop = {k for k, n in enumerate(x.shape) if n == 1} if ax in ((), [], None) else set(_axes(ax, x.ndim))
    if any(x.shape[k] != 1 for k in drop):
        raise ValueError(f"Squeeze: dims {sorted(drop)} of {x.shape} are not all 1")
    return x.reshape(tuple(n for k, n in enumerate(x.shape) if k not in drop))


def _concat(prim, *xs):
    if len(xs) == 1 and isinstance(xs[0], (tuple, list)):
        xs = tuple(xs[0])
    return jnp.concatenate(xs, axis=prim.axis)


def _strided_slice(prim, x, begin, end, strides):
    """MindSpore's StridedSlice: dim d keeps the indices of Python's ``range`` slice begin[d]:end[d]:strides[d]
    (negative ends count from the end, out-of-range ends clamp); dims beyond len(begin) are kept whole. The
    begin/end/shrink masks are read if the primitive has them (a set bit: no begin, no end, keep one index and
    drop the dim)."""
    bm, em, sm = (int(getattr(prim, m, 0)) for m in ("begin_mask", "end_mask", "shrink_axis_mask"))
    if getattr(prim, "ellipsis_mask", 0) or getattr(prim, "new_axis_mask", 0):
        raise NotImplementedError("StridedSlice: ellipsis_mask and new_axis_mask are not modelled")
    out, drop = x, []
    for d, (b, e, s) in enumerate(zip(begin, end, strides, strict=True)):
        n = x.shape[d]
        if sm >> d & 1:
            idx = np.asarray([b % n])
            drop.append(d)
        else:
            idx = np.arange(n)[slice(None if bm >> d & 1 else b, None if em >> d & 1 else e, s)]
        out = jnp.take(out, jnp.asarray(idx, jnp.int32), axis=d)
    return out.reshape(tuple(n for k, n in enumerate(out.shape) if k not in drop)) if drop else out


def _one_hot_of(indices, depth: int, dtype):
    """[..., depth] with 1 where the last index equals the position (indices out of range: all 0)."""
    # compared as float64 (exact for any index below 2**53): LLVM's x86 backend (jax 0.10.2, every optimisation level
    # above 0) aborts compiling the float64 gradient of h * (1 + OneHot) when the compare is of int32 vectors
    # ("Cannot select: X86ISD::SUBV_BROADCAST_LOAD", fuzz seed 62)
    return (indices[..., None].astype(jnp.float64) == jnp.arange(depth, dtype=jnp.float64)).astype(dtype)


def _gather(prim, params, indices, axis=0):
    """MindSpore's Gather: out[p..., i..., q...] = params[p..., indices[i...], q...], shape params.shape[:axis] +
    indices.shape + params.shape[axis + 1:]; computed as a one-hot contraction (each output one exact product)."""
    axis %= params.ndim
    p = jnp.moveaxis(params, axis, 0)                               # [v, pre..., post...]
    out = jnp.tensordot(_one_hot_of(indices, params.shape[axis], params.dtype), p, axes=([-1], [0]))
    k = indices.ndim
    return jnp.moveaxis(out, tuple(range(k)), tuple(range(axis, axis + k)))    # [pre..., i..., post...]


def _one_hot(prim, indices, depth, on_value=1.0, off_value=0.0):
    """MindSpore's OneHot(axis): a new dim of size depth at ``axis`` (-1: last), on_value where the position equals
    the index, off_value elsewhere."""
    on, off = jnp.asarray(on_value), jnp.asarray(off_value)
    hot = _one_hot_of(indices, int(depth), jnp.bool_)
    out = jnp.where(hot, on, off)
    axis = prim.axis if prim.axis >= 0 else prim.axis + indices.ndim + 1
    return jnp.moveaxis(out, -1, axis)


# -- convolution and pooling (NCHW) ----------------------------------------------------------------------------------
def _same_pads(size: int, k: int, stride: int, dilation: int) -> tuple[int, int]:
    """MindSpore's "same": output ceil(size / stride); the padding it needs is split evenly, the odd one at the
    bottom/right."""
    out = -(-size // stride)
    total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def _pads(pad_mode: str, pad: Any, hw: Shape, kernel: Shape, stride: Shape, dilation: Shape) -> list[tuple[int, int]]:
    mode = pad_mode.lower()
    if mode == "valid":
        return [(0, 0), (0, 0)]
    if mode == "same":
        return [_same_pads(n, k, s, d) for n, k, s, d in zip(hw, kernel, stride, dilation, strict=True)]
    # "pad": an int for all four sides, or (top, bottom, left, right)
    p = (pad,) * 4 if isinstance(pad, (int, np.integer)) else tuple(pad)
    if len(p) != 4:
        raise ValueError(f"Conv2D pad must be an int or (top, bottom, left, right), got {pad!r}")
    return [(p[0], p[1]), (p[2], p[3])]


def _windows(x, kernel: Shape, stride: Shape, dilation: Shape, out_hw: Shape):
    """For each kernel offset (i, j): x[:, :, i*dh + y*sh, j*dw + x*sw] over the output grid (y, x)."""
    (kh, kw), (sh, sw), (dh, dw), (oh, ow) = kernel, stride, dilation, out_hw
    for i in range(kh):
        for j in range(kw):
            yield i, j, x[:, :, i * dh: i * dh + (oh - 1) * sh + 1: sh, j * dw: j * dw + (ow - 1) * sw + 1: sw]


def _out_size(n: int, k: int, s: int, d: int) -> int:
    return (n - (k - 1) * d - 1) // s + 1


def _conv2d(prim, x, w):
    """MindSpore's Conv2D (NCHW x OIHW): out[n, o, y, x] = sum over c in o's group, i, j of
    xpad[n, c, y*sh + i*dh, x*sw + j*dw] * w[o, c, i, j], for pad_mode "valid", "same" or "pad"."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    g = getattr(prim, "group", 1)
    if c != cg * g or o % g:
        raise ValueError(f"Conv2D: input {x.shape} and weight {w.shape} disagree with group={g}")
    stride, dilation = _pair(prim.stride), _pair(prim.dilation)
    pads = _pads(prim.pad_mode, getattr(prim, "pad", 0), (h, wd), (kh, kw), stride, dilation)
    xp = jnp.pad(x, [(0, 0), (0, 0), *pads])
    out_hw = tuple(_out_size(nn, k, s, d) for nn, k, s, d in zip(xp.shape[2:], (kh, kw), stride, dilation, strict=True))
    wg = w.reshape(g, o // g, cg, kh, kw)
    total = 0.0
    for i, j, xs in _windows(xp, (kh, kw), stride, dilation, out_hw):
        xg = xs.reshape(n, g, 1, cg, *out_hw)                  # [n, group, 1, c in group, oh, ow]
        total = total + jnp.sum(xg * wg[None, :, :, :, i, j, None, None], axis=3)   # x [1, group, o in group, c, 1, 1]
    return total.reshape(n, o, *out_hw)


def _pool(prim, x, kind: str):
    """MindSpore's MaxPool / AvgPool (NCHW): the max or the mean over each kernel window; "same" pads (the odd
    one at the bottom/right) with -inf for the max and with zeros for the mean, which divides by the kernel area
    (MindSpore's documented formula, pad value 0)."""
    kernel, stride = _pair(prim.kernel_size), _pair(prim.strides)
    pads = _pads(prim.pad_mode, 0, x.shape[2:], kernel, stride, (1, 1))
    xp = jnp.pad(x, [(0, 0), (0, 0), *pads], constant_values=-jnp.inf if kind == "max" else 0.0)
    out_hw = tuple(_out_size(n, k, s, 1) for n, k, s in zip(xp.shape[2:], kernel, stride, strict=True))
    parts = [xs for _, _, xs in _windows(xp, kernel, stride, (1, 1), out_hw)]
    if kind == "max":
        return jnp.max(jnp.stack(parts), axis=0)
    return sum(parts[1:], parts[0]) / (kernel[0] * kernel[1])


def _batch_norm(prim, x, scale, bias, mean, variance):
    """MindSpore's BatchNorm (NCHW), as mshard documents it (output y only): y = (x - mean) / sqrt(var + eps) *
    scale + bias per channel, with the batch's mean and biased variance over every dim but the channel's in
    training, and the given mean and variance otherwise."""
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if prim.is_training:
        ax = (0, *range(2, x.ndim))
        n = math.prod(x.shape[a] for a in ax)
        m = _sum(x, ax, keepdims=True) / n
        v = _sum((x - m) ** 2, ax, keepdims=True) / n
    else:
        m, v = mean.reshape(shape), variance.reshape(shape)
    return (x - m) / jnp.sqrt(v + prim.epsilon) * scale.reshape(shape) + bias.reshape(shape)


# -- the registry ----------------------------------------------------------------------------------------------------
REFERENCES: dict[str, Callable[..., Any]] = {
    "Add": _binary(lambda x, y: x + y), "Sub": _binary(lambda x, y: x - y), "Mul": _binary(lambda x, y: x * y),
    "RealDiv": _binary(lambda x, y: x / y), "Maximum": _binary(jnp.maximum), "Minimum": _binary(jnp.minimum),
    "ReLU": _unary(lambda x: jnp.where(x > 0, x, 0.0)), "GeLU": _unary(_gelu), "Tanh": _unary(jnp.tanh),
    "Sigmoid": _unary(lambda x: 1.0 / (1.0 + jnp.exp(-x))), "Exp": _unary(jnp.exp), "Log": _unary(jnp.log),
    "Sqrt": _unary(jnp.sqrt), "Square": _unary(lambda x: x * x), "BiasAdd": _bias_add, "Cast": _cast,
    "MatMul": _matmul, "BatchMatMul": _batch_matmul,
    "ReduceSum": _reduce_sum, "ReduceMean": _reduce_mean, "ReduceMax": _reduce_max,
    "Softmax": _softmax, "LogSoftmax": _log_softmax, "LayerNorm": _layer_norm,
    "SoftmaxCrossEntropyWithLogits": _softmax_cross_entropy,
    "Transpose": _transpose, "Reshape": _reshape, "Flatten": _flatten, "ExpandDims": _expand_dims, "Squeeze": _squeeze,
    "Concat": _concat, "StridedSlice": _strided_slice, "Gather": _gather, "OneHot": _one_hot,
    "Conv2D": _conv2d, "MaxPool": lambda prim, x: _pool(prim, x, "max"), "AvgPool": lambda prim, x: _pool(prim, x, "avg"),
    "BatchNorm": _batch_norm,
}

# how many leading call arguments are tensors (the rest are attributes); absent: all of them
TENSOR_INPUTS: dict[str, int] = {"Cast": 1, "ReduceSum": 1, "ReduceMean": 1, "ReduceMax": 1, "Transpose": 1,
                                 "Reshape": 1, "ExpandDims": 1, "StridedSlice": 1, "Gather": 2, "OneHot": 1}


def reference(prim, *inputs):
    """The reference of ``prim`` (an ``mshard.ops`` primitive object, read for its class name and attributes)."""
    return REFERENCES[type(prim).__name__](prim, *inputs)


def _split_args(prim, args: Sequence[Any]) -> tuple[list[Shape], list[Any]]:
    k = TENSOR_INPUTS.get(type(prim).__name__, len(args))
    return [tuple(s) for s in args[:k]], list(args[k:])


# -- reduction lengths, for float32 tolerances ---------------------------------------------------------------------
_ELEMENTWISE = {"Add", "Sub", "Mul", "RealDiv", "Maximum", "Minimum", "ReLU", "GeLU", "Tanh", "Sigmoid", "Exp", "Log",
                "Sqrt", "Square", "BiasAdd", "Cast"}
_EXACT = {"Transpose", "Reshape", "Flatten", "ExpandDims", "Squeeze", "Concat", "StridedSlice", "Gather", "OneHot", "MaxPool",
          "ReduceMax"}


def reduction_length(prim, *input_shapes) -> int:
    """The longest float sum one output element depends on: MatMul's k, Conv2D's C_in * kh * kw (per group), a
    ReduceSum/ReduceMean's reduced size, the normalised size of Softmax, LogSoftmax, LayerNorm and
    SoftmaxCrossEntropyWithLogits, BatchNorm's N * H * W in training, AvgPool's window; 1 for elementwise ops and
    for exact ones (data movement, max). ``input_shapes``: the tensor inputs' shapes, then the call's attribute
    arguments as in the call (``ReduceSum``'s axis)."""
    kind = type(prim).__name__
    shapes, attrs = _split_args(prim, input_shapes)
    if kind in _ELEMENTWISE or kind in _EXACT:
        return 1
    x = shapes[0]
    if kind in ("MatMul", "BatchMatMul"):
        return x[-2] if prim.transpose_a else x[-1]
    if kind in ("ReduceSum", "ReduceMean"):
        return math.prod(x[a] for a in _axes(attrs[0] if attrs else (), len(x)))
    if kind in ("Softmax", "LogSoftmax"):
        return math.prod(x[a] for a in _axes(prim.axis, len(x)))
    if kind == "LayerNorm":
        return math.prod(x[prim.begin_norm_axis % len(x):])
    if kind == "SoftmaxCrossEntropyWithLogits":
        return x[-1]
    if kind == "Conv2D":
        return math.prod(shapes[1][1:])
    if kind == "AvgPool":
        return math.prod(_pair(prim.kernel_size))
    if kind == "BatchNorm":
        return math.prod(x) // x[1] if prim.is_training else 1
    raise KeyError(f"no reduction length for {kind}")


def gradient_length(prim, *input_shapes) -> tuple[int, ...]:
    """Per tensor input, the longest float sum one element of its gradient (of a loss weighing the outputs) depends
    on: the forward's :func:`reduction_length` plus the backward's own sum over the output elements that element
    feeds (MatMul's x: n, w: m; a broadcast operand: its repeat count; Conv2D's x: (O / group) * kh * kw, w: N * Ho *
    Wo; Softmax's: the axis; a gather's params: the number of lookups). Arguments as :func:`reduction_length`'s."""
    kind = type(prim).__name__
    shapes, attrs = _split_args(prim, input_shapes)
    n = reduction_length(prim, *input_shapes)
    x = shapes[0]

    def size(s: Shape) -> int:
        return math.prod(s)
    if kind in _ELEMENTWISE:
        out = np.broadcast_shapes(*shapes) if kind != "BiasAdd" else x
        fan = [size(out) // max(size(s), 1) for s in shapes]
    elif kind in ("MatMul", "BatchMatMul"):
        w = shapes[1]
        m = x[-1] if prim.transpose_a else x[-2]
        k_n = w[-2] if prim.transpose_b else w[-1]
        batch = np.broadcast_shapes(x[:-2], w[:-2])
        fan = [k_n * size(batch) // size(x[:-2]), m * size(batch) // size(w[:-2])]
    elif kind in ("Softmax", "LogSoftmax", "SoftmaxCrossEntropyWithLogits"):
        fan = [n] * len(shapes)
    elif kind == "LayerNorm":
        fan = [n] + [size(x) // size(s) for s in shapes[1:]]
    elif kind == "Conv2D":
        w = shapes[1]
        g = getattr(prim, "group", 1)
        stride, dilation = _pair(prim.stride), _pair(prim.dilation)
        pads = _pads(prim.pad_mode, getattr(prim, "pad", 0), x[2:], w[2:], stride, dilation)
        out_hw = [_out_size(nn + p0 + p1, k, s, d) for nn, (p0, p1), k, s, d in zip(x[2:], pads, w[2:], stride,
                                                                                   dilation, strict=True)]
        fan = [w[0] // g * w[2] * w[3], x[0] * size(tuple(out_hw))]
    elif kind in ("MaxPool", "AvgPool"):
        fan = [math.prod(_pair(prim.kernel_size))]
    elif kind == "BatchNorm":
        nhw = size(x) // x[1]
        fan = [nhw] * len(shapes)
    elif kind == "Gather":
        fan = [size(shapes[1]), 1]
    else:                                   # reductions (a broadcast back), data movement, OneHot
        fan = [1] * len(shapes)
    return tuple(n + f for f in fan)
