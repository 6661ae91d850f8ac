"""Issue 40: a layout change that XLA's partitioner would make the long way is run by mshard's own collectives,
planned and priced so, in the compiled program, with values and gradients equal to one device.

The case: MindSpore-style ``Layout`` strategies on two primitives of a 2 x 2 x 2 mesh (a, b, c). ReLU computes
[16, 32] float32 split (a, b); Square reads it split (-, (b, a, c)). XLA's partitioner cannot go from the first to
the second directly ("involuntary full rematerialization"): it gathers the tensor whole and slices it, 2
all-gathers that move 1,536 B per device (512 B over b, then 1,024 B over a). Direct: axis a leaves dim 0 for dim 1 by one all-to-all of
the 512 B local block (half of it leaves: 256 B), then axis c splits dim 1 by a local slice."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import on_one_device

import mshard as ms
from mshard import ops
from searchers.direct_reshard import xla_only

LAY = ms.Layout((2, 2, 2), ("a", "b", "c"))
X = jnp.asarray(np.random.default_rng(0).standard_normal((16, 32)), jnp.float32)
W = jnp.arange(32.0, dtype=jnp.float32)


def net(x):
    relu = ops.ReLU().shard((LAY("a", "b"),))
    square = ops.Square().shard((LAY("None", ("b", "a", "c")),))
    return square(relu(x))


def loss(x):
    return jnp.sum(net(x) * W)


def _moved(report, kind=None):
    return sum(c.moved for c in report.collectives if kind is None or c.kind == kind)


def test_the_change_runs_as_one_all_to_all_and_the_plan_says_what_xla_would_move():
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        f = ms.jit(net)
        (r,) = f.plan(X).redistributions
        rep = ms.comm_report(f, X)
        y = f(X)
    # each device holds an (a, b) tile of 8 x 16 float32, 512 B; the all-to-all over a (2 devices) sends half of it
    assert r.communication == {"all-to-all": 256.0} and r.xla_bytes == 1536.0, r
    assert "where XLA's change moves 1,536 B" in str(r)
    assert [c.kind for c in rep.collectives] == ["all-to-all"] and _moved(rep) == 256.0, rep.collectives
    # an elementwise program: exact against numpy on one device
    np.testing.assert_array_equal(np.asarray(y), np.square(np.maximum(np.asarray(X), 0)))


def test_left_to_xla_the_same_program_moves_six_times_more():
    """The program before direct redistributions (searchers.direct_reshard.xla_only): XLA's 2 all-gathers."""
    with xla_only(), ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        f = ms.jit(net)
        (r,) = f.plan(X).redistributions
        rep = ms.comm_report(f, X)
    assert r.xla_bytes is None and r.communication == {"all-gather": 1536.0}, r
    assert {c.kind for c in rep.collectives} == {"all-gather"} and _moved(rep) == 1536.0, rep.collectives


def test_the_gradient_takes_the_change_back_directly_and_equals_one_device():
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        g = ms.jit(jax.grad(loss))
        rep = ms.comm_report(g, X)
        got = g(X)
    with xla_only(), ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
        before = ms.comm_report(ms.jit(jax.grad(loss)), X)
    want = on_one_device(jax.grad(lambda x: jnp.sum(jnp.square(jax.nn.relu(x)) * W)), X)
    # the same float32 products per element on both sides (no sum crosses devices): exact
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # forward all-to-all (256 B); backward (b, a, c) -> (a, b): axis c gathered back (256 B), axis a returned to
    # dim 0 by all-to-all (256 B)
    assert _moved(rep) == 768.0 and _moved(rep) < _moved(before), (rep.collectives, before.collectives)
