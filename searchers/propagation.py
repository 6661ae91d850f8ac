"""MindSpore's sharding_propagation (docs/algorithms.md §3).

Start from the ops with a fixed strategy (``op.fixed``); walk the graph breadth-first over edges in both directions.
When an op is first reached it is decided at once, against every neighbour already decided (operand producers and
result consumers): among its candidates keep those whose redistributions against those sides move the fewest bytes
(over the links' bandwidth, no per-collective latency: MindSpore's redistribution cost counts the data a change
moves; a layout equal to the neighbour's, or obtainable by a free local slice, moves none), then those of least
summed redistribution cost on the cost model (latency included), then those whose strategy uses as many
devices as the neighbour ops' strategies do (the least summed ``|log2 devices - log2 neighbour's devices|``; a source,
data or a parameter, has a layout and no strategy, and does not count), then take the least own cost (ties: candidate
order). Every split is a candidate, one that idles devices too: fully_use_devices restricts the cost-model searchers,
not propagation (issue 14: a ReLU that feeds a MatMul operand laid out (2, 1) takes (2, 1) on 8 devices). This follows
MindSpore's rule (edge_costmodel.cc: zero-communication candidates first, the least redistribution computation cost
among them, then the op's own communication; else the least communication). The middle key is how mshard reads
MindSpore's unit-test expectations: a convolution chain seeded ``(1, 1, 2, 1)`` with fully_use_devices off keeps
``(1, 1, 2, 1)`` (2 devices, as the seed) where the lesser compute alone took ``(4, 1, 2, 1)``; and an Add after a MatMul
``((4, 2), (1, 2))`` takes ``(4, 2)`` (8 devices, as the MatMul), not the ``(4, 1)`` the MatMul's reduced result
arrives in (tests/e2e/search/test_mindspore_propagation_expectations.py). Costs compare with a relative tolerance of
1e-9, so float rounding never decides a tie.
A source op gets one strategy, so a parameter consumed by several ops
keeps the layout of the first decision; later consumers pay the redistribution. Ops never
reached get :func:`~searchers.strategies.data_parallel_strategy`; with no fixed op at all every
op does, and a note says so.

A training step's backward and update (``Op.derived``) are not propagated into: MindSpore propagates over the
forward operators and derives the backward from their strategies, and the optimizer from the parameters' layouts.
Here they are decided after the forward: with the forward's strategies held, the cost model's exact search
(:func:`~searchers.dynamic_programming.dynamic_programming`) chooses them and the layouts of the state only they
read (an optimizer moment), every updated state stored in its input's layout. The layout MindSpore derives is among
the candidates, so by the cost model this backward costs no more. Propagated into, a gradient's free local slice
ties with keeping it whole, the lesser compute picks the slice, and every updated weight is gathered back after the
step (a data-parallel MLP step: 2.5 times data parallel's cost, an all-gather per weight). Deciding each derived op
in the layout its operands arrive in (semi_auto's default) was tried too: a weight gradient of a Megatron step then
took both operands' splits and all-reduced over the batch axis what the optimizer-parallel step reduce-scatters.

An opaque op (``OPAQUE_KINDS``: a scan, while or cond the graph shows as one op over its body) is decided the same
way, in the layout its decided operands arrive in: MindSpore's graph has no such op (it inlines the body), and its
own cost does not model the body, so the lesser estimated compute would pick a split of a carry that the body then
pays for (a GradAccumulationCell step: an extra all-reduce and an all-gather per accumulated gradient).

The walk itself is :func:`searchers.spread.propagate`. Work is linear in edges x candidates; cost vectors and
decisions are memoised per (:class:`~searchers.spec.OpSpec`, neighbour layouts), so repeated layers cost one
evaluation.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4, 6))
>>> (y,) = g.add_op("exp", "exp", {"i": 4, "j": 6}, [x], [("i", "j")], [("i", "j")], fixed=((), (0,)))
>>> _ = g.add_op("neg", "neg", {"i": 4, "j": 6}, [y], [("i", "j")], [("i", "j")])
>>> sharding_propagation(g, CostParams()).strategies
{0: ((), (0,)), 1: ((), (0,)), 2: ((), (0,))}
"""

from __future__ import annotations

import dataclasses
import gc
import time

from .baselines import no_worse_than_baselines
from .cache import cached_search
from .cost import CostParams
from .dynamic_programming import dynamic_programming
from .graph import DeviceMesh, Graph
from .graph_index import GraphIndex
from .result import SearchResult
from .spread import State, propagate


@cached_search
def sharding_propagation(graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
                         max_candidates: int | None = None, baselines: bool = True) -> SearchResult:
    """Propagate the fixed strategies of ``graph`` to every op it can reach (see module doc) and return that plan,
    as MindSpore's sharding_propagation does: where an obvious plan (:mod:`searchers.baselines`) costs less on the
    cost model, a note says so with both figures, and the plan is kept (``baselines=False``: no such check).
    ``fully_use_devices`` does not restrict the propagation (a neighbour takes the layout that needs no
    redistribution even where that idles devices, as MindSpore's propagation does: the option is the cost-model
    searchers'); it only keeps the replicated plan out of the baselines that are compared."""
    # the search allocates only acyclic tuples and lists: pausing the cyclic garbage collector
    # saves its repeated scans of the (large) live graph, about a third of the time at 100k ops
    enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        ix = GraphIndex(graph)
        res = propagate(graph, params, max_candidates, ix, derive=_derive, least_change=True)
        res = dataclasses.replace(res, seconds=time.perf_counter() - t0)        # the index's time included
        return (no_worse_than_baselines(graph, params, res, fully_use_devices=fully_use_devices, index=ix, swap=False)
                if baselines else res)
    finally:
        if enabled:
            gc.enable()


def _derive(graph: Graph, params: CostParams, st: State, derived: list[bool], set_strategy) -> None:
    """Decide the derived ops given the forward (module doc): the forward's strategies and the layouts of the state it
    reads are held, and :func:`~searchers.dynamic_programming.dynamic_programming` chooses the derived ops' strategies
    and the layouts of the state only they read (an optimizer moment), with every write-back tied to its state."""
    held = [op.fixed for op in graph.ops]
    try:
        for op in graph.ops:
            if not derived[op.id] and st.chosen[op.id] is not None:
                op.fixed = st.chosen[op.id]
        res = dynamic_programming(graph, params, cache=False)
    finally:
        for op, f in zip(graph.ops, held):
            op.fixed = f
    for op in graph.ops:
        if st.chosen[op.id] is None:
            set_strategy(op.id, res.strategies[op.id])


def _main() -> None:  # pragma: no cover - a benchmark, run by hand
    import argparse

    from .generators import graph_of_size

    ap = argparse.ArgumentParser(description="time sharding_propagation on a synthetic graph")
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--family", default="transformer")
    ap.add_argument("--devices", type=int, default=8)
    a = ap.parse_args()
    t = time.perf_counter()
    g = graph_of_size(a.ops, family=a.family, mesh=DeviceMesh.prime(a.devices), fix_data=True)
    build = time.perf_counter() - t
    r = sharding_propagation(g, CostParams())
    print(f"{a.family}: {len(g)} ops, {sum(len(op.inputs) for op in g.ops)} edges; build {build:.2f} s; "
          f"propagation {r.seconds:.3f} s; cost total {r.cost.total:.6g}; notes {r.notes}")


if __name__ == "__main__":  # pragma: no cover
    _main()
