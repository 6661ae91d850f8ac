"""recursive_programming specifics: one round per prime factor, heaviest first, cuts that can
complete under fully_use_devices, the follow flag, quality against dynamic_programming."""

import dataclasses

import pytest

from searchers.cost import CostParams
from searchers.dynamic_programming import dynamic_programming
from searchers.generators import conv_net, graph_of_size, mlp_chain
from searchers.graph import DeviceMesh, Graph
from searchers.recursive_programming import _Rounds, recursive_programming
from searchers.strategies import strategies_for

P = CostParams()


def test_rounds_cut_one_axis_at_a_time():
    cands = strategies_for((4, 6), (False, False), (2, 3))
    r = _Rounds(cands, cands, 2)
    assert cands[r.rep] == ((), ())
    # round 0 (axis 0, size 2): split dim 0, dim 1 or nothing; dim 0 first on ties
    assert [cands[i] for i in r.kids[0, r.rep]] == [((0,), ()), ((), (0,)), ((), ())]
    # round 1 (axis 1, size 3) after cutting dim 0: only dim 1 (6) takes a factor 3
    cut0 = cands.index(((0,), ()))
    assert [cands[i] for i in r.kids[1, cut0]] == [((0,), (1,)), ((0,), ())]


def test_fully_use_devices_keeps_only_cuts_that_can_complete():
    sizes = (2, 6)
    cands = strategies_for(sizes, (False, False), (2, 2))
    finals = strategies_for(sizes, (False, False), (2, 2), True)
    r = _Rounds(cands, finals, 2)
    for (axis, _), kids in r.kids.items():
        for i in kids:
            assert any(sum(len(a) for a in cands[i]) == axis + 1 for _ in [0])   # every round cuts


def test_a_matmul_with_a_small_weight_cuts_its_batch_in_every_round():
    g = Graph(DeviceMesh((2, 3)))
    x = g.source("x", (12, 6))
    w = g.source("w", (6, 4), kind="param")
    g.add_op("mm", "dot_general", {"m": 12, "k": 6, "n": 4}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    # without the stored-state price: with it, splitting n as well stores half the weight at no communication
    # either way (searchers/recursive_programming.py's doctest shows both)
    s = recursive_programming(g, dataclasses.replace(P, state_weight=0.0), cache=False).strategies
    assert s[2] == ((0, 1), (), ()) and s[0] == ((0, 1), ()) and s[1] == ((), ())


def test_heaviest_op_is_cut_and_the_plan_is_near_optimal():
    """mm2 is 16x heavier than mm1."""
    g = Graph(DeviceMesh((2,)))
    x = g.source("x", (8, 8), fixed=((0,), ()))
    w1 = g.source("w1", (8, 8), kind="param")
    w2 = g.source("w2", (8, 128), kind="param")
    (h,) = g.add_op("mm1", "dot_general", {"m": 8, "k": 8, "n": 8}, [x, w1], [("m", "k"), ("k", "n")], [("m", "n")])
    (r,) = g.add_op("relu", "relu", {"i": 8, "j": 8}, [h], [("i", "j")], [("i", "j")])
    g.add_op("mm2", "dot_general", {"m": 8, "k": 8, "n": 128}, [r, w2], [("m", "k"), ("k", "n")], [("m", "n")])
    res = recursive_programming(g, P, cache=False)
    assert any(res.strategies[5])                       # the heaviest op is cut
    assert res.cost.total <= dynamic_programming(g, P, cache=False).cost.total * 1.10


@pytest.mark.parametrize("family", ["mlp", "transformer", "conv"])
def test_within_ten_percent_of_dynamic_programming_on_the_benchmark_families(family):
    g = graph_of_size(150, family, DeviceMesh.prime(8), fix_data=True)
    rp = recursive_programming(g, P, cache=False).cost.total
    dp = dynamic_programming(g, P, cache=False, core_time_limit=0.5, improve_passes=1).cost.total
    assert rp <= 1.10 * dp


def test_work_is_memoised_across_repeated_layers():
    """Twenty times the layers is far less than twenty times the work per new decision."""
    small = recursive_programming(mlp_chain(5, 16, 8, DeviceMesh((2, 2)), backward=True), P, cache=False)
    big = recursive_programming(mlp_chain(100, 16, 8, DeviceMesh((2, 2)), backward=True), P, cache=False)
    assert len(big.strategies) > 15 * len(small.strategies)
    g = conv_net(4, 8, (2, 4, 8), 6, DeviceMesh((2, 2)), backward=True)
    assert len(recursive_programming(g, P, cache=False).strategies) == len(g)
