"""The differential fuzzer's long campaign (issue 13): random programs over every primitive, checked against one device.

    .venv/bin/python bench/fuzz.py --cases 10000 [--invalid 0.25] [--start 0] [--workers 2] [--out PATH]
    .venv/bin/python bench/fuzz.py --smoke      # 2 cases in 1 worker: that it runs and writes its JSON

Case ``i`` is ``tests/fuzz_programs.make_case(start + i, invalid)`` (a fixed share of them with an invalid strategy),
so a run replays exactly; a case may be a training case (tests/fuzz_training.py), use 2 or 4 devices, another
Layout, big dims, ilp, scan / cond or Dropout. Cases run in worker subprocesses that log each case before running it:
a worker that dies (an XLA CHECK failure aborts the process) is restarted after the case it died on, which is
recorded as a ``process abort`` finding. Every finding is written as a standalone script to bench/out/fuzz/<seed>.py;
the counts (per mode, per primitive, per feature such as the device count or the training variant, per outcome) go
to bench/out/fuzz-<first>-<last>.json and a table is printed. With
``--out PATH`` the counts go to PATH, and the workers' logs and the findings' scripts to ``fuzz/`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "out"


def _is_invalid(i: int, share: float) -> bool:
    return share > 0 and (i % max(1, round(1 / share))) == 0


def worker(seeds: list[int], share: float, log: Path) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.path[:0] = [str(ROOT)]
    sys.path.append(str(ROOT / "tests"))
    from fuzz_programs import check_case, make_case
    with log.open("a") as f:
        for s in seeds:
            case = make_case(s, _is_invalid(s, share))
            f.write(json.dumps({"start": s}) + "\n")
            f.flush()
            t = time.perf_counter()
            outcome, detail = check_case(case)
            f.write(json.dumps({"seed": s, "outcome": outcome, "detail": detail[:600], "s": time.perf_counter() - t})
                    + "\n")
            f.flush()


def run_worker(seeds: list[int], share: float, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--worker", ",".join(map(str, seeds)), "--invalid", str(share),
                             "--log", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def read_log(log: Path) -> tuple[dict[int, dict], list[int]]:
    done, started = {}, []
    if log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            if "start" in r:
                started.append(r["start"])
            else:
                done[r["seed"]] = r
    return done, started


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--invalid", type=float, default=0.25, help="share of cases with an invalid strategy")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--log", help=argparse.SUPPRESS)
    ap.add_argument("--out", help="the JSON counts (default bench/out/fuzz-<first>-<last>.json); logs and findings "
                                  "go to fuzz/ beside it")
    ap.add_argument("--smoke", action="store_true", help="2 cases in 1 worker: checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.cases, args.workers = 2, 1
    if args.worker is not None:
        worker([int(s) for s in args.worker.split(",")], args.invalid, Path(args.log))
        return

    sys.path[:0] = [str(ROOT)]
    sys.path.append(str(ROOT / "tests"))
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from fuzz_programs import describe, features, make_case, script
    fuzz_dir = Path(args.out).resolve().parent / "fuzz" if args.out else OUT / "fuzz"
    fuzz_dir.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.start, args.start + args.cases))
    t0 = time.time()
    logs = [fuzz_dir / f"worker{w}.jsonl" for w in range(args.workers)]
    for log in logs:
        log.unlink(missing_ok=True)
    todo = {w: seeds[w::args.workers] for w in range(args.workers)}
    aborts: dict[int, str] = {}
    procs = {w: run_worker(todo[w], args.invalid, logs[w]) for w in todo if todo[w]}
    shown = t0
    while procs:
        time.sleep(1)
        for w, p in list(procs.items()):
            if p.poll() is None:
                continue
            del procs[w]
            done, started = read_log(logs[w])
            left = [s for s in todo[w] if s not in done and s not in aborts]
            if p.returncode != 0 and started and started[-1] not in done:
                aborts[started[-1]] = f"process abort (exit code {p.returncode})"
                left = [s for s in left if s != started[-1]]
            if left:
                procs[w] = run_worker(left, args.invalid, logs[w])
        if time.time() - shown > 60:
            shown = time.time()
            n = sum(len(read_log(g)[0]) for g in logs) + len(aborts)
            print(f"{n}/{len(seeds)} cases, {time.time() - t0:.0f}s", file=sys.stderr, flush=True)

    results: dict[int, dict] = {}
    for log in logs:
        results.update(read_log(log)[0])
    for s, why in aborts.items():
        results[s] = {"seed": s, "outcome": "finding", "detail": why, "s": 0.0}
    by_mode: dict[str, Counter] = defaultdict(Counter)
    by_prim: dict[str, Counter] = defaultdict(Counter)
    by_feature: dict[str, Counter] = defaultdict(Counter)
    findings = []
    for s in seeds:
        r = results[s]
        case = make_case(s, _is_invalid(s, args.invalid))
        mode = case["mode"] + (f"/{case['search_mode']}" if case["search_mode"] else "")
        by_mode[mode][r["outcome"]] += 1
        for k in sorted({st["kind"] for st in case["steps"]}):
            by_prim[k][r["outcome"]] += 1
        for k in features(case):
            by_feature[k][r["outcome"]] += 1
        if r["outcome"] == "finding":
            findings.append({"seed": s, "case": describe(case), "finding": r["detail"]})
            (fuzz_dir / f"{s}.py").write_text(script(case, r["detail"].splitlines()[0][:300]))
    outcomes = ("equal", "meeting", "refused", "finding")
    total = Counter(r["outcome"] for r in results.values())
    summary = {"cases": len(seeds), "start": args.start, "invalid_share": args.invalid,
               "seconds": round(time.time() - t0, 1), "outcomes": dict(total),
               "by_mode": {k: dict(v) for k, v in sorted(by_mode.items())},
               "by_primitive": {k: dict(v) for k, v in sorted(by_prim.items())},
               "by_feature": {k: dict(v) for k, v in sorted(by_feature.items())}, "findings": findings}
    report = Path(args.out) if args.out else OUT / f"fuzz-{args.start}-{args.start + len(seeds) - 1}.json"
    report.write_text(json.dumps(summary, indent=1))
    print(f"{len(seeds)} cases (seeds {args.start}..{args.start + len(seeds) - 1}) in {summary['seconds']}s: "
          + ", ".join(f"{o} {total[o]}" for o in outcomes))
    width = max(len(k) for k in list(by_mode) + list(by_prim) + list(by_feature))
    for title, table in (("mode", by_mode), ("primitive", by_prim), ("feature", by_feature)):
        print(f"\n{title:<{width}}  " + "  ".join(f"{o:>8}" for o in outcomes))
        for k, v in sorted(table.items()):
            print(f"{k:<{width}}  " + "  ".join(f"{v[o]:>8}" for o in outcomes))
    for f in findings:
        print(f"\nFINDING seed {f['seed']}: {f['case']}\n  {f['finding'][:300]}")
    print(f"\nwrote {report}" + (f" and {len(findings)} scripts in {fuzz_dir}" if findings else ""))


if __name__ == "__main__":
    main()
