"""Does the cost model rank plans the way the compiled programs do? (issue 14: Spearman >= 0.9 per net)

    .venv/bin/python bench/rank_vs_hlo.py [--plans 50] [--models mlp,transformer,conv,embed] [--steps forward,train]
                                          [--out bench/out/rank_vs_hlo.json]
    .venv/bin/python bench/rank_vs_hlo.py --smoke     # 4 plans of the MLP: that it runs and writes its JSON

For each model of ``examples/models.py`` and each step (the forward; the training step, ``value_and_grad`` of
``sum(model(x))``), ``--plans`` random valid plans are drawn: every op not fixed by the dataset strategy takes a
strategy drawn uniformly from its candidates (:func:`searchers.strategies.enumerate_strategies`, every mesh axis
used, as auto_parallel's default ``fully_use_devices``). Each plan is run through mshard's own planner (a searcher
that returns the draw, swapped in for the bench's run) and compiled. Two scores per plan:

- predicted: the plan's cost-model total (:attr:`mshard.Plan.cost`), what the searchers minimise;
- compiled: the same weighting applied to what the compiled HLO does, ``alpha * flops / flops_per_s + beta *
  sum(latency + bytes / bandwidth)`` over its collectives (``mshard.comm_report``: bytes moved per device), FLOPs from
  ``cost_analysis()`` (a loop body counted once; these steps have no loops).

Reported per (model, step): Spearman's rank correlation of the two (scipy), and of the predicted and compiled
bytes alone, over the distinct plans drawn; per plan, both scores, the bytes, the HLO's FLOPs and collective count,
the plan's redistributions that move data, the collectives the plan pays for (in latencies) and the compiled ones
per kind (where the two disagree is where the ranking goes wrong). JSON: ``bench/out/rank_vs_hlo.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported, quiet XLA, paths

ROOT = _cpu8.ROOT

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from models import MODELS, inputs  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

import mshard as ms  # noqa: E402
from mshard._src.edges.comm_report import CommReport  # noqa: E402
from searchers import protocol  # noqa: E402
from searchers.cost import CostParams, graph_cost  # noqa: E402
from searchers.result import SearchResult  # noqa: E402
from searchers.strategies import enumerate_strategies  # noqa: E402

SLOT = "dynamic_programming"        # the search_mode whose searcher the bench swaps for its random draw


def grad_step(m, *a):
    return nnx.value_and_grad(lambda m, *a: jnp.sum(m(*a)))(m, *a)


STEPS = {"forward": lambda m, *a: m(*a), "train": grad_step}


def random_searcher(rng: random.Random):
    def search(graph, params, **options):
        st = {}
        for op in graph.ops:
            cands = enumerate_strategies(op, graph.mesh, fully_use_devices=True)
            st[op.id] = op.fixed if op.fixed is not None else rng.choice(cands)
        return SearchResult(st, graph_cost(graph, st, params), "random", 0.0)
    return search


def _latencies(plan) -> float:
    """The collectives the plan pays for, in latencies: its communication time less its bytes' time, over the
    default 5 us (every axis has the default link here)."""
    return (float(plan.cost.comm_time) - float(sum(plan.cost.communication.values())) / 100e9) / 5e-6


def _planned_kinds(plan) -> dict[str, int]:
    """Per collective kind, how many of the plan's redistributions move bytes with it, and (all-reduce) how many ops
    resolve partial sums (an op's cost also holds its operands' redistributions, so only its all-reduce counts here;
    a redistribution of two steps of one kind counts once: ``predicted_latencies`` has the exact count)."""
    out: dict[str, int] = {}
    for r in plan.redistributions:
        for kind, b in r.communication.items():
            if b:
                out[kind] = out.get(kind, 0) + 1
    reducing = sum(1 for o in plan.ops if o.cost.communication.get("all-reduce"))
    if reducing:
        out["all-reduce"] = reducing
    return out


def compiled_score(f, m, xs, params: CostParams) -> tuple[float, float, float, int, dict[str, int]]:
    """(score, bytes moved per device, flops per device, collectives, collectives per kind) of the compiled program
    of ``f(m, *xs)``."""
    compiled = f.lower(m, *xs).compile()          # compiled once: its collectives and its FLOPs
    rep = CommReport.from_hlo(compiled.as_text())
    moved = sum(float(v["moved"]) for v in rep.by_kind.values())
    comm = sum(5e-6 * int(v["count"]) + float(v["moved"]) / 100e9 for v in rep.by_kind.values())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", 0.0))
    count = sum(int(v["count"]) for v in rep.by_kind.values())
    kinds = {k: int(v["count"]) for k, v in rep.by_kind.items()}
    return params.alpha * flops / params.flops_per_s + params.beta * comm, moved, flops, count, kinds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", type=int, default=50)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", default="forward,train")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "rank_vs_hlo.json"))
    ap.add_argument("--smoke", action="store_true", help="4 plans of the MLP: checks that it runs")
    a = ap.parse_args()
    if a.smoke:
        a.plans, a.models = 4, "mlp"
    saved = protocol.SEARCHERS[SLOT]
    rng = random.Random(a.seed)
    protocol.register(SLOT, random_searcher(rng))
    params = CostParams()
    rows = []
    try:
        for name in a.models.split(","):
            for step in a.steps.split(","):
                seen, pts = set(), []
                for _ in range(a.plans):
                    with ms.parallel_context(parallel_mode="auto_parallel", device_num=8, search_mode=SLOT):
                        m, xs = MODELS[name](), inputs(name)
                        f = ms.jit(STEPS[step])
                        plan = f.plan(m, *xs)
                        key = tuple(sorted((o.name, o.strategy) for o in plan.ops))
                        if key in seen:
                            continue
                        seen.add(key)
                        score, moved, flops, count, hlo_kinds = compiled_score(f, m, xs, params)
                        moving = [r for r in plan.redistributions if any(r.communication.values())]
                        pts.append({"predicted": float(plan.cost.total), "compiled": score, "hlo_moved": moved,
                                    "flops": flops, "predicted_comm": float(sum(plan.cost.communication.values())),
                                    "hlo_collectives": count, "predicted_redistributions": len(moving),
                                    "predicted_latencies": _latencies(plan), "hlo_by_kind": hlo_kinds,
                                    "planned_by_kind": _planned_kinds(plan)})
                rho = spearmanr([p["predicted"] for p in pts], [p["compiled"] for p in pts]).statistic \
                    if len(pts) > 2 else float("nan")
                rho_bytes = spearmanr([p["predicted_comm"] for p in pts], [p["hlo_moved"] for p in pts]).statistic \
                    if len(pts) > 2 else float("nan")
                row = {"model": name, "step": step, "plans": len(pts), "spearman": float(rho),
                       "spearman_bytes": float(rho_bytes), "points": pts}
                rows.append(row)
                print(f"{name:12s} {step:8s} plans {len(pts):3d}  spearman(total) {rho:6.3f}  "
                      f"spearman(bytes) {rho_bytes:6.3f}", flush=True)
    finally:
        protocol.SEARCHERS[SLOT] = saved
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
