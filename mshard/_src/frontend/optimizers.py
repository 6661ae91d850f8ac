"""MindSpore's optimizer Cells (``nn.SGD``, ``nn.Momentum``, ``nn.Adam``, ``nn.AdamWeightDecay``) over optax.

An optimizer is built as in MindSpore, from the network's parameters, and handed to ``nn.TrainOneStepCell``; its
``tx`` is the ``optax.GradientTransformation`` that computes MindSpore's update (loss-scale division, weight decay,
the rule's state, the learning rate), step for step.

>>> import jax.numpy as jnp, optax
>>> from flax import nnx
>>> from mshard._src.frontend.optimizers import Momentum
>>> lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
>>> opt = Momentum([lin.kernel, lin.bias], learning_rate=0.1, momentum=0.9)
>>> params = {"w": jnp.zeros(2)}
>>> state = opt.tx.init(params)
>>> for _ in range(2):                       # accum = 1, then 0.9 * 1 + 1 = 1.9
...     updates, state = opt.tx.update({"w": jnp.ones(2)}, state, params)
...     params = optax.apply_updates(params, updates)
>>> [round(float(x), 4) for x in params["w"]]
[-0.29, -0.29]

Weight decay follows MindSpore's rule for ungrouped parameters: it is not applied to a parameter whose path (the
attribute path ``optax`` sees, e.g. ``backbone.ln.gamma``) contains ``beta`` or ``gamma``; ``SGD`` applies it to
every parameter, as MindSpore's ``SGD`` operator does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mshard._src.frontend.functional_zero import zero_layouts
from mshard._src.values.errors import CellError, CellTypeError

__all__ = ["SGD", "Adam", "AdamWeightDecay", "Momentum", "Optimizer"]


# -- arguments ---------------------------------------------------------------------------------------
def _check_params(where: str, params: Any) -> list[nnx.Param]:
    """The optimizer's parameters: a non-empty list of distinct ``nnx.Param`` Variables."""
    if params is None or isinstance(params, (nnx.Variable, dict, str)) or not isinstance(params, Iterable):
        raise CellTypeError(f"{where}: params must be a list of nnx.Param (net.trainable_params()), got "
                            f"{type(params).__name__}.")
    params = list(params)
    if not params:
        raise CellError(f"{where}: params is an empty list; pass net.trainable_params().")
    if any(isinstance(p, dict) for p in params):
        raise CellTypeError(f"{where}: a list of groups must hold only dicts ({{'params': [...], 'lr': ..., "
                            f"'weight_decay': ...}}), not a mix of dicts and parameters.")
    bad = [type(p).__name__ for p in params if not isinstance(p, nnx.Param)]
    if bad:
        raise CellTypeError(f"{where}: params must be nnx.Param Variables (net.trainable_params()), got "
                            f"{', '.join(sorted(set(bad)))}.")
    if len({id(p) for p in params}) != len(params):
        raise CellError(f"{where}: a parameter appears more than once in params; pass each parameter once.")
    return params


_GROUP_KEYS = ("params", "lr", "learning_rate", "weight_decay", "grad_centralization")


def _groups(where: str, params: Any) -> tuple[list[nnx.Param], list[tuple[list[nnx.Param], dict]] | None]:
    """-> (the parameters in the optimizer's order, the groups or None): MindSpore's group parameters, a list of
    dicts ``{"params": [...], "lr": ..., "weight_decay": ...}`` and at most one ``{"order_params": [...]}``."""
    if not (isinstance(params, (list, tuple)) and params and all(isinstance(g, dict) for g in params)):
        return _check_params(where, params), None
    groups, order = [], None
    for i, g in enumerate(params):
        if "order_params" in g:
            order = _check_params(where, g["order_params"])
            continue
        unknown = sorted(set(g) - set(_GROUP_KEYS))
        if unknown or "params" not in g:
            raise CellError(f"{where}: group {i} has keys {sorted(g)}; a group is a dict with 'params' and "
                            f"optionally {', '.join(repr(k) for k in _GROUP_KEYS[1:])} (or {{'order_params': ...}}).")
        groups.append((_check_params(where, g["params"]), g))
    flat = [p for ps, _ in groups for p in ps]
    if len({id(p) for p in flat}) != len(flat):
        raise CellError(f"{where}: a parameter is in more than one group; put each parameter in one group.")
    if order is not None and {id(p) for p in order} != {id(p) for p in flat}:
        raise CellError(f"{where}: order_params must hold exactly the grouped parameters ({len(flat)}), got "
                        f"{len(order)}.")
    return (order if order is not None else flat), groups


def _non_negative(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise CellTypeError(f"{where}: {name} must be a float, got {type(value).__name__}.")
    if value < 0:
        raise CellError(f"{where}: {name}={value}; it must be >= 0.")
    return float(value)


def _in_unit_interval(where: str, name: str, value: Any) -> float:
    value = _non_negative(where, name, value)
    if not 0.0 < value < 1.0:
        raise CellError(f"{where}: {name}={value}; it must lie in (0, 1).")
    return value


def _schedule(where: str, learning_rate: Any) -> float | Callable:
    """A float, a callable ``step -> lr`` (an optax schedule), or MindSpore's list form: a 1-D sequence of per-step
    values, step ``i`` using value ``i`` and the last value holding after the list ends."""
    if callable(learning_rate):
        return learning_rate
    if isinstance(learning_rate, (int, float, np.integer, np.floating)) and not isinstance(learning_rate, bool):
        return _non_negative(where, "learning_rate", learning_rate)
    try:
        values = np.asarray(learning_rate, dtype=np.float32)
    except (TypeError, ValueError):
        raise CellTypeError(f"{where}: learning_rate must be a float, a callable step -> lr (an optax schedule) or a "
                            f"1-D list of per-step values, got {type(learning_rate).__name__}.") from None
    if values.ndim == 0:
        return _non_negative(where, "learning_rate", float(values))
    if values.ndim != 1 or values.size == 0 or (values < 0).any():
        raise CellError(f"{where}: a learning_rate list must be 1-D, non-empty and >= 0, got shape "
                        f"{values.shape}.")
    table = jnp.asarray(values)
    last = values.size - 1

    def per_step(count):
        return table[jnp.minimum(count, last)]
    return per_step


def _name(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts)


def _decay_mask(tree):
    """MindSpore's ``decay_filter`` for ungrouped parameters: no weight decay where the name holds beta or gamma."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "beta" not in _name(path) and "gamma" not in _name(path),
                                            tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


# -- MindSpore's update rules as optax transformations -------------------------------------------------
class SGDState(NamedTuple):
    """MindSpore's SGD state: ``count`` (steps taken; MindSpore's ``stat``) and ``accum`` (the velocity)."""

    count: jax.Array
    accum: optax.Updates


def _sgd_rule(momentum: float, dampening: float, nesterov: bool) -> optax.GradientTransformation:
    """MindSpore's ``ops.SGD`` without the weight decay and learning rate: the first step sets ``accum = g``."""

    def init(params):
        return SGDState(jnp.zeros([], jnp.int32), optax.tree_utils.tree_zeros_like(params))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        if momentum <= 0.0:
            return updates, SGDState(count, state.accum)
        first = state.count == 0
        accum = jax.tree.map(lambda g, a: jnp.where(first, g, momentum * a + (1.0 - dampening) * g).astype(a.dtype),
                             updates, state.accum)
        if nesterov:
            updates = jax.tree.map(lambda g, a: g + momentum * a, updates, accum)
        else:
            updates = accum
        return updates, SGDState(count, accum)

    return optax.GradientTransformation(init, update)


class AdamState(NamedTuple):
    """MindSpore's Adam state: ``count`` (``t``; MindSpore keeps ``beta1_power``/``beta2_power``), ``m``, ``v``."""

    count: jax.Array
    m: optax.Updates
    v: optax.Updates


def _adam_rule(beta1: float, beta2: float, eps: float, nesterov: bool) -> optax.GradientTransformation:
    """MindSpore's ``ops.Adam`` without the learning rate: the bias correction scales the step, eps is not scaled."""

    def init(params):
        zeros = optax.tree_utils.tree_zeros_like(params)
        return AdamState(jnp.zeros([], jnp.int32), zeros, optax.tree_utils.tree_zeros_like(params))

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        m = jax.tree.map(lambda g, m: beta1 * m + (1.0 - beta1) * g, updates, state.m)
        v = jax.tree.map(lambda g, v: beta2 * v + (1.0 - beta2) * g * g, updates, state.v)
        t = count.astype(jnp.float32)
        corr = jnp.sqrt(1.0 - jnp.power(beta2, t)) / (1.0 - jnp.power(beta1, t))
        if nesterov:
            num = jax.tree.map(lambda g, m: m * beta1 + (1.0 - beta1) * g, updates, m)
        else:
            num = m
        out = jax.tree.map(lambda n, v: (corr * n / (jnp.sqrt(v) + eps)).astype(v.dtype), num, v)
        return out, AdamState(count, m, v)

    return optax.GradientTransformation(init, update)


class AdamWeightDecayState(NamedTuple):
    """MindSpore's AdamWeightDecay state: the moments ``m`` and ``v`` (no step count: no bias correction)."""

    m: optax.Updates
    v: optax.Updates


def _adam_weight_decay_rule(beta1: float, beta2: float, eps: float) -> optax.GradientTransformation:
    """MindSpore's AdamWeightDecay moments: ``m / (sqrt(v) + eps)`` with no bias correction."""

    def init(params):
        return AdamWeightDecayState(optax.tree_utils.tree_zeros_like(params), optax.tree_utils.tree_zeros_like(params))

    def update(updates, state, params=None):
        del params
        m = jax.tree.map(lambda g, m: beta1 * m + (1.0 - beta1) * g, updates, state.m)
        v = jax.tree.map(lambda g, v: beta2 * v + (1.0 - beta2) * g * g, updates, state.v)
        out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), m, v)
        return out, AdamWeightDecayState(m, v)

    return optax.GradientTransformation(init, update)


# -- the Cells ----------------------------------------------------------------------------------------
class Optimizer:
    """MindSpore's ``nn.Optimizer`` base: the parameters, learning rate, weight decay and loss scale of an update rule.

    ``tx`` is the ``optax.GradientTransformation`` of the rule (built by the subclass); ``nn.TrainOneStepCell`` applies
    it to ``parameters``. Group parameters work as in MindSpore: each group's ``lr`` and ``weight_decay`` (else the
    optimizer's) apply to its parameters, the weight decay to all of them (the beta/gamma filter is for ungrouped
    parameters), and ``order_params`` orders ``parameters``; each group is one ``optax.multi_transform`` branch.
    Differences from MindSpore: a list ``learning_rate`` keeps its last value after the list ends; the base class has
    no rule of its own; ``grad_centralization`` is accepted and not applied.

    Args:
        params: the parameters to train: a list of ``nnx.Param`` Variables (``net.trainable_params()``), or MindSpore's
            groups, a list of dicts ``{"params": [...], "lr": ..., "weight_decay": ...}`` (and ``{"order_params":
            [...]}``).
        learning_rate: a float, a callable ``step -> lr`` (an optax schedule) or a 1-D list of per-step values.
        weight_decay: the L2 coefficient added to the gradient (not to ``beta``/``gamma`` parameters).
        loss_scale: the gradients are divided by it before the update (MindSpore's fixed loss scale).

    >>> from flax import nnx
    >>> from mshard._src.frontend.optimizers import Momentum, Optimizer
    >>> lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> opt = Momentum([lin.kernel, lin.bias], learning_rate=0.1, momentum=0.9)
    >>> isinstance(opt, Optimizer), len(opt.parameters), opt.learning_rate, type(opt.tx).__name__
    (True, 2, 0.1, 'GradientTransformationExtraArgs')
    """

    def __init__(self, params: Any, learning_rate: Any, weight_decay: float = 0.0, loss_scale: float = 1.0):
        where = type(self).__name__
        self.parameters, groups = _groups(where, params)
        self.learning_rate: float | Callable = _schedule(where, learning_rate)
        self.weight_decay = _non_negative(where, "weight_decay", weight_decay)
        self.loss_scale = _non_negative(where, "loss_scale", loss_scale)
        if self.loss_scale <= 0.0:
            raise CellError(f"{where}: loss_scale={loss_scale}; it must be > 0.")
        self._grouped = groups is not None
        self.tx: optax.GradientTransformation = self._rule() if groups is None else self._grouped_rule(groups)
        self._state: list[nnx.Variable] | None = None
        self._state_def: Any = None

    def _rule(self) -> optax.GradientTransformation:
        raise CellError("Optimizer is MindSpore's base class and has no update rule of its own: use nn.SGD, "
                        "nn.Momentum, nn.Adam or nn.AdamWeightDecay, or pass an optax transformation to "
                        "nn.TrainOneStepCell (a subclass with its own construct is not supported yet).")

    def _grouped_rule(self, groups: list[tuple[list[nnx.Param], dict]]) -> optax.GradientTransformation:
        """One branch of ``optax.multi_transform`` per group: the rule with the group's lr and weight decay."""
        where = type(self).__name__
        default_lr, default_wd = self.learning_rate, self.weight_decay
        branches, label_of = {}, {}
        try:
            for i, (ps, g) in enumerate(groups):
                lr = g.get("lr", g.get("learning_rate"))
                self.learning_rate = default_lr if lr is None else _schedule(where, lr)
                wd = g.get("weight_decay")
                self.weight_decay = default_wd if wd is None else _non_negative(where, "weight_decay", wd)
                branches[f"group{i}"] = self._rule()
                for p in ps:
                    label_of[id(p)] = f"group{i}"
        finally:
            self.learning_rate, self.weight_decay = default_lr, default_wd
        self.group_branches, self.group_of = branches, label_of      # for a network's own tree (TrainOneStepCell)
        labels = {k: label_of[id(p)] for k, p in zip(self._keys(), self.parameters, strict=True)}
        return optax.multi_transform(branches, labels)

    def _chain(self, *rule: optax.GradientTransformation, decay: Callable | None = _decay_mask,
               decay_after: bool = False) -> optax.GradientTransformation:
        """``gradient / loss_scale``, ``+ weight_decay * p`` (before the rule, or after it), the rule, ``* -lr``."""
        if getattr(self, "_grouped", False):
            decay = None                   # a group's weight decay applies to every parameter of the group
        parts: list[optax.GradientTransformation] = []
        if self.loss_scale != 1.0:
            parts.append(optax.scale(1.0 / self.loss_scale))
        wd = [optax.add_decayed_weights(self.weight_decay, mask=decay)] if self.weight_decay > 0 else []
        parts += (list(rule) + wd) if decay_after else (wd + list(rule))
        parts.append(optax.scale_by_learning_rate(self.learning_rate))
        return optax.chain(*parts)

    def state_variables(self) -> list[nnx.Variable]:
        """The parameters and the optimizer state as Variables (the state made on first use, from the parameters'
        values then): what ``ms.jit`` passes to a step that calls this optimizer."""
        if self._state is None:
            leaves, self._state_def = jax.tree.flatten(self.tx.init(self._values()))
            self._state = [nnx.OptState(x) for x in leaves]
        return list(self.parameters) + self._state

    def _keys(self) -> list[str]:
        # the names optax sees (weight decay skips beta/gamma by name): trainable_params() names each parameter by
        # its attribute path, as MindSpore does
        return [f"{i:05d}.{getattr(p, 'name', None) or 'param'}" for i, p in enumerate(self.parameters)]

    def _values(self) -> dict[str, Any]:
        return {k: p[...] for k, p in zip(self._keys(), self.parameters, strict=True)}

    def __call__(self, gradients):
        """MindSpore's ``optimizer(grads)``: one update of ``parameters`` (in place) from ``gradients``, a tuple in
        the parameters' order (what ``value_and_grad(fn, None, weights)`` returns). Works eagerly and inside an
        ``ms.jit`` step that reaches this optimizer.

        Args:
            gradients: one gradient per parameter, in order.

        Returns:
            True, as MindSpore's optimizers return.
        """
        grads = list(gradients)
        if len(grads) != len(self.parameters):
            raise CellError(f"{type(self).__name__}: {len(grads)} gradients for {len(self.parameters)} parameters; "
                            f"take the gradients with respect to the optimizer's parameters "
                            f"(value_and_grad(fn, None, optimizer.parameters)).")
        state_vars = self.state_variables()[len(self.parameters):]
        state = jax.tree.unflatten(self._state_def, [v[...] for v in state_vars])
        keys = self._keys()
        params = self._values()
        grads = dict(zip(keys, grads, strict=True))
        zero = zero_layouts(params)                 # optimizer parallel inside a hand-written ms.jit step
        if zero:
            grads, params, state = (zero.constrain(grads), zero.constrain(params), zero.constrain(state))
        updates, new_state = self.tx.update(grads, state, params)
        new = optax.apply_updates(params, updates)
        if zero:
            new_state, new = zero.constrain(new_state), zero.constrain(new)
        for k, p in zip(keys, self.parameters, strict=True):
            p[...] = new[k].astype(p[...].dtype)
        for v, x in zip(state_vars, jax.tree.leaves(new_state), strict=True):
            v[...] = x
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.parameters)} parameters, learning_rate={self.learning_rate!r})"


class SGD(Optimizer):
    """MindSpore's ``nn.SGD``: ``g' = g / loss_scale + weight_decay * p`` (every parameter), and with ``momentum > 0``
    ``v = momentum * v + (1 - dampening) * g'``, where the first step sets ``v = g'`` (MindSpore's ``stat``);
    ``p -= lr * v`` (nesterov: ``p -= lr * (g' + momentum * v)``); with ``momentum = 0``, ``p -= lr * g'``.

    The state is ``SGDState(count, accum)``. Differences from MindSpore: none in the update (see :class:`Optimizer`
    for the arguments).

    Args:
        params: the parameters to train: a list of ``nnx.Param`` Variables (``net.trainable_params()``).
        learning_rate: a float, a callable ``step -> lr`` or a 1-D list of per-step values.
        momentum: the momentum ``u`` (>= 0).
        dampening: the dampening of the velocity update (>= 0).
        weight_decay: the L2 coefficient added to the gradient.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        loss_scale: the gradients are divided by it before the update.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> from mshard._src.frontend.optimizers import SGD
    >>> lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = SGD([lin.kernel, lin.bias], learning_rate=0.1, momentum=0.9, dampening=0.5).tx
    >>> p = {"w": jnp.zeros(2)}
    >>> s = tx.init(p)
    >>> for _ in range(2):                       # v = 1 (first step), then 0.9 + 0.5 = 1.4
    ...     u, s = tx.update({"w": jnp.ones(2)}, s, p)
    ...     p = optax.apply_updates(p, u)
    >>> [round(float(x), 4) for x in p["w"]]
    [-0.24, -0.24]
    """

    def __init__(self, params: Any, learning_rate: Any = 0.1, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, loss_scale: float = 1.0):
        self.momentum = _non_negative("SGD", "momentum", momentum)
        self.dampening = _non_negative("SGD", "dampening", dampening)
        self.nesterov = bool(nesterov)
        if self.nesterov and (self.momentum <= 0.0 or self.dampening != 0.0):
            raise CellError(f"SGD: nesterov=True needs momentum > 0 and dampening == 0, got momentum={momentum}, "
                            f"dampening={dampening}.")
        super().__init__(params, learning_rate, weight_decay, loss_scale)

    def _rule(self) -> optax.GradientTransformation:
        return self._chain(_sgd_rule(self.momentum, self.dampening, self.nesterov), decay=None)


class Momentum(Optimizer):
    """MindSpore's ``nn.Momentum`` (``ops.ApplyMomentum``): ``g' = g / loss_scale + weight_decay * p``,
    ``accum = momentum * accum + g'`` (``accum`` starts at 0), ``p -= lr * accum``
    (``use_nesterov``: ``p -= lr * (g' + momentum * accum)``).

    ``tx`` is ``optax.trace`` with the learning rate. Weight decay skips parameters named ``beta``/``gamma``, as
    MindSpore does for ungrouped parameters.

    Args:
        params: the parameters to train: a list of ``nnx.Param`` Variables (``net.trainable_params()``).
        learning_rate: a float, a callable ``step -> lr`` or a 1-D list of per-step values.
        momentum: the momentum (>= 0).
        weight_decay: the L2 coefficient added to the gradient.
        loss_scale: the gradients are divided by it before the update.
        use_nesterov: Nesterov momentum.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard._src.frontend.optimizers import Momentum
    >>> lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = Momentum([lin.kernel, lin.bias], 0.1, 0.9, use_nesterov=True).tx
    >>> u, _ = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}), {"w": jnp.zeros(2)})
    >>> [round(float(x), 4) for x in u["w"]]     # -0.1 * (1 + 0.9 * 1)
    [-0.19, -0.19]
    """

    def __init__(self, params: Any, learning_rate: Any, momentum: float, weight_decay: float = 0.0,
                 loss_scale: float = 1.0, use_nesterov: bool = False):
        self.momentum = _non_negative("Momentum", "momentum", momentum)
        self.use_nesterov = bool(use_nesterov)
        super().__init__(params, learning_rate, weight_decay, loss_scale)

    def _rule(self) -> optax.GradientTransformation:
        return self._chain(optax.trace(decay=self.momentum, nesterov=self.use_nesterov))


class Adam(Optimizer):
    """MindSpore's ``nn.Adam`` (``ops.Adam``): ``g' = g / loss_scale + weight_decay * p`` (L2, before the moments),
    ``m = b1 m + (1 - b1) g'``, ``v = b2 v + (1 - b2) g'^2``, ``p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) +
    eps)`` (``use_nesterov``: ``m`` replaced by ``b1 m + (1 - b1) g'``), ``t`` counting from 1.

    Differences from ``optax.adam``: eps is added to ``sqrt(v)``, not to the bias-corrected ``sqrt(v_hat)``, so the
    state is ``AdamState(count, m, v)``. ``use_locking`` has no effect. Weight decay skips ``beta``/``gamma``.

    Args:
        params: the parameters to train: a list of ``nnx.Param`` Variables (``net.trainable_params()``).
        learning_rate: a float, a callable ``step -> lr`` or a 1-D list of per-step values.
        beta1: the first moment's decay, in (0, 1).
        beta2: the second moment's decay, in (0, 1).
        eps: added to ``sqrt(v)`` (> 0).
        use_locking: accepted for MindSpore's signature; no effect.
        use_nesterov: Nesterov momentum in the first moment.
        weight_decay: the L2 coefficient added to the gradient.
        loss_scale: the gradients are divided by it before the update.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard._src.frontend.optimizers import Adam
    >>> lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = Adam([lin.kernel, lin.bias], learning_rate=0.1).tx
    >>> u, s = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.zeros(2)}), {"w": jnp.zeros(2)})
    >>> [round(float(x), 4) for x in u["w"]]     # the first step moves by lr
    [-0.1, -0.1]
    """

    def __init__(self, params: Any, learning_rate: Any = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, use_locking: bool = False, use_nesterov: bool = False, weight_decay: float = 0.0,
                 loss_scale: float = 1.0):
        self.beta1 = _in_unit_interval("Adam", "beta1", beta1)
        self.beta2 = _in_unit_interval("Adam", "beta2", beta2)
        self.eps = _non_negative("Adam", "eps", eps)
        if self.eps <= 0.0:
            raise CellError(f"Adam: eps={eps}; it must be > 0.")
        self.use_locking, self.use_nesterov = bool(use_locking), bool(use_nesterov)
        super().__init__(params, learning_rate, weight_decay, loss_scale)

    def _rule(self) -> optax.GradientTransformation:
        return self._chain(_adam_rule(self.beta1, self.beta2, self.eps, self.use_nesterov))


class AdamWeightDecay(Optimizer):
    """MindSpore's ``nn.AdamWeightDecay``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``update = m / (sqrt(v) + eps) + weight_decay * p``, ``p -= lr * update``, with NO bias correction.

    Differences from ``optax.adamw`` (which corrects the bias): the state is ``AdamWeightDecayState(m, v)``; weight
    decay skips parameters named ``beta``/``gamma``, as MindSpore does for ungrouped parameters; no loss scale.

    Args:
        params: the parameters to train: a list of ``nnx.Param`` Variables (``net.trainable_params()``).
        learning_rate: a float, a callable ``step -> lr`` or a 1-D list of per-step values.
        beta1: the first moment's decay, in (0, 1).
        beta2: the second moment's decay, in (0, 1).
        eps: added to ``sqrt(v)`` (> 0).
        weight_decay: the decoupled decay coefficient, added to the update.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from mshard._src.frontend.optimizers import AdamWeightDecay
    >>> lin = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> tx = AdamWeightDecay([lin.kernel, lin.bias], learning_rate=0.1, weight_decay=0.5).tx
    >>> u, _ = tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}), {"w": jnp.ones(2)})
    >>> [round(float(x), 4) for x in u["w"]]     # -0.1 * (0.1 / (sqrt(0.001) + 1e-6) + 0.5)
    [-0.3662, -0.3662]
    """

    def __init__(self, params: Any, learning_rate: Any = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-6, weight_decay: float = 0.0):
        self.beta1 = _in_unit_interval("AdamWeightDecay", "beta1", beta1)
        self.beta2 = _in_unit_interval("AdamWeightDecay", "beta2", beta2)
        self.eps = _non_negative("AdamWeightDecay", "eps", eps)
        if self.eps <= 0.0:
            raise CellError(f"AdamWeightDecay: eps={eps}; it must be > 0.")
        super().__init__(params, learning_rate, weight_decay)

    def _rule(self) -> optax.GradientTransformation:
        return self._chain(_adam_weight_decay_rule(self.beta1, self.beta2, self.eps), decay_after=True)


class DistributedGradReducer:
    """MindSpore's ``nn.DistributedGradReducer(parameters, mean=True, degree=None, fusion_type=1, group=...)``:
    here the identity. mshard's gradients are already those of the global loss over the global batch (the planned
    program reduces them across devices, docs/gradients.md), so there is nothing left to all-reduce.

    Args:
        parameters: the optimizer's parameters (accepted for MindSpore's signature).
        mean: MindSpore's mean flag (the gradient is the global-loss gradient either way).
        degree: MindSpore's device count (unused).
        fusion_type: MindSpore's fusion group (fusion follows ``comm_fusion``).
        group: MindSpore's communication group (unused).

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> g = (jnp.ones(2),)
    >>> nn.DistributedGradReducer([])(g) is g
    True
    """

    def __init__(self, parameters: Any = None, mean: bool = True, degree: int | None = None, fusion_type: int = 1,
                 group: Any = None):
        self.mean, self.degree = mean, degree

    def __call__(self, grads: Any) -> Any:
        return grads


class PipelineGradReducer(DistributedGradReducer):
    """MindSpore's ``parallel.nn.PipelineGradReducer(parameters, scale_sense=1.0, opt_shard=None)``: the identity.
    A pipelined step (``nn.Pipeline`` / ``nn.PipelineCell`` under ``TrainOneStepCell``) already accumulates the
    micro-batches' gradients and reduces them over the data-parallel devices.

    Args:
        parameters: the optimizer's parameters (accepted for MindSpore's signature).
        scale_sense: MindSpore's loss scale (unused: pass ``loss_scale`` to the optimizer).
        opt_shard: MindSpore's optimizer-shard flag (optimizer parallel follows the context).

    >>> import jax.numpy as jnp
    >>> from mshard.parallel.nn import PipelineGradReducer
    >>> g = (jnp.ones(2),)
    >>> PipelineGradReducer([])(g) is g
    True
    """

    def __init__(self, parameters: Any = None, scale_sense: float = 1.0, opt_shard: bool | None = None):
        super().__init__(parameters)
        self.scale_sense, self.opt_shard = scale_sense, opt_shard
