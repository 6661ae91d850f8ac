"""One process of a 2-process x 4-device run (started by tests/e2e/multiprocess/test_multiprocess.py)."""

import os
import sys

pid, port = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4" + os.environ.get("MSHARD_TEST_XLA_EXTRA", "")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import mshard as ms  # noqa: E402
from mshard import ops  # noqa: E402

assert jax.device_count() == 8 and jax.local_device_count() == 4
rng = np.random.default_rng(0)                      # the same values in both processes
x = rng.standard_normal((16, 32)).astype(np.float32)
w1 = rng.standard_normal((32, 64)).astype(np.float32)
w2 = rng.standard_normal((64, 32)).astype(np.float32)
ref = np.maximum(x @ w1, 0) @ w2

ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
mm1 = ops.MatMul().shard(((2, 1), (1, 4)))
mm2 = ops.MatMul().shard(((2, 4), (4, 1)))
p1, p2 = nnx.Param(jnp.asarray(w1)), nnx.Param(jnp.asarray(w2))
xs = x                                              # a host array both processes hold in full
f = ms.jit(lambda x, a, b: mm2(jax.nn.relu(mm1(x, a[...])), b[...]))
y = f(xs, p1, p2)
assert not y.is_fully_addressable
for shard in y.addressable_shards:
    # float32 on unscaled normals: 32- then 64-term dot products (|y| ~ 30) split by Megatron vs numpy's BLAS order,
    # ~sqrt(n) * 2**-24 <= 5e-7 relative each (worst n * 2**-24 = 4e-6); atol for entries that cancel near 0
    np.testing.assert_allclose(np.asarray(shard.data), ref[shard.index], rtol=1e-4, atol=1e-4)
rep = ms.comm_report(f, xs, p1, p2)
assert rep.count("all-reduce") == 1 and rep.total_count == 1, rep.by_kind   # Megatron: one all-reduce
# a per-process batch slice through ms.dataset.shard_batch (data_parallel): rows of both processes form the batch
ms.set_auto_parallel_context(parallel_mode="data_parallel")
local = x[pid * 8:(pid + 1) * 8]
g = ms.jit(lambda x, a, b: jax.nn.relu(x @ a[...]) @ b[...])
z = g(ms.dataset.shard_batch(local), p1, p2)
assert z.shape == (16, 32)
for shard in z.addressable_shards:
    # the same bound: row-split data parallel, only XLA's vs numpy's summation order differs
    np.testing.assert_allclose(np.asarray(shard.data), ref[shard.index], rtol=1e-4, atol=1e-4)
print(f"process {pid} OK", rep.by_kind, flush=True)
jax.distributed.shutdown()
