"""Turn the strategies found in a traced region into concrete layouts on one mesh.

Input: the region's jaxpr (with ``mshard_mark`` annotations), what each input is (data or a
parameter path) and the context. Output: a :class:`RegionLayouts` — the mesh, the layout of every
input, and the layout each mark must be constrained to (``None``: leave it to XLA).

Split counts name no mesh axes; the axes are chosen here, walking the program in order, so a
consumer takes the axes its producer already uses for the same dim (no redistribution), a
parameter's split avoids the axes its first consumer's other operands use, and a split count
seen before reuses the same axes. Layouts (and PartitionSpec/NamedSharding) name their axes and
are taken as given.

Nested jaxprs: calls (jit/pjit, custom_jvp/vjp, checkpoint/remat, closed_call) are walked inline
with their inputs' layouts; loop and branch bodies (scan, while, cond) are walked for their marks
with unknown input layouts.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from mshard._src.jaxpr.marks import OpNote, mark_p
from mshard._src.jaxpr.op_graph import TracedEqn, TraceResult, jaxpr_to_graph
from mshard._src.jaxpr.split_meetings import SplitMeetings
from mshard._src.jaxpr.walk import as_jaxpr as _as_jaxpr
from mshard._src.jaxpr.walk import call_jaxpr, iter_marks, sub_jaxprs
from mshard._src.values.context import did_you_mean
from mshard._src.values.errors import (
    DatasetStrategyError,
    LayoutError,
    ParameterPlanError,
    StrategyError,
    StrategyIgnoredWarning,
)
from mshard._src.values.layout import (
    DimAxes,
    TensorStrategy,
    check_fits,
    choose_axes,
    prime_mesh,
    spec_of,
    to_tensor_strategy,
)
from searchers import DeviceMesh


def notes_in(jaxpr: jcore.Jaxpr) -> list[OpNote]:
    seen: dict[int, OpNote] = {}
    for e in iter_marks(jaxpr):
        seen.setdefault(e.params["note"].uid, e.params["note"])
    return list(seen.values())


def exact_mark_key(eqn) -> tuple[int, str, int]:
    """A mark's own key, its role kept: a searched plan lays out a transposed mark (role ``ct``/``ct_out``) on its
    own; :func:`mark_key` (what semi_auto assigns) gives it its primal's layout."""
    return (eqn.params["note"].uid, eqn.params["role"], eqn.params["index"])


def mark_key(eqn) -> tuple[int, str, int]:
    role = eqn.params["role"]
    return (eqn.params["note"].uid, "in" if role in ("in", "ct") else "out", eqn.params["index"])


@dataclass
class InputInfo:
    kind: str                          # "data" | "param"
    shape: tuple[int, ...]
    name: str                          # parameter path or "arg0[1]"
    strategy: TensorStrategy | None = None   # a fixed layout for this input (dataset tuple, parameter_plan)


@dataclass
class RegionLayouts:
    mesh: DeviceMesh
    inputs: list[DimAxes]
    marks: dict[tuple[int, str, int], DimAxes | None] = field(default_factory=dict)
    op_names: dict[int, str] = field(default_factory=dict)
    honour_marks: bool = True
    user_inputs: set[int] = field(default_factory=set)     # inputs laid out by the user (data, parameter_plan)
    strategy_inputs: list[DimAxes] | None = None    # a searched region's inputs as the user's strategies alone lay them out
    # an out mark whose op must first compute in another layout (a guard's safe layout): the op's result is
    # constrained to this one, then to the mark's
    staged: dict[tuple[int, str, int], DimAxes] = field(default_factory=dict)
    # storage layouts that share mesh axes with a split they meet: redistributed before the op, said in the plan
    notes: list[str] = field(default_factory=list)

    def input_specs(self) -> list[PartitionSpec]:
        """Every input's planned layout as a ``PartitionSpec`` over ``mesh.names``."""
        return [spec_of(d) for d in self.inputs]


# -- mesh ------------------------------------------------------------------------------------------
def region_mesh(notes: Sequence[OpNote], fixed: Sequence[TensorStrategy], device_num: int) -> DeviceMesh:
    meshes = {}
    for n in notes:
        for st in tuple(n.in_strategy) + tuple(n.out_strategy or ()):
            if st is not None and st.mesh is not None:
                meshes.setdefault(st.mesh, n.given_name or n.kind)
    for st in fixed:
        if st.mesh is not None:
            meshes.setdefault(st.mesh, "parameter_plan")
    if len(meshes) > 1:
        desc = "; ".join(f"{m.shape} {m.names} (from {w})" for m, w in meshes.items())
        raise LayoutError(f"one mesh per region: the strategies name different device matrices: {desc}. Use one "
                          f"Layout (or one mesh for every NamedSharding) in a region.")
    if meshes:
        (mesh,) = meshes
        if mesh.size != device_num:
            raise LayoutError(f"Layout device_matrix {mesh.shape} covers {mesh.size} devices but device_num="
                              f"{device_num}; make the device matrix's product equal device_num.")
        return mesh
    return prime_mesh(device_num)


def resolve_counts(st: TensorStrategy, mesh: DeviceMesh, where: str) -> TensorStrategy:
    """Give a PartitionSpec-derived strategy its counts on ``mesh`` (checking its axis names)."""
    if st.axes is None or all(c > 0 for c in st.counts):
        return st
    for dim in st.axes:
        for a in dim:
            if a not in mesh.names:
                raise LayoutError(f"{where}: PartitionSpec axis {a!r} is not an axis of the region mesh "
                                  f"{dict(zip(mesh.names, mesh.shape))}; use a NamedSharding or a Layout "
                                  f"that defines it.")
    return TensorStrategy(tuple(mesh.count(a) for a in st.axes), st.axes, mesh)


# -- the planner -------------------------------------------------------------------------------------
class Assigner:
    """Walks a jaxpr in program order and fixes the axes of every annotated split.

    With ``meetings`` (``split_meetings.SplitMeetings``, built on the whole traced graph) a user split never
    takes a mesh axis of another user split it meets in some op, whatever lies between them, where it can.
    Where no free axes are left for two op strategies it raises ``LayoutError`` naming both; where one of the two is
    a storage layout (``storage``) it shares the axes, and :attr:`notes` says so for the plan.
    """

    def __init__(self, mesh: DeviceMesh, meetings: SplitMeetings | None = None, claim_names: dict | None = None,
                 storage: set | frozenset = frozenset()):
        self.mesh = mesh
        # claim keys that are storage layouts (a parameter_plan, a data input's strategy, a Cell's or shard-wrapped
        # function's in/out strategy), not an op's compute strategy (docs/design.md invariant 4): one that cannot
        # take axes apart from a split it meets shares them, and the tensor is redistributed before the op
        self.storage = set(storage)
        self.notes: list[str] = []
        self.known: dict[Any, DimAxes] = {}             # jaxpr var -> layout
        self.pending: dict[Any, tuple[TensorStrategy, str, Any]] = {}   # var -> counts-only strategy, name, claim
        self.marks: dict[tuple[int, str, int], DimAxes | None] = {}
        self.by_count: dict[int, tuple[str, ...]] = {}  # split count -> axes chosen for it before
        self.meetings = meetings
        self.claim_names = claim_names or {}            # claim key -> what the user wrote, for messages
        self.claimed: dict[tuple[Any, int], tuple[str, ...]] = {}   # (claim key, dim) -> axes it took

    # -- user splits that meet (mshard._src.jaxpr.split_meetings) ----------------------------------------------------
    def _met(self, claims: Sequence[tuple[Any, int]]) -> dict[tuple[Any, int], tuple[tuple[str, ...], str]]:
        """Placed claims met by any of ``claims`` -> (their axes, the op where they meet)."""
        out = {}
        if self.meetings is None:
            return out
        for c in claims:
            for other, op in self.meetings.meets(*c).items():
                if other in self.claimed and other not in claims:
                    out.setdefault(other, (self.claimed[other], op))
        return out

    def _claim(self, claims: Sequence[tuple[Any, int]], axes: tuple[str, ...], count: int) -> None:
        """Record ``axes`` for ``claims``; LayoutError where a claim they meet already took one of them."""
        if not axes or self.meetings is None:
            return
        for other, (ax, op) in self._met(claims).items():
            shared = set(ax) & set(axes)
            if shared and (claims[0][0] in self.storage or other[0] in self.storage):
                self.notes.append(
                    f"{self._who(claims[0])} (over mesh axes {axes}) and {self._who(other)} (over {ax}) meet in op "
                    f"{op!r} on the shared axes {sorted(shared)}: a storage layout, so the tensor is stored as asked "
                    f"and redistributed where the op computes")
            elif shared:
                mine = claims[0]
                sizes = dict(zip(self.mesh.names, self.mesh.shape))
                err = LayoutError(
                    f"{self._who(mine)} (a {count}-way split over mesh axes {axes}) and {self._who(other)} (over "
                    f"{ax}) meet in op {op!r} and need disjoint mesh axes, but mesh "
                    f"{sizes} has no free axes for both (shared: "
                    f"{sorted(shared)}). Give both a Layout with disjoint axes, e.g. Layout((2, 4), ('dp', 'mp')) "
                    f"with layout('dp', 'None') for the data and layout('None', 'mp') for the weight, or use "
                    f"splits whose product divides device_num={self.mesh.size}.")
                # what met, as data: the two splits and the devices they must share
                err.meeting = {"op": op, "splits": (count, math.prod(sizes[a] for a in ax)),
                               "device_num": self.mesh.size}
                raise err
        for c in claims:
            self.claimed[c] = axes

    def seed_explicit(self, notes: Sequence[OpNote]) -> None:
        """Record the claims whose axes the user named (a Layout, a PartitionSpec) before the walk, so a split
        placed earlier in program order avoids the axes a later named split it meets will take."""
        for note in notes:
            letters: dict[str, tuple[str, ...]] = {}
            for i, st in enumerate(note.in_strategy):
                if st is None or st.axes is None:
                    continue
                for d, axes in enumerate(st.axes):
                    if axes:
                        self.claimed[((note.uid, "in", i), d)] = tuple(axes)
                        if note.in_dims is not None and note.in_dims[i][d] is not None:
                            letters[note.in_dims[i][d]] = tuple(axes)
            for j, dims in enumerate(note.out_dims or ()):
                if (note.out_strategy or (None,) * len(note.out_dims))[j] is None:
                    for pos, x in enumerate(dims):
                        if x in letters:
                            self.claimed[((note.uid, "out", j), pos)] = letters[x]

    def _who(self, c: tuple[Any, int]) -> str:
        key, d = c
        return f"{self.claim_names.get(key, key)} dim {d}"

    def _joined(self, claims: Sequence[tuple[Any, int]], count: int) -> list[tuple[str, ...]]:
        """The axes already taken by user splits of ``count`` that ``claims`` join (the same loop dim of one op)."""
        if self.meetings is None:
            return []
        out = []
        for c in claims:
            for other in self.meetings.joins(*c):
                ax = self.claimed.get(other)
                if ax and other not in claims and self.mesh.count(ax) == count and ax not in out:
                    out.append(ax)
        return out

    def _hard(self, claims: Sequence[tuple[Any, int]]) -> set[str]:
        return {a for ax, _ in self._met(claims).values() for a in ax}

    # axes for one tensor given counts, preferring known axes per dim
    def place(self, st: TensorStrategy, where: str, prefer: Sequence[DimAxes | None] = (),
              avoid: set[str] = frozenset(), reuse: bool = False, claim: Any = None) -> DimAxes:
        """``reuse``: a split count seen before takes the same axes even if they are in ``avoid``. ``claim``: the
        key of a user split (:mod:`mshard._src.jaxpr.split_meetings`): its dims avoid the axes of the user splits they meet."""
        st = resolve_counts(st, self.mesh, where)
        if st.axes is not None:
            if claim is not None:
                for d, axes in enumerate(st.axes):
                    self._claim([(claim, d)], axes, self.mesh.count(axes))
            return st.axes
        out: list[tuple[str, ...]] = [()] * st.rank
        used: set[str] = set()
        # dims in order, as a primitive's loop letters are placed (assign_op), so the same counts get the same axes
        # from a function region and a primitive's; on a mesh with composite axes the largest split goes first,
        # where it still finds an axis of its size
        order = list(range(st.rank)) if self.mesh.all_prime else sorted(range(st.rank), key=lambda d: -st.counts[d])
        for d in order:
            c = st.counts[d]
            if c == 1:
                continue
            claims = [(claim, d)] if claim is not None else []
            pref = self._joined(claims, c) + [p[d] for p in prefer if p is not None and d < len(p) and p[d]]
            if c in self.by_count and (reuse or not (set(self.by_count[c]) & avoid)):
                pref.append(self.by_count[c])
            out[d] = self._take(c, used, pref, avoid, lambda free, c=c, d=d: (
                f"{where}: split {c} on dim {d} cannot be made from the free mesh axes "
                f"{ {a: self.mesh.axis_size(a) for a in free} } of mesh {dict(zip(self.mesh.names, self.mesh.shape))}; "
                f"choose splits whose product is a product of distinct mesh axes."), claims)
        return tuple(out)

    def _take(self, c: int, used: set[str], prefer, avoid, message, claims=()) -> tuple[str, ...]:
        """Axes for a ``c``-way split among the axes not in ``used`` (nor, where it can, those of the user splits
        ``claims`` meet); records them in ``used``, ``by_count`` and for ``claims``."""
        free = [a for a in self.mesh.names if a not in used]
        hard = self._hard(claims) if claims else set()
        axes = None
        if hard:
            ok = [a for a in free if a not in hard]
            axes = choose_axes(c, ok, self.mesh, [p for p in prefer if not set(p) & hard], avoid)
        if axes is None:
            axes = choose_axes(c, free, self.mesh, prefer, avoid)
        if axes is None:
            raise StrategyError(message(free))
        if claims:
            self._claim(claims, axes, c)
        used.update(axes)
        self.by_count.setdefault(c, axes)
        return axes

    def layout_of(self, var, avoid: set[str] = frozenset()) -> DimAxes | None:
        if isinstance(var, jcore.Literal):
            return None
        if var in self.pending:
            st, name, claim = self.pending.pop(var)
            self.known[var] = self.place(st, name, avoid=avoid, claim=claim)
        return self.known.get(var)

    # -- ops --------------------------------------------------------------------------------------
    def assign_op(self, note: OpNote, name: str, in_vars: Sequence[Any]) -> None:
        """Fix loop-dim axes of a primitive object's strategy; record in/out mark layouts."""
        if all(s is None for s in note.in_strategy) and not any(note.out_strategy or ()):
            # unannotated primitive object: a pending parameter split avoids the other operands' axes
            others = {a for v in in_vars if v is not None and not isinstance(v, jcore.Literal)
                      and v in self.known for d in self.known[v] for a in d}
            for v in in_vars:
                if v is not None:
                    self.layout_of(v, avoid=others)
            return
        known = [self.layout_of(v) for v in in_vars]
        loop: dict[str, tuple[str, ...]] = {}
        for i, st in enumerate(note.in_strategy):
            if st is None:
                continue
            st = resolve_counts(st, self.mesh, f"{name} input {i}")
            if st.axes is None:
                continue
            for pos, (letter, axes) in enumerate(zip(note.in_dims[i], st.axes)):
                if letter is None:
                    continue
                if letter in loop and loop[letter] != axes:
                    raise StrategyError(f"{name}: inputs disagree on a shared dim: input {i} dim {pos} is split "
                                        f"over {axes or 'no axes'} but another input uses {loop[letter] or 'no axes'}"
                                        f" for the same dim; give both the same layout.")
                loop[letter] = axes
        letter_claims = {l: [((note.uid, "in", i), pos) for i, dims in enumerate(note.in_dims)
                             if note.in_strategy[i] is not None for pos, x in enumerate(dims) if x == l]
                         for l in {x for dims in note.in_dims for x in dims if x is not None}}
        for j, dims in enumerate(note.out_dims):
            # an output laid out by the loop dims claims them too: a letter's axes avoid what the output meets
            if (note.out_strategy or (None,) * len(note.out_dims))[j] is None:
                for pos, x in enumerate(dims):
                    if x is not None:
                        letter_claims.setdefault(x, []).append(((note.uid, "out", j), pos))
        for letter, axes in loop.items():
            self._claim(letter_claims.get(letter, []), axes, self.mesh.count(axes))
        counts = note.loop_counts
        used = {a for ax in loop.values() for a in ax}
        appearance = [l for dims in note.in_dims for l in dims if l is not None]

        def has_pref(letter: str) -> bool:
            return any(k is not None and l == letter and k[pos] and self.mesh.count(k[pos]) == counts[letter]
                       for k, dims in zip(known, note.in_dims) for pos, l in enumerate(dims))
        todo = [l for l in dict.fromkeys(appearance) if l in counts and l not in loop and counts[l] > 1]
        for letter in sorted(todo, key=lambda l: (not has_pref(l), appearance.index(l))):
            c = counts[letter]
            prefer, avoid = [], set()
            for k, dims in zip(known, note.in_dims):
                if k is None:
                    continue
                for pos, l in enumerate(dims):
                    if l == letter and k[pos]:
                        prefer.append(k[pos])
                    elif l is not None and l != letter:
                        avoid.update(k[pos])
            if c in self.by_count:
                prefer.append(self.by_count[c])
            loop[letter] = self._take(c, used, prefer, avoid, lambda free, c=c: (
                f"{name}: the strategy splits its dims {counts} over more mesh axes than mesh "
                f"{dict(zip(self.mesh.names, self.mesh.shape))} has free for a {c}-way split; the product of all "
                f"of the op's splits must divide device_num={self.mesh.size}."), letter_claims.get(letter, []))
        for i, dims in enumerate(note.in_dims):
            self.marks[(note.uid, "in", i)] = (None if note.in_strategy[i] is None else
                                               tuple(loop.get(l, ()) if l else () for l in dims))
        partial = tuple(a for l in note.reduction_dims for a in loop.get(l, ()))
        for j, dims in enumerate(note.out_dims):
            natural = tuple(loop.get(l, ()) if l else () for l in dims)
            ost = (note.out_strategy or (None,) * len(note.out_dims))[j]
            if ost is None and note.as_traced:      # laid out by the traced equations (the search), not by letters
                self.marks[(note.uid, "out", j)] = None
            elif ost is None:
                self.marks[(note.uid, "out", j)] = natural
                for pos, axes in enumerate(natural):
                    self._claim([((note.uid, "out", j), pos)], axes, self.mesh.count(axes))
            else:
                pref = tuple(n + tuple(a for a in partial if a not in n) for n in natural)
                self.marks[(note.uid, "out", j)] = self.place(ost, f"{name} output {j}", prefer=[pref, natural],
                                                              claim=(note.uid, "out", j))

    def assign_shard(self, note: OpNote, name: str, in_vars: dict[int, Any]) -> None:
        """A shard-wrapped function or Cell: each annotated input/output gets its layout."""
        taken: set[str] = set()
        for i, st in enumerate(note.in_strategy):
            if st is None or i not in in_vars:
                continue
            k = self.layout_of(in_vars[i])
            lay = self.place(st, f"{name} input {i}", prefer=[k] if k else [], avoid=set(taken),
                             reuse=True, claim=(note.uid, "in", i))
            self.marks[(note.uid, "in", i)] = lay
            taken.update(a for d in lay for a in d)
        for j, st in enumerate(note.out_strategy or ()):
            self.marks[(note.uid, "out", j)] = (None if st is None else self.place(st, f"{name} output {j}",
                                                                                   claim=(note.uid, "out", j)))

    # -- the walk ---------------------------------------------------------------------------------
    def walk(self, jaxpr: jcore.Jaxpr, names: dict[int, str]) -> None:
        eqns = jaxpr.eqns
        done: set[int] = set()
        for pos, eqn in enumerate(eqns):
            if eqn.primitive is mark_p:
                note: OpNote = eqn.params["note"]
                key = mark_key(eqn)
                role = eqn.params["role"]
                if role == "in" and note.uid not in done:
                    done.add(note.uid)
                    group = {e.params["index"]: e.invars[0] for e in eqns[pos:]
                             if e.primitive is mark_p and e.params["note"] is note and e.params["role"] == "in"}
                    name = names[note.uid]
                    if note.in_dims is None:
                        self.assign_shard(note, name, group)
                    else:
                        self.assign_op(note, name, [group.get(i) for i in range(len(note.in_dims))])
                elif role == "out" and note.uid not in done and note.in_dims is None:
                    done.add(note.uid)
                    self.assign_shard(note, names[note.uid], {})
                lay = self.marks.get(key)
                if lay is not None:
                    self.known[eqn.outvars[0]] = lay
                elif role not in ("out", "ct_out") or note.in_dims is None:
                    src = self.layout_of(eqn.invars[0])
                    if src is not None:
                        self.known[eqn.outvars[0]] = src
                continue
            body = call_jaxpr(eqn)
            if body is not None:
                for outer, inner in zip(eqn.invars, body.invars):
                    if isinstance(outer, jcore.Literal):
                        continue
                    if outer in self.pending:
                        self.pending[inner] = self.pending[outer]
                    elif outer in self.known:
                        self.known[inner] = self.known[outer]
                self.walk(body, names)
                for outer, inner in zip(eqn.outvars, body.outvars):
                    if not isinstance(inner, jcore.Literal) and inner in self.known:
                        self.known[outer] = self.known[inner]
                for outer, inner in zip(eqn.invars, body.invars):
                    if not isinstance(outer, jcore.Literal) and outer in self.pending and inner not in self.pending:
                        self.pending.pop(outer)
                        self.known[outer] = self.known[inner]
                continue
            for sub in sub_jaxprs(eqn):
                self.walk(sub, names)
            self._propagate(eqn)

    def _propagate(self, eqn) -> None:
        """Resolve pending parameter splits at first use; carry layouts through elementwise-shaped ops."""
        others = {a for v in eqn.invars if not isinstance(v, jcore.Literal) and v in self.known
                  for d in self.known[v] for a in d}
        ins = [self.layout_of(v, avoid=others) for v in eqn.invars]
        for out in eqn.outvars:
            shape = getattr(out.aval, "shape", None)
            for v, lay in zip(eqn.invars, ins):
                if lay is not None and getattr(v.aval, "shape", None) == shape:
                    self.known[out] = lay
                    break


def op_names(jaxpr: jcore.Jaxpr) -> dict[int, str]:
    """The op names of docs/design.md §2 for annotated ops: ``scope/Kind`` with ``_1``, ``_2`` for repeats, in program order."""
    names: dict[int, str] = {}
    count: dict[str, int] = {}
    for eqn in iter_marks(jaxpr):
        note: OpNote = eqn.params["note"]
        if note.uid in names:
            continue
        scope = str(eqn.source_info.name_stack)
        if note.given_name and note.kind == "shard":
            base = note.given_name
        else:
            base = f"{scope}/{note.kind}" if scope else note.kind
        k = count.get(base, 0)
        count[base] = k + 1
        names[note.uid] = base if k == 0 else f"{base}_{k}"
    return names


def _inner_var(eqn, k: int):
    """The body variable operand ``k`` of a call-like eqn, a ``scan`` constant or a ``while`` body operand is bound
    to (None otherwise: a scan's carry or sliced input, a while's condition constant, a branch)."""
    body = call_jaxpr(eqn)
    if body is not None:
        return body, body.invars[k] if k < len(body.invars) else None
    if eqn.primitive.name == "scan" and k < eqn.params.get("num_consts", 0):
        body = _as_jaxpr(eqn.params["jaxpr"])
        return body, body.invars[k]
    if eqn.primitive.name == "while" and k >= eqn.params["cond_nconsts"]:
        body = _as_jaxpr(eqn.params["body_jaxpr"])
        return body, body.invars[k - eqn.params["cond_nconsts"]]
    return None, None


def _first_use(eqns, v) -> Any:
    """The first use of ``v`` if it is an annotated mark with a strategy (looking through call bodies, scan
    constants, a while loop's body operands and a conditional's branches: a weight used inside
    GradAccumulationCell's micro-batch loop, a recomputed Cell or a decode loop), else None."""
    for eqn in eqns:
        for k, u in enumerate(eqn.invars):
            if isinstance(u, jcore.Literal) or u is not v:
                continue
            if eqn.primitive is mark_p:
                ok = eqn.params["role"] == "in" and eqn.params["note"].in_strategy[eqn.params["index"]] is not None
                return eqn if ok else None
            if eqn.primitive.name == "cond":          # the first branch whose first use of it is a mark
                return None if k == 0 else next((m for b in eqn.params["branches"] if (m := _first_use(
                    b.jaxpr.eqns, b.jaxpr.invars[k - 1])) is not None), None)
            body, inner = _inner_var(eqn, k)
            return None if inner is None else _first_use(body.eqns, inner)
    return None


def _first_uses(jaxpr: jcore.Jaxpr) -> dict[Any, Any]:
    """Region inputs whose first use is an annotated mark with a strategy -> that mark eqn."""
    return {v: _first_use(jaxpr.eqns, v) for v in jaxpr.invars}


def data_layout(info: InputInfo, dataset: Any, index: int, mesh: DeviceMesh, assigner: Assigner,
                taken: set[str] = frozenset()) -> DimAxes:
    rank = len(info.shape)
    if info.strategy is not None:
        check_fits(info.strategy, info.shape, mesh.size, f"data input {info.name}")
        return assigner.place(info.strategy, f"data input {info.name}", avoid=set(taken), reuse=True,
                              claim=("input", index))
    if dataset == "full_batch" or rank == 0:
        return ((),) * rank
    if dataset == "data_parallel":
        if info.shape[0] % mesh.size:
            raise DatasetStrategyError(
                f"data input {info.name}: dataset_strategy 'data_parallel' splits dim 0 over {mesh.size} devices "
                f"but its size is {info.shape[0]} (shape {info.shape}); use a batch size divisible by {mesh.size}, "
                f"or dataset_strategy='full_batch'. Inputs are global arrays: feed the whole batch of every device "
                f"at once (a MindSpore script's per-device batch times the device count).")
        return (tuple(mesh.names),) + ((),) * (rank - 1)
    raise DatasetStrategyError(
        f"data input {info.name}: dataset_strategy {dataset!r} gives it no layout; give one strategy tuple per data "
        f"input, or use 'data_parallel' / 'full_batch'.")


# MindSpore's parameter names and flax's: a parameter_plan key in either vocabulary finds the parameter where the
# mapping is unambiguous (Dense/Linear weight <-> kernel, embedding table, LayerNorm/BatchNorm scale and shift)
PARAM_ALIASES = {"weight": ("kernel", "embedding"), "kernel": ("weight",), "embedding": ("weight",),
                 "embedding_table": ("embedding", "weight"), "gamma": ("scale",), "scale": ("gamma",),
                 "beta": ("bias",), "moving_mean": ("mean",), "moving_variance": ("var",)}


def resolve_param_name(path: str, params: dict, key: str) -> str:
    """``path`` itself if it is a parameter; else the one parameter its last component's alias names (a
    parameter_plan key in MindSpore's names on a flax module, or the other way round); else ``path`` (the caller
    reports it). Two candidates are an error naming both."""
    if path in params:
        return path
    head, _, last = path.rpartition(".")
    found = [f"{head}.{a}" if head else a for a in PARAM_ALIASES.get(last, ())]
    found = [p for p in found if p in params]
    if len(found) > 1:
        raise ParameterPlanError(f"parameter_plan: key {key!r} could mean {found}; use the parameter's own path.")
    return found[0] if found else path


def assign_layouts(closed: jcore.ClosedJaxpr, inputs: Sequence[InputInfo], *, mode: str, device_num: int,
                dataset_strategy: Any, param_plans: Sequence[tuple[str, str, Any]] = (),
                trace: Callable[[DeviceMesh], TraceResult] | None = None) -> RegionLayouts:
    """Layouts for a traced region under ``mode`` (see docs/design.md §3).

    ``trace(mesh)``: the region's operator graph on ``mesh`` (:func:`mshard._src.jaxpr.op_graph.jaxpr_to_graph` with
    ``primitives=True``), called once the mesh is known, where user splits may meet; the planner passes the one
    it searches on, so a region is traced into a graph once. Without it the graph is traced here."""
    jaxpr = closed.jaxpr
    notes = notes_in(jaxpr)
    names = op_names(jaxpr)
    params = {info.name: i for i, info in enumerate(inputs) if info.kind == "param"}
    fixed: dict[int, TensorStrategy] = {}
    if mode in ("semi_auto_parallel", "auto_parallel"):
        for cell, key, strategy in param_plans:
            path = resolve_param_name(f"{cell}.{key}" if cell else key, params, key)
            if path not in params:
                near = [p for p in params if p.endswith(key.split(".")[-1])][:5] or list(params)[:5]
                raise ParameterPlanError(f"parameter_plan{' of Cell ' + repr(cell) if cell else ''}: key {key!r} "
                                         f"matches no parameter.{did_you_mean(path, params)} Parameters include "
                                         f"{near}. Use a parameter path like 'dense1.weight'.")
            i = params[path]
            st = to_tensor_strategy(strategy, f"parameter_plan[{key!r}]")
            check_fits(st, inputs[i].shape, device_num, f"parameter_plan[{key!r}] (shape {inputs[i].shape})")
            fixed[i] = st
    annotated = [names[n.uid] for n in notes
                 if any(st is not None for st in tuple(n.in_strategy) + tuple(n.out_strategy or ()))]
    if annotated and mode in ("stand_alone", "data_parallel"):
        warnings.warn(f"parallel_mode={str(mode)!r} ignores the strategies of {annotated[:5]}"
                      f"{' and more' if len(annotated) > 5 else ''}; set parallel_mode='semi_auto_parallel' to apply "
                      f"them.", StrategyIgnoredWarning, stacklevel=2)
    if mode == "stand_alone":
        mesh = prime_mesh(1)
        return RegionLayouts(mesh, [((),) * len(i.shape) for i in inputs], {}, names, honour_marks=False)
    if mode in ("semi_auto_parallel", "auto_parallel"):
        mesh = region_mesh(notes, list(fixed.values()) + [i.strategy for i in inputs if i.strategy], device_num)
    else:
        mesh = prime_mesh(device_num)
    meetings, claim_names = None, {}
    if mode in ("semi_auto_parallel", "auto_parallel"):
        tr = (trace(mesh) if trace is not None else
              jaxpr_to_graph(closed, DeviceMesh(mesh.shape, mesh.names), [i.kind for i in inputs],
                             [i.name for i in inputs], primitives=True))
        meetings, claim_names, storage = user_meetings(tr, inputs, fixed, names)
    else:
        storage = set()
    assigner = Assigner(mesh, meetings, claim_names, storage)
    if meetings is not None:
        assigner.seed_explicit(notes_in(jaxpr))
    in_layouts: list[DimAxes | None] = [None] * len(inputs)
    first_use = _first_uses(jaxpr) if mode in ("semi_auto_parallel", "auto_parallel") else {}
    taken: set[str] = set()
    for i, info in enumerate(inputs):
        if info.kind == "data" and info.strategy is None and first_use.get(jaxpr.invars[i]) is not None:
            continue   # laid out as its first (annotated) consumer asks, decided in the walk
        if info.kind == "data":
            in_layouts[i] = data_layout(info, dataset_strategy, i, mesh, assigner, taken)
            taken.update(a for d in in_layouts[i] for a in d)
            assigner.known[jaxpr.invars[i]] = in_layouts[i]
        elif i in fixed:
            assigner.pending[jaxpr.invars[i]] = (fixed[i], f"parameter {info.name}", ("input", i))
        elif first_use.get(jaxpr.invars[i]) is not None:
            continue   # a parameter sliced as the op that consumes it first asks (MindSpore's parameter slicing)
        else:
            in_layouts[i] = ((),) * len(info.shape)
            assigner.known[jaxpr.invars[i]] = in_layouts[i]
    honour = mode in ("semi_auto_parallel", "auto_parallel")
    if honour:
        assigner.walk(jaxpr, names)
    for i, info in enumerate(inputs):
        if in_layouts[i] is None and info.kind == "data":
            eqn = first_use[jaxpr.invars[i]]
            in_layouts[i] = assigner.marks.get(mark_key(eqn)) or data_layout(info, dataset_strategy, i, mesh, assigner)
        elif in_layouts[i] is None and first_use.get(jaxpr.invars[i]) is not None:
            in_layouts[i] = assigner.marks.get(mark_key(first_use[jaxpr.invars[i]])) or ((),) * len(info.shape)
        elif in_layouts[i] is None:
            in_layouts[i] = assigner.layout_of(jaxpr.invars[i])
    user = {i for i, info in enumerate(inputs) if info.kind == "data" or i in fixed}
    return RegionLayouts(mesh, in_layouts, assigner.marks, names, honour_marks=honour, user_inputs=user,
                         notes=assigner.notes)


def _split_dims(st: TensorStrategy | None) -> list[int]:
    return [] if st is None else [d for d, c in enumerate(st.counts) if c != 1]


def _tensor_dims(split: Sequence[int], mark) -> dict[int, int]:
    """{claim dim: tensor dim} of a mark's split dims: a mark batched over data-parallel replicas has the replica
    dim at its ``bdim``, after which every dim is one further."""
    bdim = mark.params.get("bdim")
    return {d: d + (bdim is not None and d >= bdim) for d in split}


def _group_claims(te: TracedEqn, g, names: dict[int, str], sources: dict, who: dict, stops: set,
                  sinks: dict, at: dict) -> None:
    """The claims of a primitive object traced as one op (``te.group``): its input strategies on the op's loop
    dims (``at``) and on the residuals it leaves for the backward, its results as the note lays them out; the op
    is a sink, entered only through its inputs without a strategy (see ``split_meetings.SplitMeetings``). An
    object without strategies passes claims through like any op."""
    note: OpNote = te.eqn.params["note"]
    if not any(st is not None for st in note.in_strategy):
        return
    op = g.ops[te.op]
    marks = {(e.params["role"], e.params["index"]): e for e in te.group if e.primitive is mark_p}
    residual = {k: oid for oid, (tied, k) in g.operand_ties.items() if tied == te.op}
    sinks[te.op] = {k for k, st in enumerate(note.in_strategy) if st is None}
    label = names.get(note.uid, note.kind)
    for k, st in enumerate(note.in_strategy):
        e = marks[("in", k)]
        if st is None:
            continue
        tdims = _tensor_dims(_split_dims(st), e)
        key = mark_key(e)
        at.setdefault(key, []).append((te.op, {d: op.in_dims[k][td] for d, td in tdims.items()}))
        if k in residual:             # the operand as the backward reads it: laid out by this claim alone
            stops.add(residual[k])
            sources.setdefault(key, []).append((g.ops[residual[k]].outputs[0], tdims))
        who[key] = f"{label} input {k}"
    for j, dims in enumerate(note.out_dims):
        e = marks[("out", j)]
        split = [p for p, l in enumerate(dims) if l and note.loop_counts.get(l, 1) > 1]
        key = mark_key(e)
        sources.setdefault(key, []).append((op.outputs[j], _tensor_dims(split, e)))
        who[key] = f"{label} output {j}"


def user_meetings(tr: TraceResult, inputs: Sequence[InputInfo], fixed: dict[int, TensorStrategy],
                  names: dict[int, str]) -> tuple[SplitMeetings, dict, set]:
    """Where the region's user splits meet, on its whole traced graph (:mod:`mshard._src.jaxpr.split_meetings`; the graph the
    region's search runs on, its primitive objects one op each), a name for each claim (what the user wrote) for
    messages, and the claims that are storage layouts (:class:`Assigner`)."""
    g = tr.graph
    sources: dict[Any, list[tuple[int, dict[int, int]]]] = {}
    who: dict[Any, str] = {}
    for i, info in enumerate(inputs):
        st = fixed.get(i, info.strategy)
        if st is not None:
            sources[("input", i)] = [(g.ops[tr.input_ops[i]].outputs[0], {d: d for d in _split_dims(st)})]
            who[("input", i)] = (f"parameter_plan[{info.name!r}]" if info.kind == "param"
                                 else f"data input {info.name}")
    # a step's write-backs tie new state to its input for the search; no claim passes them
    stops = {op.id for op in g.ops if op.fixed is not None or op.kind == "writeback"}
    sinks: dict[int, set[int]] = {}
    at: dict[Any, list[tuple[int, dict[int, str]]]] = {}
    shard_marks = set()              # a shard-wrapped function's or Cell's in/out strategies: storage layouts
    for te in tr.eqns:
        e = te.eqn
        if te.group:
            _group_claims(te, g, names, sources, who, stops, sinks, at)
            continue
        if e.primitive is not mark_p:
            continue
        note: OpNote = e.params["note"]
        role, idx = e.params["role"], e.params["index"]
        if note.in_dims is None:     # a shard-wrapped function or Cell: its annotated inputs and outputs
            st = note.in_strategy[idx] if role in ("in", "ct") else (note.out_strategy or (None,) * (idx + 1))[idx]
            split = _split_dims(st)
        elif not any(s is not None for s in note.in_strategy) and not any(note.out_strategy or ()):
            continue                 # an unannotated primitive object: an identity, not a user split
        elif role in ("in", "ct"):
            st = note.in_strategy[idx]
            split = _split_dims(st)
        else:
            ost = (note.out_strategy or (None,) * len(note.out_dims))[idx]
            st = ost if ost is not None else note
            split = (_split_dims(ost) if ost is not None else
                     [p for p, l in enumerate(note.out_dims[idx]) if l and note.loop_counts.get(l, 1) > 1])
        if st is None:
            continue
        key = mark_key(e)
        stops.add(te.op)
        if role not in ("in", "out"):
            # a transposed mark (its primal's cotangent) lays out what the primal's claim decides; spreading it too
            # would carry the claim backwards into the forward values its cotangent is multiplied with (a tanh's
            # residual, say), where it would meet claims that never meet in the program the user wrote
            continue
        sources.setdefault(key, []).append((g.ops[te.op].outputs[0], _tensor_dims(split, e)))
        side = "input" if key[1] == "in" else "output"
        who[key] = f"{names.get(note.uid, note.kind)} {side} {idx}"
        if note.in_dims is None:
            shard_marks.add(key)
    storage = {k for k in who if k[0] == "input"} | shard_marks
    return SplitMeetings(g, sources, stops, sinks, at), who, storage
