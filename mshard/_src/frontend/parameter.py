"""MindSpore's ``Parameter``, ``Tensor``, dtypes and ``initializer`` over Flax NNX Variables and jax arrays.

A ``Parameter`` is an ``nnx.Param`` (``requires_grad=False``: a :class:`FrozenParameter`, an ``nnx.Variable`` that no
gradient is taken for), so a Cell that holds one is an ordinary nnx Module. ``initializer`` draws at once from the
global seed (``ms.set_seed``) where MindSpore draws lazily.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mshard._src.values.errors import CellError, CellTypeError
from mshard._src.values.seed import next_key

# MindSpore's dtype names
float16 = jnp.float16
float32 = jnp.float32
float64 = jnp.float64
bfloat16 = jnp.bfloat16
int8 = jnp.int8
int16 = jnp.int16
int32 = jnp.int32
int64 = jnp.int64
uint8 = jnp.uint8
bool_ = jnp.bool_
float_ = float32


def Tensor(input_data: Any = None, dtype: Any = None) -> jax.Array:
    """MindSpore's ``Tensor(input_data, dtype)``: here a ``jax.Array`` (global, on the default device).

    Args:
        input_data: an array, a NumPy array, a number or a nested list.
        dtype: the dtype (``ms.float32``, ...); None keeps the data's (a Python float becomes float32).

    Returns:
        The ``jax.Array``.

    >>> import mshard as ms
    >>> ms.Tensor([[1, 2]], ms.float32).dtype, ms.Tensor(2.0).dtype
    (dtype('float32'), dtype('float32'))
    """
    if input_data is None:
        raise CellTypeError("Tensor: input_data is None; MindSpore's lazy Tensor(shape=..., init=...) is "
                            "initializer(init, shape, dtype) here.")
    return jnp.asarray(input_data, dtype=dtype)


# -- initializers ---------------------------------------------------------------------------------------
def _fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """MindSpore's fan_in / fan_out of a weight ``[out, in, *kernel]`` (a 1-D shape: both its size)."""
    if len(shape) < 2:
        n = shape[0] if shape else 1
        return n, n
    field = math.prod(shape[2:])
    return shape[1] * field, shape[0] * field


class Initializer:
    """Base of MindSpore's initializer objects: ``init(shape, dtype, key)`` returns the values; pass one to
    :func:`initializer` (or as a ``weight_init``). A subclass defines ``__call__``.

    Args:
        none: the base takes no arguments.

    >>> import jax, jax.numpy as jnp
    >>> from mshard.common.initializer import Initializer, initializer
    >>> class Twos(Initializer):
    ...     def __call__(self, shape, dtype, key):
    ...         return jnp.full(shape, 2.0, dtype)
    >>> initializer(Twos(), [2]).tolist()
    [2.0, 2.0]
    """

    def __call__(self, shape: tuple[int, ...], dtype: Any, key: jax.Array) -> jax.Array:
        raise NotImplementedError


class Zero(Initializer):
    """All zeros (the name ``"zeros"``).

    Args:
        none: takes no arguments.

    >>> from mshard.common.initializer import Zero, initializer
    >>> initializer(Zero(), [2]).tolist()
    [0.0, 0.0]
    """

    def __call__(self, shape, dtype, key):
        return jnp.zeros(shape, dtype)


class One(Initializer):
    """All ones (the name ``"ones"``).

    Args:
        none: takes no arguments.

    >>> from mshard.common.initializer import One, initializer
    >>> initializer(One(), [2]).tolist()
    [1.0, 1.0]
    """

    def __call__(self, shape, dtype, key):
        return jnp.ones(shape, dtype)


class Constant(Initializer):
    """Every value ``value``.

    Args:
        value: the value.

    >>> from mshard.common.initializer import Constant, initializer
    >>> initializer(Constant(3), [2]).tolist()
    [3.0, 3.0]
    """

    def __init__(self, value: float):
        self.value = value

    def __call__(self, shape, dtype, key):
        return jnp.full(shape, self.value, dtype)


class Normal(Initializer):
    """``N(mean, sigma^2)`` (the name ``"normal"``: sigma 0.01).

    Args:
        sigma: the standard deviation.
        mean: the mean.

    >>> from mshard.common.initializer import Normal, initializer
    >>> initializer(Normal(0.02), [3, 2]).shape
    (3, 2)
    """

    def __init__(self, sigma: float = 0.01, mean: float = 0.0):
        self.sigma, self.mean = sigma, mean

    def __call__(self, shape, dtype, key):
        return (self.mean + self.sigma * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class TruncatedNormal(Initializer):
    """``N(0, sigma^2)`` cut at two sigmas (the name ``"truncatedNormal"``: sigma 0.01).

    Args:
        sigma: the standard deviation before the cut.

    >>> from mshard.common.initializer import TruncatedNormal, initializer
    >>> float(abs(initializer(TruncatedNormal(0.1), [100])).max()) <= 0.2
    True
    """

    def __init__(self, sigma: float = 0.01):
        self.sigma = sigma

    def __call__(self, shape, dtype, key):
        return (self.sigma * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dtype)


class Uniform(Initializer):
    """``U(-scale, scale)`` (the name ``"uniform"``: scale 0.07).

    Args:
        scale: the bound.

    >>> from mshard.common.initializer import Uniform, initializer
    >>> float(abs(initializer(Uniform(0.5), [100])).max()) <= 0.5
    True
    """

    def __init__(self, scale: float = 0.07):
        self.scale = scale

    def __call__(self, shape, dtype, key):
        return jax.random.uniform(key, shape, jnp.float32, -self.scale, self.scale).astype(dtype)


class XavierUniform(Initializer):
    """``U(-b, b)`` with ``b = gain * sqrt(6 / (fan_in + fan_out))`` (the name ``"xavier_uniform"``); for a weight
    ``[out, in, *kernel]`` fan_in is ``in * prod(kernel)`` and fan_out ``out * prod(kernel)``.

    Args:
        gain: the scale factor.

    >>> from mshard.common.initializer import XavierUniform, initializer
    >>> float(abs(initializer(XavierUniform(), [4, 2])).max()) <= 1.0
    True
    """

    def __init__(self, gain: float = 1.0):
        self.gain = gain

    def __call__(self, shape, dtype, key):
        fi, fo = _fans(tuple(shape))
        b = self.gain * math.sqrt(6.0 / (fi + fo))
        return jax.random.uniform(key, shape, jnp.float32, -b, b).astype(dtype)


class XavierNormal(Initializer):
    """``N(0, s^2)`` with ``s = gain * sqrt(2 / (fan_in + fan_out))`` (the name ``"xavier_normal"``).

    Args:
        gain: the scale factor.

    >>> from mshard.common.initializer import XavierNormal, initializer
    >>> initializer(XavierNormal(), [4, 2]).shape
    (4, 2)
    """

    def __init__(self, gain: float = 1.0):
        self.gain = gain

    def __call__(self, shape, dtype, key):
        fi, fo = _fans(tuple(shape))
        return (self.gain * math.sqrt(2.0 / (fi + fo)) * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _gain(negative_slope: float, nonlinearity: str) -> float:
    if nonlinearity == "leaky_relu":
        return math.sqrt(2.0 / (1 + negative_slope ** 2))
    return {"relu": math.sqrt(2.0), "tanh": 5.0 / 3, "linear": 1.0, "sigmoid": 1.0}.get(nonlinearity, 1.0)


class HeUniform(Initializer):
    """``U(-b, b)`` with ``b = gain * sqrt(3 / fan)``, ``gain = sqrt(2 / (1 + negative_slope^2))`` for leaky_relu
    (the name ``"he_uniform"``). ``HeUniform(math.sqrt(5))`` is MindSpore's Dense default: ``b = 1 / sqrt(fan_in)``.

    Args:
        negative_slope: the leaky_relu slope in the gain.
        mode: ``"fan_in"`` or ``"fan_out"``.
        nonlinearity: ``"leaky_relu"``, ``"relu"``, ``"tanh"``, ``"linear"`` or ``"sigmoid"``.

    >>> import math
    >>> from mshard.common.initializer import HeUniform, initializer
    >>> float(abs(initializer(HeUniform(math.sqrt(5)), [3, 100])).max()) <= 0.1
    True
    """

    def __init__(self, negative_slope: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"):
        self.negative_slope, self.mode, self.nonlinearity = negative_slope, mode, nonlinearity

    def __call__(self, shape, dtype, key):
        fi, fo = _fans(tuple(shape))
        b = _gain(self.negative_slope, self.nonlinearity) * math.sqrt(3.0 / (fi if self.mode == "fan_in" else fo))
        return jax.random.uniform(key, shape, jnp.float32, -b, b).astype(dtype)


class HeNormal(Initializer):
    """``N(0, s^2)`` with ``s = gain / sqrt(fan)`` (the name ``"he_normal"``; the gain as :class:`HeUniform`'s).

    Args:
        negative_slope: the leaky_relu slope in the gain.
        mode: ``"fan_in"`` or ``"fan_out"``.
        nonlinearity: ``"leaky_relu"``, ``"relu"``, ``"tanh"``, ``"linear"`` or ``"sigmoid"``.

    >>> from mshard.common.initializer import HeNormal, initializer
    >>> initializer(HeNormal(), [3, 2]).shape
    (3, 2)
    """

    def __init__(self, negative_slope: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu"):
        self.negative_slope, self.mode, self.nonlinearity = negative_slope, mode, nonlinearity

    def __call__(self, shape, dtype, key):
        fi, fo = _fans(tuple(shape))
        s = _gain(self.negative_slope, self.nonlinearity) / math.sqrt(fi if self.mode == "fan_in" else fo)
        return (s * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


# MindSpore's initializer names (its registry is case-sensitive with aliases; lower-case is accepted too)
_NAMES: dict[str, type[Initializer]] = {
    "zeros": Zero, "zero": Zero, "ones": One, "one": One, "normal": Normal, "truncatednormal": TruncatedNormal,
    "uniform": Uniform, "xavier_uniform": XavierUniform, "xavieruniform": XavierUniform,
    "xavier_normal": XavierNormal, "xaviernormal": XavierNormal, "he_uniform": HeUniform, "heuniform": HeUniform,
    "he_normal": HeNormal, "henormal": HeNormal,
}


def initializer(init: Any, shape: Sequence[int] | int | None = None, dtype: Any = float32) -> jax.Array:
    """MindSpore's ``initializer(init, shape, dtype)``: the values of a new parameter, drawn now from the global seed.

    Args:
        init: an initializer name (``"normal"``, ``"zeros"``, ``"ones"``, ``"uniform"``, ``"truncatedNormal"``,
            ``"xavier_uniform"``, ``"xavier_normal"``, ``"he_uniform"``, ``"he_normal"``), an :class:`Initializer`
            (``Normal(0.02)``), a number (every value), or an array (used as it is; ``shape`` must match).
        shape: the shape (an int or a sequence).
        dtype: the dtype (``ms.float32``, ...).

    Returns:
        A ``jax.Array`` of ``shape`` and ``dtype``.

    >>> import mshard as ms
    >>> from mshard.common.initializer import initializer, One
    >>> initializer("zeros", [2, 3], ms.float32).tolist()
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    >>> initializer(One(), 2).tolist(), initializer(0.5, (1,)).tolist()
    ([1.0, 1.0], [0.5])
    """
    if isinstance(shape, int):
        shape = (shape,)
    if isinstance(init, (jax.Array, np.ndarray)):
        arr = jnp.asarray(init, dtype=dtype)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise CellError(f"initializer: the array given has shape {tuple(arr.shape)}, not the shape {tuple(shape)} "
                            f"asked for.")
        return arr
    if shape is None:
        raise CellTypeError(f"initializer({init!r}): give the shape, e.g. initializer({init!r}, [64, 32], ms.float32).")
    shape = tuple(int(d) for d in shape)
    if isinstance(init, bool) or (not isinstance(init, (str, Initializer)) and not isinstance(init, (int, float))):
        raise CellTypeError(f"initializer: init must be a name, an Initializer, a number or an array, got "
                            f"{type(init).__name__}.")
    if isinstance(init, (int, float)):
        init = Constant(init)
    if isinstance(init, str):
        cls = _NAMES.get(init.lower())
        if cls is None:
            raise CellError(f"initializer: unknown initializer {init!r}. Known: {', '.join(sorted(set(_NAMES)))}.")
        init = cls()
    return init(shape, dtype, next_key())


# -- Parameter ------------------------------------------------------------------------------------------
class FrozenParameter(nnx.Variable):
    """A ``Parameter(..., requires_grad=False)``: state of the Cell that no gradient is taken for and no optimizer
    updates (``trainable_params()`` leaves it out; ``get_parameters()`` lists it)."""


class Parameter(nnx.Param):
    """MindSpore's ``Parameter(default_input, name=None, requires_grad=True)``: an ``nnx.Param`` of a Cell.

    ``requires_grad=False`` gives a :class:`FrozenParameter` (no gradient, not in ``trainable_params()``). ``name``
    is kept as metadata; the parameter's path in plans and checkpoints is its attribute path, as for any nnx Param.
    Differences from MindSpore: ``layerwise_parallel`` and ``parallel_optimizer`` are accepted and unused.

    Args:
        default_input: the initial value: an array, a NumPy array, a number, or ``initializer(...)``'s result.
        name: MindSpore's parameter name (metadata).
        requires_grad: whether the parameter is trained.
        layerwise_parallel: accepted for MindSpore's signature; no effect.
        parallel_optimizer: accepted for MindSpore's signature; optimizer parallel follows the context.

    >>> import mshard as ms
    >>> from mshard.common.initializer import initializer
    >>> w = ms.Parameter(initializer("ones", [2], ms.float32), name="w")
    >>> w[...].tolist(), w.name, isinstance(ms.Parameter(1.0, requires_grad=False), ms.Parameter)
    ([1.0, 1.0], 'w', False)
    """

    def __new__(cls, default_input: Any = None, name: str | None = None, requires_grad: bool = True,
                layerwise_parallel: bool = False, parallel_optimizer: bool = True, **kwargs: Any):
        if not requires_grad:
            return FrozenParameter(_value(default_input), name=name, requires_grad=False)
        return super().__new__(cls)

    def __init__(self, default_input: Any = None, name: str | None = None, requires_grad: bool = True,
                 layerwise_parallel: bool = False, parallel_optimizer: bool = True, **kwargs: Any):
        super().__init__(_value(default_input), name=name, requires_grad=True, **kwargs)


def _value(default_input: Any) -> jax.Array:
    if default_input is None:
        raise CellTypeError("Parameter: default_input is None; give the initial value, e.g. "
                            "Parameter(initializer('normal', [64, 32], ms.float32), name='w').")
    if isinstance(default_input, nnx.Variable):
        return default_input[...]
    arr = jnp.asarray(default_input)
    return arr.astype(jnp.float32) if arr.dtype == jnp.float64 else arr


@contextlib.contextmanager
def no_init_parameters() -> Iterator[None]:
    """MindSpore's ``nn.no_init_parameters()``: a block whose Cells defer initialising their parameters. flax builds
    parameters when the model is built, so here the block changes nothing; it is kept so such scripts run.

    Returns:
        A context manager.

    >>> from mshard import nn
    >>> with nn.no_init_parameters():
    ...     net = nn.Dense(2, 2)
    >>> net.weight[...].shape
    (2, 2)
    """
    yield
