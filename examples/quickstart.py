"""mshard quickstart: MindSpore strategies on 8 simulated CPU devices, checked against one device.

    python examples/quickstart.py

1. a Megatron-style MLP by strategy tuples (primitive objects),
2. the same MLP by Layout,
3. a small Flax NNX model (nn.Cell) with Cell.shard + parameter_plan.
Each prints the mesh, the PartitionSpec of every parameter and the collectives of the compiled HLO.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from flax import nnx

import mshard as ms
from mshard import Layout, nn, ops

TOL = dict(rtol=1e-5, atol=1e-5)


def show(title, f, args, names, out, ref):
    lay = f.layouts(*args) if hasattr(f, "layouts") else f.region().layouts(*args)
    print(f"\n== {title}")
    print("mesh:", dict(zip(lay.mesh.names, lay.mesh.shape)))
    for name, a in zip(names, args):
        print(f"  {name:>14}: {a.sharding.spec if hasattr(a, 'sharding') and len(a.sharding.device_set) > 1 else ''}"
              f" planned {lay.input_specs()[names.index(name)]}")
    print("  output spec:", out.sharding.spec)
    print(ms.comm_report(f, *args))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), **TOL)
    print(f"  matches one device (rtol={TOL['rtol']}, atol={TOL['atol']})")


def main():
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (32, 64))
    w1 = jax.random.normal(k[1], (64, 256)) * 0.1
    w2 = jax.random.normal(k[2], (256, 64)) * 0.1
    ref = \
        np.maximum(np.asarray(x) @ np.asarray(w1), 0) @ np.asarray(w2)

    # 1. strategy tuples: column-parallel, then row-parallel matmul: one all-reduce in the forward pass
    mm1 = ops.MatMul().shard(((2, 1), (1, 4)))
    relu = ops.ReLU().shard(((2, 4),))
    mm2 = ops.MatMul().shard(((2, 4), (4, 1)))
    f = ms.jit(lambda x, w1, w2: mm2(relu(mm1(x, w1)), w2))
    show("Megatron MLP, strategy tuples", f, (x, w1, w2), ["x", "w1", "w2"], f(x, w1, w2), ref)

    # 2. the same with a Layout: named device matrix (dp=2, mp=4)
    layout = Layout((2, 4), ("dp", "mp"))
    lm1 = ops.MatMul().shard((layout("dp", "None"), layout("None", "mp")))
    lm2 = ops.MatMul().shard((layout("dp", "mp"), layout("mp", "None")))
    g = ms.jit(lambda x, w1, w2: lm2(jax.nn.relu(lm1(x, w1)), w2))
    show("Megatron MLP, Layout", g, (x, w1, w2), ["x", "w1", "w2"], g(x, w1, w2), ref)

    # 3. a Flax NNX Cell: batch split 2 ways, Dense weights ([out, in], as MindSpore) split 4 ways
    class Net(nn.Cell):
        def __init__(self, rngs):
            self.dense1 = nn.Dense(64, 256, rngs=rngs)
            self.dense2 = nn.Dense(256, 64, rngs=rngs)

        def __call__(self, x):
            return self.dense2(jax.nn.relu(self.dense1(x)))

    net = Net(nnx.Rngs(0))
    single = net(x)                     # outside any region: plain JAX on one device
    net.shard(in_strategy=((2, 1),), parameter_plan={"dense1.weight": (4, 1), "dense2.weight": (1, 4)})
    y = net(x)                          # a sharded Cell called eagerly runs as its own region
    print("\n== Flax NNX Cell with Cell.shard + parameter_plan")
    for path, v in nnx.to_flat_state(nnx.state(net)):
        print(f"  {'.'.join(map(str, path)):>14}: {v[...].sharding.spec}")
    print("  output spec:", y.sharding.spec)
    print(ms.comm_report(net, x))
    np.testing.assert_allclose(np.asarray(y), np.asarray(single), **TOL)
    print(f"  matches one device (rtol={TOL['rtol']}, atol={TOL['atol']})")
    print("\nquickstart OK")


if __name__ == "__main__":
    main()
