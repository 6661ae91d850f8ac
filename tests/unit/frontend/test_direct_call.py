"""PyNative-style eager calls (issue 16): a primitive with a strategy called on concrete arrays in semi_auto runs
as its own sharded region and its result keeps the layout; elsewhere it is plain JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mshard as ms
from mshard import ops

RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.normal(size=(16, 8)), jnp.float32)
W = jnp.asarray(RNG.normal(size=(8, 32)), jnp.float32)
# float32: 8-term dot products, computed on one device or split over 4 column blocks (no reduction across devices)
TOL = 1e-6


def test_an_eager_primitive_with_a_strategy_runs_sharded_and_keeps_its_layout():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    y = mm(X, W)
    np.testing.assert_allclose(np.asarray(y), np.asarray(X) @ np.asarray(W), rtol=TOL, atol=TOL)
    assert len(y.sharding.device_set) == 8 and y.sharding.shard_shape(y.shape) == (8, 8)
    z = ops.ReLU().shard(((2, 4),))(y)                    # the next eager op takes the layout as it is
    assert z.sharding.shard_shape(z.shape) == (8, 8)
    assert ms.comm_report(mm._eager_region, X, W).total_count == 0      # column parallel: nothing moves
    n = len(mm._eager_region._cache)          # (a .shard call anywhere re-plans: ReLU's above added one)
    mm(X, W)
    mm(X, W)
    assert len(mm._eager_region._cache) == n                              # compiled once per shapes


def test_outside_the_strategy_modes_it_is_plain_jax_and_under_jax_jit_it_keeps_its_strategy():
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    ms.set_auto_parallel_context(parallel_mode="data_parallel", device_num=8)
    assert len(mm(X, W).sharding.device_set) == 1
    assert len(jax.jit(lambda a, b: mm(a, b))(X, W).sharding.device_set) == 1
    assert "_eager_region" not in mm.__dict__
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    y = jax.jit(lambda a, b: mm(a, b))(X, W)            # its region, traced into the user's program
    np.testing.assert_allclose(np.asarray(y), np.asarray(X) @ np.asarray(W), rtol=TOL, atol=TOL)
    assert y.sharding.shard_shape(y.shape) == (X.shape[0] // 2, W.shape[1] // 4)


def test_a_partition_spec_strategy_needs_a_region_and_says_so_when_called_eagerly():
    from jax.sharding import PartitionSpec as P
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mm = ops.MatMul().shard((P("dp", None), P(None, "mp")))
    with pytest.warns(ms.errors.StrategyIgnoredWarning, match="names mesh axes only an enclosing region defines"):
        y = mm(X, W)
    np.testing.assert_allclose(np.asarray(y), np.asarray(X) @ np.asarray(W), rtol=TOL, atol=TOL)


def test_a_partition_spec_strategy_under_the_users_jax_jit_runs_plain_and_warns_once():
    from jax.sharding import PartitionSpec as P
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mm = ops.MatMul().shard((P("dp", None), P(None, "mp")))
    with pytest.warns(ms.errors.StrategyIgnoredWarning, match="under your own jax.jit") as rec:
        y = jax.jit(lambda a, b: mm(a, b) + mm(a, b))(X, W)
    assert sum(issubclass(r.category, ms.errors.StrategyIgnoredWarning) for r in rec) == 1
    np.testing.assert_allclose(np.asarray(y), 2 * (np.asarray(X) @ np.asarray(W)), rtol=TOL, atol=TOL)


def test_repeated_eager_calls_replan_for_a_new_shape_and_take_an_input_of_another_layout():
    """The cached path of an eager op: a new shape is planned again (not run with the plan of the old one); an
    input committed to another layout (another eager op's result) is laid out as this op's plan asks."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    ref = np.asarray(X) @ np.asarray(W)
    for _ in range(2):
        mm(X, W)
    X2 = jnp.concatenate([X, 2 * X])
    for x, want in ((X2, np.concatenate([ref, 2 * ref])), (X, ref), (X2, np.concatenate([ref, 2 * ref]))):
        y = mm(x, W)
        np.testing.assert_allclose(np.asarray(y), want, rtol=TOL, atol=TOL)
        assert y.sharding.shard_shape(y.shape) == (x.shape[0] // 2, W.shape[1] // 4)
    rows = ops.ReLU().shard(((8, 1),))(X)                  # committed: split 8 ways on rows
    assert rows.sharding.shard_shape(rows.shape) == (2, 8)
    for _ in range(2):
        y = mm(rows, W)
        np.testing.assert_allclose(np.asarray(y), np.maximum(np.asarray(X), 0) @ np.asarray(W), rtol=TOL, atol=TOL)
        assert y.sharding.shard_shape(y.shape) == (8, 8)


@pytest.mark.parametrize("with_region", [False, True])
def test_eager_ops_and_a_region_in_a_chain_move_nothing_outside_their_programs(with_region):
    """Mixing eager ops and a sharded region: each result is already in the layout the next one's plan asks, so
    after the first (compiling) pass nothing is placed or resharded between the programs (no jax.device_put),
    and no program holds a collective (column-parallel matmul, elementwise ops on its layout)."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    relu = ops.ReLU().shard(((2, 4),))
    scale = ms.shard(lambda y: y * 2.0, in_strategy=((2, 4),)) if with_region else ops.Mul().shard(((2, 4), ()))
    xs = ops.ReLU().shard(((2, 1),))(X)                   # the batch split mm's plan asks of its first input
    w = jax.device_put(W, mm._region()._prepare((xs, W), {})[0].in_shardings[1])        # placed once

    def chain():
        return relu(scale(relu(mm(xs, w)), *(() if with_region else (2.0,))))
    ref = np.maximum(np.maximum(np.asarray(X), 0) @ np.asarray(W), 0) * 2
    chain()
    puts = []
    real = jax.device_put
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real(*a, **k))
        for _ in range(3):
            out = chain()
    np.testing.assert_allclose(np.asarray(out), ref, rtol=TOL, atol=TOL)
    assert out.sharding.shard_shape(out.shape) == (8, 8)
    y = mm(xs, w)
    assert ms.comm_report(mm._eager_region, xs, w).total_count == 0
    assert ms.comm_report(relu._eager_region, y).total_count == 0
    assert len(puts) == 0, f"{len(puts)} device_put(s) between the programs"


def _direct_op():
    """A MatMul called until its calls go direct (mshard._src.frontend.direct_call): no Python frame before jax.jit's dispatch."""
    from mshard._src.frontend import direct_call
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    for _ in range(direct_call.HITS + 1):
        y = mm(X, W)
    assert direct_call.is_direct(mm) and type(mm).__name__ == "MatMul" and isinstance(mm, ops.MatMul)
    return mm, y


def test_repeated_eager_calls_go_direct_and_keep_the_planned_program_and_layout():
    """After a few calls the op's class becomes its direct subclass; its calls then run the op's own region traced
    into one jax.jit: the same values, the same output layout, and a compiled program with the same collectives
    (none: column parallel) as the region's."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mm, y0 = _direct_op()
    y = mm(X, W)
    np.testing.assert_allclose(np.asarray(y), np.asarray(X) @ np.asarray(W), rtol=TOL, atol=TOL)
    assert y.sharding == y0.sharding and y.sharding.shard_shape(y.shape) == (8, 8)
    hlo = mm._direct_call.lower(X, W).compile().as_text()
    assert not any(k in hlo for k in ("all-gather", "all-reduce", "all-to-all", "collective-permute"))
    assert repr(mm) == "MatMul().shard(((2, 1), (1, 4)))"
    # a new shape goes through the ordinary path again inside the jax.jit: planned for that shape
    X2 = jnp.concatenate([X, 2 * X])
    y2 = mm(X2, W)
    np.testing.assert_allclose(np.asarray(y2), np.asarray(X2) @ np.asarray(W), rtol=TOL, atol=TOL)
    assert y2.sharding.shard_shape(y2.shape) == (16, 8)


def test_a_direct_op_goes_back_when_the_context_a_strategy_or_a_region_changes():
    from mshard._src.frontend import direct_call
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mm, _ = _direct_op()
    ms.set_auto_parallel_context(parallel_mode="data_parallel")          # eager calls are plain JAX there
    assert not direct_call.is_direct(mm)
    assert len(mm(X, W).sharding.device_set) == 1
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    mm, _ = _direct_op()
    mm.shard(((8, 1), (1, 1)))                                          # a new strategy: its layout from now on
    assert not direct_call.is_direct(mm)
    for _ in range(direct_call.HITS + 2):
        y = mm(X, W)
    assert direct_call.is_direct(mm) and y.sharding.shard_shape(y.shape) == (2, 32)
    mm.name = "proj"                                                    # any attribute set
    assert not direct_call.is_direct(mm) and mm.name == "proj"
    mm, _ = _direct_op()
    # inside a region the op is annotated (its strategy planned with the region), not run as its own program
    f = ms.jit(lambda a, b: jnp.tanh(mm(a, b)))
    # float32: TOL's 8-term dot products, then tanh (1-Lipschitz) computed by XLA's and numpy's own approximations
    np.testing.assert_allclose(np.asarray(f(X, W)), np.tanh(np.asarray(X) @ np.asarray(W)), rtol=1e-5, atol=1e-5)
    assert not direct_call.is_direct(mm)
    assert any(r.strategy == ((2, 1), (1, 4)) for r in f.plan(X, W).ops if r.kind == "MatMul")


def test_a_direct_op_under_the_users_transformations():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mm, _ = _direct_op()
    g = jax.grad(lambda w: mm(X, w).sum())(W)                            # d/dW sum(X W) = X^T 1
    # float32: each entry sums 16 rows of X (|x| < 5 for these seeded normal draws), in another order than numpy:
    # error <= 15 * 2**-24 * 16 * 5 < 1e-4
    np.testing.assert_allclose(np.asarray(g), np.asarray(X).T @ np.ones((16, 32), np.float32), rtol=1e-5, atol=1e-4)
    y = jax.jit(lambda a, b: 2 * mm(a, b))(X, W)
    np.testing.assert_allclose(np.asarray(y), 2 * (np.asarray(X) @ np.asarray(W)), rtol=TOL, atol=TOL)
    v = jax.vmap(lambda a: mm(a, W))(jnp.stack([X, -X]))
    np.testing.assert_allclose(np.asarray(v[1]), -(np.asarray(X) @ np.asarray(W)), rtol=TOL, atol=TOL)
    assert y.sharding.shard_shape(y.shape) == (8, 8)          # its region traced into the user's program
