"""Distributed checkpoints (issue 17): save sharded, load into any strategy or device count, bit-exact resume,
never load corrupt data."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from train_helpers import MLP, batches, mse

import mshard as ms
from mshard import nn
from mshard._src.edges.checkpoint.leaves import leaves_of
from mshard._src.edges.checkpoint.store import steps as store_steps
from mshard.errors import CheckpointError


def _values(obj):
    """Every variable of ``obj`` on the host, by name (RNG keys as their key data)."""
    return {lf.name: np.asarray(jax.device_get(lf.value)) for lf in leaves_of(obj)}


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def _mlp_step(mode, seed=0, dropout=0.0, zero=False):
    kw = {"device_num": 8, "enable_parallel_optimizer": zero}
    if mode == "megatron":
        ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", **kw)
        net = MLP(nnx.Rngs(seed), dropout=dropout).megatron(2, 4)
    else:
        ms.set_auto_parallel_context(parallel_mode=mode, **kw)
        net = MLP(nnx.Rngs(seed), dropout=dropout)
    return nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.adamw(1e-2))


DATA = batches(4, [(32, 16), (32, 8)], seed=3)


@pytest.mark.parametrize("mode,zero,dropout", [("data_parallel", False, 0.1), ("megatron", False, 0.0),
                                              ("data_parallel", True, 0.0), ("megatron", True, 0.0)])
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, mode, zero, dropout):
    step = _mlp_step(mode, dropout=dropout, zero=zero)
    losses = [float(step(*b)) for b in DATA]
    # the same run stopped after 2 steps, saved, and resumed in fresh objects (another initialisation)
    first = _mlp_step(mode, dropout=dropout, zero=zero)
    part = [float(first(*b)) for b in DATA[:2]]
    h = ms.save_checkpoint(first, tmp_path, metadata={"epoch": 0})
    assert h.wait().step == 2                               # the optimizer's step count
    resumed = _mlp_step(mode, seed=7, dropout=dropout, zero=zero)
    r = ms.load_checkpoint(tmp_path, resumed, inputs=DATA[0])
    assert (r.step, r.metadata, r.param_not_load, r.ckpt_not_load) == (2, {"epoch": 0}, [], [])
    _assert_same(_values(resumed), _values(first))
    part += [float(resumed(*b)) for b in DATA[2:]]
    assert part == losses                                   # bit-identical, not close
    assert int(resumed.optimizer.step[...]) == 4


def test_load_reshards_between_strategies_and_device_counts(tmp_path):
    """dp x mp 2x4 with optimizer parallel -> data parallel on 8 -> 4 devices -> one device: the same values."""
    src = _mlp_step("megatron", zero=True)
    for b in DATA[:2]:
        src(*b)
    ms.save_checkpoint(src, tmp_path).wait()
    want = _values(src)
    saved = json.loads((tmp_path / "2" / "mshard" / "metadata").read_text())
    assert saved["leaves"]["network.backbone.fc1.weight"]["layout"]["spec"] != [None, None]  # really split
    dp8 = _mlp_step("data_parallel")
    ms.load_checkpoint(tmp_path, dp8, inputs=DATA[0])
    _assert_same(_values(dp8), want)
    w = dp8.network.backbone.fc1.weight[...]
    assert isinstance(w.sharding, NamedSharding) and len(w.sharding.device_set) == 8
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=4)
    dp4 = nn.TrainOneStepCell(nn.WithLossCell(MLP(nnx.Rngs(1)).megatron(2, 2), mse), optax.adamw(1e-2))
    ms.load_checkpoint(tmp_path, dp4, inputs=DATA[0])
    _assert_same(_values(dp4), want)
    assert len(dp4.network.backbone.fc1.weight[...].sharding.device_set) == 4
    # the bare network, on one device, from the training checkpoint: its weights only, optimizer state reported
    one = MLP(nnx.Rngs(5))
    r = ms.load_checkpoint(tmp_path, one)
    assert r.param_not_load == [] and any(n.startswith("optimizer.") for n in r.ckpt_not_load)
    for lf in leaves_of(one):
        assert np.array_equal(np.asarray(lf.value), want["network.backbone." + lf.name]), lf.name


def test_differences_are_listed_and_strict_false_loads_the_intersection(tmp_path):
    ms.save_checkpoint(MLP(nnx.Rngs(0)), tmp_path).wait()
    other = MLP(nnx.Rngs(1), hidden=32)
    with pytest.raises(CheckpointError) as e:
        ms.load_checkpoint(tmp_path, other)
    msg = str(e.value)
    for line in ("fc1.weight: shape (32, 16) here, (64, 16) in the checkpoint",
                 "fc2.weight: shape (32, 32) here, (64, 64) in the checkpoint",
                 "fc3.weight: shape (8, 32) here, (8, 64) in the checkpoint", "strict=False"):
        assert line in msg, msg
    assert "fc3.bias" not in msg
    before = _values(other)
    r = ms.load_checkpoint(tmp_path, other, strict=False)
    after = _values(other)
    fc3_bias = "fc3.bias"
    assert fc3_bias not in r.param_not_load                  # same shape (8,): loaded
    assert np.array_equal(after[fc3_bias], np.asarray(MLP(nnx.Rngs(0)).fc3.bias[...]))
    assert sorted(r.param_not_load) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight", "fc3.weight"]
    for n in r.param_not_load:
        assert np.array_equal(after[n], before[n])           # untouched


def test_strict_false_with_no_leaf_in_common_loads_nothing_and_says_so(tmp_path):
    """Every leaf differs in shape: strict=False lists them all as not loaded and leaves them as they were. It used
    to hand orbax an empty restore and report the checkpoint as damaged."""
    ms.save_checkpoint(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), tmp_path).wait()
    other = nnx.Linear(4, 16, rngs=nnx.Rngs(1))
    before = {n: np.asarray(v) for n, v in _values(other).items()}
    r = ms.load_checkpoint(tmp_path, other, strict=False)
    assert sorted(r.param_not_load) == ["bias", "kernel"]
    for n, v in _values(other).items():
        assert np.array_equal(np.asarray(v), before[n]), n


def _corrupt_target(tmp_path):
    net = MLP(nnx.Rngs(0))
    net.fc2.matmul.shard(((2, 4), (1, 4)))
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    net.shard(in_strategy=((2, 1),))
    net(jnp.asarray(DATA[0][0]))                  # run once: the weights are stored in the plan's layouts
    assert len(net.fc2.weight[...].sharding.device_set) == 8
    ms.save_checkpoint(net, tmp_path).wait()
    return "fc2.weight"


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_damaged_files_raise_and_load_nothing(tmp_path, damage):
    leaf = _corrupt_target(tmp_path)
    files = sorted(p for p in (tmp_path / "0" / "state" / leaf).iterdir() if not p.name.startswith("."))
    victim = files[len(files) // 2]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        victim.unlink()
    target = MLP(nnx.Rngs(9))
    before = _values(target)
    with pytest.raises(CheckpointError) as e:
        ms.load_checkpoint(tmp_path, target)
    msg = str(e.value)
    assert leaf in msg and str(tmp_path / "0" / "state" / leaf) in msg, msg
    assert victim.name in msg, msg
    _assert_same(_values(target), before)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    script = f"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax.numpy as jnp
from flax import nnx
import mshard as ms
class Big(nnx.Module):
    def __init__(self, n):
        self.w = nnx.Param(jnp.full((n, 1024), 1.5, jnp.float32))
mgr = ms.CheckpointManager({str(tmp_path)!r}, ms.CheckpointConfig(keep_checkpoint_max=1, async_save=True))
mgr.save(Big(16), step=1).wait()
print("saved 1", flush=True)
mgr.save(Big(1 << 16), step=2)          # 256 MB, asynchronous; keeping 1 step, step 1 goes once step 2 commits
print("saving 2", flush=True)
import time; time.sleep(60)
"""
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "saved 1"
        assert p.stdout.readline().strip() == "saving 2"
        p.kill()
        p.wait(30)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(30)
        p.stdout.close()
    assert store_steps(str(tmp_path)) == [1]
    with pytest.raises(CheckpointError, match="step 2 is not a committed checkpoint"):
        ms.load_checkpoint(tmp_path, nnx.Module(), step=2)

    class Big(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((16, 1024), jnp.float32))
    b = Big()
    assert ms.load_checkpoint(tmp_path, b).step == 1
    assert float(b.w[...].min()) == 1.5 == float(b.w[...].max())


_EXIT_AFTER_ASYNC_SAVE = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax.numpy as jnp
from flax import nnx
import mshard as ms
class Big(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(1 << 22, dtype=jnp.float32).reshape(1 << 12, 1 << 10))   # 16 MB
        self.b = nnx.Param(jnp.arange(7, dtype=jnp.float32) * 0.25 - 1.0)   # exact in float32
d = sys.argv[1]
ms.save_checkpoint(Big(), os.path.join(d, "fn"), step=1, async_save=True)
ms.CheckpointManager(os.path.join(d, "mgr"), ms.CheckpointConfig(async_save=True)).save(Big(), step=3)
print("returned", flush=True)
"""


def test_a_script_that_ends_right_after_an_async_save_keeps_its_checkpoint(tmp_path):
    """The script returns from both async saves and ends at once: the interpreter's exit commits them (orbax's
    background commit needs thread pools that Python shuts down before ``atexit`` hooks run)."""
    r = subprocess.run([sys.executable, "-c", _EXIT_AFTER_ASYNC_SAVE, str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "returned", r.stderr[-2000:]
    assert "cannot schedule new futures" not in r.stderr and "did not commit" not in r.stderr, r.stderr[-2000:]

    class Big(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros((1 << 12, 1 << 10), jnp.float32))
            self.b = nnx.Param(jnp.zeros((7,), jnp.float32))
    for sub, step in (("fn", 1), ("mgr", 3)):
        b = Big()
        assert ms.load_checkpoint(tmp_path / sub, b).step == step          # loaded by this (another) process
        np.testing.assert_array_equal(np.asarray(b.w[...]), np.arange(1 << 22, dtype=np.float32).reshape(4096, 1024))
        np.testing.assert_array_equal(np.asarray(b.b[...]), np.arange(7, dtype=np.float32) * 0.25 - 1.0)


def _committed_on_disk(d, step):
    """Orbax's commit marker, read from the file system (not through ``store.steps``, which waits for saves)."""
    return (pathlib.Path(d) / str(step) / "state" / "commit_success.txt").is_file()


def test_save_is_synchronous_by_default_and_a_load_waits_for_a_save_in_flight(tmp_path):
    net = nnx.Linear(256, 512, rngs=nnx.Rngs(0))
    ms.save_checkpoint(net, tmp_path / "sync", step=1)                # MindSpore's default: committed on return
    assert _committed_on_disk(tmp_path / "sync", 1)
    mgr = ms.CheckpointManager(tmp_path / "mgr")
    mgr.save(net, step=1)
    assert _committed_on_disk(tmp_path / "mgr", 1)
    ms.save_checkpoint(net, tmp_path / "async", step=5, async_save=True)
    other = nnx.Linear(256, 512, rngs=nnx.Rngs(1))                    # another init: the load must change it
    assert ms.load_checkpoint(tmp_path / "async", other).step == 5    # waits for the save in flight
    _assert_same(_values(net), _values(other))
    ms.save_checkpoint(net, tmp_path / "async", step=6, async_save=True)
    ms.save_checkpoint(net, tmp_path / "async", async_save=True)      # default step: one past the last, 6 included
    assert store_steps(str(tmp_path / "async")) == [5, 6, 7]


def test_manager_keeps_the_last_n_and_refuses_to_overwrite(tmp_path):
    mgr = ms.CheckpointManager(tmp_path, ms.CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=2,
                                                             append_info={"run": "a"}))
    net = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    saved = [s for s in range(1, 9) if mgr.step_end(net, s) is not None]
    assert saved == [2, 4, 6, 8]
    assert mgr.wait().all_steps() == [6, 8] and mgr.latest_step() == 8
    assert mgr.restore(nnx.Linear(4, 4, rngs=nnx.Rngs(1))).metadata == {"run": "a"}
    with pytest.raises(CheckpointError, match="already exists"):
        ms.save_checkpoint(net, tmp_path, step=8)
    with pytest.raises(ms.errors.CheckpointTypeError, match="positive int"):
        ms.CheckpointConfig(keep_checkpoint_max=0)


def test_transform_checkpoints_to_another_strategy_file(tmp_path):
    """2x4 Megatron with its strategy file -> the 8-way data-parallel strategy file -> loads equal."""
    src_plan, dst_plan = tmp_path / "src.json", tmp_path / "dst.json"
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                                 strategy_ckpt_config={"save_file": str(src_plan)})
    step = nn.TrainOneStepCell(nn.WithLossCell(MLP(nnx.Rngs(0)).megatron(2, 4), mse), optax.adamw(1e-2))
    step(*DATA[0])
    ms.save_checkpoint(step, tmp_path / "a").wait()
    ms.set_auto_parallel_context(strategy_ckpt_config={"save_file": str(dst_plan)})
    other = nn.TrainOneStepCell(nn.WithLossCell(MLP(nnx.Rngs(0)).megatron(8, 1), mse), optax.adamw(1e-2))
    other.plan(*DATA[0])
    assert dst_plan.exists()
    with pytest.raises(CheckpointError, match="was not saved with"):
        ms.checkpoint.transform_checkpoints(tmp_path / "a", tmp_path / "bad", "checkpoint_", dst_plan, dst_plan)
    assert ms.transform_checkpoints(tmp_path / "a", tmp_path / "b", "checkpoint_", src_plan, dst_plan) == 1
    meta = json.loads((tmp_path / "b" / "1" / "mshard" / "metadata").read_text())
    src_meta = json.loads((tmp_path / "a" / "1" / "mshard" / "metadata").read_text())
    name = "network.backbone.fc1.weight"
    assert meta["leaves"][name]["layout"] != src_meta["leaves"][name]["layout"]
    fresh = nn.TrainOneStepCell(nn.WithLossCell(MLP(nnx.Rngs(4)), mse), optax.adamw(1e-2))
    ms.load_checkpoint(tmp_path / "b", fresh)
    _assert_same(_values(fresh), _values(step))


def test_infer_predict_layout_and_load_distributed_checkpoint(tmp_path):
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    train = nn.TrainOneStepCell(nn.WithLossCell(MLP(nnx.Rngs(0)).megatron(2, 4), mse), optax.adamw(1e-2))
    train(*DATA[0])
    ms.save_checkpoint(train, tmp_path).wait()
    net = MLP(nnx.Rngs(3))
    net.fc1.matmul.shard(((1, 1), (8, 1)))               # inference: fc1 split 8 ways on its output
    net.shard(in_strategy=((1, 1),))
    x = jnp.asarray(DATA[1][0])
    lay = ms.infer_predict_layout(net, x)
    assert len(lay["fc1.weight"].device_set) == 8 and lay["fc1.weight"].spec[0] is not None
    r = ms.load_distributed_checkpoint(net, tmp_path, predict_strategy=lay)
    assert r.param_not_load == []
    assert net.fc1.weight[...].sharding.is_equivalent_to(lay["fc1.weight"], 2)
    ref = MLP(nnx.Rngs(8))
    ms.load_checkpoint(tmp_path, ref)
    np.testing.assert_allclose(np.asarray(net(x)), np.asarray(ref(x)), rtol=1e-6, atol=1e-6)


def test_mindspore_parameter_dict_holds_every_saved_leaf_and_loads_into_any_layout(tmp_path):
    """``ms.load_checkpoint(dir)`` without an object is MindSpore's parameter dict: every saved leaf (parameters,
    Adam's moments, the step count) equal to what was saved; ``ms.load_param_into_net`` writes it into a network
    that keeps its own layout, and says what it did not load."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    train = nn.TrainOneStepCell(nn.WithLossCell(MLP(nnx.Rngs(0)).megatron(2, 4), mse), optax.adamw(1e-2))
    train(*DATA[0])
    ms.save_checkpoint(train, tmp_path).wait()
    saved = _values(train)
    d = ms.load_checkpoint(tmp_path)
    assert isinstance(d, ms.checkpoint.ParamDict) and d.step == 1
    assert sorted(d) == sorted(saved)
    for k, x in d.items():
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        assert np.array_equal(np.asarray(x), saved[k]), k
    net = MLP(nnx.Rngs(5))
    net.fc1.matmul.shard(((1, 1), (8, 1)))
    net.shard(in_strategy=((1, 1),))
    x = jnp.asarray(DATA[1][0])
    lay = ms.infer_predict_layout(net, x)
    ms.load_checkpoint(tmp_path, net, layouts=lay, strict=False)           # placed in the predict layout
    for _, v in nnx.iter_graph(net):
        if isinstance(v, nnx.Param):
            v[...] = jnp.zeros_like(v[...])                                 # in place: the layout stays
    not_loaded, unused = ms.load_param_into_net(net, d)
    assert not_loaded == [] and all(k.startswith("optimizer.") for k in unused) and unused
    assert net.fc1.weight[...].sharding.is_equivalent_to(lay["fc1.weight"], 2)
    for name, value in _values(net).items():
        assert np.array_equal(value, saved["network.backbone." + name]), name
    with pytest.raises(CheckpointError, match="strict_load=False"):
        ms.load_param_into_net(MLP(nnx.Rngs(1)), {"fc1.weight": d["network.backbone.fc1.weight"]}, strict_load=True)
    with pytest.raises(TypeError, match="one directory"):
        ms.load_distributed_checkpoint(net, [tmp_path, tmp_path / "other"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool", "uint32"])
def test_checksum_does_not_depend_on_the_layout_and_sees_one_flipped_bit(dtype):
    from jax.sharding import PartitionSpec as P

    from mshard._src.edges.checkpoint.checksum import CHUNK, block_sums, total
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    rows = 2 * CHUNK // 1024 + 8              # a shard of more than one slice, and a remainder slice
    host = (rng.normal(size=(rows, 1024)) * 100).astype(dtype) if dtype != "bool" else rng.random((rows, 1024)) > 0.5
    layouts = [jax.devices()[3], *[NamedSharding(mesh, s) for s in (P("a"), P(None, "b"), P(("a", "b")), P(),
                                                                     P("b", "a"))]]
    xs = [jax.device_put(host, lay) for lay in layouts]
    whole = [total(s) for s in block_sums(xs, [(1, 1)] * len(xs))]
    assert all(np.array_equal(w, whole[0]) for w in whole)
    # per block of a (2, 4) grid: a layout whose shards are the blocks, and layouts whose shards straddle them
    grid = [b.reshape(-1, 2) for b in block_sums(xs, [(2, 4)] * len(xs))]
    assert all(np.array_equal(g, grid[0]) for g in grid)
    assert np.array_equal(total(grid[0]), whole[0])
    flipped = np.array(host)
    v = flipped.view(np.uint8) if dtype != "bool" else None
    if v is not None:
        v.reshape(-1)[v.size // 3] ^= 4                 # one bit of one element
    else:
        flipped[rows // 3, 7] = not flipped[rows // 3, 7]
    (f,) = block_sums([jax.device_put(flipped, layouts[1])], [(2, 4)])
    diff = [i for i in range(8) if not np.array_equal(f.reshape(-1, 2)[i], grid[0][i])]
    assert len(diff) == 1 and not np.array_equal(total(f), whole[0])
