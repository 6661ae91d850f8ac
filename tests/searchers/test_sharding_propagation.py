"""sharding_propagation (docs/algorithms.md §3): the Megatron acceptance example, reconciling several
decided sides, shared parameters, data-parallel fallbacks, agreement with the oracle, speed."""


import pytest

from searchers.brute import brute_force
from searchers.cost import CostParams, graph_cost
from searchers.generators import graph_of_size, mlp_chain
from searchers.graph import DeviceMesh, Graph
from searchers.propagation import sharding_propagation
from searchers.result import SearchResult
from searchers.strategies import data_parallel_strategy

P = CostParams()


def megatron_mlp():
    """x[64,32] @ w1[32,128] -> relu -> @ w2[128,32] on a (2,2,2) mesh, mm1 column-parallel."""
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (64, 32), kind="data")
    w1 = g.source("w1", (32, 128), kind="param")
    w2 = g.source("w2", (128, 32), kind="param")
    (h,) = g.add_op("mm1", "dot_general", {"m": 64, "k": 32, "n": 128}, [x, w1],
                    [("m", "k"), ("k", "n")], [("m", "n")], fixed=((0,), (), (1, 2)))
    (r,) = g.add_op("relu", "relu", {"i": 64, "j": 128}, [h], [("i", "j")], [("i", "j")])
    g.add_op("mm2", "dot_general", {"m": 64, "k": 128, "n": 32}, [r, w2], [("m", "k"), ("k", "n")], [("m", "n")])
    return g


def test_megatron_mlp_becomes_column_then_row_parallel():
    g = megatron_mlp()
    res = sharding_propagation(g, P)
    assert isinstance(res, SearchResult) and res.algorithm == "sharding_propagation"
    s = res.strategies
    x, w1, w2, mm1, relu, mm2 = range(6)
    assert s[mm1] == ((0,), (), (1, 2))                  # fixed, untouched
    assert s[relu] == ((0,), (1, 2))                     # follows mm1's result
    assert s[mm2] == ((0,), (1, 2), ())                  # row parallel: k over (1,2), m over (0,)
    assert s[w2] == ((1, 2), ())                         # the propagated w2 layout
    assert s[w1] == ((), (1, 2)) and s[x] == ((0,), ())
    # exactly one collective: mm2's all-reduce of its [64,32] result, m-split in 2 (4096 B local)
    # over k's 4 devices: 2 * 4096 * 3/4 bytes
    c = res.cost
    # pytest.approx defaults (rel=1e-6): the bytes are exact float64 products; comm_time has two roundings (~2**-52);
    # total is the same plan's graph_cost, re-summed (~n * 2**-53)
    assert c.comm_bytes["all-reduce"] == pytest.approx(6144.0)
    assert c.comm_bytes["all-gather"] == c.comm_bytes["all-to-all"] == c.comm_bytes["reduce-scatter"] == 0.0
    assert c.comm_time == pytest.approx(5e-6 + 6144 / 100e9)      # one all-reduce (group of 4): one latency
    assert c.total == pytest.approx(graph_cost(g, s, P).total)
    assert res.notes == [] and res.seconds >= 0.0


def test_megatron_against_the_oracle():
    g = megatron_mlp()
    g.ops[0].fixed, g.ops[1].fixed = ((0,), ()), ((), (1, 2))      # as propagated; keeps brute force small
    prop = sharding_propagation(g, P, baselines=False).strategies
    best = brute_force(g, P)
    # propagation is greedy: it keeps relu's layout for mm2 (no redistribution). The oracle may
    # do better by paying for a redistribution; it is never worse.
    assert graph_cost(g, best, P).total <= graph_cost(g, prop, P).total
    assert {i: best[i] for i in (0, 1, 3, 4)} == {i: prop[i] for i in (0, 1, 3, 4)}
    # with the baseline check (the default) the plan is never worse than propagation alone, nor the oracle's
    checked = sharding_propagation(g, P).strategies
    assert graph_cost(g, best, P).total <= graph_cost(g, checked, P).total <= graph_cost(g, prop, P).total


def test_several_decided_sides_are_reconciled():
    g = Graph(DeviceMesh((2,)))
    a = g.source("a", (8, 8), fixed=((0,), ()))       # rows split
    b = g.source("b", (8,), fixed=((0,),))            # the bias split along j
    g.add_op("add", "add", {"i": 8, "j": 8}, [a, b], [("i", "j"), ("j",)], [("i", "j")])
    s = sharding_propagation(g, P).strategies
    # i-split: a free, b all-gathered (16 B); j-split would match b but all-to-all a (64 B);
    # replicated gathers both. The sum over both sides picks the i split.
    assert s[2] == ((0,), ())


def test_a_shared_parameter_keeps_the_first_decided_layout():
    g = Graph(DeviceMesh((2,)))
    x = g.source("x", (16, 32))
    w = g.source("w", (32, 32), kind="param")
    g.add_op("mmA", "dot_general", {"m": 16, "k": 32, "n": 32}, [x, w], [("m", "k"), ("k", "n")],
             [("m", "n")], fixed=((), (), (0,)))
    z = g.source("z", (16, 32), fixed=((0,), ()))
    g.add_op("mmB", "dot_general", {"m": 16, "k": 32, "n": 32}, [z, w], [("m", "k"), ("k", "n")], [("m", "n")])
    res = sharding_propagation(g, P)
    # BFS from mmA decides w first (column split); when z's turn decides mmB, w stays as it is.
    assert res.strategies[1] == ((), (0,))
    # mmB: m-split would gather w (2048 B), n-split gathers z (1024 B), k-split needs two
    # all-to-alls (512 + 1024 B, two latencies), replicated gathers both: n-split wins
    assert res.strategies[4] == ((), (), (0,))
    # pytest.approx default rel=1e-6: byte counts are exact in float64
    assert res.cost.comm_bytes["all-gather"] == pytest.approx(1024.0)
    assert res.cost.comm_bytes["all-to-all"] == 0.0


def test_backward_direction_picks_a_producer_that_needs_no_gather():
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (8, 8))
    (y,) = g.add_op("exp", "exp", {"i": 8, "j": 8}, [x], [("i", "j")], [("i", "j")])
    g.add_op("neg", "neg", {"i": 8, "j": 8}, [y], [("i", "j")], [("i", "j")], fixed=((1,), (0,)))
    s = sharding_propagation(g, P).strategies
    assert s[1] == ((1,), (0,)) and s[0] == ((1,), (0,))


@pytest.mark.parametrize("fully", [False, True])
def test_a_neighbour_takes_the_layout_that_needs_no_redistribution_even_idling_devices(fully):
    """Issue 14's example: a ReLU feeding a MatMul operand laid out (2, 1) on 8 devices takes (2, 1), as MindSpore's
    propagation does, with fully_use_devices on or off (it restricts the cost-model searchers only): nothing is
    redistributed."""
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (16, 8))
    w = g.source("w", (8, 4), kind="param")
    (r,) = g.add_op("relu", "max", {"i": 16, "j": 8}, [x], [("i", "j")], [("i", "j")])
    g.add_op("mm", "dot_general", {"m": 16, "k": 8, "n": 4}, [r, w], [("m", "k"), ("k", "n")], [("m", "n")],
             fixed=((0,), (), ()))
    res = sharding_propagation(g, P, fully_use_devices=fully, cache=False)
    assert res.strategies[2] == ((0,), ()) and res.strategies[0] == ((0,), ())
    assert res.cost.communication == 0


def test_no_fixed_op_means_data_parallel_with_a_note():
    g = mlp_chain(2, 64, 32, DeviceMesh((2, 2)))
    res = sharding_propagation(g, P)
    assert res.strategies == {op.id: data_parallel_strategy(op, g.mesh) for op in g.ops}
    assert res.strategies[0] == ((0, 1), ()) and res.strategies[1] == ((), ())
    assert any("no op has a fixed strategy" in n for n in res.notes)


def test_unreached_ops_get_data_parallel_with_a_note():
    g = Graph(DeviceMesh((2,)))
    x = g.source("x", (4, 4), fixed=((), (0,)))
    g.add_op("exp", "exp", {"i": 4, "j": 4}, [x], [("i", "j")], [("i", "j")])
    z = g.source("z", (4, 4))                          # a separate component
    g.add_op("neg", "neg", {"i": 4, "j": 4}, [z], [("i", "j")], [("i", "j")])
    res = sharding_propagation(g, P)
    assert res.strategies[1] == ((), (0,))
    assert res.strategies[2] == ((0,), ()) and res.strategies[3] == ((0,), ())
    assert any("2 op(s) not reached" in n and "neg" in n for n in res.notes)


def test_never_beats_the_oracle_on_small_graphs():
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (8, 4), fixed=((0,), ()))
    w = g.source("w", (4, 8), kind="param")
    (y,) = g.add_op("mm", "dot_general", {"m": 8, "k": 4, "n": 8}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    g.add_op("exp", "exp", {"i": 8, "j": 8}, [y], [("i", "j")], [("i", "j")])
    prop = graph_cost(g, sharding_propagation(g, P).strategies, P).total
    best = graph_cost(g, brute_force(g, P), P).total
    # 1e-12: the same plan's float64 total, re-summed (~n * 2**-53)
    assert best <= prop * (1 + 1e-12)


def test_result_cost_equals_graph_cost_on_a_training_graph():
    g = graph_of_size(2000, "transformer", DeviceMesh((2, 2, 2)), fix_data=True)
    res = sharding_propagation(g, P)
    ref = graph_cost(g, res.strategies, P)
    # float64 sums over ~2000 ops in another order: <= 2000 * 2**-53 = 2e-13 relative, far below 1e-9
    assert res.cost.total == pytest.approx(ref.total, rel=1e-9)
    assert res.cost.memory == pytest.approx(ref.memory, rel=1e-9)
    for k, v in ref.comm_bytes.items():
        assert res.cost.comm_bytes[k] == pytest.approx(v, rel=1e-9)
    assert not any("not reached" in n for n in res.notes)     # the data source reaches every op


def test_100k_ops_propagate_to_every_op():
    """Its speed is measured in bench/search.py (never timed in a test: CI machines are shared and noisy)."""
    g = graph_of_size(100_000, "transformer", DeviceMesh.prime(8), fix_data=True)
    assert len(g) >= 95_000
    res = sharding_propagation(g, P)
    assert len(res.strategies) == len(g)
    assert not any("not reached" in n for n in res.notes)     # the data source reaches every op
    # float64 sums over ~1e5 ops in another order: <= 1e5 * 2**-53 = 1.1e-11 relative, 1e-9 leaves 100x
    assert res.cost.total == pytest.approx(graph_cost(g, res.strategies, P).total, rel=1e-9)


def _sgd_step(fixed_mm):
    """A training step's graph as mshard traces it: x[64,32] @ w[32,16] -> sum (forward), a weight gradient
    x^T @ y (derived; y stands for the cotangent, which arrives in the forward result's layout), the update w - lr*g and Adam-like moment m' = m + g (derived), and a write-back per
    updated state (follow_operand=1). ``fixed_mm``: the forward MatMul's strategy (the user's)."""
    g = Graph(DeviceMesh((2, 4)))
    x = g.source("x", (64, 32), kind="data", fixed=((0, 1), ()))
    w = g.source("w", (32, 16), kind="param")
    m = g.source("m", (32, 16), kind="param")           # an optimizer moment: only the update reads it
    (y,) = g.add_op("mm", "dot_general", {"m": 64, "k": 32, "n": 16}, [x, w], [("m", "k"), ("k", "n")],
                    [("m", "n")], fixed=fixed_mm)
    g.add_op("sum", "reduce_sum", {"i": 64, "j": 16}, [y], [("i", "j")], [()])
    (gw,) = g.add_op("grad", "dot_general", {"b": 64, "k": 32, "n": 16}, [x, y], [("b", "k"), ("b", "n")],
                     [("k", "n")])
    (nw,) = g.add_op("upd", "sub", {"i": 32, "j": 16}, [w, gw], [("i", "j")] * 2, [("i", "j")])
    (nm,) = g.add_op("mom", "add", {"i": 32, "j": 16}, [m, gw], [("i", "j")] * 2, [("i", "j")])
    for new, old, name in ((nw, w, "w"), (nm, m, "m")):
        g.add_op(f"writeback/{name}", "writeback", {"i": 32, "j": 16}, [new, old], [("i", "j")] * 2, [("i", "j")],
                 follow_operand=1)
    for op in g.ops[5:]:                     # what no user output (the sum) depends on: mshard._src.planning.prepare.free_derived
        op.derived = op.free_devices = True
    return g


def test_a_training_steps_backward_and_update_are_derived_not_propagated_into():
    """MindSpore propagates over the forward and derives the backward and the optimizer from it (module doc of
    searchers.propagation). Data parallel (the forward MatMul fixed ((0, 1), (), ())): the gradient's partial sums are
    reduced and the weight's update computes whole, where the weight is stored; nothing is gathered back after the
    step (propagated into, a free slice of the gradient split the update and each new weight was all-gathered)."""
    g = _sgd_step(((0, 1), (), ()))
    res = sharding_propagation(g, P, cache=False)
    s = res.strategies
    _x, w, m, mm, _sm, _grad, upd, _mom, wbw, wbm = range(10)
    assert s[mm] == ((0, 1), (), ())                    # the forward: as fixed
    assert s[w] == ((), ()) and s[upd] == ((), ()) and s[wbw] == ((), ())
    assert s[wbm] == s[m]                               # every state stored where it is read
    assert res.cost.comm_bytes["all-gather"] == 0.0 and res.cost.comm_bytes["all-to-all"] == 0.0


def test_a_moment_only_the_update_reads_is_stored_where_the_update_computes():
    """Column parallel (mm fixed ((0,), (), (1,)): w stored split on its columns over the 4-way axis). The update
    subtracts the gradient from w where w is stored ((), (1,)); the moment m, which only the update reads, is stored
    in the layout its update computes in (its write-back tied to it), so neither is gathered after the step."""
    g = _sgd_step(((0,), (), (1,)))
    g.ops[0].fixed = ((0,), ())
    res = sharding_propagation(g, P, cache=False)
    s = res.strategies
    _x, w, m, _mm, _sm, _grad, upd, mom, wbw, wbm = range(10)
    assert s[w] == ((), (1,)) and s[upd] == ((), (1,)) and s[wbw] == ((), (1,))
    assert s[m] == s[mom] == s[wbm] and s[m][1] == (1,)       # split at least like w, never gathered back
    assert res.cost.comm_bytes["all-gather"] == 0.0 and res.cost.comm_bytes["all-to-all"] == 0.0
