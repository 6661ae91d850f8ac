"""Predicted communication (the plan's cost model) beside the compiled HLO's (comm_report), per model.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python bench/predicted_vs_hlo.py [--modes a,b] [--out PATH]
    .venv/bin/python bench/predicted_vs_hlo.py --smoke     # the MLP only: that it runs and writes its JSON

Prints a table and writes JSON (bench/out/predicted_vs_hlo.json, ``--out``). Bytes are per device, "moved" by
ring formulas from the collective's result size and replica-group size (see mshard.comm_report).
Runs each model (mlp, transformer block, conv, embedding classifier) forward and as a training step (loss +
gradients) in data_parallel, semi_auto_parallel and in auto_parallel with every search_mode (``--modes`` picks some; ilp is
slow and off unless named). ``within_10pct``: every collective kind's predicted bytes within 10% of the HLO's
(collective-permute included: the cost model prices none, so any permute in the HLO misses).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported, quiet XLA, paths

ROOT = _cpu8.ROOT

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from models import MODELS, inputs  # noqa: E402

import mshard as ms  # noqa: E402


def grad_step(m, *a):
    return nnx.value_and_grad(lambda m, *a: jnp.sum(m(*a)))(m, *a)


MODES = {"data_parallel": dict(parallel_mode="data_parallel", gradients_mean=True),
         "semi_auto": dict(parallel_mode="semi_auto_parallel"),
         "sharding_propagation": dict(parallel_mode="auto_parallel", search_mode="sharding_propagation"),
         "recursive_programming": dict(parallel_mode="auto_parallel", search_mode="recursive_programming"),
         "dynamic_programming": dict(parallel_mode="auto_parallel", search_mode="dynamic_programming"),
         "ilp": dict(parallel_mode="auto_parallel", search_mode="ilp")}


def within(pred: dict, real: dict, tol: float = 0.10) -> bool:
    return all(abs(pred.get(k, 0.0) - real.get(k, 0.0)) <= tol * max(pred.get(k, 0.0), real.get(k, 0.0))
               for k in set(pred) | set(real))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="data_parallel,semi_auto,sharding_propagation,recursive_programming,dynamic_programming")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "predicted_vs_hlo.json"))
    ap.add_argument("--smoke", action="store_true", help="the MLP only: checks that it runs")
    args = ap.parse_args()
    models = {"mlp": MODELS["mlp"]} if args.smoke else MODELS
    rows = []
    for mode in args.modes.split(","):
        with ms.parallel_context(device_num=8, **MODES[mode]):
            for name, cls in models.items():
                for what, fn in (("forward", lambda m, *a: m(*a)), ("train", grad_step)):
                    m, xs = cls(), inputs(name)
                    f = ms.jit(fn)
                    plan = f.plan(m, *xs)
                    rep = ms.comm_report(f, m, *xs)
                    pred = {k: float(v) for k, v in plan.cost.communication.items() if v}
                    real = {k: float(v["moved"]) for k, v in rep.by_kind.items()}
                    rows.append({"mode": mode, "model": name, "step": what, "predicted_moved": pred, "hlo_moved": real,
                                 "hlo_counts": {k: v["count"] for k, v in rep.by_kind.items()},
                                 "predicted_total": sum(pred.values()), "hlo_total": sum(real.values()),
                                 "within_10pct": within(pred, real), "algorithm": plan.algorithm})
    from rich.console import Console
    from rich.table import Table
    t = Table(title="predicted vs compiled communication, bytes moved per device")
    for c in ("mode", "model", "step", "predicted", "HLO", "ratio HLO/pred", "kinds within 10%", "HLO collectives"):
        t.add_column(c)
    for r in rows:
        ratio = r["hlo_total"] / r["predicted_total"] if r["predicted_total"] else (1.0 if not r["hlo_total"] else float("inf"))
        r["ratio"] = ratio
        t.add_row(r["mode"], r["model"], r["step"], json.dumps({k: round(v) for k, v in r["predicted_moved"].items()}),
                  json.dumps({k: round(v) for k, v in r["hlo_moved"].items()}), f"{ratio:.2f}",
                  "yes" if r["within_10pct"] else "NO", json.dumps(r["hlo_counts"]))
    print(f"within 10% on every kind: {sum(r['within_10pct'] for r in rows)} of {len(rows)}")
    Console(width=180).print(t)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
