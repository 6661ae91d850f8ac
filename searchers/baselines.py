"""The obvious plans no search may lose to (docs/design.md invariant 6; issue 14).

Every cost-model searcher (recursive_programming, dynamic_programming, ilp) ends with :func:`no_worse_than_baselines`:
it prices, on the searcher's own cost model, the plans a user gets without searching, and returns the cheapest of
them instead of the search's plan where that is cheaper (a note says so). sharding_propagation, MindSpore's
algorithm, keeps what it propagates and only notes a cheaper baseline, with both figures (issue 40):

- ``data parallel`` (a): the data inputs not fixed by the dataset strategy split on their batch dim
  (:func:`~searchers.strategies.data_parallel_strategy`), every other op computing in the layout its operands
  arrive in (a batch split flows on, parameters stay whole);
- ``data parallel (sliced)`` (a, under ``full_batch``): data inputs fixed whole (every device holds the batch) stay
  whole, and their consumers compute on the batch split as in ``data parallel``: slicing a replicated tensor is
  free, so this is data parallel at no cost for the data's arrival;
- ``data parallel (per op)`` (a, MindSpore's form): every op not fixed splits the loop dim behind dim 0 of its
  first operand, as MindSpore's data-parallel default does, the batch sliced where it arrives whole
  (``full_batch``: slicing a replicated tensor is free);
- ``semi_auto`` (b): the user's strategies and, for every other op, the layout its operands arrive in
  (:func:`~searchers.follow.follow_operands`);
- ``replicated`` (c), only where ``fully_use_devices`` is off: every op not fixed computes whole.

Every baseline keeps the fixed ops and the ties (a write-back in its input's layout, a marked operand read again in
the layout its op computed it in), and is taken only where its peak memory (:func:`~searchers.memory.peak_memory`)
is no more than the search's plan's or the device capacity (not the summed memory of every op: a baseline whose sum
was below an unfitting plan's once replaced ilp's fitting plan with one 1.4x over the capacity), and only where it
is a plan that uses the devices as asked: under ``fully_use_devices`` (MindSpore's "search only strategies that use
every device") the batch must enter the computation over every device, i.e. every unfixed consumer of a data input
computes in one of its candidates (sources, ``free_devices`` ops and ops with no operands are exempt, as in
:func:`~searchers.strategies.enumerate_strategies`). What follows may compute whole as data parallel does: a batch
norm's per-channel statistics, the scalars after the loss, an iota, a parameter's own transform. So the replicated
plan (c), and a data-parallel plan that would compute the whole batch on every device, count only with idle devices
allowed.

>>> from searchers.cost import CostParams
>>> from searchers.generators import mlp_chain
>>> from searchers.graph import DeviceMesh
>>> g = mlp_chain(2, 64, 64, DeviceMesh((2, 4)))
>>> sorted(baseline_plans(g, CostParams(), fully_use_devices=False))
['data parallel', 'data parallel (per op)', 'replicated', 'user strategies + follow']
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from .cost import Cost, CostParams
from .follow import follow_operands, follow_strategies
from .graph import Graph, Op, Strategy, pinned_strategy, replicated
from .graph_index import GraphIndex
from .result import SearchResult
from .strategies import data_parallel_strategy, enumerate_strategies

_REL = 1e-9       # a baseline must be cheaper by more than float64 re-summation noise to replace the search's plan


def _with_data_split(graph: Graph, held: list[Op], make: Callable[[], list[Strategy]]) -> list[Strategy]:
    """``make()`` run with the data inputs ``held`` fixed at their data-parallel split, their own ``fixed`` given
    back after."""
    saved = [op.fixed for op in held]
    for op in held:
        op.fixed = data_parallel_strategy(op, graph.mesh)
    try:
        return make()
    finally:
        for op, f in zip(held, saved):
            op.fixed = f


def _per_op(graph: Graph, ix: GraphIndex, pick: Callable[[Op], Strategy]) -> list[Strategy]:
    """Fixed ops as fixed, ties as tied, every other op ``pick(op)`` (asked once per op shape and kind)."""
    ops = graph.ops
    picks = [pick(ops[v]) for v in ix.first_of_kind.tolist()]
    st: list[Strategy | None] = [picks[k] for k in ix.kind_index]
    pinned = ix.pinned()
    for v in pinned:
        st[v] = None                # decided in program order below: a tie may look ahead, and sees None there
    for v in pinned:
        st[v] = pinned_strategy(graph, ops[v], _Before(st, v))
    return cast(list[Strategy], st)          # every op is decided by now


class _Before(Sequence):
    """``strategies`` as a pass in program order sees them at op ``v``: the ops after ``v`` not decided yet."""

    def __init__(self, strategies: list[Strategy | None], v: int) -> None:
        self.strategies, self.v = strategies, v

    def __len__(self) -> int:
        return len(self.strategies)

    def __getitem__(self, i):           # type: ignore[override]
        return self.strategies[i] if i < self.v else None


def data_parallel(graph: Graph, params: CostParams, **_: Any) -> SearchResult:
    """MindSpore's data_parallel mode as a plan: the data inputs fixed at their batch split, parameters whole, every
    other op computing in the layout its operands arrive in, its first operand's first (the batch flows on)."""
    r = follow_operands(graph, params, first_operand_first=True)
    return dataclasses.replace(r, algorithm="data_parallel", notes=[
        "data_parallel: the batch is split over every device and flows through every op; parameters are whole "
        "(MindSpore's data parallel)"])


def baseline_plans(graph: Graph, params: CostParams, *, fully_use_devices: bool,
                   index: GraphIndex | None = None) -> dict[str, list[Strategy]]:
    """The baselines of the module doc, by name (a strategy per op id); ``index``: the graph's
    :class:`~searchers.graph_index.GraphIndex`, if at hand. ``params`` is accepted for the searcher signature."""
    ix = GraphIndex(graph) if index is None else index
    semi_auto = follow_strategies(graph, ix)
    unfixed = [op for op in graph.ops if op.kind == "data" and op.fixed is None]
    plans = {
        # with every data input already fixed (a dataset strategy), the data-parallel plan is semi_auto's
        "data parallel": (_with_data_split(graph, unfixed, lambda: follow_strategies(graph, ix))
                          if unfixed else semi_auto),
        "data parallel (per op)": _per_op(graph, ix, lambda op: (replicated(op) if op.is_source and op.kind != "data"
                                                                 else data_parallel_strategy(op, graph.mesh))),
        "user strategies + follow": semi_auto,
    }
    whole = [op for op in graph.ops if op.kind == "data" and op.fixed is not None and not any(op.fixed)]
    if whole:       # follow with the whole data taken as split, then the data given back its own (whole) layout
        sliced = _with_data_split(graph, whole, lambda: follow_strategies(graph, ix))
        for op in whole:
            sliced[op.id] = tuple(tuple(a) for a in op.fixed)
        plans["data parallel (sliced)"] = sliced
    if not fully_use_devices:
        plans["replicated"] = _per_op(graph, ix, replicated)
    return plans


def admissible(graph: Graph, strategies: Sequence[Strategy] | Mapping[int, Strategy], *, fully_use_devices: bool) -> bool:
    """Whether every unfixed, untied consumer of a data input computes in one of its candidates (module doc)."""
    if not fully_use_devices:
        return True           # every split of a splittable dim, and whole, is a candidate
    entry = {c for op in graph.ops if op.kind == "data" for t in op.outputs for c in graph.tensors[t].consumers}
    return all(strategies[c] in enumerate_strategies(graph.ops[c], graph.mesh, fully_use_devices=True)
               for c in entry if graph.ops[c].fixed is None and graph.ops[c].follow_operand is None
               and c not in graph.operand_ties)


def no_worse_than_baselines(graph: Graph, params: CostParams, result: SearchResult, *,
                            fully_use_devices: bool, index: GraphIndex | None = None, swap: bool = True) -> SearchResult:
    """``result``, or the cheapest baseline where it costs less on the same cost model (noted); its ``seconds``
    include the check. ``index``: the graph's :class:`~searchers.graph_index.GraphIndex`, if the searcher has one.
    ``swap=False`` (sharding_propagation, MindSpore's algorithm): ``result`` itself, with a note giving both figures
    where a baseline is cheaper."""
    t0 = time.perf_counter()
    best: tuple[float, str, list[Strategy], Cost] | None = None
    ix = GraphIndex(graph) if index is None else index
    priced: dict[int, Cost] = {}                            # a baseline that is another's plan is priced once
    cheaper = []
    for name, plan in baseline_plans(graph, params, fully_use_devices=fully_use_devices, index=ix).items():
        cost = priced.get(id(plan))
        if cost is None:
            cost = priced[id(plan)] = ix.cost(plan, params)
        if cost.total < result.cost.total * (1 - _REL):
            cheaper.append((cost.total, name, plan, cost))
    limit: float | None = None
    for total, name, plan, cost in sorted(cheaper, key=lambda c: c[0]):
        if not admissible(graph, plan, fully_use_devices=fully_use_devices):
            continue
        # the summed memory of every op counts each tensor at least once, so it bounds the peak: within the capacity,
        # the baseline fits without its profile (GraphIndex.peak: 0.2-0.3 s for the first two at 100k ops)
        if cost.memory <= params.device_memory_capacity:
            best = (total, name, plan, cost)
            break
        if limit is None:
            limit = max(ix.peak(result.strategies), params.device_memory_capacity)
        if ix.peak(plan) <= limit:
            best = (total, name, plan, cost)
            break
    seconds = result.seconds + time.perf_counter() - t0
    if best is None:
        return dataclasses.replace(result, seconds=seconds)
    total, name, plan, cost = best
    if not swap:
        return dataclasses.replace(result, seconds=seconds, notes=list(result.notes) + [
            f"the {name} plan costs {total:.4g} on this cost model, below the propagated plan's "
            f"{result.cost.total:.4g}: kept the propagation (MindSpore's sharding_propagation returns what it "
            f"propagates; search_mode 'dynamic_programming', 'recursive_programming' or 'ilp' returns the cheaper)"])
    return dataclasses.replace(result, strategies=dict(enumerate(plan)), cost=cost, seconds=seconds, notes=list(result.notes) + [
        f"the {name} plan costs {total:.4g} on this cost model, below the search's {result.cost.total:.4g}: "
        f"returned it (no search returns a plan worse than the obvious ones)"])
