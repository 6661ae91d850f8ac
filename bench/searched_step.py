"""Communication of searched training steps against the user's strategies alone.

    .venv/bin/python bench/searched_step.py            # table + bench/out/searched_step.json

One training step (SGD) of a 1-layer GPT with ``shard_megatron(2, 4)`` on 8 simulated CPU devices: planned
from the strategies alone (semi_auto_parallel) and by each searcher in auto_parallel with the same strategies
fixed, with fully_use_devices False and True. For each: the collectives of the compiled step and the bytes
each device moves (``ms.comm_report``, ring estimates), with the held-state second search
(:mod:`mshard.planner`: updated state tied to its stored layout) and without it (``once``: the first search's
plan, as before that change). sharding_propagation never runs the second search.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported
import numpy as np

import mshard as ms
from mshard import planner

CFG = dict(vocab=64, hidden=64, heads=4, ffn=128, seq=16, layers=1)
BATCH = 16
SEARCHERS = ("dynamic_programming", "ilp", "recursive_programming", "sharding_propagation")


def measure(mode, search=None):
    t = np.random.default_rng(0).integers(0, CFG["vocab"], size=(BATCH, CFG["seq"] + 1)).astype(np.int32)
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(parallel_mode=mode, device_num=8, gradients_mean=True,
                                 **({"search_mode": search} if search else {}))
    _, step = _cpu8.gpt_step(CFG)
    rep = ms.comm_report(step, t[:, :-1], t[:, 1:])
    return {"collectives": rep.total_count, "moved_bytes": int(sum(c.moved for c in rep.collectives))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--searchers", default=",".join(SEARCHERS))
    ap.add_argument("--out", default=str(_cpu8.ROOT / "bench" / "out" / "searched_step.json"))
    args = ap.parse_args(argv)
    hold = planner._hold_state
    rows = []
    for fully in (False, True):
        ms.reset_algo_parameters()
        ms.set_algo_parameters(fully_use_devices=fully)
        semi = measure("semi_auto_parallel")
        print(f"fully_use_devices={fully}: semi_auto (strategies alone) {semi['collectives']} collectives, "
              f"{semi['moved_bytes']:,} B moved", flush=True)
        for name in args.searchers.split(","):
            row = {"fully_use_devices": fully, "searcher": name, "semi_auto": semi}
            for tag, fn in (("held", hold), ("once", lambda graph, strategies: False)):
                planner._hold_state = fn
                try:
                    row[tag] = measure("auto_parallel", name)
                finally:
                    planner._hold_state = hold
            rows.append(row)
            print(f"  {name:22s} once {row['once']['collectives']:4d} / {row['once']['moved_bytes']:>9,} B   "
                  f"held {row['held']['collectives']:4d} / {row['held']['moved_bytes']:>9,} B   "
                  f"held / semi_auto bytes {row['held']['moved_bytes'] / semi['moved_bytes']:.2f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": {**CFG, "batch": BATCH}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
