"""The single-device reference every training example, test and benchmark compares mshard against:
plain flax.nnx + optax on one device. A model's mshard strategies (``Cell.shard``, ``ms.shard``, primitives with a
strategy) apply inside a ``jax.jit`` too, so the reference runs under ``parallel_mode="stand_alone"``, where mshard
ignores them: the model is plain JAX on one device.

>>> import jax.numpy as jnp, numpy as np, optax
>>> from flax import nnx
>>> net = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
>>> data = [(np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32))] * 2
>>> trained, opt_state, losses = train_one_device(net, optax.sgd(0.1), data, lambda p, y: jnp.mean((p - y) ** 2))
>>> len(losses), losses[1] < losses[0], trained is not net       # a trained copy; ``net`` is untouched
(2, True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import optax
from flax import nnx


def train_one_device(net: nnx.Module, tx: optax.GradientTransformation, data: Sequence[tuple],
                     loss_fn: Callable, *, grad_scale: float = 1.0,
                     device: Any = None) -> tuple[nnx.Module, Any, list[float]]:
    """Train a copy of ``net`` on ``device`` (default: the first local device) for one step per batch.

    Each batch is ``(inputs..., label)`` and the loss is ``loss_fn(net(*inputs), label)``;
    ``grad_scale`` multiplies the gradient (MindSpore's sum over data-parallel replicas is ``dp`` times
    the gradient of a mean loss). Returns ``(trained copy, optax state, loss of each step)``.
    """
    import mshard as ms
    with ms.parallel_context(parallel_mode="stand_alone"):
        return _train(net, tx, data, loss_fn, grad_scale, device)


def _train(net, tx, data, loss_fn, grad_scale, device):
    net = nnx.clone(net)
    dev = device or jax.local_devices()[0]
    nnx.update(net, jax.device_put(nnx.state(net), dev))
    opt_state = jax.device_put(tx.init(nnx.as_pure(nnx.state(net, nnx.Param))), dev)
    gdef, _ = nnx.split(net)

    @jax.jit
    def step(state, opt_state, *batch):
        m = nnx.merge(gdef, state)
        loss, g = nnx.value_and_grad(lambda m: loss_fn(m(*batch[:-1]), batch[-1]))(m)
        g = jax.tree.map(lambda x: x * grad_scale, nnx.as_pure(g))
        p = nnx.as_pure(nnx.state(m, nnx.Param))
        upd, opt_state = tx.update(g, opt_state, p)
        nnx.update(m, optax.apply_updates(p, upd))
        return nnx.state(m), opt_state, loss

    state = nnx.state(net)
    losses = []
    for batch in data:
        state, opt_state, loss = step(state, opt_state, *[jax.device_put(x, dev) for x in batch])
        losses.append(float(loss))
    nnx.update(net, state)
    return net, opt_state, losses
