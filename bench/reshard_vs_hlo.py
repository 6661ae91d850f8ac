"""The cost model's redistributions (searchers.xla_reshard) beside the collectives XLA compiles, layout pair by pair.

    .venv/bin/python bench/reshard_vs_hlo.py [--sample N] [--out bench/out/reshard_vs_hlo.json]
    .venv/bin/python bench/reshard_vs_hlo.py --smoke     # 3 pairs per case: that it runs and writes its JSON

For each mesh and tensor rank: every pair of layouts (each mesh axis on one tensor dim or none, every order inside a
dim), or a fixed random sample of N pairs; each pair is compiled as ``jax.jit(x * 2)`` from a ``src`` input
constrained to ``dst`` (``with_sharding_constraint``, as the executor does) and its HLO collectives are compared
kind by kind (bytes moved per device) with the model's. Prints a table and writes bench/out/reshard_vs_hlo.json
(``--out``), with the pairs that differ.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections import Counter
from pathlib import Path

import _cpu8  # first: 8 simulated CPU devices before JAX is imported
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from mshard._src.edges.comm_report import CommReport
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
    ap.add_argument("--smoke", action="store_true", help="a sample of 3 pairs per case: checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.sample = 3
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
        rows.append({"mesh": mesh_shape, "shape": shape, "pairs": len(pairs), "exact": len(pairs) - len(differ),
                     "differ": differ})
        print(f"mesh {mesh_shape} rank {len(shape)}: {len(pairs) - len(differ)} of {len(pairs)} pairs exact",
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(json.dumps([{k: v for k, v in r.items() if k != "differ"} for r in rows]))


if __name__ == "__main__":
    main()
