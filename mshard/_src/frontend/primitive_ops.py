"""MindSpore's primitive objects (docs/design.md §2), each with MindSpore's constructor arguments.

>>> import jax.numpy as jnp
>>> from mshard import ops
>>> ops.MatMul(transpose_b=True)(jnp.ones((4, 3)), jnp.ones((2, 3))).shape
(4, 2)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from mshard._src.frontend.primitive_base import LETTERS, Primitive, broadcast_spec
from mshard._src.values.errors import StrategyError

_NONE: frozenset[str] = frozenset()


# -- elementwise ---------------------------------------------------------------------------------
class _Elementwise(Primitive):
    fn: Any = None

    def compute(self, *xs):
        return type(self).fn(*xs)

    def spec(self, shapes, attrs):
        ins, outs = broadcast_spec(shapes)
        return ins, outs, _NONE


def _elementwise(name: str, fn, doc: str) -> type:
    return type(name, (_Elementwise,), {"fn": staticmethod(fn), "__doc__": doc})


Add = _elementwise("Add", jnp.add, "x + y with broadcasting; strategy ((a, b), (a, b)) or ((a, b), (b,)).")
Sub = _elementwise("Sub", jnp.subtract, "x - y with broadcasting.")
Mul = _elementwise("Mul", jnp.multiply, "x * y with broadcasting.")
RealDiv = _elementwise("RealDiv", jnp.divide, "x / y with broadcasting.")
Maximum = _elementwise("Maximum", jnp.maximum, "elementwise max.")
Minimum = _elementwise("Minimum", jnp.minimum, "elementwise min.")
ReLU = _elementwise("ReLU", jax.nn.relu, "max(x, 0).")
GeLU = _elementwise("GeLU", jax.nn.gelu, "GELU (tanh approximation, as MindSpore's GeLU).")
Tanh = _elementwise("Tanh", jnp.tanh, "tanh.")
Sigmoid = _elementwise("Sigmoid", jax.nn.sigmoid, "logistic sigmoid.")
Exp = _elementwise("Exp", jnp.exp, "exp.")
Log = _elementwise("Log", jnp.log, "natural log.")
Sqrt = _elementwise("Sqrt", jnp.sqrt, "square root.")
Square = _elementwise("Square", jnp.square, "x * x.")


def _layout_format(op: str, data_format: str, allowed: tuple[str, ...] = ("NCHW",)) -> str:
    """``data_format`` as MindSpore's op takes it, refused (not ignored) where mshard computes another layout."""
    if data_format not in allowed:
        raise StrategyError(f"{op}: data_format={data_format!r} is not supported; mshard's {op} takes "
                            f"{' or '.join(map(repr, allowed))} (transpose the input to NCHW, or leave data_format out).")
    return data_format


class BiasAdd(Primitive):
    """``BiasAdd(data_format="NCHW")``: x + bias, bias ``(C,)`` added along x's channel dim, as MindSpore's BiasAdd:
    dim 1 for "NCHW" / "NCDHW" (for a 2-D ``[N, C]`` input that is the last dim), the last dim for "NHWC".
    Strategy ((n, c, ...), (c,)): the bias splits as the channel dim.

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.BiasAdd()(jnp.zeros((1, 2, 3)), jnp.array([1.0, 2.0]))[0, :, 0].tolist()
    [1.0, 2.0]
    """

    def __init__(self, data_format: str = "NCHW", name: str | None = None):
        super().__init__(name)
        self.data_format = _layout_format("BiasAdd", data_format, ("NCHW", "NHWC", "NCDHW"))

    def _channel(self, rank: int) -> int:
        return rank - 1 if self.data_format == "NHWC" else min(1, rank - 1)

    def compute(self, x, bias):
        c = self._channel(x.ndim)
        if c == x.ndim - 1:              # the channel is the last dim ([N, C], NHWC): a plain broadcast
            return x + bias
        return x + bias.reshape((1,) * c + (-1,) + (1,) * (x.ndim - c - 1))

    def spec(self, shapes, attrs):
        xs = tuple(LETTERS[:len(shapes[0])])
        return (xs, (xs[self._channel(len(xs))],)), (xs,), _NONE


class Cast(Primitive):
    """``Cast()(x, dtype)``; strategy over x."""

    n_tensors = 1

    def compute(self, x, dtype):
        return x.astype(dtype)

    def spec(self, shapes, attrs):
        ins, outs = broadcast_spec(shapes)
        return ins, outs, _NONE


# -- matmul ----------------------------------------------------------------------------------------
class MatMul(Primitive):
    """``MatMul(transpose_a=False, transpose_b=False)``: 2-D x @ w. Strategy ((m, k), (k, n)).

    With transpose_b=True the weight is [n, k] and the strategy is ((m, k), (n, k)), as in MindSpore.
    """

    def __init__(self, transpose_a: bool = False, transpose_b: bool = False, name: str | None = None):
        super().__init__(name)
        self.transpose_a, self.transpose_b = transpose_a, transpose_b

    def compute(self, x, w):
        # one dot_general with the contracting dims named (no separate transpose op: a planned layout on a
        # transpose's result would make XLA materialise it)
        a = "km" if self.transpose_a else "mk"
        b = "nk" if self.transpose_b else "kn"
        return jnp.einsum(f"{a},{b}->mn", x, w)

    def spec(self, shapes, attrs):
        a = ("k", "m") if self.transpose_a else ("m", "k")
        b = ("n", "k") if self.transpose_b else ("k", "n")
        return (a, b), (("m", "n"),), _NONE


class BatchMatMul(MatMul):
    """``BatchMatMul(transpose_a, transpose_b)``: [..., m, k] @ [..., k, n]; batch dims broadcast."""

    def compute(self, x, w):
        a = "...km" if self.transpose_a else "...mk"
        b = "...nk" if self.transpose_b else "...kn"
        return jnp.einsum(f"{a},{b}->...mn", x, w)

    def spec(self, shapes, attrs):
        bx, bw = shapes[0][:-2], shapes[1][:-2]
        bins, bout = broadcast_spec([bx, bw])
        a = ("k", "m") if self.transpose_a else ("m", "k")
        b = ("n", "k") if self.transpose_b else ("k", "n")
        rename = {c: c.upper() for c in LETTERS}
        bx_d = tuple(rename[c] if c else None for c in bins[0])
        bw_d = tuple(rename[c] if c else None for c in bins[1])
        bo = tuple(rename[c] for c in bout[0])
        return (bx_d + a, bw_d + b), (bo + ("m", "n"),), _NONE


# -- reductions and normalisations -----------------------------------------------------------------
def _axes(axis, rank: int) -> tuple[int, ...]:
    if axis is None or axis == ():
        return tuple(range(rank))
    axis = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % rank for a in axis)


class _Reduce(Primitive):
    n_tensors = 1
    fn: Any = None

    def __init__(self, keep_dims: bool = False, name: str | None = None):
        super().__init__(name)
        self.keep_dims = keep_dims

    def compute(self, x, axis=()):
        return type(self).fn(x, axis=_axes(axis, x.ndim), keepdims=self.keep_dims)

    def spec(self, shapes, attrs):
        rank = len(shapes[0])
        red = _axes(attrs[0] if attrs else (), rank)
        ins = tuple(LETTERS[:rank])
        outs = tuple((None if self.keep_dims else "") if k in red else LETTERS[k] for k in range(rank))
        outs = tuple(o for o in outs if o != "")
        return (ins,), (outs,), _NONE


ReduceSum = type("ReduceSum", (_Reduce,), {"fn": staticmethod(jnp.sum), "__doc__": "ReduceSum(keep_dims)(x, axis)."})
ReduceMean = type("ReduceMean", (_Reduce,), {"fn": staticmethod(jnp.mean), "__doc__": "ReduceMean(keep_dims)(x, axis)."})
ReduceMax = type("ReduceMax", (_Reduce,), {"fn": staticmethod(jnp.max), "__doc__": "ReduceMax(keep_dims)(x, axis)."})


class Softmax(Primitive):
    """``Softmax(axis=-1)``; the softmax axis cannot be split (as in MindSpore)."""

    fn = staticmethod(jax.nn.softmax)

    def __init__(self, axis: int = -1, name: str | None = None):
        super().__init__(name)
        self.axis = axis

    def compute(self, x):
        return type(self).fn(x, axis=self.axis)

    def spec(self, shapes, attrs):
        rank = len(shapes[0])
        d = tuple(LETTERS[:rank])
        return (d,), (d,), frozenset({d[self.axis % rank]})


class LogSoftmax(Softmax):
    """``LogSoftmax(axis=-1)``."""

    fn = staticmethod(jax.nn.log_softmax)


class LayerNorm(Primitive):
    """``LayerNorm(begin_norm_axis=1, begin_params_axis=1, epsilon=1e-7)``: returns (y, mean, variance).

    The normalised dims cannot be split (as in MindSpore). Inputs (x, gamma, beta).
    """

    def __init__(self, begin_norm_axis: int = 1, begin_params_axis: int = 1, epsilon: float = 1e-7,
                 name: str | None = None):
        super().__init__(name)
        self.begin_norm_axis, self.begin_params_axis, self.epsilon = begin_norm_axis, begin_params_axis, epsilon

    def compute(self, x, gamma, beta):
        axes = tuple(range(self.begin_norm_axis % x.ndim, x.ndim))
        mean = jnp.mean(x, axis=axes, keepdims=True)
        var = jnp.var(x, axis=axes, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.epsilon) * gamma + beta
        return y, mean, var

    def spec(self, shapes, attrs):
        rank = len(shapes[0])
        d = tuple(LETTERS[:rank])
        bn, bp = self.begin_norm_axis % rank, self.begin_params_axis % rank
        stat = tuple(c if k < bn else None for k, c in enumerate(d))
        return (d, d[bp:], d[bp:]), (d, stat, stat), frozenset(d[bn:])


class SoftmaxCrossEntropyWithLogits(Primitive):
    """Returns (loss [batch], dlogits [batch, classes]) for logits and one-hot labels, as MindSpore."""

    def compute(self, logits, labels):
        logp = jax.nn.log_softmax(logits, axis=-1)
        loss = -jnp.sum(labels * logp, axis=-1)
        return loss, jnp.exp(logp) - labels

    def spec(self, shapes, attrs):
        return (("b", "c"), ("b", "c")), (("b",), ("b", "c")), _NONE


# -- shape ops -----------------------------------------------------------------------------------------
class Transpose(Primitive):
    """``Transpose()(x, perm)``; strategy over x."""

    n_tensors = 1

    def compute(self, x, perm):
        return jnp.transpose(x, perm)

    def spec(self, shapes, attrs):
        d = LETTERS[:len(shapes[0])]
        return (tuple(d),), (tuple(d[p] for p in attrs[0]),), _NONE


class Reshape(Primitive):
    """``Reshape()(x, shape)``: dims are grouped into runs of equal products; within a merged or split run only
    the leading dim may be split (MindSpore's reshape rule)."""

    n_tensors = 1

    def compute(self, x, shape):
        return jnp.reshape(x, shape)

    def spec(self, shapes, attrs):
        src = tuple(shapes[0])
        want = tuple(attrs[0])
        size = math.prod(src)
        if want.count(-1) > 1 or any(d < -1 for d in want) or (
                -1 in want and (math.prod(d for d in want if d != -1) in (0,) or
                                size % math.prod(d for d in want if d != -1))) or (
                -1 not in want and math.prod(want) != size):
            raise StrategyError(f"Reshape: cannot reshape an array of shape {src} ({size} elements) to {want}; "
                                f"the new shape must have the same number of elements.")
        dst = tuple(size // math.prod(d for d in want if d != -1) if d == -1 else d for d in want)
        ins, outs, fixed = [], [], set()
        i = j = 0
        n = 0
        while i < len(src) or j < len(dst):
            a, b = [i], [j]
            pa = src[i] if i < len(src) else 1
            pb = dst[j] if j < len(dst) else 1
            while pa != pb:
                if pa < pb:
                    i += 1
                    a.append(i)
                    pa *= src[i]
                else:
                    j += 1
                    b.append(j)
                    pb *= dst[j]
            letter = f"r{n}"
            n += 1
            a = [x for x in a if x < len(src)]
            b = [x for x in b if x < len(dst)]
            # the run's leading dim is its first of size > 1: a size-1 dim dropped or added is no dim to split
            la = next((x for x in a if src[x] != 1), a[0] if a else None)
            lb = next((x for x in b if dst[x] != 1), b[0] if b else None)
            lead_ok = la is not None and lb is not None and (src[la] % dst[lb] == 0 or dst[lb] % src[la] == 0)
            ins += [letter if x == la else None for x in a]
            outs += [letter if x == lb else None for x in b]
            if not lead_ok:
                fixed.add(letter)
            i += 1
            j += 1
        return (tuple(ins),), (tuple(outs),), frozenset(fixed)


class ExpandDims(Primitive):
    """``ExpandDims()(x, axis)``."""

    n_tensors = 1

    def compute(self, x, axis):
        return jnp.expand_dims(x, axis)

    def spec(self, shapes, attrs):
        rank = len(shapes[0])
        d = list(LETTERS[:rank])
        out = list(d)
        out.insert(attrs[0] % (rank + 1), None)
        return (tuple(d),), (tuple(out),), _NONE


class Squeeze(Primitive):
    """``Squeeze(axis=())``."""

    def __init__(self, axis=(), name: str | None = None):
        super().__init__(name)
        self.axis = axis

    def compute(self, x):
        ax = _axes(self.axis, x.ndim) if self.axis != () else tuple(k for k, s in enumerate(x.shape) if s == 1)
        return jnp.squeeze(x, ax)

    def spec(self, shapes, attrs):
        s = shapes[0]
        ax = _axes(self.axis, len(s)) if self.axis != () else tuple(k for k, n in enumerate(s) if n == 1)
        d = tuple(LETTERS[:len(s)])
        return (d,), (tuple(c for k, c in enumerate(d) if k not in ax),), _NONE


class Concat(Primitive):
    """``Concat(axis=0)(x1, x2, ...)``; the concat axis cannot be split."""

    def __init__(self, axis: int = 0, name: str | None = None):
        super().__init__(name)
        self.axis = axis

    def __call__(self, *args):
        if len(args) == 1 and isinstance(args[0], (tuple, list)):
            args = tuple(args[0])
        return super().__call__(*args)

    def compute(self, *xs):
        return jnp.concatenate(xs, axis=self.axis)

    def spec(self, shapes, attrs):
        rank = len(shapes[0])
        ax = self.axis % rank
        d = tuple("cat" if k == ax else LETTERS[k] for k in range(rank))
        per_in = tuple(tuple(f"cat{i}" if k == ax else LETTERS[k] for k in range(rank)) for i in range(len(shapes)))
        return per_in, (d,), frozenset({"cat"} | {f"cat{i}" for i in range(len(shapes))})


class StridedSlice(Primitive):
    """``StridedSlice()(x, begin, end, strides)``; sliced dims cannot be split."""

    n_tensors = 1

    def compute(self, x, begin, end, strides):
        return x[tuple(slice(b, e, s) for b, e, s in zip(begin, end, strides))]

    def spec(self, shapes, attrs):
        s = shapes[0]
        begin, end, strides = attrs
        full = [b == 0 and e >= n and st == 1 for b, e, st, n in zip(begin, end, strides, s)] + [True] * (len(s) - len(begin))
        d = tuple(LETTERS[k] if full[k] else f"s{k}" for k in range(len(s)))
        o = tuple(LETTERS[k] if full[k] else f"o{k}" for k in range(len(s)))
        return (d,), (o,), frozenset(f"s{k}" for k in range(len(s)) if not full[k])


class Gather(Primitive):
    """``Gather()(params, indices, axis)`` — the embedding lookup when axis=0 and params is [vocab, dim].

    Strategy ((v, d), (b, s)); splitting the vocab v needs a masked lookup plus an all-reduce (XLA does it).
    """

    n_tensors = 2

    def compute(self, params, indices, axis=0):
        return jnp.take(params, indices, axis=axis)

    def spec(self, shapes, attrs):
        p, i = shapes
        axis = (attrs[0] if attrs else 0) % len(p)
        pd = tuple("v" if k == axis else f"p{k}" for k in range(len(p)))
        idd = tuple(f"i{k}" for k in range(len(i)))
        out = pd[:axis] + idd + pd[axis + 1:]
        return (pd, idd), (out,), _NONE


class OneHot(Primitive):
    """``OneHot(axis=-1)(indices, depth, on_value, off_value)``; strategy over indices."""

    n_tensors = 1

    def __init__(self, axis: int = -1, name: str | None = None):
        super().__init__(name)
        self.axis = axis

    def compute(self, indices, depth, on_value=1.0, off_value=0.0):
        oh = jax.nn.one_hot(indices, depth, axis=self.axis)
        return oh * (on_value - off_value) + off_value

    def spec(self, shapes, attrs):
        d = tuple(LETTERS[:len(shapes[0])])
        out = list(d)
        out.insert(self.axis % (len(d) + 1), "depth")
        return (d,), (tuple(out),), _NONE


# -- convolution and pooling (NCHW, as MindSpore) ---------------------------------------------------
def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _conv_pads(pad) -> list[tuple[int, int]]:
    """MindSpore's Conv2D ``pad`` under pad_mode="pad": an int for every side, or (top, bottom, left, right)."""
    if isinstance(pad, int):
        return [(pad, pad), (pad, pad)]
    if isinstance(pad, (tuple, list)) and len(pad) == 4 and all(isinstance(p, int) for p in pad):
        return [(pad[0], pad[1]), (pad[2], pad[3])]
    raise StrategyError(f"Conv2D: pad={pad!r} is neither an int nor a 4-tuple (top, bottom, left, right) of ints; "
                        f"give pad=1 or pad=(1, 1, 2, 2), as MindSpore's Conv2D takes it.")


class Conv2D(Primitive):
    """``Conv2D(out_channel, kernel_size, pad_mode="valid", pad=0, stride=1, dilation=1, group=1)``, NCHW/OIHW.

    Strategy ((n, c, h, w), (o, c, 1, 1)); h and w may be split only with pad_mode="same" and stride 1
    (XLA exchanges the halos).
    """

    def __init__(self, out_channel: int, kernel_size, mode: int = 1, pad_mode: str = "valid", pad=0, stride=1,
                 dilation=1, group: int = 1, data_format: str = "NCHW", name: str | None = None):
        super().__init__(name)
        _layout_format("Conv2D", data_format)
        self.out_channel, self.kernel_size = out_channel, _pair(kernel_size)
        self.pad_mode, self.pad, self.stride, self.dilation, self.group = pad_mode, pad, _pair(stride), _pair(dilation), group
        if pad_mode == "pad":
            _conv_pads(pad)                 # a pad MindSpore would not take is refused here, when the op is made

    def compute(self, x, w):
        pad = self.pad_mode.upper() if self.pad_mode in ("same", "valid") else _conv_pads(self.pad)
        if self.stride == (1, 1):
            if self.group > 1:
                return _grouped_conv(x, w, self.stride, _hashable(pad), self.dilation, self.group)
            return _conv(x, w, self.stride, pad, self.dilation, self.group)
        window = [(k - 1) * d + 1 for k, d in zip(w.shape[2:], self.dilation)]
        pads = tuple(jax.lax.padtype_to_pads(x.shape[2:], window, self.stride, pad)) if isinstance(pad, str) \
            else tuple(tuple(p) for p in pad)
        return _strided_conv(x, w, self.stride, pads, self.dilation, self.group)

    def spec(self, shapes, attrs):
        halo = self.pad_mode == "same" and self.stride == (1, 1)
        h, w = ("h", "w") if halo else ("hi", "wi")
        ho, wo = ("h", "w") if halo else ("ho", "wo")
        fixed = frozenset({"kh", "kw"} | (set() if halo else {"hi", "wi", "ho", "wo"}))
        return (("n", "c", h, w), ("o", "c", "kh", "kw")), (("n", "o", ho, wo),), fixed

    def halo(self, shapes) -> tuple[dict[str, int], frozenset[str]]:
        """pad_mode="same", stride 1: a split of h or w reads ``dilation * (kernel - 1)`` rows of its neighbours'
        blocks (XLA exchanges them); a search never splits them together with out-channels (guard
        conv_halo_out_channels: XLA computes wrong values for that pair)."""
        if not (self.pad_mode == "same" and self.stride == (1, 1)):
            return {}, frozenset()
        kernel = shapes[1][2:]
        rows = {d: dil * (k - 1) for d, k, dil in zip(("h", "w"), kernel, self.dilation) if k > 1}
        return rows, frozenset({"o"}) if rows else frozenset()


_DN = ("NCHW", "OIHW", "NCHW")


def _conv(x, w, stride, pad, dilation, group):
    return jax.lax.conv_general_dilated(x, w, stride, pad, rhs_dilation=dilation, feature_group_count=group,
                                        dimension_numbers=_DN)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _strided_conv(x, w, stride, pads, dilation, group):
    """A strided convolution whose input gradient is the transpose of a stride-1 convolution followed by a strided
    slice (interior padding, then a plain convolution) instead of XLA's base-dilated convolution: XLA's CPU
    algebraic simplifier aborts the process on the latter for some small kernels (a CHECK failure, e.g. a (2, 3)
    kernel, stride 2, pad 1 on a width-4 input; ../shared/repro/r2_conv_stride_grad_abort.py, plain jax.jit on one
    device too). Same values, same weight gradient."""
    return _conv(x, w, stride, pads, dilation, group)


def _strided_conv_fwd(x, w, stride, pads, dilation, group):
    return _conv(x, w, stride, pads, dilation, group), (x, w)


def _strided_conv_bwd(stride, pads, dilation, group, res, dy):
    x, w = res
    _, vx = jax.vjp(lambda x: _conv(x, w, (1, 1), pads, dilation, group)[:, :, ::stride[0], ::stride[1]], x)
    return vx(dy)[0], _weight_grad(x, w, dy, stride, pads, dilation, group)


def _hashable(pad):
    return pad if isinstance(pad, str) else tuple(tuple(p) for p in pad)


def _weight_grad(x, w, dy, stride, pad, dilation, group):
    """The kernel's gradient. A grouped one is computed group by group (plain convolutions, concatenated on the
    out-channels): XLA (JAX 0.10, CPU) computes a grouped convolution's weight gradient ``k`` times too large when
    the batch is split over one mesh axis and another axis of size ``k`` is left whole (plain jax.jit reproduces it:
    tests/test_primitive_references.py's Conv2D-group-batch-2-of-8 case). Same FLOPs, ``group`` smaller ops."""
    if group == 1:
        return jax.vjp(lambda w: _conv(x, w, stride, pad, dilation, 1), w)[1](dy)[0]
    xs, ws, dys = jnp.split(x, group, axis=1), jnp.split(w, group, axis=0), jnp.split(dy, group, axis=1)
    return jnp.concatenate([jax.vjp(lambda wk, xk=xk: _conv(xk, wk, stride, pad, dilation, 1), wk)[1](dk)[0]
                            for xk, wk, dk in zip(xs, ws, dys, strict=True)], axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _grouped_conv(x, w, stride, pad, dilation, group):
    """A stride-1 grouped convolution whose weight gradient is :func:`_weight_grad`'s (XLA's own is wrong under
    some batch splits); its input gradient is XLA's."""
    return _conv(x, w, stride, pad, dilation, group)


def _grouped_conv_fwd(x, w, stride, pad, dilation, group):
    return _conv(x, w, stride, pad, dilation, group), (x, w)


def _grouped_conv_bwd(stride, pad, dilation, group, res, dy):
    x, w = res
    _, vx = jax.vjp(lambda x: _conv(x, w, stride, pad, dilation, group), x)
    return vx(dy)[0], _weight_grad(x, w, dy, stride, pad, dilation, group)


_grouped_conv.defvjp(_grouped_conv_fwd, _grouped_conv_bwd)


_strided_conv.defvjp(_strided_conv_fwd, _strided_conv_bwd)


class _Pool(Primitive):
    reducer: str = "max"

    def __init__(self, kernel_size=1, strides=1, pad_mode: str = "valid", data_format: str = "NCHW",
                 name: str | None = None):
        super().__init__(name)
        _layout_format(type(self).__name__, data_format)
        self.kernel_size, self.strides, self.pad_mode = _pair(kernel_size), _pair(strides), pad_mode.upper()

    def compute(self, x):
        win, st = (1, 1) + self.kernel_size, (1, 1) + self.strides
        if self.reducer == "max":
            return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, win, st, self.pad_mode)
        s = jax.lax.reduce_window(x, 0.0, jax.lax.add, win, st, self.pad_mode)
        return s / (self.kernel_size[0] * self.kernel_size[1])

    def spec(self, shapes, attrs):
        tiled = self.kernel_size == self.strides and all(
            n % k == 0 for n, k in zip(shapes[0][2:], self.kernel_size))
        if tiled:
            return (("n", "c", "h", "w"),), (("n", "c", "h", "w"),), _NONE
        return (("n", "c", "hi", "wi"),), (("n", "c", "ho", "wo"),), frozenset({"hi", "wi", "ho", "wo"})


MaxPool = type("MaxPool", (_Pool,), {"reducer": "max", "__doc__": "``MaxPool(kernel_size, strides, pad_mode)``, NCHW."})
AvgPool = type("AvgPool", (_Pool,), {"reducer": "avg", "__doc__": "``AvgPool(kernel_size, strides, pad_mode)``, NCHW."})


class BatchNorm(Primitive):
    """``BatchNorm(is_training=False, epsilon=1e-5)``: inputs (x, scale, bias, mean, variance), NCHW; returns y.

    In training the batch statistics are reduced over n, h, w (XLA all-reduces when those are split).
    """

    def __init__(self, is_training: bool = False, epsilon: float = 1e-5, momentum: float = 0.1,
                 data_format: str = "NCHW", name: str | None = None):
        super().__init__(name)
        _layout_format("BatchNorm", data_format)
        self.is_training, self.epsilon = is_training, epsilon

    def compute(self, x, scale, bias, mean, variance):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        if self.is_training:
            axes = (0,) + tuple(range(2, x.ndim))
            mean, variance = jnp.mean(x, axis=axes), jnp.var(x, axis=axes)
        inv = jax.lax.rsqrt(variance.reshape(shape) + self.epsilon)
        return (x - mean.reshape(shape)) * inv * scale.reshape(shape) + bias.reshape(shape)

    def spec(self, shapes, attrs):
        rest = tuple(LETTERS[7:7 + len(shapes[0]) - 2])
        x = ("n", "c") + rest
        return (x, ("c",), ("c",), ("c",), ("c",)), (x,), _NONE
