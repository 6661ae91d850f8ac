"""Trace a jaxpr into a :class:`searchers.Graph` of iteration-space ops.

:func:`jaxpr_to_graph` walks a closed jaxpr in program order:

* every region input becomes a source op of the kind the caller gives (``data``/``param``/
  ``const``), every closed-over constant and every literal operand a ``const`` source op;
* every equation becomes one op whose iteration space comes from :mod:`mshard._src.jaxpr.rules`
  (unknown primitives get the safe default and a one-time warning); its ``kind`` is the
  primitive name (``mshard_mark`` markers included, as elementwise identity ops);
* equations of the primitives in :data:`mshard._src.jaxpr.rules.INLINE` (``jit``, ``custom_jvp_call``,
  ``custom_vjp_call``, ``remat2``, ...) are not ops: their sub-jaxpr is walked in their place,
  its inputs bound to the outer operands' tensors and the outer results to its results' tensors.
  ``scan``/``while``/``cond`` stay one op each (see :mod:`mshard._src.jaxpr.rules`);
* layouts the program states itself are fixed ops on the region mesh (when their mesh is it: same
  axis names and sizes): a ``sharding_constraint`` op is fixed to its sharding; a ``shard_map`` is
  not an op but its boundary -- each operand flows into a fixed sink op ``<name>/in<i>`` (its
  ``in_specs`` layout, what the shard_map will reshard it to) and each result comes from a fixed
  source ``<name>/out<j>`` (its ``out_specs``), so a search prices the redistribution around it
  and never asks for another layout of its results.

Op names follow docs/design.md §2, ``scope/primitive`` where scope is the equation's name stack
(for an inlined equation the enclosing equation's name stack, then its own); a name already
taken gets ``_1``, ``_2``, ... in program order. Literal sources are named
``<consumer op name>/literal<operand index>``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend import core as jcore  # Literal, Jaxpr, ClosedJaxpr

from mshard._src.jaxpr import rules
from mshard._src.values.errors import PlanError
from searchers import DeviceMesh, Graph
from searchers.graph import strategy_of_layout

__all__ = ["TraceResult", "TracedEqn", "jaxpr_to_graph"]


@dataclass(frozen=True)
class TracedEqn:
    """One equation that became an op. ``path``: the inlined equations enclosing it, outermost
    first (``()`` for a top-level equation). ``inputs``/``outputs``: its op's tensor ids."""

    eqn: Any
    op: int
    name: str
    path: tuple[Any, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    group: tuple[Any, ...] = ()     # a primitive object traced as one op: its marks and body eqns (eqn: 1st mark)

    @property
    def primitive(self) -> str:
        return self.eqn.primitive.name


@dataclass
class TraceResult:
    """The graph of a traced region and the way back from it to the jaxpr.

    ``var_tensor`` maps every jaxpr ``Var`` (by identity; the inner vars of inlined sub-jaxprs
    included) to its tensor id. A sub-jaxpr inlined at several places (a shared ``jit``) maps
    its inner vars to the tensors of the last place; :attr:`eqns` is exact for every place.
    """

    graph: Graph
    closed_jaxpr: Any
    var_tensor: dict[Any, int]
    eqns: list[TracedEqn]                       # program order, one per op from an equation
    input_ops: list[int]                        # source op id of each jaxpr input
    const_ops: list[int] = field(default_factory=list)   # source op id of each closed-over const
    _by_eqn: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def tensor_of(self, var) -> int:
        """Tensor id of a jaxpr ``Var``."""
        return self.var_tensor[var]

    def ops_of(self, eqn) -> list[int]:
        """Op ids of an equation (by identity), one per place it was traced."""
        return [self.eqns[i].op for i in self._by_eqn.get(id(eqn), [])]

    def op_of(self, eqn) -> int:
        """Op id of the first (program order) place an equation was traced."""
        ops = self.ops_of(eqn)
        if not ops:
            raise KeyError(f"equation {eqn.primitive.name} was not traced (inlined or foreign)")
        return ops[0]

    @property
    def marks(self) -> list[TracedEqn]:
        """The ``mshard_mark`` equations, in program order."""
        return [t for t in self.eqns if t.primitive == "mshard_mark"]


def _shape(aval) -> tuple[int, ...]:
    return tuple(int(n) for n in getattr(aval, "shape", ()))


def _itemsize(aval) -> int:
    try:
        return int(np.dtype(aval.dtype).itemsize)
    except Exception:
        return 4


class _Namer:
    """Unique op names: the first use of a name keeps it, later ones get ``_1``, ``_2``, ..."""

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self.used: set[str] = set()

    def __call__(self, name: str) -> str:
        n = self.count.get(name, 0)
        out = name if n == 0 else f"{name}_{n}"
        while out in self.used:
            n += 1
            out = f"{name}_{n}"
        self.count[name] = n + 1
        self.used.add(out)
        return out


def _spec_strategy(spec, rank: int, axis: dict[str, int]) -> tuple[tuple[int, ...], ...] | None:
    """A PartitionSpec as per-dim mesh-axis indices (``None`` if it names an axis not in ``axis``)."""
    out: list[tuple[int, ...]] = []
    for entry in tuple(spec) + (None,) * (rank - len(tuple(spec))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if any(n not in axis for n in names):
            return None
        out.append(tuple(axis[n] for n in names))
    return tuple(out[:rank])


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class _NotAGroup(Exception):
    pass


REPLICA = "_r"      # the loop dim of a primitive object's data-parallel replicas (marks batched by jax.vmap)
REDUCE_OF = {"reduce_max": "max", "reduce_min": "min", "reduce_prod": "prod", "argmax": "max", "argmin": "min"}


def _last_uses(jaxpr) -> dict[Any, int]:
    """var -> index of the last eqn reading it (``len(eqns)`` for a jaxpr result)."""
    last: dict[Any, int] = {}
    for k, e in enumerate(jaxpr.eqns):
        for v in e.invars:
            if not isinstance(v, jcore.Literal):
                last[v] = k
    for v in jaxpr.outvars:
        if not isinstance(v, jcore.Literal):
            last[v] = len(jaxpr.eqns)
    return last


def _group_end(jaxpr, start: int, last: dict[Any, int]) -> int | None:
    """If eqn ``start`` opens a primitive object's group (its input marks, the body, its output marks, as
    ``annotate_call`` traces them), the index after the group; None where the group is not self-contained:
    no out_strategy (its redistribution stays a mark of its own), every input marked before the body, the body
    reading only the group's values and the jaxpr's constants, nothing but its marks read after it."""
    eqns = jaxpr.eqns
    first = eqns[start]
    note = first.params["note"]
    if note.in_dims is None or note.as_traced or first.params["role"] != "in" or any(note.out_strategy or ()):
        return None
    n_in, n_out = len(note.in_dims), len(note.out_dims)
    seen_in: set[int] = set()
    seen_out: set[int] = set()
    inside: set[Any] = set()
    allowed = set(jaxpr.constvars)
    for k in range(start, len(eqns)):
        e = eqns[k]
        is_mark = e.primitive.name == "mshard_mark"
        if is_mark and e.params["note"] is note:
            role, idx = e.params["role"], e.params["index"]
            if role == "in" and idx not in seen_in and not seen_out and len(inside) == len(seen_in):
                seen_in.add(idx)
            elif role == "out" and len(seen_in) == n_in and idx not in seen_out:
                if e.invars[0] not in inside:
                    return None
                seen_out.add(idx)
            else:
                return None
        elif is_mark or len(seen_in) < n_in or seen_out:
            return None                    # another annotated op inside, a body before every input is marked
        elif any(not isinstance(v, jcore.Literal) and v not in inside and v not in allowed for v in e.invars):
            return None
        if not (is_mark and e.params["role"] == "out"):
            inside.update(e.outvars)
        if len(seen_out) == n_out:
            marks = {v for q in eqns[start:k + 1] if q.primitive.name == "mshard_mark" for v in q.outvars}
            if any(last.get(v, -1) > k for v in inside if v not in marks):
                return None                # a body value read after the group (marked operands may be: residuals)
            return k + 1
    return None


class _GraphBuilder:
    def __init__(self, mesh: DeviceMesh, primitives: bool = False) -> None:
        self.primitives = primitives       # trace each primitive object as one op (see group)
        self.graph = Graph(mesh)
        self.names = _Namer()
        self.var_tensor: dict[Any, int] = {}
        self.eqns: list[TracedEqn] = []
        self.by_eqn: dict[int, list[int]] = {}
        self.axis = dict(zip(mesh.names, range(len(mesh.shape))))
        # split counts a strategy can give a loop dim: products of subsets of the mesh axes
        counts = {1}
        for n in mesh.shape:
            counts |= {c * n for c in counts}
        self.split_counts = sorted(counts)

    # -- sources ------------------------------------------------------------------------------
    def source(self, name: str, aval, kind: str) -> int:
        return self.graph.source(self.names(name), _shape(aval), kind=kind, itemsize=_itemsize(aval))

    def read(self, v, env: dict, consumer: str, index: int) -> int:
        if isinstance(v, jcore.Literal):
            return self.source(f"{consumer}/literal{index}", v.aval, "const")
        return env[v]

    # -- equations ----------------------------------------------------------------------------
    def walk(self, jaxpr, env: dict, scope: str, path: tuple) -> None:
        eqns = jaxpr.eqns
        last = _last_uses(jaxpr) if self.primitives else {}
        k = 0
        while k < len(eqns):
            eqn = eqns[k]
            eqn_scope = _join(scope, str(eqn.source_info.name_stack))
            end = _group_end(jaxpr, k, last) if self.primitives and eqn.primitive.name == "mshard_mark" else None
            if end is not None and self.group(eqns[k:end], env, eqn_scope, path,
                                              lambda v, end=end: last.get(v, -1) >= end):
                k = end
                continue
            sub = self.inlinable(eqn)
            if sub is not None:
                self.inline(eqn, sub, env, eqn_scope, path)
            else:
                self.op(eqn, env, eqn_scope, path)
            k += 1

    def group(self, eqns, env: dict, scope: str, path: tuple, later=lambda v: True) -> bool:
        """A primitive object as one op (MindSpore's operator): its iteration space is the object's own (the
        note's loop dims, with the dims it cannot split unsplittable), its operands the tensors its input marks
        receive and its results its output marks'; the body between them is left to XLA. A mark batched over
        data-parallel replicas has the replica dim as loop dim ``_r`` at its ``bdim``."""
        note = eqns[0].params["note"]
        marks = {(e.params["role"], e.params["index"]): e for e in eqns if e.primitive.name == "mshard_mark"}
        ins = [marks[("in", i)] for i in range(len(note.in_dims))]
        outs = [marks[("out", j)] for j in range(len(note.out_dims))]
        dims: dict[str, int] = {}
        limit: dict[str, int] = {}

        def labels(e, letters, is_input):
            lab = list(letters)
            if e.params.get("bdim") is not None:
                lab.insert(e.params["bdim"], REPLICA)
            shape = _shape(e.invars[0].aval)
            if len(lab) != len(shape):
                raise _NotAGroup         # batched by a vmap that did not say where (not a replica split)
            for letter, n in zip(lab, shape):
                if letter is None or n == 1 or dims.setdefault(letter, n) == n:
                    continue
                if is_input:
                    raise _NotAGroup     # inputs disagree on a loop dim's size: trace the body op by op
                limit[letter] = math.gcd(limit.get(letter, dims[letter]), n)   # an output dim sized unlike it
            return tuple(None if n == 1 else letter for letter, n in zip(lab, shape))
        try:
            in_dims = [labels(e, d, True) for e, d in zip(ins, note.in_dims)]
            out_dims = [labels(e, d, False) for e, d in zip(outs, note.out_dims)]
        except _NotAGroup:
            return False
        used = {d for t in in_dims + out_dims for d in t if d is not None}
        dims = {d: n for d, n in dims.items() if d in used}
        name = self.names(_join(scope, note.kind))
        inputs = [self.read(e.invars[0], env, name, i) for i, e in enumerate(ins)]
        reduce = next((REDUCE_OF[e.primitive.name] for e in eqns if e.primitive.name in REDUCE_OF), "sum")
        itemsizes = [_itemsize(e.outvars[0].aval) for e in outs]
        res = self.graph.add_op(name, note.kind, dims, inputs, in_dims, out_dims, [_shape(e.outvars[0].aval) for e in outs],
                                itemsize=itemsizes[0], reduce=reduce, unsplittable=frozenset(note.fixed) & set(dims),
                                split_limit=limit or None, halo={d: r for d, r in note.halo if d in dims} or None,
                                halo_apart=note.halo_apart & set(dims))
        op = self.graph.ops[-1]
        for tid, size in zip(res, itemsizes):
            self.graph.tensors[tid].itemsize = size
        for e, tid in zip(outs, res):
            env[e.outvars[0]] = tid
            self.var_tensor[e.outvars[0]] = tid
        for k, (e, tid) in enumerate(zip(ins, inputs)):
            if later(e.outvars[0]):          # a marked operand read again (a backward residual): an identity that
                self.identity(f"{name}/operand{k}", "residual", [tid])   # keeps the layout the op computed it in
                res_op = self.graph.ops[-1]
                self.graph.operand_ties[res_op.id] = (op.id, k)
                self.graph.tensors[res_op.outputs[0]].itemsize = self.graph.tensors[tid].itemsize
                tid = res_op.outputs[0]
            env[e.outvars[0]] = tid
            self.var_tensor[e.outvars[0]] = tid
        for e in eqns:
            self.by_eqn.setdefault(id(e), []).append(len(self.eqns))
        self.eqns.append(TracedEqn(eqns[0], op.id, name, path, tuple(inputs), tuple(res), tuple(eqns)))
        return True

    @staticmethod
    def inlinable(eqn):
        key = rules.INLINE.get(eqn.primitive.name)
        sub = eqn.params.get(key) if key else None
        if isinstance(sub, jcore.ClosedJaxpr):
            inner = sub.jaxpr
        elif isinstance(sub, jcore.Jaxpr):
            inner = sub
        else:
            return None
        if len(inner.invars) != len(eqn.invars) or len(inner.outvars) != len(eqn.outvars):
            return None   # an unexpected calling convention: trace it as one op instead
        return sub

    def inline(self, eqn, sub, env: dict, scope: str, path: tuple) -> None:
        inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
        consts = sub.consts if isinstance(sub, jcore.ClosedJaxpr) else []
        label = _join(scope, eqn.primitive.name)
        inner_env: dict = {}
        for i, (iv, ov) in enumerate(zip(inner.invars, eqn.invars)):
            inner_env[iv] = self.read(ov, env, label, i)
        for cv, _ in zip(inner.constvars, consts):
            inner_env[cv] = self.source(f"{scope}/const" if scope else "const", cv.aval, "const")
        for v, t in inner_env.items():
            self.var_tensor[v] = t
        self.walk(inner, inner_env, scope, (*path, eqn))
        for i, (iv, ov) in enumerate(zip(inner.outvars, eqn.outvars)):
            env[ov] = self.read(iv, inner_env, label, i)
            self.var_tensor[ov] = env[ov]

    def on_region_mesh(self, jmesh) -> bool:
        """Whether a jax Mesh is the region's (same axis names and sizes, in order)."""
        try:
            shape = dict(jmesh.shape)
        except (AttributeError, TypeError):
            return False
        return tuple(shape) == self.graph.mesh.names and tuple(shape.values()) == tuple(self.graph.mesh.shape)

    def shard_map(self, eqn, env: dict, name: str) -> bool:
        """A ``shard_map`` on the region mesh as its fixed boundary (module doc); False if it is not one."""
        p = eqn.params
        if not self.on_region_mesh(p.get("mesh")):
            return False
        ins = [_spec_strategy(s, len(_shape(v.aval)), self.axis) for s, v in zip(p["in_specs"], eqn.invars)]
        outs = [_spec_strategy(s, len(_shape(v.aval)), self.axis) for s, v in zip(p["out_specs"], eqn.outvars)]
        if any(s is None for s in ins + outs):
            return False
        # manual over some mesh axes only (a pipeline's stages): its in_specs say nothing of the others, on which an
        # input stays where it arrives (XLA partitions the body over them). Its boundary still draws the search (an
        # input split over the stages is stored so), but the plan does not price the move into it as a move into
        # in_specs (searchers.graph.dead_ops: not a sink): whoever emits the body prices it
        # (mshard._src.training.pipeline.price)
        manual = set(p.get("newly_manual_axes") or p.get("axis_names") or self.graph.mesh.names)
        kind = "shard_map_in" if manual >= set(self.graph.mesh.names) else "shard_map_in_partial"
        for i, (v, st) in enumerate(zip(eqn.invars, ins)):
            self.identity(f"{name}/in{i}", kind, [self.read(v, env, name, i)], fixed=st)
        for j, (v, st) in enumerate(zip(eqn.outvars, outs)):
            tid = self.graph.source(self.names(f"{name}/out{j}"), _shape(v.aval), kind="data",
                                    itemsize=_itemsize(v.aval), fixed=st)
            env[v] = tid
            self.var_tensor[v] = tid
        return True

    def identity(self, name: str, kind: str, tids: list[int], **kw) -> None:
        """An op over one tensor's dims (every operand shaped like ``tids[0]``) whose result nobody reads: a
        fixed boundary or a tie between tensors that the search prices through its edges."""
        t = self.graph.tensors[tids[0]]
        dims = {f"i{k}": n for k, n in enumerate(t.shape)}
        self.graph.add_op(self.names(name), kind, dims, tids, [tuple(dims)] * len(tids), [tuple(dims)],
                          [t.shape], itemsize=t.itemsize, flops=0.0, **kw)

    def fixed_by_constraint(self, eqn, op) -> None:
        """Fix a ``sharding_constraint`` op to its sharding when that is on the region mesh."""
        sh = eqn.params.get("sharding")
        if eqn.params.get("unconstrained_dims") or not self.on_region_mesh(getattr(sh, "mesh", None)):
            return
        lay = _spec_strategy(sh.spec, len(op.out_dims[0]), self.axis)
        if lay is not None:
            op.fixed = strategy_of_layout(op, lay)

    def op(self, eqn, env: dict, scope: str, path: tuple) -> None:
        prim = eqn.primitive.name
        name = self.names(_join(scope, prim))
        if prim == "shard_map" and self.shard_map(eqn, env, name):
            return
        inputs = [self.read(v, env, name, i) for i, v in enumerate(eqn.invars)]
        in_shapes = [_shape(v.aval) for v in eqn.invars]
        out_shapes = [_shape(v.aval) for v in eqn.outvars]
        s = rules.iteration_space(prim, in_shapes, out_shapes, eqn.params)
        unsplit = set(s.unsplittable)
        limit = dict(s.split_divides) or None      # e.g. reshape: a split must divide the new leading dim
        itemsizes = [_itemsize(v.aval) for v in eqn.outvars]
        outs = self.graph.add_op(name, prim, s.dims, inputs, s.in_dims, s.out_dims, out_shapes,
                                 itemsize=itemsizes[0] if itemsizes else 4, reduce=s.reduce,
                                 unsplittable=frozenset(unsplit), flops=s.flops, split_limit=limit,
                                 halo=s.halo or None, halo_apart=s.halo_apart, read_only=s.read_only)
        for tid, size in zip(outs, itemsizes):
            self.graph.tensors[tid].itemsize = size
        if prim == "sharding_constraint":
            self.fixed_by_constraint(eqn, self.graph.ops[-1])
        for v, tid in zip(eqn.outvars, outs):
            env[v] = tid
            self.var_tensor[v] = tid
        self.by_eqn.setdefault(id(eqn), []).append(len(self.eqns))
        self.eqns.append(TracedEqn(eqn, self.graph.ops[-1].id, name, path, tuple(inputs), tuple(outs)))


def _tie_state(t: _GraphBuilder, jaxpr, env: dict, state_outputs: Sequence[tuple[int, int]]) -> None:
    """A ``writeback`` op per updated state: its operands are the new value (result ``o``) and the state input
    ``i`` it replaces, on the same loop dims, tied to the input's layout (``follow_operand=1``). The new value
    is stored in the input's layout (the region's output sharding is the input's), so a plan that leaves it in
    another layout pays that redistribution here, where the search sees it, instead of as a collective after
    the last op."""
    g = t.graph
    for o, i in state_outputs:
        ov, iv = jaxpr.outvars[o], jaxpr.invars[i]
        if isinstance(ov, jcore.Literal) or ov is iv:
            continue
        new, old = env[ov], env[iv]
        if g.tensors[new].shape != g.tensors[old].shape or not g.tensors[old].shape:
            continue
        t.identity(f"writeback/{g.ops[g.tensors[old].producer].name}", "writeback", [new, old], follow_operand=1)


def jaxpr_to_graph(closed_jaxpr, mesh: DeviceMesh, input_kinds: Sequence[str],
                   input_names: Sequence[str], state_outputs: Sequence[tuple[int, int]] = (), *,
                   primitives: bool = False) -> TraceResult:
    """The :class:`searchers.Graph` of ``closed_jaxpr`` (e.g. from ``jax.make_jaxpr``).

    ``input_kinds[i]`` (``"data"``, ``"param"`` or ``"const"``) and ``input_names[i]`` describe
    jaxpr input ``i`` (the flattened arguments). ``Graph.outputs`` are the jaxpr's results.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((8, 4)), jnp.ones((4, 2)))
    >>> r = jaxpr_to_graph(cj, DeviceMesh.prime(8), ["data", "param"], ["x", "w"])
    >>> [op.name for op in r.graph.ops]
    ['x', 'w', 'dot_general', 'tanh']

    ``state_outputs``: (result index, input index) pairs of a region's updated state (parameters,
    optimizer state): each adds a ``writeback`` op tying the new value to the input's layout.

    ``primitives``: trace each primitive object (``ops.MatMul()``, ...) as one op with the object's own iteration
    space, as MindSpore sees it (its body's eqns are not ops; see ``_GraphBuilder.group``), so a searcher's strategy
    for it is the object's MindSpore strategy and the dims it cannot split are never split.
    """
    jaxpr = closed_jaxpr.jaxpr
    if len(input_kinds) != len(jaxpr.invars) or len(input_names) != len(jaxpr.invars):
        raise PlanError(f"jaxpr_to_graph: the jaxpr has {len(jaxpr.invars)} inputs but got "
                         f"{len(input_kinds)} input_kinds and {len(input_names)} input_names; "
                         "give one kind and one name per flattened argument")
    t = _GraphBuilder(mesh, primitives)
    env: dict = {}
    input_ops = []
    for v, kind, name in zip(jaxpr.invars, input_kinds, input_names):
        env[v] = t.source(name, v.aval, kind)
        input_ops.append(t.graph.tensors[env[v]].producer)
    const_ops = []
    for v in jaxpr.constvars:
        env[v] = t.source("const", v.aval, "const")
        const_ops.append(t.graph.tensors[env[v]].producer)
    t.var_tensor.update(env)
    t.walk(jaxpr, env, "", ())
    t.graph.outputs = [t.read(v, env, "output", i) for i, v in enumerate(jaxpr.outvars)]
    _tie_state(t, jaxpr, env, state_outputs)
    return TraceResult(t.graph, closed_jaxpr, t.var_tensor, t.eqns, input_ops, const_ops, t.by_eqn)




def scan_body_graph(eqn, path: tuple, mesh: DeviceMesh, in_fixed: Sequence, out_fixed: Sequence,
                    stored: Sequence[bool] = (), body: Any = None, scalars: bool = False) -> TraceResult:
    """The graph of one step of a ``scan``'s body, to plan it as a region of its own: each body input is a source
    fixed to the layout the body reads it in (``in_fixed``, a strategy per input: the constants' and the carry's
    layouts, a scanned input's without its scanned dim), and each result is read by a ``writeback`` op fixed to the
    layout the loop keeps it in (``out_fixed``: the carry's; a stacked result's readers' without the scanned dim;
    None: where the body makes it). ``stored[k]``: body input k is stored state (a weight), a ``param`` source.
    The body's equations carry ``path + (eqn,)``, the emitter's keys inside the body. ``body``: another body of
    the same eqn to trace (a ``while``'s body jaxpr, one branch of a ``cond``), the ``scan``'s by default.
    ``scalars``: a scalar result is read by a write-back too (a while's condition, whose one result is its test);
    else it has none.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda h, w: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, w))(
    ...     jnp.ones((8, 4)), jnp.ones((3, 4, 4)))
    >>> (scan,) = cj.jaxpr.eqns
    >>> r = scan_body_graph(scan, (), DeviceMesh.prime(8), [((0,), ()), ((), ())], [((0,), ())])
    >>> [(op.name, op.fixed) for op in r.graph.ops]      # doctest: +NORMALIZE_WHITESPACE
    [('scan_in0', ((0,), ())), ('scan_in1', ((), ())), ('dot_general', None), ('tanh', None),
     ('scan_out0', ((0,), ()))]
    """
    body = eqn.params["jaxpr"] if body is None else body
    t = _GraphBuilder(mesh, primitives=True)
    env: dict = {}
    input_ops = []
    for k, (v, fixed) in enumerate(zip(body.jaxpr.invars, in_fixed, strict=True)):
        kind = "param" if k < len(stored) and stored[k] else "data"
        env[v] = t.graph.source(t.names(f"scan_in{k}"), _shape(v.aval), kind=kind, itemsize=_itemsize(v.aval),
                                fixed=tuple(tuple(a) for a in fixed))
        input_ops.append(t.graph.tensors[env[v]].producer)
    const_ops = []
    for v in body.jaxpr.constvars:
        env[v] = t.source("const", v.aval, "const")
        const_ops.append(t.graph.tensors[env[v]].producer)
    t.var_tensor.update(env)
    t.walk(body.jaxpr, env, "", (*path, eqn))
    outs = []
    for j, (v, fixed) in enumerate(zip(body.jaxpr.outvars, out_fixed, strict=True)):
        tid = t.read(v, env, "scan_out", j)
        if not t.graph.tensors[tid].shape and not scalars:
            continue
        t.identity(f"scan_out{j}", "writeback", [tid], fixed=None if fixed is None else tuple(tuple(a) for a in fixed))
        outs.append(t.graph.ops[-1].outputs[0])
    t.graph.outputs = outs
    return TraceResult(t.graph, body, t.var_tensor, t.eqns, input_ops, const_ops, t.by_eqn)
