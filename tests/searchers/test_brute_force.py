"""brute_force: the exact oracle, checked against an itertools enumeration of graph_cost."""

import itertools

import pytest

from searchers.brute import brute_force
from searchers.cost import CostParams, graph_cost
from searchers.errors import SearchLimitError
from searchers.graph import DeviceMesh, Graph
from searchers.strategies import enumerate_strategies

P = CostParams()


def small_graph(fixed_x=None):
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (8, 4), fixed=fixed_x)
    w = g.source("w", (4, 6), kind="param")
    (y,) = g.add_op("mm", "dot_general", {"m": 8, "k": 4, "n": 6}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    g.add_op("exp", "exp", {"i": 8, "j": 6}, [y], [("i", "j")], [("i", "j")])
    return g


def naive_minimum(g, params):
    cands = [enumerate_strategies(op, g.mesh) for op in g.ops]
    return min(graph_cost(g, dict(enumerate(c)), params).total for c in itertools.product(*cands))


@pytest.mark.parametrize("fixed_x", [None, ((), (0, 1)), ((1,), ())])
def test_brute_force_matches_naive_enumeration(fixed_x):
    g = small_graph(fixed_x)
    best = brute_force(g, P)
    assert set(best) == {op.id for op in g.ops}
    # float64: graph_cost totals of two optimal plans, the same or tied, re-summed in another order (~n * 2**-53)
    assert graph_cost(g, best, P).total == pytest.approx(naive_minimum(g, P), rel=1e-9)
    if fixed_x is not None:
        assert best[0] == fixed_x


def test_brute_force_follows_a_fixed_split_through_an_elementwise_chain():
    g = Graph(DeviceMesh((2,)))
    x = g.source("x", (8, 8), fixed=((), (0,)))
    (y,) = g.add_op("neg", "neg", {"i": 8, "j": 8}, [x], [("i", "j")], [("i", "j")])
    g.add_op("exp", "exp", {"i": 8, "j": 8}, [y], [("i", "j")], [("i", "j")])
    # keeping j split costs no communication and halves compute and memory
    assert brute_force(g, P) == {0: ((), (0,)), 1: ((), (0,)), 2: ((), (0,))}


def test_brute_force_fully_use_devices_uses_every_axis():
    g = small_graph()
    best = brute_force(g, P, fully_use_devices=True)
    for oid, s in best.items():
        if not g.ops[oid].is_source:     # an input's layout follows its users; operators use every axis
            assert sorted(a for axes in s for a in axes) == [0, 1]


def test_brute_force_refuses_large_search():
    g = small_graph()
    with pytest.raises(SearchLimitError, match="exceed"):
        brute_force(g, P, limit=10)
