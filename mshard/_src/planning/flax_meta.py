"""flax's own sharding annotations as user strategies: ``nnx.with_partitioning(init, (None, "model"))``.

A model written for flax's sharding API names, per parameter, the mesh axis of each dim (the Variable's
``out_sharding`` metadata; ``sharding`` / ``sharding_names`` in older flax). mshard reads it as that parameter's
``parameter_plan`` entry, on the mesh that gives the names their sizes, looked up in this order:

1. the Variable's ``mesh`` metadata (``nnx.with_partitioning(init, names, mesh=mesh)``);
2. the mesh of the parameter's value, where flax placed it (a model created under ``jax.set_mesh(mesh)``);
3. the mesh set by ``jax.set_mesh`` / ``jax.sharding.use_mesh`` around the call.

So a model created for flax's sharding runs unchanged without a global mesh when it is called. Activations
annotated with ``out_sharding=`` (JAX's explicit sharding) are read by :mod:`mshard._src.jaxpr.explicit_types`,
on the mesh set around the call or, without one, the mesh these annotations name. Names that no mesh
sizes are a :class:`~mshard.errors.ParameterPlanError` naming the parameter and the fixes (nothing is silently
replicated). A ``parameter_plan`` entry for the same parameter wins over the annotation.

>>> import jax, mshard as ms
>>> from flax import nnx
>>> from jax.sharding import AxisType
>>> mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
>>> init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"), mesh=mesh)
>>> lin = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
>>> [(k, str(s.spec)) for _, k, s in annotated_plans([nnx.state(lin)], ["bias", "kernel"])]   # leaf order
[('kernel', "P(None, 'model')")]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mshard._src.values.errors import ParameterPlanError

_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")


def _names(meta: dict) -> tuple | None:
    for k in _NAME_KEYS:
        v = meta.get(k)
        if isinstance(v, PartitionSpec):
            return tuple(v)
        if isinstance(v, (tuple, list)) and v:
            return tuple(v)
    return None


def ambient_mesh():
    """The concrete mesh set around the call (``jax.set_mesh`` / ``jax.sharding.use_mesh``), or None."""
    try:
        from jax._src import mesh as mesh_lib  # JAX 0.10 exposes no public getter for the concrete mesh
        m = mesh_lib.get_concrete_mesh()
    except Exception:
        return None
    return None if m is None or getattr(m, "empty", True) else m


def annotated_plans(states: Sequence[Any], param_names: Sequence[str]) -> list[tuple[str, str, NamedSharding]]:
    """``[("", parameter name, NamedSharding)]`` for every Variable of ``states`` with flax sharding names, in the
    order of the flattened state leaves (``param_names`` names them)."""
    variables = [v for s in states
                 for v in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    if len(variables) != len(param_names):
        return []
    out = []
    for v, name in zip(variables, param_names):
        if not isinstance(v, nnx.Variable):
            continue
        meta = v.get_metadata()
        names = _names(meta)
        if names is None or all(n is None for n in names):
            continue
        mesh = meta.get("mesh")
        if mesh is None:
            sh = getattr(v.get_value(), "sharding", None)
            mesh = sh.mesh if isinstance(sh, NamedSharding) and not isinstance(sh.mesh, jax.sharding.AbstractMesh) \
                else None
        mesh = mesh or ambient_mesh()
        if mesh is None:
            raise ParameterPlanError(
                f"parameter {name!r}: nnx.with_partitioning names mesh axes {names} but no mesh gives them sizes; "
                f"pass mesh= to nnx.with_partitioning, create or call the model under jax.set_mesh(mesh), or give "
                f"a parameter_plan for {name!r}.")
        missing = [a for n in names if n is not None for a in (n if isinstance(n, tuple) else (n,))
                   if a not in mesh.axis_names]
        if missing:
            raise ParameterPlanError(f"parameter {name!r}: nnx.with_partitioning names mesh axes {missing} that the "
                                     f"mesh {dict(mesh.shape)} does not have; use its axis names "
                                     f"{tuple(mesh.axis_names)}.")
        out.append(("", name, NamedSharding(mesh, PartitionSpec(*names))))
    return out


def creation_mesh(module: Any) -> jax.sharding.Mesh | None:
    """The mesh a module's annotated parameters were created on (the mesh of the first one placed on a concrete
    mesh), or None. flax needs it around creating Variables that copy the annotations (an optimizer's moments)."""
    for _, v in nnx.iter_graph(module):
        if isinstance(v, nnx.Variable) and _names(v.get_metadata()) is not None:
            sh = getattr(v.get_value(), "sharding", None)
            if isinstance(sh, NamedSharding) and isinstance(sh.mesh, jax.sharding.Mesh):
                return sh.mesh
    return None
