"""SequentialCell / CellList: the forward is the composition, the parameters are the sub-Cells'."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mshard as ms
from mshard import nn
from mshard.errors import CellTypeError


def test_sequential_cell_composes_and_trains_its_sub_cells():
    a, b = nn.Dense(4, 3), nn.Dense(3, 2)
    seq = nn.SequentialCell([a, nn.ReLU(), b])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 4)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(seq(x)), np.asarray(b(jnp.maximum(a(x), 0))))
    assert len(seq.trainable_params()) == 4
    assert {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(seq, nnx.Param))} == {
        "cells/0/weight", "cells/0/bias", "cells/2/weight", "cells/2/bias"}


def test_cell_list_holds_cells_and_refuses_others():
    cl = nn.CellList([nn.Dense(2, 2)])
    cl.extend([nn.ReLU()])
    cl.insert(0, nn.Flatten())
    assert [type(c).__name__ for c in cl] == ["Flatten", "Dense", "ReLU"]
    with pytest.raises(CellTypeError, match="item 0 is a function"):
        nn.SequentialCell([lambda x: x])


def test_a_sequential_cell_shards_like_any_cell():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    seq = nn.SequentialCell(nn.Dense(8, 16, weight_init="ones", bias_init="zeros"), nn.ReLU())
    seq[0].matmul.shard(((2, 1), (4, 1)))
    x = jnp.ones((8, 8))
    want = np.full((8, 16), 8.0, np.float32)
    np.testing.assert_array_equal(np.asarray(ms.jit(lambda m, v: m(v))(seq, x)), want)
