"""The cost model: compute, communication and memory of ops and of redistributions.

Units:

* ``compute``: seconds per device, ``flops / devices used / CostParams.flops_per_s``;
* ``comm_bytes``: bytes sent per device, per collective kind (``"all-reduce"``,
  ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"``), ring formulas (docs/algorithms.md §2);
* ``comm_time``: seconds, alpha-beta per mesh axis: one ``latency`` per collective (the largest of the
  axes it spans: XLA emits one collective over the device group, however many axes the group spans),
  plus bytes / ``bandwidth[axis]`` (a collective over several axes runs at the slowest);
* ``memory``: bytes per device of an op's operands and results (a redistribution: 0);
* ``total``: ``alpha * compute + beta * comm_time + gamma * memory / memory_unit`` — MindSpore's
  weights. ``memory_unit`` (default 1 GiB) keeps the memory term a tie-breaker: with memory in
  plain bytes, ``gamma=0.001`` would outweigh every other term by orders of magnitude; set
  ``memory_unit=1`` for the literal formula.

An op's partial results (split reduction dims) are resolved inside the op by all-reduces, one per split
reduction dim as XLA compiles them. XLA's all-reduce combiner merges a training step's gradient all-reduces
(none depends on another) into one collective: the k ops of that set
(:func:`~searchers.graph.mark_merged_reductions`) pay their bytes and 1/k of a latency each. The
consumer then slices for free, so ``"reduce-scatter"`` stays 0 in this model (a searcher that
fuses the two may charge ``S_local * (k-1) / k`` instead). :func:`graph_cost` memory is the sum of
the ops' memories: a proxy that counts a tensor at its producer and at each consumer, not a
peak; searchers with a memory limit should use per-op memory.

Every function is memoised on hashable keys (the op's :class:`~searchers.spec.OpSpec`, the
layouts, the mesh and the params), so repeated layers cost one evaluation.

>>> from searchers.graph import DeviceMesh
>>> m = DeviceMesh((2, 2))
>>> c = redistribution_cost(((0,), ()), ((), ()), (8, 8), 4, m, CostParams())
>>> c.comm_bytes["all-gather"], round(c.comm_time * 1e6, 5)   # 128 B local, 1 more shard: 128 B
(128.0, 5.00128)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType

from .direct_reshard import best_steps, cheaper_than_xla, depends_on_direct
from .direct_reshard import plan as direct_plan
from .errors import SearchGraphError
from .graph import (
    UNPRICED_READERS,
    DeviceMesh,
    Graph,
    Op,
    Strategy,
    TensorLayout,
    constant_tensors,
    dead_ops,
    operand_layout,
    share_key,
    split_count,
)
from .spec import OpSpec, layout_of, op_spec

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclass(frozen=True)
class CostParams:
    """Weights and machine constants of the cost model (see the module docstring for units)."""

    alpha: float = 1.0                              # weight of compute (seconds)
    beta: float = 400.0                             # weight of communication (seconds)
    gamma: float = 0.001                            # weight of memory (memory_unit bytes per device)
    device_memory_capacity: float = 16 * 2**30      # bytes per device (a limit for searchers that use one)
    flops_per_s: float = 100e12                     # assumed device throughput
    memory_unit: float = float(2**30)               # bytes per memory unit in ``total``
    # a byte of parameter or optimizer state stored per device costs as much as moving this many bytes over the
    # slowest link (issue 40: a replicated 16 MB weight must not win by a 0.8 MB collective); 0 turns it off
    state_weight: float = 0.1

    def state_price(self, mesh: DeviceMesh) -> float:
        """The weighted cost of one byte of state stored per device (see ``state_weight``)."""
        return self.beta * self.state_weight / min(mesh.bandwidth) if self.state_weight else 0.0

    def weigh(self, compute: float, comm_time: float, memory: float) -> float:
        """The weighted total of the three terms."""
        return self.alpha * compute + self.beta * comm_time + self.gamma * memory / self.memory_unit


def _kinds(values: Mapping[str, float] | None = None) -> Mapping[str, float]:
    d = dict.fromkeys(KINDS, 0.0)
    if values:
        d.update(values)
    return MappingProxyType(d)


@dataclass(frozen=True, eq=True)
class Cost:
    """A cost: compute (s), comm_bytes per collective kind (bytes per device), comm_time (s),
    memory (bytes per device) and the weighted total. Costs add up with ``+``.

    >>> (Cost(compute=1.0, total=1.0) + Cost(comm_time=2.0, total=800.0)).total
    801.0
    """

    compute: float = 0.0
    comm_bytes: Mapping[str, float] = field(default_factory=_kinds)
    comm_time: float = 0.0
    memory: float = 0.0
    total: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.comm_bytes, MappingProxyType) or set(self.comm_bytes) != set(KINDS):
            object.__setattr__(self, "comm_bytes", _kinds(self.comm_bytes))

    __hash__ = None  # type: ignore[assignment]

    @property
    def communication(self) -> float:
        """All bytes moved per device, every collective kind together."""
        return float(sum(self.comm_bytes.values()))

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.compute + other.compute,
                    {k: self.comm_bytes[k] + other.comm_bytes[k] for k in KINDS},
                    self.comm_time + other.comm_time, self.memory + other.memory, self.total + other.total)

    @staticmethod
    def sum(costs: Sequence[Cost]) -> Cost:
        """Sum of many costs (faster than chained ``+``)."""
        comp = time = mem = tot = 0.0
        by = dict.fromkeys(KINDS, 0.0)
        for c in costs:
            comp += c.compute
            time += c.comm_time
            mem += c.memory
            tot += c.total
            for k, v in c.comm_bytes.items():
                by[k] += v
        return Cost(comp, by, time, mem, tot)


ZERO = Cost()


# -- one op ----------------------------------------------------------------------------------
def op_cost(op: Op, strategy: Strategy, graph: Graph, params: CostParams) -> Cost:
    """Cost of ``op`` under ``strategy`` on ``graph.mesh``.

    compute = flops / devices used / flops_per_s; communication: results that are partial over
    the axes of split reduction dims are all-reduced, once per split reduction dim over that dim's
    axis group (k devices): ``2 * S_local * (k - 1) / k`` bytes per result and dim; memory = local
    bytes of operands + results.

    >>> from searchers.graph import DeviceMesh, Graph
    >>> g = Graph(DeviceMesh((2, 2)))
    >>> x = g.source("x", (8, 4)); w = g.source("w", (4, 6), kind="param")
    >>> _ = g.add_op("mm", "dot_general", {"m": 8, "k": 4, "n": 6}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    >>> c = op_cost(g.ops[2], ((0,), (1,), ()), g, CostParams(flops_per_s=1.0))
    >>> c.compute, c.comm_bytes["all-reduce"], c.memory     # 384 flops / 4; x 32 + w 48 + out 96 B
    (96.0, 96.0, 176.0)
    """
    return spec_cost(op_spec(op, graph), _canon(strategy), graph.mesh, params)


def _canon(strategy: Strategy) -> Strategy:
    return tuple(tuple(a) for a in strategy)


@lru_cache(maxsize=1 << 18)
def spec_cost(spec: OpSpec, strategy: Strategy, mesh: DeviceMesh, params: CostParams) -> Cost:
    """:func:`op_cost` of an op given by its :class:`OpSpec` (memoised)."""
    if len(strategy) != len(spec.sizes):
        raise SearchGraphError(f"strategy {strategy} has {len(strategy)} entries, the op has {len(spec.sizes)} loop dims")
    shape = mesh.shape
    compute = spec.flops / split_count(strategy, shape) / params.flops_per_s     # the devices the strategy uses
    memory = 0.0
    for maps, nbytes in zip(spec.in_maps, spec.in_bytes):
        memory += nbytes / split_count(layout_of(maps, strategy), shape)
    groups = _reduction_groups(spec.reduction, strategy, mesh)
    ar_bytes = ar_time = 0.0
    for maps, nbytes in zip(spec.out_maps, spec.out_bytes):
        local = nbytes / split_count(layout_of(maps, strategy), shape)
        memory += local
        for k, lat, bw in groups:
            b = 2.0 * local * (k - 1) / k
            ar_bytes += b
            ar_time += lat * spec.latency_share + b / bw
    by = {"all-reduce": ar_bytes}
    if spec.halo:
        halo_bytes, halo_time = _halo(spec, strategy, mesh)
        by["collective-permute"] = halo_bytes
        ar_time += halo_time
    total = params.weigh(compute, ar_time, memory)
    if spec.stored:             # a parameter source: its result is the state it stores, per device
        total += params.state_price(mesh) * sum(nbytes / split_count(layout_of(maps, strategy), shape)
                                                for maps, nbytes in zip(spec.out_maps, spec.out_bytes))
    return Cost(compute, by, ar_time, memory, total)


def scattered_reduction_cost(op: Op, strategy: Strategy, target: TensorLayout, graph: Graph,
                             params: CostParams) -> Cost:
    """The collectives that resolve ``op``'s partial result straight into ``target``, its result layout with some
    of the partial axes appended to its dims' stacks: a reduce-scatter over those axes (``S_local * (q-1)/q``)
    and an all-reduce over the others of the smaller block. What the executor runs in place of the all-reduce
    :func:`op_cost` charges and the consumer's slice (``mshard._src.planning.scattered_sums``).

    >>> from searchers.graph import DeviceMesh, Graph
    >>> g = Graph(DeviceMesh((2, 2)))
    >>> x = g.source("x", (8, 4)); w = g.source("w", (4, 6), kind="param")
    >>> _ = g.add_op("mm", "dot_general", {"m": 8, "k": 4, "n": 6}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    >>> c = scattered_reduction_cost(g.ops[2], ((), (0, 1), ()), ((0, 1), ()), g, CostParams())
    >>> c.comm_bytes["reduce-scatter"], c.comm_bytes["all-reduce"]     # 192 B partial: 3/4 of it; nothing left
    (144.0, 0.0)
    >>> c = scattered_reduction_cost(g.ops[2], ((), (0, 1), ()), ((0,), ()), g, CostParams())
    >>> c.comm_bytes["reduce-scatter"], c.comm_bytes["all-reduce"]     # half of 192 B; 2 * 96 * 1/2 over axis 1
    (96.0, 96.0)
    """
    return _scattered_cost(op_spec(op, graph), _canon(strategy), _canon(target), graph.mesh, params)


@lru_cache(maxsize=1 << 16)
def _scattered_cost(spec: OpSpec, strategy: Strategy, target: TensorLayout, mesh: DeviceMesh,
                    params: CostParams) -> Cost:
    have = layout_of(spec.out_maps[0], strategy)
    partial = {a for d in spec.reduction for a in strategy[d]}
    return reduction_cost(have, target, partial, spec.out_bytes[0], mesh, params)


def reduction_cost(have: TensorLayout, target: TensorLayout, partial, nbytes: float, mesh: DeviceMesh,
                   params: CostParams) -> Cost:
    """The collectives that sum a partial result of ``nbytes`` (whole), held in ``have`` and partial over the mesh
    axes ``partial``, into ``target`` (``have`` with some of those axes appended to its dims' stacks): one
    reduce-scatter per dim that gains axes (``S_local * (q-1)/q`` each, on the block left by the one before), then
    an all-reduce over the axes left (``2 S_local (k-1)/k``). The executor's order
    (``mshard._src.runtime.partial_sums.materialize``).

    >>> m = DeviceMesh((2, 2))
    >>> c = reduction_cost(((),), ((0,),), {0, 1}, 64.0, m, CostParams())
    >>> c.comm_bytes["reduce-scatter"], c.comm_bytes["all-reduce"]      # 32 B over axis 0, then 2 * 32 * 1/2
    (32.0, 32.0)
    """
    block = nbytes / split_count(have, mesh.shape)
    by = {"reduce-scatter": 0.0, "all-reduce": 0.0}
    seconds = 0.0
    steps = [("reduce-scatter", tuple(t)[len(h):]) for h, t in zip(have, target)]   # one per dim, as emitted
    steps.append(("all-reduce", tuple(a for a in sorted(partial) if all(a not in ax for _, ax in steps))))
    for kind, axes in steps:
        k = mesh.count(axes)
        if k == 1:
            continue
        b = (1.0 if kind == "reduce-scatter" else 2.0) * block * (k - 1) / k
        block /= k if kind == "reduce-scatter" else 1
        by[kind] += b
        seconds += max(mesh.latency[a] for a in axes) + b / min(mesh.bandwidth[a] for a in axes)
    return Cost(0.0, by, seconds, 0.0, params.weigh(0.0, seconds, 0.0))


def scattered_layout(have: TensorLayout, want: TensorLayout, axes, shape: Sequence[int],
                     mesh: DeviceMesh) -> TensorLayout | None:
    """``have`` with, on each dim, the partial ``axes`` that ``want`` splits that dim on appended (in ``want``'s
    order): where a reduce-scatter leaves a partial result read in ``want``. None where ``want`` splits no dim on
    them or a dim would not divide.

    >>> m = DeviceMesh((2, 2, 2))
    >>> scattered_layout(((2,), ()), ((0, 1, 2), ()), (0, 1), (64, 16), m)     # then a permute to (0, 1, 2)
    ((2, 0, 1), ())
    """
    out, added = [], False
    for h, w, n in zip(have, want, shape, strict=True):
        extra = tuple(a for a in w if a in axes and a not in h)
        added = added or bool(extra)
        out.append(tuple(h) + extra)
        if n % mesh.count(out[-1]):
            return None
    return tuple(out) if added else None


def scatter_saving(op: Op, strategy: Strategy, want: TensorLayout, graph: Graph, params: CostParams, *,
                   then_change: bool = True) -> tuple[TensorLayout, Cost] | None:
    """Where ``op``'s partial result, read in ``want``, moves fewer bytes reduce-scattered into
    :func:`scattered_layout` and changed from there than all-reduced (as :func:`op_cost` charges) and changed from
    its result layout: (that layout, the change in cost, negative). Else None. The rule the executor's choice
    follows (``mshard._src.planning.scattered_sums``). ``then_change=False``: only where ``want`` is that layout
    (the result layout with reduced axes appended, nothing to change after), the searchers' objective
    (:func:`graph_cost`, the pairwise problem): pricing every change after a reduce-scatter for every pair of
    candidates tripled a search's time.

    >>> from searchers.graph import Graph
    >>> g = Graph(DeviceMesh((2, 2)))
    >>> x = g.source("x", (8, 4)); w = g.source("w", (4, 6), kind="param")
    >>> _ = g.add_op("mm", "dot_general", {"m": 8, "k": 4, "n": 6}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    >>> target, change = scatter_saving(g.ops[2], ((), (0, 1), ()), ((0, 1), ()), g, CostParams())
    >>> target, change.comm_bytes["all-reduce"], change.comm_bytes["reduce-scatter"]    # 288 B -> 144 B
    (((0, 1), ()), -288.0, 144.0)
    """
    if len(op.outputs) != 1:
        return None
    t = graph.tensors[op.outputs[0]]
    found = _scatter_saving(op_spec(op, graph), _canon(strategy), _canon(want), tuple(t.shape), t.itemsize,
                            graph.mesh, params)
    return found if found is None or then_change or found[0] == _canon(want) else None


@lru_cache(maxsize=1 << 18)
def _scatter_saving(spec: OpSpec, strategy: Strategy, want: TensorLayout, shape: tuple[int, ...], itemsize: int,
                    mesh: DeviceMesh, params: CostParams) -> tuple[TensorLayout, Cost] | None:
    axes = {a for d in spec.reduction for a in strategy[d]}
    if not axes:
        return None
    have = layout_of(spec.out_maps[0], strategy)
    target = scattered_layout(have, want, axes, shape, mesh)
    if target is None:
        return None
    reduced = spec_cost(spec, strategy, mesh, params)
    before = Cost(0.0, {"all-reduce": reduced.comm_bytes["all-reduce"]}, reduced.comm_time, 0.0,
                  params.weigh(0.0, reduced.comm_time, 0.0)) + redistribution_cost(
        have, want, shape, itemsize, mesh, params)
    after = (_scattered_cost(spec, strategy, target, mesh, params)
             + redistribution_cost(target, want, shape, itemsize, mesh, params))
    if (after.communication, after.total) >= (before.communication, before.total):
        return None
    return target, Cost(0.0, {k: after.comm_bytes[k] - before.comm_bytes[k] for k in KINDS},
                        after.comm_time - before.comm_time, 0.0, after.total - before.total)


def scatter_edges(graph: Graph) -> dict[int, tuple[int, int]]:
    """Op id of every ``scatter`` op whose one result is read by exactly one operand -> (its reader's op id,
    operand index): the edges whose price :func:`scatter_saving` changes in a search."""
    if not any(op.scatter for op in graph.ops):
        return {}
    reads: dict[int, list[tuple[int, int]]] = {}
    for op in graph.ops:
        for i, tid in enumerate(op.inputs):
            reads.setdefault(tid, []).append((op.id, i))
    ends = set(graph.outputs)
    return {op.id: reads[op.outputs[0]][0] for op in graph.ops
            if op.scatter and len(op.outputs) == 1 and op.outputs[0] not in ends
            and len(reads.get(op.outputs[0], ())) == 1}


def _halo(spec: OpSpec, strategy: Strategy, mesh: DeviceMesh) -> tuple[float, float]:
    """(bytes, seconds) of the halo exchange of a windowed op (``OpSpec.halo``). Each operand that follows a split
    halo dim sends its neighbours ``halo`` rows of its local block, in two collective-permutes (one each way, as
    XLA's partitioner emits for a window), at the slowest of the dim's axes; the dims are exchanged one after
    another, a later one on the block already widened by the earlier ones' halos (which is how the corners
    travel)."""
    nbytes = seconds = 0.0
    for maps, size in zip(spec.in_maps, spec.in_bytes):
        block = size / split_count(layout_of(maps, strategy), mesh.shape)
        for d in maps:
            if not isinstance(d, int):          # a merged dim (a reshape's): never a window's
                continue
            rows = spec.halo[d] if d >= 0 else 0
            axes = strategy[d] if d >= 0 else ()
            if not rows or not axes:
                continue
            b = block * rows * split_count((axes,), mesh.shape) / spec.sizes[d]
            nbytes += b
            seconds += 2 * max(mesh.latency[a] for a in axes) + b / min(mesh.bandwidth[a] for a in axes)
            block += b
    return nbytes, seconds


def _reduction_groups(reduction: Sequence[int], strategy: Strategy,
                      mesh: DeviceMesh) -> list[tuple[int, float, float]]:
    """``(devices, latency, bandwidth)`` of each all-reduce that resolves a partial result: XLA emits one per split
    reduction dim, over the devices of that dim's axes (a sum over two split dims is two all-reduces, one dim split
    over two axes is one), at the largest latency and the slowest bandwidth of those axes."""
    out = []
    for d in reduction:
        axes = strategy[d]
        k = 1
        for a in axes:
            k *= mesh.shape[a]
        if k > 1:
            out.append((k, max(mesh.latency[a] for a in axes), min(mesh.bandwidth[a] for a in axes)))
    return out


# -- redistribution --------------------------------------------------------------------------
def redistribution_cost(src: TensorLayout, dst: TensorLayout, shape: Sequence[int], itemsize: int,
                        mesh: DeviceMesh, params: CostParams, skip: int = 0) -> Cost:
    """Cost of converting a tensor of global ``shape`` from layout ``src`` to ``dst`` (less its first ``skip``
    collectives, which another reader's redistribution already ran: :func:`shared_steps`).

    The collectives are the ones XLA's SPMD partitioner emits for this pair
    (:mod:`searchers.xla_reshard`), or the executor's direct ones where they move less
    (:mod:`searchers.direct_reshard`), priced with ring formulas: an all-gather sends
    ``S_result * (k-1) / k``, an all-to-all ``S_local * (k-1) / k``, a collective-permute its whole
    ``S_local``. Axis order inside one tensor dim matters: ``(0, 1)`` and ``(1, 0)`` put the devices
    in different tiles, and going from one to the other is a permute.

    >>> m = DeviceMesh((2, 2))
    >>> redistribution_cost(((0,), (1,)), ((0,), (1,)), (8, 8), 4, m, CostParams()).total
    0.0
    >>> c = redistribution_cost(((0,), ()), ((), (0,)), (8, 8), 4, m, CostParams())
    >>> c.comm_bytes["all-to-all"]      # 128 B local, half of it leaves
    64.0
    """
    src, dst = _canon(src), _canon(dst)
    if len(src) != len(shape) or len(dst) != len(shape):
        raise SearchGraphError(f"redistribution_cost: layouts {src} -> {dst} do not match rank {len(shape)}")
    nbytes = itemsize
    for s in shape:
        nbytes *= int(s)
    return _redist(src, dst, nbytes, mesh, params, skip)


def redistribution_steps(src: TensorLayout, dst: TensorLayout, mesh: DeviceMesh) -> tuple[tuple[str, int, float], ...]:
    """The collectives the program runs to convert ``src`` to ``dst``: XLA's (:func:`searchers.xla_reshard.reshard`),
    or the executor's own one-collective-per-axis steps where those move less
    (:func:`searchers.direct_reshard.best_steps`):
    ``(kind, mesh axis, bytes per device per global byte)`` in execution order, the axis being the
    slowest one the collective's groups span; empty when only local slicing (or nothing) is needed.

    >>> redistribution_steps(((0,), ()), ((), (1,)), DeviceMesh((2, 2)))   # slice axis 1 on dim 1, gather axis 0
    (('all-gather', 0, 0.25),)
    >>> from searchers.xla_reshard import reshard
    >>> [(s.kind, s.moved) for s in reshard(((0,), ()), ((), (1,)), (2, 2))]  # XLA's: the split moves, then devices
    [('all-to-all', 0.25), ('collective-permute', 0.5)]
    >>> redistribution_steps(((0,), ()), ((1,), ()), DeviceMesh((2, 2)))   # same counts: a permute
    (('collective-permute', 0, 0.5),)
    >>> redistribution_steps(((0,), ()), ((), ()), DeviceMesh((2, 2)))     # gather dim 0
    (('all-gather', 0, 0.5),)
    """
    if src == dst:
        return ()
    # a tensor dim split in neither layout takes no part (xla_reshard.reshard drops it too): pairs that differ only
    # in such dims (a rank-4 activation and its rank-2 view) are one entry of this memo
    keep = [i for i, (a, b) in enumerate(zip(src, dst)) if a or b]
    if len(keep) < len(src):
        return _steps(tuple(src[i] for i in keep), tuple(dst[i] for i in keep), mesh)
    return _steps(src, dst, mesh)


@lru_cache(maxsize=1 << 16)
def _steps(src: TensorLayout, dst: TensorLayout, mesh: DeviceMesh) -> tuple[tuple[str, int, float], ...]:
    steps = []
    for st in best_steps(src, dst, mesh.shape):
        axes = st.axes or tuple(range(len(mesh.shape)))
        axis = min(axes, key=lambda a: (mesh.bandwidth[a], -mesh.latency[a]))
        steps.append((st.kind, axis, st.moved))
    return tuple(steps)


def shared_steps(steps: Sequence[tuple[str, int, float]], earlier: Sequence[Sequence[tuple[str, int, float]]]) -> int:
    """How many leading collectives of ``steps`` (:func:`redistribution_steps`) one of the ``earlier`` redistributions
    of the same tensor already ran: XLA computes a collective on the same value once (common subexpressions), so a
    tensor read in two layouts that both start by the same all-gather pays that all-gather once. Only all-gathers
    count: from one layout, gathering a mesh axis has one result (the axis splits one dim), while an all-to-all or
    a collective-permute over the same axes may send the blocks to different places.

    >>> ag, a2a = ("all-gather", 0, 0.5), ("all-to-all", 1, 0.25)
    >>> shared_steps((ag, a2a), [(ag,)]), shared_steps((ag,), [(ag, a2a)]), shared_steps((a2a,), [(a2a,)])
    (1, 1, 0)
    """
    best = 0
    for e in earlier:
        k = 0
        while k < len(steps) and k < len(e) and steps[k] == e[k] and steps[k][0] == "all-gather":
            k += 1
        best = max(best, k)
    return best


def reshard_once(ran: dict, tid, src: TensorLayout, dst: TensorLayout, mesh: DeviceMesh) -> int:
    """:func:`shared_steps` of tensor ``tid``'s redistribution ``src -> dst`` against the ones already recorded in
    ``ran`` (``tid`` -> (layout, steps) list; ``tid`` a tensor id, or (tensor id, ``Op.share_scope``)), which it then
    records: one reader at a time, in program order. Two direct redistributions (:mod:`searchers.direct_reshard`)
    share the collectives of their common leading moves."""
    src, dst = _canon(src), _canon(dst)
    steps = redistribution_steps(src, dst, mesh)
    earlier = ran.setdefault(tid, [])
    direct = cheaper_than_xla(src, dst, mesh.shape)
    same_path = [(d, e) for d, e in earlier if cheaper_than_xla(src, d, mesh.shape) == direct]
    if direct:
        # two direct redistributions of one value run the same collectives as far as their moves agree (each move
        # a function of the value and the moves before it), and XLA computes those once
        mine = direct_plan(src, dst, mesh.shape)
        k = max((sum(m.kind != "slice" for m in _common_prefix(mine, direct_plan(src, d, mesh.shape)))
                 for d, _ in same_path), default=0)
    else:
        k = shared_steps(steps, [e for _, e in same_path])
    earlier.append((dst, steps))
    return k


def _common_prefix(a: Sequence, b: Sequence) -> Sequence:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return a[:n]


@lru_cache(maxsize=1 << 18)
def _redist(src: TensorLayout, dst: TensorLayout, nbytes: int, mesh: DeviceMesh, params: CostParams,
            skip: int = 0) -> Cost:
    """The cost of ``src -> dst`` for ``nbytes`` (global), less its first ``skip`` collectives (:func:`shared_steps`)."""
    steps = redistribution_steps(src, dst, mesh)[skip:]
    if not steps:
        return ZERO
    by = dict.fromkeys(KINDS, 0.0)
    time = 0.0
    for kind, a, coef in steps:
        b = coef * nbytes
        by[kind] += b
        time += mesh.latency[a] + b / mesh.bandwidth[a]
    return Cost(0.0, by, time, 0.0, params.weigh(0.0, time, 0.0))


def redistribution_total(src: TensorLayout, dst: TensorLayout, nbytes: int, mesh: DeviceMesh,
                         params: CostParams) -> float:
    """Weighted total of a redistribution, for a tensor of ``nbytes`` global bytes (memoised)."""
    return 0.0 if src == dst else _redist(src, dst, nbytes, mesh, params).total


# -- a whole graph ---------------------------------------------------------------------------
def graph_cost(graph: Graph, strategies: Mapping[int, Strategy], params: CostParams, *,
               specs: Sequence[OpSpec] | None = None, shared: bool = False, scatter: bool = True) -> Cost:
    """Sum of every op's cost and of the redistribution on every edge (producer result layout ->
    consumer operand layout). ``strategies`` needs an entry for every op id; ``specs`` (one
    :class:`OpSpec` per op, optional) saves recomputing them. ``shared=True`` counts a tensor
    redistributed to one layout once however many ops read it there, as the compiled program does
    (XLA reshards a value once per target sharding and shares the result), and a tensor computed from
    constants alone not at all (it is re-broadcast locally), and leaves out the ops whose results nothing uses
    (:func:`~searchers.graph.dead_ops`: XLA removes them); the default charges every edge and op, the searchers'
    objective. ``scatter``: a ``scatter`` op read by one operand is priced reduce-scattered where its reader's
    layout is its own with reduced axes appended and that moves less (:func:`scatter_saving`), as the executor runs
    it.

    >>> from searchers.graph import DeviceMesh, Graph
    >>> g = Graph(DeviceMesh((2,)))
    >>> x = g.source("x", (4,))
    >>> _ = g.add_op("neg", "neg", {"i": 4}, [x], [("i",)], [("i",)])
    >>> p = CostParams(gamma=1.0, memory_unit=1.0)
    >>> round(graph_cost(g, {0: ((0,),), 1: ((0,),)}, p).total, 9)   # 8 B (x) + 8 + 8 B (neg)
    24.0
    """
    mesh = graph.mesh
    if specs is None:
        specs = [op_spec(op, graph) for op in graph.ops]
    chosen: list[Strategy] = []
    out_lay: dict[int, TensorLayout] = {}
    op_count: Counter = Counter()
    dead = dead_ops(graph) if shared else frozenset()
    for op, spec in zip(graph.ops, specs):
        try:
            s = _canon(strategies[op.id])
        except KeyError:
            raise SearchGraphError(f"graph_cost: no strategy for op {op.id} ({op.name})") from None
        chosen.append(s)
        if op.id not in dead:
            op_count[spec, s] += 1
        for tid, maps in zip(op.outputs, spec.out_maps):
            out_lay[tid] = layout_of(maps, s)
    red_count: Counter = Counter()
    seen: set[tuple[int, TensorLayout]] = set()
    free = constant_tensors(graph) if shared else frozenset()
    extra = [_merged_latency(specs, chosen, mesh, params, [op.merge_group for op in graph.ops])] if shared else []
    done: dict[int, list] = {}
    for op, spec, s in zip(graph.ops, specs, chosen):
        if op.id in dead or (shared and op.kind in UNPRICED_READERS):
            continue
        for i, (tid, maps, nbytes) in enumerate(zip(op.inputs, spec.in_maps, spec.in_bytes)):
            want, have = layout_of(maps, s), out_lay[tid]
            key = share_key(op, i, tid, have, want)
            if have != want and tid not in free and not (shared and (key, want) in seen):
                seen.add((key, want))
                red_count[have, want, nbytes] += 1
                # collectives another reader of the tensor already ran are not run again (in its scope)
                k = reshard_once(done, key, have, want, mesh) if shared else 0
                if k:
                    whole, rest = _redist(have, want, nbytes, mesh, params), _redist(have, want, nbytes, mesh,
                                                                                    params, k)
                    extra.append(Cost(0.0, {kk: rest.comm_bytes[kk] - whole.comm_bytes[kk] for kk in KINDS},
                                      rest.comm_time - whole.comm_time, 0.0, rest.total - whole.total))
    if scatter:
        for pid, (cid, i) in scatter_edges(graph).items():
            if pid not in dead and cid not in dead:
                found = scatter_saving(graph.ops[pid], chosen[pid], operand_layout(graph.ops[cid], chosen[cid], i),
                                       graph, params, then_change=False)
                if found is not None:
                    extra.append(found[1])
    return Cost.sum([counted_cost(op_count, red_count, mesh, params)] + extra)


def _merged_latency(specs: Sequence[OpSpec], chosen: Sequence[Strategy], mesh: DeviceMesh,
                    params: CostParams, groups: Sequence[int] | None = None) -> Cost:
    """What the compiled program's all-reduce combiner does to the merged reductions' latencies, less what their
    ``latency_share`` charged (:func:`searchers.graph.mark_merged_reductions`): XLA merges only all-reduces over the
    same device groups, so each set (``groups``: per op its ``merge_group``; None: one set) pays one latency per
    distinct set of mesh axes, not ``1/k`` each. (A searcher's objective keeps the share: it is per op; the
    program's cost, ``shared=True``, is exact.)

    >>> from searchers.graph import DeviceMesh, Graph, mark_merged_reductions
    >>> g = Graph(DeviceMesh((2, 2)))
    >>> x = g.source("x", (4, 4))
    >>> _ = g.add_op("sum_a", "reduce_sum", {"m": 4, "n": 4}, [x], [("m", "n")], [()])
    >>> _ = g.add_op("sum_b", "reduce_sum", {"m": 4, "n": 4}, [x], [("m", "n")], [()])
    >>> g.outputs.extend([g.ops[1].outputs[0], g.ops[2].outputs[0]])
    >>> mark_merged_reductions(g)
    2
    >>> specs = [op_spec(op, g) for op in g.ops]
    >>> p = CostParams()
    >>> same = _merged_latency(specs, [((0,), ()), ((0,), ()), ((0,), ())], g.mesh, p)
    >>> apart = _merged_latency(specs, [((0,), ()), ((0,), ()), ((1,), ())], g.mesh, p)
    >>> round(same.comm_time / 5e-6, 6), round(apart.comm_time / 5e-6, 6)   # 1 latency, not 2 x 1/2; 2, not 1
    (0.0, 1.0)
    """
    charged = 0.0
    paid: dict[tuple[int, tuple[int, ...]], float] = {}
    for i, (spec, s) in enumerate(zip(specs, chosen)):
        if spec.latency_share == 1.0:
            continue
        for d in spec.reduction:
            axes = tuple(sorted(s[d]))
            if math.prod(mesh.shape[a] for a in axes) > 1:
                lat = max(mesh.latency[a] for a in axes)
                charged += lat * spec.latency_share * len(spec.out_maps)
                key = (0 if groups is None else groups[i], axes)
                paid[key] = max(paid.get(key, 0.0), lat)
    extra = sum(paid.values()) - charged
    return Cost(comm_time=extra, total=params.weigh(0.0, extra, 0.0)) if abs(extra) > 0 else ZERO

def counted_cost(op_counts: Mapping[tuple[OpSpec, Strategy], int],
                 redist_counts: Mapping[tuple[TensorLayout, TensorLayout, int], int],
                 mesh: DeviceMesh, params: CostParams) -> Cost:
    """Sum of ``n`` x op cost per ``(spec, strategy): n`` and ``n`` x redistribution cost per
    ``(src layout, dst layout, global bytes): n`` — :func:`graph_cost` once the graph is counted."""
    parts = [(spec_cost(spec, s, mesh, params), n) for (spec, s), n in op_counts.items()]
    parts += [(_redist(h, w, b, mesh, params), n) for (h, w, b), n in redist_counts.items()]
    comp = time = mem = tot = 0.0
    by = dict.fromkeys(KINDS, 0.0)
    for c, n in parts:
        comp += n * c.compute
        time += n * c.comm_time
        mem += n * c.memory
        tot += n * c.total
        for k, v in c.comm_bytes.items():
            by[k] += n * v
    return Cost(comp, by, time, mem, tot)


for _memo in (_steps, _redist):
    depends_on_direct(_memo.cache_clear)
