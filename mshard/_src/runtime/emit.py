"""Re-emit a traced region with its planned layouts.

The jaxpr is evaluated primitive by primitive (as ``jax.core.eval_jaxpr`` does); each
``mshard_mark`` becomes ``jax.lax.with_sharding_constraint`` to its planned layout, or nothing.
With a searched plan (``eqn_out``/``eqn_in``), every op's results are constrained to the plan's
layouts, and its operands where the plan redistributes them: from the layout the operand is known
to have (its producer's constraint, or the region input's planned layout) by
:func:`~mshard._src.runtime.redistribute.redistribute`, which runs the direct collectives where XLA's
partitioner would move more bytes.

Nested jaxprs: call-like eqns (jit/pjit, custom_jvp/vjp, closed_call) are inlined when their body
holds marks or planned ops — the same structure :mod:`mshard._src.jaxpr.op_graph` walks — so a custom JVP/VJP
rule inside a region is replaced by differentiation of its body if the region itself is
differentiated from outside. checkpoint/remat bodies, and scan/while/cond bodies holding marks,
are rebuilt with re-emitted bodies, keeping remat. Everything else is bound unchanged, so XLA
sees the user's program plus the constraints, and its SPMD partitioner inserts the collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from mshard._src.jaxpr.marks import mark_p
from mshard._src.jaxpr.walk import CALLS, REMAT, eval_jaxpr, jaxpr_params
from mshard._src.jaxpr.walk import has_marks as _has_marks
from mshard._src.planning.axis_assignment import RegionLayouts, exact_mark_key, mark_key
from mshard._src.runtime import partial_sums
from mshard._src.runtime.redistribute import redistribute
from mshard._src.values.layout import dims_of, jax_mesh, replica_layout, spec_of

INLINE = frozenset(CALLS) - REMAT     # inlined where the body holds marks or planned ops
REBUILD = REMAT                       # kept, around their re-emitted body, so the recomputation survives
# the control flow whose planned bodies (planning/scan_bodies.py) are re-emitted with their layouts: the param
BRANCHED = {"while": "body_jaxpr", "cond": "branches"}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


class Emitter:
    def __init__(self, layouts: RegionLayouts, eqn_out: dict | None = None, eqn_in: dict | None = None,
                 eqn_scatter: dict | None = None, eqn_joined: dict | None = None, bodies: dict | None = None):
        self.layouts = layouts
        self.mesh = jax_mesh(layouts.mesh)
        self.eqn_out = eqn_out or {}
        self.eqn_in = eqn_in or {}
        self.eqn_scatter = eqn_scatter or {}  # key -> the layout a partial result is reduce-scattered to
        self._summed: dict[int, tuple] = {}   # id(Stacked) -> (it, its sum): one collective however many read it
        self.planned = bool(eqn_out)
        self._laid: dict[int, tuple] = {}     # id(value) -> (value, the layout it was constrained to)
        # id(value) -> (value, its layout, the layout its readers take): a scanned slice moved where it is read
        self._deferred: dict[int, tuple] = {}
        self._undeferred: dict[int, tuple] = {}     # id(value) -> (value, it moved): one move however many read it
        self._partial_roles: dict[int, tuple] = {}  # id(eqn) -> (eqn, its role in a sum of partial sums: partial_sums)
        # key -> role of the equations whose partial sums a concatenate joins (mshard._src.planning.joined_sums)
        self.eqn_joined = eqn_joined or {}
        # the path inside a scan body the plan laid out -> (the layouts it reads its inputs in, leaves its results in)
        self.bodies = bodies or {}

    def wsc(self, x, lay):
        if lay is None or not hasattr(x, "shape") or len(lay) != len(x.shape):
            return x
        return self._known(jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec_of(lay))), lay)

    def _known(self, x, lay):
        self._laid[id(x)] = (x, lay)
        return x

    def move(self, x, lay):
        """``x`` read by an op in layout ``lay``: where the layout ``x`` was constrained to is known, the change runs
        as :func:`~mshard._src.runtime.redistribute.redistribute` chooses (its direct collectives where XLA's
        partitioner would move more), else as a constraint XLA realises."""
        seen = self._laid.get(id(x))
        if seen is None or seen[0] is not x or lay is None or not hasattr(x, "shape") or len(lay) != len(x.shape):
            return self.wsc(x, lay)
        return self._known(redistribute(x, seen[1], lay, self.layouts.mesh), lay)

    def defer(self, x, src, dst):
        """``x``, in layout ``src``, is moved to ``dst`` where an op reads it (inside a remat body it reaches)."""
        x = self.wsc(x, src)
        self._deferred[id(x)] = (x, src, dst)
        return x

    def _undefer(self, x):
        d = self._deferred.get(id(x))
        if d is None or d[0] is not x:
            return x
        done = self._undeferred.get(id(x))
        if done is None or done[0] is not x:
            done = self._undeferred[id(x)] = (x, self.move(x, d[2]))
        return done[1]

    def _deferred_at(self, invals) -> dict[int, tuple]:
        out = {}
        for j, x in enumerate(invals):
            d = self._deferred.get(id(x))
            if d is not None and d[0] is x:
                out[j] = d[1:3]
        return out

    def _scan_slices(self, params, invals, ins: list, path: tuple):
        """A scanned operand the plan moves to a layout that, like the one it is stored in, keeps the scanned dim
        whole: the change is made on each step's slice where the loop body reads it (inside the body's remat
        call, if it has one, so that the recomputation repeats it rather than saving its result), and its
        transpose, the gradient's change, on each step's slice too. The collectives move the bytes of the whole
        stack's change, and one slice is held in the new layout at a time: FSDP over a scan of layers gathers one
        layer's weights at a time. -> (params, ins) with those operands left in their stored layout."""
        n0 = params["num_consts"] + params["num_carry"]
        slices = {}
        for i in range(n0, len(invals)):
            seen, dst = self._laid.get(id(invals[i])), ins[i]
            if seen is None or seen[0] is not invals[i] or dst is None or len(dst) != len(seen[1]):
                continue
            src = tuple(tuple(d) for d in seen[1])
            dst = tuple(tuple(d) for d in dst)
            if src != dst and not src[0] and not dst[0]:
                slices[i] = (src[1:], dst[1:])
                ins[i] = None
        if slices or path in self.bodies:     # a planned body: re-emitted with its own layouts
            params = dict(params, jaxpr=self.rewrite(params["jaxpr"], path, slices, self.bodies.get(path)))
        return params, ins

    def _shard_map_ins(self, params, invals) -> list | None:
        """A ``shard_map`` manual over every axis of the region mesh (a gradient bucket): each operand moved into its
        ``in_specs`` as :meth:`move` moves it (the direct collectives where XLA's own change at the boundary moves
        more, as the plan prices a move into a ``shard_map``'s inputs); None for any other ``shard_map`` (manual over
        some axes only, as a pipeline's, or on another mesh), whose operands XLA moves at its boundary."""
        mesh = self.layouts.mesh
        try:
            shape = dict(params["mesh"].shape)
        except (AttributeError, KeyError, TypeError):
            return None
        manual = set(params.get("newly_manual_axes") or params.get("axis_names") or ())
        if tuple(shape) != tuple(mesh.names) or tuple(shape.values()) != tuple(mesh.shape) or manual != set(shape):
            return None
        return [dims_of(spec, len(x.shape)) if hasattr(x, "shape") else None
                for spec, x in zip(params["in_specs"], invals)]

    def eval(self, jaxpr: jcore.Jaxpr, consts, *args, path: tuple = ()):
        if self.planned:
            roles = partial_sums.partial_sum_pairs(jaxpr)
            for e in jaxpr.eqns:      # a jaxpr inlined at several places: the joined roles are this place's
                role = self.eqn_joined.get((path, id(e))) or roles.get(id(e))
                if role is None:
                    self._partial_roles.pop(id(e), None)
                else:
                    self._partial_roles[id(e)] = (e, role)
        outs = eval_jaxpr(jaxpr, consts, args, lambda eqn, invals: self.eqn(eqn, invals, path))
        return [self._materialize(x) for x in outs]

    def _layout_of(self, x, planned):
        if planned is not None:
            return tuple(tuple(d) for d in planned)
        seen = self._laid.get(id(x))
        return None if seen is None or seen[0] is not x else tuple(tuple(d) for d in seen[1])

    def _materialize(self, x):
        """A :class:`~mshard._src.runtime.partial_sums.Stacked` partial sum summed (one all-reduce), constrained to
        the layout the plan gave the sum, or to its parts' layout."""
        if not isinstance(x, partial_sums.Stacked):
            return x
        done = self._summed.get(id(x))
        if done is None or done[0] is not x:
            done = self._summed[id(x)] = (x, self.wsc(partial_sums.materialize(x, self.layouts.mesh),
                                                      x.layout if x.target is None else x.target))
        return done[1]

    def _partial(self, eqn, invals, key):
        """An op of a sum of partial sums (:mod:`~mshard._src.runtime.partial_sums`): its parts per device, or
        None to bind it as traced."""
        seen = self._partial_roles.get(id(eqn))
        role = seen[1] if seen is not None and seen[0] is eqn else None
        stacked = [isinstance(x, partial_sums.Stacked) for x in invals]
        if role == "root" and not any(stacked):
            # the operand a gather's transpose adds into: zeros, whole
            lays = self._operand_layouts(invals, key, whole_first=eqn.primitive.name == "scatter-add")
            if lays is None:
                return None
            return partial_sums.local_partial(eqn, invals, lays, self.layouts.mesh)
        if role == "chain" and stacked == [True]:
            return partial_sums.chain_op(eqn, invals[0], (self.eqn_out.get(key) or [None])[0])
        if role == "concat" and all(stacked):     # the put-back of copies' partial sums (joined_sums)
            return partial_sums.concatenate(eqn, invals, (self.eqn_out.get(key) or [None])[0],
                                            self.eqn_scatter.get(key))
        if role == "sum" and all(stacked) and len(invals) == 2:
            out = partial_sums.add(*invals)
            sum_lay = (self.eqn_out.get(key) or [None])[0]
            if out is not None and sum_lay is not None:
                out = dataclasses.replace(out, target=tuple(tuple(d) for d in sum_lay))
            return out
        return None

    def _operand_layouts(self, invals, key, whole_first: bool = False) -> list | None:
        """The layouts an equation reads its operands in (planned, or as they were constrained); None where one is
        unknown. ``whole_first``: an unknown first operand is taken whole."""
        ins = self.eqn_in.get(key) or [None] * len(invals)
        lays = [self._layout_of(x, lay) if hasattr(x, "shape") else None for x, lay in zip(invals, ins)]
        if whole_first and lays[0] is None and hasattr(invals[0], "shape"):
            lays[0] = ((),) * len(invals[0].shape)
        return None if any(lay is None or len(lay) != len(x.shape) for x, lay in zip(invals, lays)) else lays

    def _scattered(self, eqn, invals, key, target):
        """An op whose partial result the plan reduce-scatters into ``target`` (``scattered_sums``): computed per
        device as a :class:`~mshard._src.runtime.partial_sums.Stacked` that its first reader sums; None to bind
        it as traced (its operands' layouts unknown, or its parts not laid out as the plan has them)."""
        lays = self._operand_layouts(invals, key)
        if lays is None:
            return None
        invals = [self.move(x, lay) for x, lay in zip(invals, lays)]
        part = partial_sums.local_partial(eqn, invals, lays, self.layouts.mesh)
        target = tuple(tuple(d) for d in target)
        if part is None or partial_sums.scattered_dims(part.layout, target, part.axes) is None:
            return None
        return dataclasses.replace(part, target=target)

    def eqn(self, eqn, invals, path: tuple):
        prim = eqn.primitive
        if self._partial_roles or any(isinstance(x, partial_sums.Stacked) for x in invals):
            part = self._partial(eqn, invals, (path, id(eqn)))
            if part is not None:
                return part
            invals = [self._materialize(x) for x in invals]
        if (target := self.eqn_scatter.get((path, id(eqn)))) is not None:
            part = self._scattered(eqn, invals, (path, id(eqn)), target)
            if part is not None:
                return part
        if prim is mark_p:
            if not self.layouts.honour_marks:
                return invals[0]
            lay = self.layouts.marks.get(exact_mark_key(eqn), self.layouts.marks.get(mark_key(eqn)))
            first = self.layouts.staged.get(exact_mark_key(eqn))
            if eqn.params.get("bdim") is not None:
                lay, first = (replica_layout(x, eqn.params["bdim"], eqn.params["replica_axes"])
                              if x is not None and len(x) == len(invals[0].shape) - 1 else x for x in (lay, first))
            x = self._undefer(invals[0])
            x = x if first is None else self.move(x, first)
            return self.move(x, lay)
        params = eqn.params
        deferred = self._deferred_at(invals)
        # a shard_map is a fixed boundary of the plan (mshard._src.jaxpr.op_graph): its body (manual axes, e.g. a pipeline's
        # stages) is bound as traced, only its operands and results are constrained
        has = prim.name != "shard_map" and (self.planned or any(_has_marks(j) for j in jaxpr_params(params)))
        inner = path + (id(eqn),)
        if has and prim.name in INLINE:
            body = params[CALLS[prim.name]]
            if isinstance(body, jcore.ClosedJaxpr):
                return self.eval(body.jaxpr, body.consts, *invals, path=inner)
            return self.eval(body, (), *invals, path=inner)
        if deferred and prim.name in REBUILD:        # the slice's move is made inside the recomputed body
            params = {k: self.rewrite(v, inner, deferred) for k, v in params.items()}
        else:
            invals = [self._undefer(x) for x in invals] if deferred else invals
            if prim.name in BRANCHED and inner in self.bodies:     # a planned while body or cond's branches
                params = dict(params, **{BRANCHED[prim.name]: self.rewrite(params[BRANCHED[prim.name]], inner,
                                                                            body=self.bodies[inner])})
                if (*inner, "cond") in self.bodies:                # a planned while's condition
                    params["cond_jaxpr"] = self.rewrite(params["cond_jaxpr"], inner,
                                                        body=self.bodies[(*inner, "cond")])
            elif has and (prim.name in REBUILD or any(_has_marks(j) for j in jaxpr_params(params))):
                params = {k: self.rewrite(v, inner) for k, v in params.items()}
        key = (path, id(eqn))
        ins = self.eqn_in.get(key)
        if prim.name == "scan" and (ins is not None or inner in self.bodies):
            params, ins = self._scan_slices(params, invals, list(ins or [None] * len(invals)), inner)
        if ins is None and prim.name == "shard_map" and self.planned:
            ins = self._shard_map_ins(params, invals)
        if ins is not None:
            invals = [self.move(x, lay) for x, lay in zip(invals, ins)]
        scope = str(eqn.source_info.name_stack)
        with jax.named_scope(scope) if scope else _null(), eqn.ctx.manager:
            out = prim.bind(*invals, **prim.get_bind_params(params))
        outs_lay = self.eqn_out.get(key)
        if outs_lay is None and prim.name == "pad" and self.planned:
            # a pad the plan leaves free (computed from constants alone: the transpose of a strided slice of a sum's
            # ones) is held whole and its readers slice it locally: constrained split on a padded dim at once, XLA's
            # partitioner fails its HLO verifier (docs/xla_repro/r15_pad_of_constant_split.py)
            out = self.wsc(out, ((),) * len(out.shape))
        if outs_lay is not None and prim.name == "scan":
            outs_lay = _stacked_results_free(outs_lay, params["num_carry"])
        if outs_lay is not None:
            if prim.multiple_results:
                out = [self.wsc(x, lay) for x, lay in zip(out, outs_lay)]
            else:
                out = self.wsc(out, outs_lay[0])
        return out

    def rewrite(self, v, path: tuple, defer: dict | None = None, body: tuple | None = None):
        """A jaxpr param -> the same jaxpr with marks/planned ops re-emitted with constraints; ``defer``: invar
        index -> (its layout, the layout its readers take), a move made where the body reads it; ``body``: (the
        layouts its inputs arrive in, the layouts its results are left in), a planned scan body's."""
        if isinstance(v, (tuple, list)):
            return type(v)(self.rewrite(x, path, defer, body) for x in v)

        def fn(jaxpr, consts):
            def run(*a):
                a = [self.defer(x, *defer[i]) if defer and i in defer
                     else self.wsc(x, body[0][i]) if body is not None else x for i, x in enumerate(a)]
                res = self.eval(jaxpr, consts, *a, path=path)
                return res if body is None else [self.move(x, lay) for x, lay in zip(res, body[1], strict=True)]
            return run
        if isinstance(v, jcore.ClosedJaxpr):
            avals = [x.aval for x in v.jaxpr.invars]
            return jax.make_jaxpr(fn(v.jaxpr, v.consts))(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
        if isinstance(v, jcore.Jaxpr):
            avals = [x.aval for x in v.invars]
            closed = jax.make_jaxpr(fn(v, ()))(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals])
            if closed.consts:
                raise NotImplementedError("mshard: a re-emitted open jaxpr gained constants")
            return closed.jaxpr
        return v


def _stacked_results_free(outs_lay, num_carry: int) -> list:
    """A scan's stacked results that the plan has whole are left to XLA, which lays them out as their readers
    ask (the scan's rule, :func:`mshard._src.jaxpr.rules.scan_carry_rule`, keeps them whole): a planned body leaves
    each step's slice where its readers read it (``bodies``), and a gradient stack of a scan over layers is then
    reduced one layer at a time inside the loop, instead of stacked whole first."""
    return [None if j >= num_carry and lay is not None and not any(lay) else lay for j, lay in enumerate(outs_lay)]


def emit(closed: jcore.ClosedJaxpr, layouts: RegionLayouts, eqn_out: dict | None = None,
         eqn_in: dict | None = None, eqn_scatter: dict | None = None, eqn_joined: dict | None = None,
         bodies: dict | None = None) -> Callable[..., list]:
    """A function of the region's flat inputs that evaluates ``closed`` with planned constraints."""
    em = Emitter(layouts, eqn_out, eqn_in, eqn_scatter, eqn_joined, bodies)

    def run(*args):
        em._laid.clear()
        em._deferred.clear()
        em._undeferred.clear()
        try:
            if len(args) == len(layouts.inputs):       # the inputs arrive in their planned layouts (in_shardings)
                args = [em._known(x, lay) if lay is not None and hasattr(x, "shape") and len(lay) == len(x.shape)
                        else x for x, lay in zip(args, layouts.inputs, strict=True)]
            return em.eval(closed.jaxpr, closed.consts, *args)
        finally:
            em._laid.clear()        # the trace's values are not kept alive past it
            em._deferred.clear()
            em._undeferred.clear()
            em._summed.clear()
            em._partial_roles.clear()   # found again per traced body (a rebuilt remat body is a new jaxpr each trace)
    return run
