"""Guards for layouts XLA miscompiles (mshard._src.planning.xla_guards; issue 13): each guarded strategy equals one device through
mshard, and a test beside it shows plain jax.jit is still wrong, by the specific signal (a value far off, or XLA's
own abort), so an import error or a timeout cannot pass for it. When a JAX upgrade fixes XLA, that test fails and
says to lift the guard."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import mshard as ms
from mshard import ops


def conv(a, b):
    return jax.lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))


CASES = [  # (x shape, kernel shape, Conv2D strategy): the r1 reproducer, and a 3x3 conv with H or W split
    ((1, 1, 4, 1), (2, 1, 2, 1), ((1, 1, 2, 1), (2, 1, 1, 1))),
    ((2, 4, 8, 8), (8, 4, 3, 3), ((1, 1, 2, 1), (2, 1, 1, 1))),
    ((2, 4, 8, 8), (8, 4, 3, 3), ((1, 1, 1, 2), (4, 1, 1, 1))),
]


def data(xs, ks):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal(xs), jnp.float32), jnp.asarray(rng.standard_normal(ks), jnp.float32)


def assert_xla_still_wrong(got, want, tol: float, then: str) -> None:
    """Plain XLA's result is still wrong: some value is off by more than 100x the float32 tolerance ``tol`` (a
    miscompile, not rounding). If every value is within ``tol``, XLA was fixed: ``then``."""
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True))
    if err <= tol:
        pytest.fail(f"plain XLA now computes this right (max error {err:.2e}): {then}")
    assert err > 100 * tol, f"plain XLA is off by {err:.2e}: neither right nor the known miscompile"


@pytest.mark.parametrize("xs, ks, st", CASES)
def test_conv_with_halo_and_out_channel_split_equals_one_device(xs, ks, st):
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
    x, k = data(xs, ks)
    op = ops.Conv2D(ks[0], ks[2:], pad_mode="same").shard(st)
    f = ms.jit(lambda a, b: op(a, b))
    y = f(x, k)
    # float32: each output sums C*kh*kw <= 36 products, in another order on the halo'd shards
    assert_close(y, conv(x, k))
    assert y.sharding.shard_shape(y.shape)[1] == ks[0] // st[1][0]       # out-channels split as asked
    assert any("guard conv_halo_out_channels" in n for n in f.plan(x, k).notes)
    loss = ms.jit(jax.grad(lambda a, b: jnp.sum(op(a, b) ** 2), argnums=(0, 1)))
    gx, gk = loss(x, k)
    rx, rk = jax.grad(lambda a, b: jnp.sum(conv(a, b) ** 2), argnums=(0, 1))(x, k)
    # float32: gradients sum up to N*H*W = 128 products per kernel entry, reordered by the partitioning
    assert_close(gx, rx, rtol=1e-4, atol=1e-4)
    assert_close(gk, rk, rtol=1e-4, atol=1e-4)


def test_plain_xla_still_miscompiles_the_guarded_conv():
    """XLA (JAX 0.10) miscompiles a conv whose input is split across the kernel window while its kernel is split on
    out-channels."""
    mesh = jax.make_mesh((2, 2, 2), ("d0", "d1", "d2"), axis_types=(AxisType.Auto,) * 3)
    x, k = data((2, 4, 8, 8), (8, 4, 3, 3))

    def g(a, b):
        a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(None, None, "d0", None)))
        b = jax.lax.with_sharding_constraint(b, NamedSharding(mesh, P("d1", None, None, None)))
        return jax.lax.with_sharding_constraint(conv(a, b), NamedSharding(mesh, P(None, "d1", "d0", None)))
    assert_xla_still_wrong(jax.jit(g)(x, k), conv(x, k), 1e-4, "lift mshard._src.planning.xla_guards' conv_halo_out_channels")


def _chain(x, w1, w2, act):
    return jnp.sum(act(jax.lax.conv_general_dilated(
        jax.lax.conv_general_dilated(x, w1, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW")),
        w2, (1, 1), [(1, 1), (1, 1)], dimension_numbers=("NCHW", "OIHW", "NCHW"))))


def _r13_data():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((8, 4, 6, 6)), jnp.float32),
            jnp.asarray(rng.standard_normal((4, 4, 1, 1)), jnp.float32),
            jnp.asarray(rng.standard_normal((6, 4, 2, 1)), jnp.float32))


@pytest.mark.parametrize("mode", ["semi_auto", "dynamic_programming", "recursive_programming",
                                  "sharding_propagation"])
def test_conv_chain_split_on_width_after_it_has_the_right_weight_gradient(mode):
    """r13: a conv chain whose output is split on W gets a wrong weight gradient from plain jax.jit (dw2 off by 218
    where |dw2| <= 73). mshard pins each conv's result to the layout it computes in (W whole: a padded window is
    not split) and slices afterwards, so the gradient is right in every mode."""
    kw = ({"parallel_mode": "semi_auto_parallel"} if mode == "semi_auto" else
          {"parallel_mode": "auto_parallel", "search_mode": mode})
    ms.set_auto_parallel_context(device_num=8, dataset_strategy="full_batch", **kw)
    x, w1, w2 = _r13_data()
    act = ops.Tanh().shard(((1, 1, 1, 2),))
    g = ms.jit(jax.grad(lambda w2, w1, x: _chain(x, w1, w2, act)))(w2, w1, x)
    r = jax.grad(lambda w2, w1, x: _chain(x, w1, w2, jnp.tanh))(w2, w1, x)
    # float32: each dw2 entry sums 8*7*8 = 448 products of order 1 (|dw2| <= 73), reordered by the partitioning
    assert_close(g, r, rtol=1e-4, atol=1e-3)


def test_plain_xla_still_miscompiles_the_width_split_conv_chain():
    """XLA (JAX 0.10) computes a wrong weight gradient for a conv chain whose output is constrained on W."""
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    x, w1, w2 = _r13_data()

    def act(y):
        return jnp.sin(jax.lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, None, None, "a"))))
    g = jax.jit(jax.grad(lambda w2, w1, x: _chain(x, w1, w2, act)))(w2, w1, x)
    assert_xla_still_wrong(g, jax.grad(lambda w2, w1, x: _chain(x, w1, w2, jnp.sin))(w2, w1, x), 1e-2,
                           "a conv's result need not be pinned to its computing layout")


def _r11_loss(x, relu, sl, sq):
    return jnp.sum(sq(sl(relu(x), (0, 2), (4, 3), (1, 2))))


def test_strided_slice_gradient_on_a_split_dim_equals_one_device():
    """r11: the gradient of a stride-2 StridedSlice on a dim an annotated producer splits leaks into the next
    column under plain jax.jit; through mshard (every op pinned) it equals one device."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)
    ops_ = (ops.ReLU().shard(((1, 2),)), ops.StridedSlice(), ops.Square().shard(((1, 1),)))
    g = ms.jit(jax.grad(lambda x: _r11_loss(x, *ops_)))(x)
    plain = (jax.nn.relu, ops.StridedSlice(), jnp.square)
    assert_close(g, jax.grad(lambda x: _r11_loss(x, *plain))(x))       # 4 rows, 1 column: no sums to reorder


def test_plain_xla_still_miscompiles_the_strided_slice_gradient():
    """XLA (JAX 0.10) leaks a strided slice's cotangent into the next column when the sliced dim is split."""
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)), jnp.float32)

    def plain(x):
        x = jax.lax.with_sharding_constraint(jax.nn.relu(x), NamedSharding(mesh, P(None, "a")))
        return jnp.sum(jax.lax.with_sharding_constraint(x[:, 2:3:2], NamedSharding(mesh, P())) ** 2)
    assert_xla_still_wrong(jax.jit(jax.grad(plain))(x), jax.grad(lambda x: jnp.sum(jax.nn.relu(x)[:, 2:3:2] ** 2))(x),
                           1e-5, "a strided slice on a split dim need not be pinned")


STRIDED = [(8, 4, 2, 3), (4, 4, 2, 3), (8, 2, 2, 3), (8, 4, 2, 4), (8, 8, 3, 3)]   # (H, W, kh, kw): the first four
# abort plain jax.jit's gradient on one CPU device; stride 2, pad 1

_CHILD = """
import sys, numpy as np, jax, jax.numpy as jnp
import mshard as ms
from mshard import ops
ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
out = {}
for k, (H, W, kh, kw) in enumerate(%r):
    rng = np.random.default_rng(k)
    x = jnp.asarray(rng.standard_normal((4, 3, H, W)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3, kh, kw)), jnp.float32)
    conv = ops.Conv2D(4, (kh, kw), pad_mode="pad", pad=1, stride=2)
    wo = (W + 2 - kw) // 2 + 1
    act = ops.ReLU().shard(((1, 1, 1, 2),)) if wo %% 2 == 0 else ops.ReLU()
    gx, gw = ms.jit(jax.grad(lambda x, w: jnp.sum(act(conv(x, w)) ** 2), argnums=(0, 1)))(x, w)
    out[f"x{k}"], out[f"w{k}"], out[f"gx{k}"], out[f"gw{k}"] = x, w, gx, gw
np.savez(sys.argv[1], **{k: np.asarray(v) for k, v in out.items()})
"""


def _np_conv_grads(x, w, s=2, p=1):
    """float64 reference: y = conv(x, w) (stride s, pad p), loss = sum(relu(y)^2); -> (dx, dw), by direct sums."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    kh, kw = w.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
    ho, wo = (xp.shape[2] - kh) // s + 1, (xp.shape[3] - kw) // s + 1
    y = np.zeros((x.shape[0], w.shape[0], ho, wo))
    for i in range(ho):
        for j in range(wo):
            y[:, :, i, j] = np.einsum("nckl,ockl->no", xp[:, :, i * s:i * s + kh, j * s:j * s + kw], w)
    dy = 2 * np.maximum(y, 0)
    dxp, dw = np.zeros_like(xp), np.zeros_like(w)
    for i in range(ho):
        for j in range(wo):
            dxp[:, :, i * s:i * s + kh, j * s:j * s + kw] += np.einsum("no,ockl->nckl", dy[:, :, i, j], w)
            dw += np.einsum("nckl,no->ockl", xp[:, :, i * s:i * s + kh, j * s:j * s + kw], dy[:, :, i, j])
    return dxp[:, :, p:-p, p:-p], dw


def test_strided_conv_gradients_do_not_abort_and_equal_a_direct_sum(tmp_path):
    """r2: plain jax.jit aborts the process (XLA CPU algebraic simplifier CHECK) on the input gradient of these strided
    convs, on one device too. ops.Conv2D computes that gradient as the transpose of a stride-1 convolution and a
    strided slice. Run in a subprocess, which must exit 0; the gradients equal a float64 direct sum."""
    import os
    import subprocess
    import sys
    out = tmp_path / "g.npz"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _CHILD % (STRIDED,), str(out)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = np.load(out)
    for k in range(len(STRIDED)):
        dx, dw = _np_conv_grads(got[f"x{k}"], got[f"w{k}"])
        # float32: each gradient entry sums at most 4*3*3*4 = 144 (dw) products of order 1-10, in another order
        np.testing.assert_allclose(got[f"gx{k}"], dx, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got[f"gw{k}"], dw, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("pad_mode", ["same", "valid", "pad"])
def test_strided_conv2d_gradient_equals_jax_where_jax_compiles(pad_mode):
    """The rewritten input gradient agrees with JAX's own on a shape JAX compiles (3x3 kernel, stride 2)."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((4, 3, 9, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 3, 3, 3)), jnp.float32)
    op = ops.Conv2D(4, 3, pad_mode=pad_mode, pad=1, stride=2)
    pad = pad_mode.upper() if pad_mode != "pad" else [(1, 1), (1, 1)]

    def ref(x, w):
        return jnp.sum(jnp.tanh(jax.lax.conv_general_dilated(x, w, (2, 2), pad,
                                                             dimension_numbers=("NCHW", "OIHW", "NCHW"))))
    g = ms.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(op(x, w))), argnums=(0, 1)))(x, w)
    r = jax.grad(ref, argnums=(0, 1))(x, w)
    # float32: 27-term convolutions and their transposes, summed in another order
    assert_close(g, r, rtol=1e-4, atol=1e-4)


def assert_xla_aborts(r, where: str, check: str, then: str) -> None:
    """A workaround's reason still holds: plain XLA aborts (SIGABRT) with its own check failure at ``where``. Any
    other outcome fails: a run that passes means XLA was fixed and ``then``; another error (an import, a timeout, a
    different crash) is not the signal the workaround is for."""
    import signal
    if r.returncode == 0:
        pytest.fail(f"plain XLA no longer aborts here: {then}")
    assert r.returncode == -signal.SIGABRT and where in r.stderr and check in r.stderr, \
        f"not XLA's known abort (exit {r.returncode}):\n{r.stderr[-3000:]}"


def test_plain_xla_still_aborts_on_the_strided_conv_gradient():
    """Why ops.Conv2D writes its own strided input gradient: XLA (JAX 0.10) CPU aborts on the input gradient of a
    (2, 3) kernel, stride 2, pad 1 convolution of a width-4 input."""
    import subprocess
    import sys
    code = ("import jax, jax.numpy as jnp\n"
            "x, w = jnp.ones((2, 3, 8, 4)), jnp.ones((4, 3, 2, 3))\n"
            "c = lambda x: jax.lax.conv_general_dilated(x, w, (2, 2), ((1, 1), (1, 1)), "
            "dimension_numbers=('NCHW', 'OIHW', 'NCHW'))\n"
            "jax.jit(jax.grad(lambda x: jnp.sum(c(x) ** 2)))(x).block_until_ready()\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert_xla_aborts(r, "algebraic_simplifier.cc", "Window dimensions do not match RHS shape",
                      "ops.Conv2D may use XLA's own strided-conv input gradient again")


def test_plain_xla_still_aborts_on_a_partially_manual_gather():
    """Why a pipeline stage's parameters get explicit specs: XLA (JAX 0.10) aborts on a gather inside a shard_map
    manual over one axis when its operand's indexed dim and its indices' batch dim are split over the same Auto
    axis."""
    import subprocess
    import sys
    code = ("import jax, jax.numpy as jnp\n"
            "from jax import lax\n"
            "from jax.sharding import AxisType, PartitionSpec as P\n"
            "mesh = jax.make_mesh((2, 2, 2), ('stage', 'a', 'b'), axis_types=(AxisType.Auto,) * 3)\n"
            "def local(t, i):\n"
            "    t = lax.with_sharding_constraint(t, P('a', None))\n"
            "    i = lax.with_sharding_constraint(i, P('a', None))\n"
            "    return jnp.tanh(t[i]).sum()[None]\n"
            "f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P()), out_specs=P('stage'), "
            "axis_names={'stage'}, check_vma=False))\n"
            "t, i = jnp.arange(64.0).reshape(16, 4) / 64, jnp.arange(16).reshape(2, 8)\n"
            "assert abs(float(f(t, i)[0]) - float(jnp.tanh(t[i]).sum())) < 1e-4\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "JAX_PLATFORMS": "cpu",
                            "XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert_xla_aborts(r, "spmd_partitioner_util.cc", "Check failed: partition_group_list.num_replica_groups()",
                      "a pipeline stage's parameters may be left to XLA's propagation again "
                      "(mshard._src.training.pipeline.cells._param_specs)")


def test_plain_xla_still_miscompiles_the_grouped_conv_weight_gradient():
    """Why ops.Conv2D computes a grouped weight gradient group by group (mshard/_src/frontend/primitive_ops.py::_weight_grad):
    XLA (JAX 0.10) computes it k times too large when the batch is split over one mesh axis and another of size k is
    left whole (here 4x)."""
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    x, w, g = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 4, 6, 6), (4, 2, 3, 3), (2, 4, 4, 4)))

    def loss(w, x):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", feature_group_count=2,
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return jnp.sum(y * g)
    got = jax.jit(jax.grad(loss))(w, jax.device_put(x, NamedSharding(mesh, P("a"))))
    # float32: each kernel entry sums 2 * 4 * 4 = 32 products of order 1
    assert_xla_still_wrong(got, jax.grad(loss)(w, x), 1e-4, "ops.Conv2D may use XLA's own grouped weight gradient")


def test_plain_xla_still_rejects_a_free_pad_constrained_split_on_its_padded_dim():
    """r15: a pad with interior padding of a replicated constant (the gradient of a stride-2 slice of a sum), then
    constrained split 8 ways on the padded dim, fails XLA's HLO verifier under plain jax.jit; the emitter holds such
    a pad whole first (runtime/emit.py), which compiles. When a JAX upgrade compiles it, this fails: lift the guard
    (the fuzzer's seeds 744 and 320993, tests/e2e/fuzz/test_fuzz.py, check mshard's side)."""
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)

    def f(x, whole_first):
        g = jax.lax.with_sharding_constraint(jnp.ones((16, 8), jnp.float32), NamedSharding(mesh, P()))
        p = jax.lax.pad(g, 0.0, [(0, 0, 0), (0, 1, 1)])
        if whole_first:
            p = jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P()))
        p = jax.lax.with_sharding_constraint(p, NamedSharding(mesh, P(None, ("a", "b", "c"))))
        return p.T * x
    x = jnp.ones((16, 16), jnp.float32)
    want = np.zeros((16, 16), np.float32)
    want[::2] = 1.0                            # the ones at every other row of the transposed pad, zeros between
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: f(x, True))(x)), want)
    with pytest.raises(jax.errors.JaxRuntimeError, match="hlo verifier"):
        jax.jit(lambda x: f(x, False))(x)
