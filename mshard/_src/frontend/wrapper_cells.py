"""The loss and micro-batch wrappers: WithLossCell, GradAccumulationCell, MicroBatchInterleaved (their forward
passes; the gradients of a GradAccumulationCell under TrainOneStepCell are :mod:`mshard._src.training.grads`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mshard._src.frontend.cell import Cell, register_paths
from mshard._src.jaxpr import marks
from mshard._src.values.errors import CellError, CellTypeError

__all__ = ["GradAccumulationCell", "MicroBatchInterleaved", "WithLossCell"]


# -- the loss and micro-batch wrappers -------------------------------------------------------------
class WithLossCell(Cell):
    """``WithLossCell(backbone, loss_fn)``: ``loss_fn(backbone(*data), label)``; the label is the last input.

    As MindSpore's: the network with loss a :class:`~mshard.nn.TrainOneStepCell` trains;
    ``backbone_network`` is the backbone.

    Args:
        backbone: the network (a Cell or any ``nnx.Module``) called on every input but the last.
        loss_fn: ``loss_fn(output, label) -> loss``, e.g. :class:`~mshard.nn.MSELoss`.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> net = nn.Dense(4, 2, rngs=nnx.Rngs(0))
    >>> net_with_loss = nn.WithLossCell(net, nn.MSELoss())
    >>> net_with_loss(jnp.ones((3, 4)), jnp.zeros((3, 2))).shape, net_with_loss.backbone_network is net
    ((), True)
    """

    def __init__(self, backbone: nnx.Module, loss_fn: Callable):
        self.backbone = backbone
        self.loss_fn = loss_fn

    def __call__(self, *inputs):
        if len(inputs) < 2:
            raise CellTypeError(f"WithLossCell: expected (data..., label), got {len(inputs)} input(s).")
        return self.loss_fn(self.backbone(*inputs[:-1]), inputs[-1])

    @property
    def backbone_network(self) -> nnx.Module:
        return self.backbone


def _check_count(name: str, what: str, n: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise CellError(f"{name}: {what}={n!r} must be a positive int.")
    return n


def check_rows(shape: tuple, n: int, where: str) -> None:
    """The batch dim of ``shape`` must divide into ``n`` slices."""
    if len(shape) and shape[0] % n:
        raise CellError(f"{where}: the batch dim {shape[0]} (input shape {tuple(shape)}) is not divisible by "
                        f"{n}; use a batch size that is a multiple of {n}.")


def _split_rows(x, n: int, where: str):
    """``[B, ...] -> [n, B/n, ...]``; slice k holds rows k, k+n, k+2n, ... (strided, so each slice keeps
    the batch's data-parallel layout and nothing moves between devices)."""
    if not hasattr(x, "shape") or x.ndim == 0:
        return None
    check_rows(x.shape, n, where)
    return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def _prefix(cell: nnx.Module, child: str) -> str:
    trace = marks.current_region()
    base = trace.module_paths.get(id(cell), "") if trace is not None else ""
    return f"{base}.{child}" if base else child


class GradAccumulationCell(Cell):
    """``GradAccumulationCell(network, micro_size)``: the batch is cut into ``micro_size`` micro-batches that
    run one after another (``jax.lax.scan``), so activations of one micro-batch are live at a time.

    ``network`` is a network with loss (``WithLossCell``). Called, it returns the mean of the micro-batch
    losses; under :class:`TrainOneStepCell` the gradients are accumulated over the micro-batches (their
    mean: for a mean-reduced loss, the full-batch gradient) and applied once. Micro-batch k holds rows
    k, k+micro_size, ... of the batch, so every micro-batch stays spread over the data-parallel devices.

    Args:
        network: the network with loss; every array input's dim 0 must be divisible by ``micro_size``.
        micro_size: the number of micro-batches (a positive int).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> x, y = jnp.arange(16.0).reshape(4, 4), jnp.zeros((4, 2))
    >>> net_with_loss = nn.WithLossCell(nn.Dense(4, 2, rngs=nnx.Rngs(0)), nn.MSELoss())
    >>> bool(jnp.allclose(nn.GradAccumulationCell(net_with_loss, 2)(x, y), net_with_loss(x, y)))
    True
    """

    def __init__(self, network: nnx.Module, micro_size: int):
        self.network = network
        self.micro_size = _check_count("GradAccumulationCell", "micro_size", micro_size)

    def __call__(self, *inputs):
        n = self.micro_size
        xs = [_split_rows(x, n, "GradAccumulationCell") for x in inputs]
        gdef, params, rest = nnx.split(self.network, nnx.Param, ...)
        params, rest = nnx.as_pure(params), nnx.as_pure(rest)
        trace, prefix = marks.current_region(), _prefix(self, "network")
        scanned = [x for x in xs if x is not None]

        def body(rest, d):
            it = iter(d)
            args = [next(it) if x is not None else a for x, a in zip(xs, inputs)]
            m = nnx.merge(gdef, params, rest)
            if trace is not None:
                register_paths(trace, m, prefix)
            out = m(*args)
            return nnx.as_pure(nnx.state(m, nnx.Not(nnx.Param))), out

        rest, outs = jax.lax.scan(body, rest, scanned)
        nnx.update(self.network, rest)
        return jax.tree.map(lambda o: jnp.mean(o, axis=0), outs)


class MicroBatchInterleaved(Cell):
    """``MicroBatchInterleaved(network, interleave_num=2)``: the batch is cut into ``interleave_num`` slices
    that run as independent copies of the network in one program (XLA may overlap one slice's
    communication with another's computation), and their outputs are averaged.

    Differences from MindSpore: MindSpore adds the slice outputs; mshard averages them, so the loss and the
    gradients equal the full batch's for a mean-reduced loss (multiply by ``interleave_num`` for MindSpore's
    value). Slice k holds rows k, k+interleave_num, ... (no data moves between devices).

    Args:
        network: the network (with loss, or any Cell); every array input's dim 0 must be divisible by
            ``interleave_num``.
        interleave_num: the number of slices (a positive int).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard import nn
    >>> x, y = jnp.arange(16.0).reshape(4, 4), jnp.zeros((4, 2))
    >>> net_with_loss = nn.WithLossCell(nn.Dense(4, 2, rngs=nnx.Rngs(0)), nn.MSELoss())
    >>> bool(jnp.allclose(nn.MicroBatchInterleaved(net_with_loss, 2)(x, y), net_with_loss(x, y)))
    True
    """

    def __init__(self, network: nnx.Module, interleave_num: int = 2):
        self.network = network
        self.interleave_num = _check_count("MicroBatchInterleaved", "interleave_num", interleave_num)

    def __call__(self, *inputs):
        n = self.interleave_num
        xs = [_split_rows(x, n, "MicroBatchInterleaved") for x in inputs]
        outs = [self.network(*[a if x is None else x[k] for x, a in zip(xs, inputs)]) for k in range(n)]
        return jax.tree.map(lambda *o: sum(o[1:], o[0]) / n, *outs)
