"""A TrainOneStepCell's repeated steps without the region's per-call split/update: the compiled step called on
the Variables' arrays directly, while nothing it depends on has changed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import numpy as np
from flax import nnx

from .. import annotate
from .. import context as ctxmod
from ..region import Region, raw_ok, unshare_donated

if TYPE_CHECKING:
    from .train import TrainOneStepCell


_MISS = object()


class _FastPath:
    """Repeated steps without the region's per-call ``nnx.split``/``nnx.update`` (tens of ms for a model with a
    few hundred Variables): after a first call through the region, the step keeps the network's and optimizer's
    Variables in the region's input order and the compiled step, reads the Variables' arrays, calls the compiled
    step and writes the changed arrays back into the same Variables.

    Valid while the context, algorithm/cost-model parameters, strategy epoch and the data's structure, shapes and
    dtypes are unchanged; otherwise (or if the compiled step rejects the arrays, e.g. a value replaced with one of
    another sharding) the step goes through the region again. As MindSpore compiles a training graph once, Cells or
    Variables *assigned* to the network after the first step are not seen (values written into its Variables,
    e.g. by ``nnx.update``, are).
    """

    def __init__(self, comp, variables, raw, tree, avals, shardings):
        self.comp, self.variables, self.raw = comp, variables, raw
        self.tree, self.avals, self.shardings = tree, avals, shardings
        self.ctx, self.algo, self.cost = ctxmod.current(), ctxmod.get_algo_parameters(), ctxmod.get_cost_model_context()
        self.epoch = annotate.epoch()
        self.user_tree = comp.out_tree.children()[0]
        self.changed = list(comp.changed)

    @staticmethod
    def build(region: Region, cell: TrainOneStepCell, data: tuple) -> _FastPath | None:
        flat, tree = jax.tree.flatten(data)
        if not all(isinstance(x, (jax.Array, np.ndarray)) for x in flat):
            return None
        comp = region._prepare((*data, cell), {})[0]       # the compiled step just used (a cache hit)
        _, state = nnx.split(cell)
        variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        if len(variables) != len(jax.tree.leaves(state)) or not all(isinstance(v, nnx.Variable) for v in variables):
            return None
        raw = [raw_ok(v) for v in variables]
        avals = [(x.shape, x.dtype) for x in flat]
        shardings = comp.in_shardings[len(variables):]
        return _FastPath(comp, variables, raw, tree, avals, shardings)

    def __call__(self, data: tuple):
        if (ctxmod.current() is not self.ctx or annotate.epoch() != self.epoch
                or ctxmod.get_algo_parameters() is not self.algo or ctxmod.get_cost_model_context() is not self.cost):
            return _MISS
        flat, tree = jax.tree.flatten(data)
        if tree != self.tree or any(not isinstance(x, (jax.Array, np.ndarray)) or (x.shape, x.dtype) != a
                                    for x, a in zip(flat, self.avals)):
            return _MISS
        flat = [jax.device_put(x, sh) if isinstance(x, jax.Array) and x.committed and x.sharding != sh else x
                for x, sh in zip(flat, self.shardings)]
        vals = [v._raw_value if r else v.get_value() for v, r in zip(self.variables, self.raw)]
        unshare_donated(vals, self.changed)           # the step donates them: never an array someone else holds
        try:
            outs = self.comp.jitted(*vals, *flat)
        except (ValueError, TypeError):
            return _MISS
        n_user = len(outs) - len(self.changed)
        for i, x in zip(self.changed, outs[n_user:]):
            v = self.variables[i]
            if self.raw[i]:
                v._raw_value = x
            else:
                v.set_value(x)
        return jax.tree.unflatten(self.user_tree, list(outs[:n_user]))
