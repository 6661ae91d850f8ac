"""enumerate_strategies / data_parallel_strategy: expectations derived by hand or by counting."""

import itertools

import pytest

from searchers.graph import DeviceMesh, Graph, replicated
from searchers.strategies import data_parallel_strategy, enumerate_strategies, strategies_for


def matmul_graph(mesh, m=64, k=32, n=128, **kw):
    g = Graph(mesh)
    x = g.source("x", (m, k))
    w = g.source("w", (k, n), kind="param")
    g.add_op("mm", "dot_general", {"m": m, "k": k, "n": n}, [x, w], [("m", "k"), ("k", "n")], [("m", "n")], **kw)
    return g


def axes_used(s):
    return [a for axes in s for a in axes]


def test_matmul_on_2x2x2_counts_every_assignment():
    g = matmul_graph(DeviceMesh((2, 2, 2)))
    cands = enumerate_strategies(g.ops[2], g.mesh)
    # every axis independently goes to m, k, n or nowhere; 64, 32, 128 are all divisible by 8
    assert len(cands) == 4 ** 3
    assert len(set(cands)) == len(cands)
    assert cands[0] == ((), (), ())
    for s in cands:
        used = axes_used(s)
        assert len(used) == len(set(used))                   # an axis at most once
        assert all(list(axes) == sorted(axes) for axes in s)  # ascending inside a loop dim
    assert ((0,), (), (1, 2)) in cands and ((0, 1, 2), (), ()) in cands


def test_order_is_deterministic_and_most_devices_first():
    g = matmul_graph(DeviceMesh((2, 2, 2)))
    a = enumerate_strategies(g.ops[2], g.mesh)
    b = enumerate_strategies(g.ops[2], g.mesh)
    assert a == b
    devices = [g.mesh.count(axes_used(s)) for s in a[1:]]
    assert devices == sorted(devices, reverse=True)
    assert devices[0] == 8 and devices[-1] == 2


def test_tiny_source_listed_by_hand():
    g = Graph(DeviceMesh((2, 2)))
    g.source("x", (4, 3))
    # dim 1 (size 3) cannot take a factor 2; dim 0 (size 4) can take axis 0, 1 or both
    assert enumerate_strategies(g.ops[0], g.mesh) == [((), ()), ((0, 1), ()), ((0,), ()), ((1,), ())]


def test_divisibility_with_mixed_mesh():
    g = Graph(DeviceMesh((2, 3)))
    g.source("v", (6, 4))
    cands = set(enumerate_strategies(g.ops[0], g.mesh))
    # dim0 = 6 takes 2, 3 or 6; dim1 = 4 takes only 2 (axis 0)
    expected = {((), ()), ((0,), ()), ((1,), ()), ((0, 1), ()), ((), (0,)), ((1,), (0,))}
    assert cands == expected


def test_unsplittable_dims_never_split():
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (4, 8, 8))
    g.add_op("conv", "conv", {"n": 4, "h": 8, "w": 8}, [x], [("n", "h", "w")], [("n", "h", "w")],
             unsplittable=frozenset({"h", "w"}))
    cands = enumerate_strategies(g.ops[1], g.mesh)
    assert all(s[1] == () and s[2] == () for s in cands)
    assert set(cands) == {((), (), ()), ((0,), (), ()), ((1,), (), ()), ((0, 1), (), ())}


def test_fully_use_devices():
    g = matmul_graph(DeviceMesh((2, 2, 2)))
    cands = enumerate_strategies(g.ops[2], g.mesh, fully_use_devices=True)
    assert len(cands) == 3 ** 3               # each axis goes to m, k or n
    assert all(sorted(axes_used(s)) == [0, 1, 2] for s in cands)
    assert ((), (), ()) not in cands


def test_fully_use_devices_falls_back_when_impossible():
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (2, 3))      # at most one factor 2 fits
    g.add_op("neg", "neg", {"i": 2, "j": 3}, [x], [("i", "j")], [("i", "j")])
    cands = enumerate_strategies(g.ops[1], g.mesh, fully_use_devices=True)
    assert set(cands) == {((0,), ()), ((1,), ())}
    # a source (input) is exempt: its layout follows its users
    assert ((), ()) in enumerate_strategies(g.ops[0], g.mesh, fully_use_devices=True)


def test_fixed_strategy_returned_alone():
    g = matmul_graph(DeviceMesh((2, 2, 2)), fixed=((0,), (), (1, 2)))
    assert enumerate_strategies(g.ops[2], g.mesh) == [((0,), (), (1, 2))]


def test_max_candidates_keeps_replicated_and_the_largest():
    g = matmul_graph(DeviceMesh((2, 2, 2)))
    full = enumerate_strategies(g.ops[2], g.mesh)
    few = enumerate_strategies(g.ops[2], g.mesh, max_candidates=5)
    assert few == full[:5] and few[0] == ((), (), ())
    assert all(g.mesh.count(axes_used(s)) == 8 for s in few[1:])


def test_matches_independent_product_enumeration():
    mesh = DeviceMesh((2, 2, 3))
    sizes = {"a": 12, "b": 4, "c": 9}
    g = Graph(mesh)
    x = g.source("x", tuple(sizes.values()))
    g.add_op("op", "exp", sizes, [x], [tuple(sizes)], [tuple(sizes)])
    expected = set()
    for assign in itertools.product([None, 0, 1, 2], repeat=3):    # axis -> loop dim
        s = tuple(tuple(a for a in range(3) if assign[a] == d) for d in range(3))
        if all(size % mesh.count(s[d]) == 0 for d, size in enumerate(sizes.values())):
            expected.add(s)
    assert set(enumerate_strategies(g.ops[1], mesh)) == expected


# -- data parallel ---------------------------------------------------------------------------
@pytest.mark.parametrize("mesh,size,expected", [
    ((2, 2, 2), 64, (0, 1, 2)),
    ((2, 2, 2), 6, (0,)),          # 2 divides 6, 4 does not
    ((2, 2, 3), 12, (0, 1, 2)),
    ((2, 2, 3), 8, (0, 1)),        # 3 does not divide 8
    ((3, 2), 4, (1,)),             # axis 0 (3) skipped, axis 1 (2) taken
    ((2, 2), 1, ()),
])
def test_data_parallel_data_source(mesh, size, expected):
    g = Graph(DeviceMesh(mesh))
    g.source("x", (size, 5))
    assert data_parallel_strategy(g.ops[0], g.mesh) == (expected, ())


def test_data_parallel_params_consts_and_ops():
    g = matmul_graph(DeviceMesh((2, 2, 2)))
    g.source("c", (8,), kind="const")
    assert data_parallel_strategy(g.ops[1], g.mesh) == ((), ())          # param: replicated
    assert data_parallel_strategy(g.ops[3], g.mesh) == ((),)             # const: replicated
    assert data_parallel_strategy(g.ops[2], g.mesh) == ((0, 1, 2), (), ())  # m of operand 0


def test_data_parallel_follows_operand_dim_0_even_when_transposed():
    g = Graph(DeviceMesh((2,)))
    x = g.source("x", (4, 6))
    g.add_op("t", "transpose", {"i": 6, "j": 4}, [x], [("j", "i")], [("i", "j")])
    assert data_parallel_strategy(g.ops[1], g.mesh) == ((), (0,))


def test_data_parallel_unsplittable_and_scalar_are_replicated():
    g = Graph(DeviceMesh((2,)))
    x = g.source("x", (4, 6))
    g.add_op("u", "exp", {"i": 4, "j": 6}, [x], [("i", "j")], [("i", "j")], unsplittable=frozenset({"i"}))
    s = g.source("s", ())
    g.add_op("v", "neg", {}, [s], [()], [()])
    assert data_parallel_strategy(g.ops[1], g.mesh) == replicated(g.ops[1])
    assert data_parallel_strategy(g.ops[2], g.mesh) == ()
    assert data_parallel_strategy(g.ops[3], g.mesh) == ()


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (2, 3), (2, 2, 3), (5,)])
def test_strategies_for_depends_on_sizes_only_through_their_gcd_with_the_device_count(mesh_shape):
    """The memo by gcd(size, N) must give exactly the enumeration on the raw sizes."""
    import random

    from searchers.strategies import _strategies_for  # the enumeration itself, without the gcd memo
    rng = random.Random(0)
    for _ in range(60):
        nd = rng.randint(1, 3)
        sizes = tuple(rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 12, 18, 20, 24, 30, 36, 60, 64, 96, 100]) for _ in range(nd))
        uns = tuple(rng.random() < 0.2 for _ in range(nd))
        for fully in (False, True):
            assert strategies_for(sizes, uns, mesh_shape, fully) == \
                _strategies_for.__wrapped__(sizes, uns, mesh_shape, fully, None)
