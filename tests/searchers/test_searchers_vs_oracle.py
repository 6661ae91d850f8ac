"""dynamic_programming and ilp equal brute-force enumeration on small graphs (<= 8 ops, few
strategies); recursive_programming stays within its stated bounds of it."""

import copy
import dataclasses
import math

import pytest

from searchers.brute import brute_force
from searchers.cost import CostParams, graph_cost
from searchers.dynamic_programming import dynamic_programming
from searchers.errors import SearchGraphError
from searchers.generators import conv_net, mlp_chain, random_dag
from searchers.graph import DeviceMesh, Graph
from searchers.ilp import ilp
from searchers.recursive_programming import recursive_programming
from searchers.strategies import enumerate_strategies

P = CostParams()
# a cheaper network than the default (1 us latency, 10 GB/s): compute and memory matter too
P_SLOW_LINK = CostParams(beta=1.0, flops_per_s=1e9)


def combos(g, fully=False):
    return math.prod(len(enumerate_strategies(op, g.mesh, fully_use_devices=fully)) for op in g.ops)


def optimum(g, params, fully=False):
    return graph_cost(g, brute_force(g, params, fully_use_devices=fully), params).total


def diamond(mesh):
    """x -> exp -> (neg, tanh) -> add: a residual-like diamond (triangle after one elimination)."""
    g = Graph(mesh)
    x = g.source("x", (8, 12))
    (e,) = g.add_op("exp", "exp", {"i": 8, "j": 12}, [x], [("i", "j")], [("i", "j")])
    (a,) = g.add_op("neg", "neg", {"i": 8, "j": 12}, [e], [("i", "j")], [("i", "j")])
    (b,) = g.add_op("tr", "transpose", {"i": 8, "j": 12}, [e], [("i", "j")], [("j", "i")])
    (c,) = g.add_op("tr2", "transpose", {"i": 12, "j": 8}, [b], [("i", "j")], [("j", "i")])
    g.add_op("add", "add", {"i": 8, "j": 12}, [a, c], [("i", "j")] * 2, [("i", "j")])
    return g


def k4(mesh):
    """Four ops that each see the three others: no exact elimination applies to them."""
    g = Graph(mesh)
    x = g.source("x", (8, 8))
    ij = {"i": 8, "j": 8}
    (a,) = g.add_op("exp", "exp", ij, [x], [("i", "j")], [("i", "j")])
    (b,) = g.add_op("tr", "transpose", ij, [a], [("i", "j")], [("j", "i")])
    (c,) = g.add_op("add", "add", ij, [a, b], [("i", "j"), ("i", "j")], [("i", "j")])
    g.add_op("add3", "add", ij, [a, b, c], [("i", "j"), ("j", "i"), ("i", "j")], [("i", "j")])
    return g


def cases():
    out = []
    for mesh in (DeviceMesh((2,)), DeviceMesh((2, 2)), DeviceMesh((2, 3))):
        for n in (5, 7, 8):
            for seed in range(4):
                g = random_dag(n, seed, mesh)
                if combos(g) <= 300_000:
                    out.append(pytest.param(g, id=f"random{n}-{seed}-{'x'.join(map(str, mesh.shape))}"))
    m4 = DeviceMesh((2, 2))
    out += [pytest.param(mlp_chain(2, 16, 8, DeviceMesh((2,))), id="mlp2"),
            pytest.param(mlp_chain(1, 8, 4, DeviceMesh((2,)), backward=True), id="mlp1-training"),
            pytest.param(conv_net(4, 4, (2, 4), 6, DeviceMesh((2,))), id="conv"),
            pytest.param(diamond(m4), id="diamond"),
            pytest.param(k4(DeviceMesh((2,))), id="k4")]
    return out


CASES = cases()


@pytest.mark.parametrize("params", [P, P_SLOW_LINK], ids=["default", "slow-link"])
@pytest.mark.parametrize("g", CASES)
def test_dynamic_programming_and_ilp_equal_brute_force(g, params):
    assert combos(g) <= 600_000
    best = optimum(g, params)
    for searcher in (dynamic_programming, ilp):
        res = searcher(g, params, cache=False)
        # float64 costs: an optimal plan's terms re-summed (~n * 2**-53 ~ 1e-15 for <= 8 ops) and the ILP's mip_rel_gap
        # (1e-9); abs=1e-18 only admits an optimum of 0 (the smallest cost term here, ~1e-12 s, is 1e6 times larger)
        assert res.cost.total == pytest.approx(best, rel=1e-9, abs=1e-18), searcher.__name__
        assert not any("not guaranteed optimal" in n for n in res.notes)


@pytest.mark.parametrize("g", CASES[-6:])
def test_equal_brute_force_with_fully_use_devices_and_a_fixed_op(g):
    g = copy.deepcopy(g)                      # CASES are shared: the other tests must see them unfixed
    g.ops[0].fixed = enumerate_strategies(g.ops[0], g.mesh)[-1]
    best = optimum(g, P, fully=True)
    for searcher in (dynamic_programming, ilp):
        res = searcher(g, P, fully_use_devices=True, cache=False)
        # float64 re-summation (~1e-15) within the ILP's mip_rel_gap=1e-9
        assert res.cost.total == pytest.approx(best, rel=1e-9), searcher.__name__
        assert res.strategies[0] == g.ops[0].fixed


def test_the_star_fallback_is_no_worse_than_its_starting_plans():
    """With the exact core solvers switched off, k4 goes through star elimination."""
    g = k4(DeviceMesh((2, 2)))
    res = dynamic_programming(g, P, exact_limit=1, core_time_limit=0, cache=False)
    assert any("star elimination" in n for n in res.notes)
    # 1e-12: a plan equal to the optimum may sum its float64 terms in another order (~n * 2**-53 ~ 1e-15)
    assert res.cost.total >= optimum(g, P) * (1 - 1e-12)
    from searchers.propagation import sharding_propagation
    assert res.cost.total <= sharding_propagation(g, P).cost.total * (1 + 1e-12)


# recursive_programming's stated bounds (its module doc): 1.10x the optimum on the structured
# families (MLP chains, transformer blocks, conv nets); no worst-case bound on random DAGs and
# other shapes, where the measured worst on these tiny graphs is 1.11x (1.75x without the
# block polish; costs there are mostly memory tie-breakers)
STRUCTURED = [c for c in CASES if c.id.startswith(("mlp", "conv"))]
RANDOM = [c for c in CASES if not c.id.startswith(("mlp", "conv"))]


@pytest.mark.parametrize("g", STRUCTURED)
def test_recursive_programming_within_its_bound_on_structured_graphs(g):
    best = optimum(g, P)
    # 1.10: the stated bound; 1e-12: float64 re-summation of a plan at exactly the bound (~n * 2**-53)
    assert recursive_programming(g, P, cache=False).cost.total <= 1.10 * best * (1 + 1e-12)


def test_recursive_programming_on_small_random_graphs():
    """recursive_programming (MindSpore's D-Rec, a heuristic) within 1.25 of the optimum on the communication and
    compute model. With the stored-state price (issue 40) its worst case is random5-2-2x2 at 1.97: a 6 KB weight
    its rounds leave split 2 ways where the optimum splits it 4 ways (both plans move nothing), and on a 5-op graph
    that storage is most of the total; the median case stays optimal with it (the next test)."""
    ratios = []
    q = dataclasses.replace(P, state_weight=0.0)
    for c in RANDOM:
        g = c.values[0]
        ratios.append(recursive_programming(g, q, cache=False).cost.total / optimum(g, q))
    assert max(ratios) <= 1.25
    # 1e-9: an optimal plan's float64 total, re-summed (~1e-15), divided by the optimum
    assert sorted(ratios)[len(ratios) // 2] <= 1.0 + 1e-9     # the median case is optimal


def test_recursive_programming_with_the_state_price_is_optimal_on_the_median_random_graph():
    ratios = sorted(recursive_programming(c.values[0], P, cache=False).cost.total / optimum(c.values[0], P)
                    for c in RANDOM)
    # 1e-9: an optimal plan's float64 total, re-summed (~1e-15), divided by the optimum
    assert ratios[len(ratios) // 2] <= 1.0 + 1e-9


def test_block_polish_only_lowers_the_cost():
    """The polish moves a block only when that is cheaper: with it the plan is never worse."""
    for c in CASES:
        g = c.values[0]
        plain = recursive_programming(g, P, cache=False, polish=0).cost.total
        # 1e-12: an unchanged plan's float64 total re-summed (~n * 2**-53)
        assert recursive_programming(g, P, cache=False, polish=2).cost.total <= plain * (1 + 1e-12)


def sgd_step(mesh, fixed_x=False, fixed_w=None):
    """y = x @ w; g = x^T @ y; w' = w - g, written back into w's layout (a writeback tied by follow_operand)."""
    g = Graph(mesh)
    x = g.source("x", (8, 6), fixed=((0,), ()) if fixed_x else None)
    w = g.source("w", (6, 4), kind="param", fixed=fixed_w)
    (y,) = g.add_op("mm", "dot_general", {"m": 8, "k": 6, "n": 4}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    (gw,) = g.add_op("mmT", "dot_general", {"k": 6, "m": 8, "n": 4}, [x, y], [("m", "k"), ("m", "n")],
                     [("k", "n")], free_devices=True)
    (new,) = g.add_op("sub", "sub", {"i": 6, "j": 4}, [w, gw], [("i", "j")] * 2, [("i", "j")], free_devices=True)
    g.add_op("writeback", "writeback", {"i": 6, "j": 4}, [new, w], [("i", "j")] * 2, [("i", "j")],
             free_devices=True, follow_operand=1)
    return g


def _keeps_tie(g, strategies):
    from searchers.graph import operand_layout, result_layout
    wb = g.ops[-1]
    return operand_layout(wb, strategies[wb.id], 1) == result_layout(g.ops[1], strategies[1], 0)


@pytest.mark.parametrize("kw", [{}, {"fixed_x": True}, {"fixed_w": ((), (0,))}])
@pytest.mark.parametrize("params", [P, P_SLOW_LINK], ids=["default", "slow-link"])
def test_exact_searchers_equal_brute_force_under_a_follow_operand_tie(kw, params):
    g = sgd_step(DeviceMesh((2, 2)), **kw)
    best = brute_force(g, params)
    assert _keeps_tie(g, best)
    opt = graph_cost(g, best, params).total
    free = copy.deepcopy(g)
    free.ops[-1].follow_operand = None
    assert graph_cost(free, brute_force(free, params), params).total <= opt    # the tie only constrains
    for searcher in (dynamic_programming, ilp):
        res = searcher(g, params, cache=False)
        assert _keeps_tie(g, res.strategies), searcher.__name__
        # float64 re-summation (~1e-15) within the ILP's mip_rel_gap=1e-9
        assert res.cost.total == pytest.approx(opt, rel=1e-9), searcher.__name__


@pytest.mark.parametrize("name", ["recursive_programming", "sharding_propagation"])
def test_greedy_searchers_keep_a_follow_operand_tie(name):
    from searchers.propagation import sharding_propagation
    fn = {"recursive_programming": recursive_programming, "sharding_propagation": sharding_propagation}[name]
    for kw in ({"fixed_x": True}, {"fixed_x": True, "fixed_w": ((), (0, 1))}):
        g = sgd_step(DeviceMesh((2, 2)), **kw)
        res = fn(g, P, cache=False)
        assert _keeps_tie(g, res.strategies)
        # float64: the plan's cost is graph_cost of the same strategies, at most re-summed (~n * 2**-53, far below 1e-9)
        assert res.cost.total == pytest.approx(graph_cost(g, res.strategies, P).total, rel=1e-9)


def test_follow_operand_must_name_an_operand_over_every_loop_dim():
    g = Graph(DeviceMesh((2,)))
    x = g.source("x", (4, 6))
    v = g.source("v", (6,))
    for k, ins, in_dims in ((2, [x, x], [("i", "j")] * 2), (1, [x, v], [("i", "j"), ("j",)])):
        with pytest.raises(SearchGraphError, match=f"follow_operand={k}"):
            g.add_op("tie", "writeback", {"i": 4, "j": 6}, ins, in_dims, [("i", "j")], follow_operand=k)
