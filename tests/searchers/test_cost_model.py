"""The cost model against numbers worked out by hand from docs/algorithms.md §2 and the alpha-beta model."""

import itertools
import math

import numpy as np
import pytest

from searchers.cost import (
    KINDS,
    Cost,
    CostParams,
    graph_cost,
    op_cost,
    redistribution_cost,
)
from searchers.cost_vectors import edge_cost_matrix, op_cost_vector
from searchers.errors import SearchGraphError
from searchers.graph import DeviceMesh, Graph, operand_layout, result_layout
from searchers.strategies import enumerate_strategies
from searchers.xla_reshard import reshard

MESH = DeviceMesh((2, 2, 2))          # 100 GB/s, 5 us per axis (the defaults)
P = CostParams()
LAT, BW = 5e-6, 100e9


def assert_cost(c, *, compute=0.0, bytes_=None, time=0.0, memory=0.0, params=P, stored=0.0):
    bytes_ = bytes_ or {}
    # float64: the model and the hand formula do the same <= 10 operations, maybe in another order (~10 * 2**-53 =
    # 1e-15 relative); abs=1e-30 lets an expected 0.0 match only (near-)exact zeros (every nonzero cost is >= 1e-12)
    assert c.compute == pytest.approx(compute, rel=1e-12, abs=1e-30)
    for k in KINDS:
        assert c.comm_bytes[k] == pytest.approx(bytes_.get(k, 0.0), rel=1e-12, abs=1e-30), k
    assert c.comm_time == pytest.approx(time, rel=1e-12, abs=1e-30)
    assert c.memory == pytest.approx(memory, rel=1e-12, abs=1e-30)
    # ``stored``: the bytes per device a parameter source stores, priced as moving state_weight of them at 100 GB/s
    total = (params.alpha * compute + params.beta * time + params.gamma * memory / params.memory_unit
             + params.beta * params.state_weight * stored / BW)
    assert c.total == pytest.approx(total, rel=1e-12, abs=1e-30)


def test_params_defaults_are_mindspores():
    assert (P.alpha, P.beta, P.gamma) == (1.0, 400.0, 0.001)
    assert P.device_memory_capacity == 16 * 2**30 and P.flops_per_s == 100e12


# -- redistribution ----------------------------------------------------------------------------
SHAPE, ITEM = (64, 32), 4            # 8192 bytes


@pytest.mark.parametrize("layout", [((), ()), ((0,), ()), ((0, 2), (1,)), ((), (2,))])
def test_identical_layouts_cost_exactly_zero(layout):
    c = redistribution_cost(layout, layout, SHAPE, ITEM, MESH, P)
    assert c.total == 0.0 and c.comm_time == 0.0 and all(v == 0.0 for v in c.comm_bytes.values())


@pytest.mark.parametrize("src,dst", [(((), ()), ((0,), ())), (((), ()), ((1,), (0, 2))), (((0,), ()), ((0,), (1,)))])
def test_replicated_to_split_is_a_free_slice(src, dst):
    assert redistribution_cost(src, dst, SHAPE, ITEM, MESH, P).total == 0.0


def test_split_to_replicated_is_an_all_gather():
    c = redistribution_cost(((0,), ()), ((), ()), SHAPE, ITEM, MESH, P)
    # 4096 B local, gathering one more shard of 4096 B
    assert_cost(c, bytes_={"all-gather": 4096.0}, time=LAT + 4096 / BW)


def test_gather_over_two_axes_equals_flat_ring_formula():
    c = redistribution_cost(((0, 1), ()), ((), ()), SHAPE, ITEM, MESH, P)
    # XLA gathers both factors of the dim in one all-gather over 4 devices (one latency):
    # S_local = 2048, k = 4: S_local*(k-1) = 6144 in all
    assert_cost(c, bytes_={"all-gather": 6144.0}, time=LAT + 6144 / BW)


def test_split_dim_change_is_an_all_to_all():
    c = redistribution_cost(((0,), ()), ((), (0,)), SHAPE, ITEM, MESH, P)
    assert_cost(c, bytes_={"all-to-all": 2048.0}, time=LAT + 2048 / BW)   # 4096 * (2-1)/2


def test_a_split_that_changes_dim_and_axis_is_priced_as_the_executor_runs_it():
    # (2, 1) tiles -> (1, 2) tiles, each replicated 4 ways. Under with_sharding_constraint XLA moves the split to
    # dim 1 with an all-to-all over axis 0 (half of the 4096 B local tensor leaves), then permutes the 4096 B tiles
    # onto axis 1's devices: 6144 B (compiled HLO, tests/e2e/search/test_reshard_model.py). The executor runs the
    # direct steps instead (searchers.direct_reshard, mshard._src.runtime.redistribute): axis 1 splits dim 1 by a
    # local slice (each device keeps 2048 B), then axis 0 leaves dim 0 by an all-gather of those 2048 B blocks,
    # receiving one block: 2048 B. The cost prices the cheaper, the executor's.
    xla = [(s.kind, s.moved * 8192) for s in reshard(((0,), ()), ((), (1,)), MESH.shape)]
    assert xla == [("all-to-all", 2048.0), ("collective-permute", 4096.0)]
    c = redistribution_cost(((0,), ()), ((), (1,)), SHAPE, ITEM, MESH, P)
    assert_cost(c, bytes_={"all-gather": 2048.0}, time=LAT + 2048 / BW)


def test_per_axis_bandwidth_and_latency():
    mesh = DeviceMesh((2, 2), bandwidth=(1e9, 1e11), latency=(1e-5, 1e-6))
    slow = redistribution_cost(((0,), ()), ((), ()), SHAPE, ITEM, mesh, P)
    fast = redistribution_cost(((1,), ()), ((), ()), SHAPE, ITEM, mesh, P)
    # pytest.approx defaults (rel=1e-6, abs=1e-12): latency + bytes / bandwidth, two float64 roundings (~2**-52);
    # the axes differ 10x in latency and 100x in bandwidth, far beyond rel=1e-6
    assert slow.comm_time == pytest.approx(1e-5 + 4096 / 1e9)
    assert fast.comm_time == pytest.approx(1e-6 + 4096 / 1e11)
    assert slow.comm_bytes == fast.comm_bytes


def test_redistribution_rank_mismatch_raises():
    with pytest.raises(SearchGraphError):
        redistribution_cost(((0,),), ((), ()), SHAPE, ITEM, MESH, P)


# -- one op ------------------------------------------------------------------------------------
def mlp_graph():
    g = Graph(MESH)
    x = g.source("x", (64, 32))
    w = g.source("w", (32, 128), kind="param")
    (y,) = g.add_op("mm", "dot_general", {"m": 64, "k": 32, "n": 128}, [x, w],
                    [("m", "k"), ("k", "n")], [("m", "n")])
    g.add_op("relu", "relu", {"i": 64, "j": 128}, [y], [("i", "j")], [("i", "j")])
    return g


def test_matmul_with_split_contraction():
    g = mlp_graph()
    c = op_cost(g.ops[2], ((0,), (1, 2), ()), g, P)
    flops = 2 * 64 * 32 * 128
    out_local = 64 * 128 * 4 / 2                   # m split in 2: 16384 B
    ar = 2 * out_local * (4 - 1) / 4               # partial over k's 4 devices
    memory = 64 * 32 * 4 / 8 + 32 * 128 * 4 / 4 + out_local
    # one all-reduce over the group of k's 4 devices (axes 1 and 2), as XLA compiles it: one latency
    assert_cost(c, compute=flops / 8 / 100e12, bytes_={"all-reduce": ar}, time=LAT + ar / BW, memory=memory)


def test_matmul_column_parallel_needs_no_communication():
    g = mlp_graph()
    c = op_cost(g.ops[2], ((0,), (), (1, 2)), g, P)
    memory = 64 * 32 * 4 / 2 + 32 * 128 * 4 / 4 + 64 * 128 * 4 / 8
    assert_cost(c, compute=2 * 64 * 32 * 128 / 8 / 100e12, memory=memory)


def test_replicated_op_and_source_costs():
    g = mlp_graph()
    assert_cost(op_cost(g.ops[3], ((), ()), g, P), compute=64 * 128 / 100e12, memory=2 * 64 * 128 * 4)
    # a parameter source: no compute; it stores its half of the weight per device (issue 40's state price)
    assert_cost(op_cost(g.ops[1], ((1,), ()), g, P), memory=32 * 128 * 4 / 2, stored=32 * 128 * 4 / 2)
    assert_cost(op_cost(g.ops[1], ((1,), ()), g, P.__class__(state_weight=0.0)), memory=32 * 128 * 4 / 2,
                params=P.__class__(state_weight=0.0))


def test_all_reduce_runs_at_the_slowest_axis():
    mesh = DeviceMesh((2, 2), bandwidth=(1e9, 1e11))
    g = Graph(mesh)
    x = g.source("x", (8, 8))
    g.add_op("sum", "reduce_sum", {"i": 8, "j": 8}, [x], [("i", "j")], [("i",)])
    c = op_cost(g.ops[1], ((), (0, 1)), g, P)
    ar = 2 * 32 * 3 / 4                              # result 32 B, replicated, k = 4
    # pytest.approx defaults (rel=1e-6): float64, exact products and one division; the slow axis' term 48 / 1e9 is
    # 5e-3 of comm_time, so pricing the faster axis would fail
    assert c.comm_bytes["all-reduce"] == pytest.approx(ar)
    assert c.comm_time == pytest.approx(LAT + ar / 1e9)     # one all-reduce over both axes' 4 devices: one latency


def test_strategy_of_wrong_length_raises():
    g = mlp_graph()
    with pytest.raises(SearchGraphError):
        op_cost(g.ops[2], ((0,), ()), g, P)


def test_op_cost_vector_matches_op_cost():
    g = mlp_graph()
    for op in g.ops:
        cands = enumerate_strategies(op, g.mesh)
        v = op_cost_vector(op, cands, g, P)
        assert v.shape == (len(cands),)
        # float64: the vectorised costs and op_cost do the same few operations per strategy, maybe reordered (~1e-15)
        np.testing.assert_allclose(v, [op_cost(op, s, g, P).total for s in cands], rtol=1e-12)


def test_edge_cost_matrix_matches_redistribution_cost():
    g = mlp_graph()
    mm, relu = g.ops[2], g.ops[3]
    pc, cc = enumerate_strategies(mm, g.mesh), enumerate_strategies(relu, g.mesh)
    R = edge_cost_matrix(mm, pc, relu, cc, 0, g, P)
    assert R.shape == (len(pc), len(cc))
    for i, j in itertools.product(range(len(pc)), range(len(cc))):
        want = redistribution_cost(result_layout(mm, pc[i]), operand_layout(relu, cc[j], 0), (64, 128), 4, g.mesh, P)
        # float64, as above; abs=0.0: an expected 0 (the same layout) must be exactly 0
        assert R[i, j] == pytest.approx(want.total, rel=1e-12, abs=0.0)
    same = [(i, j) for i, j in itertools.product(range(len(pc)), range(len(cc)))
            if result_layout(mm, pc[i]) == operand_layout(relu, cc[j], 0)]
    assert same and all(R[i, j] == 0.0 for i, j in same)


# -- a graph -----------------------------------------------------------------------------------
def test_graph_cost_sums_ops_and_edges():
    g = mlp_graph()
    strat = {0: ((0,), ()), 1: ((), ()), 2: ((0,), (), ()), 3: ((), ())}
    got = graph_cost(g, strat, P)
    # the mm result is m-split over axis 0; relu wants it replicated: all-gather 16384 B
    expected = sum((op_cost(op, strat[op.id], g, P) for op in g.ops), Cost())
    # pytest.approx defaults (rel=1e-6, abs=1e-12): float64 sums of 4 ops' costs in another order (~4 * 2**-53);
    # abs=1e-12 is below the smallest term (relu's compute, 8e-11 s), so a missing op would fail
    assert got.compute == pytest.approx(expected.compute)
    assert got.memory == pytest.approx(expected.memory)
    assert got.comm_bytes["all-gather"] == pytest.approx(16384.0)
    assert got.comm_time == pytest.approx(LAT + 16384 / BW)
    assert got.total == pytest.approx(expected.total + P.beta * (LAT + 16384 / BW))


def test_graph_cost_needs_every_op():
    g = mlp_graph()
    with pytest.raises(SearchGraphError, match="relu"):
        graph_cost(g, {0: ((), ()), 1: ((), ()), 2: ((), (), ())}, P)


def test_cost_addition():
    a = Cost(1.0, {"all-reduce": 2.0}, 3.0, 4.0, 5.0)
    b = Cost(0.5, {"all-gather": 1.0}, 0.5, 1.0, 1.0)
    s = a + b
    assert (s.compute, s.comm_time, s.memory, s.total) == (1.5, 3.5, 5.0, 6.0)
    assert dict(s.comm_bytes) == {"all-reduce": 2.0, "all-gather": 1.0, "reduce-scatter": 0.0, "all-to-all": 0.0,
                                  "collective-permute": 0.0}
    assert s.communication == 3.0
    assert Cost.sum([a, b]) == s


def test_memory_unit_scales_only_the_memory_term():
    g = mlp_graph()
    literal = CostParams(memory_unit=1.0)
    c = op_cost(g.ops[3], ((), ()), g, literal)
    # pytest.approx default rel=1e-6 of 262.144: float64 rounding only; the memory term (262) is what this checks,
    # the compute term (8e-11) is below the tolerance
    assert c.total == pytest.approx(64 * 128 / 100e12 + 0.001 * 2 * 64 * 128 * 4)
    # math.isclose default rel_tol=1e-9: the same float64 byte count computed twice (memory ignores memory_unit)
    assert math.isclose(op_cost(g.ops[3], ((), ()), g, P).memory, c.memory)
