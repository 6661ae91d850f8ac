"""A tensor dim made of several loop dims (a reshape's merged run, issue 40): layouts, candidates and searches.

``[64, 8] -> [4, 128]`` runs over the factors ``(4, 16, 8)``: the operand's rows are ``(a, b)``, the result's columns
``(b, c)``. A device's block of a merged dim is the loop dims' axes in order, major first; a minor loop dim may be
split only when every loop dim before it is split into its size, else a device's rows would not be one contiguous
run of the flat array (rows split 2 ways by ``a`` and 2 by ``b`` hold rows 0-15 of 32 and 32-47, not a block).
"""

import itertools
import math

import pytest

from searchers.brute import brute_force
from searchers.cost import CostParams, graph_cost
from searchers.dynamic_programming import dynamic_programming
from searchers.graph import DeviceMesh, Graph, operand_layout, result_layout, strategy_of_layout
from searchers.ilp import ilp
from searchers.propagation import sharding_propagation
from searchers.recursive_programming import recursive_programming
from searchers.strategies import enumerate_strategies, is_legal

P = CostParams()
MESH = DeviceMesh((2, 2, 2))
SEARCHERS = {"brute_force": lambda g: brute_force(g, P),
             "dynamic_programming": lambda g: dynamic_programming(g, P, cache=False).strategies,
             "recursive_programming": lambda g: recursive_programming(g, P, cache=False).strategies,
             "ilp": lambda g: ilp(g, P, cache=False).strategies,
             "sharding_propagation": lambda g: sharding_propagation(g, P).strategies}


def reshape_graph(rows_fixed=True):
    """x [64, 8] (its rows split over the three axes when ``rows_fixed``) -> reshape [4, 128] -> relu."""
    g = Graph(MESH)
    x = g.source("x", (64, 8), fixed=((0, 1, 2), ()) if rows_fixed else None)
    (r,) = g.add_op("reshape", "reshape", {"a": 4, "b": 16, "c": 8}, [x], [(("a", "b"), "c")], [("a", ("b", "c"))],
                    out_shapes=[(4, 128)])
    g.add_op("relu", "max", {"i": 4, "j": 128}, [r], [("i", "j")], [("i", "j")])
    return g


def test_a_merged_dim_is_laid_out_over_its_loop_dims_axes_major_first():
    op = reshape_graph().ops[1]
    s = ((0, 1), (2,), ())                      # a split 4 ways (whole), b 2 ways
    assert operand_layout(op, s, 0) == ((0, 1, 2), ())
    assert result_layout(op, s) == ((0, 1), (2,))
    assert strategy_of_layout(op, ((0, 1, 2), ()), 0, MESH) == s
    assert is_legal(op, s, MESH) and not is_legal(op, ((0,), (2,), ()), MESH)


def test_candidates_split_a_minor_loop_dim_only_after_the_major_ones_whole():
    op = reshape_graph().ops[1]
    got = set(enumerate_strategies(op, MESH))
    # every assignment of the 3 axes to no dim or one of a, b, c whose counts divide the sizes, then the rule spelled
    # out on split counts: b split only with a split 4 ways (whole); c only with b split 16 ways (never on 8 devices)
    want = set()
    for owner in itertools.product([None, 0, 1, 2], repeat=3):
        s = tuple(tuple(ax for ax in range(3) if owner[ax] == d) for d in range(3))
        n = [math.prod(MESH.shape[a] for a in axes) for axes in s]
        if any(size % k for size, k in zip((4, 16, 8), n, strict=True)):
            continue
        if (n[1] > 1 and n[0] != 4) or (n[2] > 1 and n[1] != 16):
            continue
        want.add(s)
    assert got == want and ((0, 1), (2,), ()) in got and ((0,), (2,), ()) not in got


@pytest.mark.parametrize("name", SEARCHERS)
def test_rows_split_eight_ways_reach_the_reshape_s_result_with_nothing_moved(name):
    """x's rows over all 8 devices are the result's (4, 2) blocks: every searcher lays the relu out so, and the plan
    moves no byte (the cost model's own price of the plan: no redistribution, no reduction)."""
    g = reshape_graph()
    st = SEARCHERS[name](g)
    assert result_layout(g.ops[1], st[1]) == ((0, 1), (2,)), st
    assert st[2] == ((0, 1), (2,)), st
    assert sum(graph_cost(g, st, P).comm_bytes.values()) == 0
