"""recursive_programming with its levels decided at once (searchers.rp_levels) against op by op.

    .venv/bin/python bench/rp_levels.py [--repeat 3] [--out bench/out/rp_levels.json]
    .venv/bin/python bench/rp_levels.py --smoke     # 2k-op families, 300 chains of 4 ops, 1 run: that it runs

For each graph: the search time with the level path (the default) and with every op decided
one by one (``LEVEL_MIN_OPS`` out of reach), in one process, the least of ``--repeat`` runs
each after a warm-up run, interleaved; the number of batched levels and the tail; and whether
both plans are the same (they must be). Graphs (8 devices, a (2, 2, 2) mesh): the 100k-op
families of bench/search.py, and parallel chains of identical ops built interleaved, the deep
case where levels are many and mid-sized: 200 chains of 500 ops (500 levels of 200 ops, below
the 256-op minimum: all op by op) and 400 chains of 250 ops (250 levels of 400: the first 64
at once, the rest a tail). ``batched_levels`` 0: the level path did not run. JSON goes to
``bench/out/rp_levels.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import searchers.recursive_programming as rp  # noqa: E402
import searchers.rp_levels as rpl  # noqa: E402
from searchers.cost import CostParams  # noqa: E402
from searchers.generators import graph_of_size  # noqa: E402
from searchers.graph import DeviceMesh, Graph  # noqa: E402


def chains(width: int, depth: int, mesh: DeviceMesh) -> Graph:
    """``width`` chains of ``depth`` elementwise ops, one step of every chain at a time."""
    g = Graph(mesh)
    cur = [g.source(f"x{c}", (64, 32)) for c in range(width)]
    for d in range(depth):
        for c in range(width):
            (cur[c],) = g.add_op(f"e{d}_{c}", "exp", {"i": 64, "j": 32}, [cur[c]], [("i", "j")], [("i", "j")])
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "rp_levels.json"))
    ap.add_argument("--smoke", action="store_true",
                    help="families of 2,000 ops, 300 chains of 4 ops (levels above the minimum), 1 run: checks that it runs")
    a = ap.parse_args()
    size, shapes = 100_000, ((200, 500), (400, 250))
    if a.smoke:
        size, shapes, a.repeat = 2_000, ((300, 4),), 1
    mesh = DeviceMesh.prime(8)
    graphs = {f: (lambda f=f: graph_of_size(size, f, mesh, fix_data=True)) for f in ("mlp", "transformer", "conv",
                                                                                      "random")}
    for w, d in shapes:
        graphs[f"chains {w}x{d}"] = lambda w=w, d=d: chains(w, d, mesh)
    default = rp.LEVEL_MIN_OPS
    seen: list[tuple[int, int]] = []
    real = rpl.LevelBatch.sweep

    def spy(self, rnd, state, lay):          # how many levels, how large a tail
        seen.append((self.n_levels, len(self.tail)))
        return real(self, rnd, state, lay)

    rpl.LevelBatch.sweep = spy               # type: ignore[method-assign]
    rows = []
    for name, build in graphs.items():
        g = build()
        times: dict[str, float] = {"levels": float("inf"), "op_by_op": float("inf")}
        plans = {}
        for mode in ("levels", "op_by_op", "levels", "op_by_op"):         # the first two: warm-up
            rp.LEVEL_MIN_OPS = default if mode == "levels" else 10**12
            plans[mode] = rp.recursive_programming(g, CostParams(), cache=False).strategies
        for _ in range(a.repeat):
            for mode in ("levels", "op_by_op"):
                rp.LEVEL_MIN_OPS = default if mode == "levels" else 10**12
                seen.clear()
                t = time.perf_counter()
                rp.recursive_programming(g, CostParams(), cache=False)
                times[mode] = min(times[mode], time.perf_counter() - t)
                if mode == "levels":
                    levels, tail = seen[0] if seen else (0, 0)
        rp.LEVEL_MIN_OPS = default
        row = {"graph": name, "ops": len(g), "levels_s": round(times["levels"], 3),
               "op_by_op_s": round(times["op_by_op"], 3), "ratio": round(times["levels"] / times["op_by_op"], 3),
               "batched_levels": levels, "tail_ops": tail, "same_plan": plans["levels"] == plans["op_by_op"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"machine": {"cpus": __import__("os").cpu_count(), "python": sys.version.split()[0]},
           "command": "bench/rp_levels.py", "level_min_ops": default, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"JSON: {a.out}")


if __name__ == "__main__":
    main()
