"""The user's Megatron MLP inside a ``while_loop`` and a ``cond``, per mode: bytes per device from the compiled HLO
against the plan's, and against the same MLP without the control flow.

    .venv/bin/python bench/branch_bodies.py [--modes semi_auto_parallel,dynamic_programming,...]
                                            [--out bench/out/branch_bodies.json]
    .venv/bin/python bench/branch_bodies.py --smoke        # semi_auto only: that it runs and writes its JSON

The MLP is MindSpore's tutorial strategies (the first MatMul ((2, 1), (1, 4)), the second ((2, 4), (4, 1))) on
x (32, 64), w1 (64, 256), w2 (256, 64), all passed as function arguments, 8 simulated CPU devices. Cases:

* ``while_static``: ``h = tanh(mlp(h))`` 3 times in a ``while_loop`` with a Python bound (XLA knows the trip count);
* ``while_argument``: the same with the bound an argument (XLA does not; the plan prices one iteration);
* ``cond``: ``cond(p, tanh(x), mlp(x))`` with ``p`` an argument (one branch runs; ``hlo_bytes`` counts every branch,
  tests/helpers.py ``trip_moved``);
* ``cond_grad``: the gradient of ``sum(cond(...) ** 2)`` with respect to both weights;
* ``cond_on_x``, ``cond_on_x_grad``: the same with the predicate ``x[0, 0] > -1e9`` (x is gathered for it, and
  arrives split over every device: the MLP's branch gathers it to its rows; in the gradient both branches gather it,
  3,072 B each: the HLO counts both, the plan the costlier, so they differ by 3,072 B);
* ``layers``, ``layers_in_while``, ``layers_in_scan``: 2 such layers with stacked weights (``nnx.Param``) run by a
  ``scan``, alone and 3 times inside a ``while_loop`` or another ``scan`` (a loop planned inside a loop's body);
* ``mlp`` and ``mlp_grad``: the same without control flow, the baseline (``ratio_to_mlp``: the case's bytes over the
  baseline's times the iterations it runs, 3 for ``while_static``, 1 otherwise).

``max_err`` is against ``jax.jit`` on one device of the same cases written with plain ``jnp`` matmuls (no mshard op).

Per row: the HLO bytes by kind, the plan's, whether they are equal, the largest difference from ``jax.jit`` of the
same cases on one device (``max_err``), and the ratio. Before while/cond bodies were planned (on 90677c8) the
weights were gathered whole for the loop or branch: run this file on that commit for the "before" column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _cpu8  # 8 simulated CPU devices, before JAX
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import mshard as ms
from mshard import ops

sys.path.insert(0, str(_cpu8.ROOT / "tests"))
from helpers import trip_moved

MODES = ("semi_auto_parallel", "sharding_propagation", "dynamic_programming", "recursive_programming")
R = np.random.default_rng(7)
X = jnp.asarray(R.normal(size=(32, 64)), jnp.float32)
W1 = jnp.asarray(R.normal(size=(64, 256)) * 0.1, jnp.float32)
W2 = jnp.asarray(R.normal(size=(256, 64)) * 0.1, jnp.float32)


def _cases(mlp):
    def loop(stop):
        return lambda x, w1, w2, n: jax.lax.while_loop(
            lambda c: c[0] < (3 if stop is None else n), lambda c: (c[0] + 1, jnp.tanh(mlp(c[1], w1, w2))), (0, x))[1]

    def branch(p, x, w1, w2):
        return jax.lax.cond(p, lambda: jnp.tanh(x), lambda: mlp(x, w1, w2))

    def on_x(p, x, w1, w2):           # the predicate reads the data (x arrives split over every device)
        return jax.lax.cond(x[0, 0] > -1e9, lambda: mlp(x, w1, w2), lambda: jnp.tanh(x))

    def grad_of(f):
        return jax.grad(lambda w1, w2, p, x: jnp.sum(f(p, x, w1, w2) ** 2), argnums=(0, 1))
    n = jnp.int32(3)
    p = jnp.bool_(False)
    return {
        "mlp": (lambda x, w1, w2: mlp(x, w1, w2), (X, W1, W2), None, 1),
        "mlp_grad": (grad_of(lambda p, x, w1, w2: mlp(x, w1, w2)), (W1, W2, p, X), None, 1),
        "while_static": (loop(None), (X, W1, W2, n), "mlp", 3),
        "while_argument": (loop("n"), (X, W1, W2, n), "mlp", 1),
        "cond": (branch, (p, X, W1, W2), "mlp", 1),
        "cond_grad": (grad_of(branch), (W1, W2, p, X), "mlp_grad", 1),
        "cond_on_x": (on_x, (p, X, W1, W2), "mlp", 1),
        "cond_on_x_grad": (grad_of(on_x), (W1, W2, p, X), "mlp_grad", 1),
    }


class _Layers(nnx.Module):
    """2 MLP layers, their weights stacked, run by a scan (a flax LLM's scanned layers)."""

    def __init__(self, mlp):
        self.w1 = nnx.Param(jnp.stack([W1, W1 / 2]))
        self.w2 = nnx.Param(jnp.stack([W2, W2]))
        self.mlp = mlp

    def __call__(self, h):
        return jax.lax.scan(lambda h, w: (jnp.tanh(self.mlp(h, w[0], w[1])), None), h, (self.w1[...], self.w2[...]))[0]


def _layer_cases(mlp):
    net = _Layers(mlp)
    loop = lambda net, x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, net(c[1])), (0, x))[1]
    scan = lambda net, x: jax.lax.scan(lambda h, _: (net(h), None), x, None, length=3)[0]
    return {"layers": (lambda net, x: net(x), (net, X), None, 1),
            "layers_in_while": (loop, (net, X), "layers", 3),
            "layers_in_scan": (scan, (net, X), "layers", 3)}


def _megatron_mlp():
    mm1, mm2 = ops.MatMul().shard(((2, 1), (1, 4))), ops.MatMul().shard(((2, 4), (4, 1)))
    return lambda x, w1, w2: mm2(jax.nn.relu(mm1(x, w1)), w2)


def _context(mode: str) -> None:
    if mode == "semi_auto_parallel":
        ms.set_auto_parallel_context(parallel_mode=mode, device_num=8)
    else:
        ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8)


def rows(modes=MODES) -> list[dict]:
    out = []
    for mode in modes:
        _context(mode)
        plain = lambda x, w1, w2: jax.nn.relu(x @ w1) @ w2              # plain jnp: no mshard op in the reference
        cases = {**_cases(_megatron_mlp()), **_layer_cases(_megatron_mlp())}
        refs = {**_cases(plain), **_layer_cases(plain)}
        cpu = jax.devices("cpu")[0]
        got = {}
        for name, (fn, args, base, times) in cases.items():
            f = ms.jit(fn)
            with jax.default_device(cpu):
                ref = jax.jit(refs[name][0])(*[a if isinstance(a, nnx.Module) else np.asarray(a)
                                               for a in refs[name][1]])
            err = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                      for a, b in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(ref), strict=True))
            plan = f.plan(*args)
            moved = trip_moved(f.lower(*args).compile().as_text())
            got[name] = sum(moved.values())
            out.append({"mode": mode, "case": name, "hlo": moved, "hlo_bytes": got[name],
                        "plan": dict(plan.cost.communication), "plan_equals_hlo": plan.cost.communication == moved,
                        "max_err": err, "baseline": base,
                        "ratio_to_mlp": got[name] / (times * got[base]) if base and got.get(base) else None})
        ms.reset_auto_parallel_context()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "branch_bodies.json"))
    ap.add_argument("--smoke", action="store_true", help="semi_auto only")
    a = ap.parse_args(argv)
    got = rows(("semi_auto_parallel",) if a.smoke else tuple(a.modes.split(",")))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"rows": got}, fh, indent=1)
    for r in got:
        ratio = "" if r["ratio_to_mlp"] is None else f"{r['ratio_to_mlp']:.3f}"
        print(f"{r['mode']:>22} {r['case']:>15} hlo {r['hlo_bytes']:>10,.0f} B  plan=hlo {r['plan_equals_hlo']!s:>5}"
              f"  err {r['max_err']:.1e}  vs mlp {ratio}")


if __name__ == "__main__":
    main()
