"""Plans that fit device_memory_capacity: a GPT-1.3B-shaped training step on 8 simulated devices, compiled, not run.

    python bench/memory_fit.py                       # GPT-1.3B shape: 24 blocks, d 2048, ffn 8192, vocab 50304
    python bench/memory_fit.py --smoke               # a small GPT, capacity scaled down, recursive_programming only

The step is ``TrainOneStepCell(WithLossCell(GPT), optax.adamw)`` with a batch of 8 sequences of 1024 tokens. It is
built under ``nnx.eval_shape`` (no weight is allocated) and compiled by ``ms.dry_run`` (XLA:CPU's buffer assignment
for 8 simulated devices; nothing runs). Rows:

- ``data_parallel``: the baseline, no search and no fit;
- one row per cost-model searcher in ``auto_parallel`` (``--searchers``): the fit (``mshard._src.training.memory_fit``)
  keeps the searched plan if the cost model's peak fits ``device_memory_capacity``, else raises the optimizer level.

Columns: ``predicted`` (the cost model's peak of the step the fit kept, bytes per device; none for data parallel),
``compiled`` (arguments + temp + outputs - aliased, from the compiled step's ``memory_analysis``), ``stored`` (the
compiled arguments: parameters and optimizer state), ``level`` (the optimizer level the fit chose), ``fits`` (both
within the capacity), ``seconds`` (plan and compile), each row's ``ratio_compiled`` to data parallel. The JSON
(``--out``, default ``bench/out/memory_fit.json``) holds ``config`` and ``rows``.
"""

import argparse
import json
import time
from pathlib import Path

import _cpu8  # noqa: F401  first: 8 simulated CPU devices before JAX is imported, quiet XLA, paths
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from gpt import GPT

import mshard as ms
from mshard import nn

GIB = 2 ** 30
SHAPES = {
    "gpt1.3b": dict(vocab=50304, hidden=2048, heads=16, ffn=8192, seq=1024, layers=24),
    "smoke": dict(vocab=8192, hidden=512, heads=8, ffn=2048, seq=256, layers=2),
}


def _loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def measure(shape: dict, mode: str, search_mode: str | None, capacity: float) -> dict:
    kw = dict(parallel_mode=mode, device_num=8, gradients_mean=True)
    if search_mode:
        kw["search_mode"] = search_mode
    ms.set_auto_parallel_context(**kw)
    ms.set_cost_model_context(device_memory_capacity=capacity)
    t0 = time.perf_counter()
    step = nnx.eval_shape(lambda: nn.TrainOneStepCell(nn.WithLossCell(GPT(nnx.Rngs(0), **shape), _loss),
                                                      optax.adamw(1e-4)))
    ids = jnp.zeros((8, shape["seq"]), jnp.int32)
    with ms.dry_run(quiet=True) as dr:
        step(ids, ids)
    seconds = time.perf_counter() - t0
    plan = step._rt.plan(step, (ids, ids))
    m = dr.report["memory"]
    compiled = m["argument_bytes"] + m["temp_bytes"] + m["output_bytes"] - m["alias_bytes"]
    level = plan.optimizer_level
    predicted = plan.memory.total if plan.memory is not None else None
    ms.reset_auto_parallel_context()
    ms.set_cost_model_context(device_memory_capacity=16 * GIB)
    return {"predicted": predicted, "compiled": compiled, "stored": m["argument_bytes"], "level": level,
            "fits": compiled <= capacity and (predicted is None or predicted <= capacity),
            "notes": list(plan.notes), "seconds": round(seconds, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a 2-block GPT of width 512, capacity 1/64: that it runs")
    ap.add_argument("--searchers", default=None,
                    help="comma-separated cost-model search modes (default dynamic_programming,recursive_programming; "
                         "--smoke: recursive_programming; ilp's memory rows on this graph take minutes)")
    ap.add_argument("--capacity_gib", type=float, default=16.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "memory_fit.json"))
    args = ap.parse_args(argv)
    shape = SHAPES["smoke" if args.smoke else "gpt1.3b"]
    if args.searchers is None:
        args.searchers = "recursive_programming" if args.smoke else "dynamic_programming,recursive_programming"
    # the smoke's GPT needs about 1/64 of GPT-1.3B's memory: the capacity scales with it
    capacity = args.capacity_gib * GIB / (64 if args.smoke else 1)
    rows = [{"plan": "data_parallel", **measure(shape, "data_parallel", None, capacity)}]
    for s in filter(None, args.searchers.split(",")):
        rows.append({"plan": s, **measure(shape, "auto_parallel", s, capacity)})
    base = rows[0]["compiled"]
    for r in rows:
        r["ratio_compiled"] = r["compiled"] / base
        pred = "-" if r["predicted"] is None else f"{r['predicted'] / GIB:.2f}"
        print(f"{r['plan']:22s} predicted {pred:>6s} GiB  compiled {r['compiled'] / GIB:6.2f} GiB  stored "
              f"{r['stored'] / GIB:6.2f} GiB  level {r['level'] or '-':8s} fits {r['fits']!s:5s} "
              f"x{r['ratio_compiled']:.3f} of data parallel  {r['seconds']} s", flush=True)
    out = {"config": {**shape, "batch": 8, "devices": jax.device_count(), "capacity": capacity,
                      "platform": jax.devices()[0].platform}, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
