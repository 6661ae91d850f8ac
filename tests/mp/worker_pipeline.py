"""One process of a 2-process x 4-device pipeline run (started by tests/e2e/multiprocess/test_pipeline_multiprocess.py).

The examples GPT in 2 stages (embeddings and the first two blocks, then the rest with the head and loss), one
stage per process, 1F1B over 4 micro-batches, data parallel over the 4 devices of each stage; each process feeds
its half of every batch through ms.dataset.shard_batch. Every process also trains the same model on its first
local device alone on the full batches and compares.
"""

import os
import sys

pid, port = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4" + os.environ.get("MSHARD_TEST_XLA_EXTRA", "")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mshard as ms  # noqa: E402
from mshard import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from reference import train_one_device  # noqa: E402
from train_gpt import LOSS, make_gpt, synthetic_batches  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
data = synthetic_batches(3)                 # the same batches in both processes
tx = optax.adamw(1e-3, eps=1e-3)            # tests/e2e/pipeline/test_pipeline.py: eps = lr keeps the update Lipschitz in g
init = make_gpt(nnx.Rngs(0), layers=4)
ref, ref_opt, ref_losses = train_one_device(init, tx, data, LOSS, device=jax.local_devices()[0])

ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8, gradients_mean=True,
                             pipeline_stages=2)
net = make_gpt(nnx.Rngs(0), layers=4)      # the same values as init (a fresh, uncommitted copy)
net.embedding.pipeline_stage = net.position.pipeline_stage = 0
for i, b in enumerate(net.blocks):
    b.pipeline_stage = i // 2
net.final_norm.pipeline_stage = net.head.pipeline_stage = 1
step = nn.TrainOneStepCell(nn.PipelineCell(nn.WithLossCell(net, LOSS), 4), tx)
losses = []
for x, y in data:
    half = slice(pid * 8, (pid + 1) * 8)          # this process's rows
    bx, by = ms.dataset.shard_batch((x[half], y[half]))
    assert not bx.is_fully_addressable
    losses.append(float(step(bx, by)))
# tests/e2e/pipeline/test_pipeline.py's bounds: losses rtol 1e-4, parameters 1e-4 after 3 AdamW steps with eps = lr
np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
for got, want in zip(jax.tree.leaves(nnx.state(net, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param)), strict=True):
    for shard in got.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], atol=1e-4)
# every AdamW leaf (count, mu, nu) against one device's, the same bound (mu, nu: 3 steps of the same gradients)
got_opt, want_opt = jax.tree.leaves(step.opt_state), jax.tree.leaves(ref_opt)
for got, want in zip(got_opt, want_opt, strict=True):
    assert got.shape == np.shape(want), (got.shape, np.shape(want))
    for shard in got.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], atol=1e-4)
# the stages are the processes: the activations cross between them by collective-permute
hlo = step.lower(bx, by).as_text()
assert "collective-permute" in hlo or "collective_permute" in hlo
print(f"process {pid} OK", losses, flush=True)
jax.distributed.shutdown()
