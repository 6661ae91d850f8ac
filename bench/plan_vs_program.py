"""A training step's plan against its compiled program, over searchers and training settings.

    .venv/bin/python bench/plan_vs_program.py [--nets gpt,gpt4,mlp,...] [--modes semi_auto,...] [--out PATH]
    .venv/bin/python bench/plan_vs_program.py --smoke      # the GPT under semi_auto, two settings: that it runs

For each net, mode and setting: one ``TrainOneStepCell`` (SGD) is planned (``step.plan``) and compiled, and the
plan's bytes per device per collective kind are compared with the compiled HLO's, read without mshard's code
(``tests/helpers.py`` ``trip_moved``: each collective's result size and group size by the ring formulas, each loop
counted by its trip count). ``equal``: every kind equal to the byte (rounded).

Nets: ``gpt`` the TinyGPT of ``tests/train_helpers.py`` with ``shard_megatron(2, 4)`` on 8 devices (batch 16 x 8
tokens), ``gpt4`` the same with ``shard_megatron(2, 2)`` on 4 devices, and ``examples/models.py``'s ``mlp``,
``transformer``, ``conv`` and ``embed`` (no strategies; an MSE loss against a fixed target, the embedding classifier
its own loss). Modes: semi_auto_parallel and auto_parallel under each search_mode. Settings: none, optimizer level
1/2/3 (``parallel_optimizer_threshold`` 0), recompute (the GPT's blocks), 2 accumulated micro-batches, a comm_fusion
setting (all-reduce buckets of 32 MB, reduce-scatter ones under an optimizer level), and combinations.

Prints a table and writes JSON (bench/out/plan_vs_program.json, ``--out``): one row per step, with both byte
dictionaries. A setting a net refuses (a batch its micro-batches and replicas do not divide) is a row with its error.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported, quiet XLA, paths

ROOT = _cpu8.ROOT
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from helpers import trip_moved  # noqa: E402
from models import MODELS, inputs  # noqa: E402
from train_helpers import TinyGPT, batches, token_loss  # noqa: E402

import mshard as ms  # noqa: E402
from mshard import nn  # noqa: E402

MODES = {"semi_auto": {"parallel_mode": "semi_auto_parallel"}} | {
    s: {"parallel_mode": "auto_parallel", "search_mode": s}
    for s in ("dynamic_programming", "recursive_programming", "sharding_propagation", "ilp")}
LEVEL = {"enable_parallel_optimizer": True}
SETTINGS = {   # name -> (context keywords, recompute the GPT's blocks, micro-batches)
    "none": ({}, False, 0),
    "level1": ({**LEVEL, "parallel_optimizer_config": {"optimizer_level": "level1", "parallel_optimizer_threshold": 0}},
               False, 0),
    "level2": ({**LEVEL, "parallel_optimizer_config": {"optimizer_level": "level2", "parallel_optimizer_threshold": 0}},
               False, 0),
    "level3": ({**LEVEL, "parallel_optimizer_config": {"optimizer_level": "level3", "parallel_optimizer_threshold": 0}},
               False, 0),
    "recompute": ({}, True, 0),
    "accumulate2": ({}, False, 2),
    "fused": ({"comm_fusion": {"allreduce": {"mode": "size", "config": 32}}}, False, 0),
    "level3+recompute": ({**LEVEL, "parallel_optimizer_config": {"optimizer_level": "level3",
                                                                "parallel_optimizer_threshold": 0}}, True, 0),
    "level1+accumulate2": ({**LEVEL, "parallel_optimizer_config": {"optimizer_level": "level1",
                                                                  "parallel_optimizer_threshold": 0}}, False, 2),
    "level3+fused": ({**LEVEL, "parallel_optimizer_config": {"optimizer_level": "level3",
                                                            "parallel_optimizer_threshold": 0},
                      "comm_fusion": {"reducescatter": {"mode": "size", "config": 32}}}, False, 0),
}
NETS = ("gpt", "gpt4", "mlp", "transformer", "conv", "embed")
_TARGET = {"mlp": (32, 64), "transformer": (8, 16, 64), "conv": (16, 8)}


def _mse(pred, y):
    return jnp.mean((pred - y) ** 2)


def _step(net_name: str, recompute: bool, micro: int):
    """(TrainOneStepCell, its batch) of one net (module doc)."""
    if net_name in ("gpt", "gpt4"):
        net = TinyGPT(nnx.Rngs(0))
        for b in net.blocks:
            b.shard_megatron(2, 4 if net_name == "gpt" else 2)
            if recompute:
                b.recompute()
        loss = nn.WithLossCell(net, token_loss)
        args = batches(1, [(16, 8), (16, 8)], seed=2, ints=(32, 32))[0]
    else:
        net = MODELS[net_name]()
        xs = inputs(net_name)
        loss = net if net_name == "embed" else nn.WithLossCell(net, _mse)
        args = xs if net_name == "embed" else xs + (jax.random.normal(jax.random.key(5), _TARGET[net_name]),)
    if micro:
        loss = nn.GradAccumulationCell(loss, micro)
    return nn.TrainOneStepCell(loss, optax.sgd(0.1)), tuple(args)


def measure(net_name: str, mode: str, setting: str) -> dict:
    kw, recompute, micro = SETTINGS[setting]
    row = {"net": net_name, "mode": mode, "setting": setting}
    ms.reset_auto_parallel_context()
    ms.set_auto_parallel_context(device_num=4 if net_name == "gpt4" else 8, gradients_mean=True, **MODES[mode], **kw)
    try:
        step, args = _step(net_name, recompute, micro)
        plan = step.plan(*args)
        hlo = step.lower(*args).compile().as_text()
    except Exception as e:      # a setting the net refuses: recorded, not hidden
        return row | {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        ms.reset_auto_parallel_context()
    program = {k: round(v) for k, v in trip_moved(hlo).items() if round(v)}
    planned = {k: round(v) for k, v in plan.cost.communication.items() if round(v)}
    return row | {"planned": planned, "program": program, "equal": planned == program,
                  "program_total": sum(program.values()), "search_s": round(plan.seconds, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nets", default=",".join(NETS))
    ap.add_argument("--modes", default="semi_auto,dynamic_programming,recursive_programming,sharding_propagation")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "plan_vs_program.json"))
    ap.add_argument("--smoke", action="store_true", help="the GPT under semi_auto, two settings")
    args = ap.parse_args()
    nets, modes, settings = args.nets.split(","), args.modes.split(","), args.settings.split(",")
    if args.smoke:
        nets, modes, settings = ["gpt"], ["semi_auto"], ["none", "level3+fused"]
    warnings.simplefilter("ignore")
    rows = []
    for net_name in nets:
        for mode in modes:
            for setting in settings:
                rows.append(r := measure(net_name, mode, setting))
                print(json.dumps(r), flush=True)
    from rich.console import Console
    from rich.table import Table
    t = Table(title="a training step's plan against its compiled program, bytes per device")
    for c in ("net", "mode", "setting", "program total", "equal", "planned", "program"):
        t.add_column(c)
    for r in rows:
        if "error" in r:
            t.add_row(r["net"], r["mode"], r["setting"], "-", "refused", r["error"][:60], "")
        else:
            t.add_row(r["net"], r["mode"], r["setting"], f"{r['program_total']:,}", "yes" if r["equal"] else "NO",
                      json.dumps(r["planned"]), json.dumps(r["program"]))
    ran = [r for r in rows if "error" not in r]
    Console(width=200).print(t)
    print(f"plan = program: {sum(r['equal'] for r in ran)} of {len(ran)} steps ({len(rows) - len(ran)} refused)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
