"""The bytes a ``shard_map`` body's own collectives move, read from the jaxpr (mshard/_src/jaxpr/manual_collectives.py),
equal the compiled program's, read from its HLO without mshard's code (tests/helpers.py ``loop_moved``): every kind,
axis groups of 2, 4 and 8 devices, and a scan around them (its trip count)."""

import jax
import jax.numpy as jnp
import pytest
from helpers import loop_moved
from jax.sharding import PartitionSpec as P

from mshard._src.jaxpr.manual_collectives import region_manual_moves

MESH = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _body(x):
    y = jax.lax.psum(x, "a")
    z = jax.lax.psum_scatter(x, ("a", "b"), scatter_dimension=0, tiled=True)
    w = jax.lax.all_gather(z, "b", axis=0, tiled=True)
    v = jax.lax.ppermute(x, "a", [(0, 1), (1, 0)])
    u = jax.lax.all_to_all(x, "b", 0, 0, tiled=True)
    return jnp.sin(y) + jnp.cos(v) * u, w


def _looped(x):
    def step(c, _):
        a, w = _body(c)
        return a + jnp.sum(w), None
    return jax.lax.scan(step, x, None, length=3)[0]


@pytest.mark.parametrize("fn, trips", [(_body, 1), (_looped, 3)], ids=["straight", "in_a_scan"])
def test_a_shard_map_bodys_collectives_are_priced_as_compiled(fn, trips):
    out_specs = (P("a"), P("a")) if fn is _body else P("a")
    f = jax.jit(jax.shard_map(fn, mesh=MESH, in_specs=P("a"), out_specs=out_specs, check_vma=False))
    x = jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8)
    got: dict[str, float] = {}
    for kind, nbytes, _ in region_manual_moves(jax.make_jaxpr(f)(x).jaxpr, ("a", "b"), (2, 4)):
        got[kind] = got.get(kind, 0.0) + nbytes
    want = {k: v for k, v in loop_moved(f.lower(x).compile().as_text(), trips).items() if v}
    assert got == pytest.approx(want), (got, want)
    assert set(got) == {"all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all"}


def test_a_shard_map_on_another_mesh_is_not_counted():
    other = jax.make_mesh((8,), ("c",), axis_types=(jax.sharding.AxisType.Auto,))
    f = jax.shard_map(lambda x: jax.lax.psum(x, "c"), mesh=other, in_specs=P("c"), out_specs=P(), check_vma=False)
    assert region_manual_moves(jax.make_jaxpr(f)(jnp.ones((16, 8))).jaxpr, ("a", "b"), (2, 4)) == []


def test_a_shard_map_manual_over_some_axes_only_is_not_priced():
    """A pipeline's shard_map is manual over its stage axes only: its body's shapes are whole over the other axes,
    which XLA still partitions, so its per-device bytes are not known from the jaxpr (measured on the 2-stage GPT
    of tests/e2e/pipeline, 10 ticks: the jaxpr's permutes come to 655,360 B per device, the compiled ones to 168,960 B)."""
    f = jax.shard_map(lambda x: jax.lax.psum(x, "a"), mesh=MESH, in_specs=P("a"), out_specs=P(), axis_names={"a"},
                      check_vma=False)
    assert region_manual_moves(jax.make_jaxpr(f)(jnp.ones((16, 8))).jaxpr, ("a", "b"), (2, 4)) == []


def test_the_move_into_a_shard_maps_inputs_is_priced():
    """The layout change into a shard_map's in_specs runs whenever the shard_map does: its boundary op's result is
    read by the manual body, which the graph does not hold, and it was once taken for dead code and left out of
    the plan (searchers/graph.py ``dead_ops``; measured here: the plan said 14,336 B, the program moves 21,504 B).
    The batch arrives split over the 8 devices and the shard_map reads it whole: an all-gather, priced as compiled."""
    import numpy as np

    import mshard as ms
    mesh = jax.make_mesh((2, 2, 2), ("d0", "d1", "d2"), axis_types=(jax.sharding.AxisType.Auto,) * 3)

    def f(x):
        whole = jax.shard_map(lambda a: jax.lax.psum(a * 3, ("d0", "d1", "d2")), mesh=mesh, in_specs=P(),
                              out_specs=P(), check_vma=False)
        return whole(jnp.tanh(x) * 2)
    x = jnp.arange(64 * 32, dtype=jnp.float32).reshape(64, 32) / 1000
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode="dynamic_programming", device_num=8):
        r = ms.jit(f)
        plan = r.plan(x)
        compiled = {k: v for k, v in loop_moved(r.lower(x).compile().as_text(), 1).items() if v}
        out = np.asarray(r(x))
    assert plan.mesh.names == ("d0", "d1", "d2")       # the shard_map is on the region's mesh (else not priced)
    assert "all-gather" in compiled
    assert plan.cost.communication == pytest.approx(compiled, abs=0.5)
    # the psum adds the same whole value on 8 devices: 8 * 3 * 2 * tanh(x), to float32 rounding of a few ops
    np.testing.assert_allclose(out, 48 * np.tanh(np.asarray(x, np.float64)), rtol=1e-6)
