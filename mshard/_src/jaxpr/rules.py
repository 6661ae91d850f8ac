"""Per-primitive sharding rules: one registry ``{primitive name: rule}``.

A *rule* is a pure function of an equation's abstract inputs and its params::

    rule(in_shapes: list[tuple[int, ...]], out_shapes: list[tuple[int, ...]], **params) -> IterSpace

that returns the op's einsum-like *iteration space* (see :mod:`searchers.graph`): named loop dims
with sizes, the loop dim of every operand/result dim (``None`` where a tensor dim follows no loop
dim, which makes that dim replicated under every strategy), the combiner of partial results for
the reduction dims, and the loop dims that may never be split.

Rules never look at values, devices or the mesh. Families are registered with one helper each
(:func:`register`), and dot_general, conv and the reductions are each written once over an
einsum-like spec (:func:`einsum_space`, :func:`space`).

:func:`iteration_space` is the one entry point. An unknown primitive gets :func:`default_rule`
(follow an operand elementwise when every result has that operand's shape, else replicate) and
one :class:`UnknownPrimitiveWarning` per primitive name per process; a rule that fails on
unexpected params falls back to the same default with a :class:`RuleFailureWarning`. Neither
path raises (unless the warnings filter turns warnings into errors).

Nested jaxprs, the choice made for each (the tracer, :mod:`mshard._src.jaxpr.op_graph`, reads :data:`INLINE`):

* ``jit`` (pjit), ``closed_call``, ``core_call``, ``custom_jvp_call``, ``custom_vjp_call``,
  ``remat2``/``checkpoint``: *inlined* -- the tracer walks the sub-jaxpr, so the search sees
  every primitive inside (a ``jit`` around ``jnp.take`` or ``jax.nn.relu`` must not hide it), and
  the custom derivative rules do not matter for the forward graph.
* ``scan``, ``while``, ``cond``: *one op* whose carry keeps its layout and whose other operands are
  each read in a layout of its own (:func:`scan_carry_rule`, :func:`while_carry_rule`,
  :func:`cond_branches_rule`); the searchers price no body, and once the region is searched each
  body or branch is planned and priced as a region of its own (``planning.scan_bodies``).
* ``shard_map``, callbacks, ``custom_linear_solve``: *one op* with the :func:`replicated_rule`
  (every dim unsplittable): replicating is always correct and XLA still partitions inside where
  the surrounding layout allows.
"""

from __future__ import annotations

import itertools
import math
import operator
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from mshard._src.jaxpr.walk import CALLS
from searchers.graph import parts

Shape = tuple[int, ...]
Labels = tuple["str | tuple[str, ...] | None", ...]   # per tensor dim: its loop dim, or the loop dims it is made of

__all__ = [
    "INLINE",
    "RULES",
    "IterSpace",
    "Rule",
    "RuleFailureWarning",
    "UnknownPrimitiveWarning",
    "default_rule",
    "einsum_space",
    "iteration_space",
    "register",
    "replicated_rule",
    "space",
]


class UnknownPrimitiveWarning(UserWarning):
    """A primitive with no registered rule was traced; it got the safe default rule."""


class RuleFailureWarning(UserWarning):
    """A registered rule failed on unexpected params; the op got the safe default rule."""


@dataclass(frozen=True)
class IterSpace:
    """The iteration space of one op (what :meth:`searchers.Graph.add_op` takes).

    ``dims``: loop dim -> size, ordered (treat as read-only). ``in_dims[i]`` / ``out_dims[j]``:
    the loop dim of each dim of operand ``i`` / result ``j`` (``None``: replicated).
    ``reduce``: combiner of partial results over split reduction dims (loop dims no result uses).
    ``unsplittable``: loop dims no strategy may split. ``flops``: ``None`` means the searcher's
    default (``prod(dims)``, x2 with a reduction). ``split_divides``: for a loop dim shared by
    tensor dims of different sizes (a merged run of a reshape), a split count of that dim must
    also divide this number; result dims mapped to such a loop dim may differ from its size (they
    are multiples of this number). The tracer turns it into ``unsplittable`` where the mesh
    allows a split that would break it (:mod:`searchers` knows no such constraint).
    ``halo``: for a windowed op (a convolution), loop dim -> rows of the operand beyond a device's
    block that it reads when that dim is split (XLA's partitioner exchanges them with the
    neighbours); ``halo_apart``: loop dims a search never splits together with a halo dim.

    >>> s = einsum_space("mk,kn->mn", [(8, 4), (4, 2)], [(8, 2)])
    >>> s.dims, s.reduction_dims
    ({'m': 8, 'n': 2, 'k': 4}, ('k',))
    """

    dims: dict[str, int]
    in_dims: tuple[Labels, ...]
    out_dims: tuple[Labels, ...]
    reduce: str = "sum"
    unsplittable: frozenset[str] = frozenset()
    flops: float | None = None
    split_divides: dict[str, int] = field(default_factory=dict)
    halo: dict[str, int] = field(default_factory=dict)
    halo_apart: frozenset[str] = frozenset()
    read_only: frozenset[str] = frozenset()   # operand loop dims no result uses that are not reduced either (a
                                              # scan's constants and scanned inputs: the body reads them)

    @property
    def reduction_dims(self) -> tuple[str, ...]:
        used = {d for od in self.out_dims for lab in od for d in parts(lab)} | self.read_only
        return tuple(d for d in self.dims if d not in used)

    def check(self, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]) -> None:
        """Raise ``ValueError`` if the space does not fit these shapes (ranks, sizes, labels)."""
        if len(in_shapes) != len(self.in_dims) or len(out_shapes) != len(self.out_dims):
            raise ValueError(f"IterSpace: {len(self.in_dims)} in_dims / {len(self.out_dims)} out_dims "
                             f"for {len(in_shapes)} operands / {len(out_shapes)} results")
        sides = (("operand", in_shapes, self.in_dims), ("result", out_shapes, self.out_dims))
        for what, shapes, maps in sides:
            for i, (shape, labels) in enumerate(zip(shapes, maps)):
                if len(shape) != len(labels):
                    raise ValueError(f"IterSpace: {what} {i} has rank {len(shape)}, labels {labels}")
                for size, d in zip(shape, labels):
                    if d is None:
                        continue
                    if not isinstance(d, str):          # a dim made of several loop dims (a reshape's merged run)
                        if not set(d) <= set(self.dims) or math.prod(self.dims[x] for x in d) != size:
                            raise ValueError(f"IterSpace: {what} {i} dim of size {size} mapped to loop dims {d}")
                        continue
                    if d not in self.dims:
                        raise ValueError(f"IterSpace: {what} {i} uses unknown loop dim {d!r}")
                    if size == self.dims[d]:
                        continue
                    g = self.split_divides.get(d)
                    if what == "result" and g is not None and size % g == 0:
                        continue
                    raise ValueError(f"IterSpace: {what} {i} dim of size {size} mapped to {d}={self.dims[d]}")
        for d in (*self.unsplittable, *self.split_divides):
            if d not in self.dims:
                raise ValueError(f"IterSpace: unknown loop dim {d!r} in unsplittable/split_divides")


Rule = Callable[..., IterSpace]
RULES: dict[str, Rule] = {}

# primitive name -> the param holding the sub-jaxpr the tracer inlines (see the module docstring)
INLINE: dict[str, str] = dict(CALLS)     # the one call table (mshard._src.jaxpr.walk)


def register(*names: str) -> Callable[[Rule], Rule]:
    """Register ``rule`` under every name in ``names`` (a whole family at once)."""
    def deco(rule: Rule) -> Rule:
        for n in names:
            RULES[n] = rule
        return rule
    return deco


# -- building spaces ---------------------------------------------------------------------------
def space(ins: Sequence[Sequence[str | None]], outs: Sequence[Sequence[str | None]],
          in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]], *,
          reduce: str = "sum", unsplittable: Iterable[str] = (), flops: float | None = None,
          split_divides: Mapping[str, int] | None = None, halo: Mapping[str, int] | None = None,
          halo_apart: Iterable[str] = (), sizes: Mapping[str, int] | None = None,
          read_only: Iterable[str] = ()) -> IterSpace:
    """An :class:`IterSpace` from per-tensor label tuples. Loop dims are ordered by first
    appearance in the results, then in the operands (free dims first, reductions last, as einsum).

    A loop dim's size is that of the first operand (else result) dim carrying its label, checked
    against every other dim with that label (:meth:`IterSpace.check`); ``sizes`` gives those of loop
    dims that only appear as parts of a dim made of several (a tuple label).
    """
    dims: dict[str, int] = {}
    size: dict[str, int] = dict(sizes or {})   # operands fix a loop dim's size (results may be multiples)
    for labels, shape in zip([*ins, *outs], [*in_shapes, *out_shapes]):
        for d, n in zip(labels, shape):
            if isinstance(d, str) and d not in size:
                size[d] = int(n)
    for labels in [*outs, *ins]:
        for lab in labels:
            for d in parts(lab):
                if d not in dims:
                    dims[d] = size[d]
    canon = lambda labels: tuple(lab if lab is None or isinstance(lab, str) else tuple(lab) for lab in labels)
    s = IterSpace(dims, tuple(canon(x) for x in ins), tuple(canon(x) for x in outs), reduce,
                  frozenset(d for d in unsplittable if d in dims), flops, dict(split_divides or {}),
                  dict(halo or {}), frozenset(halo_apart), frozenset(d for d in read_only if d in dims))
    s.check(in_shapes, out_shapes)
    return s


def einsum_space(spec: str, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]],
                 **kw) -> IterSpace:
    """``space`` from an einsum string of one-letter labels, ``.`` for an unmapped dim.

    >>> einsum_space("bmk,bkn->bmn", [(2, 8, 4), (2, 4, 6)], [(2, 8, 6)]).reduction_dims
    ('k',)
    """
    lhs, rhs = spec.replace(" ", "").split("->")
    parse = lambda t: [tuple(None if c == "." else c for c in part) for part in t.split(",")] if t else []
    return space(parse(lhs), parse(rhs), in_shapes, out_shapes, **kw)


def _size(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


def _out_size(out_shapes: Sequence[Sequence[int]]) -> float:
    return float(sum(_size(s) for s in out_shapes))


def _norm(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# -- safe defaults -----------------------------------------------------------------------------
@register("debug_print")      # ops.Print inside a region: what it prints is gathered whole (a debugging aid)
def replicated_rule(in_shapes, out_shapes, **_) -> IterSpace:
    """Every dim unsplittable: operands replicated, each result dim its own unsplittable loop dim."""
    outs = [tuple(f"r{j}_{k}" for k in range(len(s))) for j, s in enumerate(out_shapes)]
    return space([(None,) * len(s) for s in in_shapes], outs, in_shapes, out_shapes,
                 unsplittable=[d for o in outs for d in o], flops=_out_size(out_shapes))


def default_rule(in_shapes, out_shapes, **_) -> IterSpace:
    """The rule for unknown primitives: follow an operand elementwise, else replicate.

    If every result has the shape of some operand, each distinct result shape gets its own free
    loop dims, shared by every operand of exactly that shape (other operands are replicated);
    otherwise :func:`replicated_rule`.
    """
    in_t = [tuple(s) for s in in_shapes]
    out_t = [tuple(s) for s in out_shapes]
    if not out_t or not all(o in in_t for o in out_t):
        return replicated_rule(in_shapes, out_shapes)
    labels: dict[Shape, tuple[str, ...]] = {}
    for o in out_t:
        if o not in labels:
            labels[o] = tuple(f"f{len(labels)}_{k}" for k in range(len(o)))
    ins = [labels.get(s, (None,) * len(s)) for s in in_t]
    return space(ins, [labels[o] for o in out_t], in_shapes, out_shapes)


_warned: set[str] = set()


def iteration_space(name: str, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]],
                    params: Mapping[str, object] | None = None) -> IterSpace:
    """The iteration space of primitive ``name``; never raises for unknown or odd primitives."""
    in_shapes = [tuple(int(n) for n in s) for s in in_shapes]
    out_shapes = [tuple(int(n) for n in s) for s in out_shapes]
    rule = RULES.get(name)
    if rule is None:
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"mshard: no sharding rule for primitive {name!r}; using the safe default "
                          "(follow an operand elementwise, else replicate)", UnknownPrimitiveWarning,
                          stacklevel=2)
        return default_rule(in_shapes, out_shapes)
    try:
        return rule(in_shapes, out_shapes, **dict(params or {}))
    except Exception as e:
        key = f"failed:{name}"
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"mshard: the sharding rule for {name!r} failed ({type(e).__name__}: {e}); "
                          "using the safe default", RuleFailureWarning, stacklevel=2)
        return default_rule(in_shapes, out_shapes)


# -- elementwise families ----------------------------------------------------------------------
UNARY = (
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bessel_i0e", "bessel_i1e", "cbrt", "ceil",
    "clz", "conj", "cos", "cosh", "digamma", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
    "imag", "is_finite", "lgamma", "log", "log1p", "logistic", "neg", "not", "population_count", "real",
    "round", "rsqrt", "sign", "sin", "sinh", "sqrt", "square", "tan", "tanh", "integer_pow",
    "convert_element_type", "copy", "copy_p", "reduce_precision", "stop_gradient", "zeros_like",
    "random_seed", "random_clone", "sharding_constraint", "reshard", "name", "pvary",
    "mshard_mark",   # mshard's identity marker (mshard.ops): an elementwise identity op
)
NARY = (
    "add", "sub", "mul", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "and", "or", "xor",
    "eq", "ne", "lt", "le", "gt", "ge", "shift_left", "shift_right_arithmetic", "shift_right_logical",
    "complex", "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "polygamma", "zeta",
    "regularized_incomplete_beta", "add_any", "select_n", "clamp", "mulhi", "random_fold_in",
    "threefry2x32",
)


@register(*UNARY, *NARY)
def elementwise_rule(in_shapes, out_shapes, **_) -> IterSpace:
    """Elementwise with numpy broadcasting: operands right-aligned to the result; a dim whose size
    differs from the result's (size 1, broadcast) maps to ``None``. All results share one shape."""
    ref = out_shapes[0]
    if any(tuple(o) != tuple(ref) for o in out_shapes) or any(len(s) > len(ref) for s in in_shapes):
        return default_rule(in_shapes, out_shapes)
    labels = tuple(f"i{k}" for k in range(len(ref)))

    def align(shape):
        off = len(ref) - len(shape)
        return tuple(labels[off + k] if n == ref[off + k] else None for k, n in enumerate(shape))
    return space([align(s) for s in in_shapes], [labels] * len(out_shapes), in_shapes, out_shapes)


@register("optimization_barrier", "device_put")
def identity_each_rule(in_shapes, out_shapes, **_) -> IterSpace:
    """Result ``j`` is operand ``j`` (several unrelated identities in one op)."""
    if [tuple(s) for s in in_shapes] != [tuple(s) for s in out_shapes]:
        return default_rule(in_shapes, out_shapes)
    labels = [tuple(f"t{j}_{k}" for k in range(len(s))) for j, s in enumerate(out_shapes)]
    return space(labels, labels, in_shapes, out_shapes)


# -- contractions, written once ------------------------------------------------------------------
@register("dot_general")
def dot_general_rule(in_shapes, out_shapes, *, dimension_numbers, **_) -> IterSpace:
    """``b m k, b k n -> b m n``: batch ``b*`` and free ``m*``/``n*`` dims, contraction ``k*``."""
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = in_shapes[0], in_shapes[1]
    lab_l: list[str | None] = [None] * len(lhs)
    lab_r: list[str | None] = [None] * len(rhs)
    out: list[str] = []
    for i, (a, b) in enumerate(zip(lb, rb)):
        lab_l[a] = lab_r[b] = f"b{i}"
        out.append(f"b{i}")
    for i, (a, b) in enumerate(zip(lc, rc)):
        lab_l[a] = lab_r[b] = f"k{i}"
    for tensor, prefix in ((lab_l, "m"), (lab_r, "n")):
        free = [d for d in range(len(tensor)) if tensor[d] is None]
        for i, d in enumerate(free):
            tensor[d] = f"{prefix}{i}"
            out.append(f"{prefix}{i}")
    return space([lab_l, lab_r], [out], in_shapes[:2], out_shapes)


@register("conv_general_dilated")
def conv_rule(in_shapes, out_shapes, *, window_strides, padding, lhs_dilation=None, rhs_dilation=None,
              dimension_numbers, feature_group_count=1, batch_group_count=1, **_) -> IterSpace:
    """``n c S, o c K -> n o S``: n and o free, c (and the kernel window K) reduced.

    A spatial dim is free (shared by input and output) for a 1x1 kernel with stride 1, no padding
    and no dilation. A "same" window (stride 1, no input dilation, padding >= 0 on each side, the
    output as large as the input) shares it too, with a *halo*: a device split on it reads
    ``rhs_dilation * (k - 1)`` rows of its neighbours' blocks, which XLA exchanges (two
    collective-permutes); a search never splits it together with o (``halo_apart``: XLA computes
    wrong values for that pair, :mod:`mshard._src.planning.xla_guards`). Any other window (strided, valid, input
    dilated) keeps the input's spatial dim replicated and the output's unsplittable. Grouped
    convolutions keep c and o unsplittable (feature_group_count > 1; and n, as XLA gathers it),
    batch-grouped ones n and o, and get no halo.
    """
    lhs, rhs = in_shapes[0], in_shapes[1]
    out = out_shapes[0]
    ls, rs, os_ = dimension_numbers.lhs_spec, dimension_numbers.rhs_spec, dimension_numbers.out_spec
    nsp = len(ls) - 2
    lhs_dilation = tuple(lhs_dilation or (1,) * nsp)
    lab_l: list[str | None] = [None] * len(lhs)
    lab_r: list[str | None] = [None] * len(rhs)
    lab_o: list[str | None] = [None] * len(out)
    unsplit: set[str] = set()
    lab_o[os_[0]] = "n"
    lab_o[os_[1]] = lab_r[rs[0]] = "o"
    lab_r[rs[1]] = "c"
    if batch_group_count == 1:
        lab_l[ls[0]] = "n"
    else:
        unsplit |= {"n", "o"}
    if feature_group_count == 1:
        lab_l[ls[1]] = "c"
    else:   # XLA's partitioner all-gathers a grouped conv's batch too: keep it whole
        unsplit |= {"n", "c", "o"}
    rhs_dilation = tuple(rhs_dilation or (1,) * nsp)
    halo: dict[str, int] = {}
    for i in range(nsp):
        s, k = f"s{i}", f"k{i}"
        lab_o[os_[2 + i]] = s
        lab_r[rs[2 + i]] = k
        unsplit.add(k)
        size, kernel = lhs[ls[2 + i]], rhs[rs[2 + i]]
        same = (window_strides[i] == 1 and lhs_dilation[i] == 1 and size == out[os_[2 + i]]
                and min(padding[i]) >= 0)
        if same and kernel == 1 and tuple(padding[i]) == (0, 0):
            lab_l[ls[2 + i]] = s
        elif same and kernel > 1 and feature_group_count == 1 and batch_group_count == 1:
            lab_l[ls[2 + i]] = s
            halo[s] = rhs_dilation[i] * (kernel - 1)
        else:
            unsplit.add(s)
    flops = 2.0 * _size(out) * rhs[rs[1]] * _size([rhs[d] for d in rs[2:]])
    return space([lab_l, lab_r], [lab_o], in_shapes[:2], out_shapes, unsplittable=unsplit, flops=flops,
                 halo=halo, halo_apart={"o"} if halo else ())


# -- reductions, written once --------------------------------------------------------------------
def _reduction(in_shapes, out_shapes, axes, *, reduce: str, split_reduced: bool) -> IterSpace:
    """Operands ``i0 i1 ...`` (all the same shape; scalar init values follow no dim) -> results
    without ``axes``. Reduced dims are splittable (partials combined by ``reduce``) only if
    ``split_reduced``."""
    rank = len(in_shapes[0])
    axes = {_norm(a, rank) for a in axes}
    labels = tuple(f"i{k}" for k in range(rank))
    ins = [labels if len(s) == rank else (None,) * len(s) for s in in_shapes]
    outs = [tuple(labels[k] for k in range(rank) if k not in axes)] * len(out_shapes)
    unsplit = () if split_reduced else [labels[k] for k in axes]
    return space(ins, outs, in_shapes, out_shapes, reduce=reduce, unsplittable=unsplit)


def _reduction_rule(reduce: str, split_reduced: bool) -> Rule:
    def rule(in_shapes, out_shapes, *, axes=None, dimensions=None, **_):
        return _reduction(in_shapes, out_shapes, axes if axes is not None else dimensions,
                          reduce=reduce, split_reduced=split_reduced)
    return rule


# name -> (combiner of partial results, may a reduced dim be split). argmax/argmin keep the axis
# whole: combining partial arg-results needs the values too, which one combiner cannot express;
# so do xor and the generic ``reduce`` with a user computation.
REDUCTIONS: dict[str, tuple[str, bool]] = {
    "reduce_sum": ("sum", True), "reduce_max": ("max", True), "reduce_min": ("min", True),
    "reduce_prod": ("prod", True), "reduce_and": ("and", True), "reduce_or": ("or", True),
    "argmax": ("max", False), "argmin": ("min", False),
    "reduce_xor": ("sum", False), "reduce": ("sum", False),
}
for _name, (_combiner, _split) in REDUCTIONS.items():
    RULES[_name] = _reduction_rule(_combiner, _split)


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def scan_axis_rule(in_shapes, out_shapes, *, axis, **_):
    """A cumulative op: the scanned axis is unsplittable, the others free."""
    rank = len(in_shapes[0])
    labels = tuple(f"i{k}" for k in range(rank))
    return space([labels], [labels], in_shapes, out_shapes, unsplittable=[labels[_norm(axis, rank)]])


@register("sort")
def sort_rule(in_shapes, out_shapes, *, dimension, **_):
    """Sort (several same-shape operands): the sorted dim unsplittable, the others free."""
    rank = len(in_shapes[0])
    labels = tuple(f"i{k}" for k in range(rank))
    return space([labels] * len(in_shapes), [labels] * len(out_shapes), in_shapes, out_shapes,
                 unsplittable=[labels[_norm(dimension, rank)]])


@register("approx_top_k")
def top_k_rule(in_shapes, out_shapes, *, axis=-1, reduction_dimension=None, **_):
    """top_k over ``axis``: that dim is replicated in the operand and unsplittable in the results.
    (``top_k`` itself is replicated: XLA's partitioner all-gathers its TopK custom call.)"""
    rank = len(in_shapes[0])
    ax = _norm(reduction_dimension if reduction_dimension is not None else axis, rank)
    labels = tuple(f"i{k}" for k in range(rank))
    ins = tuple(None if k == ax else d for k, d in enumerate(labels))
    outs = tuple("t" if k == ax else d for k, d in enumerate(labels))
    return space([ins], [outs] * len(out_shapes), in_shapes, out_shapes, unsplittable=["t"],
                 flops=float(_size(in_shapes[0])))


# -- layout ops ----------------------------------------------------------------------------------
@register("broadcast_in_dim")
def broadcast_in_dim_rule(in_shapes, out_shapes, *, broadcast_dimensions, **_):
    """Operand dim i follows result dim ``broadcast_dimensions[i]`` (None where it is size 1 and
    broadcast); new result dims are free (each device materialises its own slice)."""
    out = out_shapes[0]
    labels = tuple(f"i{k}" for k in range(len(out)))
    op = tuple(labels[d] if in_shapes[0][i] == out[d] else None for i, d in enumerate(broadcast_dimensions))
    extra = [(None,) * len(s) for s in in_shapes[1:]]     # dynamic-shape operands
    return space([op, *extra], [labels], in_shapes, out_shapes)


@register("transpose")
def transpose_rule(in_shapes, out_shapes, *, permutation, **_):
    labels = tuple(f"i{k}" for k in range(len(in_shapes[0])))
    return space([labels], [tuple(labels[p] for p in permutation)], in_shapes, out_shapes)


@register("squeeze")
def squeeze_rule(in_shapes, out_shapes, *, dimensions, **_):
    rank = len(in_shapes[0])
    gone = {_norm(d, rank) for d in dimensions}
    labels = tuple(None if k in gone else f"i{k}" for k in range(rank))
    return space([labels], [tuple(d for d in labels if d is not None)], in_shapes, out_shapes)


def reshape_runs(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Group the non-1 dims of shapes ``a`` and ``b`` into runs of equal products (in order).

    >>> reshape_runs((4, 6, 8), (24, 2, 4))
    [([0, 1], [0]), ([2], [1, 2])]
    """
    ai = [i for i, n in enumerate(a) if n != 1]
    bi = [j for j, n in enumerate(b) if n != 1]
    runs, i, j = [], 0, 0
    while i < len(ai) and j < len(bi):
        ins, outs = [ai[i]], [bi[j]]
        pa, pb = a[ai[i]], b[bi[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ins.append(ai[i])
                pa *= a[ai[i]]
                i += 1
            else:
                outs.append(bi[j])
                pb *= b[bi[j]]
                j += 1
        runs.append((ins, outs))
    return runs


def common_factors(a: Sequence[int], b: Sequence[int]) -> list[int] | None:
    """The finest factorisation of a run of equal products that both ``a`` and ``b`` are made of, major first:
    each dim of either side is a product of consecutive factors. None where there is none (the two sides' prefix
    products do not form one chain of multiples, e.g. ``(6, 4)`` and ``(4, 6)``).

    >>> common_factors((64, 8), (4, 128)), common_factors((6, 4), (4, 6))
    ([4, 16, 8], None)
    """
    cuts = sorted({p for side in (a, b) for p in itertools.accumulate(side, operator.mul)})
    factors, prev = [], 1
    for c in cuts:
        if c % prev:
            return None
        factors.append(c // prev)
        prev = c
    return factors


def _factor_labels(side: Sequence[int], factors: Sequence[int], r: int) -> list[str | tuple[str, ...]]:
    """Per dim of ``side``, the factors (loop dims ``r{r}_{k}``) it is made of: one label, or a tuple."""
    out, k = [], 0
    for n in side:
        got = []
        while n > 1:
            got.append(f"r{r}_{k}")
            n //= factors[k]
            k += 1
        out.append(got[0] if len(got) == 1 else tuple(got))
    return out


@register("reshape")
def reshape_rule(in_shapes, out_shapes, *, dimensions=None, **_):
    """MindSpore's reshape rule over runs of equal products (:func:`reshape_runs`).

    A run of one dim on each side is a shared free loop dim. A merged run is split into the finest factors both
    sides are made of (:func:`common_factors`), one loop dim each; a dim made of several factors maps to that
    tuple of loop dims, so a block split of it survives the reshape exactly where it is a block split of the
    other side too: ``[64, 8] -> [4, 128]`` runs over ``(4, 16, 8)``, and rows split 8 ways are the result
    split ``(4, 2)``, with no data moved (a minor factor is split only after the factors before it are split
    whole: :meth:`searchers.graph.Op.nested`). A run with no common factors (``(6, 4) -> (4, 6)``) keeps the
    rule before: the leading input dim and the leading result dim share a loop dim (sized like the input
    dim) whose split must also divide the leading result dim (``split_divides``); the run's other dims are
    replicated (input) / unsplittable (result). Size-1 dims follow no loop dim.

    >>> s = reshape_rule([(64, 8)], [(4, 128)])
    >>> s.dims, s.in_dims, s.out_dims
    ({'r0_0': 4, 'r0_1': 16, 'r0_2': 8}, ((('r0_0', 'r0_1'), 'r0_2'),), (('r0_0', ('r0_1', 'r0_2')),))
    """
    a, b = in_shapes[0], out_shapes[0]
    if dimensions is not None or _size(a) != _size(b) or 0 in a:
        return replicated_rule(in_shapes, out_shapes)
    lab_in: list = [None] * len(a)
    lab_out: list = [None] * len(b)
    unsplit, divides, sizes = [], {}, {}
    for r, (ins, outs) in enumerate(reshape_runs(a, b)):
        if len(ins) == 1 and len(outs) == 1:
            lab_in[ins[0]] = lab_out[outs[0]] = f"r{r}"
            continue
        factors = common_factors([a[i] for i in ins], [b[j] for j in outs])
        if factors is not None:
            sizes.update((f"r{r}_{k}", n) for k, n in enumerate(factors))
            for i, lab in zip(ins, _factor_labels([a[i] for i in ins], factors, r)):
                lab_in[i] = lab
            for j, lab in zip(outs, _factor_labels([b[j] for j in outs], factors, r)):
                lab_out[j] = lab
            continue
        lab_in[ins[0]] = lab_out[outs[0]] = f"r{r}"
        divides[f"r{r}"] = math.gcd(a[ins[0]], b[outs[0]])
        for k, j in enumerate(outs[1:]):
            lab_out[j] = f"r{r}_{k + 1}"
            unsplit.append(f"r{r}_{k + 1}")
    extra = [(None,) * len(s) for s in in_shapes[1:]]
    return space([lab_in, *extra], [lab_out], in_shapes, out_shapes, unsplittable=unsplit,
                 split_divides=divides, flops=_out_size(out_shapes), sizes=sizes)


def _whole_or_fixed(in_shapes, out_shapes, keep: Sequence[bool], *, data_operands: Sequence[int] = (0,),
                    flops: float | None = None) -> IterSpace:
    """Result dims ``i{k}``; dim k is shared with the data operands where ``keep[k]`` (and the
    sizes agree), else the operands' dim is replicated and ``i{k}`` unsplittable. Non-data
    operands (scalars, start indices) follow no dim."""
    out = out_shapes[0]
    labels = tuple(f"i{k}" for k in range(len(out)))
    ins = []
    for i, s in enumerate(in_shapes):
        if i in data_operands and len(s) == len(out):
            ins.append(tuple(labels[k] if keep[k] and s[k] == out[k] else None for k in range(len(s))))
        else:
            ins.append((None,) * len(s))
    return space(ins, [labels] * len(out_shapes), in_shapes, out_shapes,
                 unsplittable=[labels[k] for k in range(len(out)) if not keep[k]],
                 flops=flops if flops is not None else _out_size(out_shapes))


@register("concatenate")
def concatenate_rule(in_shapes, out_shapes, *, dimension, **_):
    """The concatenated dim is unsplittable; the others are shared by all operands."""
    rank = len(out_shapes[0])
    keep = [k != dimension for k in range(rank)]
    return _whole_or_fixed(in_shapes, out_shapes, keep, data_operands=range(len(in_shapes)))


@register("split")
def split_rule(in_shapes, out_shapes, *, axis, **_):
    """The inverse of concatenate: the split axis is replicated / unsplittable."""
    rank = len(in_shapes[0])
    ax = _norm(axis, rank)
    labels = tuple(f"i{k}" for k in range(rank))
    ins = tuple(None if k == ax else d for k, d in enumerate(labels))
    outs = [tuple(f"a{j}" if k == ax else d for k, d in enumerate(labels)) for j in range(len(out_shapes))]
    return space([ins], outs, in_shapes, out_shapes, unsplittable=[f"a{j}" for j in range(len(out_shapes))],
                 flops=_out_size(out_shapes))


@register("slice")
def slice_rule(in_shapes, out_shapes, *, start_indices, limit_indices, strides=None, **_):
    """Dims taken whole stay free; sliced dims are unsplittable."""
    a = in_shapes[0]
    strides = strides or (1,) * len(a)
    keep = [start_indices[k] == 0 and limit_indices[k] == a[k] and strides[k] == 1 for k in range(len(a))]
    return _whole_or_fixed(in_shapes, out_shapes, keep)


@register("dynamic_slice")
def dynamic_slice_rule(in_shapes, out_shapes, *, slice_sizes, **_):
    """Dims taken whole are free (their start index is clamped to 0); sliced dims unsplittable."""
    keep = [slice_sizes[k] == in_shapes[0][k] for k in range(len(in_shapes[0]))]
    return _whole_or_fixed(in_shapes, out_shapes, keep)


@register("dynamic_update_slice")
def dynamic_update_slice_rule(in_shapes, out_shapes, **_):
    """Operand, update and result share the dims the update covers whole; the others are
    unsplittable (operand/result) and replicated (update)."""
    a, u = in_shapes[0], in_shapes[1]
    keep = [u[k] == a[k] for k in range(len(a))]
    out = _whole_or_fixed(in_shapes, out_shapes, [True] * len(a), data_operands=(0,))
    labels = out.out_dims[0]
    upd = tuple(labels[k] if keep[k] else None for k in range(len(a)))
    ins = [out.in_dims[0], upd, *out.in_dims[2:]]
    return space(ins, out.out_dims, in_shapes, out_shapes,
                 unsplittable=[labels[k] for k in range(len(a)) if not keep[k]], flops=out.flops)


@register("pad")
def pad_rule(in_shapes, out_shapes, *, padding_config, **_):
    """Unpadded dims are free; padded dims are unsplittable."""
    keep = [tuple(c) == (0, 0, 0) for c in padding_config]
    return _whole_or_fixed(in_shapes, out_shapes, keep)


@register("rev")
def rev_rule(in_shapes, out_shapes, *, dimensions, **_):
    """Reversed dims are unsplittable (a split one would swap shards between devices)."""
    keep = [k not in set(dimensions) for k in range(len(in_shapes[0]))]
    return _whole_or_fixed(in_shapes, out_shapes, keep)


@register("tile")
def tile_rule(in_shapes, out_shapes, *, reps, **_):
    return _whole_or_fixed(in_shapes, out_shapes, [r == 1 for r in reps])


@register("iota", "empty2")
def iota_rule(in_shapes, out_shapes, **_):
    """No operands; every result dim is free (each device computes its own slice). ``empty2``: an uninitialised
    value, JAX's placeholder in a differentiated ``cond`` for a residual the other branch makes."""
    labels = tuple(f"i{k}" for k in range(len(out_shapes[0])))
    return space([(None,) * len(s) for s in in_shapes], [labels], in_shapes, out_shapes)


@register("bitcast_convert_type")
def bitcast_rule(in_shapes, out_shapes, **_):
    """Same shape: elementwise. A size-changing bitcast adds/drops a trailing dim, which is
    replicated in the operand / unsplittable in the result."""
    a, b = in_shapes[0], out_shapes[0]
    if tuple(a) == tuple(b):
        return elementwise_rule(in_shapes, out_shapes)
    n = min(len(a), len(b))
    lab = [f"i{k}" for k in range(max(len(a), len(b)))]
    ins = tuple(lab[k] if k < n else None for k in range(len(a)))
    outs = tuple(lab[k] for k in range(len(b)))
    return space([ins], [outs], in_shapes, out_shapes, unsplittable=lab[n:])


# -- windows -------------------------------------------------------------------------------------
@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
          "select_and_scatter_add", "select_and_gather_add", "select_and_scatter")
def window_rule(in_shapes, out_shapes, *, window_dimensions, window_strides=None, padding=None,
                base_dilation=None, window_dilation=None, **_):
    """Pooling and its gradients: a dim whose window is trivial (size 1, stride 1, no padding or
    dilation) is free and shared by every same-rank operand; a windowed dim is unsplittable in
    the results and replicated in operands of another size. Scalar init values follow no dim."""
    r = len(window_dimensions)
    strides = window_strides or (1,) * r
    padding = padding or ((0, 0),) * r
    bd, wd = base_dilation or (1,) * r, window_dilation or (1,) * r
    trivial = [window_dimensions[k] == 1 and strides[k] == 1 and tuple(padding[k]) == (0, 0)
               and bd[k] == 1 and wd[k] == 1 for k in range(r)]
    data = [i for i, s in enumerate(in_shapes) if len(s) == r]
    s = _whole_or_fixed(in_shapes, out_shapes, trivial, data_operands=data,
                        flops=_out_size(out_shapes) * max(1, _size(window_dimensions)))
    return s


# -- gather / scatter ------------------------------------------------------------------------------
@register("gather")
def gather_rule(in_shapes, out_shapes, *, dimension_numbers, slice_sizes, **_):
    """Gather (``jnp.take``, ``table[ids]``).

    Index batch dims ``g*`` (every indices dim but the last, the index vector) are shared with the
    result's batch dims: free. Operand dims the slice takes whole and no index addresses are
    shared with the result's offset dims ``o*``: free. A single indexed, collapsed, size-1-slice
    operand dim (the embedding's vocabulary ``v``) is a reduction: split, each device looks up
    the ids in its range (masking the rest to 0) and the partial results are summed. Every other
    gathered operand dim is replicated and its result window dim unsplittable.
    """
    dn = dimension_numbers
    op, idx, out = in_shapes[0], in_shapes[1], out_shapes[0]
    lab_op: list[str | None] = [None] * len(op)
    lab_idx: list[str | None] = [None] * len(idx)
    lab_out: list[str | None] = [None] * len(out)
    unsplit = []
    batch_pos = [p for p in range(len(out)) if p not in dn.offset_dims]
    for k, (p, d) in enumerate(zip(batch_pos, range(len(idx) - 1))):
        lab_idx[d] = lab_out[p] = f"g{k}"
    for od, idd in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        lab_op[od] = lab_idx[idd]
    offset_operand = [d for d in range(len(op))
                      if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
    for k, (p, d) in enumerate(zip(dn.offset_dims, offset_operand)):
        lab_out[p] = f"o{k}"
        if d not in dn.start_index_map and slice_sizes[d] == op[d]:
            lab_op[d] = f"o{k}"
        else:
            unsplit.append(f"o{k}")
    if len(dn.start_index_map) == 1:
        v = dn.start_index_map[0]
        if v in dn.collapsed_slice_dims and slice_sizes[v] == 1:
            lab_op[v] = "v"
    return space([lab_op, lab_idx], [lab_out], in_shapes[:2], out_shapes, reduce="sum",
                 unsplittable=unsplit, flops=_out_size(out_shapes))


def _scatter(in_shapes, out_shapes, *, dimension_numbers, combiner: str | None, split_updates: bool,
             **_) -> IterSpace:
    """Scatter(-add) (``x.at[ids].add(u)``, the gradient of gather).

    Operand and result share dims ``p*``. Update scatter dims ``u*`` (shared with the indices'
    batch dims) are reductions: split, every device scatters its updates and the results are
    combined (sum for scatter-add); for a plain overwriting scatter they are unsplittable. The
    single indexed, inserted operand dim (the embedding's ``v``) is free for combining scatters
    (each device applies the updates that land in its range) and unsplittable otherwise. Operand
    window dims taken whole by the updates are shared with them; other windowed dims unsplittable.
    """
    dn = dimension_numbers
    op, idx, upd = in_shapes[0], in_shapes[1], in_shapes[2]
    lab_op = [f"p{d}" for d in range(len(op))]
    lab_idx: list[str | None] = [None] * len(idx)
    lab_upd: list[str | None] = [None] * len(upd)
    unsplit: list[str] = []
    scatter_pos = [p for p in range(len(upd)) if p not in dn.update_window_dims]
    for k, (p, d) in enumerate(zip(scatter_pos, range(len(idx) - 1))):
        lab_idx[d] = lab_upd[p] = f"u{k}"
        if not split_updates:
            unsplit.append(f"u{k}")
    for od, idd in zip(dn.operand_batching_dims, dn.scatter_indices_batching_dims):
        lab_upd[scatter_pos[idd]] = lab_idx[idd] = lab_op[od]
        if lab_op[od] in unsplit:
            unsplit.remove(lab_op[od])
    window_operand = [d for d in range(len(op))
                      if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
    for p, d in zip(dn.update_window_dims, window_operand):
        if d not in dn.scatter_dims_to_operand_dims and upd[p] == op[d]:
            lab_upd[p] = lab_op[d]
        else:
            unsplit.append(lab_op[d])
    embedding_like = (combiner is not None and len(dn.scatter_dims_to_operand_dims) == 1
                      and dn.scatter_dims_to_operand_dims[0] in dn.inserted_window_dims)
    for d in dn.inserted_window_dims:
        if not (embedding_like and d == dn.scatter_dims_to_operand_dims[0]):
            unsplit.append(lab_op[d])
    ins = [lab_op, lab_idx, lab_upd, *[(None,) * len(s) for s in in_shapes[3:]]]
    return space(ins, [lab_op], in_shapes, out_shapes, reduce=combiner or "sum", unsplittable=unsplit,
                 flops=float(_size(upd)))


def _scatter_rule(combiner: str | None, split_updates: bool) -> Rule:
    def rule(in_shapes, out_shapes, **params):
        return _scatter(in_shapes, out_shapes, combiner=combiner, split_updates=split_updates, **params)
    return rule


# name -> (combiner of the partial results (None: an overwriting scatter), may update dims be split).
# XLA's partitioner all-gathers the updates of scatter-sub rather than combining partial results.
SCATTERS: dict[str, tuple[str | None, bool]] = {
    "scatter-add": ("sum", True), "scatter-sub": ("sum", False), "scatter-mul": ("prod", True),
    "scatter-min": ("min", True), "scatter-max": ("max", True), "scatter": (None, False)}
for _name, (_combiner, _split) in SCATTERS.items():
    RULES[_name] = _scatter_rule(_combiner, _split)


# -- random ----------------------------------------------------------------------------------------
@register("rng_bit_generator", "rng_uniform", "random_gamma")
def _rng_rule(in_shapes, out_shapes, **_):
    """Stateful-looking generators: replicated (their bits depend on the whole output shape)."""
    return replicated_rule(in_shapes, out_shapes)


register("top_k")(replicated_rule)   # XLA's SPMD partitioner all-gathers the TopK custom call


def _leading(in_shapes, out_shapes, *, lead: int) -> IterSpace:
    """The first ``lead`` dims are free and shared by all tensors; the rest replicated (operands)
    or unsplittable (results)."""
    lab = [f"i{k}" for k in range(lead)]
    ins = [tuple(lab[k] if k < lead else None for k in range(len(s))) for s in in_shapes]
    outs = [tuple(lab[k] if k < lead else f"x{j}_{k}" for k in range(len(s)))
            for j, s in enumerate(out_shapes)]
    return space(ins, outs, in_shapes, out_shapes,
                 unsplittable=[d for o in outs for d in o if d.startswith("x")], flops=_out_size(out_shapes))


@register("random_bits", "random_split", "random_wrap", "random_unwrap")
def key_rule(in_shapes, out_shapes, **_):
    """Key-array ops: the key batch dims (the operand's, minus a trailing key-data dim for
    random_wrap) are free; the dims the op adds are unsplittable (safe: their values depend on
    the generator's layout)."""
    lead = min(len(in_shapes[0]), *(len(s) for s in out_shapes))
    return _leading(in_shapes, out_shapes, lead=lead)


# -- control flow and opaque calls: one op, replicated (see the module docstring) ------------------
register("scan", "while", "cond", "shard_map", "custom_linear_solve", "pure_callback", "io_callback",
         "debug_callback", "custom_partitioning", "ffi_call", "fft", "cholesky", "triangular_solve",
         "lu", "qr", "eigh", "svd", "linear_call", "run_state")(replicated_rule)
# fallbacks for the inlined primitives, used only if a caller asks for them directly
register(*INLINE)(replicated_rule)


@register("scan")
def scan_carry_rule(in_shapes, out_shapes, *, num_consts=0, num_carry=0, **_) -> IterSpace:
    """A scan's carry keeps its layout from step to step: carry k's input and result share free loop dims, and
    XLA partitions the body around them (a split carry is always computed right). Each constant is read in a
    layout of its own (``read_only`` loop dims: read by the body, neither returned nor reduced); the scanned
    inputs and the stacked results stay whole (a scanned input moved to a layout is moved step by step inside the
    loop). The searchers price no body; once the region is searched, the plan lays the body out, reads the
    constants where they arrive where that costs less, and prices it (``planning.scan_bodies.plan_scan_bodies``).

    >>> s = scan_carry_rule([(4, 4), (8, 4), (3, 8, 4)], [(8, 4), (3, 8, 4)], num_consts=1, num_carry=1)
    >>> s.in_dims
    (('k0_0', 'k0_1'), ('c0_0', 'c0_1'), (None, None, None))
    >>> s.out_dims[0], sorted(s.unsplittable), s.reduction_dims
    (('c0_0', 'c0_1'), ['y1_0', 'y1_1', 'y1_2'], ())
    """
    ins: list[tuple[str | None, ...]] = [tuple(f"k{i}_{d}" for d in range(len(s))) if i < num_consts
                                         else (None,) * len(s) for i, s in enumerate(in_shapes)]
    outs = [tuple(f"y{j}_{d}" for d in range(len(s))) for j, s in enumerate(out_shapes)]
    carried = set()
    for k in range(min(num_carry, len(out_shapes))):
        i = num_consts + k
        if i < len(in_shapes) and tuple(in_shapes[i]) == tuple(out_shapes[k]):
            lab = tuple(f"c{k}_{d}" for d in range(len(out_shapes[k])))
            ins[i], outs[k] = lab, lab
            carried.add(k)
    unsplit = [d for j, o in enumerate(outs) if j not in carried for d in o]
    read = [d for lab in ins[:num_consts] for d in lab]
    return space(ins, outs, in_shapes, out_shapes, unsplittable=unsplit, flops=_out_size(out_shapes), read_only=read)


@register("while")
def while_carry_rule(in_shapes, out_shapes, *, cond_nconsts=0, body_nconsts=0, **_) -> IterSpace:
    """A ``while_loop`` as a scan of unknown length (:func:`scan_carry_rule`): each carry keeps its layout from
    step to step (its input and result share free loop dims), each constant of the condition and of the body is
    read in a layout of its own (``read_only``), so a weight the body reads split (a Megatron layer inside a decode
    loop) is not gathered whole for the loop. Once the region is searched, the body is planned and priced per
    iteration (``planning.scan_bodies.plan_scan_bodies``).

    >>> s = while_carry_rule([(), (4, 4), (8, 4)], [(8, 4)], cond_nconsts=1, body_nconsts=1)
    >>> s.in_dims, s.out_dims
    (((), ('k1_0', 'k1_1'), ('c0_0', 'c0_1')), (('c0_0', 'c0_1'),))
    """
    nc = cond_nconsts + body_nconsts
    ins = [tuple(f"k{i}_{d}" for d in range(len(s))) for i, s in enumerate(in_shapes[:nc])]
    outs = []
    for k, s in enumerate(out_shapes):
        lab = tuple(f"c{k}_{d}" for d in range(len(s)))
        ins.append(lab)
        outs.append(lab)
    read = [d for lab in ins[:nc] for d in lab]
    return space(ins, outs, in_shapes, out_shapes, flops=_out_size(out_shapes), read_only=read)


@register("cond")
def cond_branches_rule(in_shapes, out_shapes, **_) -> IterSpace:
    """A ``cond``/``switch``: the branch index is whole, every other operand is read in a layout of its own
    (``read_only``: a branch reads it where it arrives, a weight split by a strategy inside the branch is not
    gathered for the branch) and every result has free dims of its own. Once the region is searched, each branch
    is planned as a region of its own with its operands and results fixed where the search put them, and the
    conditional is priced as its costlier branch (``planning.scan_bodies.plan_scan_bodies``).

    >>> s = cond_branches_rule([(), (8, 4)], [(8, 2)])
    >>> s.in_dims, s.out_dims
    (((), ('k1_0', 'k1_1')), (('y0_0', 'y0_1'),))
    """
    ins = [tuple(f"k{i}_{d}" for d in range(len(s))) if i else (None,) * len(s) for i, s in enumerate(in_shapes)]
    outs = [tuple(f"y{j}_{d}" for d in range(len(s))) for j, s in enumerate(out_shapes)]
    read = [d for lab in ins[1:] for d in lab]
    return space(ins, outs, in_shapes, out_shapes, flops=_out_size(out_shapes), read_only=read)
