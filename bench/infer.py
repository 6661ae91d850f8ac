"""Decoding speed: examples/infer_gpt.py's greedy KV-cache step through mshard against a hand-written ``jax.jit``.

    python bench/infer.py [--tokens 24] [--repeats 3] [--batch 4] [--layers 2] [--hidden 64]
                          [--out bench/out/infer.json]
    python bench/infer.py --smoke      # 4 tokens, 1 repeat, 1 layer: that it runs and writes its JSON

Both decode the same mp = 8 model (``block.shard_megatron(1, 8)``, its weights in the layouts
``ms.infer_predict_layout`` gives) with the same head-split KV cache:

- ``mshard``: ``ms.Region(decode_step, data_strategy=...)`` called once per token with the model as argument;
- ``mshard_bound``: the same region bound to the model (``region.bind(net)``, what the example runs): no per-call
  traversal of the model;
- ``jax_jit``: ``jax.jit(decode_step)`` over ``nnx.split`` state with ``in_shardings``/``out_shardings`` set by hand
  to the same layouts (weights as planned, cache split over heads), the baseline an expert would write;
- ``one_device``: ``jax.jit`` on one device (the whole model there).

Tokens per second over ``--tokens`` steps (batch rows x steps / time, after a warm-up call), best of
``--repeats``; ``ratio_mshard_vs_jax_jit`` is the mshard time over the hand-written one. The tokens of all three
must agree (else the bench fails). With the default sizes each step is a few microseconds of compute, so the ratio
is dominated by the per-call dispatch of the region; ``--hidden 1024 --layers 8`` shows a compute-bound step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import _cpu8  # noqa: F401
import infer_gpt as ex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mshard as ms


def _loop(call, cache, tok0, n):
    tok = tok0
    out = []
    for p in range(n):
        tok, cache = call(cache, tok, jnp.int32(p))
        out.append(tok)
    jax.block_until_ready(tok)
    return np.concatenate([np.asarray(t) for t in out], axis=1)


def _plain(fn, *args):
    with ms.parallel_context(parallel_mode="stand_alone"):
        return fn(*args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "infer.json"))
    ap.add_argument("--smoke", action="store_true", help="4 tokens, 1 repeat, 1 layer: checks that it runs")
    a = ap.parse_args()
    if a.smoke:
        a.tokens, a.repeats, a.layers = 4, 1, 1
    ex.LAYERS, ex.HIDDEN, ex.FFN = a.layers, a.hidden, 2 * a.hidden
    ex.SEQ = max(ex.SEQ, a.tokens)
    n = min(8, jax.device_count())
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=n, dataset_strategy="full_batch")
    net = ex.inference_net(n)
    tok0 = jnp.asarray(np.arange(a.batch, dtype=np.int32)[:, None] % ex.VOCAB)
    layout = ms.infer_predict_layout(net, tok0)
    region = ms.Region(ex.decode_step, data_strategy=ex.cache_strategy(n), name="decode")
    bound = region.bind(net)
    region.place(net, ex.new_cache(a.batch), tok0, jnp.int32(0))          # the weights in the planned layouts
    w = net.blocks[0].attention.query.weight[...]
    assert isinstance(w.sharding, NamedSharding) and w.sharding.is_equivalent_to(
        layout["blocks.0.attention.query.weight"], 2)
    mesh = w.sharding.mesh
    cache_sh = NamedSharding(mesh, P(None, None, None, tuple(mesh.axis_names)))
    rep = NamedSharding(mesh, P())
    graphdef, state = nnx.split(net)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    hand = jax.jit(lambda s, c, t, p: ex.decode_step(nnx.merge(graphdef, s), c, t, p),
                   in_shardings=(state_sh, cache_sh, rep, rep), out_shardings=(rep, cache_sh))
    one_dev = jax.devices()[0]
    state1 = jax.device_put(state, one_dev)
    single = jax.jit(lambda s, c, t, p: ex.decode_step(nnx.merge(graphdef, s), c, t, p))

    calls = {
        "mshard": (lambda c, t, p: region(net, c, t, p), jax.device_put(ex.new_cache(a.batch), cache_sh)),
        "mshard_bound": (bound, jax.device_put(ex.new_cache(a.batch), cache_sh)),
        # plain JAX (stand_alone: the model's strategies would otherwise apply inside these jax.jit programs)
        "jax_jit": (lambda c, t, p: _plain(hand, state, c, t, p), jax.device_put(ex.new_cache(a.batch), cache_sh)),
        "one_device": (lambda c, t, p: _plain(single, state1, c, t, p),
                       jax.device_put(ex.new_cache(a.batch), one_dev)),
    }
    best: dict[str, float] = {}
    tokens: dict[str, np.ndarray] = {}
    for call, cache in calls.values():
        _loop(call, cache, tok0, 2)                                      # compile and warm up
    for _ in range(a.repeats):
        for name, (call, cache) in calls.items():
            t = time.perf_counter()
            tokens[name] = _loop(call, cache, tok0, a.tokens)
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    if not all(np.array_equal(tokens["mshard"], t) for t in tokens.values()):
        raise SystemExit(f"bench/infer.py: the decoders disagree: {tokens}")
    res = {"platform": jax.devices()[0].platform, "devices": n, "batch": a.batch, "layers": a.layers,
           "hidden": a.hidden, "tokens": a.tokens,
           **{f"{k}_tokens_per_s": a.batch * a.tokens / v for k, v in best.items()},
           **{f"{k}_ms_per_step": 1e3 * v / a.tokens for k, v in best.items()},
           "ratio_mshard_vs_jax_jit": best["mshard"] / best["jax_jit"],
           "ratio_mshard_bound_vs_jax_jit": best["mshard_bound"] / best["jax_jit"]}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
