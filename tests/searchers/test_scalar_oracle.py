"""An exact oracle that shares nothing with the searchers' tables (issue 37): every full plan of a small graph is
priced by the scalar cost model, ``graph_cost`` (one call per whole plan, the function plans are reported with),
never by the per-op vectors and per-edge matrices (``searchers.cost_vectors``) that dynamic_programming, ilp and
brute_force all read. Its minimum is the optimum; the exact searchers must reach it, and brute_force (the table
oracle the other tests use) must agree with it, so a wrong table entry cannot hide behind "the code agrees with
itself"."""

import itertools
import math

import pytest

from searchers.brute import brute_force
from searchers.cost import CostParams, graph_cost
from searchers.dynamic_programming import dynamic_programming
from searchers.generators import mlp_chain, random_dag
from searchers.graph import DeviceMesh, operand_layout, result_layout
from searchers.ilp import ilp
from searchers.strategies import enumerate_strategies

P = CostParams()
P_SLOW_LINK = CostParams(beta=1.0, flops_per_s=1e9)
LIMIT = 25_000        # whole plans priced one by one in Python: at most a few seconds per graph


def _ties_hold(g, plan) -> bool:
    """Every ``Op.follow_operand`` tie: the operand is laid out as its producer's result (the searchers' rule)."""
    for op in g.ops:
        k = op.follow_operand
        if k is None:
            continue
        t = op.inputs[k]
        for p in g.ops:
            if t in p.outputs and result_layout(p, plan[p.id], p.outputs.index(t)) != operand_layout(op, plan[op.id], k):
                return False
    return True


def scalar_optimum(g, params) -> float:
    cands = [enumerate_strategies(op, g.mesh) for op in g.ops]
    assert math.prod(len(c) for c in cands) <= LIMIT
    best = math.inf
    for pick in itertools.product(*cands):
        plan = {op.id: s for op, s in zip(g.ops, pick, strict=True)}
        if _ties_hold(g, plan):
            best = min(best, graph_cost(g, plan, params).total)
    return best


def _cases():
    out = []
    for mesh in (DeviceMesh((2,)), DeviceMesh((2, 2))):
        for n in (3, 4, 5, 6):
            for seed in range(6):
                g = random_dag(n, seed, mesh)
                if math.prod(len(enumerate_strategies(op, mesh)) for op in g.ops) <= LIMIT:
                    out.append(pytest.param(g, id=f"random{n}-{seed}-{'x'.join(map(str, mesh.shape))}"))
    out.append(pytest.param(mlp_chain(1, 8, 4, DeviceMesh((2,))), id="mlp1"))
    return out


CASES = _cases()


def test_there_are_enough_cases():
    assert len(CASES) >= 12, len(CASES)


@pytest.mark.parametrize("params", [P, P_SLOW_LINK], ids=["default", "slow-link"])
@pytest.mark.parametrize("g", CASES)
def test_exact_searchers_reach_the_optimum_of_the_scalar_cost_model(g, params):
    best = scalar_optimum(g, params)
    assert math.isfinite(best)
    # the same float sums in another order (per-op vectors and per-edge matrices vs one pass over the plan)
    rel = 1e-9
    assert graph_cost(g, brute_force(g, params), params).total == pytest.approx(best, rel=rel)
    assert graph_cost(g, dynamic_programming(g, params).strategies, params).total == pytest.approx(best, rel=rel)
    assert graph_cost(g, ilp(g, params).strategies, params).total == pytest.approx(best, rel=rel)
