"""One trace and one operator graph per region (issue 38): planning a region builds its graph once, and axis
assignment (where user splits meet, :mod:`mshard._src.jaxpr.split_meetings`) and the search both work on that graph. The first call of
a training step plans two regions, the forward alone (its mesh, data-parallel axes and parameter layouts) and the
step, so it builds two graphs; before, each region built two (one for the claims, one for the search)."""

import sys
from collections import Counter

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mshard as ms
import mshard._src.jaxpr.op_graph
from mshard import nn, ops
from mshard.errors import LayoutError


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = nn.Dense(16, 32, rngs=nnx.Rngs(0))
        self.dense2 = nn.Dense(32, 4, rngs=nnx.Rngs(1))
        self.relu = ops.ReLU()

    def __call__(self, x):
        return self.dense2(self.relu(self.dense1(x)))


@pytest.fixture
def builds(monkeypatch):
    """Every operator graph built, as the jaxpr it was built from: the builder is patched wherever mshard's
    modules hold it."""
    seen: list = []
    original = mshard._src.jaxpr.op_graph.jaxpr_to_graph

    def counting(closed, *a, **k):
        seen.append(closed)
        return original(closed, *a, **k)

    for name, mod in list(sys.modules.items()):
        if (name == "mshard" or name.startswith("mshard.")) and getattr(mod, "jaxpr_to_graph", None) is original:
            monkeypatch.setattr(mod, "jaxpr_to_graph", counting)
    return seen


def _data():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.normal(size=(16, 16)), jnp.float32), jnp.asarray(rng.normal(size=(16, 4)), jnp.float32))


@pytest.mark.parametrize("search", [None, "dynamic_programming"])
def test_the_first_training_step_builds_one_graph_per_region(builds, search):
    ctx = dict(parallel_mode="semi_auto_parallel" if search is None else "auto_parallel", device_num=8)
    if search is not None:
        ctx["search_mode"] = search
    ms.set_auto_parallel_context(**ctx)
    net = Net()
    if search is None:                       # user strategies: axis assignment finds where they meet
        net.dense1.matmul.shard(((2, 1), (4, 1)))   # transpose_b: the weight is [out, in]
        net.relu.shard(((2, 4),))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, lambda p, y: jnp.mean((p - y) ** 2)), optax.sgd(0.1))
    x, y = _data()
    step(x, y)
    per_jaxpr = Counter(id(c) for c in builds)
    assert len(per_jaxpr) == 2, f"{len(per_jaxpr)} regions planned; want the forward and the step"
    assert all(n == 1 for n in per_jaxpr.values()), f"graphs built per region: {sorted(per_jaxpr.values())}"
    builds.clear()
    step(x, y)
    assert builds == []                      # a later step replans nothing


def test_a_forward_region_builds_one_graph(builds):
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    net = Net()
    net.dense1.matmul.shard(((2, 1), (4, 1)))   # transpose_b: the weight is [out, in]
    out = ms.jit(lambda m, x: m(x))(net, _data()[0])
    assert out.shape == (16, 4)
    assert len(builds) == 1


def test_claims_still_meet_on_the_one_graph(builds):
    """Two op strategies that cannot share the mesh are still refused on the one graph, where each primitive object
    is one op: an 8-way row split out of one MatMul and an 8-way column split out of another meet in the add of
    their results (docs/design.md invariant 4)."""
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    rows, cols = ops.MatMul().shard(((8, 1), (1, 1))), ops.MatMul().shard(((1, 1), (1, 8)))
    x, w = jnp.ones((16, 16)), jnp.ones((16, 16))
    with pytest.raises(LayoutError, match="meet in op"):
        ms.jit(lambda x, w: rows(x, w) + cols(x, w))(x, w)
    assert len(builds) == 1
