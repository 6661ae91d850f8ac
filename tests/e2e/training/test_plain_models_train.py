"""Issue 16's "done when": the flax MNIST CNN and a MiniGPT-style model, written as the public flax examples
write them (plain nnx, no mshard layers), each train in data_parallel, in semi_auto with Megatron
``parameter_plan``s given by ``ms.shard(module, ...)``, and in auto_parallel under every search_mode, equal to
the same training on one device (plain nnx + optax, tests/train_helpers.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_helpers import PARAM_RTOL, assert_params_close, reference_train, token_loss

import mshard as ms
from mshard import nn


class CNN(nnx.Module):
    """The flax MNIST example's CNN, scaled to 8x8 images (two 3x3 convolutions, average pools, two denses)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(16 * 2 * 2, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return self.linear2(nnx.relu(self.linear1(x)))


V, D, H, T = 16, 16, 2, 4


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, D, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class MiniGPT(nnx.Module):
    """The flax MiniGPT example's shape: token + position embeddings, pre-norm blocks, a vocabulary head."""

    def __init__(self, rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Embed(T, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs)])
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, ids):
        x = self.tok(ids) + self.pos(jnp.arange(ids.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def ce(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def cnn_case():
    rng = np.random.default_rng(3)
    data = [(rng.normal(size=(16, 8, 8, 1)).astype(np.float32), rng.integers(0, 10, 16).astype(np.int32))
            for _ in range(2)]
    return (lambda: CNN(rngs=nnx.Rngs(0))), ce, data, optax.adam(1e-2)


def gpt_case():
    rng = np.random.default_rng(4)
    data = [tuple(rng.integers(0, V, (8, T)).astype(np.int32) for _ in range(2)) for _ in range(2)]
    # SGD: the attention's key bias has an exactly zero gradient (it shifts every logit of a query alike), and
    # Adam would turn the rounding noise of that zero into full-size steps of either sign
    return (lambda: MiniGPT(nnx.Rngs(0))), token_loss, data, optax.sgd(0.1)


def megatron(model):
    """Column-parallel then row-parallel denses (one all-reduce each), batch split 2 ways, as an expert writes
    them with MindSpore's shard on the model's own sub-modules."""
    if isinstance(model, CNN):
        ms.shard(model.linear1, in_strategy=((2, 1),), parameter_plan={"kernel": (1, 4), "bias": (4,)})
        ms.shard(model.linear2, in_strategy=((2, 4),), parameter_plan={"weight": (4, 1)})
    else:
        for b in model.blocks:
            ms.shard(b.up, in_strategy=((2, 1, 1),), parameter_plan={"kernel": (1, 4), "bias": (4,)})
            ms.shard(b.down, in_strategy=((2, 1, 4),), parameter_plan={"weight": (4, 1)})
    return model


CONFIGS = [("data_parallel", {}), ("semi_auto_parallel", {})] + [
    ("auto_parallel", {"search_mode": m}) for m in ms.context.SEARCH_MODES]
# the MiniGPT's training step is ~390 ops: recursive_programming searches it in ~20 s and dynamic_programming in
# ~10 s on 2 cores; ilp runs to its 60 s time limit (heavy, ~80 s: the CNN's ilp case runs in CI; issue 14's search
# speed)
HEAVY = {("minigpt", "ilp"): 80}


def _cases():
    for name, case in (("mnist_cnn", cnn_case), ("minigpt", gpt_case)):
        for mode, kw in CONFIGS:
            label = kw.get("search_mode", mode)
            heavy = HEAVY.get((name, label))
            yield pytest.param(case, mode, kw, id=f"{name}-{label}",
                               marks=[pytest.mark.heavy(heavy)] if heavy else [])


@pytest.mark.parametrize("case,mode,kw", list(_cases()))
def test_a_plain_flax_model_trains_as_on_one_device(case, mode, kw):
    make, loss_fn, data, tx = case()
    ref, _, ref_losses = reference_train(make(), tx, data, loss_fn)
    ms.set_auto_parallel_context(parallel_mode=mode, device_num=8, gradients_mean=True, **kw)
    model = make()
    if mode == "semi_auto_parallel":
        megatron(model)
    step = nn.TrainOneStepCell(nn.WithLossCell(model, loss_fn), tx)
    losses = [float(step(*b)) for b in data]
    # float32, 2 Adam / SGD steps: tests/train_helpers.py's reasoning for PARAM_RTOL / PARAM_ATOL
    np.testing.assert_allclose(losses, ref_losses, rtol=PARAM_RTOL)
    assert_params_close(model, ref)
    if mode == "semi_auto_parallel":             # the expert's split is where the plan put the weights
        dense = model.linear1 if isinstance(model, CNN) else model.blocks[0].up
        kernel = dense.kernel[...]
        assert kernel.sharding.shard_shape(kernel.shape) == (kernel.shape[0], kernel.shape[1] // 4)
