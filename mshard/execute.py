"""Re-emit a traced region with its planned layouts.

The jaxpr is evaluated primitive by primitive (as ``jax.core.eval_jaxpr`` does); each
``mshard_mark`` becomes ``jax.lax.with_sharding_constraint`` to its planned layout, or nothing.
Call-like eqns whose bodies hold marks (jit/pjit, custom_jvp/vjp, closed_call) are inlined;
other higher-order eqns holding marks (checkpoint/remat, scan, while, cond) are rebuilt with
re-emitted bodies. Everything else is bound unchanged, so XLA sees the user's program plus
the constraints, and its SPMD partitioner inserts the collectives.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from .annotate import mark_p
from .assign import CALL_PARAMS, RegionLayouts, iter_marks, mark_key
from .layout import spec_of

INLINE = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}


def _has_marks(j) -> bool:
    jj = j.jaxpr if isinstance(j, jcore.ClosedJaxpr) else j
    return next(iter_marks(jj), None) is not None


class Emitter:
    def __init__(self, layouts: RegionLayouts):
        self.layouts = layouts
        self.mesh = layouts.mesh.jax_mesh()

    def constrain(self, eqn, x):
        if not self.layouts.honour_marks:
            return x
        lay = self.layouts.marks.get(mark_key(eqn))
        if lay is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec_of(lay)))

    def eval(self, jaxpr: jcore.Jaxpr, consts, *args):
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            outs = self.eqn(eqn, invals)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn, invals):
        prim = eqn.primitive
        if prim is mark_p:
            return self.constrain(eqn, invals[0])
        params = eqn.params
        has = any(_has_marks(j) for j in _jaxpr_params(params))
        if has and prim.name in INLINE:
            body = params[CALL_PARAMS[prim.name]]
            if isinstance(body, jcore.ClosedJaxpr):
                return self.eval(body.jaxpr, body.consts, *invals)
            return self.eval(body, (), *invals)
        if has:
            params = {k: self.rewrite(v) for k, v in params.items()}
        scope = str(eqn.source_info.name_stack)
        with jax.named_scope(scope) if scope else _null(), eqn.ctx.manager:
            return prim.bind(*invals, **prim.get_bind_params(params))

    def rewrite(self, v):
        """A jaxpr param with marks -> the same jaxpr with marks re-emitted as constraints."""
        if isinstance(v, (tuple, list)):
            return type(v)(self.rewrite(x) for x in v)
        if isinstance(v, jcore.ClosedJaxpr) and _has_marks(v):
            avals = [x.aval for x in v.jaxpr.invars]
            fn = lambda *a: self.eval(v.jaxpr, v.consts, *a)  # noqa: E731
            return jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
        if isinstance(v, jcore.Jaxpr) and _has_marks(v):
            avals = [x.aval for x in v.invars]
            fn = lambda *a: self.eval(v, (), *a)  # noqa: E731
            closed = jax.make_jaxpr(fn)(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
            if closed.consts:
                raise NotImplementedError("mshard: a re-emitted open jaxpr gained constants")
            return closed.jaxpr
        return v


def _jaxpr_params(params) -> list:
    out = []
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(item, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                out.append(item)
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


def emit(closed: jcore.ClosedJaxpr, layouts: RegionLayouts) -> Callable[..., list]:
    """A function of the region's flat inputs that evaluates ``closed`` with planned constraints."""
    em = Emitter(layouts)
    return lambda *args: em.eval(closed.jaxpr, closed.consts, *args)
