"""A reshape moves no data where a device's block of the array stays one contiguous block (issue 40).

A reshape keeps the flat (row-major) order, so a layout whose every device holds one contiguous run of the flat array
is the same data before and after. The reshape's rule runs over the finest factors both shapes are made of
(``mshard/_src/jaxpr/rules.py`` ``reshape_rule``): ``[64, 8]`` rows split 8 ways are 8 runs of 64 elements, which as
``[4, 128]`` are each row's two halves, the layout ``(4, 2)``; ``[2, 64]`` split ``(2, 4)`` is 8 runs of 16, which as
``[128]`` is the 8-way split. Before, a merged run kept a split of its leading dim only, and the compiled programs
gathered (512 B and 384 B per device).

Each network runs on 8 devices under sharding_propagation with a plain ``jnp`` reshape, forward and backward; the
values equal plain JAX on one device and the compiled program has no collective at all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import mshard as ms

pytestmark = pytest.mark.slow

R = np.random.default_rng(41)


def _arr(*shape):
    return jnp.asarray(R.normal(size=shape), jnp.float32)


CASES = {
    # rows split 8 ways (the data-parallel dataset) -> [4, 128]: each device's 64 elements are half a new row
    "split_rows": ((64, 8), "data_parallel", (4, -1)),
    # [2, 64] split (2, 4) -> [128]: each device's 16 elements are an eighth of the flat array
    "merge_split_dims": ((2, 64), ((2, 4),), (-1,)),
}


@pytest.mark.parametrize("name", CASES)
def test_a_reshape_that_keeps_each_device_s_block_contiguous_moves_nothing(name):
    shape, dataset, new = CASES[name]
    x, c = _arr(*shape), _arr(*jnp.zeros(shape).reshape(new).shape)
    fwd = lambda x: jnp.tanh(x.reshape(new)) * c
    step = lambda x: (fwd(x), jax.grad(lambda x: jnp.sum(fwd(x) * fwd(x)))(x))
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8,
                             dataset_strategy=dataset):
        f = ms.jit(step)
        rep = ms.comm_report(f, x)
        y, g = f(x)
    assert rep.by_kind == {}, rep.by_kind
    # float32 elementwise ops on the same elements, no sum reordered: equal to rounding
    assert_close(y, fwd(x))
    assert_close(g, jax.grad(lambda x: jnp.sum(fwd(x) * fwd(x)))(x))
