"""Pipeline parallel: the bubble of each schedule, the memory of the compiled step, and the step time against the
same model without stages.

    python bench/pipeline.py [--out bench/out/pipeline.json] [--skip-time] [--repeats 5]
    python bench/pipeline.py --smoke     # S = 2, M = 4, 1f1b+recompute only, 1 repeat: that it runs and writes its JSON

- ``bubble``: for S in {2, 4}, M in {4, 8, 16} and each schedule (gpipe, 1f1b, interleaved with v = 2 chunks), the
  idle stage-ticks over all stage-ticks of the tick table the executor runs (mshard._src.training.pipeline.schedule), beside the
  textbook formula (S-1)/(M+S-1), interleaved (S-1)/(v*M+S-1).
- ``memory``: the examples GPT (4 blocks, hidden 64, seq 32) trained through nn.PipelineCell with a fixed
  micro-batch of 8 sequences (the batch is 8*M), S = 2 and 4, M = 4, 8, 16, and the schedules: gpipe and 1f1b
  (every forward's residuals kept until its backward), gpipe+recompute and 1f1b+recompute (the blocks with
  ``recompute()``: their inputs kept, their forwards recomputed at backward time), and 1f1b-stage-recompute (the
  executor's ``keep_residuals=False``: only stage inputs kept, each stage's whole forward recomputed): per-device
  ``temp_size_in_bytes`` and ``argument_size_in_bytes`` of the compiled step (``memory_analysis()``), its FLOPs
  (``cost_analysis()``, which counts a loop's body once: the pipelined rows, one scan over the ticks each, compare
  with each other, not with the unrolled step without stages), and the parameter bytes one device holds, beside
  the same step without stages (data parallel on the 8 devices).
- ``moved``: bytes per device the compiled step moves on its busiest stage, by collective kind (each loop by its trip
  count, each branch of the schedule's conditional as often as the schedule runs it), for S in {2, 4}, M in {4, 8}
  and gpipe, 1f1b, 1f1b+recompute, beside the plan's bytes (equal kind by kind) and the same step without stages
  (data parallel on the 8 devices), with the ratio; and on 2 stages 1f1b with Megatron blocks inside the stages
  (``shard_megatron(2, 2)``, ``(1, 4)``), whose plan leaves the stages' model-parallel collectives out
  (``priced`` false).
- ``time``: seconds per step (median of ``--repeats`` after a warm-up) of the pipelined step and of the same step
  without stages on the same devices, and their ratio, measured in the same run.

On CPU the stages share 2 cores, so the time ratio says what the program costs, not what overlap a GPU gives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import _cpu8  # 8 simulated CPU devices, before JAX
import jax
import numpy as np
import optax
from flax import nnx

import mshard as ms
from mshard import nn
from mshard._src.training.pipeline.run import ring_size
from mshard._src.training.pipeline.schedule import bubble_formula, make_schedule

MB = 8       # sequences per micro-batch


def bubble_rows() -> list[dict]:
    rows = []
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for S in (2, 4):
            for M in (4, 8, 16):
                s = make_schedule(name, stages=S, micro=M, chunks=v)
                rows.append({"schedule": name, "S": S, "M": M, "chunks": v, "ticks": s.ticks, "bubble": s.bubble(),
                             "formula": bubble_formula(name, S, M, v), "ring_slots": ring_size(s),
                             "in_flight": s.in_flight()})
    return rows


def _gpt(S: int):
    from train_gpt import LOSS, make_gpt
    net = make_gpt(nnx.Rngs(0), layers=4)
    if S > 1:
        net.embedding.pipeline_stage = net.position.pipeline_stage = 0
        for i, b in enumerate(net.blocks):
            b.pipeline_stage = min(i * S // 4, S - 1)
        net.final_norm.pipeline_stage = net.head.pipeline_stage = S - 1
    return nn.WithLossCell(net, LOSS)


def _batch(M: int):
    """``M * MB`` sequences of the affine recurrence of examples/train_gpt.py (ids, next ids)."""
    rng = np.random.default_rng(0)
    x = np.empty((M * MB, 33), np.int32)
    x[:, 0] = rng.integers(0, 64, M * MB)
    for i in range(32):
        x[:, i + 1] = (5 * x[:, i] + 3) % 64
    return x[:, :-1], x[:, 1:]


SCHEDULES = ("gpipe", "gpipe+recompute", "1f1b", "1f1b+recompute", "1f1b-stage-recompute")


def _step(S: int, M: int, sched: str):
    """``sched``: one of :data:`SCHEDULES` (module doc)."""
    import functools

    import mshard._src.training.pipeline.cells as nn_pipeline
    from mshard._src.training.pipeline import run
    nn_pipeline.run_pipeline = functools.partial(run.run_pipeline,
                                                 keep_residuals=not sched.endswith("-stage-recompute"))
    ctx = dict(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True, pipeline_stages=S,
               pipeline_config={"pipeline_scheduler": sched.split("+")[0].split("-")[0]})
    ms.set_auto_parallel_context(**ctx)
    net = _gpt(S)
    if sched.endswith("+recompute"):
        for b in net.backbone.blocks:
            b.recompute()
    if "+megatron" in sched:            # "1f1b+megatron2x2": shard_megatron(2, 2) on every block
        dp, mp = map(int, sched.split("+megatron")[1].split("x"))
        for b in net.backbone.blocks:
            b.shard_megatron(data_parallel=dp, model_parallel=mp)
    cell = nn.PipelineCell(net, M) if S > 1 else net
    return nn.TrainOneStepCell(cell, optax.sgd(0.01)), net


def _param_bytes_per_device(net) -> int:
    total = 0
    for x in jax.tree.leaves(nnx.state(net, nnx.Param)):
        shard = x.addressable_shards[0].data
        total += shard.size * shard.dtype.itemsize
    return total


def memory_rows(stages=(2, 4), micro=(4, 8, 16), schedules=SCHEDULES) -> list[dict]:
    rows = []
    for S in stages:
        for M in micro:
            x, y = _batch(M)
            for sched in tuple(schedules) + ("no stages",):
                step, net = _step(1, M, "1f1b") if sched == "no stages" else _step(S, M, sched)
                compiled = step.lower(x, y).compile()
                mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, list) else cost
                step(x, y)
                rows.append({"S": S, "M": M, "schedule": sched, "temp_bytes": int(mem.temp_size_in_bytes),
                             "argument_bytes": int(mem.argument_size_in_bytes), "flops": float(cost["flops"]),
                             "param_bytes_per_device": _param_bytes_per_device(net)})
    ms.reset_auto_parallel_context()
    return rows


MOVED = ("gpipe", "1f1b", "1f1b+recompute", "1f1b+megatron2x2", "1f1b+megatron1x4")


def moved_rows(stages=(2, 4), micro=(4, 8), schedules=MOVED) -> list[dict]:
    """Bytes per device the compiled step moves, by collective kind, on its busiest stage's devices (tests/helpers.py
    ``busiest_stage_moved``: each loop by its trip count, each branch of the schedule's conditional as often as the
    schedule runs it), beside the plan's figure and the same step without stages (data parallel on 8 devices)."""
    sys.path.insert(0, str(_cpu8.ROOT / "tests"))
    from helpers import busiest_stage_moved, trip_moved
    rows = []
    for S in stages:
        for M in micro:
            x, y = _batch(M)
            base, _ = _step(1, M, "1f1b")
            dp = sum(trip_moved(base.lower(x, y).compile().as_text()).values())
            for sched in schedules:
                if "+megatron" in sched and S != 2:        # the strategies are for a stage of 4 devices
                    continue
                step, _ = _step(S, M, sched)
                plan = step.plan(x, y)
                hlo = step.lower(x, y).compile().as_text()
                moved = busiest_stage_moved(hlo, S, M, 1, plan.pipeline.ticks, sched == "gpipe")
                total = sum(moved.values())
                rows.append({"S": S, "M": M, "schedule": sched, "hlo_bytes": total,
                             "plan_bytes": sum(plan.cost.communication.values()),
                             "all_reduce_bytes": moved.get("all-reduce", 0.0),
                             "plan_equals_hlo": plan.cost.communication == moved,
                             "priced": not any("not in this plan's bytes" in n for n in plan.notes), "no_stages_bytes": dp,
                             "ratio_to_no_stages": total / dp,
                             "stage_replicas": "its replica of the stage" in plan.pipeline.in_stage})
    ms.reset_auto_parallel_context()
    return rows


def _time(step, x, y, repeats: int) -> float:
    float(step(x, y))
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(step(x, y))
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def time_rows(repeats: int, cases=((2, 8), (4, 8)), schedules=SCHEDULES) -> list[dict]:
    rows = []
    for S, M in cases:
        x, y = _batch(M)
        base, _ = _step(1, M, "1f1b")
        t0 = _time(base, x, y, repeats)
        for sched in schedules:
            step, _ = _step(S, M, sched)
            t = _time(step, x, y, repeats)
            rows.append({"S": S, "M": M, "schedule": sched, "step_s": t, "no_stages_s": t0, "ratio": t / t0,
                         "device": jax.devices()[0].platform})
    ms.reset_auto_parallel_context()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "pipeline.json"))
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-moved", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true",
                    help="S = 2, M = 4, the schedule 1f1b+recompute only, 1 repeat: checks that it runs")
    a = ap.parse_args(argv)
    # --smoke: one (S, M) and one schedule, beside the step without stages (each pipelined step compiles for seconds)
    mem_kw, time_kw, moved_kw = {}, {}, {}
    if a.smoke:
        a.repeats = 1
        mem_kw = dict(stages=(2,), micro=(4,), schedules=("1f1b+recompute",))
        time_kw = dict(cases=((2, 4),), schedules=("1f1b+recompute",))
        moved_kw = dict(stages=(2,), micro=(4,), schedules=("1f1b",))
    out = {"bubble": bubble_rows()}
    if not a.skip_moved:
        out["moved"] = moved_rows(**moved_kw)
    if not a.skip_memory:
        out["memory"] = memory_rows(**mem_kw)
    if not a.skip_time:
        out["time"] = time_rows(a.repeats, **time_kw)
    from rich.console import Console
    from rich.table import Table
    for key, rows in out.items():
        t = Table(title=key)
        for c in rows[0]:
            t.add_column(c)
        for r in rows:
            t.add_row(*[f"{v:.4f}" if isinstance(v, float) else str(v) for v in r.values()])
        Console().print(t)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({"bubble_all_equal_formula": all(abs(r["bubble"] - r["formula"]) < 1e-12 for r in out["bubble"]),
                      "moved_plan_equals_hlo": all(r["plan_equals_hlo"] for r in out.get("moved", ()) if r["priced"])}))


if __name__ == "__main__":
    main()
