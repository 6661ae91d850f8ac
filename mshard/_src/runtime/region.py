"""``ms.jit``: a jitted region that is traced once per (shapes, dtypes, context), planned, and run.

Arguments that are nnx Modules (Cells) are parameters: their state is split off, placed on its
planned sharding once (written back into the module, so later calls move nothing) and updated
after the call (a region may change its modules' state). Other array arguments are data and follow
``dataset_strategy``; non-array leaves (ints, strings, None) are static.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding

from mshard._src.jaxpr import marks
from mshard._src.jaxpr.explicit_types import NO_MESH, data_spec, erase_types, explicit_mesh, typed_avals
from mshard._src.planning.axis_assignment import InputInfo, RegionLayouts
from mshard._src.planning.flax_meta import ambient_mesh, annotated_plans, mesh_from_names, unsized_names
from mshard._src.planning.search import search_region
from mshard._src.planning.xla_guards import apply_guards
from mshard._src.runtime import dryrun
from mshard._src.runtime.emit import emit
from mshard._src.runtime.fastcall import (
    MISS,
    InputsChanged,
    fast_call,
    follow_plan,
    graph_structure,
    module_variables,
    same_structure,
)
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import ContextError, DatasetStrategyError, ParameterPlanError, RegionTypeError
from mshard._src.values.layout import TensorStrategy, jax_mesh, normalize_in_strategy, spec_of


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or (
        hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type))


def _path_str(path) -> str:
    """A state leaf's key path -> ``"dense1.weight"`` (the Variable's ``.value`` attribute dropped)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
    return ".".join(parts)


class _VarHolder(nnx.Module):
    """Carries a lone ``nnx.Variable`` argument through split/merge as a parameter."""

    def __init__(self, v):
        self.v = v


@dataclass
class _Compiled:
    closed: Any
    layouts: RegionLayouts
    jitted: Callable
    in_shardings: list
    module_out_shardings: list
    out_tree: Any
    changed: list          # indices of state leaves the region writes (only these come back)
    plan: Any = None       # the Plan this program runs (every mode)
    infos: Any = None
    param_plans: Any = None


class Region:
    """The jitted region ``ms.jit(fn)``: traced once per (shapes, dtypes, context), planned, and run.

    In auto modes the search runs when it is first traced. nnx Module (Cell) arguments are parameters, placed
    on their planned shardings once and updated after the call; other array arguments are data and follow
    ``dataset_strategy``; non-array leaves are static. ``lower``, ``plan``, ``layouts``, ``param_shardings`` and
    ``place`` plan without running; ``bind`` skips the per-call graph traversal. Usually made by :func:`jit`.

    Args:
        fn: the function to run.
        data_strategy: one strategy per positional argument (None for a module argument, or to leave a data
            argument to ``dataset_strategy``), in any form ``shard`` takes.
        name: the region's name in plans and messages (default: ``fn.__name__``).
        input_layout_hook: ``hook(infos, layouts, statics=...) -> layouts.inputs``, for a training wrapper to
            re-lay out inputs after planning (optimizer state following its parameter, ZeRO sharding);
            ``statics`` are the call's static (non-array) arguments, in order (a training step passes its plan so).
        donate_params: donate the written parameter buffers (a training step updates them in place).
        memory_kind_hook: ``hook(infos, statics=...) -> [memory kind or None per input]``: inputs stored in another
            memory than the device's (``"pinned_host"``: a training step's offloaded optimizer state); an input
            written back keeps its memory kind.
        compiler_options_hook: ``hook(statics=...) -> dict | None``: XLA options this program compiles with (a
            level3 training step's memory-first schedule).
        strategy_file: whether ``strategy_ckpt_config``'s files apply to this region (default True). A training
            step's forward probe, planned only to learn the step's layouts, passes False: the file holds the
            step's own plan, whose op names would meet the probe's by chance.

    A region with a ``save_file`` writes the plan of the program it last ran, lowered or planned (each program's
    plan once per use, so the file holds the plan in use, not the last one tried).

    >>> import jax.numpy as jnp, mshard as ms
    >>> f = ms.jit(lambda x: jnp.tanh(x) * 2)
    >>> float(f(jnp.zeros(8)).sum())
    0.0
    >>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    >>> r = ms.Region(lambda x: x * 2, data_strategy=((8, 1),), name="double")
    >>> out = r(jnp.ones((8, 2)))
    >>> r.name, out.shape, out.sharding.shard_shape(out.shape)
    ('double', (8, 2), (1, 2))
    >>> ms.reset_auto_parallel_context()
    """

    def __init__(self, fn: Callable, *, data_strategy: tuple | None = None, name: str | None = None,
                 input_layout_hook: Callable | None = None, donate_params: bool = False,
                 memory_kind_hook: Callable | None = None, compiler_options_hook: Callable | None = None,
                 strategy_file: bool = True):
        """The arguments are described in the class docstring."""
        self.strategy_file = strategy_file
        self._saved: tuple | None = None         # (save_file, the program whose plan it holds)
        self.fn = fn
        self.compiler_options_hook = compiler_options_hook
        self.memory_kind_hook = memory_kind_hook
        if data_strategy is not None and not all(s is None or isinstance(s, TensorStrategy) for s in data_strategy):
            where = f"ms.Region {name or getattr(fn, '__name__', 'region')!r} data_strategy"
            data_strategy = tuple(None if s is None else (s if isinstance(s, TensorStrategy) else
                                                          normalize_in_strategy((s,), 1, where)[0])
                                  for s in data_strategy)
        self.input_layout_hook = input_layout_hook
        self.donate_params = donate_params
        self.data_strategy = data_strategy        # per-arg layouts for data args (a shard root's in_strategy)
        self.name = name or getattr(fn, "__name__", "region")
        self._cache: dict[Any, _Compiled] = {}
        functools.update_wrapper(self, fn, updated=())

    # -- arguments ---------------------------------------------------------------------------------
    def _split_args(self, args: tuple, kwargs: dict):
        modules, mod_pos = [], []
        flat_data, data_names, data_pos = [], [], []
        statics = []
        treedef_args = []
        for i, a in enumerate(args):
            # a Module, or another nnx object that holds Variables (nnx.Optimizer): its state is the region's
            # parameters, never data (a batch split of Adam's moments made no sense)
            if isinstance(a, nnx.Module) or (isinstance(a, nnx.Pytree) and nnx.graph.is_graph_node(a)):
                modules.append(a)
                mod_pos.append(i)
                treedef_args.append(("module", len(modules) - 1))
            elif isinstance(a, nnx.Variable):          # a lone parameter: carried by a holder module
                modules.append(_VarHolder(a))
                mod_pos.append(i)
                treedef_args.append(("variable", len(modules) - 1))
            else:
                leaves, tree = jax.tree.flatten_with_path(a)
                spec = []
                for path, leaf in leaves:
                    if _is_array(leaf):
                        spec.append(("data", len(flat_data)))
                        data_names.append(f"arg{i}{jax.tree_util.keystr(path)}")
                        data_pos.append(i)
                        flat_data.append(leaf)
                    else:
                        spec.append(("static", leaf))
                        statics.append(leaf)
                treedef_args.append(("tree", tree, tuple(spec)))
        if kwargs:
            raise RegionTypeError(f"ms.jit region {self.name!r}: pass arguments positionally (got keywords "
                            f"{sorted(kwargs)}); keyword arguments are not supported yet.")
        return modules, mod_pos, flat_data, data_names, data_pos, treedef_args

    @staticmethod
    def _param_name(gi: int, path: str, mod_pos: list[int], holders: list[bool]) -> str:
        """Parameter path: plain for the first module argument (``dense1.weight``), ``argI.path`` for later
        ones, ``argI`` for a lone nnx.Variable argument (module ``gi`` is argument ``mod_pos[gi]``)."""
        pos = mod_pos[gi]
        if path == "v" and holders[gi]:
            return f"arg{pos}"
        return path if gi == 0 else f"arg{pos}.{path}"

    def _key(self, modules, flat_data, treedef_args):
        graphdefs, states = [], []
        for m in modules:
            g, s = nnx.split(m)
            graphdefs.append(g)
            states.append(s)
        avals = tuple((tuple(x.shape), str(x.dtype)) for x in flat_data)
        st_avals = tuple(tuple((tuple(v.shape), str(v.dtype)) for v in jax.tree.leaves(s)) for s in states)
        tree_key = tuple((t[0], t[1], tuple(("static", repr(s[1])) if s[0] == "static" else s for s in t[2]))
                         if t[0] == "tree" else t for t in treedef_args)
        ctx = ctxmod.current()
        key = (tuple(graphdefs), st_avals, avals, tree_key, ctx.cache_key(), repr(ctxmod.get_algo_parameters()),
               repr(ctxmod.get_cost_model_context()), marks.epoch())
        return key, graphdefs, states

    # -- tracing and planning ---------------------------------------------------------------------
    def _build(self, graphdefs, states, flat_data, data_names, data_pos, treedef_args, mod_pos: list[int],
               holders: list[bool]) -> _Compiled:
        """Trace, plan and jit the region for one call's arguments (everything per call is an argument here, so a
        region can be re-entered: called again while it traces or from another thread)."""
        ctx = ctxmod.current()
        state_leaves, state_trees, param_names = [], [], []
        for gi, s in enumerate(states):
            leaves, tree = jax.tree.flatten_with_path(s)
            state_trees.append(tree)
            for path, leaf in leaves:
                param_names.append(self._param_name(gi, _path_str(path), mod_pos, holders))
                state_leaves.append(leaf)
        if ctx.parallel_mode in ("semi_auto_parallel", "auto_parallel") and unsized_names(states, param_names):
            # flax names that no mesh sizes: built under the mesh mshard makes from them (planning/flax_meta.py)
            args = (graphdefs, states, flat_data, data_names, data_pos, treedef_args, mod_pos, holders)

            def under(mesh):
                with jax.set_mesh(mesh):
                    return self._build(*args)
            built: dict = {}

            def price(mesh):
                built[id(mesh)] = under(mesh)
                return float(built[id(mesh)].plan.cost.total)
            mesh, note = mesh_from_names(states, param_names, ctx.devices, price)
            comp = built.get(id(mesh)) or under(mesh)
            comp.plan = dataclasses.replace(comp.plan, notes=tuple(comp.plan.notes) + (note,))
            return comp
        n_state = len(state_leaves)
        counts = [len(jax.tree.leaves(s)) for s in states]
        # strategies are checked against the configured device_num in every mode (stand_alone ignores them, on one
        # device, as data_parallel does; a strategy valid for device_num is not an error there)
        trace = marks.TraceRecord(device_num=ctx.devices)
        fn = self.fn

        def pure(*flat):
            st_flat, data = flat[:n_state], flat[n_state:]
            mods, off = [], 0
            for g, tree, c in zip(graphdefs, state_trees, counts):
                mods.append(nnx.merge(g, jax.tree.unflatten(tree, st_flat[off:off + c])))
                off += c
            for m in mods:
                prefix = ""
                for path, sub in nnx.iter_graph(m):
                    if isinstance(sub, nnx.Module):
                        trace.module_paths[id(sub)] = (prefix + ".".join(map(str, path))) if path else ""
            args = []
            for t in treedef_args:
                if t[0] == "module":
                    args.append(mods[t[1]])
                elif t[0] == "variable":
                    args.append(mods[t[1]].v)
                else:
                    _, tree, spec = t
                    args.append(jax.tree.unflatten(tree, [data[s[1]] if s[0] == "data" else s[1] for s in spec]))
            out = fn(*args)
            new_states = [jax.tree.leaves(nnx.state(m)) for m in mods]
            return out, [x for s in new_states for x in s]

        def traced(mesh):
            # mesh: None for a plain trace; else the user's mesh, for a program written for explicit sharding
            # (jaxpr/explicit_types: traced typed under its Explicit form, then its types erased to constraints)
            with marks.recording_into(trace), marks.module_scopes(trace, _module_classes(graphdefs)):
                if mesh is None:
                    flat_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state_leaves + list(flat_data)]
                    return jax.make_jaxpr(pure, return_shape=True)(*flat_avals)
                specs = _annotated_specs(states, param_names, n_state) + [data_spec(x, mesh) for x in flat_data]
                avals = typed_avals(state_leaves + list(flat_data), specs, mesh)
                with jax.sharding.use_abstract_mesh(explicit_mesh(mesh)):
                    typed, out_shape = jax.make_jaxpr(pure, return_shape=True)(*avals)
            return erase_types(typed, mesh), out_shape

        user_mesh = ambient_mesh()
        explicit = user_mesh is not None and AxisType.Explicit in tuple(user_mesh.axis_types)
        try:
            closed, out_shape = traced(user_mesh if explicit else None)
        except ValueError as e:
            # out_sharding= / PartitionSpec in code traced without an Explicit mesh: retrace it as explicit code
            # on the user's mesh (set around the call, or the one the parameters' annotations name)
            user_mesh = user_mesh or _annotated_mesh(states, param_names)
            if explicit or user_mesh is None or not any(m in str(e) for m in _EXPLICIT_ONLY):
                raise
            trace = marks.TraceRecord(device_num=ctx.devices)
            closed, out_shape = traced(user_mesh)
        out_tree = jax.tree.structure(out_shape)
        infos = [InputInfo("param", tuple(x.shape), nm) for x, nm in zip(state_leaves, param_names)]
        for x, nm, pos in zip(flat_data, data_names, data_pos):
            st = None
            if self.data_strategy is not None and pos < len(self.data_strategy):
                st = self.data_strategy[pos]
            elif isinstance(ctx.dataset_strategy, tuple):
                # MindSpore's dataset_strategy has one entry per dataset column: the region's data arguments,
                # counted without the Cells and modules passed beside them
                k = pos - sum(m < pos for m in mod_pos)
                if k >= len(ctx.dataset_strategy):
                    raise DatasetStrategyError(
                        f"ms.jit region {self.name!r}: dataset_strategy {ctx.dataset_strategy} has "
                        f"{len(ctx.dataset_strategy)} entries but data input {nm} is data argument {k}; give one "
                        f"entry per data argument (modules not counted), or use 'data_parallel' / 'full_batch'.")
                st = TensorStrategy(ctx.dataset_strategy[k])
            infos.append(InputInfo("data", tuple(x.shape), nm, st))
        # one planning path for every mode: data_parallel and stand_alone plan as the data-parallel default
        # flax's own annotations (nnx.with_partitioning) first: a parameter_plan entry for the same parameter wins
        honour = ctx.parallel_mode in ("semi_auto_parallel", "auto_parallel")
        param_plans = (annotated_plans(states, param_names) if honour else []) + list(trace.param_plans)
        hook = None
        # the call's static (non-array) arguments, in order: what the hooks are given (a training step's plan)
        statics = [s[1] for t in treedef_args if t[0] == "tree" for s in t[2] if s[0] == "static"]
        if self.input_layout_hook is not None:
            hook = functools.partial(self.input_layout_hook, statics=statics)
        files = ctx if self.strategy_file else dataclasses.replace(
            ctx, strategy_ckpt_config={**ctx.strategy_ckpt_config, "load_file": "", "save_file": ""})
        planned = search_region(closed, infos, ctx=files, algorithm=search_algorithm(ctx) or ctx.parallel_mode,
                                param_plans=param_plans, input_layout_hook=hook)
        layouts = planned.layouts
        if hook is not None:
            layouts.inputs = list(hook(infos, layouts))
        guarded = apply_guards(closed.jaxpr, layouts)     # layouts XLA miscompiles are realised safely
        if guarded:
            planned = dataclasses.replace(planned, plan=dataclasses.replace(
                planned.plan, notes=tuple(planned.plan.notes) + tuple(guarded)))
        mesh = jax_mesh(layouts.mesh)
        kinds = [None] * len(layouts.inputs)
        if self.memory_kind_hook is not None:
            kinds = list(self.memory_kind_hook(infos, statics=statics))
        in_sh = [NamedSharding(mesh, spec_of(lay), memory_kind=k) for lay, k in zip(layouts.inputs, kinds, strict=True)]
        run = emit(closed, layouts, planned.eqn_out, planned.eqn_in, planned.eqn_scatter, planned.eqn_joined,
                   planned.bodies)
        n_out = len(jax.tree.leaves(out_shape))
        n_user = n_out - n_state
        outvars, invars = closed.jaxpr.outvars, closed.jaxpr.invars
        changed = [j for j in range(n_state) if outvars[n_user + j] is not invars[j]]
        if self.input_layout_hook is None:     # not a training wrapper's own step (TrainOneStepCell)
            kinds = [type(v) for s in states for v in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, nnx.Variable))]
            _check_training_settings(self.name, ctx, [param_names[j] for j in changed
                                                      if j < len(kinds) and issubclass(kinds[j], nnx.Param)],
                                     pipelined=bool(trace.pipelines), zero=trace.zero)
        mod_out = [in_sh[j] for j in changed]
        out_sh = [None] * n_user + mod_out

        expected = [(tuple(v.aval.shape), v.aval.dtype) for v in invars]

        def flat_fn(*flat):
            # traced once per input signature: a fast path's call with other shapes/dtypes must not reuse this
            # plan (it was made for these shapes), so it is refused here and the call goes through the region
            if any((tuple(x.shape), x.dtype) != e for x, e in zip(flat, expected)):
                raise InputsChanged(f"region {self.name!r}: called with other input shapes/dtypes")
            with jax.sharding.use_abstract_mesh(NO_MESH):     # the emitted program's meshes are its own
                outs = run(*flat)
            return list(outs[:n_user]) + [outs[n_user + j] for j in changed]

        donate = tuple(changed) if self.donate_params else ()
        options = self.compiler_options_hook(statics=statics) if self.compiler_options_hook is not None else None
        jitted = jax.jit(flat_fn, in_shardings=in_sh, out_shardings=out_sh, donate_argnums=donate,
                         compiler_options=options)
        return _Compiled(closed, layouts, jitted, in_sh, mod_out, out_tree, changed,
                         planned.plan, infos, param_plans)

    def _prepare(self, args, kwargs):
        modules, mod_pos, flat_data, data_names, data_pos, treedef_args = self._split_args(args, kwargs)
        key, graphdefs, states = self._key(modules, flat_data, treedef_args)
        comp = self._cache.get(key)
        if comp is None:
            comp = self._build(graphdefs, states, flat_data, data_names, data_pos, treedef_args, mod_pos,
                               [isinstance(m, _VarHolder) for m in modules])
            self._cache[key] = comp
        self._save_strategy(comp)
        return comp, modules, states, flat_data

    def _save_strategy(self, comp: _Compiled) -> None:
        """Write ``comp``'s plan to the context's ``save_file`` unless the file holds it already (a training step
        plans several programs to choose one: the file ends with the one in use)."""
        ctx = ctxmod.current()
        save = ctx.strategy_ckpt_config.get("save_file")
        if (not save or not self.strategy_file or comp.plan is None
                or ctx.parallel_mode not in ("semi_auto_parallel", "auto_parallel")):
            return
        if self._saved is None or self._saved[0] != save or self._saved[1] is not comp:
            comp.plan.save(save)
            self._saved = (save, comp)

    def _place(self, comp: _Compiled, modules, states):
        """Put parameters on their planned shardings once, writing them back into the modules."""
        flat, off = [], 0
        for m, s in zip(modules, states):
            leaves, tree = jax.tree.flatten(s)
            shs = comp.in_shardings[off:off + len(leaves)]
            off += len(leaves)
            # a donating region places copies, also of arrays already in their planned layout: device_put may
            # alias the caller's buffer (even with may_alias=False, one device -> replicated), and an array placed
            # by another region may be shared with a clone of the model; donating it would delete arrays the
            # caller still holds. (Only this slow path copies; a training step's repeated calls take the fast path.)
            if self.donate_params:
                placed = [_put(jnp.copy(x), sh) for x, sh in zip(leaves, shs)]
            else:
                placed = [x if getattr(x, "sharding", None) == sh else _put(x, sh) for x, sh in zip(leaves, shs)]
            if any(p is not x for p, x in zip(placed, leaves)):
                nnx.update(m, jax.tree.unflatten(tree, placed))
            flat.extend(placed)
        return flat

    def __call__(self, *args, **kwargs):
        comp, modules, states, flat_data = self._prepare(args, kwargs)
        leaves = [x for s in states for x in jax.tree.leaves(s)]
        if dryrun.active() and not any(isinstance(x, jax.core.Tracer) for x in leaves + list(flat_data)):
            dryrun.stop_after(self, comp, args, leaves + list(flat_data))
        if any(isinstance(x, jax.core.Tracer) for x in leaves + list(flat_data)):
            # inside jax.jit / jax.grad / jax.vmap: the values are not placed (a tracer has no buffer), they are
            # constrained to the planned layouts, and the region's jitted program is traced into the caller's
            wsc = jax.lax.with_sharding_constraint
            flat = [wsc(x, sh) for x, sh in zip(leaves + list(flat_data), comp.in_shardings)]
            return self._finish(comp, modules, states, comp.jitted(*flat))
        flat_state = self._place(comp, modules, states)
        flat_data = follow_plan(flat_data, comp.in_shardings[len(flat_state):])
        outs = comp.jitted(*flat_state, *flat_data)
        return self._finish(comp, modules, states, outs)

    def fast_path(self, args: tuple, modules, data: tuple) -> Callable | None:
        """After a call with ``args`` (its program compiled, its parameters placed): a
        :func:`~mshard._src.runtime.fastcall.fast_call` running that program on ``modules``' Variables and new ``data``, or
        None where the modules hold something other than Variables."""
        comp = self._prepare(args, {})[0]       # the program just run (a cache hit)
        variables = module_variables(modules)
        return None if variables is None else fast_call(comp, variables, data, donate=self.donate_params)

    def bind(self, *modules: nnx.Module) -> BoundRegion:
        """``f = region.bind(net)``; ``f(*data)`` is ``region(net, *data)`` without the per-call graph traversal.

        For loops that call one region many times with the same modules (a decode loop, an eval loop): the first
        call goes through the region; later calls read the modules' Variables, call the compiled program and write
        the changed values back, as ``nnx.cached_partial`` does for ``nnx.jit``. Values written into the modules'
        Variables between calls are seen; Variables or sub-modules *assigned* to a module after the first call are
        not (bind again after changing a module's structure). A new context, strategy, data shape or dtype, or a
        value of another layout goes through the region again.

        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import mshard as ms
        >>> lin = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        >>> f = ms.jit(lambda m, x: m(x)).bind(lin)
        >>> f(jnp.ones((8, 4))).shape, f(jnp.ones((8, 4))).shape
        ((8, 2), (8, 2))
        """
        for m in modules:
            if not isinstance(m, nnx.Module):
                raise RegionTypeError(f"ms.jit region {self.name!r}: bind takes nnx Modules/Cells, got "
                                      f"{type(m).__name__}; pass data arguments when calling the bound region.")
        return BoundRegion(self, modules)

    def _finish(self, comp, modules, states, outs):
        n_changed = len(comp.changed)
        user, written = outs[:len(outs) - n_changed], outs[len(outs) - n_changed:]
        if n_changed:
            new_by_index = dict(zip(comp.changed, written))
            off = 0
            for m, s in zip(modules, states):
                leaves, tree = jax.tree.flatten(s)
                idx = range(off, off + len(leaves))
                off += len(leaves)
                if any(i in new_by_index for i in idx):
                    new = [new_by_index.get(i, x) for i, x in zip(idx, leaves)]
                    nnx.update(m, jax.tree.unflatten(tree, new))
        out_tree = comp.out_tree
        # out_tree is (user_out, [state leaves]); rebuild the user part
        user_tree = out_tree.children()[0]
        return jax.tree.unflatten(user_tree, list(user))

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """``jax.stages.Lowered`` of this region for these arguments (``.compile().as_text()`` gives HLO)."""
        comp, _, states, flat_data = self._prepare(args, kwargs)
        leaves = [x for s in states for x in jax.tree.leaves(s)]
        n = len(leaves)
        placed = [x if isinstance(x, jax.Array) and x.committed and x.sharding == sh
                  else jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for x, sh in zip(leaves, comp.in_shardings)]
        return comp.jitted.lower(*placed, *[_as_called(x, sh) for x, sh in zip(flat_data, comp.in_shardings[n:])])

    def place(self, *args) -> None:
        """Put the module arguments' variables on their planned shardings (plans for these arguments; runs
        nothing). ``ms.load_checkpoint(..., inputs=...)`` restores into these layouts."""
        comp, modules, states, _ = self._prepare(args, {})
        self._place(comp, modules, states)

    def param_shardings(self, *args) -> dict[str, NamedSharding]:
        """The planned sharding of every module variable for these arguments, by parameter path."""
        comp = self._prepare(args, {})[0]
        return {info.name: sh for info, sh in zip(comp.infos, comp.in_shardings) if info.kind == "param"}

    def layouts(self, *args) -> RegionLayouts:
        """The planned layouts (mesh, inputs, marks) for these arguments (traces, does not run)."""
        return self._prepare(args, {})[0].layouts

    def state_bytes(self, *args) -> dict[str, float]:
        """Bytes per device of every state input (the modules' Variables, by name) in its planned layout (traces
        and plans, does not run)."""
        comp = self._prepare(args, {})[0]
        mesh = comp.layouts.mesh
        out = {}
        for info, lay in zip(comp.infos, comp.layouts.inputs, strict=True):
            if info.kind != "param":
                continue
            aval = next(v.aval for v, i in zip(comp.closed.jaxpr.invars, comp.infos) if i is info)
            split = math.prod(mesh.count(tuple(d)) for d in lay if d) if lay else 1
            out[info.name] = math.prod(info.shape) * aval.dtype.itemsize / split
        return out

    def plan(self, *args):
        """The Plan for these arguments (traced and planned, not run): the plan the region runs, in every mode
        (data_parallel and stand_alone: MindSpore's data-parallel plan on every device / on one)."""
        return self._prepare(args, {})[0].plan

    def jaxpr(self, *args):
        return self._prepare(args, {})[0].closed


class BoundRegion:
    """A region with its module arguments bound (:meth:`Region.bind`). With ``check_structure`` (the unbound
    call of ``ms.shard(module)``), each call first checks the modules' :func:`graph_structure` against the one
    the fast path was built on, so a Variable or sub-module assigned between calls is seen."""

    def __init__(self, region: Region, modules: tuple, check_structure: bool = False):
        self.region, self.modules = region, tuple(modules)
        self.check_structure = check_structure
        self._fast: Callable | None = None
        self._structure: list | None = None

    def __call__(self, *data):
        out = self.call_fast(data)
        if out is not MISS:
            return out
        out = self.region(*self.modules, *data)
        self._fast = self._build_fast(data)
        if self.check_structure and self._fast is not None:
            self._structure = graph_structure(self.modules)
        return out

    def call_fast(self, data: tuple):
        """The fast path's result, or ``MISS`` where the call must go through the region."""
        fast = self._fast
        if fast is None:
            return MISS
        if self.check_structure and not same_structure(self._structure):
            self._fast = None
            return MISS
        return fast(data)

    def _build_fast(self, data: tuple) -> Callable | None:
        return self.region.fast_path((*self.modules, *data), self.modules, data)




def _as_called(x: Any, sh: NamedSharding) -> Any:
    """What :meth:`Region.lower` passes for one data input: the value a call passes to the program where that is
    the value itself (an uncommitted array or, on one process, a host value, both taken as they are:
    :func:`~mshard._src.runtime.fastcall.follow_plan`; an array already on its planned sharding), else its shape and dtype on
    the planned sharding (what the call reshards it to). jax.jit compiles an uncommitted argument and a committed
    one apart, so lowering with the call's values gives the program the call compiled: ``.compile()`` after a call
    (``ms.comm_report``, ``memory_analysis``) is a cache hit, not a second compile of the whole program."""
    if isinstance(x, jax.Array):
        if not x.committed or x.sharding == sh:
            return x
    elif isinstance(x, np.ndarray | np.generic) and jax.process_count() == 1:
        return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)


def _put(x, sh):
    """``jax.device_put`` that also places an uncommitted PRNG key array on a sharding other processes share
    (device_put refuses key arrays there: their key data is placed and wrapped again)."""
    if jax.process_count() > 1 and jnp.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        return jax.random.wrap_key_data(jax.device_put(jax.random.key_data(x), sh), impl=jax.random.key_impl(x))
    return jax.device_put(x, sh)


# what JAX says of out_sharding= / a PartitionSpec used outside an Explicit mesh
_EXPLICIT_ONLY = ("cannot contain axis names that are of type Auto", "not under a mesh context")


def _annotated_specs(states, param_names, n_state: int) -> list:
    """Each state leaf's flax-annotated spec (None: replicated), typing it in an explicit trace."""
    try:
        plans = {nm: sh.spec for _, nm, sh in annotated_plans(states, param_names)}
    except ParameterPlanError:
        plans = {}
    return [plans.get(nm) for nm in param_names[:n_state]]


def _annotated_mesh(states, param_names):
    """The mesh the parameters' flax annotations are on, or None."""
    try:
        plans = annotated_plans(states, param_names)
    except ParameterPlanError:
        return None
    return next((sh.mesh for _, _, sh in plans if isinstance(sh.mesh, jax.sharding.Mesh)), None)


def _module_classes(graphdefs) -> set:
    """The nnx Module classes in these graphdefs (for :class:`annotate.module_scopes`)."""
    return {n.type for g in graphdefs for n in getattr(g, "nodes", ()) or ()
            if isinstance(getattr(n, "type", None), type) and issubclass(n.type, nnx.Module)}


def _check_training_settings(name: str, ctx, written: list[str], pipelined: bool = False, zero: bool = False) -> None:
    """A region that writes parameters is a training step written by hand (``ms.jit`` of value_and_grad + an
    optimizer update). The context's optimizer-parallel setting is applied by ``TrainOneStepCell``, which plans the
    step around it, unless an optimizer Cell applied it while the step was traced (``zero``,
    mshard._src.frontend.functional_zero), and so is ``pipeline_stages`` unless the step ran a PipelineCell's
    schedule (``pipelined``: a PipelineCell differentiated inside ``ms.jit``, mshard._src.training.pipeline.cells);
    such a hand-written step would silently ignore them, so it is refused. So is host offload
    (``set_offload_context``), in every mode: only TrainOneStepCell keeps the optimizer state in host memory."""
    where = f"ms.jit region {name!r} updates parameters ({', '.join(written[:3])}{', ...' if len(written) > 3 else ''})"
    if written and ctx.offload_config.get("offload_param") == "cpu":
        raise ContextError(
            f"{where}: a training step written by hand, but set_offload_context(offload_config={{'offload_param': "
            f"'cpu'}}) keeps the optimizer state in host memory only in nn.TrainOneStepCell. Train with "
            f"nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer), or set "
            f"set_offload_context(offload_config={{'offload_param': ''}}) for this step.")
    if not written or ctx.parallel_mode == "stand_alone":
        return
    asked = [f"{k}={v!r}" for k, v, on in (("pipeline_stages", ctx.pipeline_stages,
                                            ctx.pipeline_stages > 1 and not pipelined),
                                         ("enable_parallel_optimizer", ctx.enable_parallel_optimizer,
                                          ctx.enable_parallel_optimizer and not zero)) if on]
    if asked:
        raise ContextError(
            f"{where}: a training step written by hand, but the context's {' and '.join(asked)} is not applied to it. "
            f"Train with nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer) (nn.PipelineCell for "
            f"stages); or, in a hand-written step, update with an mshard optimizer Cell (nn.Momentum(...)(grads), "
            f"which applies optimizer parallel) and differentiate a Pipeline cell (which runs the stages); or set "
            f"{' and '.join(a.split('=')[0] + '=' + ('1' if a.startswith('pipeline') else 'False') for a in asked)} "
            f"for this step.")


def search_algorithm(ctx) -> str | None:
    """The searcher a region uses under ``ctx``, or None for the user-strategy path (docs/design.md §3)."""
    if ctx.parallel_mode == "auto_parallel":
        return ctx.search_mode
    if ctx.parallel_mode == "semi_auto_parallel":
        if ctx.search_mode_explicit and ctx.search_mode == "sharding_propagation":
            return "sharding_propagation"
        return "follow_operands"    # the user's strategies, and every other op in the layout its operands arrive in
    return None


def jit(fn: Callable) -> Region:
    """The jitted region: ``ms.jit(fn)(*args)``; cached per (shapes, dtypes, context).

    MindSpore's ``jit``: the call is traced, planned under the current parallel context (the cells' strategies,
    or a search in auto modes) and compiled once per (shapes, dtypes, context). nnx Module arguments are
    parameters (placed once, updated after the call), array arguments are data, other leaves static.

    Args:
        fn: the function to jit, or a :class:`Region` (returned as it is).

    Returns:
        The :class:`Region` of ``fn``: call it like ``fn``; ``.lower(*args)``, ``.plan(*args)`` inspect it.

    >>> import jax.numpy as jnp, mshard as ms
    >>> ms.jit(lambda a, b: a @ b).lower(jnp.ones((8, 4)), jnp.ones((4, 2))).compile() is not None
    True
    """
    return fn if isinstance(fn, Region) else Region(fn)
