"""Tiny models and a single-device optax reference for the training tests (no mshard training code inside)."""


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gpt import GPT
from reference import train_one_device

from mshard import nn

# float32 training, 2-3 steps of Adam (lr 1e-2) or SGD on the MLP (16/64-term dot products, 32-row batch sums) or
# TinyGPT (32/64-term): the partitioning reorders every gradient sum (~n * 2**-24 <= 4e-6 relative), compounded over
# the steps, and Adam's m / sqrt(nu) carries that relative error into the update: PARAM_RTOL 2e-5. PARAM_ATOL for
# entries near 0: a step moves a weight by ~lr = 1e-2, so 3 steps with <= 5e-5 relative update error give 1.5e-6
PARAM_RTOL, PARAM_ATOL = 2e-5, 2e-6


class MLP(nn.Cell):
    """16 -> 64 -> 64 -> 8; weights of 4 KB / 16 KB, biases of 256 B."""

    def __init__(self, rngs, din=16, hidden=64, dout=8, dropout=0.0):
        self.fc1 = nn.Dense(din, hidden, activation="relu", rngs=rngs)
        self.fc2 = nn.Dense(hidden, hidden, activation="relu", rngs=rngs)
        self.fc3 = nn.Dense(hidden, dout, rngs=rngs)
        self.drop = nn.Dropout(p=dropout, rngs=rngs)

    def __call__(self, x):
        return self.fc3(self.drop(self.fc2(self.fc1(x))))

    def megatron(self, dp, mp):
        """fc1 column parallel, fc2 row parallel, fc3 data parallel."""
        self.fc1.matmul.shard(((dp, 1), (mp, 1)))
        self.fc1.bias_add.shard(((dp, mp), (mp,)))
        self.fc2.matmul.shard(((dp, mp), (1, mp)))
        return self


def TinyGPT(rngs, vocab=32, hidden=32, heads=4, layers=2, seq=8, ffn=64):
    return GPT(rngs, vocab=vocab, hidden=hidden, heads=heads, ffn=ffn, seq=seq, layers=layers)


def mse(pred, y):
    return jnp.mean((pred - y) ** 2)


def token_loss(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def batches(n, shapes, seed=0, ints=None):
    """``n`` batches of float32 arrays (or ints below ``ints`` for the entries marked True)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        b = []
        for k, s in enumerate(shapes):
            if ints and ints[k]:
                b.append(rng.integers(0, ints[k], size=s).astype(np.int32))
            else:
                b.append(rng.normal(size=s).astype(np.float32))
        out.append(tuple(b))
    return out


def reference_train(net, tx, data, loss_fn, grad_scale=1.0):
    """Train a copy of ``net`` on device 0 with plain nnx + optax; -> (net, optax state, losses).

    ``grad_scale`` multiplies the gradient of the mean loss (MindSpore's sum over data-parallel replicas)."""
    return train_one_device(net, tx, data, loss_fn, grad_scale=grad_scale, device=jax.devices()[0])


def params_of(net):
    return jax.tree.leaves(nnx.state(net, nnx.Param))


def assert_params_close(a, b, rtol=PARAM_RTOL, atol=PARAM_ATOL):
    pa, pb = params_of(a), params_of(b)
    assert len(pa) == len(pb)
    for x, y in zip(pa, pb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def assert_trees_close(a, b, rtol=PARAM_RTOL, atol=PARAM_ATOL):
    """Leaves in order (an optax state of a WithLossCell has one more key level than the bare network's)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
