"""mshard._src.planning.fused_sums (issue 40): a plan prices two partial sums the emitter adds before one all-reduce
as that one all-reduce. The reference is the compiled program: the cost model's ring formula, 2 S (k - 1) / k bytes
per device, applied to each all-reduce the HLO runs (``ms.comm_report``), not the planner's own arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mshard as ms

R = np.random.default_rng(3)


def _ring(rep, kind="all-reduce"):
    return sum(c.nbytes * 2 * (c.group_size - 1) / c.group_size for c in rep.collectives if c.kind == kind)


def test_a_tied_weights_gradient_is_priced_as_one_all_reduce():
    """``e`` read twice, as ``x @ e`` and ``(.) @ e.T``, with the batch split 8 ways: its gradient is two partial
    sums over the batch, added and all-reduced once. Priced apart, the plan said one [16, 32] all-reduce too many."""
    e = nnx.Param(jnp.asarray(R.normal(size=(16, 32)), jnp.float32))
    x = jnp.asarray(R.normal(size=(64, 16)), jnp.float32)

    def step(x, e):
        return jax.value_and_grad(lambda e: jnp.sum(jnp.tanh(x @ e) @ e.T))(e[...])
    with ms.parallel_context(parallel_mode="data_parallel", device_num=8):
        f = ms.jit(step)
        plan = f.plan(x, e)
        rep = ms.comm_report(f, x, e)
    assert {c.kind for c in rep.collectives} == {"all-reduce"}
    # the gradient [16, 32] f32 and the loss, each once
    assert plan.cost.communication["all-reduce"] == _ring(rep) == 2 * (16 * 32 + 1) * 4 * 7 / 8
