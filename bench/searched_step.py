"""Communication of searched training steps against the user's strategies alone.

    .venv/bin/python bench/searched_step.py            # table + bench/out/searched_step.json (--out PATH)
    .venv/bin/python bench/searched_step.py --smoke    # fully_use_devices=False, dynamic_programming: that it runs

One training step (SGD) of a 1-layer GPT with ``shard_megatron(2, 4)`` on 8 simulated CPU devices: planned
from the strategies alone (semi_auto_parallel) and by each searcher in auto_parallel with the same strategies
fixed, with fully_use_devices False and True. For each: the collectives of the compiled step, the bytes each
device moves (``ms.comm_report``, ring estimates) and the search seconds (``plan.seconds``), in these variants:

* ``plan``: mshard as it is. Updated state is stored in its input's layout: dynamic_programming and ilp search
  under the write-back ties (``Op.follow_operand``) in one pass; recursive_programming applies them after its
  search and searches again with the state held (:mod:`mshard._src.planning.search`); sharding_propagation applies them after.
* ``untied``: dynamic_programming and ilp without the ties, searched twice as recursive_programming is
  (the way before the ties).
* ``once``: recursive_programming without its second search.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported
import numpy as np

import mshard as ms
from mshard._src.planning import search as planner
from searchers.cache import SEARCH_CACHE
from searchers.pairwise_problem import PairwiseProblem

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
    out = {"collectives": rep.total_count, "moved_bytes": int(sum(c.moved for c in rep.collectives))}
    if search:
        out["search_s"] = round(step.plan(t[:, :-1], t[:, 1:]).seconds, 3)
    return out


@contextlib.contextmanager
def variant(tag):
    """``untied``: no write-back ties in the exact searchers, and their second search back; ``once``: no
    second search."""
    SEARCH_CACHE.clear()                     # every variant searches afresh (the cache keys on the graph only)
    saved = planner.hold_state, dict(planner.SEARCHERS), PairwiseProblem.tie_operands
    if tag == "untied":
        for name, s in saved[1].items():
            if s.ties_exactly:
                planner.SEARCHERS[name] = dataclasses.replace(s, ties_exactly=False, holds_state=True)
        PairwiseProblem.tie_operands = lambda self: 0
    if tag == "once":
        planner.hold_state = lambda graph, strategies: False
    try:
        yield
    finally:
        planner.hold_state, PairwiseProblem.tie_operands = saved[0], saved[2]
        planner.SEARCHERS.clear()
        planner.SEARCHERS.update(saved[1])


VARIANTS = {"dynamic_programming": ("plan", "untied"), "ilp": ("plan", "untied"),
            "recursive_programming": ("plan", "once"), "sharding_propagation": ("plan",)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--searchers", default=",".join(SEARCHERS))
    ap.add_argument("--out", default=str(_cpu8.ROOT / "bench" / "out" / "searched_step.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="fully_use_devices=False only, dynamic_programming only: checks that it runs")
    args = ap.parse_args(argv)
    if args.smoke:
        args.searchers = "dynamic_programming"
    rows = []
    for fully in (False,) if args.smoke else (False, True):
        ms.reset_algo_parameters()
        ms.set_algo_parameters(fully_use_devices=fully)
        semi = measure("semi_auto_parallel")
        print(f"fully_use_devices={fully}: semi_auto (strategies alone) {semi['collectives']} collectives, "
              f"{semi['moved_bytes']:,} B moved", flush=True)
        for name in args.searchers.split(","):
            row = {"fully_use_devices": fully, "searcher": name, "semi_auto": semi}
            for tag in VARIANTS[name]:
                with variant(tag):
                    row[tag] = measure("auto_parallel", name)
            rows.append(row)
            print(f"  {name:22s} " + "   ".join(
                f"{tag} {row[tag]['collectives']:4d} / {row[tag]['moved_bytes']:>9,} B "
                f"({row[tag]['moved_bytes'] / semi['moved_bytes']:.2f}x semi, search {row[tag]['search_s']:.2f} s)"
                for tag in VARIANTS[name]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"config": {**CFG, "batch": BATCH}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
