"""Gradient fusion in every mode: one training step of a small GPT with and without ``all_reduce_fusion_config``.

    .venv/bin/python bench/fusion.py                  # table + bench/out/fusion.json
    .venv/bin/python bench/fusion.py --repeats 3      # fewer timing repeats
    .venv/bin/python bench/fusion.py --smoke          # tiny GPT, 1 repeat of 1 step, semi_auto Megatron
                                                      # only: that it runs and writes its JSON

For each setting (semi_auto_parallel with Megatron strategies, auto_parallel with each searcher, with and
without the Megatron strategies) the step is built twice on 8 simulated CPU devices: without a fusion setting
(XLA places the gradient reductions and its combiner merges them) and with ``all_reduce_fusion_config`` cutting
the gradients into three buckets (per-replica gradients, one all-reduce per bucket over the data-parallel
replicas). Reported from the compiled HLO (``ms.comm_report``): the number of collectives, the bytes each device
moves (ring estimates), the all-reduces over the replica groups; the parameters after one SGD step (lr 0.1) from the
same start (max abs difference between the two steps); and the step time ratio fused / unfused (median over
interleaved repeats; a benchmark on a shared machine, not a test).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported
import jax
import numpy as np
from flax import nnx

import mshard as ms
from mshard._src.values.layout import jax_mesh

CFG = dict(vocab=256, hidden=128, heads=4, ffn=512, seq=32, layers=2)
SMOKE_CFG = dict(vocab=64, hidden=32, heads=4, ffn=64, seq=8, layers=1)
BATCH = 16
SETTINGS = [("semi_auto_parallel", None, True), ("auto_parallel", "sharding_propagation", True),
            ("auto_parallel", "dynamic_programming", True), ("auto_parallel", "recursive_programming", True),
            ("auto_parallel", "sharding_propagation", False)]


def data():
    t = np.random.default_rng(0).integers(0, CFG["vocab"], size=(BATCH, CFG["seq"] + 1)).astype(np.int32)
    return t[:, :-1], t[:, 1:]


def build(mode, search, megatron, fused):
    ms.reset_auto_parallel_context()
    ctx = dict(parallel_mode=mode, device_num=8, gradients_mean=True)
    if search:
        ctx["search_mode"] = search
    net, step = _cpu8.gpt_step(CFG, megatron)
    n_params = len(jax.tree.leaves(nnx.state(net, nnx.Param)))
    if fused:
        ctx["all_reduce_fusion_config"] = [n_params // 3, 2 * n_params // 3]
    ms.set_auto_parallel_context(**ctx)
    return net, step


def replica_groups(step) -> set[frozenset[int]]:
    """The data-parallel replica groups of a fused step (devices that differ only along its replica axes)."""
    plan = step._rt.last
    mesh = jax_mesh(plan.mesh)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    over = [mesh.axis_names.index(a) for a in plan.replicas]
    keep = [i for i in range(ids.ndim) if i not in over]
    size = int(np.prod([ids.shape[i] for i in over]))
    return {frozenset(int(x) for x in row) for row in ids.transpose(keep + over).reshape(-1, size)}


def timed(step, batch, steps=5):
    jax.block_until_ready(step(*batch))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = step(*batch)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(_cpu8.ROOT / "bench" / "out" / "fusion.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="tiny GPT, 1 repeat of 1 step, the first setting only: checks that it runs")
    args = ap.parse_args(argv)
    steps_per_timing = 5
    if args.smoke:
        CFG.update(SMOKE_CFG)
        args.repeats, steps_per_timing = 1, 1
    settings = [SETTINGS[0]] if args.smoke else SETTINGS
    batch = data()
    rows = []
    for mode, search, megatron in settings:
        ctx_name = f"{mode}{'/' + search if search else ''}{' + megatron' if megatron else ''}"
        steps, reports, params = {}, {}, {}
        for fused in (False, True):
            net, step = build(mode, search, megatron, fused)
            step(*batch)                                   # one step from the same start
            params[fused] = [np.asarray(x) for x in jax.tree.leaves(nnx.state(net, nnx.Param))]
            reports[fused] = ms.comm_report(step, *batch)
            steps[fused] = (step, ms.get_auto_parallel_context("all_reduce_fusion_config"))
        groups = replica_groups(steps[True][0])
        times = {False: [], True: []}
        for _ in range(args.repeats):                      # interleaved; each step under its own context
            for fused in (False, True):
                ms.set_auto_parallel_context(all_reduce_fusion_config=steps[fused][1])
                times[fused].append(timed(steps[fused][0], batch, steps_per_timing))
        ratios = [f / u for f, u in zip(times[True], times[False])]
        row = {"setting": ctx_name, "replicas": len(next(iter(groups))),
               "fusion_config": steps[True][1]}
        for fused, tag in ((False, "xla"), (True, "fused")):
            rep = reports[fused]
            row[tag] = {"collectives": rep.total_count, "moved_bytes": int(sum(c.moved for c in rep.collectives)),
                        "replica_all_reduces": sum(c.kind == "all-reduce" and {frozenset(g) for g in c.groups} == groups
                                                   for c in rep.collectives),
                        "step_ms": 1e3 * float(np.median(times[fused]))}
        row["max_param_diff"] = float(max(np.max(np.abs(a - b)) for a, b in zip(params[False], params[True])))
        row["time_ratio_median"] = float(np.median(ratios))
        rows.append(row)
        print(f"{ctx_name:55s} replicas {row['replicas']}  collectives {row['xla']['collectives']:3d} -> "
              f"{row['fused']['collectives']:3d}  moved {row['xla']['moved_bytes']:>9,} -> {row['fused']['moved_bytes']:>9,} B"
              f"  replica all-reduces {row['xla']['replica_all_reduces']} -> {row['fused']['replica_all_reduces']}"
              f"  param diff {row['max_param_diff']:.1e}  time fused/xla {row['time_ratio_median']:.3f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": {**CFG, "batch": BATCH}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
