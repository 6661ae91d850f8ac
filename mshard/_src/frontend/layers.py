"""Layers with MindSpore's names and parameter layouts, built on flax.nnx.

Every layer is a :class:`~mshard.nn.Cell` whose heavy ops are MindSpore primitive objects
(``self.matmul``, ``self.gather``, ...), so their strategies are set as in MindSpore
(``dense.matmul.shard(((2, 1), (4, 1)))``). Each takes ``rngs=`` (``flax.nnx.Rngs``) where it has
random state, like flax's layers.

>>> import jax.numpy as jnp
>>> from flax import nnx
>>> from mshard import nn
>>> d = nn.Dense(4, 8, rngs=nnx.Rngs(0))
>>> d.weight[...].shape      # MindSpore layout: [out_channels, in_channels]
(8, 4)
>>> nn.Embedding(10, 4, rngs=nnx.Rngs(0))(jnp.array([[1, 2]])).shape
(1, 2, 4)
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mshard._src.frontend import primitive_ops as ops
from mshard._src.frontend.cell import Cell
from mshard._src.frontend.parameter import HeUniform, Uniform, initializer
from mshard._src.values.errors import CellError
from mshard._src.values.seed import next_key

_ACT: dict[str, Callable] = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "tanh": jnp.tanh,
                             "sigmoid": jax.nn.sigmoid}


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


class Dense(Cell):
    """``Dense(in_channels, out_channels, weight_init=None, bias_init=None, has_bias=True, activation=None)``:
    y = x @ W^T + b, as MindSpore's.

    ``weight`` is ``[out_channels, in_channels]`` and the matmul is ``ops.MatMul(transpose_b=True)``
    (``self.matmul``), as in MindSpore, so ``dense.matmul.shard(((2, 1), (4, 1)))`` is column parallel.
    Inputs of rank > 2 are flattened to 2-D around the matmul. Without ``rngs`` the parameters are drawn from the
    global seed (``ms.set_seed``) with MindSpore's defaults (HeUniform(sqrt(5)) weight, U(+-1/sqrt(in)) bias);
    with ``rngs`` and no ``weight_init`` the weight is LeCun normal and the bias zeros (the flax convention).

    Args:
        in_channels: size of the input's last dim.
        out_channels: size of the output's last dim.
        weight_init: MindSpore's ``weight_init``: an initializer name, ``Initializer``, number or array
            (``ms.common.initializer``).
        bias_init: the same for the bias.
        has_bias: add a ``bias`` parameter ``[out_channels]`` through ``ops.BiasAdd`` (``self.bias_add``).
        activation: applied last: ``"relu"``, ``"gelu"``, ``"tanh"``, ``"sigmoid"``, any callable, or None.
        rngs: optional ``flax.nnx.Rngs``; its ``params`` stream draws ``weight`` when ``weight_init`` is None.
        dtype: the parameters' dtype.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> d = nn.Dense(4, 2, rngs=nnx.Rngs(0))
    >>> d.weight[...].shape, d(jnp.ones((3, 5, 4))).shape
    ((2, 4), (3, 5, 2))
    >>> nn.Dense(3, 1, weight_init="ones", bias_init="zeros")(jnp.ones((1, 3))).tolist()
    [[3.0]]
    """

    def __init__(self, in_channels: int, out_channels: int, weight_init: Any = None, bias_init: Any = None,
                 has_bias: bool = True, activation: str | Callable | None = None, *, rngs: nnx.Rngs | None = None,
                 dtype: Any = jnp.float32):
        if weight_init is None and rngs is not None:
            w = jax.nn.initializers.lecun_normal()(rngs.params(), (out_channels, in_channels), dtype)
        else:       # MindSpore's default: HeUniform(negative_slope=sqrt(5)), drawn from the global seed
            w = initializer(HeUniform(math.sqrt(5)) if weight_init is None else weight_init,
                            (out_channels, in_channels), dtype)
        self.weight = nnx.Param(w)
        if not has_bias:
            self.bias = None
        elif bias_init is None and rngs is None:    # MindSpore's default: U(-1/sqrt(in), 1/sqrt(in))
            self.bias = nnx.Param(initializer(Uniform(1 / math.sqrt(in_channels)), (out_channels,), dtype))
        else:
            self.bias = nnx.Param(initializer("zeros" if bias_init is None else bias_init, (out_channels,), dtype))
        self.matmul = ops.MatMul(transpose_b=True)
        self.bias_add = ops.BiasAdd()
        self.activation = _ACT[activation] if isinstance(activation, str) else activation
        self.in_channels, self.out_channels = in_channels, out_channels

    def __call__(self, x):
        lead = x.shape[:-1]
        if x.ndim != 2:
            x = x.reshape(-1, x.shape[-1])
        y = self.matmul(x, self.weight[...])
        if self.bias is not None:
            y = self.bias_add(y, self.bias[...])
        if self.activation is not None:
            y = self.activation(y)
        return y.reshape(*lead, self.out_channels) if len(lead) != 1 else y


class ReLU(Cell):
    """``nn.ReLU()``: ``max(x, 0)`` element-wise, through ``ops.ReLU`` (``self.relu``, so ``relu.relu.shard(...)`` works).

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> nn.ReLU()(jnp.array([-1.0, 2.0])).tolist()
    [0.0, 2.0]
    """

    def __init__(self):
        self.relu = ops.ReLU()

    def __call__(self, x):
        return self.relu(x)


class Embedding(Cell):
    """``Embedding(vocab_size, embedding_size, use_one_hot=False, padding_idx=None, *, rngs)``.

    ``embedding_table`` is ``[vocab_size, embedding_size]``; the lookup is ``ops.Gather()``
    (``self.gather``) on axis 0, so ``emb.gather.shard(((1, 1), (8, 1)))`` keeps the table whole and
    splits the ids, and ``((8, 1), (1, 1))`` splits the vocabulary (XLA masks and all-reduces).
    ``use_one_hot=True`` looks up by a one-hot matmul instead (``self.one_hot`` + ``self.matmul``).
    Initialised from N(0, 0.01**2) like MindSpore's ``'normal'``; ``padding_idx`` rows start at zero.

    Args:
        vocab_size: number of rows of ``embedding_table`` (ids are in ``[0, vocab_size)``).
        embedding_size: size of each embedding vector (the output's last dim).
        use_one_hot: look up by a one-hot matmul instead of a gather.
        padding_idx: a row set to zero at initialisation, or None.
        rngs: ``flax.nnx.Rngs``; its ``params`` stream draws the table.
        dtype: the table's dtype.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> emb = nn.Embedding(10, 4, padding_idx=0, rngs=nnx.Rngs(0))
    >>> emb(jnp.array([[0, 3]])).shape, emb.embedding_table[...][0].tolist()
    ((1, 2, 4), [0.0, 0.0, 0.0, 0.0])
    """

    def __init__(self, vocab_size: int, embedding_size: int, use_one_hot: bool = False,
                 padding_idx: int | None = None, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        table = 0.01 * jax.random.normal(rngs.params(), (vocab_size, embedding_size), dtype)
        if padding_idx is not None:
            table = table.at[padding_idx].set(0)
        self.embedding_table = nnx.Param(table)
        self.vocab_size, self.embedding_size = vocab_size, embedding_size
        self.use_one_hot = use_one_hot
        self.gather = ops.Gather()
        self.one_hot = ops.OneHot()
        self.matmul = ops.MatMul()

    def __call__(self, ids):
        table = self.embedding_table[...]
        if not self.use_one_hot:
            return self.gather(table, ids, 0)
        flat = ids.reshape(-1)
        oh = self.one_hot(flat, self.vocab_size, 1.0, 0.0).astype(table.dtype)
        return self.matmul(oh, table).reshape(*ids.shape, self.embedding_size)


class LayerNorm(Cell):
    """``LayerNorm(normalized_shape, begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-7)``.

    Parameters ``gamma`` (ones) and ``beta`` (zeros) of shape ``normalized_shape``; the op is
    ``ops.LayerNorm`` (``self.layer_norm``), whose normalised dims cannot be split.
    ``rngs`` is accepted for a uniform signature and unused.

    Args:
        normalized_shape: shape (or size) of the trailing dims ``gamma`` and ``beta`` cover.
        begin_norm_axis: first axis the mean and variance are taken over (through the last).
        begin_params_axis: first axis ``gamma`` and ``beta`` apply to.
        epsilon: added to the variance before the square root.
        rngs: unused; accepted so every layer takes ``rngs=``.
        dtype: the parameters' dtype.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> y = nn.LayerNorm(4)(jnp.arange(8.0).reshape(2, 4))
    >>> y.shape, bool(jnp.allclose(y.mean(-1), 0, atol=1e-6))
    ((2, 4), True)
    """

    def __init__(self, normalized_shape: Sequence[int] | int, begin_norm_axis: int = -1,
                 begin_params_axis: int = -1, epsilon: float = 1e-7, *, rngs: nnx.Rngs | None = None,
                 dtype: Any = jnp.float32):
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.gamma = nnx.Param(jnp.ones(shape, dtype))
        self.beta = nnx.Param(jnp.zeros(shape, dtype))
        self.layer_norm = ops.LayerNorm(begin_norm_axis, begin_params_axis, epsilon)
        self.normalized_shape = shape

    def __call__(self, x):
        return self.layer_norm(x, self.gamma[...], self.beta[...])[0]


class _Replica(threading.local):
    def __init__(self) -> None:
        self.now: tuple[Any, int, int] | None = None     # (replica index, replica count, rows per replica)


_replica = _Replica()


@contextlib.contextmanager
def per_replica(index: Any, count: int, rows: int):
    """While a data-parallel step runs its replicas side by side (``jax.vmap`` over ``count`` slices
    of ``rows`` batch rows; ``index`` is the vmapped replica number), tell :class:`Dropout` so."""
    saved, _replica.now = _replica.now, (index, count, rows)
    try:
        yield
    finally:
        _replica.now = saved


class Dropout(Cell):
    """``Dropout(keep_prob=None, p=None, *, rngs)``: zero each element with probability ``p`` (or
    ``1 - keep_prob``; default ``p=0.5``) and scale the rest by ``1 / (1 - p)``.

    The mask comes from the ``'dropout'`` stream of ``rngs``, so a sharded run draws the same mask as one
    device (how data-parallel replicas draw theirs: docs/cells.md). Differences from MindSpore: active
    unless ``deterministic`` is True (``cell.set_train(False)`` or nnx's ``cell.eval()``), where MindSpore
    Cells start in inference mode until ``set_train()``.

    Args:
        keep_prob: MindSpore's older argument, the probability of keeping an element (``p = 1 - keep_prob``).
        p: the probability of zeroing an element, in ``[0, 1)``; wins over ``keep_prob``.
        rngs: ``flax.nnx.Rngs``; its ``dropout`` stream (or its default one) draws the masks. None: a stream
            seeded from the global seed (``ms.set_seed``), as MindSpore's Dropout without seeds.
        deterministic: start switched off (the input passes through unchanged).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> d = nn.Dropout(p=0.5, rngs=nnx.Rngs(0))
    >>> set(d(jnp.ones(8)).tolist()) <= {0.0, 2.0}
    True
    >>> d.set_train(False)(jnp.ones(3)).tolist()
    [1.0, 1.0, 1.0]
    """

    def __init__(self, keep_prob: float | None = None, p: float | None = None, *, rngs: nnx.Rngs | None = None,
                 deterministic: bool = False):
        if p is None:
            p = 0.5 if keep_prob is None else 1.0 - keep_prob
        if not 0.0 <= p < 1.0:
            raise CellError(f"Dropout: p={p} (keep_prob={keep_prob}) must be in [0, 1); p is the probability "
                             f"of zeroing an element.")
        self.p = float(p)
        self.deterministic = deterministic
        if rngs is None:
            rngs = nnx.Rngs(dropout=next_key())
        self.rngs = rngs["dropout"].fork()

    def __call__(self, x):
        if self.deterministic or self.p == 0.0:
            return x
        return jnp.where(self._keep(x), x / (1.0 - self.p), jnp.zeros_like(x))

    def _keep(self, x):
        """The mask of the elements kept (bool, ``x``'s shape): one device's draw, in a replica its rows of it."""
        key, rep = self.rngs(), _replica.now
        if rep is None:
            keep = jax.random.bernoulli(key, 1.0 - self.p, x.shape)
        elif x.ndim and x.shape[0] == rep[2]:
            index, count, rows = rep
            whole = jax.random.bernoulli(key, 1.0 - self.p, (count * rows, *x.shape[1:]))
            keep = jax.lax.dynamic_slice_in_dim(whole, index * rows, rows, axis=0)
        else:
            keep = jax.random.bernoulli(jax.random.fold_in(key, rep[0]), 1.0 - self.p, x.shape)
        return keep


class DropoutOp(Dropout):
    """MindSpore's primitive ``ops.Dropout(keep_prob=0.5, Seed0=0, Seed1=0)``: ``output, mask = dropout(x)``.

    Always active (a primitive has no training switch); ``mask`` is 1.0 where an element was kept and 0.0 where it
    was zeroed, in ``x``'s dtype. Nonzero seeds give a fixed stream (``Seed0`` and ``Seed1`` combined); zero seeds
    draw from the global seed (``ms.set_seed``). Differences from MindSpore: it is a Cell (its RNG state is part of
    the network), so build it in ``__init__`` as MindSpore scripts do.

    Args:
        keep_prob: the probability of keeping an element, in ``(0, 1]``.
        Seed0: the first seed (0: the global seed).
        Seed1: the second seed.

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> out, mask = ops.Dropout(keep_prob=0.5, Seed0=1)(jnp.ones(6))
    >>> bool(((out == 2 * mask) & ((mask == 0) | (mask == 1))).all())
    True
    """

    def __init__(self, keep_prob: float = 0.5, Seed0: int = 0, Seed1: int = 0):
        if not 0.0 < keep_prob <= 1.0:
            raise CellError(f"ops.Dropout: keep_prob={keep_prob} must be in (0, 1]: the probability of keeping an "
                            f"element.")
        rngs = nnx.Rngs(dropout=jax.random.fold_in(jax.random.key(Seed0), Seed1)) if (Seed0 or Seed1) else None
        super().__init__(p=1.0 - keep_prob, rngs=rngs)

    def __call__(self, x):
        if self.p == 0.0:
            return x, jnp.ones_like(x)
        keep = self._keep(x)
        return jnp.where(keep, x / (1.0 - self.p), jnp.zeros_like(x)), keep.astype(x.dtype)


class Conv2d(Cell):
    """``Conv2d(in_channels, out_channels, kernel_size, stride=1, pad_mode='same', padding=0, dilation=1,
    group=1, has_bias=False, *, rngs)``, NCHW input, weight ``[out, in/group, kh, kw]``.

    The convolution is ``ops.Conv2D`` (``self.conv2d``): ``conv.conv2d.shard(((1, 1, 2, 4), (1, 1, 1, 1)))``
    splits H and W (pad_mode='same', stride 1; XLA exchanges the halos).

    Args:
        in_channels: channels of the input (dim 1).
        out_channels: channels of the output.
        kernel_size: ``kh`` = ``kw`` as an int, or ``(kh, kw)``.
        stride: an int or ``(sh, sw)``.
        pad_mode: ``"same"``, ``"valid"`` or ``"pad"`` (explicit ``padding``).
        padding: under ``pad_mode="pad"``: an int for every side, or ``(top, bottom, left, right)``.
        dilation: an int or ``(dh, dw)``.
        group: number of channel groups; must divide ``in_channels`` and ``out_channels``.
        has_bias: add a ``bias`` parameter ``[out_channels]`` (zeros at first).
        rngs: ``flax.nnx.Rngs``; its ``params`` stream draws ``weight`` (normal, variance ``1 / fan_in``).
        dtype: the parameters' dtype.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> nn.Conv2d(3, 8, 3, rngs=nnx.Rngs(0))(jnp.ones((2, 3, 16, 16))).shape
    (2, 8, 16, 16)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, pad_mode: str = "same",
                 padding=0, dilation=1, group: int = 1, has_bias: bool = False, *, rngs: nnx.Rngs,
                 dtype: Any = jnp.float32):
        kh, kw = _pair(kernel_size)
        if in_channels % group or out_channels % group:
            raise CellError(f"Conv2d: group={group} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}.")
        fan_in = in_channels // group * kh * kw
        w = jax.random.normal(rngs.params(), (out_channels, in_channels // group, kh, kw), dtype)
        self.weight = nnx.Param(w * math.sqrt(1.0 / fan_in))
        self.bias = nnx.Param(jnp.zeros((out_channels,), dtype)) if has_bias else None
        self.conv2d = ops.Conv2D(out_channels, (kh, kw), pad_mode=pad_mode, pad=padding, stride=stride,
                                 dilation=dilation, group=group)
        self.in_channels, self.out_channels = in_channels, out_channels

    def __call__(self, x):
        y = self.conv2d(x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...].reshape(1, -1, 1, 1)
        return y


class MaxPool2d(Cell):
    """``MaxPool2d(kernel_size=1, stride=1, pad_mode='valid')``, NCHW; the op is ``ops.MaxPool`` (``self.max_pool``).

    Args:
        kernel_size: the window, an int or ``(kh, kw)``.
        stride: the window's step, an int or ``(sh, sw)``.
        pad_mode: ``"valid"`` (no padding) or ``"same"``.
        data_format: only ``"NCHW"`` (anything else is refused).

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> nn.MaxPool2d(2, 2)(jnp.arange(16.0).reshape(1, 1, 4, 4)).tolist()
    [[[[5.0, 7.0], [13.0, 15.0]]]]
    """

    def __init__(self, kernel_size=1, stride=1, pad_mode: str = "valid", data_format: str = "NCHW"):
        self.max_pool = ops.MaxPool(kernel_size, stride, pad_mode, data_format)

    def __call__(self, x):
        return self.max_pool(x)


class Flatten(Cell):
    """``Flatten()``: [N, ...] -> [N, prod(...)] (a reshape; the batch dim stays).

    Args:
        none: ``Flatten()`` takes no arguments.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> nn.Flatten()(jnp.ones((2, 3, 4))).shape
    (2, 12)
    """

    def __call__(self, x):
        return x.reshape(x.shape[0], -1)


class MultiHeadAttention(Cell):
    """Self-attention over ``x: [batch, seq, hidden_size]`` with ``num_heads`` heads (causal by default).

    ``query``/``key``/``value``/``projection`` are :class:`Dense`; the scores are ``ops.BatchMatMul``
    (``self.qk``, ``[b, heads, s, d] x [b, heads, s, d]^T``), ``ops.Softmax`` (``self.softmax``) and
    ``ops.BatchMatMul`` (``self.pv``). :meth:`shard_megatron` sets Megatron's strategies on all of them.

    Args:
        hidden_size: the input's and output's last dim.
        num_heads: number of heads; must divide ``hidden_size``.
        causal: mask each position from the later ones.
        has_bias: whether the four Dense layers have biases.
        attention_dropout_rate: Dropout probability on the attention weights.
        rngs: ``flax.nnx.Rngs`` for the weights and the dropout masks.
        dtype: the parameters' dtype.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> mha = nn.MultiHeadAttention(8, 2, rngs=nnx.Rngs(0)).shard_megatron(2, 4)
    >>> mha(jnp.ones((2, 4, 8))).shape
    (2, 4, 8)
    """

    def __init__(self, hidden_size: int, num_heads: int, *, causal: bool = True, has_bias: bool = True,
                 attention_dropout_rate: float = 0.0, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        if hidden_size % num_heads:
            raise CellError(f"MultiHeadAttention: num_heads={num_heads} must divide hidden_size={hidden_size}.")
        self.hidden_size, self.num_heads, self.causal = hidden_size, num_heads, causal
        self.head_dim = hidden_size // num_heads
        self.query = Dense(hidden_size, hidden_size, has_bias=has_bias, rngs=rngs, dtype=dtype)
        self.key = Dense(hidden_size, hidden_size, has_bias=has_bias, rngs=rngs, dtype=dtype)
        self.value = Dense(hidden_size, hidden_size, has_bias=has_bias, rngs=rngs, dtype=dtype)
        self.projection = Dense(hidden_size, hidden_size, has_bias=has_bias, rngs=rngs, dtype=dtype)
        self.qk = ops.BatchMatMul(transpose_b=True)
        self.softmax = ops.Softmax(-1)
        self.pv = ops.BatchMatMul()
        self.dropout = Dropout(p=attention_dropout_rate, rngs=rngs)

    def _heads(self, t, b, s):
        return t.reshape(b, s, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x):
        b, s, _ = x.shape
        q = self._heads(self.query(x), b, s)
        k = self._heads(self.key(x), b, s)
        v = self._heads(self.value(x), b, s)
        scores = self.qk(q, k) * (1.0 / math.sqrt(self.head_dim))
        if self.causal:
            mask = jnp.tril(jnp.ones((s, s), dtype=bool))
            scores = jnp.where(mask, scores, jnp.asarray(-1e9, scores.dtype))
        probs = self.dropout(self.softmax(scores))
        ctx = self.pv(probs, v).transpose(0, 2, 1, 3).reshape(b, s, self.hidden_size)
        return self.projection(ctx)

    def shard_megatron(self, data_parallel: int, model_parallel: int) -> MultiHeadAttention:
        """Megatron: q/k/v column parallel, heads split ``model_parallel`` ways, the projection row parallel."""
        dp, mp = data_parallel, model_parallel
        for d in (self.query, self.key, self.value):
            d.matmul.shard(((dp, 1), (mp, 1)))
            d.bias_add.shard(((dp, mp), (mp,)))
        self.qk.shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
        self.softmax.shard(((dp, mp, 1, 1),))
        self.pv.shard(((dp, mp, 1, 1), (dp, mp, 1, 1)))
        self.projection.matmul.shard(((dp, mp), (1, mp)))
        self.projection.bias_add.shard(((dp, 1), (1,)))
        return self


class FeedForward(Cell):
    """``FeedForward(hidden_size, ffn_hidden_size, activation='gelu')``: Dense -> activation -> Dense -> Dropout.

    The Dense layers are ``self.mapping`` (``hidden_size -> ffn_hidden_size``, with the activation) and
    ``self.projection`` (back to ``hidden_size``); :meth:`shard_megatron` makes them column / row parallel.

    Args:
        hidden_size: the input's and output's last dim.
        ffn_hidden_size: the inner width.
        activation: the inner activation: a name ``Dense`` takes (``"gelu"``, ``"relu"``, ...) or a callable.
        dropout_rate: Dropout probability on the output.
        rngs: ``flax.nnx.Rngs`` for the weights and the dropout masks.
        dtype: the parameters' dtype.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> nn.FeedForward(8, 32, rngs=nnx.Rngs(0))(jnp.ones((2, 4, 8))).shape
    (2, 4, 8)
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str | Callable = "gelu", *,
                 dropout_rate: float = 0.0, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        self.mapping = Dense(hidden_size, ffn_hidden_size, activation=activation, rngs=rngs, dtype=dtype)
        self.projection = Dense(ffn_hidden_size, hidden_size, rngs=rngs, dtype=dtype)
        self.dropout = Dropout(p=dropout_rate, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.projection(self.mapping(x)))

    def shard_megatron(self, data_parallel: int, model_parallel: int) -> FeedForward:
        """Megatron: the first Dense column parallel, the second row parallel (one all-reduce forward)."""
        dp, mp = data_parallel, model_parallel
        self.mapping.matmul.shard(((dp, 1), (mp, 1)))
        self.mapping.bias_add.shard(((dp, mp), (mp,)))
        self.projection.matmul.shard(((dp, mp), (1, mp)))
        self.projection.bias_add.shard(((dp, 1), (1,)))
        return self


class TransformerBlock(Cell):
    """A pre-LayerNorm transformer block: ``x + attention(ln1(x))``, then ``x + ffn(ln2(x))``.

    ``TransformerBlock(hidden_size, num_heads, ffn_hidden_size=4*hidden_size, *, causal=True,
    dropout_rate=0.0, layernorm_epsilon=1e-5, rngs)``; ``block.recompute()`` remats it,
    ``block.shard_megatron(dp, mp)`` sets Megatron strategies on attention and MLP.

    Args:
        hidden_size: the input's and output's last dim.
        num_heads: attention heads; must divide ``hidden_size``.
        ffn_hidden_size: the MLP's inner width (None: ``4 * hidden_size``).
        causal: causal self-attention.
        dropout_rate: Dropout probability on the attention weights, the attention output and the MLP output.
        layernorm_epsilon: the LayerNorms' epsilon.
        rngs: ``flax.nnx.Rngs`` for the weights and the dropout masks.
        dtype: the parameters' dtype.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> block = nn.TransformerBlock(8, 2, rngs=nnx.Rngs(0))
    >>> block(jnp.ones((2, 4, 8))).shape, block.output.mapping.weight[...].shape
    ((2, 4, 8), (32, 8))
    """

    def __init__(self, hidden_size: int, num_heads: int, ffn_hidden_size: int | None = None, *,
                 causal: bool = True, dropout_rate: float = 0.0, layernorm_epsilon: float = 1e-5,
                 rngs: nnx.Rngs, dtype: Any = jnp.float32):
        ffn = ffn_hidden_size or 4 * hidden_size
        self.layernorm1 = LayerNorm((hidden_size,), epsilon=layernorm_epsilon, dtype=dtype)
        self.attention = MultiHeadAttention(hidden_size, num_heads, causal=causal,
                                            attention_dropout_rate=dropout_rate, rngs=rngs, dtype=dtype)
        self.layernorm2 = LayerNorm((hidden_size,), epsilon=layernorm_epsilon, dtype=dtype)
        self.output = FeedForward(hidden_size, ffn, dropout_rate=dropout_rate, rngs=rngs, dtype=dtype)
        self.dropout = Dropout(p=dropout_rate, rngs=rngs)

    def __call__(self, x):
        x = x + self.dropout(self.attention(self.layernorm1(x)))
        return x + self.output(self.layernorm2(x))

    def shard_megatron(self, data_parallel: int, model_parallel: int) -> TransformerBlock:
        """Megatron strategies on the attention and the MLP; the LayerNorms split on the batch only."""
        dp = data_parallel
        self.attention.shard_megatron(dp, model_parallel)
        self.output.shard_megatron(dp, model_parallel)
        for ln in (self.layernorm1, self.layernorm2):
            ln.layer_norm.shard(((dp, 1, 1), (1,), (1,)))
        return self
