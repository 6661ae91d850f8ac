"""The operator graph every searcher works on. Pure Python + numpy: never import JAX here.

An op is described as an einsum-like *iteration space*:

* ``dims``: named loop dims with their sizes, in a fixed order, e.g. ``{"m": 64, "k": 32, "n": 16}``;
* ``in_dims[i]``: for operand ``i``, the loop dim of each of its tensor dims (``None`` for a dim
  that cannot follow a loop dim, e.g. a broadcast size-1 dim);
* ``out_dims[j]``: the same for result ``j``;
* a tensor dim may also map to a *tuple* of loop dims, major first: the dim is their product, as a
  reshape's merged dim is (``[64, 8] -> [4, 128]`` runs over loop dims ``(4, 16, 8)``: the operand's
  dim 0 is ``("a", "b")``, the result's dim 1 ``("b", "c")``). Its layout is the loop dims' axes in
  that order, and a loop dim in it may be split only when every loop dim before it is split whole
  (:meth:`Op.nested`): a device's block of the tensor dim is then one contiguous run;
* loop dims that no result uses are *reductions*; splitting one leaves partial results that
  are combined with ``op.reduce`` (an all-reduce, or a reduce-scatter into a split consumer).

``MatMul`` is ``dims={m,k,n}, in_dims=[("m","k"), ("k","n")], out_dims=[("m","n")]``;
``MatMul(transpose_b=True)`` is ``in_dims=[("m","k"), ("n","k")]``.

Every graph input (data batch, parameter, constant) is the single result of a *source op*
(``kind`` ``"data"``, ``"param"`` or ``"const"``) with no operands, so every tensor has
exactly one producer and every edge is producer op -> consumer op.

A *strategy* of an op assigns mesh axes to its loop dims: a tuple with one entry per loop dim
(in ``dims`` order), each entry a tuple of mesh-axis indices (``()`` = not split). An axis is
used by at most one loop dim of an op. The split count of a loop dim is the product of its
axes' sizes; MindSpore's strategy tuple of operand ``i`` is, per tensor dim, the split count
of the loop dim it maps to (:func:`split_counts`). The layout of a tensor under a strategy is,
per tensor dim, the axes of its loop dim (:func:`operand_layout`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import SearchGraphError

Axes = tuple[int, ...]
Strategy = tuple[Axes, ...]          # one entry per loop dim, in op.dims order
TensorLayout = tuple[Axes, ...]      # one entry per tensor dim
Label = str | tuple[str, ...] | None  # the loop dim(s) of one tensor dim (a tuple: their product, major first)


def parts(label: Label) -> tuple[str, ...]:
    """The loop dims a tensor dim maps to: ``()`` for None, ``(d,)`` for one, the tuple itself for several.

    >>> parts(None), parts("m"), parts(("a", "b"))
    ((), ('m',), ('a', 'b'))
    """
    if label is None:
        return ()
    return (label,) if isinstance(label, str) else tuple(label)


def label_axes(where: dict, label: Label) -> Axes:
    """The mesh axes of a tensor dim mapped to ``label``, given each loop dim's axes ``where``."""
    if label is None:
        return ()
    if isinstance(label, str):
        return where[label]
    return tuple(a for d in label for a in where[d])


def hand_out(dims: tuple[int, ...], axes: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]
             ) -> dict[int, tuple[int, ...]]:
    """The axes of a tensor dim made of loop dims ``dims`` (major first) given to them: each takes the next axes
    until it is split into its size; what no loop dim can take whole (a split that does not divide) is left.

    >>> hand_out((0, 1), (0, 1, 2), (4, 16), (2, 2, 2))
    {0: (0, 1), 1: (2,)}
    """
    got: dict[int, tuple[int, ...]] = {}
    rest = list(axes)
    for d in dims:
        take: list[int] = []
        while rest and math.prod(shape[a] for a in take) < sizes[d]:
            take.append(rest.pop(0))
        n = math.prod(shape[a] for a in take)
        if sizes[d] % n:
            break
        got[d] = tuple(take)
        if n < sizes[d]:
            break
    return got

SOURCE_KINDS = frozenset({"data", "param", "const"})
# ops a traced program shows as one op over a body it does not inline (a loop or a branch: mshard._src.jaxpr.rules): their own
# cost does not model the body, so a split of a carry is no cheaper for them than the cost model says
OPAQUE_KINDS = frozenset({"scan", "while", "cond"})


@dataclass(frozen=True)
class DeviceMesh:
    """The searcher's view of the device mesh: axis sizes, names and link speeds.

    >>> DeviceMesh((2, 2, 2)).size
    8
    """

    shape: tuple[int, ...]
    names: tuple[str, ...] = ()
    bandwidth: tuple[float, ...] = ()   # bytes/s per axis; default 100 GB/s each
    latency: tuple[float, ...] = ()     # seconds per collective per axis; default 5 us each

    def __post_init__(self) -> None:
        n = len(self.shape)
        if not self.names:
            object.__setattr__(self, "names", tuple(f"d{i}" for i in range(n)))
        if not self.bandwidth:
            object.__setattr__(self, "bandwidth", (100e9,) * n)
        if not self.latency:
            object.__setattr__(self, "latency", (5e-6,) * n)
        if not (len(self.names) == len(self.bandwidth) == len(self.latency) == n):
            raise SearchGraphError("DeviceMesh: names, bandwidth and latency need one entry per axis")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def count(self, axes: Iterable[int | str]) -> int:
        """Number of devices spanned by ``axes`` (axis indices or names)."""
        return math.prod(self.shape[a if isinstance(a, int) else self.names.index(a)] for a in axes)

    def axis_size(self, name: str) -> int:
        """The size of the axis called ``name``."""
        return self.shape[self.names.index(name)]

    @property
    def all_prime(self) -> bool:
        """Every axis has a prime size: any split whose product divides the size fits in any order."""
        return all(s == 1 or prime_factors(s) == [s] for s in self.shape)

    @staticmethod
    def prime(n: int) -> DeviceMesh:
        """One axis per prime factor of ``n`` (docs/design.md §2, mesh rule): 8 -> (2, 2, 2), 12 -> (2, 2, 3)."""
        return DeviceMesh(tuple(prime_factors(n)))


def prime_factors(n: int) -> list[int]:
    """Prime factors of ``n`` in ascending order (``[]`` for 1)."""
    if n < 1:
        raise SearchGraphError(f"prime_factors: n must be >= 1, got {n}")
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    if n > 1:
        out.append(n)
    return out


@dataclass
class Tensor:
    id: int
    shape: tuple[int, ...]
    itemsize: int = 4
    name: str = ""
    producer: int = -1                 # op id; every tensor has exactly one
    consumers: list[int] = field(default_factory=list)   # op ids, program order, repeats allowed

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclass
class Op:
    id: int
    name: str
    kind: str                                   # JAX primitive name, MindSpore op kind or a source kind
    dims: dict[str, int]                        # loop dim -> size, ordered
    inputs: list[int]                           # tensor ids
    in_dims: list[tuple[Label, ...]]            # per operand: loop dim(s) per tensor dim
    outputs: list[int]
    out_dims: list[tuple[Label, ...]]
    reduce: str = "sum"                         # combiner of partial results: sum|max|min|prod|and|or
    unsplittable: frozenset[str] = frozenset()  # loop dims that may not be split
    flops: float | None = None                  # None: prod(dims) (x2 when there is a reduction)
    fixed: Strategy | None = None               # a user strategy: searchers never change it
    layer: str | None = None                    # repeated-layer key (ops of identical layers share it)
    split_limit: dict[str, int] | None = None   # loop dim -> a split of it must also divide this (reshape)
    free_devices: bool = False                  # fully_use_devices does not apply (a training step's backward and
                                                # update, which MindSpore derives from the forward, not searches)
    derived: bool = False                       # computed from the forward: a training step's backward and update,
                                                # which MindSpore derives from the forward strategies and the
                                                # parameters' layouts (sharding_propagation does not spread into them)
    follow_operand: int | None = None           # this operand keeps its producer's layout: the op's strategy is
                                                # tied to the producer's (mshard's writeback: state stored in place)
    latency_share: float = 1.0                  # the part of a latency its partial-sum all-reduces pay: 1/k for the k
                                                # reductions XLA combines into one (mark_merged_reductions)
    merge_group: int = -1                       # which of those sets (mark_merged_reductions); -1: none
    halo: dict[str, int] | None = None          # loop dim -> rows of an operand beyond a device's block it reads (a
                                                # convolution window): splitting it costs a halo exchange
    halo_apart: frozenset[str] = frozenset()    # loop dims never split together with a split halo dim (XLA's
                                                # partitioner miscompiles the pair: mshard._src.planning.xla_guards)
    scatter: bool = False                       # its partial result, read by one op, may be reduce-scattered into
                                                # the layout that op reads it in (searchers.cost.scatter_saving)
    share_scope: int = 0                        # reads of one value in one layout share one redistribution only
                                                # within a scope: a recomputed layer's reads run again (XLA does not
                                                # share values across a jax.checkpoint boundary)
    read_only: frozenset[str] = frozenset()     # operand loop dims no result uses that are not reduced either: a
                                                # scan's constants and scanned inputs, which its body reads
    scanned_from: int | None = None             # a loop's first scanned operand: one moved to a layout that keeps
                                                # the scanned dim whole is moved slice by slice inside the loop, by
                                                # each loop that reads it (share_key)

    def split_sizes(self) -> tuple[int, ...]:
        """Per loop dim, the number a split count must divide (its size, or gcd with its split_limit)."""
        lim = self.split_limit or {}
        return tuple(math.gcd(n, lim[d]) if d in lim else n for d, n in self.dims.items())

    def apart(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(indices of the halo dims, indices of the ``halo_apart`` dims) in ``dims`` order: no candidate strategy
        splits one of each (``((), ())`` for an op without a halo)."""
        if not self.halo:
            return (), ()
        names = list(self.dims)
        return (tuple(i for i, d in enumerate(names) if self.halo.get(d)),
                tuple(i for i, d in enumerate(names) if d in self.halo_apart))

    def nested(self) -> tuple[tuple[int, tuple[tuple[int, int], ...]], ...]:
        """For each loop dim that is a minor part of a tensor dim mapped to several loop dims: (its index, the
        (index, size) of every loop dim before it there). No candidate splits it unless each of those is split
        into its size (a device's block of the tensor dim stays one contiguous run). ``()`` for most ops.

        >>> g = Graph(DeviceMesh((2, 2, 2)))
        >>> x = g.source("x", (64, 8))
        >>> _ = g.add_op("r", "reshape", {"a": 4, "b": 16, "c": 8}, [x], [(("a", "b"), "c")], [("a", ("b", "c"))],
        ...              out_shapes=[(4, 128)])
        >>> g.ops[1].nested()
        ((1, ((0, 4),)), (2, ((1, 16),)))
        """
        idx = {d: i for i, d in enumerate(self.dims)}
        out: dict[int, tuple[tuple[int, int], ...]] = {}
        for labels in (*self.in_dims, *self.out_dims):
            for lab in labels:
                if lab is None or isinstance(lab, str):
                    continue
                for k in range(1, len(lab)):
                    before = tuple((idx[d], self.dims[d]) for d in lab[:k])
                    out[idx[lab[k]]] = tuple(sorted(set(out.get(idx[lab[k]], ())) | set(before)))
        return tuple(sorted(out.items()))

    @property
    def dim_names(self) -> tuple[str, ...]:
        return tuple(self.dims)

    @property
    def reduction_dims(self) -> tuple[str, ...]:
        used = {d for od in self.out_dims for lab in od for d in parts(lab)} | self.read_only
        return tuple(d for d in self.dims if d not in used)

    @property
    def is_source(self) -> bool:
        return self.kind in SOURCE_KINDS

    @property
    def any_devices(self) -> bool:
        """Whether ``fully_use_devices`` leaves this op free to idle devices (:func:`may_idle`)."""
        return may_idle(bool(self.inputs), self.free_devices)

    def compute_flops(self) -> float:
        if self.flops is not None:
            return float(self.flops)
        if self.is_source:
            return 0.0
        base = float(math.prod(self.dims.values()))
        return 2.0 * base if self.reduction_dims else base


@dataclass
class Graph:
    """A dataflow graph of ops in program order (every op after its operands' producers).

    >>> g = Graph(DeviceMesh.prime(8))
    >>> x = g.source("x", (64, 32), kind="data")
    >>> w = g.source("w", (32, 16), kind="param")
    >>> (y,) = g.add_op("mm/dot_general", "dot_general", {"m": 64, "k": 32, "n": 16},
    ...                 [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    >>> g.ops[-1].reduction_dims
    ('k',)
    """

    mesh: DeviceMesh
    ops: list[Op] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)   # tensor ids returned by the region
    # op id -> (op, operand): the op (an identity) gives its result the layout that op computes that operand in (a
    # marked operand read again after its op, e.g. a backward residual); applied after a search, exactly in
    # searchers.follow (see operand_tied_strategy)
    operand_ties: dict[int, tuple[int, int]] = field(default_factory=dict)

    # -- building -----------------------------------------------------------------------------
    def _tensor(self, shape: Sequence[int], itemsize: int, name: str, producer: int) -> int:
        t = Tensor(len(self.tensors), tuple(int(s) for s in shape), itemsize, name, producer)
        self.tensors.append(t)
        return t.id

    def source(self, name: str, shape: Sequence[int], kind: str = "data", itemsize: int = 4,
               fixed: Strategy | None = None) -> int:
        """Add a source op (graph input) and return the id of its tensor."""
        if kind not in SOURCE_KINDS:
            raise SearchGraphError(f"Graph.source: kind must be one of {sorted(SOURCE_KINDS)}, got {kind!r}")
        dims = {f"s{i}": int(s) for i, s in enumerate(shape)}
        op = Op(len(self.ops), name, kind, dims, [], [], [], [tuple(dims)], fixed=fixed)
        self.ops.append(op)
        tid = self._tensor(shape, itemsize, name, op.id)
        op.outputs.append(tid)
        return tid

    def add_op(self, name: str, kind: str, dims: dict[str, int], inputs: Sequence[int],
               in_dims: Sequence[Sequence[Label]], out_dims: Sequence[Sequence[Label]],
               out_shapes: Sequence[Sequence[int]] | None = None, itemsize: int = 4, **kw: Any) -> list[int]:
        """Add an op; returns its result tensor ids. ``out_shapes`` defaults to the loop-dim sizes."""
        canon = lambda labels: tuple(lab if lab is None or isinstance(lab, str) else tuple(lab) for lab in labels)
        op = Op(len(self.ops), name, kind, dict(dims), list(inputs),
                [canon(d) for d in in_dims], [], [canon(d) for d in out_dims], **kw)
        if len(op.in_dims) != len(op.inputs):
            raise SearchGraphError(f"{name}: {len(op.inputs)} inputs but {len(op.in_dims)} in_dims")
        k = op.follow_operand
        if k is not None and not (0 <= k < len(op.inputs) and set(op.dims) <= set(op.in_dims[k])):
            raise SearchGraphError(f"{name}: follow_operand={k} must name an operand that uses every loop dim "
                             f"(its layout then decides the op's strategy); operands: {op.in_dims}")
        for tid, idims in zip(op.inputs, op.in_dims):
            t = self.tensors[tid]
            if len(idims) != len(t.shape):
                raise SearchGraphError(f"{name}: operand {t.name or tid} has rank {len(t.shape)}, in_dims {idims}")
            for size, d in zip(t.shape, idims):
                if d is not None and math.prod(dims[x] for x in parts(d)) != size:
                    raise SearchGraphError(f"{name}: operand dim of size {size} mapped to loop dim(s) {d} of "
                                           f"sizes {[dims[x] for x in parts(d)]}")
            t.consumers.append(op.id)
        self.ops.append(op)
        for j, od in enumerate(op.out_dims):
            shape = out_shapes[j] if out_shapes is not None else [math.prod(dims[x] for x in parts(d)) for d in od]
            op.outputs.append(self._tensor(shape, itemsize, f"{name}:{j}", op.id))
        return list(op.outputs)

    # -- queries ------------------------------------------------------------------------------
    def producer(self, tid: int) -> Op:
        return self.ops[self.tensors[tid].producer]

    def edges(self) -> Iterable[tuple[int, int, int, int]]:
        """(producer op, consumer op, tensor id, operand index) for every use of a tensor."""
        for op in self.ops:
            for i, tid in enumerate(op.inputs):
                yield self.tensors[tid].producer, op.id, tid, i

    def __len__(self) -> int:
        return len(self.ops)


# -- strategies and layouts -----------------------------------------------------------------
def operand_layout(op: Op, strategy: Strategy, index: int) -> TensorLayout:
    """Layout (axes per tensor dim) operand ``index`` must have under ``strategy``."""
    where = dict(zip(op.dims, strategy))
    return tuple(label_axes(where, d) for d in op.in_dims[index])


def result_layout(op: Op, strategy: Strategy, index: int = 0) -> TensorLayout:
    """Layout of result ``index`` under ``strategy`` after partial sums are resolved."""
    where = dict(zip(op.dims, strategy))
    return tuple(label_axes(where, d) for d in op.out_dims[index])


def strategy_of_layout(op: Op, layout: TensorLayout, operand: int | None = None,
                       mesh: DeviceMesh | None = None) -> Strategy:
    """The strategy that gives result 0 (or operand ``operand``) of ``op`` the tensor ``layout``, every loop
    dim that tensor does not map left unsplit: the inverse of :func:`result_layout` for ops whose loop dims
    are one tensor's dims (sources, elementwise ops, marks).

    A tensor dim mapped to several loop dims hands its axes out major first, each loop dim taking axes until
    it is split into its size (``mesh`` gives the axes' sizes; required for such a dim).

    >>> g = Graph(DeviceMesh((2, 2)))
    >>> x = g.source("x", (4, 6))
    >>> strategy_of_layout(g.ops[0], ((), (0, 1)))
    ((), (0, 1))
    """
    dims = op.out_dims[0] if operand is None else op.in_dims[operand]
    where: dict[str, tuple[int, ...]] = {}
    for lab, axes in zip(dims, layout):
        if lab is None:
            continue
        if isinstance(lab, str):
            where[lab] = tuple(axes)
            continue
        if axes and mesh is None:
            raise SearchGraphError(f"{op.name}: a layout of a dim made of loop dims {lab} needs the mesh")
        rest = list(axes)
        for k, d in enumerate(lab):
            got: list[int] = []
            while rest and (k == len(lab) - 1 or mesh.count(got) < op.dims[d]):
                got.append(rest.pop(0))
            where[d] = tuple(got)
    return tuple(where.get(d, ()) for d in op.dims)


def operand_tied_strategy(graph: Graph, op: Op, strategies: Sequence[Strategy | None] | dict) -> Strategy | None:
    """For an op in ``graph.operand_ties``: the strategy that gives its result the layout its tied op computes
    the tied operand in under ``strategies``; None for any other op or while that op is undecided.

    >>> g = Graph(DeviceMesh((2,)))
    >>> w = g.source("w", (4, 6))
    >>> _ = g.add_op("mm", "dot_general", {"k": 4, "n": 6}, [w], [("k", "n")], [("n",)])
    >>> _ = g.add_op("res", "residual", {"i": 4, "j": 6}, [w], [("i", "j")], [("i", "j")])
    >>> g.operand_ties[2] = (1, 0)
    >>> operand_tied_strategy(g, g.ops[2], {0: ((), ()), 1: ((), (0,))})
    ((), (0,))
    """
    tie = graph.operand_ties.get(op.id)
    if tie is None:
        return None
    other, k = graph.ops[tie[0]], tie[1]
    s = strategies[other.id]
    if s is None:
        return None
    return strategy_of_layout(op, operand_layout(other, s, k))


def tied_strategy(graph: Graph, op: Op, strategies: Sequence[Strategy | None]) -> Strategy | None:
    """For an op with ``follow_operand = k``: the strategy that gives operand ``k`` its producer's result
    layout under ``strategies`` (indexed by op id); None for any other op. Greedy searchers apply the
    tie with it after their search; the exact ones search under it.

    >>> g = Graph(DeviceMesh((2,)))
    >>> w = g.source("w", (4, 6))
    >>> _ = g.add_op("wb", "writeback", {"i": 4, "j": 6}, [w, w], [("i", "j")] * 2, [("i", "j")], follow_operand=1)
    >>> tied_strategy(g, g.ops[1], [((), (0,)), ((0,), ())])
    ((), (0,))
    """
    k = op.follow_operand
    if k is None:
        return None
    tid = op.inputs[k]
    p = graph.ops[graph.tensors[tid].producer]
    s = strategies[p.id]
    if s is None:
        return None
    return strategy_of_layout(op, result_layout(p, s, p.outputs.index(tid)), k)


def split_count(layout: TensorLayout, shape: tuple[int, ...]) -> int:
    """How many blocks ``layout`` cuts a tensor into on a mesh of ``shape`` (the product of the sizes of the mesh axes
    it uses): the divisor of a tensor's bytes per device, for the cost model and the memory profile alike; given a
    strategy, the number of devices it spreads the op's work over.

    >>> split_count(((0,), (), (1, 2)), (2, 3, 4))
    24
    """
    n = 1
    for axes in layout:
        for a in axes:
            n *= shape[a]
    return n


def may_idle(has_operands: bool, free_devices: bool) -> bool:
    """The one rule of what ``fully_use_devices`` leaves free to idle devices, for an :class:`Op` and for an op shape
    (:func:`searchers.spec.all_devices`): an op with no operands (a source, an iota, a constant: its layout follows
    its users, as in MindSpore) and an op marked ``free_devices``.

    >>> may_idle(False, False), may_idle(True, True), may_idle(True, False)
    (True, True, False)
    """
    return not has_operands or free_devices


def pinned_strategy(graph: Graph, op: Op, strategies: Sequence[Strategy | None]) -> Strategy | None:
    """The strategy no default chooses for ``op``: its user strategy (``fixed``), its tie (``follow_operand``:
    :func:`tied_strategy`; ``graph.operand_ties``: :func:`operand_tied_strategy`, replicated while the tied op is
    undecided); None for an op a default or a search decides. The one dispatch the baselines and semi_auto's
    default share.

    >>> g = Graph(DeviceMesh((2,)))
    >>> w = g.source("w", (4, 6), fixed=((0,), ()))
    >>> _ = g.add_op("wb", "writeback", {"i": 4, "j": 6}, [w, w], [("i", "j")] * 2, [("i", "j")], follow_operand=1)
    >>> _ = g.add_op("neg", "neg", {"i": 4, "j": 6}, [w], [("i", "j")], [("i", "j")])
    >>> [pinned_strategy(g, op, [((0,), ()), None, None]) for op in g.ops]
    [((0,), ()), ((0,), ()), None]
    """
    if op.fixed is not None:
        return tuple(tuple(a) for a in op.fixed)
    if op.follow_operand is not None:
        return tied_strategy(graph, op, strategies) or replicated(op)
    if op.id in graph.operand_ties:
        return operand_tied_strategy(graph, op, strategies) or replicated(op)
    return None


def stored_tensors(graph: Graph) -> frozenset[int]:
    """Tensors computed from stored state alone: a parameter, its casts and transposes, a constant times it (the
    rule :func:`searchers.follow.follow_operands` takes such operands' axes after the others' by). A loop's body
    reads them as parameters (``mshard._src.planning.scan_bodies``).

    >>> g = Graph(DeviceMesh.prime(8))
    >>> w = g.source("w", (16, 32), kind="param"); x = g.source("x", (8, 16))
    >>> wt = g.add_op("t", "transpose", {"a": 16, "b": 32}, [w], [("a", "b")], [("b", "a")])[0]
    >>> sorted(stored_tensors(g)) == [w, wt]
    True
    """
    stored: set[int] = set()
    for op in graph.ops:
        if (op.kind == "param" if op.is_source else op.inputs and any(t in stored for t in op.inputs) and all(
                t in stored or graph.producer(t).kind == "const" for t in op.inputs)):
            stored.update(op.outputs)
    return frozenset(stored)


def constant_tensors(graph: Graph) -> frozenset[int]:
    """Tensors computed from constants alone (no data, no parameter upstream), e.g. the ones a
    ``sum``'s gradient broadcasts, or from an op with no operands (an iota: a causal mask, positions).
    Every device can compute them in any layout, so moving one between layouts costs nothing: XLA
    re-broadcasts it locally.

    >>> g = Graph(DeviceMesh((2,)))
    >>> c, x = g.source("one", (4,), kind="const"), g.source("x", (4,))
    >>> _ = g.add_op("neg", "neg", {"i": 4}, [c], [("i",)], [("i",)])
    >>> _ = g.add_op("mul", "mul", {"i": 4}, [x, g.ops[2].outputs[0]], [("i",), ("i",)], [("i",)])
    >>> sorted(constant_tensors(g))
    [0, 2]
    """
    out: set[int] = set()
    for op in graph.ops:
        if op.kind == "const" or (not op.is_source and all(t in out for t in op.inputs)):
            out.update(op.outputs)
    return frozenset(out)


_SINKS = frozenset({"writeback", "shard_map_in", "shard_map_in_partial"})   # unread results still used (dead_ops)
# The inputs of a shard_map manual over some mesh axes only (a pipeline's stages): the body reads them, so what
# computes them runs, but their in_specs say nothing of the other axes, on which an input stays where it arrives.
# The program's price (graph_cost(shared=True), the plan) charges no move into them: whoever emits the body prices
# it (mshard._src.training.pipeline.price). The searchers' objective still charges it, which draws an input split
# over the stages to be stored so.
UNPRICED_READERS = frozenset({"shard_map_in_partial"})


def dead_ops(graph: Graph) -> frozenset[int]:
    """Ops whose results reach neither a region result nor a ``writeback`` (a loss a step computes and drops): the
    compiled program does not run them (XLA removes dead code), so the program's cost leaves them out.

    >>> g = Graph(DeviceMesh((2,)))
    >>> x = g.source("x", (4,))
    >>> (y,) = g.add_op("neg", "neg", {"i": 4}, [x], [("i",)], [("i",)])
    >>> _ = g.add_op("exp", "exp", {"i": 4}, [x], [("i",)], [("i",)])
    >>> g.outputs.append(y)
    >>> sorted(dead_ops(g))
    [2]
    """
    live_tensors = set(graph.outputs)
    dead: set[int] = set()
    for op in reversed(graph.ops):        # ops are in program order: every reader comes after its producer
        # a shard_map's inputs (its boundary, ``shard_map_in``) are read by the manual body, which the graph does not
        # hold: the move into its in_specs runs whenever the shard_map does (a gradient bucket's, always)
        if op.kind in _SINKS or not op.outputs or any(t in live_tensors for t in op.outputs):
            live_tensors.update(op.inputs)
        else:
            dead.add(op.id)
    return frozenset(dead)


def share_key(op: Op, index: int, tid: int, have: TensorLayout, want: TensorLayout) -> tuple:
    """The key under which readers of tensor ``tid`` share one redistribution from ``have`` to ``want``: the reader's
    scope (``Op.share_scope``), or, for a scanned operand a loop moves slice by slice inside itself
    (``Op.scanned_from``), that loop alone.

    >>> g = Graph(DeviceMesh((2,)))
    >>> w = g.source("w", (3, 4))
    >>> _ = g.add_op("loop", "scan", {"l": 3, "i": 4}, [w], [("l", "i")], [("l", "i")], scanned_from=0)
    >>> share_key(g.ops[1], 0, w, ((), (0,)), ((), ())), share_key(g.ops[1], 0, w, ((0,), ()), ((), ()))
    ((0, ('loop', 1)), (0, 0))
    """
    if (op.scanned_from is not None and index >= op.scanned_from and have != want and have and want
            and not have[0] and not want[0]):
        return (tid, ("loop", op.id))
    return (tid, op.share_scope)


def partial_axes(op: Op, strategy: Strategy) -> Axes:
    """Mesh axes over which the results are partial (axes of split reduction dims)."""
    where = dict(zip(op.dims, strategy))
    return tuple(sorted(a for d in op.reduction_dims for a in where[d]))


def split_counts(op: Op, strategy: Strategy, mesh: DeviceMesh) -> tuple[tuple[int, ...], ...]:
    """MindSpore's strategy tuple: per operand, the split count of each tensor dim."""
    return tuple(tuple(mesh.count(ax) for ax in operand_layout(op, strategy, i))
                 for i in range(len(op.inputs)))


def replicated(op: Op) -> Strategy:
    return tuple(() for _ in op.dims)


def layer_instances(graph: Graph) -> list[tuple[str, list[int]]]:
    """Copies of repeated layers: ``(layer key, op ids)`` for every maximal run of consecutive
    ops that share a ``layer`` key and the first component of their name scope (``block3/...``).
    Copies of one layer share the key; ops without a key belong to no copy.

    >>> g = Graph(DeviceMesh((2,)))
    >>> x = g.source("x", (4,))
    >>> for i in range(2):
    ...     (x,) = g.add_op(f"blk{i}/neg", "neg", {"i": 4}, [x], [("i",)], [("i",)], layer="blk")
    ...     (x,) = g.add_op(f"blk{i}/exp", "exp", {"i": 4}, [x], [("i",)], [("i",)], layer="blk")
    >>> layer_instances(g)
    [('blk', [1, 2]), ('blk', [3, 4])]
    """
    out: list[tuple[str, list[int]]] = []
    prev: tuple[str, str] | None = None
    for op in graph.ops:
        if op.layer is None:
            prev = None
            continue
        here = (op.layer, op.name.split("/", 1)[0])
        if here != prev:
            out.append((op.layer, []))
            prev = here
        out[-1][1].append(op.id)
    return out


def mark_merged_reductions(graph: Graph) -> int:
    """Sort the ops with a reduction dim into the sets whose all-reduces XLA's combiner merges, and give each op of a
    set of k ``latency_share = 1/k`` and the set's ``merge_group``; returns the size of the final set (group 0).

    XLA's all-reduce combiner merges all-reduces that do not depend on one another into one collective: a data-
    parallel training step compiles to one all-reduce of every gradient and the loss, not one per parameter. The
    sets:

    - group 0, the final set: the ops whose results flow only into the region's results or a ``writeback`` and
      after which every reduction is a marked ``reduce_sum`` (a gradient's reduction in a training step: the
      weight-gradient product, a bias gradient's sum, also when a second sum follows it; the loss's sum). A sum over
      the batch, then over the sequence: at most one of the two is split in a plan that keeps the batch split.
      Before such chains were marked (a reduction after another excluded it), a GPT training step's two-stage bias
      and norm gradients paid a latency each here while XLA merged them, and dynamic_programming preferred
      gathering the batch for them: 3.2x data parallel's bytes.
    - groups 1, 2, ...: every other reduction, by its depth, the longest chain of such reductions after it (Mirsky's
      partition of a partial order into antichains: two reductions of one depth never depend on one another, and
      there are as many groups as the longest chain has reductions). A batch norm's mean and mean square, or a
      layer's three projections, are one set; a forward's next product is the next set. Before these sets, a
      data-parallel conv+BatchNorm training step priced 7 latencies, where XLA compiled 5 all-reduces, and
      recursive_programming's plan of 7 collectives (0.0127) undercut it.

    Their all-reduces cost their bytes and share one latency per set (:mod:`searchers.cost`; the plan's cost,
    ``graph_cost(shared=True)``, charges one per set and set of mesh axes).

    >>> g = Graph(DeviceMesh((2,)))
    >>> x, w = g.source("x", (4, 3)), g.source("w", (3, 2), kind="param")
    >>> (gw,) = g.add_op("dw", "dot_general", {"k": 3, "m": 4, "n": 2}, [x, x], [("m", "k"), ("m", "k")],
    ...                  [("k", "n")])
    >>> (nw,) = g.add_op("upd", "add", {"k": 3, "n": 2}, [w, gw], [("k", "n")] * 2, [("k", "n")])
    >>> _ = g.add_op("wb", "writeback", {"k": 3, "n": 2}, [nw, w], [("k", "n")] * 2, [("k", "n")], follow_operand=1)
    >>> (s,) = g.add_op("loss", "reduce_sum", {"m": 4, "k": 3}, [x], [("m", "k")], [()])
    >>> g.outputs.append(s)
    >>> mark_merged_reductions(g), [(op.name, op.latency_share) for op in g.ops if op.latency_share != 1.0]
    (2, [('dw', 0.5), ('loss', 0.5)])
    >>> h = Graph(DeviceMesh((2,)))
    >>> y = h.source("y", (4, 3))
    >>> (a,) = h.add_op("sum_y", "reduce_sum", {"m": 4, "k": 3}, [y], [("m", "k")], [("k",)])
    >>> (y2,) = h.add_op("sq", "mul", {"m": 4, "k": 3}, [y, y], [("m", "k")] * 2, [("m", "k")])
    >>> (b,) = h.add_op("sum_sq", "reduce_sum", {"m": 4, "k": 3}, [y2], [("m", "k")], [("k",)])
    >>> (c,) = h.add_op("both", "add", {"k": 3}, [a, b], [("k",)] * 2, [("k",)])
    >>> (d,) = h.add_op("total", "reduce_sum", {"k": 3}, [c], [("k",)], [()])
    >>> mark_merged_reductions(h), [(op.name, op.merge_group, op.latency_share) for op in h.ops if op.merge_group >= 0]
    (0, [('sum_y', 2, 0.5), ('sum_sq', 2, 0.5), ('total', 1, 1.0)])
    """
    n = len(graph.ops)
    out = set(graph.outputs)
    to_end = [False] * n         # a writeback or a region result is reached
    final = [False] * n          # marked: reduces, reaches the end, and every reduction after it is marked too
    unmarked_after = [False] * n  # an op with a reduction dim that is not marked is reached
    depth = [0] * n              # the most unmarked reductions on a path after the op
    for op in reversed(graph.ops):
        to_end[op.id] = any(t in out for t in op.outputs)
        for t in op.outputs:
            for c in graph.tensors[t].consumers:
                cop = graph.ops[c]
                to_end[op.id] = to_end[op.id] or cop.kind == "writeback" or to_end[c]
                # a later sum that is itself marked does not count (a bias gradient summed over the batch, then
                # the sequence); any other later reduction does (a forward's next product)
                blocks = bool(cop.reduction_dims) and not (final[c] and cop.kind == "reduce_sum")
                unmarked_after[op.id] = unmarked_after[op.id] or blocks or unmarked_after[c]
                depth[op.id] = max(depth[op.id], depth[c] + (bool(cop.reduction_dims) and not cop.is_source
                                                             and not final[c]))
        final[op.id] = bool(op.reduction_dims) and not op.is_source and to_end[op.id] and not unmarked_after[op.id]
    members: dict[int, list[Op]] = {}
    for op in graph.ops:
        op.latency_share, op.merge_group = 1.0, -1
        if op.reduction_dims and not op.is_source:
            members.setdefault(0 if final[op.id] else depth[op.id] + 1, []).append(op)
    for group, ops in members.items():
        for op in ops:
            op.latency_share, op.merge_group = 1.0 / len(ops), group
    return len(members.get(0, ()))
