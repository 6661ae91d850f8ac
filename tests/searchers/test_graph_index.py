"""GraphIndex prices a whole plan as graph_cost does (the reference: one op and one edge at a time)."""

import random

import pytest

from searchers.cost import CostParams, graph_cost
from searchers.generators import graph_of_size, transformer_stack
from searchers.graph import DeviceMesh
from searchers.graph_index import GraphIndex
from searchers.strategies import enumerate_strategies

# graph_cost and GraphIndex.cost add the same per-(op shape, strategy) and per-edge terms, in another order:
# float64 re-summation of at most ~1e4 positive terms is exact to ~1e4 * 2**-52 relative, far below 1e-9
REL = 1e-9


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), 1e-30)


def _random_plan(g, rng: random.Random, as_lists: bool = False) -> dict:
    plan = {}
    for op in g.ops:
        s = rng.choice(enumerate_strategies(op, g.mesh, fully_use_devices=False))
        plan[op.id] = [list(a) for a in s] if as_lists else s
    return plan


@pytest.mark.parametrize("family", ["mlp", "transformer", "conv", "random"])
def test_plan_index_prices_random_plans_as_graph_cost_does(family):
    rng = random.Random(7)
    g = graph_of_size(300, family, DeviceMesh.prime(8), fix_data=True)
    ix = GraphIndex(g)
    p = CostParams()
    for draw in range(4):
        plan = _random_plan(g, rng, as_lists=draw == 3)      # lists, as a user may write them, are canonicalised
        ref, got = graph_cost(g, plan, p), ix.cost(plan, p)
        assert ref.total > 0
        assert _close(ref.total, got.total) and _close(ref.memory, got.memory)
        assert _close(ref.compute, got.compute) and _close(ref.comm_time, got.comm_time)
        for kind in ref.comm_bytes:
            assert _close(ref.comm_bytes[kind], got.comm_bytes[kind]), kind


def test_plan_index_prices_a_training_graph_with_write_backs():
    # transformer_stack(backward=True) has parameter updates written back (follow_operand ops)
    g = transformer_stack(2, 8, 16, 32, 4, 64, DeviceMesh((2, 4)), backward=True)
    ix = GraphIndex(g)
    plan = _random_plan(g, random.Random(3))
    assert _close(graph_cost(g, plan, CostParams()).total, ix.cost(plan, CostParams()).total)
    # and a plan as a list indexed by op id is the same plan
    assert ix.cost([plan[i] for i in range(len(g.ops))], CostParams()) == ix.cost(plan, CostParams())


def test_plan_index_names_the_op_a_plan_leaves_out():
    from searchers.errors import SearchGraphError
    g = graph_of_size(10, "mlp", DeviceMesh((2,)))
    plan = {op.id: tuple(() for _ in op.dims) for op in g.ops[:-1]}
    with pytest.raises(SearchGraphError, match=f"no strategy for op {len(g.ops) - 1}"):
        GraphIndex(g).cost(plan, CostParams())


def test_plan_index_prices_a_plan_the_same_whatever_objects_hold_its_strategies():
    # GraphIndex groups ops by strategy *object* before hashing by value: one shared tuple, equal fresh tuples and
    # lists (canonicalised) must price alike, and a list one op short names the op it lacks
    from searchers.errors import SearchGraphError
    g = graph_of_size(100, "transformer", DeviceMesh((2, 4)))
    ix = GraphIndex(g)
    plan = _random_plan(g, random.Random(5))
    fresh = [tuple(tuple(int(a) for a in axes) for axes in plan[i]) for i in range(len(g.ops))]
    as_lists = [[list(axes) for axes in s] for s in fresh]
    want = graph_cost(g, plan, CostParams()).total
    for p in (plan, fresh, as_lists):
        assert _close(ix.cost(p, CostParams()).total, want)
    with pytest.raises(SearchGraphError, match=f"no strategy for op {len(g.ops) - 1}"):
        ix.cost(fresh[:-1], CostParams())
