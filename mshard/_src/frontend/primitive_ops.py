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
from mshard._src.jaxpr import rules
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


Add = _elementwise("Add", jnp.add, """``Add()(x, y)``: ``x + y`` with numpy broadcasting, as MindSpore's Add.

    Strategy: one split tuple per input, e.g. ``((a, b), (a, b))`` or ``((a, b), (b,))``; a broadcast (size-1) dim is not split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Add()(jnp.ones((2, 3)), jnp.arange(3.0)).tolist()
    [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]
    """)
Sub = _elementwise("Sub", jnp.subtract, """``Sub()(x, y)``: ``x - y`` with numpy broadcasting.

    Strategy: one split tuple per input, e.g. ``((a, b), (a, b))``; a broadcast (size-1) dim of an input is not split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Sub()(jnp.array([5, 7]), jnp.array([1, 2])).tolist()
    [4, 5]
    """)
Mul = _elementwise("Mul", jnp.multiply, """``Mul()(x, y)``: ``x * y`` with numpy broadcasting.

    Strategy: one split tuple per input, e.g. ``((a, b), (a, b))``; a broadcast (size-1) dim of an input is not split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Mul()(jnp.array([2, 3]), jnp.array([4, 5])).tolist()
    [8, 15]
    """)
RealDiv = _elementwise("RealDiv", jnp.divide, """``RealDiv()(x, y)``: ``x / y`` (true division) with numpy broadcasting.

    Strategy: one split tuple per input, e.g. ``((a, b), (a, b))``; a broadcast (size-1) dim of an input is not split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.RealDiv()(jnp.array([1.0, 3.0]), jnp.array([2.0, 4.0])).tolist()
    [0.5, 0.75]
    """)
Maximum = _elementwise("Maximum", jnp.maximum, """``Maximum()(x, y)``: the elementwise maximum, with numpy broadcasting.

    Strategy: one split tuple per input, e.g. ``((a, b), (a, b))``; a broadcast (size-1) dim of an input is not split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Maximum()(jnp.array([1, 5]), jnp.array([3, 2])).tolist()
    [3, 5]
    """)
Minimum = _elementwise("Minimum", jnp.minimum, """``Minimum()(x, y)``: the elementwise minimum, with numpy broadcasting.

    Strategy: one split tuple per input, e.g. ``((a, b), (a, b))``; a broadcast (size-1) dim of an input is not split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Minimum()(jnp.array([1, 5]), jnp.array([3, 2])).tolist()
    [1, 2]
    """)
ReLU = _elementwise("ReLU", jax.nn.relu, """``ReLU()(x)``: ``max(x, 0)`` elementwise.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; every dim may be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.ReLU()(jnp.array([-1.0, 2.0])).tolist()
    [0.0, 2.0]
    """)
GeLU = _elementwise("GeLU", jax.nn.gelu, """``GeLU()(x)``: GELU elementwise, the tanh approximation (as MindSpore's GeLU).

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; every dim may be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.GeLU()(jnp.zeros(2)).tolist()
    [0.0, 0.0]
    """)
Tanh = _elementwise("Tanh", jnp.tanh, """``Tanh()(x)``: ``tanh(x)`` elementwise.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; every dim may be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Tanh()(jnp.zeros(2)).tolist()
    [0.0, 0.0]
    """)
Sigmoid = _elementwise("Sigmoid", jax.nn.sigmoid, """``Sigmoid()(x)``: the logistic sigmoid ``1 / (1 + exp(-x))`` elementwise.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; every dim may be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Sigmoid()(jnp.zeros(2)).tolist()
    [0.5, 0.5]
    """)
Exp = _elementwise("Exp", jnp.exp, """``Exp()(x)``: ``exp(x)`` elementwise.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; every dim may be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Exp()(jnp.zeros(2)).tolist()
    [1.0, 1.0]
    """)
Log = _elementwise("Log", jnp.log, """``Log()(x)``: the natural logarithm elementwise.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; every dim may be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Log()(jnp.ones(2)).tolist()
    [0.0, 0.0]
    """)
Sqrt = _elementwise("Sqrt", jnp.sqrt, """``Sqrt()(x)``: the square root elementwise.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; every dim may be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Sqrt()(jnp.array([4.0, 9.0])).tolist()
    [2.0, 3.0]
    """)
Square = _elementwise("Square", jnp.square, """``Square()(x)``: ``x * x`` elementwise.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; every dim may be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Square()(jnp.array([2, 3])).tolist()
    [4, 9]
    """)


def _layout_format(op: str, data_format: str, allowed: tuple[str, ...] = ("NCHW",)) -> str:
    """``data_format`` as MindSpore's op takes it, refused (not ignored) where mshard computes another layout."""
    if data_format not in allowed:
        raise StrategyError(f"{op}: data_format={data_format!r} is not supported; mshard's {op} takes "
                            f"{' or '.join(map(repr, allowed))} (transpose the input to NCHW, or leave data_format out).")
    return data_format


class BiasAdd(Primitive):
    """``BiasAdd(data_format="NCHW")(x, bias)``: ``x + bias``, the bias ``(C,)`` added along x's channel dim, as
    MindSpore's BiasAdd: dim 1 for "NCHW" / "NCDHW" (for a 2-D ``[N, C]`` input that is the last dim), the last dim
    for "NHWC". Strategy ``((n, c, ...), (c,))``: the bias splits as the channel dim.

    Args:
        data_format: where the channel dim is: ``"NCHW"`` (default), ``"NCDHW"`` or ``"NHWC"``; any other value
            raises StrategyError.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

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
    """``Cast()(x, dtype)``: ``x`` converted to ``dtype`` (``x.astype(dtype)``), as MindSpore's Cast.

    Strategy: one split tuple for ``x`` only (``dtype`` is an attribute, not a tensor), e.g. ``((a, b),)``.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Cast()(jnp.array([1.7, -2.2]), jnp.int32).tolist()
    [1, -2]
    """

    n_tensors = 1

    def compute(self, x, dtype):
        return x.astype(dtype)

    def spec(self, shapes, attrs):
        ins, outs = broadcast_spec(shapes)
        return ins, outs, _NONE


# -- matmul ----------------------------------------------------------------------------------------
class MatMul(Primitive):
    """``MatMul(transpose_a=False, transpose_b=False)(x, w)``: 2-D ``x @ w``. Strategy ``((m, k), (k, n))``.

    With ``transpose_b=True`` the weight is ``[n, k]`` and the strategy ``((m, k), (n, k))``, as in MindSpore
    (``transpose_a=True``: ``x`` is ``[k, m]``, strategy ``((k, m), ...)``). Splitting ``k`` sums partial products.

    Args:
        transpose_a: ``x`` is ``[k, m]`` (contract its dim 0 instead of dim 1).
        transpose_b: the weight is ``[n, k]`` (contract its dim 1 instead of dim 0).
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.MatMul()(jnp.ones((2, 3)), jnp.ones((3, 4))).shape
    (2, 4)
    >>> ops.MatMul(transpose_b=True)(jnp.ones((2, 3)), jnp.ones((4, 3))).shape
    (2, 4)
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
    """``BatchMatMul(transpose_a=False, transpose_b=False)(x, w)``: ``[..., m, k] @ [..., k, n]``, as MindSpore's.

    The batch dims broadcast (numpy rules). Strategy: the batch dims' splits, then ``(m, k)`` and ``(k, n)``, e.g.
    ``((b, m, k), (b, k, n))``; a broadcast (size-1) batch dim is not split.

    Args:
        transpose_a: ``x`` is ``[..., k, m]``.
        transpose_b: ``w`` is ``[..., n, k]``.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.BatchMatMul()(jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5))).shape
    (2, 3, 5)
    """

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


ReduceSum = type("ReduceSum", (_Reduce,), {
    "fn": staticmethod(jnp.sum),
    "__doc__": """``ReduceSum(keep_dims=False)(x, axis=())``: the sum of ``x`` over ``axis`` (an int or a tuple of ints;
    ``()`` or ``None``: every dim), as MindSpore's ReduceSum.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; a reduced dim may be split too (the partial results
    are combined across devices).

    Args:
        keep_dims: keep each reduced dim as a dim of size 1 instead of dropping it.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.ReduceSum()(jnp.ones((2, 3)), 1).tolist()
    [3.0, 3.0]
    >>> ops.ReduceSum(keep_dims=True)(jnp.ones((2, 3)), 1).shape
    (2, 1)
    """})
ReduceMean = type("ReduceMean", (_Reduce,), {
    "fn": staticmethod(jnp.mean),
    "__doc__": """``ReduceMean(keep_dims=False)(x, axis=())``: the mean of ``x`` over ``axis`` (an int or a tuple of ints;
    ``()`` or ``None``: every dim), as MindSpore's ReduceMean.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; a reduced dim may be split too (the partial results
    are combined across devices).

    Args:
        keep_dims: keep each reduced dim as a dim of size 1 instead of dropping it.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.ReduceMean()(jnp.array([[1.0, 3.0], [5.0, 7.0]]), 0).tolist()
    [3.0, 5.0]
    >>> ops.ReduceMean(keep_dims=True)(jnp.ones((2, 3)), 1).shape
    (2, 1)
    """})
ReduceMax = type("ReduceMax", (_Reduce,), {
    "fn": staticmethod(jnp.max),
    "__doc__": """``ReduceMax(keep_dims=False)(x, axis=())``: the maximum of ``x`` over ``axis`` (an int or a tuple of ints;
    ``()`` or ``None``: every dim), as MindSpore's ReduceMax.

    Strategy: one split tuple for ``x``, e.g. ``((a, b),)``; a reduced dim may be split too (the partial results
    are combined across devices).

    Args:
        keep_dims: keep each reduced dim as a dim of size 1 instead of dropping it.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.ReduceMax()(jnp.array([[1, 4], [3, 2]]), 1).tolist()
    [4, 3]
    >>> ops.ReduceMax(keep_dims=True)(jnp.ones((2, 3)), 1).shape
    (2, 1)
    """})


class Softmax(Primitive):
    """``Softmax(axis=-1)(x)``: ``exp(x) / sum(exp(x))`` along ``axis``, as MindSpore's Softmax.

    Strategy: one split tuple for ``x``, e.g. ``((a, 1),)``; the softmax axis cannot be split (as in MindSpore).

    Args:
        axis: the dim to normalise over (one int).
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Softmax()(jnp.zeros((2, 4))).tolist()
    [[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]
    """

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
    """``LogSoftmax(axis=-1)(x)``: ``log(softmax(x))`` along ``axis``, computed stably, as MindSpore's LogSoftmax.

    Strategy: one split tuple for ``x``, e.g. ``((a, 1),)``; the softmax axis cannot be split.

    Args:
        axis: the dim to normalise over (one int).
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.LogSoftmax()(jnp.zeros((1, 2))).tolist()
    [[-0.693..., -0.693...]]
    """

    fn = staticmethod(jax.nn.log_softmax)


class LayerNorm(Primitive):
    """``LayerNorm(begin_norm_axis=1, begin_params_axis=1, epsilon=1e-7)(x, gamma, beta)``: returns ``(y, mean,
    variance)``, as MindSpore's LayerNorm.

    ``x`` is normalised over dims ``begin_norm_axis`` onwards, then scaled by ``gamma`` and shifted by ``beta`` (both of
    shape ``x.shape[begin_params_axis:]``); ``mean`` and ``variance`` keep the normalised dims as size 1.
    Strategy: one split tuple each for ``x``, ``gamma``, ``beta``; the normalised dims cannot be split (as in MindSpore).

    Args:
        begin_norm_axis: the first dim normalised over (negative counts from the end).
        begin_params_axis: the first dim ``gamma`` and ``beta`` cover.
        epsilon: added to the variance before the square root.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> y, mean, var = ops.LayerNorm()(jnp.array([[1.0, 3.0], [2.0, 6.0]]), jnp.ones(2), jnp.zeros(2))
    >>> mean.tolist(), var.tolist(), y.shape
    ([[2.0], [4.0]], [[1.0], [4.0]], (2, 2))
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
    """``SoftmaxCrossEntropyWithLogits()(logits, labels)``: returns ``(loss, dlogits)``, as MindSpore's.

    ``logits`` and the one-hot (or soft) ``labels`` are ``[batch, classes]``; ``loss`` is ``[batch]``, the cross entropy
    of ``softmax(logits)``, and ``dlogits = softmax(logits) - labels``, its gradient. Strategy ``((b, c), (b, c))``.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> loss, dlogits = ops.SoftmaxCrossEntropyWithLogits()(jnp.zeros((1, 2)), jnp.array([[1.0, 0.0]]))
    >>> loss.tolist(), dlogits.tolist()
    ([0.693...], [[-0.5, 0.5]])
    """

    def compute(self, logits, labels):
        logp = jax.nn.log_softmax(logits, axis=-1)
        loss = -jnp.sum(labels * logp, axis=-1)
        return loss, jnp.exp(logp) - labels

    def spec(self, shapes, attrs):
        return (("b", "c"), ("b", "c")), (("b",), ("b", "c")), _NONE


# -- shape ops -----------------------------------------------------------------------------------------
class Transpose(Primitive):
    """``Transpose()(x, perm)``: ``x``'s dims permuted, output dim ``k`` being input dim ``perm[k]``, as MindSpore's.

    Strategy: one split tuple for ``x`` only (``perm`` is an attribute), e.g. ``((a, b, c),)``; the splits move with
    the dims.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Transpose()(jnp.ones((2, 3, 4)), (2, 0, 1)).shape
    (4, 2, 3)
    """

    n_tensors = 1

    def compute(self, x, perm):
        return jnp.transpose(x, perm)

    def spec(self, shapes, attrs):
        d = LETTERS[:len(shapes[0])]
        return (tuple(d),), (tuple(d[p] for p in attrs[0]),), _NONE


class Reshape(Primitive):
    """``Reshape()(x, shape)``: ``x`` with a new shape of the same size (one ``-1`` is inferred), as MindSpore's.

    Strategy: one split tuple for ``x`` only; the result is laid out as the split blocks fall in the new shape. The
    dims are grouped into runs of equal products and a run into the finest factors both shapes are made of
    (:func:`mshard._src.jaxpr.rules.reshape_rule`): a split of a dim made of several factors is a split of its
    leading factor, and of the next ones only once the leading one is split whole, so that each device's block is
    one contiguous run of the array and the reshape moves no data. ``[64, 8]`` split ``(8, 1)`` reshaped to
    ``(4, -1)`` is ``[4, 128]`` split ``(4, 2)``; ``[8, 6]`` split ``(1, 2)`` reshaped to ``(48,)`` is refused (the
    halves of each row are no block of the 48). A run with no common factors (``[6, 4] -> [4, 6]``) splits its leading
    dim only, by a count dividing both leading dims. The op is planned as the JAX reshape it computes. A shape of
    another size, or a split the rule refuses, raises StrategyError.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Reshape()(jnp.arange(6), (2, -1)).tolist()
    [[0, 1, 2], [3, 4, 5]]
    """

    n_tensors = 1
    as_traced = True

    def compute(self, x, shape):
        return jnp.reshape(x, shape)

    def spec(self, shapes, attrs):
        """One letter per input dim (its loop dim, or its factors' joined: a dim of the input is split alone, and
        its split is checked against its factors here); the result's dims carry none: the result is laid out by
        the traced reshape (``as_traced``), not by letters."""
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
        space = rules.reshape_rule([src], [dst])
        if self.in_strategy is not None and self.in_strategy[0] is not None:
            if self.in_strategy[0].copies is not None and any(k > 1 for k in self.in_strategy[0].copies):
                raise StrategyError(f"{self._where()}: interleaved_parallel asks the reshape to {dst} in copies, "
                                    f"but a Reshape is computed whole on each device's block (a copy would need the "
                                    f"new shape cut alike); lay its input out without 'interleaved_parallel' (the "
                                    f"reshape moves no data where each device's block stays a block).")
            _check_reshape_split(self._where(), space, src, dst, self.in_strategy[0].counts)
        ins = tuple(lab if lab is None or isinstance(lab, str) else "*".join(lab) for lab in space.in_dims[0])
        return (ins,), ((None,) * len(dst),), _NONE


def _check_reshape_split(where: str, space, src: tuple[int, ...], dst: tuple[int, ...], counts) -> None:
    """Raise StrategyError unless split counts ``counts`` of the input are a layout of the reshape's loop dims
    (``space``, :func:`mshard._src.jaxpr.rules.reshape_rule`): each loop dim split by a count dividing what it allows
    (``split_divides``); a dim made of several loop dims split major first, the leading one up to its size; and in
    every dim made of several (the input's or the result's), a loop dim split only when those before it are whole."""
    per: dict[str, int] = {}
    for d, (lab, c) in enumerate(zip(space.in_dims[0], counts)):
        parts = () if lab is None else (lab,) if isinstance(lab, str) else tuple(lab)
        rest = max(c, 1)
        for x in parts:
            n = math.gcd(space.dims[x], space.split_divides.get(x, space.dims[x]))
            take = rest if rest <= n else n
            per[x] = take
            rest //= take
            if rest == 1 or take != space.dims[x]:
                break
        ok = rest == 1 and all(space.dims[x] % per[x] == 0 and
                               math.gcd(space.dims[x], space.split_divides.get(x, space.dims[x])) % per[x] == 0
                               for x in parts if x in per)
        if ok:
            for labels in (*space.in_dims, *space.out_dims):
                for m in labels:
                    if isinstance(m, tuple):
                        ok = ok and all(per.get(x, 1) == 1 or all(per.get(y, 1) == space.dims[y] for y in m[:k])
                                        for k, x in enumerate(m))
        if not ok:
            raise StrategyError(f"{where}: input dim {d} (size {src[d]}) split {c} ways in {tuple(counts)} is no "
                                f"block split of the new shape {dst}: a reshape keeps a split where each device's "
                                f"block stays one contiguous run of the array (of a dim made of several, the leading "
                                f"one first, whole before the next). Use a split the new shape keeps whole, e.g. one "
                                f"dividing its leading dim.")


class Flatten(Reshape):
    """``Flatten()(x)``: ``[N, d1, d2, ...] -> [N, d1 * d2 * ...]``, as MindSpore's ``ops.Flatten``.

    Strategy: one split tuple for ``x``; the batch dim splits freely, and of the flattened dims only the first may
    be split (Reshape's rule).

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Flatten()(jnp.ones((2, 3, 4))).shape
    (2, 12)
    """

    def compute(self, x):
        return jnp.reshape(x, (x.shape[0], -1))

    def spec(self, shapes, attrs):
        s = tuple(shapes[0])
        return super().spec(shapes, ((s[0], math.prod(s[1:])),))


class ExpandDims(Primitive):
    """``ExpandDims()(x, axis)``: ``x`` with a new size-1 dim at ``axis`` (an int; negative counts from the end).

    Strategy: one split tuple for ``x`` only, e.g. ``((a, b),)``; the new dim is not split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.ExpandDims()(jnp.ones((2, 3)), 0).shape
    (1, 2, 3)
    """

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
    """``Squeeze(axis=())(x)``: ``x`` without the size-1 dims in ``axis`` (all its size-1 dims when ``axis=()``).

    Strategy: one split tuple for ``x``, e.g. ``((1, a, 1),)``.

    Args:
        axis: an int or a tuple of ints, the dims to remove (each of size 1); ``()``: every size-1 dim.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Squeeze()(jnp.ones((1, 2, 1))).shape
    (2,)
    >>> ops.Squeeze(0)(jnp.ones((1, 2, 1))).shape
    (2, 1)
    """

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
    """``Concat(axis=0)((x1, x2, ...))``: the inputs joined along ``axis``, as MindSpore's Concat.

    The inputs come as one tuple/list (as in MindSpore) or as separate arguments. Strategy: one split tuple per input,
    e.g. ``((a, 1), (a, 1))``; the concat axis cannot be split.

    Args:
        axis: the dim to join along.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Concat(axis=1)((jnp.zeros((2, 1)), jnp.ones((2, 2)))).tolist()
    [[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]
    """

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
    """``StridedSlice()(x, begin, end, strides)``: ``x[begin[k]:end[k]:strides[k], ...]`` per dim (Python slices).

    Dims past ``len(begin)`` are kept whole; MindSpore's masks (``begin_mask`` etc.) are not taken. Strategy: one split
    tuple for ``x`` only; a dim that is sliced (not its full range with stride 1) cannot be split.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.StridedSlice()(jnp.arange(10), (1,), (7,), (2,)).tolist()
    [1, 3, 5]
    """

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
    """``Gather()(params, indices, axis=0)``: the slices of ``params`` at ``indices`` along ``axis``, as MindSpore's.

    The output's shape is ``params.shape[:axis] + indices.shape + params.shape[axis + 1:]``; with ``axis=0`` and
    ``params`` ``[vocab, dim]`` it is the embedding lookup. Strategy ((v, d), (b, s)): one split tuple for ``params``
    and one for ``indices``; splitting the vocab v needs a masked lookup plus an all-reduce (XLA does it).

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Gather()(jnp.array([[0, 1], [2, 3], [4, 5]]), jnp.array([2, 0])).tolist()
    [[4, 5], [0, 1]]
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
    """``OneHot(axis=-1)(indices, depth, on_value=1.0, off_value=0.0)``: a one-hot tensor with a new dim of size
    ``depth`` at ``axis``, ``on_value`` where the index matches and ``off_value`` elsewhere, as MindSpore's OneHot.

    ``depth`` is a Python int. Strategy: one split tuple for ``indices`` only, e.g. ``((b,),)``; the new dim is not split.

    Args:
        axis: where the new ``depth`` dim goes in the output (``-1``: last).
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.OneHot()(jnp.array([0, 2]), 3, 1.0, 0.0).tolist()
    [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]
    """

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
    """``Conv2D(out_channel, kernel_size, pad_mode="valid", pad=0, stride=1, dilation=1, group=1)(x, w)``: a 2-D
    convolution of ``x`` ``[N, C, H, W]`` with the weight ``w`` ``[O, C / group, kh, kw]`` (NCHW/OIHW, as MindSpore's).

    The output is ``[N, O, H', W']``; the kernel size is read from ``w``. Strategy ``((n, c, h, w), (o, c, 1, 1))``;
    h and w may be split only with pad_mode="same" and stride 1 (XLA exchanges the halos).

    Args:
        out_channel: the number of output channels ``O`` (MindSpore's argument; ``w`` sets it).
        kernel_size: an int or ``(kh, kw)`` (MindSpore's argument; ``w`` sets it).
        mode: MindSpore's (unused; 1 is convolution).
        pad_mode: ``"valid"`` (no padding), ``"same"`` (output ``ceil(size / stride)``) or ``"pad"`` (use ``pad``).
        pad: under ``pad_mode="pad"``: an int for every side or ``(top, bottom, left, right)``; else ignored.
        stride: an int or ``(sh, sw)``.
        dilation: an int or ``(dh, dw)``, the kernel's dilation.
        group: the number of channel groups (``C`` and ``O`` divisible by it).
        data_format: only ``"NCHW"``; any other value raises StrategyError.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Conv2D(4, 3)(jnp.ones((1, 2, 5, 5)), jnp.ones((4, 2, 3, 3))).shape
    (1, 4, 3, 3)
    >>> ops.Conv2D(4, 3, pad_mode="same")(jnp.ones((1, 2, 5, 5)), jnp.ones((4, 2, 3, 3)))[0, :, 2, 2].tolist()
    [18.0, 18.0, 18.0, 18.0]
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
    kernel, stride 2, pad 1 on a width-4 input; docs/xla_repro/r2_conv_stride_grad_abort.py, plain jax.jit on one
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
    tests/e2e/strategies/test_primitive_references.py's Conv2D-group-batch-2-of-8 case). Same FLOPs, ``group`` smaller ops."""
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


MaxPool = type("MaxPool", (_Pool,), {
    "reducer": "max",
    "__doc__": """``MaxPool(kernel_size=1, strides=1, pad_mode="valid")(x)``: the maximum of each ``kernel_size`` window,
    over ``x``'s last two dims (NCHW), as MindSpore's MaxPool.

    Strategy ``((n, c, h, w),)``; ``h`` and ``w`` may be split only when the windows tile the input
    (``kernel_size == strides`` and it divides ``h`` and ``w``).

    Args:
        kernel_size: the window, an int or ``(kh, kw)``.
        strides: the window's step, an int or ``(sh, sw)``.
        pad_mode: ``"valid"`` (no padding) or ``"same"`` (pad so the output is ``ceil(size / stride)``);
            case-insensitive.
        data_format: only ``"NCHW"``; any other value raises StrategyError.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.MaxPool(2, 2)(jnp.arange(16.0).reshape(1, 1, 4, 4)).tolist()
    [[[[5.0, 7.0], [13.0, 15.0]]]]
    """})
AvgPool = type("AvgPool", (_Pool,), {
    "reducer": "avg",
    "__doc__": """``AvgPool(kernel_size=1, strides=1, pad_mode="valid")(x)``: the mean of each ``kernel_size`` window,
    over ``x``'s last two dims (NCHW), as MindSpore's AvgPool; with ``"same"``, padding counts as zeros.

    Strategy ``((n, c, h, w),)``; ``h`` and ``w`` may be split only when the windows tile the input
    (``kernel_size == strides`` and it divides ``h`` and ``w``).

    Args:
        kernel_size: the window, an int or ``(kh, kw)``.
        strides: the window's step, an int or ``(sh, sw)``.
        pad_mode: ``"valid"`` (no padding) or ``"same"`` (pad so the output is ``ceil(size / stride)``);
            case-insensitive.
        data_format: only ``"NCHW"``; any other value raises StrategyError.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.AvgPool(2, 2)(jnp.arange(16.0).reshape(1, 1, 4, 4)).tolist()
    [[[[2.5, 4.5], [10.5, 12.5]]]]
    """})


class BatchNorm(Primitive):
    """``BatchNorm(is_training=False, epsilon=1e-5)(x, scale, bias, mean, variance)``: per-channel batch
    normalisation of ``x`` ``[N, C, ...]`` (NCHW); ``scale``, ``bias``, ``mean`` and ``variance`` are ``(C,)``. Returns ``y``.

    ``y = (x - mean) / sqrt(variance + epsilon) * scale + bias``; in training the batch's own statistics over n, h, w
    replace ``mean`` and ``variance`` (XLA all-reduces when those dims are split). Unlike MindSpore's it returns no
    updated statistics. Strategy ``((n, c, h, w), (c,), (c,), (c,), (c,))``.

    Args:
        is_training: use the batch's statistics instead of ``mean`` and ``variance``.
        epsilon: added to the variance before the square root.
        momentum: MindSpore's running-statistics momentum (accepted, unused: no statistics are updated here).
        data_format: only ``"NCHW"``; any other value raises StrategyError.
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> x, bias = jnp.zeros((2, 3, 2, 2)), jnp.array([1.0, 2.0, 3.0])
    >>> ops.BatchNorm()(x, jnp.ones(3), bias, jnp.zeros(3), jnp.ones(3))[0, :, 0, 0].tolist()
    [1.0, 2.0, 3.0]
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
