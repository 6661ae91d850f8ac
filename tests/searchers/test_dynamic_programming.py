"""dynamic_programming specifics: the pairwise problem it shrinks, repeated layers, the follow
flag, memory notes and the documented fallback."""

import dataclasses
import itertools

import numpy as np
import pytest

from searchers.cost import CostParams, graph_cost
from searchers.dynamic_programming import _series, dynamic_programming
from searchers.generators import mlp_chain, transformer_stack
from searchers.graph import DeviceMesh
from searchers.ilp import ilp
from searchers.pairwise_problem import PairwiseProblem

P = CostParams()


def test_problem_total_is_graph_cost_for_any_choice():
    g = mlp_chain(1, 8, 4, DeviceMesh((2,)), backward=True)
    prob = PairwiseProblem.build(g, P)
    rng = np.random.default_rng(0)
    for _ in range(20):
        choice = {v: int(rng.integers(len(c))) for v, c in enumerate(prob.cands)}
        # float64: the problem's table entries vs graph_cost, the same terms in another order (~n * 2**-53 ~ 1e-15)
        assert prob.total(choice) == pytest.approx(graph_cost(g, prob.strategies(choice), P).total, rel=1e-12)


@pytest.mark.parametrize("family", ["transformer", "conv", "random"])
@pytest.mark.parametrize("fully", [False, True])
def test_problem_built_from_the_shared_tables_is_the_cost_model_entry_by_entry(family, fully):
    """PairwiseProblem takes its candidates, vectors and layout lists from the search's Tables, where op shapes of several
    structures share layout lists: every node's vector must still be the cost model's own vector of that op
    (op_cost_vector), and every pair's matrix the sum of the cost model's matrices of the edges between the two ops
    (edge_cost_matrix), exactly: the same functions on the same layouts. Under fully_use_devices an op that must
    use every device has only candidates that do. One user strategy (the first data input's split) is kept."""
    from searchers.cost_vectors import edge_cost_matrix, op_cost_vector
    from searchers.generators import graph_of_size
    from searchers.graph import split_count
    from searchers.spec import all_devices, op_spec
    g = graph_of_size(60, family, DeviceMesh.prime(8), fix_data=True)
    prob = PairwiseProblem.build(g, P, fully_use_devices=fully)
    for op, cands, vec in zip(g.ops, prob.cands, prob.unary, strict=True):
        np.testing.assert_array_equal(vec, op_cost_vector(op, cands, g, P))
        if op.fixed is not None:
            assert cands == (tuple(tuple(a) for a in op.fixed),)
        elif fully and all_devices(op_spec(op, g), True):
            assert all(split_count(s, g.mesh.shape) == 8 for s in cands), op.name
    want: dict[tuple[int, int], np.ndarray] = {}
    for cons in g.ops:
        for k, tid in enumerate(cons.inputs):
            p = g.tensors[tid].producer
            m = edge_cost_matrix(g.ops[p], prob.cands[p], cons, prob.cands[cons.id], k, g, P)
            key, m = ((p, cons.id), m) if p < cons.id else ((cons.id, p), m.T)
            want[key] = want[key] + m if key in want else m
    got = {(prob.lo[i], prob.hi[i]): prob.mat[i] for i in prob.pairs()}
    assert got.keys() == want.keys()
    for key, m in want.items():
        # several edges between one pair are summed in one order in both: equal floats
        np.testing.assert_array_equal(got[key], m)


def test_absorbing_fixed_ops_keeps_totals():
    g = mlp_chain(1, 8, 4, DeviceMesh((2, 2)))
    g.ops[0].fixed = ((0,), ())
    full = PairwiseProblem.build(g, P)
    small = PairwiseProblem.build(g, P)
    assert small.absorb_single() >= 1 and 0 in small.decided
    choice = {v: 0 for v in small.live()}
    dropped = sum(float(full.unary[v][c]) for v, c in small.decided.items())   # a constant
    # float64: the absorbed constant plus the rest, the same terms in another order (~n * 2**-53 ~ 1e-15)
    assert small.total(choice) + dropped == pytest.approx(full.total(small.expand(choice)), rel=1e-12)


def test_op_elimination_is_a_min_plus_product():
    rng = np.random.default_rng(1)
    mh, c, mj = rng.random((5, 3)), rng.random(5), rng.random((5, 4))
    best, arg = _series(mh, c, mj)
    for a, b in itertools.product(range(3), range(4)):
        vals = mh[:, a] + c + mj[:, b]
        # pytest.approx default rel=1e-6: the same three float64 numbers added in _series' order (2 roundings, ~2**-52)
        assert best[a, b] == pytest.approx(vals.min()) and arg[a, b] == int(np.argmin(vals))


def test_repeated_layers_are_reused():
    g = transformer_stack(12, 2, 8, 16, 2, 32, DeviceMesh((2, 2)), backward=False)
    # the batch split of the data (dataset_strategy) on one axis. With the batch on both axes, the messages along
    # the residual stream keep growing under the XLA-faithful redistribution costs (entries for "never leave this
    # layout" rise by ~3e-8 per layer), so value keys stop repeating: 297 of 503 reused (open, issue 14). The
    # stored-state price (CostParams.state_weight, issue 40) makes them grow the same way with the batch on one axis
    # (298 of 503 reused): this checks the reuse without it (open)
    g.ops[0].fixed = ((0,), (), ())
    res = dynamic_programming(g, dataclasses.replace(P, state_weight=0.0), cache=False)
    note = next(n for n in res.notes if n.startswith("repeated structure"))
    hits, total = (int(x) for x in note.split(": ")[1].split(" eliminations")[0].split(" of "))
    assert hits / total > 0.8                     # after the first copies, a layer's eliminations are lookups


def test_follow_is_exact_under_its_constraint():
    g = mlp_chain(2, 8, 4, DeviceMesh((2,)))
    free = dynamic_programming(g, P, cache=False)
    tied = dynamic_programming(g, P, elementwise_op_strategy_follow=True, cache=False)
    # 1e-12: possibly the same plan, its float64 total summed in two orders (~n * 2**-53); rel=1e-9: the ILP's mip_rel_gap
    assert tied.cost.total >= free.cost.total * (1 - 1e-12)
    assert tied.cost.total == pytest.approx(ilp(g, P, elementwise_op_strategy_follow=True, cache=False).cost.total,
                                            rel=1e-9)


def test_a_plan_over_the_memory_capacity_gets_a_note():
    g = mlp_chain(1, 64, 64, DeviceMesh((2,)))
    res = dynamic_programming(g, CostParams(device_memory_capacity=1000.0), cache=False)
    assert any("exceeds device_memory_capacity" in n and "ilp" in n for n in res.notes)


@pytest.mark.slow
def test_training_graph_through_the_fallback_beats_propagation():
    from searchers.propagation import sharding_propagation
    from searchers.strategies import data_parallel_strategy
    g = transformer_stack(3, 2, 8, 16, 2, 32, DeviceMesh((2, 2, 2)))
    for op in g.ops:
        if op.kind == "data":
            op.fixed = data_parallel_strategy(op, g.mesh)
    res = dynamic_programming(g, P, core_time_limit=0, cache=False)
    assert any("star elimination" in n for n in res.notes)
    assert res.cost.total <= sharding_propagation(g, P).cost.total
    # float64: the plan's cost is graph_cost of the same strategies, at most re-summed (~n * 2**-53, far below 1e-9)
    assert res.cost.total == pytest.approx(graph_cost(g, res.strategies, P).total, rel=1e-9)
