"""The cost model's redistributions are the collectives XLA compiles (searchers.xla_reshard vs compiled HLO).

For pairs of layouts of a tensor (each mesh axis on one tensor dim or none, in every order inside a dim), a
``jax.jit`` whose input arrives in ``src`` and whose value is constrained to ``dst`` (``with_sharding_constraint``,
as the executor constrains an op's operands) is compiled and its collectives are read from the HLO; the model's
collectives must be the same kinds with the same bytes moved per device. Exact on every pair of a two-axis mesh,
and on fixed samples (100 each) of all pairs of rank-2 and rank-3 tensors on the planner's (2, 2, 2) mesh. The bench
(bench/reshard_vs_hlo.py) compiles every pair: rank 2, 2401 of 2401 exact on (2, 2, 2); rank 3, 3 of a
2500-pair sample differ (a permute XLA adds after an all-to-all).

(A jit's ``out_shardings`` is another path: XLA's propagation first merges two compatible partially replicated
shardings, so ``src -> dst`` becomes a local slice to the merge and a gather from it. The executor never takes that
path for an op's operand, and the model follows the constraint.)
"""

from __future__ import annotations

import random
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_layouts as layouts
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mshard._src.edges.comm_report import CommReport
from searchers.xla_reshard import reshard


def hlo_moved(mesh, names, shape, src, dst) -> Counter:
    def spec(lay):
        return P(*[tuple(names[a] for a in axes) if axes else None for axes in lay])
    f = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, spec(dst))),
                in_shardings=NamedSharding(mesh, spec(src)))
    rep = CommReport.from_hlo(f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text())
    return Counter({k: v["moved"] for k, v in rep.by_kind.items()})


def model_moved(mesh_shape, shape, src, dst) -> Counter:
    nbytes = 4 * int(np.prod(shape))
    out: Counter = Counter()
    for st in reshard(src, dst, mesh_shape, shape):
        out[st.kind] += st.moved * nbytes
    return out


def check(mesh_shape, shape, pairs):
    names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(names))
    wrong = []
    for src, dst in pairs:
        real, pred = hlo_moved(mesh, names, shape, src, dst), model_moved(mesh_shape, shape, src, dst)
        # both sides are sums of a few products of powers of two with (k-1)/k: equal up to float64 rounding
        if set(real) != set(pred) or any(pred[k] != pytest.approx(real[k], rel=1e-12) for k in real):
            wrong.append((src, dst, dict(pred), dict(real)))
    assert not wrong, f"{len(wrong)} of {len(pairs)} pairs differ, e.g. {wrong[:3]}"


@pytest.mark.parametrize("mesh_shape", [(2, 4), (4, 2)])
def test_every_pair_on_a_two_axis_mesh(mesh_shape):
    ls = layouts(2, 2)
    check(mesh_shape, (16, 32), [(s, d) for s in ls for d in ls])


def all_pairs(rank: int, naxes: int = 3):
    ls = layouts(rank, naxes)
    return [(s, d) for s in ls for d in ls]


@pytest.mark.slow
def test_every_pair_sample_on_the_planner_mesh_rank2():
    # 2401 pairs, about 0.05 s each to compile: a fixed sample of 100 (bench/reshard_vs_hlo.py: all)
    check((2, 2, 2), (16, 32), random.Random(0).sample(all_pairs(2), 100))


@pytest.mark.slow
def test_every_pair_sample_on_the_planner_mesh_rank3():
    # 11236 pairs: a fixed sample of 100
    check((2, 2, 2), (8, 16, 32), random.Random(0).sample(all_pairs(3), 100))


def test_rank4_pairs_with_dims_split_in_neither_layout():
    """searchers.cost.redistribution_steps memoises a pair with the dims split in neither layout dropped (a rank-4
    activation and its rank-2 view share one entry, as xla_reshard.reshard already simulates them): on a sample of
    rank-4 pairs with such dims, its steps (XLA's, under xla_only) are what XLA compiles."""
    from searchers.cost import redistribution_steps
    from searchers.direct_reshard import xla_only
    from searchers.graph import DeviceMesh
    m = (2, 2, 2)
    names = ("a0", "a1", "a2")
    mesh = jax.make_mesh(m, names, axis_types=(AxisType.Auto,) * 3)
    shape = (8, 4, 8, 16)
    ls = layouts(4, 3)
    rng = random.Random(1)
    pairs = [(rng.choice(ls), rng.choice(ls)) for _ in range(400)]
    sample = [(s, d) for s, d in pairs if s != d and any(not a and not b for a, b in zip(s, d, strict=True))][:25]
    assert len(sample) == 25
    for src, dst in sample:
        pred: Counter = Counter()
        with xla_only():        # the pair as XLA realises it (a with_sharding_constraint), not the executor's own
            for kind, _, coef in redistribution_steps(src, dst, DeviceMesh(m)):
                pred[kind] += coef * 4 * int(np.prod(shape))
        real = hlo_moved(mesh, names, shape, src, dst)
        # sums of a few products of powers of two with (k-1)/k: equal up to float64 rounding
        assert set(real) == set(pred) and all(pred[k] == pytest.approx(real[k], rel=1e-12) for k in real), \
            (src, dst, dict(pred), dict(real))


def test_examples_of_each_realisation():
    # the kinds XLA picks (each checked against HLO above): a permute for the same counts in another device order,
    # an all-to-all for a split moving dims, an all-gather to replicate, full rematerialisation when nothing fits
    m = (2, 2, 2)
    assert [s.kind for s in reshard(((), (0,)), ((), (1,)), m)] == ["collective-permute"]
    assert [s.kind for s in reshard(((0,), ()), ((), (0,)), m)] == ["all-to-all"]
    assert [s.kind for s in reshard(((0, 1), ()), ((0,), ()), m)] == ["all-gather"]
    assert reshard(((0,), ()), ((0, 1), ()), m) == ()            # a local slice
    assert [(s.kind, s.group) for s in reshard(((0, 1, 2), (), ()), ((), (0,), (1, 2)), m, (8, 16, 256))] == \
        [("all-gather", 8)]                                      # XLA's "involuntary full rematerialization"


@pytest.mark.parametrize("split", [((0,), (1, 2)), ((0, 1), (2,)), ((0, 1, 2), ()), ((1,), (0,))])
def test_partial_sums_are_one_all_reduce_per_split_reduction_dim(split):
    """A sum over two dims split on different axes compiles to one all-reduce per dim (a dim split over several axes:
    one over their devices); the model prices the same count and bytes."""
    from searchers.cost import CostParams, op_cost
    from searchers.graph import DeviceMesh, Graph
    names = ("a0", "a1", "a2")
    mesh = jax.make_mesh((2, 2, 2), names, axis_types=(AxisType.Auto,) * 3)
    spec = P(*[tuple(names[a] for a in axes) if axes else None for axes in split])
    f = jax.jit(jnp.sum, in_shardings=NamedSharding(mesh, spec))
    rep = CommReport.from_hlo(f.lower(jax.ShapeDtypeStruct((32, 64), jnp.float32)).compile().as_text())
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (32, 64))
    g.add_op("sum", "reduce_sum", {"i": 32, "j": 64}, [x], [("i", "j")], [()])
    c = op_cost(g.ops[1], split, g, CostParams())
    groups = sorted(int(np.prod([2] * len(axes))) for axes in split if axes)
    assert sorted(col.group_size for col in rep.collectives if col.kind == "all-reduce") == groups
    assert rep.total_count == len(groups)
    # both sides sum 2 * 4 B * (k-1)/k per group: exact in float64 up to one rounding per term
    assert c.comm_bytes["all-reduce"] == pytest.approx(rep.moved("all-reduce"), rel=1e-12)
    assert c.comm_time == pytest.approx(len(groups) * 5e-6 + c.comm_bytes["all-reduce"] / 100e9, rel=1e-12)


@pytest.mark.parametrize("mode", ["dynamic_programming", "sharding_propagation"])
def test_a_training_steps_gradient_all_reduces_are_one_collective(mode):
    """XLA's all-reduce combiner merges the gradient all-reduces of a data-parallel step (none depends on another)
    and the loss's into one tuple all-reduce. The model gives these reductions one latency between them
    (searchers.graph.mark_merged_reductions): the three share one latency, as many as the compiled step's
    all-reduces."""
    import optax
    from models import MLP, inputs

    import mshard as ms
    from mshard import nn

    (x,) = inputs("mlp")
    m = MLP()
    y = jnp.zeros_like(m(x))
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8,
                             dataset_strategy="data_parallel", gradients_mean=True):
        step = nn.TrainOneStepCell(nn.WithLossCell(m, nn.MSELoss()), optax.sgd(0.01))
        plan = step.plan(x, y)
        rep = ms.comm_report(step, x, y)
    assert {s for s in plan.param_specs.values() if len(s)} == {P(None, None)}   # data parallel: weights whole
    latency, bandwidth = 5e-6, 100e9                                    # DeviceMesh's defaults per axis
    reduces = [o for o in plan.ops if "all-reduce" in o.cost.communication]
    assert len(reduces) == 3, [o.name for o in reduces]                # the loss and the two weight gradients
    # the latencies the plan (the program's cost) charges: comm_time less the bytes' time, in units of one latency
    # (per op, each marked reduction carries 1/k of a latency, k counting the marked ops that need no all-reduce
    # in this plan too; the plan's total charges one latency per set of axes: searchers.cost._merged_latency)
    charged = (plan.cost.comm_time - sum(plan.cost.communication.values()) / bandwidth) / latency
    # float64: each subtraction loses ~1e-22 s of a 5e-6 s latency, far below 1e-9 of it
    assert rep.count("all-reduce") == 1 and charged == pytest.approx(1.0, rel=1e-9), (charged, rep.by_kind)


@pytest.mark.parametrize("mode", ["dynamic_programming", "sharding_propagation"])
@pytest.mark.parametrize("ds", [((8, 1), (8, 1)), ((2, 1), (2, 1)), ((2, 1), (1, 4))])
def test_final_all_reduces_merge_only_over_the_same_devices(mode, ds):
    """XLA's all-reduce combiner merges independent all-reduces only when they span the same device groups, so the
    compiled program (the plan's cost, graph_cost(shared=True)) pays one latency per distinct group of the final
    reductions, not 1/k each: two sums of inputs split over the same axes compile to one all-reduce, over different
    axes to one each. Before (92dfe22) the plan charged the two of ((2, 1), (1, 4)) one latency between them while
    the program had 2 or 3 all-reduces."""
    import mshard as ms

    def f(x, y):
        return jnp.sum(x), jnp.sum(y * 2.0)

    x = jnp.arange(512, dtype=jnp.float32).reshape(64, 8)
    y = x + 1.0
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8, dataset_strategy=ds):
        g = ms.jit(f)
        plan = g.plan(x, y)
        rep = ms.comm_report(g, x, y)
        got = g(x, y)
    latency, bandwidth = 5e-6, 100e9                                    # DeviceMesh's defaults per axis
    charged = (plan.cost.comm_time - sum(plan.cost.communication.values()) / bandwidth) / latency
    assert rep.total_count == rep.count("all-reduce") >= 1
    # float64: the subtraction loses ~1e-22 s of a 5e-6 s latency, far below 1e-9 of it
    assert charged == pytest.approx(rep.count("all-reduce"), rel=1e-9), (charged, rep.by_kind, plan.strategies)
    # exact: the sums of small integers in float32 are below 2**24
    assert float(got[0]) == float(jnp.sum(x)) and float(got[1]) == float(jnp.sum(2.0 * y))
