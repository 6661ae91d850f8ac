"""Per-device memory and bytes moved per training step of a GPT, for each way of laying it out (issue 39).

    python bench/memory.py                 # the "small" GPT (4 blocks, hidden 128), 8 simulated CPU devices
    python bench/memory.py --size medium
    python bench/memory.py --smoke         # the 1-block smoke GPT, 3 layouts: that it runs and writes its JSON
    python bench/memory.py --size wide --recompute   # 8 wide blocks, each recomputed (level3's per-layer gathers)

Rows, each one TrainOneStepCell (AdamW) of bench/step.py's GPT:

- ``data_parallel``: the baseline every ratio divides by;
- ``megatron``: semi_auto, each block's Megatron strategies over dp 2 x mp n/2;
- ``zero_level1`` / ``zero_level2`` / ``zero_level3``: data parallel with ``enable_parallel_optimizer`` at MindSpore's
  optimizer levels (level3 stores the weights sharded too: FSDP);
- ``fsdp_x_tp``: Megatron with optimizer level3 (weights sharded over the data-parallel axis as well);
- ``offload``: data parallel with ``set_offload_context(offload_config={"offload_param": "cpu"})``: the optimizer
  state waits in host memory (``pinned_host``) between steps.

Columns, per device: ``params`` and ``opt_state`` (the stored arrays' shard shapes after a step, device memory only:
an offloaded state counts under ``opt_state_host``), ``arguments`` and
``temp`` (the compiled step's ``memory_analysis``; gradients live in temp), and ``moved`` (bytes of every collective
in the compiled HLO, mshard's ring estimate: ``ms.comm_report``). ``ratio_*``: each against data parallel. On CPU the
numbers are XLA:CPU's buffer assignment for 8 simulated devices: the arrays' sizes are exact, temp is XLA:CPU's (a
GPU's scheduler can differ), XLA:CPU's ``arguments`` counts host-memory arguments too (one RAM), and nothing here
is timed.

The JSON (``--out``, default ``bench/out/memory.json``) holds ``config``, ``rows`` (one dict per layout) and
``summary`` (the ratios by row).
"""

import argparse
import json
from pathlib import Path

import _cpu8  # noqa: F401  first: 8 simulated CPU devices before JAX is imported, quiet XLA, paths
import jax
from flax import nnx
from step import SIZES, batch, make_step, per_device_bytes

import mshard as ms

LAYOUTS = {
    "data_parallel": dict(mode="data_parallel"),
    "megatron": dict(mode="semi_auto_parallel", megatron=True),
    "zero_level1": dict(mode="data_parallel", zero=True, level="level1"),
    "zero_level2": dict(mode="data_parallel", zero=True, level="level2"),
    "zero_level3": dict(mode="data_parallel", zero=True, level="level3"),
    "fsdp_x_tp": dict(mode="semi_auto_parallel", megatron=True, zero=True, level="level3"),
    "offload": dict(mode="data_parallel", offload=True),
}
COLUMNS = ("params", "opt_state", "arguments", "temp", "moved")


def _split_by_memory(tree):
    """(bytes per device in device memory, in host memory) of a tree of arrays."""
    dev = [x for x in jax.tree.leaves(tree) if x.sharding.memory_kind in (None, "device")]
    host = [x for x in jax.tree.leaves(tree) if x.sharding.memory_kind not in (None, "device")]
    return per_device_bytes(dev), per_device_bytes(host)


def measure(cfg, n, mode, offload=False, recompute=False, **kw):
    """One step of the layout: its stored bytes per device, its compiled memory and its collectives."""
    step = make_step(cfg, mode, n, recompute=recompute, **kw)
    ms.set_offload_context(offload_config={"offload_param": "cpu" if offload else ""})
    data = ms.dataset.shard_batch(batch(cfg))
    step(*data)
    mem = step.lower(*data).compile().memory_analysis()
    rep = ms.comm_report(step, *data)
    opt_dev, opt_host = _split_by_memory(step.opt_state)
    ms.reset_auto_parallel_context()
    return {"params": per_device_bytes(nnx.state(step.network, nnx.Param)),
            "opt_state": opt_dev, "opt_state_host": opt_host,
            "arguments": int(mem.argument_size_in_bytes), "temp": int(mem.temp_size_in_bytes),
            "moved": int(sum(rep.moved(k) for k in rep.by_kind)),
            "collectives": {k: rep.count(k) for k in rep.by_kind}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "memory.json"))
    ap.add_argument("--smoke", action="store_true", help="the 1-block smoke GPT: checks that it runs")
    ap.add_argument("--recompute", action="store_true", help="every block recomputed in the backward")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size = "smoke"
    cfg, n = SIZES[args.size], jax.device_count()
    rows = []
    # the smoke: data parallel and the two layouts that compose the most paths (the others are tests' own:
    # test_train_memory, test_fsdp_compositions, test_offload)
    layouts = {k: v for k, v in LAYOUTS.items() if not args.smoke or k in ("data_parallel", "fsdp_x_tp", "offload")}
    for name, kw in layouts.items():
        row = {"layout": name, **measure(cfg, n, recompute=args.recompute, **kw)}
        rows.append(row)
        print(f"{name:14s} " + "  ".join(f"{c} {row[c]:>11,}" for c in COLUMNS), flush=True)
    base = rows[0]
    summary = {}
    for row in rows:
        for c in COLUMNS:
            row[f"ratio_{c}"] = row[c] / base[c] if base[c] else None
        summary[row["layout"]] = {c: row[f"ratio_{c}"] for c in COLUMNS}
    print("\nagainst data parallel:")
    for name, r in summary.items():
        print(f"{name:14s} " + "  ".join(f"{c} {'-' if v is None else f'{v:.3f}'}" for c, v in r.items()))
    config = {**cfg, "recompute": args.recompute, "devices": n, "platform": jax.devices()[0].platform}
    out = {"config": config, "rows": rows, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
