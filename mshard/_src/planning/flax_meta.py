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
sizes at all (no mesh on any Variable, on any value, or around the call) get a mesh mshard makes from the names
(:func:`mesh_from_names`): every way of giving the devices to the names, each name at least 2 (nothing the user
split is left whole) and dividing the dims it splits, priced by the planner's cost model; the cheapest is kept, and
the same mesh is used for every region of that model. A ``parameter_plan`` entry for the same parameter wins over
the annotation.

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

import itertools
import math
from collections.abc import Callable, Sequence
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
    out = []
    for v, name, names in _annotated(states, param_names):
        mesh = _variable_mesh(v) or ambient_mesh()
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


def _annotated(states: Sequence[Any], param_names: Sequence[str]) -> list[tuple[nnx.Variable, str, tuple]]:
    """(Variable, parameter name, its flax names) of every Variable of ``states`` whose names split something."""
    variables = [v for s in states
                 for v in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, nnx.Variable))]
    if len(variables) != len(param_names):
        return []
    out = []
    for v, name in zip(variables, param_names):
        if isinstance(v, nnx.Variable):
            names = _names(v.get_metadata())
            if names is not None and any(n is not None for n in names):
                out.append((v, name, names))
    return out


def _variable_mesh(v: nnx.Variable):
    """The mesh a Variable's annotation is on: its ``mesh`` metadata, else the concrete mesh its value is on."""
    mesh = v.get_metadata().get("mesh")
    if mesh is None:
        sh = getattr(v.get_value(), "sharding", None)
        mesh = sh.mesh if isinstance(sh, NamedSharding) and not isinstance(sh.mesh, jax.sharding.AbstractMesh) \
            else None
    return mesh


def _axes(n) -> tuple:
    return () if n is None else (tuple(n) if isinstance(n, (tuple, list)) else (n,))


def unsized_names(states: Sequence[Any], param_names: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes the flax annotations name, in first-use order, when no mesh anywhere gives them sizes (no
    annotated Variable has a mesh, and none is set around the call); else ``()``."""
    ann = _annotated(states, param_names)
    if not ann or ambient_mesh() is not None or any(_variable_mesh(v) is not None for v, _, _ in ann):
        return ()
    return tuple(dict.fromkeys(a for _, _, names in ann for n in names for a in _axes(n)))


def mesh_sizes(states: Sequence[Any], param_names: Sequence[str], devices: int) -> list[dict[str, int]]:
    """Every way of giving ``devices`` devices to the annotations' mesh axes (:func:`unsized_names`): each axis at
    least 2 (an axis of 1 would leave whole what the user split), their product ``devices``, and every annotated
    dim divisible by the product of its axes' sizes.

    >>> from flax import nnx
    >>> init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("fsdp", "tp"))
    >>> with nnx.use_eager_sharding(False):         # flax creates annotated weights with no mesh only so
    ...     lin = nnx.Linear(16, 8, kernel_init=init, use_bias=False, rngs=nnx.Rngs(0))
    >>> mesh_sizes([nnx.state(lin)], ["kernel"], 8)
    [{'fsdp': 2, 'tp': 4}, {'fsdp': 4, 'tp': 2}]
    """
    names = unsized_names(states, param_names)
    ann = _annotated(states, param_names)
    out = []
    for sizes in itertools.product(*[[d for d in range(2, devices + 1) if devices % d == 0]] * len(names)):
        if math.prod(sizes) != devices:
            continue
        size = dict(zip(names, sizes))
        if all(n % math.prod(size[a] for a in _axes(axes)) == 0
               for v, _, spec in ann for n, axes in zip(v.shape, spec)):
            out.append(size)
    return out


# (the annotations' shapes and names, devices) -> the mesh chosen for them: one model's regions (a training step's
# forward probe and the step itself) run on one mesh
_CHOSEN: dict[tuple, tuple[jax.sharding.Mesh, str]] = {}


def mesh_from_names(states: Sequence[Any], param_names: Sequence[str], devices: int,
                    price: Callable[[jax.sharding.Mesh], float]) -> tuple[jax.sharding.Mesh, str]:
    """The mesh mshard makes for annotations whose names no mesh sizes (Auto axes over the first ``devices``
    devices): of :func:`mesh_sizes`' candidates, the one ``price`` (the plan's cost under that mesh) finds cheapest,
    the first in order on a tie. -> (mesh, a note for the plan saying what was tried)."""
    ann = _annotated(states, param_names)
    key = (tuple(sorted((tuple(v.shape), repr(n)) for v, _, n in ann)), devices)
    if key in _CHOSEN:
        return _CHOSEN[key]
    names = unsized_names(states, param_names)
    cands = mesh_sizes(states, param_names, devices)
    if not cands:
        raise ParameterPlanError(
            f"nnx.with_partitioning names mesh axes {names} and no mesh gives them sizes; mshard found no way to "
            f"give {devices} devices to them (each at least 2, dividing every dim it splits); pass mesh= to "
            f"nnx.with_partitioning, or create or call the model under jax.set_mesh(mesh).")
    devs = jax.devices()[:devices]
    meshes = [jax.make_mesh(tuple(c.values()), names, axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                            devices=devs) for c in cands]
    costs = [price(m) for m in meshes] if len(meshes) > 1 else [0.0]
    best = min(range(len(meshes)), key=lambda i: (costs[i], i))
    tried = ", ".join(f"{c} {cost:.4g} s" for c, cost in zip(cands, costs))
    note = (f"mesh from flax's names: {cands[best]} (no mesh gives the names {names} sizes; "
            f"the cost model's estimate per candidate: {tried})")
    _CHOSEN[key] = (meshes[best], note)
    return _CHOSEN[key]


def creation_mesh(module: Any) -> jax.sharding.Mesh | None:
    """The mesh a module's annotated parameters were created on (the mesh of the first one placed on a concrete
    mesh), or None. flax needs it around creating Variables that copy the annotations (an optimizer's moments)."""
    for _, v in nnx.iter_graph(module):
        if isinstance(v, nnx.Variable) and _names(v.get_metadata()) is not None:
            sh = getattr(v.get_value(), "sharding", None)
            if isinstance(sh, NamedSharding) and isinstance(sh.mesh, jax.sharding.Mesh):
                return sh.mesh
    return None
