import sys; sys.path[:0] = ["tests", "."]
import conftest
import optax
from flax import nnx
from train_helpers import MLP, batches, mse
import mshard as ms
from mshard import nn
ms.set_auto_parallel_context(
    parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8, gradients_mean=True,
    all_reduce_fusion_config=[2, 4], enable_parallel_optimizer=True,
    parallel_optimizer_config={"parallel_optimizer_threshold": 1},
    comm_fusion={"reducescatter": {"mode": "size", "config": 0.001}, "allgather": {"mode": "auto", "config": None}})
data = batches(2, [(32, 16), (32, 8)], seed=5)
net = MLP(nnx.Rngs(5)).megatron(2, 4)
step = nn.TrainOneStepCell(nn.WithLossCell(net, mse), optax.adam(1e-2))
x, y = data[0]
plan = step.plan(x, y)
for o in plan.ops:
    if o.cost.communication or not o.name.startswith("vmap(jvp"): print(o.name, o.strategy, o.cost.communication)
print(plan.param_specs)
for c in ms.comm_report(step, x, y).collectives: print(c.kind, c.nbytes, c.text[:180])
