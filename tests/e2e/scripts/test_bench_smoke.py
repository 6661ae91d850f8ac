"""Every benchmark runs (issue 42): each bench/*.py with ``--smoke`` (tiny sizes, one repeat, the same code paths)
exits 0 and writes its machine-readable JSON, with the top-level fields it documents. Nothing is timed here."""

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers import ROOT, xla_flags

pytestmark = pytest.mark.slow

BENCH = ROOT / "bench"

# Per script, some of the top-level fields its own documentation (module docstring, the report it builds in main)
# says its JSON holds. A script whose JSON is a list of rows (one per model, plan, case...): fields of every row.
FIELDS: dict[str, tuple[str, ...]] = {
    "branch_bodies": ("rows",),
    "checkpoint": ("throughput", "memory"),
    "conv_halo": ("size", "one_device_flops", "rows"),
    "eager": ("platform", "devices", "calls", "rounds", "eager_primitive_python_us"),
    "fusion": ("config", "rows"),
    "fuzz": ("cases", "outcomes", "by_mode", "by_primitive", "findings"),
    "infer": ("platform", "devices", "tokens", "ratio_mshard_vs_jax_jit", "ratio_mshard_bound_vs_jax_jit"),
    "launch": ("first_step_s", "faults", "dry_run"),
    "memory": ("config", "rows", "summary"),
    "memory_fit": ("config", "rows"),
    "mutate": ("rev", "results", "caught", "total"),
    "pipeline": ("bubble", "moved", "memory", "time"),
    "plan_vs_program": ("net", "mode", "setting", "planned", "program", "equal"),                # rows
    "plans_snapshot": ("models", "plans"),
    "plans_vs_baselines": ("rows", "summary"),
    "plans_vs_expert": ("model", "plan", "bytes", "ratio", "max_err_vs_one_device"),            # rows
    "predicted_vs_hlo": ("mode", "model", "step", "predicted_moved", "hlo_moved", "within_10pct"),  # rows
    "rank_vs_hlo": ("model", "step", "plans", "spearman", "points"),                           # rows
    "reshard_vs_hlo": ("pairs", "nets"),
    "rp_levels": ("machine", "command", "level_min_ops", "rows"),
    "search": ("machine", "command", "rows", "growth_exponent", "targets"),
    "search_traced": ("searcher", "ops", "seconds", "cost", "notes"),                          # rows
    "searched_step": ("config", "rows"),
    "step": ("devices", "platform", "model", "time", "memory", "python_us"),
}
# the smoke runs of a loaded 2-core machine take seconds to a minute; bench/step.py's (two modes, six features: three
# optimizer levels, recompute, accumulation, a 2-stage pipeline; the fused Megatron step and every memory route, a
# 1-layer model) about 3.5 minutes on a 2-core machine, alone or beside the suite's other shard
TIMEOUT_S = {"step": 600}


def test_every_bench_script_is_listed():
    scripts = {p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(FIELDS)


# run in their own test file (tests/e2e/scripts/test_bench_step_smoke.py), so the suite's shards can take them apart from the rest
OWN_FILE = ("step",)


@pytest.mark.parametrize("name", sorted(set(FIELDS) - set(OWN_FILE)))
def test_bench_smoke_writes_its_json(name, tmp_path):
    check_smoke(name, tmp_path)


def check_smoke(name, tmp_path):
    """Run bench/<name>.py --smoke and check its JSON (the module doc)."""
    out = tmp_path / "out.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(8))
    # its own session: a script's own subprocesses (memory probes, fuzz workers, `mshard run` jobs, searcher
    # children) are killed with it on a timeout
    proc = subprocess.Popen([sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--out", str(out)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S.get(name, 300))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"bench/{name}.py --smoke ran past {TIMEOUT_S.get(name, 300)} s:\n{stderr[-3000:]}")
    assert proc.returncode == 0, f"bench/{name}.py --smoke exited {proc.returncode}:\n{stderr[-3000:]}"
    assert out.is_file(), f"bench/{name}.py --smoke wrote no {out}:\n{stdout[-2000:]}"
    report = json.loads(out.read_text())
    rows = report if isinstance(report, list) else [report]
    assert rows, f"bench/{name}.py --smoke wrote an empty list"
    for row in rows:
        missing = [k for k in FIELDS[name] if k not in row]
        assert not missing, f"bench/{name}.py's JSON lacks {missing}: {sorted(row)}"
    if name == "mutate":        # the smoke run plants the checksum bug: the suite must catch it
        assert report["caught"] == report["total"] == 1, report
    if name == "plans_vs_baselines":    # every searched plan of the MLP replays exactly from its strategy file
        assert not report["summary"]["not_replayed"], report["summary"]
        assert all(r["replays"] for r in report["rows"] if r["plan"] in ("sharding_propagation", "ilp"))
    if name == "reshard_vs_hlo":        # the executor's own changes compile to the bytes the cost model prices
        assert all(r["direct"]["as_predicted"] == r["direct"]["pairs"] for r in report["pairs"]), report["pairs"]
