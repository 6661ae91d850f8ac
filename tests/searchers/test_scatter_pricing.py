"""The searchers price a dot's partial sums reduce-scattered where its one reader allows (issue 40).

``Op.scatter`` marks a dot whose partial result the executor can reduce-scatter
(mshard/_src/planning/scattered_sums.py). Its reader's layout then decides what the reduction costs: an all-reduce
and a change, or a reduce-scatter into (and a change from) the reader's split. ``searchers.cost.graph_cost`` and
the pairwise problem that dynamic_programming and ilp solve price it so.

The oracle is exhaustive: every combination of candidate strategies priced by ``graph_cost`` (the objective's
definition), not by the pairwise problem the searchers solve. The bytes come from the ring formulas: an all-reduce
of S over k devices moves 2 S (k-1)/k, a reduce-scatter S (k-1)/k.
"""

import itertools
import random

import pytest

from searchers.cost import CostParams, graph_cost, scatter_saving
from searchers.dynamic_programming import dynamic_programming
from searchers.graph import DeviceMesh, Graph, operand_layout
from searchers.ilp import ilp
from searchers.pairwise_problem import PairwiseProblem
from searchers.strategies import enumerate_strategies


def _net(scatter: bool) -> Graph:
    """x [64, 192] that arrives split on its contraction 4 ways, @ w [192, 32], then an elementwise op. The partial
    result is 8 KiB; x is 48 KiB. Reduced where it is made: an all-reduce of 12 KiB per device; reduce-scattered
    into the next op's split: 6 KiB; the other way, x moved to rows by an all-to-all, 9 KiB: between the two."""
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (64, 192), fixed=((), (0, 1)))
    w = g.source("w", (192, 32))
    (h,) = g.add_op("mm", "dot_general", {"m": 64, "k": 192, "n": 32}, [x, w], [("m", "k"), ("k", "n")],
                    [("m", "n")])
    g.ops[-1].scatter = scatter
    (y,) = g.add_op("relu", "max", {"i": 64, "j": 32}, [h], [("i", "j")], [("i", "j")])
    g.outputs.append(y)
    return g


def _brute(graph: Graph, params: CostParams):
    cands = [enumerate_strategies(op, graph.mesh) for op in graph.ops]
    return min((graph_cost(graph, dict(enumerate(c)), params).total, c) for c in itertools.product(*cands))


def test_a_partial_sum_read_split_is_priced_as_a_reduce_scatter():
    g, p = _net(True), CostParams()
    mm, relu = g.ops[2], g.ops[3]
    k_split = ((), (0, 1), ())
    target, change = scatter_saving(mm, k_split, operand_layout(relu, ((0, 1), ()), 0), g, p)
    assert target == ((0, 1), ())
    assert change.comm_bytes["all-reduce"] == -2 * 8192 * 3 / 4
    assert change.comm_bytes["reduce-scatter"] == 8192 * 3 / 4
    assert scatter_saving(mm, k_split, operand_layout(relu, ((), ()), 0), g, p) is None   # read whole: all-reduce
    assert scatter_saving(mm, ((0, 1), (), ()), operand_layout(relu, ((0, 1), ()), 0), g, p) is None  # no partial


@pytest.mark.parametrize("searcher", [dynamic_programming, ilp])
def test_searchers_find_the_plan_the_reduce_scatter_makes_cheapest(searcher):
    """With the reduce-scatter priced, contracting over x's split and scattering the result beats moving x to rows;
    priced as an all-reduce (``scatter=False``, the searchers before), moving x won. Both searchers reach the
    exhaustive optimum of the objective either way."""
    p = CostParams()
    best, choice = _brute(_net(True), p)
    assert choice[2] == ((), (0, 1), ())                       # the contraction split over x's split
    _, plain_choice = _brute(_net(False), p)
    assert plain_choice[2] == ((0, 1), (), ())                 # rows: x moved by an all-to-all
    got = searcher(_net(True), p)
    assert graph_cost(_net(True), got.strategies, p).total == pytest.approx(best, rel=1e-12)
    assert got.strategies[2] == ((), (0, 1), ())
    assert graph_cost(_net(True), dict(enumerate(plain_choice)), p).total > best


def test_the_pairwise_problem_totals_equal_graph_cost_with_scatter_ops():
    """The pairwise problem's total of any choice is graph_cost's (the doc's promise), scatter pairs included."""
    g, p = _net(True), CostParams()
    prob = PairwiseProblem.build(g, p)
    rng = random.Random(5)
    for _ in range(200):
        choice = {v: rng.randrange(len(prob.cands[v])) for v in range(len(prob.cands))}
        s = {v: prob.cands[v][c] for v, c in choice.items()}
        assert prob.total(choice) == pytest.approx(graph_cost(g, s, p).total, rel=1e-9, abs=1e-15)
