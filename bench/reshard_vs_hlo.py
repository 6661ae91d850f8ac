"""The redistributions of mshard's programs against XLA's own, layout pair by pair and on the bench nets.

    .venv/bin/python bench/reshard_vs_hlo.py [--sample N] [--nets mlp,transformer,...] [--out ...json]
    .venv/bin/python bench/reshard_vs_hlo.py --smoke     # 3 pairs per case, the MLP's expert plan

**Pairs.** For each mesh and tensor rank: every pair of layouts (each mesh axis on one tensor dim or none, every
order inside a dim), or a fixed random sample of N pairs; each pair is compiled as ``jax.jit(x * 2)`` from a
``src`` input constrained to ``dst`` (``with_sharding_constraint``) and its HLO collectives are compared kind by
kind (bytes moved per device) with the cost model's simulation of XLA (``searchers.xla_reshard``): ``exact``.
Where the executor runs the change itself (``searchers.direct_reshard``: one collective per moved mesh axis, where
that moves less than XLA's), the pair is compiled again through ``mshard._src.runtime.redistribute`` and both
programs' bytes are reported (``direct``: pairs, XLA's bytes, the executor's bytes, and how many of those equal the
direct steps' prediction).

**Nets** (``--nets``, default every model of ``bench/plans_vs_baselines.py``). One SGD training step of each net
under its expert (semi_auto Megatron) plan and sharding_propagation's and dynamic_programming's searched plans,
dataset ``full_batch``, compiled twice: *before* (every redistribution left to XLA and priced so:
``searchers.direct_reshard.xla_only``) and *after*. Per plan: the HLO bytes moved per device before and after, each
layout change the executor runs itself (op, operand, shape, layouts, XLA's bytes and its own), and the largest
difference of every parameter after the step from plain flax + optax on one device, both programs.

JSON (``--out``, default bench/out/reshard_vs_hlo.json): ``{"pairs": [{"mesh", "shape", "pairs", "exact",
"differ", "direct"}], "nets": [{"model", "plan", "moved_before", "moved_after", "ratio", "changes",
"max_err_before", "max_err_after"}]}``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
from collections import Counter
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from plans_vs_baselines import _models
from reference import train_one_device

import mshard as ms
from mshard import nn
from mshard._src.edges.comm_report import CommReport
from mshard._src.runtime.redistribute import redistribute
from mshard._src.values.layout import DeviceMesh
from searchers.direct_reshard import cheaper_than_xla, steps, xla_only
from searchers.xla_reshard import reshard

CASES = [((2, 4), (16, 32)), ((4, 2), (16, 32)), ((8,), (16, 32)), ((2, 2, 2), (16, 32)), ((2, 4), (8, 16, 32)),
         ((2, 2, 2), (8, 16, 32))]


def layouts(rank: int, naxes: int):
    out = set()
    for place in itertools.product(range(-1, rank), repeat=naxes):
        dims = [[a for a in range(naxes) if place[a] == d] for d in range(rank)]
        for perms in itertools.product(*[list(itertools.permutations(x)) for x in dims]):
            out.add(tuple(tuple(p) for p in perms))
    return sorted(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sample", type=int, default=0, help="pairs per case (0: all)")
    ap.add_argument("--out", default=str(_cpu8.ROOT / "bench" / "out" / "reshard_vs_hlo.json"))
    ap.add_argument("--smoke", action="store_true", help="3 pairs per case and the MLP's expert plan: that it runs")
    ap.add_argument("--nets", default="mlp,transformer,conv,embed,gpt,flax_minigpt",
                    help="bench nets whose training step is measured before and after ('none': the pairs only)")
    args = ap.parse_args()
    if args.smoke:
        args.sample, args.nets = 3, "mlp"
    rows = []
    for mesh_shape, shape in CASES:
        names = tuple(f"a{i}" for i in range(len(mesh_shape)))
        mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(names))
        ls = layouts(len(shape), len(mesh_shape))
        pairs = [(s, d) for s in ls for d in ls]
        if args.sample and args.sample < len(pairs):
            pairs = random.Random(0).sample(pairs, args.sample)
        nbytes = 4 * int(np.prod(shape))
        differ = []
        direct = {"pairs": 0, "xla_moved": 0.0, "direct_moved": 0.0, "as_predicted": 0}
        for s, d in pairs:
            def spec(lay, names=names):
                return P(*[tuple(names[a] for a in ax) if ax else None for ax in lay])
            # the value constrained to dst, as the executor constrains an op's operand (a jit's out_shardings
            # goes through XLA's sharding merge first: another path, see tests/e2e/search/test_reshard_model.py)
            target = NamedSharding(mesh, spec(d))
            f = jax.jit(lambda x, t=target: jax.lax.with_sharding_constraint(x * 2, t),
                        in_shardings=NamedSharding(mesh, spec(s)))
            rep = CommReport.from_hlo(f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text())
            real = Counter({k: v["moved"] for k, v in rep.by_kind.items()})
            pred: Counter = Counter()
            for st in reshard(s, d, mesh_shape, shape):
                pred[st.kind] += st.moved * nbytes
            if set(real) != set(pred) or any(abs(real[k] - pred[k]) > 1e-9 * real[k] for k in real):
                differ.append({"src": s, "dst": d, "model": dict(pred), "hlo": dict(real)})
            if cheaper_than_xla(s, d, mesh_shape):
                # the executor's own change of the pair (its direct steps), compiled
                dm = DeviceMesh(mesh_shape, names)
                g = jax.jit(lambda x, s=s, d=d, nm=names, dm=dm: redistribute(x * 2, _names(s, nm), _names(d, nm), dm),
                            in_shardings=NamedSharding(mesh, spec(s)))
                mine = CommReport.from_hlo(g.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text())
                got = sum(v["moved"] for v in mine.by_kind.values())
                want = sum(st.moved for st in steps(s, d, mesh_shape)) * nbytes
                direct["pairs"] += 1
                direct["xla_moved"] += sum(real.values())
                direct["direct_moved"] += got
                direct["as_predicted"] += abs(got - want) <= 1e-9 * max(want, 1.0)
        rows.append({"mesh": mesh_shape, "shape": shape, "pairs": len(pairs), "exact": len(pairs) - len(differ),
                     "differ": differ, "direct": direct})
        ratio = direct["direct_moved"] / direct["xla_moved"] if direct["xla_moved"] else 1.0
        print(f"mesh {mesh_shape} rank {len(shape)}: {len(pairs) - len(differ)} of {len(pairs)} pairs exact; "
              f"{direct['pairs']} run directly, {ratio:.2f} of XLA's bytes ({direct['as_predicted']} as predicted)",
              flush=True)
    nets = [] if args.nets == "none" else net_rows(args.nets.split(","), ("expert",) if args.smoke else PLANS)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"pairs": rows, "nets": nets}, indent=1))
    print(json.dumps({"pairs": [{k: v for k, v in r.items() if k != "differ"} for r in rows],
                      "nets": [{k: v for k, v in r.items() if k != "changes"} for r in nets]}))


def _names(lay, names):
    return tuple(tuple(names[a] for a in ax) for ax in lay)


PLANS = ("expert", "sharding_propagation", "dynamic_programming")


def net_rows(models: list[str], plans) -> list[dict]:
    """One training step of each bench net under each plan, before and after direct redistributions."""
    builds = _models()
    rows = []
    for name in models:
        for plan in plans:
            got = {}
            for when in ("before", "after"):
                m, loss_cell, data, _, expert = builds[name]()
                if plan == "expert":
                    if expert is None:
                        break
                    expert(m)
                # one device trains the loss cell itself (its output is the loss; the label slot is a dummy)
                ref = train_one_device(loss_cell(m), optax.sgd(0.01), [(*data, np.zeros((), np.float32))],
                                       lambda out, _: out)[0]
                ctx = dict(parallel_mode="semi_auto_parallel") if plan == "expert" else dict(
                    parallel_mode="auto_parallel", search_mode=plan)
                with (xla_only() if when == "before" else contextlib.nullcontext()), ms.parallel_context(
                        device_num=8, gradients_mean=True, dataset_strategy="full_batch", **ctx):
                    step = nn.TrainOneStepCell(loss_cell(m), optax.sgd(0.01))
                    rep = ms.comm_report(step, *data)
                    p = step.plan(*data)
                    step(*data)
                err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                          for a, b in zip(jax.tree.leaves(nnx.state(m, nnx.Param)),
                                          jax.tree.leaves(nnx.state(ref, nnx.Param)), strict=True))
                got[when] = (sum(v["moved"] for v in rep.by_kind.values()), err, p)
            if len(got) < 2:
                continue
            (before, e0, _), (after, e1, p) = got["before"], got["after"]
            changes = [{"op": r.op, "operand": r.operand, "shape": r.shape, "src": r.src_axes, "dst": r.dst_axes,
                        "xla_bytes": r.xla_bytes, "bytes": sum(r.communication.values())}
                       for r in p.redistributions if r.xla_bytes is not None]
            rows.append({"model": name, "plan": plan, "moved_before": before, "moved_after": after,
                         "ratio": after / before if before else 1.0, "changes": changes,
                         "max_err_before": e0, "max_err_after": e1})
            print(f"{name:13s} {plan:22s} moved per device {before:12,.0f} -> {after:12,.0f} B "
                  f"({rows[-1]['ratio']:.2f}); {len(changes)} layout changes run directly; max |param - one "
                  f"device| {e0:.1e} / {e1:.1e}", flush=True)
    return rows


if __name__ == "__main__":
    main()
