"""Checkpoint throughput and memory: ``ms.save_checkpoint`` / ``ms.load_checkpoint`` against raw orbax on the same tree.

    python bench/checkpoint.py [--gb 1.0] [--leaves 4] [--repeats 2] [--out bench/out/checkpoint.json]
    python bench/checkpoint.py --smoke    # 2 MB tree, 1 repeat: that it runs and writes its JSON

The tree: ``--leaves`` float32 leaves of ``--gb`` GB in all, every one split over all devices in a different
layout of a (2, n/2) mesh (no replicated leaf: simulated CPU devices share the host's memory). Three writers, each
timed from the call to the commit on disk (save + wait), best of ``--repeats``:

- ``orbax``: orbax's default (``StandardSave``, OCDBT) through a ``CheckpointManager``;
- ``orbax_files``: orbax with one file per shard (``use_ocdbt=False``), the format mshard uses;
- ``mshard``: ``ms.save_checkpoint`` of an nnx module holding the same arrays (adds the content checksums and the
  metadata); restored with ``ms.load_checkpoint`` (adds verifying them).

Restores read into the saved layouts; ``restore_reshard_s`` restores mshard's checkpoint into another layout of
every leaf. ``ratio_*`` is mshard's time over raw orbax's (the issue asks <= 1.1 against orbax's default).

Memory (``--memory orbax|mshard``, each in a fresh process): one leaf of ``--gb`` / 2 GB saved split over the
devices, restored into another layout by raw orbax (the same files and target) or by ``load_checkpoint``;
``transient_bytes`` is the peak resident memory during the restore beyond the memory before it and the restored
arrays themselves (Linux VmHWM, reset through /proc/self/clear_refs), against the largest shard one device holds
and the process's share of the leaf (a full unsharded copy on the host would add the whole leaf). On simulated
CPU devices the devices' memory is the host's, so the restored shards count here too; on a GPU they do not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import _cpu8  # noqa: F401  (8 simulated CPU devices unless JAX_PLATFORMS says otherwise)
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mshard as ms

SPECS = [P("a", "b"), P("b", None), P(None, "b"), P(("a", "b"), None)]
OTHER = [P("b", "a"), P(None, ("a", "b")), P("a", None), P(None, "a")]


def _mesh():
    n = jax.device_count()
    shape = (2, n // 2) if n % 2 == 0 and n > 1 else (1, n)
    return jax.make_mesh(shape, ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _tree(gb: float, leaves: int, specs, mesh) -> dict:
    rows = max(8, int(gb * 2**30 / 4 / 1024 / leaves) // 8 * 8)
    out = {}
    for i in range(leaves):
        sh = NamedSharding(mesh, specs[i % len(specs)])
        out[f"w{i}"] = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sh)(
            jax.random.key(i))
    jax.block_until_ready(out)
    return out


class Holder(nnx.Module):
    def __init__(self, tree: dict):
        for k, v in tree.items():
            setattr(self, k, nnx.Param(v))


class _Best:
    """Best time per name over the repeats: ``with best("name"): ...``."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        yield
        dt = time.perf_counter() - t
        self.times[name] = min(self.times.get(name, float("inf")), dt)


def _round(root: str, r: int, tree: dict, target: dict, mesh, best: _Best) -> None:
    d = os.path.join(root, f"orbax{r}")
    m = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(create=True))
    with best("save_orbax_s"):
        m.save(0, args=ocp.args.StandardSave(tree))
        m.wait_until_finished()
    with best("restore_orbax_s"):
        jax.block_until_ready(m.restore(0, args=ocp.args.StandardRestore(target)))
    m.close()
    d = os.path.join(root, f"files{r}")
    m = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(create=True),
                              item_handlers=ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    with best("save_orbax_files_s"):
        m.save(0, args=ocp.args.PyTreeSave(tree))
        m.wait_until_finished()
    rargs = ocp.checkpoint_utils.construct_restore_args(target)
    with best("restore_orbax_files_s"):
        jax.block_until_ready(m.restore(0, args=ocp.args.PyTreeRestore(target, restore_args=rargs)))
    m.close()
    d = os.path.join(root, f"mshard{r}")
    holder = Holder(tree)
    with best("save_mshard_s"):
        ms.save_checkpoint(holder, d, step=0).wait()
    with best("restore_mshard_s"):
        ms.load_checkpoint(d, holder)
        jax.block_until_ready(nnx.state(holder))
    other = Holder({k: jax.device_put(v, NamedSharding(mesh, OTHER[i % len(OTHER)]))
                    for i, (k, v) in enumerate(tree.items())})
    with best("restore_reshard_mshard_s"):
        ms.load_checkpoint(d, other)
        jax.block_until_ready(nnx.state(other))
    if not all(np.array_equal(np.asarray(getattr(other, k)[...]), np.asarray(v)) for k, v in tree.items()):
        raise SystemExit("bench/checkpoint.py: the resharded restore differs from the saved values")
    for sub in ("orbax", "files", "mshard"):
        shutil.rmtree(os.path.join(root, f"{sub}{r}"), ignore_errors=True)


def throughput(gb: float, leaves: int, repeats: int) -> dict:
    mesh = _mesh()
    tree = _tree(gb, leaves, SPECS, mesh)
    nbytes = sum(x.nbytes for x in tree.values())
    target = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in tree.items()}
    res = {"bytes": nbytes, "devices": jax.device_count(), "platform": jax.devices()[0].platform, "leaves": leaves}
    root = tempfile.mkdtemp(prefix="mshard-ckpt-bench-")
    best = _Best()
    try:
        for r in range(repeats):
            _round(root, r, tree, target, mesh, best)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    t = best.times
    res.update(t)
    for k in ("save", "restore"):
        res[f"ratio_{k}_vs_orbax"] = t[f"{k}_mshard_s"] / t[f"{k}_orbax_s"]
        res[f"ratio_{k}_vs_orbax_files"] = t[f"{k}_mshard_s"] / t[f"{k}_orbax_files_s"]
    res["save_mshard_GBps"] = nbytes / t["save_mshard_s"] / 1e9
    res["restore_mshard_GBps"] = nbytes / t["restore_mshard_s"] / 1e9
    return res


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _peak_during(fn) -> tuple[int, int, object]:
    """(resident bytes before, peak resident bytes during, result) of ``fn()``."""
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:          # reset VmHWM to the current resident size
        f.write("5")
    before = _status("VmRSS")
    out = fn()
    return before, _status("VmHWM"), out


def memory(gb: float, which: str) -> dict:
    """One restore, by ``which`` (``orbax`` or ``mshard``), in this fresh process (freed memory stays resident
    in the allocator, so each restore is measured in its own process)."""
    mesh = _mesh()
    (x,) = _tree(gb, 1, [P(("a", "b"), None)], mesh).values()
    d = tempfile.mkdtemp(prefix="mshard-ckpt-mem-")
    try:
        ms.save_checkpoint(Holder({"w": x}), d, step=0).wait()
        other = NamedSharding(mesh, P(None, ("a", "b")))
        want = np.asarray(x[:4])
        shard = max(s.data.nbytes for s in x.addressable_shards)
        local = sum(s.data.nbytes for s in x.addressable_shards)
        nbytes = int(x.nbytes)
        del x
        tgt = {"w": jax.ShapeDtypeStruct((nbytes // 4 // 1024, 1024), jnp.float32, sharding=other)}
        if which == "orbax":          # raw orbax, the same files into the same target layout
            m = ocp.CheckpointManager(d, item_handlers={"state": ocp.PyTreeCheckpointHandler(use_ocdbt=False)})
            args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
                tgt, restore_args=ocp.checkpoint_utils.construct_restore_args(tgt)))
            before, peak, out = _peak_during(lambda: jax.block_until_ready(m.restore(0, args=args)["state"]))
            got = out["w"]
        else:
            target = Holder({"w": jax.device_put(jnp.zeros(tgt["w"].shape, jnp.float32), other)})
            before, peak, _ = _peak_during(lambda: (ms.load_checkpoint(d, target), jax.block_until_ready(target.w[...])))
            got = target.w[...]
        assert np.array_equal(np.asarray(got[:4]), want)
        transient = peak - before - local
        return {"which": which, "leaf_bytes": nbytes, "largest_shard_bytes": int(shard), "process_bytes": int(local),
                "transient_bytes": int(transient), "transient_over_largest_shard": transient / shard,
                "transient_over_process_share": transient / local,
                "platform": jax.devices()[0].platform, "devices": jax.device_count()}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--leaves", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--memory", choices=("orbax", "mshard"), help="only one memory probe (run in a fresh process)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "checkpoint.json"))
    ap.add_argument("--smoke", action="store_true", help="a 2 MB tree, 1 repeat: checks that it runs")
    a = ap.parse_args()
    if a.smoke:
        a.gb, a.repeats = 2 / 1024, 1
    if a.memory:
        print(json.dumps(memory(a.gb, a.memory)))
        return
    res = {"throughput": throughput(a.gb, a.leaves, a.repeats), "memory": {}}
    for which in ("orbax", "mshard"):
        mem = subprocess.run([sys.executable, __file__, "--memory", which, "--gb", str(a.gb / 2)], capture_output=True,
                             text=True, env=os.environ.copy())
        if mem.returncode:
            raise SystemExit(f"memory probe failed:\n{mem.stderr[-3000:]}")
        res["memory"][which] = json.loads(mem.stdout.strip().splitlines()[-1])
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
