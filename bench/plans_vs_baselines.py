"""Every searcher's plan against the obvious plans, per device, from the compiled HLO (issue 14).

    .venv/bin/python bench/plans_vs_baselines.py [--models mlp,transformer,...] [--skip-forward]
                                                 [--out bench/out/plans_vs_baselines.json]

Models: the MLP, transformer block, conv net and embedding classifier of ``examples/models.py``, the embedding GPT
of ``examples/train_gpt.py`` (1 block) and the plain flax MiniGPT of ``tests/test_plain_models_train.py``. For each,
the forward (``ms.jit``) and one training step (``nn.TrainOneStepCell``, SGD) on 8 simulated CPU devices, with
``dataset_strategy`` "data_parallel" and "full_batch", planned as:

* ``data_parallel``: parallel_mode data_parallel (its dataset_strategy is the batch split);
* ``expert``: semi_auto_parallel with the hand-written Megatron strategies, where the model has them (MLP,
  transformer block, both GPTs);
* each search_mode of auto_parallel (mshard's defaults otherwise);
* ``replicated``: stand_alone, one device's program (0 bytes; its FLOPs are what every device would compute).

Per row: the collective bytes per device in the compiled HLO (``ms.comm_report``), their ratio to data_parallel's,
the compiled FLOPs per device (``cost_analysis``) and their ratio to the replicated program's (1/8 is a perfect
split), and the search seconds. The summary line says on how many training steps every searcher moves no more bytes
than data_parallel (the issue's target, where data_parallel fits in memory: it does for every model here), and on
how many of those at no more than 1.1x data_parallel's FLOPs per device (bytes bought with replicated compute do
not count); the same for the bytes moved per device (``comm_report``'s ring estimate: an all-reduce of N bytes
moves about 2N, an all-gather about N, so the two measures disagree where a plan trades one for the other).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _cpu8

ROOT = _cpu8.ROOT
sys.path.insert(0, str(ROOT / "tests"))

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mshard as ms  # noqa: E402
from mshard import nn  # noqa: E402

SEARCH_MODES = ("sharding_propagation", "recursive_programming", "dynamic_programming", "ilp")
MSE = nn.MSELoss()


def _models() -> dict:
    """name -> () -> (network, loss cell maker, data tuple for the loss cell, forward data, expert or None)."""
    from models import MLP, ConvNet, EmbedClassifier, TransformerBlock, inputs
    from test_plain_models_train import gpt_case, megatron
    from train_gpt import LOSS, make_gpt, synthetic_batches

    def with_mse(make, name, expert=None):
        def build():
            m = make()
            (x,) = inputs(name)
            y = jnp.zeros_like(m(x))
            return m, (lambda m: nn.WithLossCell(m, MSE)), (x, y), (x,), expert
        return build

    def mlp_expert(m):
        m.shard(in_strategy=((2, 1),), parameter_plan={"w1": (1, 4), "w2": (4, 1)})

    def block_expert(m):
        col, row = (1, 4), (4, 1)
        m.shard(in_strategy=((2, 1, 1),), parameter_plan={"wq": col, "wk": col, "wv": col, "w_ff1": col,
                                                          "wo": row, "w_ff2": row})

    def embed():
        m = EmbedClassifier()
        ids, labels = inputs("embed")
        return m, (lambda m: m), (ids, labels), (ids, labels), None

    def gpt():
        m = make_gpt(nnx.Rngs(0), layers=1)
        x, y = synthetic_batches(1)[0]

        def expert(m):
            for b in m.blocks:
                b.shard_megatron(data_parallel=2, model_parallel=4)
        return m, (lambda m: nn.WithLossCell(m, LOSS)), (x, y), (x,), expert

    def flax_minigpt():
        make, loss_fn, data, _ = gpt_case()
        x, y = data[0]
        return make(), (lambda m: nn.WithLossCell(m, loss_fn)), (x, y), (x,), megatron

    return {"mlp": with_mse(MLP, "mlp", mlp_expert), "transformer": with_mse(TransformerBlock, "transformer",
                                                                               block_expert),
            "conv": with_mse(ConvNet, "conv"), "embed": embed, "gpt": gpt, "flax_minigpt": flax_minigpt}


def _measure(build, plan: str, dataset: str, training: bool) -> dict:
    m, loss_cell, data, fwd_data, expert = build()
    if plan == "expert":
        if expert is None:
            return {}
        expert(m)
    ctx = {"data_parallel": dict(parallel_mode="data_parallel"), "expert": dict(parallel_mode="semi_auto_parallel"),
           "replicated": dict(parallel_mode="stand_alone")}.get(plan, dict(parallel_mode="auto_parallel",
                                                                           search_mode=plan))
    if plan not in ("data_parallel", "replicated"):
        ctx["dataset_strategy"] = dataset
    with ms.parallel_context(device_num=8, gradients_mean=True, **ctx):
        if training:
            f = nn.TrainOneStepCell(loss_cell(m), optax.sgd(0.01))
            args = data
        else:
            f = ms.jit(lambda m, *d: m(*d))
            args = (m, *fwd_data)
        compiled = f.lower(*args).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        rep = ms.comm_report(f, *args)
        p = f.plan(*args)
    return {"bytes": int(sum(v["bytes"] for v in rep.by_kind.values())),
            "moved": float(sum(v["moved"] for v in rep.by_kind.values())), "collectives": rep.total_count,
            "flops": float(cost.get("flops", 0.0)), "search_s": float(getattr(p, "seconds", 0.0) or 0.0)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,transformer,conv,embed,gpt,flax_minigpt")
    ap.add_argument("--skip-forward", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "plans_vs_baselines.json"))
    a = ap.parse_args(argv)
    models = _models()
    rows = []
    for name in a.models.split(","):
        for training in ((True,) if a.skip_forward else (False, True)):
            for dataset in ("data_parallel", "full_batch"):
                got = {}
                for plan in ("replicated", "data_parallel", "expert") + SEARCH_MODES:
                    if dataset == "full_batch" and plan in ("replicated", "data_parallel"):
                        got[plan] = rows_by[(name, training, "data_parallel", plan)]
                        continue
                    try:
                        r = _measure(models[name], plan, dataset, training)
                    except Exception as e:      # a plan that fails is a row that says why
                        r = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    if not r:
                        continue
                    got[plan] = r
                base, rep = got.get("data_parallel", {}), got.get("replicated", {})
                for plan, r in got.items():
                    row = {"model": name, "pass": "training" if training else "forward", "dataset": dataset,
                           "plan": plan, **r}
                    if "bytes" in r and "bytes" in base:
                        row["bytes_vs_dp"] = (r["bytes"] / base["bytes"] if base["bytes"]
                                              else (1.0 if r["bytes"] == 0 else float("inf")))
                    if "moved" in r and "moved" in base:
                        row["moved_vs_dp"] = (r["moved"] / base["moved"] if base["moved"]
                                              else (1.0 if r["moved"] == 0 else float("inf")))
                    if "flops" in r and rep.get("flops"):
                        row["flops_vs_replicated"] = r["flops"] / rep["flops"]
                    rows.append(row)
                    rows_by[(name, training, dataset, plan)] = r
                print(json.dumps([x for x in rows if x["model"] == name and x["dataset"] == dataset
                                  and x["pass"] == ("training" if training else "forward")]), flush=True)
    train = [r for r in rows if r["pass"] == "training" and r["plan"] in SEARCH_MODES]
    ok = [r for r in train if r.get("bytes_vs_dp", float("inf")) <= 1.0]
    def dp_flops(r):
        return rows_by.get((r["model"], True, "data_parallel", "data_parallel"), {}).get("flops", 0.0)
    # at equal compute: a plan may not buy its bytes with a replicated (8x) computation
    even = [r for r in ok if r.get("flops", float("inf")) <= 1.1 * dp_flops(r)]
    # moved: what one device sends, the ring estimate per collective kind (an all-reduce of N bytes moves about
    # 2N, an all-gather of N about N): the traffic the cost model prices
    moved_ok = [r for r in train if r.get("moved_vs_dp", float("inf")) <= 1.0]
    moved_even = [r for r in moved_ok if r.get("flops", float("inf")) <= 1.1 * dp_flops(r)]
    summary = {"training_search_rows": len(train), "no_more_bytes_than_data_parallel": len(ok),
               "and_no_more_than_1.1x_its_flops": len(even),
               "no_more_moved_than_data_parallel": len(moved_ok), "moved_and_no_more_than_1.1x_its_flops":
                   len(moved_even),
               "worse": [(r["model"], r["dataset"], r["plan"], r.get("bytes_vs_dp", r.get("error")))
                         for r in train if r not in ok]}
    from rich.console import Console
    from rich.table import Table
    t = Table(title="plans vs baselines: collective bytes and FLOPs per device (compiled HLO, 8 CPU devices)")
    for c in ("model", "pass", "dataset", "plan", "bytes", "vs dp", "moved vs dp", "collectives", "flops vs replicated",
              "search s"):
        t.add_column(c, justify="left" if c in ("model", "pass", "dataset", "plan") else "right")
    for r in rows:
        t.add_row(r["model"], r["pass"], r["dataset"], r["plan"], f"{r.get('bytes', '-'):,}" if "bytes" in r
                  else r.get("error", "-")[:40], f"{r['bytes_vs_dp']:.2f}" if "bytes_vs_dp" in r else "-",
                  f"{r['moved_vs_dp']:.2f}" if "moved_vs_dp" in r else "-",
                  str(r.get("collectives", "-")),
                  f"{r['flops_vs_replicated']:.3f}" if "flops_vs_replicated" in r else "-",
                  f"{r.get('search_s', 0):.2f}")
    Console(width=160).print(t)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"rows": rows, "summary": summary}, fh, indent=1, default=str)
    print(json.dumps(summary))


rows_by: dict = {}

if __name__ == "__main__":
    main()
