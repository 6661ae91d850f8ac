"""ilp: the pairwise integer program against enumeration, the memory limit, the time limit."""

import itertools

import numpy as np
import pytest

from searchers.cost import CostParams, graph_cost
from searchers.errors import SearchLimitError
from searchers.generators import mlp_chain
from searchers.graph import DeviceMesh, Graph
from searchers.ilp import ilp
from searchers.memory import memory_profile, peak_memory
from searchers.pairwise import solve_pairwise

P = CostParams()


def enumerate_pairwise(unary, pairs):
    best = (np.inf, None)
    for choice in itertools.product(*[range(len(u)) for u in unary]):
        t = sum(u[c] for u, c in zip(unary, choice, strict=True)) + sum(m[choice[a], choice[b]] for a, b, m in pairs)
        if t < best[0]:
            best = (t, choice)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_solve_pairwise_equals_enumeration(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 5, size=5)
    unary = [rng.random(k) for k in sizes]
    pairs = []
    for a, b in [(0, 1), (1, 2), (2, 3), (3, 4), (0, 2), (1, 4), (0, 4)]:
        m = np.round(rng.random((sizes[a], sizes[b])) * 3, 1)     # ties and repeated rows/columns
        m[rng.random(m.shape) < 0.15] = np.inf                     # forbidden pairs
        pairs.append((a, b, m))
    unary[3][0] = np.inf
    want, _ = enumerate_pairwise(unary, pairs)
    sol = solve_pairwise(unary, pairs)
    # rel=1e-9: solve_pairwise's mip_rel_gap; the enumeration and the recomputed total sum the same 12 float64 terms in
    # another order (~12 * 2**-53)
    assert sol.optimal and sol.objective == pytest.approx(want, rel=1e-9)
    got = sum(u[c] for u, c in zip(unary, sol.choice, strict=True)) + sum(m[sol.choice[a], sol.choice[b]] for a, b, m in pairs)
    assert got == pytest.approx(want, rel=1e-9)


def test_one_sided_matrices_become_vectors():
    sol = solve_pairwise([np.zeros(3), np.zeros(2)], [(0, 1, np.array([[1.0, 5.0]] * 3))])
    # pytest.approx default rel=1e-6: HiGHS's float64 objective, scaled by 1000 / scale_ref and back (a few roundings)
    assert sol.size["e"] == 0 and sol.choice[1] == 0 and sol.objective == pytest.approx(1.0)


def big_activation_graph():
    """x[64, 256] -> exp -> exp: 3 x 64 KiB live at the end when replicated."""
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (64, 256))
    (y,) = g.add_op("exp", "exp", {"i": 64, "j": 256}, [x], [("i", "j")], [("i", "j")])
    (z,) = g.add_op("exp2", "exp", {"i": 64, "j": 256}, [y], [("i", "j")], [("i", "j")])
    g.outputs.append(z)
    return g


def big_weight_graph():
    """A replicated input and output around x[4, 256] @ w[256, 256]: replicating everything needs
    no collective; a 256 KiB weight that does not fit must be split, and that costs one."""
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (4, 256), fixed=((), ()))
    w = g.source("w", (256, 256), kind="param")
    (y,) = g.add_op("mm", "dot_general", {"m": 4, "k": 256, "n": 256}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")])
    (z,) = g.add_op("relu", "relu", {"i": 4, "j": 256}, [y], [("i", "j")], [("i", "j")], fixed=((), ()))
    g.outputs.append(z)
    return g


def test_memory_limit_changes_the_plan():
    g = big_weight_graph()
    free = ilp(g, P, cache=False)
    assert free.strategies[1] == ((), ()) and free.cost.communication == 0
    peak_free, _ = peak_memory(g, free.strategies)
    cap = peak_free * 0.6
    tight = ilp(g, CostParams(device_memory_capacity=cap), cache=False)
    # 1e-9: byte sums recomputed in float64 in another order than the ILP's rows (~n * 2**-53), and HiGHS's feasibility
    # tolerance (1e-7 absolute on rows of ~1e5 bytes, ~1e-12 relative)
    assert peak_memory(g, tight.strategies)[0] <= cap * (1 + 1e-9)
    assert max(memory_profile(g, tight.strategies)) <= cap * (1 + 1e-9)
    assert tight.strategies[1] != ((), ()) and tight.cost.communication > 0
    assert tight.cost.total > free.cost.total
    assert any("constrained" in n for n in tight.notes)


@pytest.mark.parametrize("limit", [{"max_variables": 1}, {"time_limit": 0.001}])
def test_a_plan_over_the_memory_limit_is_never_returned_when_the_program_is_not_solved(limit):
    """Issue 14: where the integer program is too large to build or stops at its time limit, ilp fell back to
    dynamic_programming's plan, which ignores the capacity: here the replicated 256 KiB weight, 1.7x the limit.
    Now it prices memory until a plan fits (searchers.memory_fit), and the baseline check takes no plan over the
    capacity either."""
    g = big_weight_graph()
    cap = peak_memory(g, ilp(g, P, cache=False).strategies)[0] * 0.6
    res = ilp(g, CostParams(device_memory_capacity=cap), cache=False, **limit)
    # 1e-9: the same float64 byte sums as test_memory_limit_changes_the_plan
    assert peak_memory(g, res.strategies)[0] <= cap * (1 + 1e-9), res.notes
    assert res.strategies[1] != ((), ())                      # the weight is split


def test_memory_limit_no_plan_can_meet_is_a_clear_error():
    g = big_activation_graph()
    with pytest.raises(SearchLimitError, match=r"device_memory_capacity=.*Raise device_memory_capacity"):
        ilp(g, CostParams(device_memory_capacity=1000.0), cache=False)


def test_memory_rows_can_be_switched_off():
    g = big_activation_graph()
    res = ilp(g, CostParams(device_memory_capacity=1000.0), memory_limit=False, cache=False)
    # float64: the plan's cost is graph_cost of the same strategies, at most re-summed (~n * 2**-53, far below 1e-9)
    assert res.cost.total == pytest.approx(graph_cost(g, res.strategies, P).total, rel=1e-9)


def test_time_limit_gives_a_clear_note():
    g = mlp_chain(2, 16, 8, DeviceMesh((2, 2, 2)), backward=True)
    res = ilp(g, P, time_limit=0.001, cache=False)
    assert len(res.strategies) == len(g)
    assert any("time_limit=0.001" in n for n in res.notes), res.notes
    # stopped early (no solution, or an unproven one), ilp still returns no more than dynamic_programming's plan;
    # float64 totals of two plans, each summed once (~n * 2**-53 relative)
    from searchers.dynamic_programming import dynamic_programming
    dp = dynamic_programming(g, P, cache=False)
    assert res.cost.total <= dp.cost.total * (1 + 1e-12)


def test_time_limit_without_fallback_raises():
    g = mlp_chain(2, 16, 8, DeviceMesh((2, 2, 2)), backward=True)
    try:
        res = ilp(g, P, time_limit=0.001, fallback=False, cache=False)
    except SearchLimitError as e:
        assert "no solution found within time_limit=0.001" in str(e)
    else:                                           # HiGHS found a first solution in time
        assert any("stopped at time_limit" in n for n in res.notes)


def test_mlp_training_graph_is_solved_to_optimality():
    g = mlp_chain(2, 16, 8, DeviceMesh((2, 2)), backward=True)
    res = ilp(g, P, cache=False)
    assert not any("time_limit" in n for n in res.notes)
    from searchers.dynamic_programming import dynamic_programming
    # rel=1e-9: the ILP's mip_rel_gap; dynamic_programming is exact on this chain
    assert res.cost.total == pytest.approx(dynamic_programming(g, P, cache=False).cost.total, rel=1e-9)


@pytest.mark.parametrize("family", ["mlp", "conv", "random"])
def test_eliminations_then_the_core_equal_the_whole_integer_program(family):
    """ilp's fast path (no memory row: exact eliminations, then the integer program on the core they leave) finds
    the optimum the whole integer program proves, on graphs too large to enumerate."""
    from searchers.generators import graph_of_size
    g = graph_of_size(30, family, DeviceMesh((2, 2, 2)), fix_data=True)
    fast = ilp(g, P, cache=False, memory_limit=False)
    whole = ilp(g, P, cache=False, memory_limit=False, eliminate=False)
    assert any("eliminations" in n for n in fast.notes) and not any("eliminations" in n for n in whole.notes)
    assert not any("time_limit" in n for n in fast.notes + whole.notes)
    # both proven optimal: HiGHS closes the gap to mip_rel_gap=1e-9 of its scaled objective, within its 1e-7
    # feasibility tolerance per variable, so two optima agree to well within 1e-6 of the total
    assert fast.cost.total == pytest.approx(whole.cost.total, rel=1e-6)


@pytest.mark.parametrize("follow", [False, True])
def test_the_fallback_on_ilps_own_problem_is_dynamic_programmings_plan(follow):
    # a program too large to build: ilp hands the PairwiseProblem it prepared to dynamic_programming's solver (no second
    # build); the plan must be the one dynamic_programming finds from its own build of the same graph and options
    from searchers.dynamic_programming import dynamic_programming
    g = mlp_chain(2, 16, 8, DeviceMesh((2, 2, 2)), backward=True)
    res = ilp(g, P, max_variables=1, elementwise_op_strategy_follow=follow, cache=False)
    dp = dynamic_programming(g, P, elementwise_op_strategy_follow=follow, cache=False)
    assert any("too large" in n for n in res.notes), res.notes
    # the same plan up to which of the (2, 2, 2) mesh's equal axes a split takes: such plans tie exactly, and which
    # one the solver returns has been seen to depend on what ran before in the process (issue 14's note); the split
    # counts of every op and the cost are the plan
    splits = lambda st: {k: tuple(len(axes) for axes in v) for k, v in st.items()}
    assert splits(res.strategies) == splits(dp.strategies)
    assert res.cost.total == pytest.approx(dp.cost.total, rel=1e-9)       # float64 re-summation, ILP gap


def test_the_time_limit_bounds_the_whole_search_and_the_fallback_names_ilp(monkeypatch):
    """Issue 40: ilp's time_limit bounds the whole search, its dynamic_programming fallback included (it printed "time
    limit 60 s: done in 101.2 s" on an LLM step), and the fallback's progress lines name ilp. With the exact
    eliminations made to fail (the path of a graph they cannot settle), dynamic_programming's plan is computed first,
    its improvement passes within a quarter of the time left, and HiGHS is given only what is left: the fallback's
    seconds plus the seconds HiGHS is given never exceed the limit (no wall-clock bound: an inequality between
    durations ilp itself measures and hands on)."""
    import time

    import searchers.dynamic_programming as dpm
    import searchers.ilp as ilpm
    g = mlp_chain(2, 16, 8, DeviceMesh((2, 2, 2)), backward=True)
    seen: dict = {}
    solve, solve_problem = ilpm.solve_pairwise, dpm.solve_problem

    def spy_solve(*a, time_limit, **kw):
        seen["highs"] = time_limit
        return solve(*a, time_limit=time_limit, **kw)

    def spy_dp(*a, **kw):
        t = time.perf_counter()
        out = solve_problem(*a, **kw)
        seen["dp"] = (time.perf_counter() - t, kw.get("improve_seconds"), kw.get("label"))
        return out

    monkeypatch.setattr(ilpm, "exact_choice", lambda *a: None)
    monkeypatch.setattr(ilpm, "solve_pairwise", spy_solve)
    monkeypatch.setattr(ilpm, "solve_problem", spy_dp)
    limit = 30.0
    res = ilp(g, P, time_limit=limit, cache=False)
    dp_seconds, improve, label = seen["dp"]
    assert dp_seconds + seen["highs"] <= limit           # HiGHS ends by the limit, the fallback's time counted in
    assert 0 < improve <= limit / 4 and label.startswith("ilp")
    assert len(res.strategies) == len(g) and res.algorithm == "ilp"
