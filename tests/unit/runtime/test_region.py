"""``Region.bind``: a region called many times with the same modules skips the per-call traversal and still equals
the region (values written between calls seen, a new context or shape re-planned, state written back)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mshard as ms
from mshard.errors import RegionTypeError


class Counter(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.float32))

    def __call__(self, x):
        self.calls[...] += 1.0
        return self.lin(x)


def _forward(m, x):
    return m(x)


def test_bound_region_equals_the_region_and_sees_written_values():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    a, b = Counter(), Counter()
    region = ms.Region(_forward, data_strategy=(None, (2, 1)))
    bound = region.bind(b)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
    for _ in range(3):
        want, got = region(a, x), bound(x)
        assert np.array_equal(np.asarray(want), np.asarray(got))
        assert got.sharding.shard_shape(got.shape)[0] == 8          # the data split (2, 1) holds
    assert float(b.calls[...]) == 3.0 == float(a.calls[...])          # state the region writes comes back
    assert bound._fast is not None                                      # later calls took the fast path
    # a value written into a Variable between calls is used (nnx.update, as an optimizer would)
    new_k = jnp.ones((4, 8))
    nnx.update(a, {"lin": {"kernel": new_k}})
    nnx.update(b, {"lin": {"kernel": new_k}})
    assert np.array_equal(np.asarray(region(a, x)), np.asarray(bound(x)))
    np.testing.assert_allclose(np.asarray(bound(x)), np.asarray(x @ new_k + b.lin.bias[...]), rtol=1e-6)


def test_bound_region_replans_on_a_new_context_or_shape():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    m = Counter()
    bound = ms.jit(_forward).bind(m)
    x = jnp.ones((16, 4))
    assert bound(x).sharding.shard_shape((16, 8))[0] == 2           # data_parallel dataset_strategy: 8 ways
    ms.set_auto_parallel_context(dataset_strategy="full_batch")
    assert bound(x).sharding.shard_shape((16, 8))[0] == 16          # re-planned: the batch whole
    assert bound(jnp.ones((8, 4))).shape == (8, 8)                    # a new shape: compiled again
    with pytest.raises(RegionTypeError, match="bind takes nnx Modules"):
        ms.jit(_forward).bind(jnp.ones(3))


def test_bound_region_under_a_trace_goes_through_the_region():
    m = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    bound = ms.jit(_forward).bind(m)
    x = jnp.ones((8, 4))
    bound(x)
    g = jax.grad(lambda x: jnp.sum(bound(x)))(x)
    # d sum(x W + b) / dx = row sums of W for every row; float32 sums of 8 terms
    np.testing.assert_allclose(np.asarray(g), np.tile(np.asarray(m.kernel[...]).sum(1), (8, 1)), rtol=1e-6)


def test_a_region_can_be_re_entered_while_it_traces():
    """Per-call data (which arguments are modules) is passed along, not kept on the Region (issue 38): a region that
    calls itself while it traces, with its module at another position, plans both calls right. With the positions
    kept on the Region, the inner call overwrote the outer call's, and the outer call counted its data argument as
    argument 1 of a 1-entry dataset_strategy (DatasetStrategyError)."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy=((8, 1),))
    lin = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    @ms.jit
    def f(a, b):
        if isinstance(a, nnx.Module):
            return a(b) + f(b, a)        # the same region, re-entered with the module second
        return b(a) * 2

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4)), jnp.float32)
    # float32: each product is a 4-term dot in any order, a few ulps of O(1) values; 3y vs y + 2y adds one rounding
    np.testing.assert_allclose(np.asarray(f(lin, x)), 3 * np.asarray(lin(x)), rtol=1e-6, atol=1e-6)
