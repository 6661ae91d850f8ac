"""Searched plans against a hand-written expert plan, on 8 (simulated) devices.

    .venv/bin/python bench/plans_vs_expert.py             # table + bench/out/plans_vs_expert.json (--out PATH)
    .venv/bin/python bench/plans_vs_expert.py --smoke     # the MLP only: that it runs and writes its JSON

For the 2-layer MLP, a transformer block and the small conv net of ``examples/models.py``, one
training step's forward and backward (``value_and_grad`` of ``sum(model(x))``) is planned by
each searcher in ``auto_parallel`` (mshard's defaults: fully_use_devices=True, dataset_strategy
data_parallel), executed, compared with one device, and its compiled HLO's collectives
(``ms.comm_report``) are printed beside those of an expert plan written by hand with
``NamedSharding`` on a (dp=2, tp=4) mesh:

* MLP: Megatron — ``w1`` column-parallel, ``w2`` row-parallel, the batch over dp;
* transformer block: Megatron — q/k/v and the first MLP weight column-parallel (heads and
  d_ff over tp), the output projection and the second MLP weight row-parallel, layer-norm
  parameters replicated, the batch over dp;
* conv net: data parallel over all 8 devices (a conv net this small has nothing to gain from
  tensor parallelism), parameters replicated.

The ratio column is the plan's collective bytes over the expert's (per device, from the HLO).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported, quiet XLA, paths

ROOT = _cpu8.ROOT

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from models import MLP, ConvNet, TransformerBlock, inputs  # noqa: E402

import mshard as ms  # noqa: E402

SEARCH_MODES = ("sharding_propagation", "recursive_programming", "dynamic_programming", "ilp")


def step(m, x):
    return nnx.value_and_grad(lambda m, x: jnp.sum(m(x)))(m, x)


def expert_specs(model: str) -> tuple[dict[str, P], P]:
    """PartitionSpec per parameter name, and the input's, for the (dp, tp) mesh."""
    if model == "mlp":
        return {"w1": P(None, "tp"), "w2": P("tp", None)}, P("dp", None)
    if model == "transformer":
        col, row = P(None, "tp"), P("tp", None)
        return ({"wq": col, "wk": col, "wv": col, "wo": row, "w_ff1": col, "w_ff2": row,
                 "ln1_g": P(), "ln1_b": P(), "ln2_g": P(), "ln2_b": P()}, P("dp", None, None))
    return {"kernel": P(), "scale": P(), "shift": P(), "head": P()}, P(("dp", "tp"), None, None, None)


def expert(model: str, m, x):
    """The expert step as a plain jax.jit over (params, x) placed with NamedSharding."""
    mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(AxisType.Auto, AxisType.Auto))
    gd, state = nnx.split(m)
    specs, xspec = expert_specs(model)

    def place(path, leaf):
        name = str(path[0].key)
        return jax.device_put(leaf, NamedSharding(mesh, specs[name]))

    state = jax.tree_util.tree_map_with_path(place, state)
    x = jax.device_put(x, NamedSharding(mesh, xspec))

    @jax.jit
    def f(state, x):
        return jax.value_and_grad(lambda st, x: jnp.sum(nnx.merge(gd, st)(x)))(state, x)

    return f, (state, x)


def max_err(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def main(argv=None) -> None:
    from rich.console import Console
    from rich.table import Table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "plans_vs_expert.json"))
    ap.add_argument("--smoke", action="store_true", help="the MLP only: checks that it runs")
    a = ap.parse_args(argv)
    models = {"mlp": lambda: (MLP(), inputs("mlp")[0]),
              "transformer": lambda: (TransformerBlock(), inputs("transformer")[0]),
              "conv": lambda: (ConvNet(), inputs("conv")[0])}
    if a.smoke:
        models = {"mlp": models["mlp"]}
    rows = []
    for model, make in models.items():
        m, x = make()
        ref_l, ref_g = step(m, x)
        ref = (ref_l, jax.tree.leaves(nnx.state(ref_g)))
        f, args = expert(model, m, x)
        el, eg = f(*args)
        rep = ms.comm_report(f, *args)
        exp_bytes = sum(v["bytes"] for v in rep.by_kind.values())
        rows.append({"model": model, "plan": "expert", "by_kind": rep.by_kind,
                     "bytes": exp_bytes, "count": rep.total_count, "ratio": 1.0,
                     "max_err_vs_one_device": max_err((el, jax.tree.leaves(eg)), ref)})
        for mode in SEARCH_MODES:
            ms.reset_auto_parallel_context()
            with ms.parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8):
                region = ms.jit(step)
                lval, g = region(m, x)
                plan = region.plan(m, x)
                rep = ms.comm_report(region, m, x)
            b = sum(v["bytes"] for v in rep.by_kind.values())
            rows.append({"model": model, "plan": mode, "by_kind": rep.by_kind, "bytes": b, "count": rep.total_count,
                         "ratio": b / exp_bytes if exp_bytes else float("inf") if b else 1.0,
                         "predicted_cost": plan.cost.total, "search_s": plan.seconds,
                         "max_err_vs_one_device": max_err((lval, jax.tree.leaves(nnx.state(g))), ref)})
    kinds = sorted({k for r in rows for k in r["by_kind"]})
    t = Table(title="one training step on 8 devices: collectives in the compiled HLO (per device)")
    for col in ["model", "plan", *[f"{k} n / bytes" for k in kinds], "total bytes", "vs expert", "collectives",
                "predicted cost", "max |err|"]:
        t.add_column(col, no_wrap=True, justify="left" if col in ("model", "plan") else "right")
    for r in rows:
        cells = [f"{r['by_kind'][k]['count']} / {r['by_kind'][k]['bytes']:,}" if k in r["by_kind"] else "-"
                 for k in kinds]
        t.add_row(r["model"], r["plan"], *cells, f"{r['bytes']:,}", f"{r['ratio']:.2f}", str(r["count"]),
                  f"{r['predicted_cost']:.4g}" if "predicted_cost" in r else "-", f"{r['max_err_vs_one_device']:.1e}")
    Console(width=max(200, Console().width)).print(t)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1, default=float))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
