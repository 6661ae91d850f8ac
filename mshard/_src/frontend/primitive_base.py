"""The base of MindSpore-style primitive objects: ``ops.MatMul(transpose_b=True).shard(((4, 2), (1, 2)))``.

A primitive object is one op in the plan. Its strategy covers its own tensor inputs, one split
tuple each, as in MindSpore; its iteration space (``spec``) says how the inputs' and outputs' dims
map to loop dims, so the strategy is checked (divisibility, device count, shared dims agreeing,
dims the op cannot split) when it is called inside a region, before JAX sees anything.
Called eagerly (concrete arrays, no region) in semi_auto/auto_parallel, a primitive with a strategy runs as its
own region, MindSpore's PyNative ``shard``, and its result keeps the planned layout; traced by the user's own
``jax.jit`` / ``grad`` / ``vmap`` its region is constrained into that program (:mod:`mshard._src.jaxpr.user_trace`); otherwise
(no strategy, data_parallel/stand_alone) it runs as plain JAX.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from mshard._src.frontend import direct_call, interleave
from mshard._src.jaxpr import marks
from mshard._src.jaxpr.marks import CallSite, OpNote
from mshard._src.jaxpr.user_trace import call_in_user_trace
from mshard._src.runtime.fastcall import MISS
from mshard._src.runtime.region import Region
from mshard._src.values import context as ctxmod
from mshard._src.values.errors import StrategyError, StrategyIgnoredWarning
from mshard._src.values.layout import TensorStrategy, check_fits, check_strategy, normalize_in_strategy

Dims = tuple[str | None, ...]
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _eager_sharded() -> bool:
    """Whether eager calls of primitives with strategies run sharded (the modes that honour strategies)."""
    return ctxmod.current().parallel_mode in ("semi_auto_parallel", "auto_parallel")


class Primitive:
    """The base of every primitive op object (``ops.MatMul``, ...): one op of the plan, with MindSpore's ``shard``.

    ``op.shard(in_strategy, out_strategy=None)`` sets the strategy (one split tuple, Layout call or PartitionSpec per
    tensor input) and returns the op. Inside a region (``ms.jit``, a sharded Cell) a call checks the strategy against
    the op's iteration space before JAX sees it; called eagerly in semi_auto/auto_parallel, an op with a strategy runs
    as its own sharded region (MindSpore's PyNative ``shard``); otherwise it runs as plain JAX. An ``nnx.Variable``
    argument is read as its value. A subclass defines ``compute(*tensors, *attrs)``, ``spec(shapes, attrs)`` ->
    (loop dims per input dim, loop dims per output dim, loop dims that must not be split), and ``n_tensors`` when its
    trailing arguments are attributes rather than tensors.

    Args:
        name: the op's name in plans and errors (default ``None``: it goes by its class name).

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.MatMul(name="proj").shard(((2, 1), (1, 4)))
    MatMul(proj).shard(((2, 1), (1, 4)))
    >>> class Double(ops.Primitive):
    ...     def compute(self, x):
    ...         return 2 * x
    ...     def spec(self, shapes, attrs):
    ...         dims = tuple("abcdefgh"[:len(shapes[0])])
    ...         return (dims,), (dims,), frozenset()
    >>> Double()(jnp.arange(3)).tolist()
    [0, 2, 4]
    """

    n_tensors: int | None = None      # leading tensor arguments; the rest are attributes (None: all)
    # planned as the JAX it computes (its equations' rules; a strategy fixes its inputs and the equation computes as
    # they arrive), not as one op of its spec: where those rules are finer than the letters (Reshape:
    # mshard._src.jaxpr.rules.reshape_rule's merged dims)
    as_traced = False
    _eager_fast = None                # the eager region's fast path (mshard._src.runtime.fastcall), set after an eager call
    _fast_hits = 0                    # its hits since it was set (mshard._src.frontend.direct_call)

    def __init__(self, name: str | None = None):
        self.name = name
        self.in_strategy: tuple[TensorStrategy | None, ...] | None = None
        self.out_strategy: tuple[TensorStrategy | None, ...] | None = None

    @property
    def kind(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        st = "" if self.in_strategy is None else f".shard({tuple(s.counts if s else None for s in self.in_strategy)})"
        return f"{self.kind}({self.name or ''}){st}"

    def shard(self, in_strategy: Any, out_strategy: Any = None) -> Primitive:
        """Set MindSpore's strategy: one split tuple (or Layout call / PartitionSpec) per tensor input."""
        where = f"{self.kind}{' ' + repr(self.name) if self.name else ''}"
        self.in_strategy = normalize_in_strategy(in_strategy, self.n_tensors, where)
        self.out_strategy = (None if out_strategy is None else
                             normalize_in_strategy(out_strategy, None, where + " out_strategy"))
        marks.bump_epoch()
        return self

    # -- to be defined by subclasses ------------------------------------------------------------
    def compute(self, *args):
        raise NotImplementedError

    def spec(self, shapes: Sequence[tuple[int, ...]], attrs: Sequence[Any]) -> tuple[
            tuple[Dims, ...], tuple[Dims, ...], frozenset[str]]:
        """(loop dims per input dim, loop dims per output dim, loop dims that must not be split)."""
        raise NotImplementedError

    # -- calling -----------------------------------------------------------------------------------
    def __call__(self, *args):
        if any(isinstance(a, nnx.Variable) for a in args):
            # MindSpore's ``self.matmul(x, self.weight)``: a Param (any nnx.Variable) is read as its value
            args = tuple(a[...] if isinstance(a, nnx.Variable) else a for a in args)
        fast = self._eager_fast
        if fast is not None and marks._state.region is None:
            # a repeated eager call: the op's compiled region, valid while the context, strategies (epoch) and
            # the arguments' shapes/dtypes are those it was built for (else, or on tracers: MISS and the full path)
            out = fast(args)
            if out is not MISS:
                hits = self._fast_hits = self._fast_hits + 1
                if hits == direct_call.HITS and type(out) is type(args[0]):
                    direct_call.enable(self, fast.stamp)     # the next calls skip this frame (mshard._src.frontend.direct_call)
                return out
        k = len(args) if self.n_tensors is None else self.n_tensors
        tensors, attrs = list(args[:k]), args[k:]
        fn = (lambda *t: self.compute(*t, *attrs))
        site = marks.call_site(tuple(tensors))
        if site is not CallSite.REGION:
            fn = self._copies(fn, tensors, attrs)
            if self.in_strategy is not None and site is CallSite.EAGER and _eager_sharded():
                if self._self_contained():
                    return self._eager(*args)          # PyNative: the op runs as its own sharded region
                self._warn_unresolved()
            elif self.in_strategy is not None and site is CallSite.USER_TRACE:
                if self._self_contained():
                    return call_in_user_trace(self, self._where(), lambda: self._region()(*args),
                                              lambda: fn(*tensors))
                if _eager_sharded():
                    self._warn_unresolved()
            return fn(*tensors)
        trace = marks.current_region()
        shapes = [tuple(jax.numpy.shape(t)) for t in tensors]
        in_dims, out_dims, fixed = self.spec(shapes, attrs)
        note = self._note(shapes, in_dims, out_dims, fixed, trace.device_num)
        fn = self._copies(fn, tensors, attrs, note, (in_dims, out_dims, fixed))
        with jax.named_scope(self.name) if self.name else _null():
            out = marks.annotate_call(fn, tensors, note)
        self._check_outputs(note, out)
        if self.out_strategy is not None:
            outs = jax.tree.leaves(out)
            if len(self.out_strategy) != len(outs):
                raise StrategyError(f"{self._where()}: out_strategy has {len(self.out_strategy)} entries but the op "
                                    f"has {len(outs)} output(s).")
            for j, (o, st) in enumerate(zip(outs, self.out_strategy)):
                if st is not None:
                    check_fits(st, o.shape, trace.device_num, f"{self._where()} output {j}")
        return out

    def _copies(self, fn, tensors, attrs, note: OpNote | None = None, spec=None):
        """``fn`` computed in the copies a Layout's ``interleaved_parallel`` asks (:mod:`mshard._src.frontend.interleave`),
        or ``fn`` itself. With the op's ``note`` and ``spec`` (in a region) each copy is annotated as the op with the
        strategy's device splits, so the search computes it where the strategy says."""
        if not _eager_sharded() or not any(s is not None and s.copies is not None for s in self.in_strategy or ()):
            return fn          # the modes that ignore strategies compute the op whole
        shapes = [tuple(jax.numpy.shape(t)) for t in tensors]
        in_dims, out_dims, fixed = spec or self.spec(shapes, attrs)
        ip = interleave.interleaved_dim(self._where(), self.in_strategy, in_dims)
        if ip is None:
            return fn
        if note is not None:
            strategy = tuple(None if s is None else dataclasses.replace(s, copies=None) for s in self.in_strategy)

            def each(i, fn, parts):
                part_shapes = [tuple(p.shape) for p in parts]
                halo, apart = self.halo(part_shapes)
                copy = OpNote(self.kind, self.name, strategy, None, tuple(part_shapes), tuple(in_dims),
                              tuple(out_dims), frozenset(fixed), tuple(sorted(halo.items())), apart)
                with jax.named_scope(f"copy{i}"):
                    return marks.annotate_call(fn, parts, copy)

            def merge(put_all, flat):
                # the copies' results, and the op's, laid out as the strategy computes them
                outs = [_result_strategy(strategy, note.loop_counts, in_dims, dims) for dims in out_dims]
                ins = tuple(st for st in outs for _ in range(ip[2]))
                return marks.annotate_call(put_all, flat, OpNote("shard", None, ins, tuple(outs),
                                                                 tuple(tuple(x.shape) for x in flat)))
        else:
            each = merge = None
        return interleave.in_copies(fn, self._where(), *ip, shapes, in_dims, out_dims, each, merge)

    def _self_contained(self) -> bool:
        """Whether the strategy names its own mesh (split tuples, a Layout, a NamedSharding), so the op alone can
        be a region; a bare PartitionSpec names axes of a mesh only a whole region defines."""
        sts = [s for s in tuple(self.in_strategy or ()) + tuple(self.out_strategy or ()) if s is not None]
        return all(s.mesh is not None or all(c > 0 for c in s.counts) for s in sts)

    def _warn_unresolved(self) -> None:
        if self.__dict__.get("_warned_eager"):
            return
        self._warned_eager = True
        warnings.warn(f"{self._where()}: called outside any region (eagerly, or under your own jax.jit / grad / "
                      f"vmap), its PartitionSpec strategy names mesh axes only an "
                      f"enclosing region defines, so it runs unsharded; give it a Layout or NamedSharding, or call "
                      f"it inside ms.jit / a sharded Cell.", StrategyIgnoredWarning, stacklevel=3)

    def _eager(self, *args):
        """An eager call of a primitive with a strategy, in semi_auto/auto_parallel: MindSpore's PyNative
        ``shard`` — the op alone is a region (planned from its strategy, compiled once per shapes), so its result
        keeps the planned layout."""
        bound = self.__dict__.get("_eager_bound")
        if bound is None:
            bound = self._eager_bound = self._region().bind()     # repeated calls skip re-keying the region
        out = bound(*args)
        if self._eager_fast is not bound._fast:
            self._eager_fast, self._fast_hits = bound._fast, 0
        return out

    def _region(self):
        """The op alone as a region (its eager calls, and its calls traced by the user's own jax.jit)."""
        if self.__dict__.get("_eager_region") is None:
            self._eager_region = Region(lambda *a: self(*a), name=self.name or self.kind)
        return self._eager_region

    def _check_outputs(self, note: OpNote, out) -> None:
        """A split carried to an output dim must divide it (e.g. MindSpore's reshape rule)."""
        counts = note.loop_counts
        for j, (o, dims) in enumerate(zip(jax.tree.leaves(out), note.out_dims)):
            for d, (size, letter) in enumerate(zip(o.shape, dims)):
                c = counts.get(letter, 1) if letter else 1
                if c > 1 and size % c:
                    raise StrategyError(f"{self._where()}: the strategy splits a dim {c} ways but output {j} dim {d} "
                                        f"has size {size} (shape {tuple(o.shape)}); it cannot keep that split. Use a "
                                        f"split that divides {size}.")

    def _where(self) -> str:
        return f"{self.kind}{' ' + repr(self.name) if self.name else ''}"

    def _note(self, shapes, in_dims, out_dims, fixed, device_num) -> OpNote:
        strategy = self.in_strategy
        if strategy is not None:
            check_strategy(self._where(), self.kind, shapes, in_dims, fixed, strategy, device_num)
        halo, apart = self.halo(shapes)
        return OpNote(self.kind, self.name, strategy or (None,) * len(shapes), self.out_strategy, tuple(shapes),
                      tuple(in_dims), tuple(out_dims), frozenset(fixed), tuple(sorted(halo.items())), apart,
                      as_traced=self.as_traced)

    def halo(self, shapes) -> tuple[dict[str, int], frozenset[str]]:
        """A windowed primitive's halo: (loop dim -> rows of its input beyond a device's block that it reads, the
        loop dims a search never splits together with a halo dim); none by default."""
        return {}, frozenset()


def _result_strategy(strategy, counts: dict[str, int], in_dims, out_dims) -> TensorStrategy:
    """An output's layout as the op's strategy computes it: each loop dim split as the inputs split it (``counts``:
    :attr:`OpNote.loop_counts`; the axes where the strategy names them)."""
    axes: dict[str, tuple[str, ...]] = {}
    mesh = None
    for st, dims in zip(strategy, in_dims):
        if st is None or st.axes is None:
            continue
        mesh = mesh or st.mesh
        for letter, a in zip(dims, st.axes):
            if letter is not None:
                axes.setdefault(letter, a)
    named = all(d is None or d in axes or counts.get(d, 1) == 1 for d in out_dims) and mesh is not None
    return TensorStrategy(tuple(counts.get(d, 1) if d else 1 for d in out_dims),
                          tuple(axes.get(d, ()) if d else () for d in out_dims) if named else None,
                          mesh if named else None)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return None


# -- spec helpers ---------------------------------------------------------------------------------
def broadcast_spec(shapes: Sequence[tuple[int, ...]]) -> tuple[tuple[Dims, ...], tuple[Dims, ...]]:
    """numpy broadcasting: output dim k is loop dim k; a size-1 input dim under a larger output dim is None."""
    rank = max((len(s) for s in shapes), default=0)
    out_shape = [1] * rank
    for s in shapes:
        for k, size in enumerate(s):
            j = rank - len(s) + k
            out_shape[j] = max(out_shape[j], size)
    letters = LETTERS[:rank]
    ins = []
    for s in shapes:
        off = rank - len(s)
        ins.append(tuple(None if (size == 1 and out_shape[off + k] != 1) else letters[off + k]
                         for k, size in enumerate(s)))
    return tuple(ins), (tuple(letters),)
