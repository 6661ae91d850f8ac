"""Dispatch cost of PyNative-style eager calls: a primitive with a strategy called eagerly (its own region) and a
bound region, against ``jax.jit`` with the same shardings, on small inputs where dispatch dominates.

    python bench/eager.py [--calls 300] [--repeats 5] [--out bench/out/eager.json]

Timed: ``--calls`` back-to-back calls, then one block; best of ``--repeats``; microseconds per call and the
ratios to ``jax.jit`` (the issue asks <= 1.1 for cached eager calls).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import _cpu8  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mshard as ms
from mshard import ops


def _per_call(fn, args, calls: int, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "eager.json"))
    a = ap.parse_args()
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=jax.device_count())
    x = jnp.ones((16, 32), jnp.float32)
    w = jnp.ones((32, 64), jnp.float32)
    mm = ops.MatMul().shard(((2, 1), (1, 4)))
    y = mm(x, w)                                         # compiles the op's region
    xs, ws = (jax.device_put(v, sh) for v, sh in zip((x, w), mm._eager_region._prepare((x, w), {})[0].in_shardings))
    mesh = y.sharding.mesh
    hand = jax.jit(lambda a, b: a @ b, in_shardings=(xs.sharding, ws.sharding),
                   out_shardings=NamedSharding(mesh, y.sharding.spec))
    lin = nnx.Linear(32, 64, rngs=nnx.Rngs(0))
    f = ms.shard(lin, in_strategy=((2, 1),), parameter_plan={"kernel": (1, 4)})
    bound = f.bind()
    f(x)
    hand_lin = jax.jit(lambda k, b, v: v @ k + b, in_shardings=(lin.kernel[...].sharding, lin.bias[...].sharding,
                                                                NamedSharding(mesh, P(tuple(mesh.axis_names[:1])))))
    res = {"platform": jax.devices()[0].platform, "devices": jax.device_count(),
           "eager_primitive_us": _per_call(mm, (xs, ws), a.calls, a.repeats),
           "jax_jit_matmul_us": _per_call(hand, (xs, ws), a.calls, a.repeats),
           "bound_module_us": _per_call(bound, (x,), a.calls, a.repeats),
           "unbound_module_us": _per_call(f, (x,), a.calls, a.repeats),
           "jax_jit_linear_us": _per_call(hand_lin, (lin.kernel[...], lin.bias[...], x), a.calls, a.repeats)}
    res["ratio_eager_primitive_vs_jax_jit"] = res["eager_primitive_us"] / res["jax_jit_matmul_us"]
    res["ratio_bound_module_vs_jax_jit"] = res["bound_module_us"] / res["jax_jit_linear_us"]
    res["ratio_unbound_module_vs_jax_jit"] = res["unbound_module_us"] / res["jax_jit_linear_us"]
    if not np.allclose(np.asarray(mm(xs, ws)), np.asarray(hand(xs, ws))):
        raise SystemExit("bench/eager.py: the eager primitive and jax.jit disagree")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
