"""The cost model prices the state a plan stores (issue 40): a cost-model searcher must not replicate a large weight
to save a small collective.

MindSpore's sharding-propagation tutorial FFN, 256 x 1024 @ 1024 x 4096 @ 4096 x 1024, with its weights as
``nnx.Param`` and only the first MatMul configured, ``((2, 1), (1, 4))``, under full_batch. Before, every
cost-model searcher kept the second 16 MiB weight whole on every device and moved the activation by an all-to-all
(512 KiB per device): the latency and byte terms preferred it, and memory was a tie-breaker at 0.001 per GiB. With
``CostParams.state_weight`` (a byte of parameter or optimizer state stored per device costs as much as moving 0.1
byte), each takes the row-parallel completion ``((2, 4), (4, 1))``: one all-reduce of the same 512 KiB result
bytes, and a quarter of the weight per device (8 MiB of parameters per device instead of 20 MiB)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mshard as ms
from mshard import nn, ops

pytestmark = pytest.mark.slow

D, H, B = 1024, 4096, 256


class FFN(nn.Cell):
    def __init__(self, rngs):
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (D, H)) / D ** 0.5)
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (H, D)) / H ** 0.5)
        self.mm1, self.mm2 = ops.MatMul().shard(((2, 1), (1, 4))), ops.MatMul()

    def __call__(self, x):
        return self.mm2(jax.nn.relu(self.mm1(x, self.w1)), self.w2)


def _stored(net) -> int:
    """Bytes of the parameters per device, from the placed arrays' shard shapes."""
    return sum(int(np.prod(v.sharding.shard_shape(v.shape))) * v.dtype.itemsize
               for v in jax.tree.leaves(nnx.state(net, nnx.Param)))


@pytest.mark.parametrize("mode", ["dynamic_programming", "recursive_programming", "ilp"])
def test_a_cost_model_searcher_completes_the_ffn_row_parallel_and_stores_a_quarter(mode):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, D)), jnp.float32)
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8,
                             dataset_strategy="full_batch"):
        net = FFN(nnx.Rngs(0))
        f = ms.jit(lambda n, x: n(x))
        plan = f.plan(net, x)
        rep = ms.comm_report(f, net, x)
        y = f(net, x)
    assert [op.strategy for op in plan.ops if op.kind == "MatMul"] == [((2, 1), (1, 4)), ((2, 4), (4, 1))]
    # one all-reduce of the row-parallel partial sums: [128, 1024] float32 per device (the batch split 2 ways)
    assert rep.by_kind.keys() == {"all-reduce"} and rep.bytes("all-reduce") == (B // 2) * D * 4
    # each weight a quarter per device: (D * H + H * D) * 4 B / 4
    assert _stored(net) == 2 * D * H * 4 // 4
    w1, w2, x64 = (np.asarray(a, np.float64) for a in (net.w1[...], net.w2[...], x))
    # float32 against float64: 1024- and 4096-term dot products of O(1) terms, ~sqrt(n) * 2**-24 relative each
    np.testing.assert_allclose(np.asarray(y), np.maximum(x64 @ w1, 0) @ w2, rtol=1e-4, atol=1e-4)
