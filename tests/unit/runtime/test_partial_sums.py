"""mshard._src.runtime.partial_sums (issue 40): partial sums computed per device, added, and reduced once.

The oracle is numpy on one device (the op's definition: a matrix product, rows added into a table). Each case
computes the op's parts on blocks laid out as given, sums them as the emitter does, and checks the sum against
numpy, and that the compiled program of two such parts added reduces once."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from mshard._src.jaxpr.sum_pairs import ROOTS
from mshard._src.runtime import partial_sums as ps
from mshard._src.values.hlo import CommReport
from mshard._src.values.layout import jax_mesh, prime_mesh, spec_of

MESH = prime_mesh(8)            # 2 x 2 x 2, axes d0 d1 d2
R = np.random.default_rng(7)


def _eqn(fn, *args):
    """The one eqn of ``fn`` that is not a broadcast (the root under test)."""
    j = jax.make_jaxpr(fn)(*args).jaxpr
    (eqn,) = [e for e in j.eqns if e.primitive.name in ROOTS]
    return eqn


def _put(x, lay):
    return jax.device_put(x, NamedSharding(jax_mesh(MESH), spec_of(lay)))


# (lhs layout, rhs layout) of x [16, 32] @ w [32, 8] contracting dim 1 with dim 0: the contraction split on the same
# axes on both sides is a partial sum over them; the free dims may be split on other axes
DOTS = [
    (((), ("d0", "d1", "d2")), (("d0", "d1", "d2"), ())),          # contraction 8 ways
    ((("d0",), ("d1", "d2")), (("d1", "d2"), ())),                 # rows 2 ways, contraction 4 ways
    (((), ("d2",)), (("d2",), ("d0", "d1"))),                      # contraction 2 ways, columns 4 ways
]


@pytest.mark.parametrize("ll, rl", DOTS)
def test_a_dot_contracting_a_split_dim_sums_to_the_product(ll, rl):
    x, w = R.normal(size=(16, 32)).astype(np.float32), R.normal(size=(32, 8)).astype(np.float32)
    eqn = _eqn(jnp.dot, x, w)
    st = jax.jit(lambda x, w: ps.local_partial(eqn, [x, w], [ll, rl], MESH).value)(_put(x, ll), _put(w, rl))
    axes = tuple(a for a in ll[1])
    assert st.shape == (2 ** len(axes), 16, 8)
    # float32: each part is a (32 / parts)-term dot product, the parts add in another order than numpy's
    np.testing.assert_allclose(np.asarray(st).sum(0), x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


def test_a_dot_whose_sides_split_the_contraction_differently_is_left_alone():
    x, w = np.ones((16, 32), np.float32), np.ones((32, 8), np.float32)
    eqn = _eqn(jnp.dot, x, w)
    assert ps.local_partial(eqn, [x, w], [((), ("d0",)), (("d1",), ())], MESH) is None
    assert ps.local_partial(eqn, [x, w], [((), ()), ((), ())], MESH) is None       # nothing split: no partial sum


def test_rows_added_into_a_table_sum_to_the_scatter_add_once():
    """A gather's transpose: every device adds its rows into the table; the table itself counts once."""
    table = R.normal(size=(10, 4)).astype(np.float32)
    idx = R.integers(0, 10, (16, 1)).astype(np.int32)
    rows = R.normal(size=(16, 4)).astype(np.float32)
    dn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                         scatter_dims_to_operand_dims=(0,))
    eqn = _eqn(lambda t, i, u: jax.lax.scatter_add(t, i, u, dn), table, idx, rows)
    lays = [((), ()), (("d0", "d1", "d2"), ()), (("d0", "d1", "d2"), ())]
    st = jax.jit(lambda *a: ps.local_partial(eqn, list(a), lays, MESH).value)(
        *[_put(a, lay) for a, lay in zip((table, idx, rows), lays, strict=True)])
    want = table.astype(np.float64).copy()
    np.add.at(want, idx[:, 0], rows)
    # float32: at most 16 rows added into an entry, in another order
    np.testing.assert_allclose(np.asarray(st).sum(0), want, rtol=1e-5, atol=1e-5)


def test_two_parts_added_compile_to_one_all_reduce():
    """x1.T @ g1 + x2.T @ g2 with the batch split 8 ways: one all-reduce of one [32, 8] result (1,024 B), where
    XLA's own program of the same sum reduces each product (2 x 1,024 B)."""
    x1, x2 = (R.normal(size=(64, 32)).astype(np.float32) for _ in range(2))
    g1, g2 = (R.normal(size=(64, 8)).astype(np.float32) for _ in range(2))
    eqn = _eqn(lambda a, b: jax.lax.dot_general(a, b, (((0,), (0,)), ((), ()))), x1, g1)
    lay = (("d0", "d1", "d2"), ())

    def ours(x1, g1, x2, g2):
        a = ps.local_partial(eqn, [x1, g1], [lay, lay], MESH)
        b = ps.local_partial(eqn, [x2, g2], [lay, lay], MESH)
        return ps.materialize(ps.add(a, b))

    def xlas(x1, g1, x2, g2):
        return x1.T @ g1 + x2.T @ g2
    args = [_put(a, lay) for a in (x1, g1, x2, g2)]
    reports = {}
    for name, fn in (("ours", ours), ("xla", xlas)):
        compiled = jax.jit(fn).lower(*args).compile()
        reports[name] = [(c.kind, c.nbytes) for c in CommReport.from_hlo(compiled.as_text()).collectives]
        got = compiled(*args)
        # float32: 64-term dot products, summed in another order
        np.testing.assert_allclose(np.asarray(got), x1.T.astype(np.float64) @ g1 + x2.T @ g2, rtol=1e-5, atol=1e-5)
    assert reports["ours"] == [("all-reduce", 32 * 8 * 4)]
    assert sorted(k for k, _ in reports["xla"]) == ["all-reduce"] * len(reports["xla"])
    assert sum(b for _, b in reports["xla"]) == 2 * 32 * 8 * 4


def test_parts_put_back_and_reduce_scattered_are_each_devices_block_of_the_join():
    """Two dots' parts (rows split over d0, contraction over d1), each reshaped to [2, 1, 8, 8], concatenated on the
    copy dim and reshaped back to [32, 8] rows over d0 (the put-back of interleaved copies), then reduce-scattered
    over d1 into rows (d0, d1): one reduce-scatter of the join, and the value is numpy's put-back of the products."""
    x1, x2 = (R.normal(size=(16, 32)).astype(np.float32) for _ in range(2))
    w = R.normal(size=(32, 8)).astype(np.float32)
    eqn = _eqn(jnp.dot, x1, w)
    ll, rl, held = (("d0",), ("d1",)), (("d1",), ()), (("d0",), ())
    back = jax.make_jaxpr(lambda a, b: jnp.concatenate([a, b], 1))(np.ones((2, 1, 8, 8)), np.ones((2, 1, 8, 8)))
    (cat,) = back.jaxpr.eqns
    shape = jax.make_jaxpr(lambda a: a.reshape(2, 1, 8, 8))(x1[:, :8]).jaxpr.eqns[0]
    flat = jax.make_jaxpr(lambda a: a.reshape(32, 8))(np.ones((2, 2, 8, 8))).jaxpr.eqns[0]

    def ours(x1, x2, w):
        parts = [ps.chain_op(shape, ps.local_partial(eqn, [x, w], [ll, rl], MESH), (("d0",), (), (), ()))
                 for x in (x1, x2)]
        joined = ps.concatenate(cat, parts, (("d0",), (), (), ()), (("d0", "d1"), ()))
        return ps.materialize(ps.chain_op(flat, joined, held), MESH)
    args = [_put(x1, ll), _put(x2, ll), _put(w, rl)]
    compiled = jax.jit(ours).lower(*args).compile()
    kinds = [(c.kind, c.nbytes) for c in CommReport.from_hlo(compiled.as_text()).collectives]
    assert kinds == [("reduce-scatter", 32 * 8 * 4 // 4)]          # each device's [8, 8] of the [32, 8] join
    want = np.concatenate([(x @ w.astype(np.float64)).reshape(2, 1, 8, 8) for x in (x1, x2)], 1).reshape(32, 8)
    # float32: 32-term dot products, two parts added in another order
    np.testing.assert_allclose(np.asarray(compiled(*args)), want, rtol=1e-5, atol=1e-5)
    assert ps.concatenate(cat, [parts_like := ps.Stacked(jnp.ones((2, 2, 1, 8, 8)), ("d1",), held + ((), ())),
                                ps.Stacked(jnp.ones((2, 2, 1, 8, 8)), ("d2",), held + ((), ()))],
                          held + ((), ()), None) is None               # parts over other axes are not joined
    assert ps.chain_op(flat, parts_like, None) is None                 # a reshape whose result layout is not known
