"""High-resolution images split over height and width, through a stack of "same" convolutions (issue 14).

    .venv/bin/python bench/conv_halo.py [--size 256] [--out bench/out/conv_halo.json]
    .venv/bin/python bench/conv_halo.py --smoke     # 16x16 images: that it runs and writes its JSON

``examples/models.py``'s SameConvs (plain flax, NHWC: 3x3 4->8, 3x3 8->8, 5x5 8->4, ReLUs between) on a
(2, size, size, 4) batch that arrives split over height (4 ways) and width (2 ways), ``dataset_strategy=((1, 4, 2,
1),)``, on 8 simulated CPU devices. Per search_mode of auto_parallel, the forward's compiled HLO: collective count
and bytes per device by kind (``ms.comm_report``), FLOPs per device (``cost_analysis``) against the one-device
program's, and whether the values equal one device's. Run on a tree before convolutions could keep a spatial split
(163b411) to see what the searchers did then. Results go to ``--out`` as JSON and a table is printed.
"""

from __future__ import annotations

import argparse
import json

import _cpu8

ROOT = _cpu8.ROOT

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from models import SameConvs  # noqa: E402

import mshard as ms  # noqa: E402

MODES = ("sharding_propagation", "recursive_programming", "dynamic_programming", "ilp")


def _row(f, args, ref) -> dict:
    compiled = f.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    rep = ms.comm_report(f, *args)
    got = np.asarray(f(*args))
    return {"by_kind": {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in rep.by_kind.items()},
            "bytes": int(sum(v["bytes"] for v in rep.by_kind.values())), "collectives": rep.total_count,
            "flops": float(cost.get("flops", 0.0)), "max_abs_err": float(np.max(np.abs(got - ref)))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "conv_halo.json"))
    ap.add_argument("--smoke", action="store_true", help="16x16 images: checks that it runs")
    a = ap.parse_args(argv)
    if a.smoke:
        a.size = 16
    net = SameConvs()
    x = np.random.default_rng(0).standard_normal((2, a.size, a.size, 4)).astype(np.float32)
    ref = np.asarray(net(jnp.asarray(x)))
    one = jax.jit(lambda m, v: m(v)).lower(net, x).compile().cost_analysis()
    one_flops = float((one[0] if isinstance(one, list) else one).get("flops", 0.0))
    rows: dict[str, dict] = {}
    for mode in MODES:
        with ms.parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8,
                                 dataset_strategy=((1, 4, 2, 1),)):
            rows[mode] = _row(ms.jit(lambda m, v: m(v)), (net, x), ref)
    out = {"size": a.size, "one_device_flops": one_flops, "rows": rows}
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"{'plan':24} {'collectives':>11} {'bytes/device':>13} {'FLOPs vs 1 device':>18} {'max |err|':>10}  kinds")
    for name, r in rows.items():
        kinds = ", ".join(f"{k} {v['count']}" for k, v in r["by_kind"].items())
        print(f"{name:24} {r['collectives']:>11} {r['bytes']:>13,} {r['flops'] / one_flops:>18.3f} "
              f"{r['max_abs_err']:>10.2e}  {kinds}")
    print(f"JSON: {a.out}")


if __name__ == "__main__":
    main()
