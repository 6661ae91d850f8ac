"""Every plan of the bench nets, as data: to show that a change to the package's structure changes no plan.

    .venv/bin/python bench/plans_snapshot.py --out A.json          # on one revision
    .venv/bin/python bench/plans_snapshot.py --out B.json          # on another
    .venv/bin/python bench/plans_snapshot.py --compare A.json B.json
    .venv/bin/python bench/plans_snapshot.py --smoke --out F.json  # the MLP forward only

For the models of ``bench/plans_vs_baselines.py`` (MLP, transformer block, conv net, embedding classifier, the
1-block GPT and the plain flax MiniGPT), forward (``ms.jit``) and one training step (``nn.TrainOneStepCell``, SGD),
on 8 simulated CPU devices with ``dataset_strategy="data_parallel"``, under data_parallel, semi_auto with the
hand-written strategies where the model has them, and each search mode: every op's strategy, every parameter's
PartitionSpec and the plan's predicted cost. Planned only, never compiled (a few seconds per plan). ``--compare``
prints every difference and exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _cpu8  # noqa: F401  (8 simulated devices, before JAX is imported)
import optax
from plans_vs_baselines import SEARCH_MODES, _models

import mshard as ms
from mshard import nn

PLANS = ("data_parallel", "expert", *SEARCH_MODES)


def _plan(build, plan: str, training: bool) -> dict | None:
    m, loss_cell, data, fwd_data, expert = build()
    if plan == "expert":
        if expert is None:
            return None
        expert(m)
    ctx = {"data_parallel": dict(parallel_mode="data_parallel"),
           "expert": dict(parallel_mode="semi_auto_parallel")}.get(plan, dict(parallel_mode="auto_parallel",
                                                                              search_mode=plan))
    with ms.parallel_context(device_num=8, gradients_mean=True, dataset_strategy="data_parallel", **ctx):
        if training:
            p = nn.TrainOneStepCell(loss_cell(m), optax.sgd(0.01)).plan(*data)
        else:
            p = ms.jit(lambda m, *d: m(*d)).plan(m, *fwd_data)
    cost = p.cost
    return {"strategies": {k: [list(s) for s in v] for k, v in p.strategies.items()},
            "param_specs": {k: str(v) for k, v in p.param_specs.items()},
            "cost": {"total": float(cost.total), "compute": float(cost.compute), "memory": float(cost.memory),
                     "communication": {k: float(v) for k, v in dict(cost.communication).items()}}}


def snapshot(models: list[str], plans=PLANS, steps=(False, True)) -> dict:
    """'model forward|train plan' -> that plan's strategies, parameter specs and predicted cost."""
    builds = _models()
    out = {}
    for name in models:
        for training in steps:
            for plan in plans:
                key = f"{name} {'train' if training else 'forward'} {plan}"
                got = _plan(builds[name], plan, training)
                if got is not None:
                    out[key] = got
                    print(f"{key}: {len(got['strategies'])} ops, cost {got['cost']['total']:.6g}", flush=True)
    return out


def compare(a: dict, b: dict) -> list[str]:
    diffs = [f"{k}: only in the first" for k in sorted(set(a) - set(b))]
    diffs += [f"{k}: only in the second" for k in sorted(set(b) - set(a))]
    for k in sorted(set(a) & set(b)):
        for part in ("strategies", "param_specs", "cost"):
            if a[k][part] != b[k][part]:
                x, y = a[k][part], b[k][part]
                keys = sorted(set(x) | set(y)) if isinstance(x, dict) else []
                what = [f"{n}: {x.get(n)} -> {y.get(n)}" for n in keys if x.get(n) != y.get(n)][:5]
                diffs.append(f"{k} {part}: " + "; ".join(what))
    return diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,transformer,conv,embed,gpt,flax_minigpt")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "plans_snapshot.json"))
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--smoke", action="store_true", help="the MLP forward under data_parallel and expert only")
    a = ap.parse_args()
    if a.compare:
        first, second = (json.load(open(p))["plans"] for p in a.compare)
        diffs = compare(first, second)
        print("\n".join(diffs) or f"the same plans: {len(first)} plans, every strategy, parameter spec and cost equal")
        sys.exit(1 if diffs else 0)
    models = ["mlp"] if a.smoke else a.models.split(",")
    snap = snapshot(models, ("data_parallel", "expert") if a.smoke else PLANS, (False,) if a.smoke else (False, True))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"models": models, "plans": snap}, f, indent=1, sort_keys=True)
    print(f"wrote {a.out}: {len(snap)} plans")


if __name__ == "__main__":
    main()
