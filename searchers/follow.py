"""semi_auto's default for the ops a user did not annotate: compute in the layout the operands arrive in.

Not a search: one pass in program order. Each op that is not fixed takes, loop dim by loop dim, the axes its
operands already carry (the most split operand first, then the larger), never an axis twice, never a dim the op
cannot split or a split its size does not allow. Nothing new is split: an op whose operands are whole stays
whole, so a data-parallel batch flows on as data parallel and a model-parallel split the user asked for flows
on as itself (what XLA's own propagation does for a program with the same constraints, and what MindSpore's
data-parallel default gives for ops downstream of the batch). A parameter nobody fixed is stored as its first
fixed consumer computes with it (MindSpore's parameter slicing), else whole. A ``follow_operand`` op (a
training step's write-back) takes its operand's layout, an ``operand_ties`` op (a marked operand read again as a
residual) the layout its op computed that operand in.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> g = Graph(DeviceMesh((2, 4)))
>>> x = g.source("x", (8, 16), fixed=((0,), ()))
>>> w = g.source("w", (16, 32), kind="param")
>>> (y,) = g.add_op("mm", "dot_general", {"m": 8, "k": 16, "n": 32}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
>>> (z,) = g.add_op("relu", "max", {"i": 8, "j": 32}, [y], [("i", "j")], [("i", "j")])
>>> r = follow_operands(g, CostParams())
>>> r.strategies[2], r.strategies[3], r.strategies[1]
(((0,), (), ()), ((0,), ()), ((), ()))
"""

from __future__ import annotations

import itertools
import math
import time
from typing import cast

from .cost import CostParams, redistribution_total, spec_cost
from .graph import DeviceMesh, Graph, Strategy, TensorLayout, hand_out, operand_layout, pinned_strategy, replicated
from .graph_index import GraphIndex
from .result import SearchResult
from .spec import OpSpec, layout_of


def follow_operands(graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
                    first_operand_first: bool = False) -> SearchResult:
    """semi_auto's default (module doc); ``fully_use_devices`` is accepted for the searcher signature and ignored:
    semi_auto splits only what the user asked for. ``first_operand_first`` takes the operands' axes in operand
    order instead (MindSpore's data parallel: an op follows the batch split of its first operand), a parameter's
    after every other operand's: a parameter stored split (optimizer level3) is gathered where an op reads it with
    the batch, not followed in its shard."""
    t0 = time.perf_counter()
    ix = GraphIndex(graph)
    strategies = dict(enumerate(follow_strategies(graph, ix, first_operand_first=first_operand_first,
                                                  params=None if first_operand_first else params)))
    return SearchResult(strategies, ix.cost(strategies, params), "follow_operands", time.perf_counter() - t0,
                        ["follow_operands: ops without a user strategy compute in the layout their operands arrive in "
                         "(nothing new is split; the batch stays data parallel)"])


def follow_strategies(graph: Graph, ix: GraphIndex, *, first_operand_first: bool = False,
                      params: CostParams | None = None) -> list[Strategy]:
    """:func:`follow_operands`' strategies, one per op id, on the graph's :class:`~searchers.graph_index.GraphIndex`
    (ops of one shape whose operands arrive alike are decided once). With ``params``, a derived op (a training
    step's backward or update) whose default strategy reads a weight (stored state: a parameter, its casts and
    transposes) in another layout than it arrives in (a split weight gathered, or a whole one sliced) takes
    the operands' axes in the order that costs least
    (:func:`cheapest_follow`), as MindSpore derives the backward from the forward's strategies: ``dy @ w.T``
    against a batch-split cotangent keeps the row-parallel weight's split and moves the cotangent, rather than
    gathering the weight."""
    shape = graph.mesh.shape
    ops = graph.ops
    st: list[Strategy | None] = [None] * len(ops)      # None: not decided yet (a tie may look ahead)
    out_l: list[tuple[int, ...]] = []                  # per op, the layout id of each result
    lid: dict[TensorLayout, int] = {}
    layouts: list[TensorLayout] = []

    def ids(si: int, s: Strategy) -> tuple[int, ...]:
        out = []
        for m in specs[si].out_maps:
            lay = layout_of(m, s)
            k = lid.get(lay)
            if k is None:
                k = lid[lay] = len(layouts)
                layouts.append(lay)
            out.append(k)
        return tuple(out)

    # (spec, arriving layout ids) -> (strategy, result layout ids); (spec, strategy) -> result layout ids
    memo: dict[tuple[int, tuple[int, ...]], tuple[Strategy, tuple[int, ...]]] = {}
    outs: dict[tuple[int, Strategy], tuple[int, ...]] = {}
    specs = ix.specs
    pinned = set(ix.pinned())
    # per op: a value computed from stored state alone (a parameter, its casts and transposes, a constant times it);
    # data parallel takes such operands' axes after the others' (a level3 weight is gathered for the batch's op)
    stored = [False] * len(ops)
    for v, (si, srcs, source) in enumerate(zip(ix.spec_index, ix.in_src, ix.is_source)):
        stored[v] = ops[v].kind == "param" if source else (
            any(stored[p] for p, _ in srcs) and all(stored[p] or ops[p].kind == "const" for p, _ in srcs))
        s = pinned_strategy(graph, ops[v], st) if v in pinned else None
        if s is not None or source:
            s = replicated(ops[v]) if s is None else s
            got_out = outs.get((si, s))
            if got_out is None:
                got_out = outs[si, s] = ids(si, s)
            st[v] = s
            out_l.append(got_out)
            continue
        kept = tuple(i for i, (p, _) in enumerate(srcs) if stored[p])
        choose = params is not None and ops[v].derived
        key = (si, tuple([out_l[p][j] for p, j in srcs]), kept if first_operand_first or choose else (), choose)
        got = memo.get(key)
        if got is None:
            lays = tuple(layouts[i] for i in key[1])
            s = follow_layouts(specs[si], lays, shape, first_operand_first, kept if first_operand_first else ())
            if choose and any(lays[i] and layout_of(specs[si].in_maps[i], s) != lays[i] for i in kept):
                s = cheapest_follow(specs[si], lays, graph.mesh, cast(CostParams, params))
            got = memo[key] = (s, ids(si, s))
        st[v] = got[0]
        out_l.append(got[1])
    for op in graph.ops:                      # an unfixed parameter: stored as its first fixed consumer computes
        if op.is_source and op.fixed is None and op.kind == "param":
            tid = op.outputs[0]
            users = [c for c in graph.tensors[tid].consumers if graph.ops[c].fixed is not None]
            if users:
                cons = graph.ops[users[0]]
                lay = operand_layout(cons, cast(Strategy, st[cons.id]), cons.inputs.index(tid))
                where = dict(zip(op.out_dims[0], lay))
                st[op.id] = tuple(tuple(where.get(d, ())) for d in op.dims)
    return cast(list[Strategy], st)        # every op is decided by now


def cheapest_follow(spec: OpSpec, lays: tuple[TensorLayout, ...], mesh: DeviceMesh, params: CostParams) -> Strategy:
    """Among the strategies :func:`follow_layouts` gives when the operands' axes are taken in each order, the one
    whose own cost plus the redistributions of its operands from ``lays`` is least on the cost model; the default
    order's on a tie (so an op whose operands agree is decided as before).

    >>> from searchers.spec import OpSpec
    >>> mesh = DeviceMesh((2, 4))
    >>> # dh = dy @ w2.T (loop dims m 32, n 256, k 64): dy [32, 64] split 8 on its rows (the loss's data-parallel
    >>> # default), w2 [256, 64] stored with its rows split 4 (Megatron's row-parallel weight)
    >>> spec = OpSpec((32, 256, 64), (False,) * 3, ((0, 2), (1, 2)), ((0, 1),), (8192, 65536), (32768,), (2,),
    ...               2 * 32 * 256 * 64, True, 1.0, (), ((), ()), False)
    >>> lays = (((0, 1), ()), ((1,), ()))
    >>> follow_layouts(spec, lays, mesh.shape)           # the most split first: w2 is gathered whole
    ((0, 1), (), ())
    >>> cheapest_follow(spec, lays, mesh, CostParams())  # w2 keeps its split; dy is gathered over axis 1 only
    ((0,), (1,), ())
    """
    orders = [None, *itertools.permutations(range(len(lays)))] if 1 < len(lays) <= 4 else [None]
    best, best_cost = None, math.inf
    for order in orders:
        s = follow_layouts(spec, lays, mesh.shape, order=order)
        if s == best:
            continue
        c = spec_cost(spec, s, mesh, params).total + sum(
            redistribution_total(lay, layout_of(maps, s), nbytes, mesh, params)
            for lay, maps, nbytes in zip(lays, spec.in_maps, spec.in_bytes, strict=True))
        if c < best_cost * (1 - 1e-9):
            best, best_cost = s, c
    return cast(Strategy, best)


def follow_layouts(spec: OpSpec, lays: tuple[TensorLayout, ...], shape: tuple[int, ...],
                   first_operand_first: bool = False, params: tuple[int, ...] = (),
                   order: tuple[int, ...] | None = None) -> Strategy:
    """The strategy of an op of ``spec`` whose operands arrive in ``lays`` (module doc); ``first_operand_first``
    takes them in operand order, those listed in ``params`` (parameters) last; ``order`` in that order."""
    arriving: list[tuple[int, int, int, TensorLayout]] = []
    for i, lay in enumerate(lays):
        n = math.prod(shape[a] for axes in lay for a in axes)
        if order is not None:
            arriving.append((order.index(i), 0, i, lay))
        else:
            arriving.append((i in params, i, i, lay) if first_operand_first else (-n, -spec.in_bytes[i], i, lay))
    where: dict[int, tuple[int, ...]] = {}
    used: set[int] = set()
    for _, _, i, lay in sorted(arriving):
        for d, axes in zip(spec.in_maps[i], lay):
            if order is not None and axes and set(axes) & used:     # the leading axes not used yet (a coarser split)
                axes = tuple(itertools.takewhile(lambda a: a not in used, axes))
            if not isinstance(d, int):              # a dim made of several loop dims: its axes, major part first
                if axes and not set(axes) & used and not any(x in where or spec.unsplittable[x] for x in d):
                    got = hand_out(d, tuple(axes), spec.sizes, shape)
                    where.update((x, a) for x, a in got.items() if a)
                    used.update(a for got_axes in got.values() for a in got_axes)
                continue
            if d < 0 or not axes or d in where or spec.unsplittable[d] or set(axes) & used:
                continue
            if spec.sizes[d] % math.prod(shape[a] for a in axes):
                continue
            where[d] = tuple(axes)
            used.update(axes)
    _keep_nesting(where, spec.nested, shape, spec.unsplittable, spec.sizes)
    return tuple(where.get(d, ()) for d in range(len(spec.sizes)))


def _keep_nesting(where: dict[int, tuple[int, ...]], nested: tuple, shape: tuple[int, ...],
                  unsplittable: tuple[bool, ...], sizes: tuple[int, ...]) -> None:
    """Make ``where`` keep :meth:`~searchers.graph.Op.nested`: a minor part of a merged tensor dim is split only where
    each major part before it is split into its size. An operand that arrives with only its inner dim split, read by
    a reshape that merges it with the dim before, is not a block split of the merged dim (its devices' rows
    interleave): its axes go to the first whole major part they divide (one all-to-all of the operand, as XLA moves
    it), else the part is computed whole (the operand gathered)."""
    changed = True
    while changed:
        changed = False
        for i, before in nested:
            if i not in where or all(math.prod(shape[a] for a in where.get(j, ())) == n for j, n in before):
                continue
            axes = where.pop(i)
            k = math.prod(shape[a] for a in axes)
            to = next((j for j, _ in before if j not in where and not unsplittable[j] and sizes[j] % k == 0), None)
            if to is not None:
                where[to] = axes
            changed = True
