"""Programs written for JAX's explicit sharding (``out_sharding=``, ``jax.sharding.reshard``) as mshard programs.

A model written for an Explicit mesh names the sharding of some results in its code
(``jnp.einsum(..., out_sharding=P("fsdp", None, "tp"))``, ``x.at[i].get(out_sharding=...)``,
``jax.sharding.reshard``), and JAX types every value with its sharding. Such code only traces under a mesh whose
axes are Explicit, with inputs typed as they are stored. mshard traces it so (:func:`typed_avals` under
:func:`explicit_mesh`), then erases the types (:func:`erase_types`):

- every equation that set a sharding (a non-``None`` ``out_sharding`` / ``sharding`` / ``dst_sharding`` param,
  ``reshard``, ``mesh_cast``) is bound without it and its result gets ``with_sharding_constraint`` to that
  sharding on the user's mesh (with Auto axes): the user's layout, which the planner takes as fixed, as it takes
  any ``with_sharding_constraint``;
- every other equation is bound as traced, on untyped values;
- calls (``jit``, custom JVP/VJP) are inlined and the bodies of remat, scan, while and cond are rebuilt the same way.

The result is the program an Auto mesh would have traced with ``with_sharding_constraint`` in place of each
explicit sharding. So the model also runs when the user's mesh has Auto axes, where JAX refuses ``out_sharding``.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import PartitionSpec as P
>>> mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
>>> f = lambda x, w: jnp.einsum("bd,df->bf", x, w, out_sharding=P("fsdp", "tp"))
>>> x, w = jax.ShapeDtypeStruct((8, 4), jnp.float32), jax.ShapeDtypeStruct((4, 8), jnp.float32)
>>> with jax.sharding.use_abstract_mesh(explicit_mesh(mesh)):
...     typed = jax.make_jaxpr(f)(*typed_avals([x, w], [P("fsdp"), None], mesh))
>>> [e.primitive.name for e in erase_types(typed, mesh).eqns]
['dot_general', 'sharding_constraint']
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from mshard._src.jaxpr.walk import CALLS, REMAT, eval_jaxpr

# params through which an equation sets its result's sharding type
_SHARDING_PARAMS = ("out_sharding", "sharding", "dst_sharding")
# primitives whose only job is to change a value's sharding type: the value passes, its layout is constrained
_CASTS = frozenset({"reshard", "mesh_cast", "sharding_cast"})
NO_MESH = AbstractMesh((), ())      # no mesh around a trace: entered so a user's Explicit mesh does not type it


def explicit_mesh(mesh: Mesh | AbstractMesh) -> AbstractMesh:
    """``mesh``'s names and sizes as an abstract mesh whose axes are all Explicit (what the trace runs under)."""
    return AbstractMesh(tuple(int(mesh.shape[a]) for a in mesh.axis_names), tuple(mesh.axis_names),
                        axis_types=(AxisType.Explicit,) * len(mesh.axis_names))


def auto_mesh(mesh: Mesh) -> Mesh:
    """The concrete ``mesh`` with Auto axes: where the erased program's constraints live."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def typed_avals(values: Sequence[Any], specs: Sequence[PartitionSpec | None], mesh: Mesh) -> list:
    """``ShapeDtypeStruct`` per value, typed with its spec on ``mesh``'s explicit form (``None``: replicated)."""
    am = explicit_mesh(mesh)
    return [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(am, s if s is not None else PartitionSpec()))
            for x, s in zip(values, specs, strict=True)]


def data_spec(x: Any, mesh: Mesh) -> PartitionSpec | None:
    """How a data argument is typed in the trace: its own spec where it is stored on a mesh with ``mesh``'s axis
    names (as plain JAX types a committed array), else replicated (as plain JAX types a NumPy array)."""
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding) and tuple(sh.mesh.axis_names) == tuple(mesh.axis_names):
        return sh.spec
    return None


def _set_sharding(eqn) -> NamedSharding | None:
    for k in _SHARDING_PARAMS:
        v = eqn.params.get(k)
        if isinstance(v, NamedSharding):
            return v
    return None


class _Eraser:
    def __init__(self, mesh: Mesh):
        self.mesh = auto_mesh(mesh)

    def constrain(self, x, sharding: NamedSharding | None):
        if sharding is None or not hasattr(x, "shape") or len(x.shape) == 0:
            return x
        spec = sharding.spec
        if len(spec) > len(x.shape):
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def eval(self, jaxpr: jcore.Jaxpr, consts, *args):
        return eval_jaxpr(jaxpr, consts, args, self.eqn)

    def eqn(self, eqn, invals: list):
        prim = eqn.primitive
        name = prim.name
        if name in _CASTS:
            outs = [self.constrain(x, _set_sharding(eqn)) for x in invals]
            return outs if prim.multiple_results else outs[0]
        if name == "sharding_constraint":          # an assertion of the type under Explicit axes: kept as a layout
            return self.constrain(invals[0], eqn.params["sharding"])
        if name in CALLS and name not in REMAT:    # jit / custom_jvp / custom_vjp bodies are inlined
            body = eqn.params[CALLS[name]]
            outs = (self.eval(body.jaxpr, body.consts, *invals) if isinstance(body, jcore.ClosedJaxpr)
                    else self.eval(body, (), *invals))
            return outs if prim.multiple_results else outs[0]
        sharding = _set_sharding(eqn)
        params = {k: (None if k in _SHARDING_PARAMS and isinstance(v, NamedSharding) else self.rewrite(v))
                  for k, v in eqn.params.items()}
        scope = str(eqn.source_info.name_stack)
        with jax.named_scope(scope) if scope else _Null():
            out = prim.bind(*invals, **prim.get_bind_params(params))
        if sharding is None:
            return out
        if prim.multiple_results:
            return [self.constrain(x, sharding) for x in out]
        return self.constrain(out, sharding)

    def rewrite(self, v: Any) -> Any:
        """A jaxpr param -> the same jaxpr with its types erased."""
        if type(v) in (tuple, list):                 # not a NamedTuple param (e.g. GatherDimensionNumbers)
            return type(v)(self.rewrite(x) for x in v)
        if isinstance(v, jcore.ClosedJaxpr):
            avals = [jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in v.jaxpr.invars]
            return jax.make_jaxpr(lambda *a: self.eval(v.jaxpr, v.consts, *a))(*avals)
        if isinstance(v, jcore.Jaxpr):
            avals = [jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in v.invars]
            closed = jax.make_jaxpr(lambda *a: self.eval(v, (), *a))(*avals)
            if closed.consts:
                raise NotImplementedError("mshard: an erased open jaxpr gained constants")
            return closed.jaxpr
        return v


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


def erase_types(closed: jcore.ClosedJaxpr, mesh: Mesh) -> jcore.ClosedJaxpr:
    """``closed`` (traced under :func:`explicit_mesh`) without sharding types; each sharding the program set is a
    ``with_sharding_constraint`` on ``mesh`` with Auto axes (module doc)."""
    er = _Eraser(mesh)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    with jax.sharding.use_abstract_mesh(NO_MESH):
        return jax.make_jaxpr(lambda *a: er.eval(closed.jaxpr, closed.consts, *a))(*avals)
