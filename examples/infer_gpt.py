"""Train a GPT in dp x mp = 2 x 4, save it, and generate text from it in mp = 8 and on one device.

    python examples/infer_gpt.py [--steps 30] [--new 16]

1. Training: examples/gpt.py's GPT (8 heads) on train_gpt.py's synthetic affine-recurrence tokens, in
   semi_auto_parallel with Megatron strategies (``block.shard_megatron(2, 4)``) and optimizer parallel;
   ``ms.save_checkpoint`` writes the whole step (weights, Adam state, step count) in its 2 x 4 layouts.
2. Inference layout: a fresh GPT with ``block.shard_megatron(1, 8)`` (q/k/v and the first MLP Dense column
   parallel over 8 devices, heads split 8 ways, the projections row parallel); ``ms.infer_predict_layout`` gives
   every weight's layout for a prompt and ``ms.load_distributed_checkpoint`` reads the checkpoint straight into
   them (the optimizer state is reported and left behind).
3. Decoding: greedy, one token per call of a jitted region (``ms.Region`` of :func:`decode_step`) with a static
   KV cache ``[layers, 2, batch, heads, max_len, head_dim]`` laid out split 8 ways over heads; the prompt is fed
   through the same step. The region plans the step once and, bound to the model (``region.bind(net)``), calls
   the compiled program for every position without re-traversing the model; the program moves exactly
   Megatron's two all-reduces per layer.
4. Check: the same checkpoint loaded on one device generates with the plain full forward pass (no cache) at
   every position; the tokens must be equal.
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from gpt import GPT
from train_gpt import synthetic_batches as batches

import mshard as ms
from mshard import nn

# VOCAB, SEQ and the batch are train_gpt.py's (its synthetic_batches feeds the training here)
VOCAB, SEQ, HIDDEN, HEADS, FFN, LAYERS = 64, 32, 64, 8, 128, 2
LOSS = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def make_gpt(seed: int = 0) -> GPT:
    return GPT(nnx.Rngs(seed), vocab=VOCAB, hidden=HIDDEN, heads=HEADS, ffn=FFN, seq=SEQ, layers=LAYERS)


def train_and_save(directory: str, steps: int) -> list[float]:
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, enable_parallel_optimizer=True)
    net = make_gpt(0)
    for block in net.blocks:
        block.shard_megatron(data_parallel=2, model_parallel=4)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, LOSS), optax.adamw(1e-2))
    losses = [float(step(*b)) for b in batches(steps)]
    ms.save_checkpoint(step, directory, metadata={"losses": losses}).wait()
    ms.reset_auto_parallel_context()
    return losses


def new_cache(batch: int, dtype=jnp.float32) -> jax.Array:
    return jnp.zeros((LAYERS, 2, batch, HEADS, SEQ, HIDDEN // HEADS), dtype)


def decode_step(net: GPT, cache: jax.Array, token: jax.Array, pos: jax.Array):
    """One greedy step: ``token: [batch, 1]`` int32 at position ``pos`` (int32 scalar) -> (next token
    ``[batch, 1]``, the cache with this position's keys and values written)."""
    b = token.shape[0]
    x = net.embedding(token) + net.position(pos[None])[None]
    seen = jnp.arange(SEQ) <= pos                                   # the positions written so far
    for i, block in enumerate(net.blocks):
        att = block.attention
        h = block.layernorm1(x)
        q, k, v = (att._heads(d(h), b, 1) for d in (att.query, att.key, att.value))     # [b, heads, 1, hd]
        for j, t in enumerate((k, v)):                              # written in place, head-split like the cache
            cache = jax.lax.dynamic_update_slice(cache, t[None, None], (i, j, 0, 0, pos, 0))
        kc, vc = cache[i, 0], cache[i, 1]
        s = jnp.einsum("bhqd,bhkd->bhqk", q, kc) / np.sqrt(att.head_dim)
        s = jnp.where(seen[None, None, None], s, jnp.asarray(-1e9, s.dtype))
        ctx = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), vc)
        x = x + att.projection(ctx.transpose(0, 2, 1, 3).reshape(b, 1, HIDDEN))
        x = x + block.output(block.layernorm2(x))
    logits = net.head(net.final_norm(x))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


def cache_strategy(mp: int) -> tuple:
    """The region's data strategies (per argument; the module has none): the cache split ``mp`` ways over heads,
    the token whole, the position left to dataset_strategy (a scalar)."""
    return (None, (1, 1, 1, mp, 1, 1), (1, 1), None)


def generate(step, prompt: np.ndarray, new: int) -> tuple[np.ndarray, jax.Array]:
    """Greedy generation through ``step(cache, token, pos)`` (a jitted :func:`decode_step` bound to the model):
    the prompt, then ``new`` tokens."""
    cache = new_cache(prompt.shape[0])
    out = [prompt[:, i:i + 1] for i in range(prompt.shape[1])]
    tok = jnp.asarray(out[0])
    for p in range(prompt.shape[1] + new - 1):
        nxt, cache = step(cache, tok, jnp.int32(p))
        tok = jnp.asarray(out[p + 1]) if p + 1 < prompt.shape[1] else nxt
        if p + 1 >= prompt.shape[1]:
            out.append(np.asarray(nxt))
    return np.concatenate(out, axis=1), cache


def generate_reference(net: GPT, prompt: np.ndarray, new: int) -> np.ndarray:
    """Greedy generation with the full forward pass at every position (no cache), plain JAX on one device."""
    ids = np.zeros((prompt.shape[0], SEQ), np.int32)
    ids[:, :prompt.shape[1]] = prompt
    fwd = jax.jit(lambda m, i: nnx.merge(*m)(i))
    parts = nnx.split(net)
    with ms.parallel_context(parallel_mode="stand_alone"):      # the strategies would apply inside a jax.jit
        for t in range(prompt.shape[1], prompt.shape[1] + new):
            logits = fwd(parts, jnp.asarray(ids))
            ids[:, t] = np.asarray(jnp.argmax(logits[:, t - 1], axis=-1))
    return ids[:, :prompt.shape[1] + new]


def inference_net(mp: int = 8) -> GPT:
    net = make_gpt(1)
    for block in net.blocks:
        block.shard_megatron(data_parallel=1, model_parallel=mp)
    return net


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args(argv)
    d = tempfile.mkdtemp(prefix="mshard-infer-")
    losses = train_and_save(d, args.steps)
    print(f"trained dp x mp = 2 x 4 with optimizer parallel: loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved {d}")
    assert losses[-1] < losses[0]

    prompt = batches(1, seed=1)[0][0][:4, :4]
    # a serving batch is small: the prompt is not split over the devices (full_batch); the model is, 8 ways
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch")
    net = inference_net(8)
    layout = ms.infer_predict_layout(net, jnp.asarray(prompt))
    r = ms.load_distributed_checkpoint(net, d, predict_strategy=layout)
    print(f"loaded step {r.step} into mp = 8 ({len(r.ckpt_not_load)} optimizer leaves left behind); "
          f"blocks.0.attention.query.weight: {net.blocks[0].attention.query.weight[...].sharding.spec}")
    region = ms.Region(decode_step, data_strategy=cache_strategy(8), name="decode")
    tokens, cache = generate(region.bind(net), prompt, args.new)
    spec = cache.sharding.spec
    print(f"KV cache {cache.shape} laid out {spec}")
    assert cache.sharding.shard_shape(cache.shape)[3] == HEADS // 8, spec
    rep = ms.comm_report(region, net, cache, jnp.asarray(prompt[:, :1]), jnp.int32(0))
    print(rep)
    # Megatron decoding: per layer one all-reduce of the attention projection's partial sums and one of the MLP's,
    # each [batch, 1, hidden] float32; nothing else moves (the cache stays split over heads)
    want = 2 * LAYERS
    assert rep.total_count == rep.count("all-reduce") == want, rep
    assert rep.bytes("all-reduce") == want * prompt.shape[0] * HIDDEN * 4, rep

    ms.reset_auto_parallel_context()
    one = make_gpt(2)
    ms.load_checkpoint(d, one)                     # the bare network, on one device
    ref = generate_reference(one, prompt, args.new)
    for row in range(2):
        print(f"  prompt {prompt[row].tolist()} -> {tokens[row, prompt.shape[1]:].tolist()}")
    assert np.array_equal(tokens, ref), (tokens, ref)
    print(f"mp = 8 with a KV cache generates the same {args.new} tokens as one device without a cache")
    print("infer_gpt OK")


if __name__ == "__main__":
    main()
