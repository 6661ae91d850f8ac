"""Search time on a traced model (issue 14: on the MiniGPT forward, ilp <= 5 s and dynamic_programming <= 1 s).

    .venv/bin/python bench/search_traced.py [--repeat 3] [--out bench/out/search_traced.json]
    .venv/bin/python bench/search_traced.py --smoke     # 1 run each: that it runs and writes its JSON

The graph is the one mshard's planner searches for the forward of the plain flax MiniGPT of
``tests/e2e/training/test_plain_models_train.py`` (2 blocks) under auto_parallel with a data-parallel batch on 8 devices: a
searcher swapped in for one planning run captures it. Each searcher then runs on it with the cache off, ``--repeat``
times (the least time counts): dynamic_programming, ilp, and ilp with ``eliminate=False`` (the whole integer
program, as before the elimination fast path). JSON: ``bench/out/search_traced.json`` (``--out``; seconds,
predicted cost, notes per searcher).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported, quiet XLA, paths

ROOT = _cpu8.ROOT
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "e2e" / "training")]

from test_plain_models_train import gpt_case  # noqa: E402

import mshard as ms  # noqa: E402
from searchers import protocol  # noqa: E402
from searchers.dynamic_programming import dynamic_programming  # noqa: E402
from searchers.ilp import ilp  # noqa: E402


def captured_graph():
    """(graph, cost params, options) the planner hands its searcher for the MiniGPT forward."""
    cap: dict = {}
    saved = protocol.SEARCHERS["dynamic_programming"]

    def grab(graph, params, **options):
        cap.update(graph=graph, params=params, options=options)
        return saved.fn(graph, params, **options)

    protocol.register("dynamic_programming", grab, options=saved.options, ties_exactly=saved.ties_exactly)
    try:
        make, _, data, _ = gpt_case()
        x, _ = data[0]
        with ms.parallel_context(parallel_mode="auto_parallel", search_mode="dynamic_programming", device_num=8,
                                 dataset_strategy="data_parallel"):
            ms.jit(lambda m, x: m(x)).plan(make(), x)
    finally:
        protocol.SEARCHERS["dynamic_programming"] = saved
    return cap["graph"], cap["params"], cap["options"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "search_traced.json"))
    ap.add_argument("--smoke", action="store_true", help="1 run per searcher: checks that it runs")
    a = ap.parse_args()
    if a.smoke:
        a.repeat = 1
    g, params, options = captured_graph()
    runs = {"dynamic_programming": lambda: dynamic_programming(g, params, cache=False, **options),
            "ilp": lambda: ilp(g, params, cache=False, **options),
            "ilp (eliminate=False)": lambda: ilp(g, params, cache=False, eliminate=False, **options)}
    rows = []
    for name, run in runs.items():
        best, res = float("inf"), None
        for _ in range(a.repeat):
            t = time.perf_counter()
            res = run()
            best = min(best, time.perf_counter() - t)
        rows.append({"searcher": name, "ops": len(g.ops), "seconds": best, "cost": float(res.cost.total),
                     "notes": list(res.notes)})
        print(f"{name:24s} {len(g.ops)} ops  {best:7.2f} s  cost {res.cost.total:.6g}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
