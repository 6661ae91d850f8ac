"""Dispatch cost of PyNative-style eager calls: a primitive with a strategy called eagerly (its own region),
``ms.shard(module)`` called unbound and bound, against ``jax.jit`` with the same shardings, on small inputs where
dispatch dominates.

    python bench/eager.py [--calls 50] [--repeats 40] [--out bench/out/eager.json]
    python bench/eager.py --smoke         # 5 calls, 2 rounds: that it runs and writes its JSON

Timed per round: ``--calls`` back-to-back calls of each case in turn, then one block. Two figures per case,
medians over ``--repeats`` rounds: wall time per call, and the dispatching thread's CPU time per call
(``time.thread_time``: the host work of issuing the call, which the device's execution threads do not inflate).
Ratios to ``jax.jit`` are medians of per-round ratios (the issue asks <= 1.1 for cached eager calls), and
``*_fastest``: the fastest round of each over the fastest of the other (noise only adds time). On a 2-core CPU
host the 8 simulated devices execute on the same cores as the dispatching thread, so the wall ratio also counts
the execution slowed by the dispatcher's extra work. After a few calls the eager primitive goes direct
(:mod:`mshard._src.frontend.direct_call`: its class's ``__call__`` is its ``jax.jit``, no Python frame in between;
``eager_primitive_direct`` says it did). ``eager_primitive_python_us``: the Python of the fast path it used before,
per call, timed alone (the compiled program swapped for a function that returns at once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def _timed(fn, args, calls: int) -> tuple[float, float]:
    """(wall, dispatching thread's CPU) microseconds per call over ``calls`` back-to-back calls and one block."""
    w, c = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        out = fn(*args)
    c = time.thread_time() - c
    jax.block_until_ready(out)
    w = time.perf_counter() - w
    return w / calls * 1e6, c / calls * 1e6


def _rounds(cases: dict, calls: int, repeats: int) -> dict:
    """Per case, the per-round timings of ``repeats`` rounds; the cases take turns within a round (in an order
    rotated every round), so a slow spell of this shared machine falls on all of them rather than on one side of
    a ratio."""
    for fn, args in cases.values():
        jax.block_until_ready(fn(*args))
    got = {name: [] for name in cases}
    names = list(cases)
    for r in range(repeats):
        # each round starts with another case: the first case after the previous round's block would otherwise
        # always be the one that meets the device threads winding down
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, args = cases[name]
            got[name].append(_timed(fn, args, calls))
    return got


def _ratio(got: dict, case: str, base: str, which: int) -> float:
    """Median over rounds of case/base, each round's pair measured back to back."""
    return statistics.median(a[which] / b[which] for a, b in zip(got[case], got[base]))


def _ratio_of_fastest(got: dict, case: str, base: str, which: int) -> float:
    """The fastest round of ``case`` over the fastest round of ``base``: noise on a shared machine only adds time,
    so the fastest round is each call's own cost (timeit's advice); the median ratio above is the typical one."""
    return min(t[which] for t in got[case]) / min(t[which] for t in got[base])


def python_overhead_us(fast, args, calls: int = 20000) -> float:
    """mshard's own per-call Python on the eager fast path, alone: the fast path's checks with the compiled
    program replaced by a function that returns at once, minus that function called directly (microseconds)."""
    import mshard._src.runtime.fastcall as fc
    noop = lambda *a: (a[0],)
    cells = [c for c in fast.__closure__ if c.cell_contents is not None and callable(c.cell_contents)
             and getattr(c.cell_contents, "lower", None) is not None]
    (cell,) = cells                                                      # the compiled program the fast path calls
    saved, cell.cell_contents = cell.cell_contents, noop
    try:
        best = []
        for f in (lambda: fast(args), lambda: noop(*args)):
            t = []
            for _ in range(7):
                c = time.perf_counter()
                for _ in range(calls):
                    f()
                t.append((time.perf_counter() - c) / calls * 1e6)
            best.append(min(t))
        assert fc.MISS is not fast(args)
    finally:
        cell.cell_contents = saved
    return best[0] - best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "eager.json"))
    ap.add_argument("--smoke", action="store_true", help="5 calls, 2 rounds, 200 overhead calls: checks that it runs")
    a = ap.parse_args()
    if a.smoke:
        a.calls, a.repeats = 5, 2
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
    program = mm._eager_region._prepare((xs, ws), {})[0].jitted      # the op's compiled region, called directly
    got = _rounds({
        "eager_primitive": (mm, (xs, ws)),
        "its_program_directly": (program, (xs, ws)),
        "jax_jit_matmul": (hand, (xs, ws)),
        "bound_module": (bound, (x,)),
        "unbound_module": (f, (x,)),
        "jax_jit_linear": (hand_lin, (lin.kernel[...], lin.bias[...], x)),
    }, a.calls, a.repeats)
    res = {"platform": jax.devices()[0].platform, "devices": jax.device_count(), "calls": a.calls,
           "rounds": a.repeats}
    for name, ts in got.items():
        res[f"{name}_wall_us"] = statistics.median(t[0] for t in ts)
        res[f"{name}_dispatch_cpu_us"] = statistics.median(t[1] for t in ts)
    # eager_primitive / its_program_directly: mshard's own per-call Python (the fast path's checks);
    # its_program_directly / jax_jit_matmul: the compiled region against the hand-written jax.jit
    for case, base in (("eager_primitive", "jax_jit_matmul"), ("eager_primitive", "its_program_directly"),
                       ("its_program_directly", "jax_jit_matmul"), ("bound_module", "jax_jit_linear"),
                       ("unbound_module", "jax_jit_linear")):
        res[f"ratio_{case}_vs_{base}_wall"] = _ratio(got, case, base, 0)
        res[f"ratio_{case}_vs_{base}_dispatch_cpu"] = _ratio(got, case, base, 1)
        res[f"ratio_{case}_vs_{base}_wall_fastest"] = _ratio_of_fastest(got, case, base, 0)
        res[f"ratio_{case}_vs_{base}_dispatch_cpu_fastest"] = _ratio_of_fastest(got, case, base, 1)
    from mshard._src.frontend import direct_call
    res["eager_primitive_direct"] = direct_call.is_direct(mm)
    # the eager fast path's Python per call (its checks around the compiled program), timed alone
    res["eager_primitive_python_us"] = python_overhead_us(mm._eager_fast, (xs, ws), calls=200 if a.smoke else 20000)
    res["eager_primitive_python_share_of_jax_jit_dispatch"] = (res["eager_primitive_python_us"]
                                                              / res["jax_jit_matmul_dispatch_cpu_us"])
    if not np.allclose(np.asarray(mm(xs, ws)), np.asarray(hand(xs, ws))):
        raise SystemExit("bench/eager.py: the eager primitive and jax.jit disagree")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
