"""mshard._src.runtime.redistribute (issue 40): where XLA's partitioner would move more bytes than one collective
per moved mesh axis, the executor's own layout change compiles to exactly the direct collectives, fewer bytes than
XLA's program for the same change, with every value and every gradient entry equal to the input's (a layout change
moves values, it computes nothing: equality is exact)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_layouts
from jax.sharding import NamedSharding

from mshard._src.runtime.redistribute import is_direct, redistribute
from mshard._src.values.hlo import CommReport
from mshard._src.values.layout import axes_by_index, jax_mesh, prime_mesh, spec_of
from searchers.direct_reshard import steps

MESH = prime_mesh(8)            # 2 x 2 x 2, axes d0 d1 d2
SHAPE = (16, 32)


def _layouts():
    """Every layout of a rank-2 tensor on the mesh, by axis name."""
    return [tuple(tuple(MESH.names[a] for a in d) for d in lay) for lay in all_layouts(2, 3)]


_ALL = [(s, d) for s in _layouts() for d in _layouts() if s != d]
# a fixed sample of the pairs the executor runs itself (each compiles two programs and a gradient)
DIRECT = random.Random(0).sample([p for p in _ALL if is_direct(*p, MESH, SHAPE)], 6)
# a whole stack moved in one all-to-all (rows (d0, d1) to columns (d0, d1, d2), then d2 sliced):
# searchers.direct_reshard's stack moves
STACKS = [((("d0", "d1"), ()), ((), ("d0", "d1", "d2")))]
DIRECT += [p for p in STACKS if p not in DIRECT]
XLA_KEPT = random.Random(0).sample([p for p in _ALL if not is_direct(*p, MESH, SHAPE)], 2)


def _moved(fn, x):
    return sum(c.moved for c in CommReport.from_hlo(fn.lower(x).compile().as_text()).collectives)


def _programs(src, dst):
    jm = jax_mesh(MESH)
    ins, outs = NamedSharding(jm, spec_of(src)), NamedSharding(jm, spec_of(dst))
    mine = jax.jit(lambda x: redistribute(x, src, dst, MESH), in_shardings=ins, out_shardings=outs)
    xla = jax.jit(lambda x: jax.lax.with_sharding_constraint(x, outs), in_shardings=ins, out_shardings=outs)
    return mine, xla, ins


@pytest.mark.parametrize("src,dst", DIRECT, ids=[f"{s}->{d}" for s, d in DIRECT])
def test_direct_change_moves_less_than_xla_and_keeps_every_value(src, dst):
    x = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)
    mine, xla, ins = _programs(src, dst)
    np.testing.assert_array_equal(np.asarray(mine(x)), np.asarray(x))
    predicted = sum(s.moved for s in steps(axes_by_index(src, MESH), axes_by_index(dst, MESH), MESH.shape)) * x.nbytes
    got = _moved(mine, x)
    assert got == pytest.approx(predicted, rel=1e-12), (got, predicted)
    assert got < _moved(xla, x)
    # the gradient is the change back: d/dx sum(w * change(x)) = w, laid out as x
    w = jnp.asarray(np.random.default_rng(0).standard_normal(SHAPE), jnp.float32)
    g = jax.jit(jax.grad(lambda x: jnp.sum(w * redistribute(x, src, dst, MESH))), in_shardings=ins)(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("src,dst", XLA_KEPT, ids=[f"{s}->{d}" for s, d in XLA_KEPT])
def test_where_xla_moves_no_more_its_change_is_kept(src, dst):
    x = jnp.arange(np.prod(SHAPE), dtype=jnp.float32).reshape(SHAPE)
    mine, xla, _ = _programs(src, dst)
    assert mine.lower(x).compile().as_text().count("all-to-all") == xla.lower(x).compile().as_text().count(
        "all-to-all")
    assert _moved(mine, x) == _moved(xla, x)
    np.testing.assert_array_equal(np.asarray(mine(x)), np.asarray(x))


def test_the_stack_pairs_run_as_stacks():
    for src, dst in STACKS:
        assert is_direct(src, dst, MESH, SHAPE)
        mine, _, _ = _programs(src, dst)
        hlo = mine.lower(jnp.zeros(SHAPE, jnp.float32)).compile().as_text()
        assert [(c.kind, c.group_size) for c in CommReport.from_hlo(hlo).collectives] == [("all-to-all", 4)]


def test_a_dim_that_does_not_divide_is_left_to_xla():
    src, dst = DIRECT[0]
    assert not is_direct(src, dst, MESH, (15, 33))
