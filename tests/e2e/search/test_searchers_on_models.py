"""Issue 5 end to end: auto_parallel with search_mode dynamic_programming / recursive_programming /
ilp traces the region, searches, and the plan executes on 8 devices equal to one device."""


import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import assert_close
from models import MLP, ConvNet, TransformerBlock, inputs

import mshard as ms
from mshard import ops

SEARCH_MODES = ("dynamic_programming", "recursive_programming", "ilp")


def auto(mode, **kw):
    return ms.parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8, **kw)


def loss_and_grad(m, *a):
    return nnx.value_and_grad(lambda m, *a: jnp.sum(m(*a)))(m, *a)


def small_block():
    return TransformerBlock(d=32, heads=4, d_ff=64), (jax.random.normal(jax.random.key(1), (8, 8, 32)),)


@pytest.mark.parametrize("mode", SEARCH_MODES)
@pytest.mark.parametrize("model", ["mlp", pytest.param("transformer", marks=pytest.mark.slow)])
def test_plan_executes_and_matches_one_device(mode, model):
    m, args = (MLP(), inputs("mlp")) if model == "mlp" else small_block()
    ref_y = m(*args)
    ref_l, ref_g = loss_and_grad(m, *args)          # eager: plain JAX on one device
    with auto(mode):
        y = ms.jit(lambda m, *a: m(*a))(m, *args)
        f = ms.jit(loss_and_grad)
        (l, g) = f(m, *args)
        plan = f.plan(m, *args)
    # float32, reordered by the plan's partitioning: 64- and 256-term dot products (MLP) or 32/64-term ones with layer
    # norm and softmax (block), ~n * 2**-24 <= 1.5e-5 relative each; the loss sums 2048 outputs (|l| ~ 15-60, ||y|| ~ 35-55):
    # random-signed roundings ~sqrt(2048) * 2**-24 * ||y|| ~ 1e-4 absolute, hence atol=1e-4 on l and its gradients
    assert_close(y, ref_y, rtol=1e-4, atol=1e-5)
    assert_close(l, ref_l, rtol=1e-4, atol=1e-4)
    assert_close(g, ref_g, rtol=1e-4, atol=1e-4)
    assert plan.algorithm == mode and len(plan.ops) > 5
    # the search partitions: a planner that fell back to replicating every op it chooses (the data inputs keep the
    # dataset strategy's split, which is fixed) would pass the value checks above
    assert any(c > 1 for op in plan.ops if not op.fixed for split in op.strategy for c in split), plan.ops


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_conv_net_plan_matches_one_device(mode):
    m, args = ConvNet(), inputs("conv")
    def weighted(m, x):       # each output weighed differently: a plain sum's all-ones cotangent hides misplaced shards
        y = m(x)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) * 0.37))
    ref_g = nnx.grad(weighted)(m, *args)                # eager: plain JAX on one device
    with auto(mode):
        y = ms.jit(lambda m, x: m(x))(m, *args)
        g = ms.jit(nnx.grad(weighted))(m, *args)
    # float32: 36-term conv sums (4 channels x 3 x 3), batch statistics over 256 values and a 256-term head reordered by
    # the partitioning (<= 256 * 2**-24 = 1.5e-5 relative), rsqrt(var) passing the statistics' error on; atol: outputs ~ 0
    assert_close(y, m(*args), rtol=1e-4, atol=1e-4)
    # every parameter's gradient: sums over the 256-value batch of those terms, so the same relative bound
    assert_close(g, ref_g, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_user_strategies_are_fixed(mode):
    m, (x,) = MLP(), inputs("mlp")
    mm1 = ops.MatMul().shard(((2, 1), (1, 4)))
    fn = lambda m, x: jax.nn.relu(mm1(x, m.w1[...])) @ m.w2[...]
    with auto(mode):
        f = ms.jit(fn)
        y = f(m, x)
        plan = f.plan(m, x)
    assert plan.strategy_of("MatMul") == ((2, 1), (1, 4))
    assert_close(y, jax.nn.relu(x @ m.w1[...]) @ m.w2[...])


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_fully_use_devices_takes_effect(mode):
    m, args = MLP(), inputs("mlp")
    fn = lambda m, x: jnp.sum(m(x))
    ms.set_algo_parameters(fully_use_devices=True)
    with auto(mode):
        plan = ms.jit(fn).plan(m, *args)
    for name, axes in plan.graph_axes.items():
        used = sorted(a for ax in axes for a in ax)
        if len(used) != len(plan.mesh.shape) and "reduce_sum" not in name:
            raise AssertionError(f"{name} uses {used} of {plan.mesh.names}")


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_cost_model_context_takes_effect(mode):
    m, args = MLP(), inputs("mlp")
    fn = lambda m, x: m(x)
    with auto(mode):
        base = ms.jit(fn).plan(m, *args)
    ms.set_cost_model_context(costmodel_alpha=10.0)
    with auto(mode):
        heavy = ms.jit(fn).plan(m, *args)
    # float64 cost model: an unchanged plan's compute is the same terms re-summed (~n * 2**-53), far below rel=1e-6
    assert heavy.cost.total > base.cost.total


def test_a_second_region_with_the_same_graph_is_not_searched_again():
    m, args = MLP(), inputs("mlp")
    with auto("dynamic_programming"):
        ms.jit(lambda m, x: m(x)).plan(m, *args)
        again = ms.jit(lambda m, x: m(x)).plan(m, *args)          # a new jit: traced again, same graph
    assert any("from the search cache" in n for n in again.notes)


@pytest.mark.parametrize("mode", ("sharding_propagation",) + SEARCH_MODES)
def test_a_sharding_constraint_inside_a_searched_region_is_a_fixed_strategy(mode):
    """A with_sharding_constraint the user wrote on the region's mesh (axes d0, d1, d2 for 8 devices) is held
    fixed like a strategy: the search plans around it instead of constraining its result to another layout."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    mesh = jax.make_mesh((2, 2, 2), ("d0", "d1", "d2"), axis_types=(jax.sharding.AxisType.Auto,) * 3)

    def f(x, w):
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), NamedSharding(mesh, P(None, ("d0", "d1", "d2"))))
        return jnp.sum(h * h, axis=1)
    x, w = jax.random.normal(jax.random.key(0), (16, 32)), jax.random.normal(jax.random.key(1), (32, 64))
    with auto(mode):
        fn = ms.jit(f)
        y = fn(x, w)
        plan = fn.plan(x, w)
    (op,) = [o for o in plan.ops if o.kind == "sharding_constraint"]
    assert op.fixed and op.strategy == ((1, 8),)
    # float32: a 32-term dot product, then 64 positive squares (< 1) summed across the 8-way split: <= 64 * 2**-24 = 4e-6
    assert_close(y, f(x, w), rtol=1e-5, atol=1e-5)


def test_the_backward_and_update_of_a_step_are_exempt_from_fully_use_devices():
    """In a searched region, the ops no user output depends on (a training step's backward and update, which
    MindSpore derives rather than searches) are marked free_devices; the forward, which the loss depends on,
    is not."""
    from mshard._src.jaxpr.op_graph import jaxpr_to_graph
    from mshard._src.planning.prepare import free_derived
    from searchers import DeviceMesh

    def step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
        return loss, w - 0.1 * g
    w, x = jnp.ones((4, 6)), jnp.ones((8, 4))
    r = jaxpr_to_graph(jax.make_jaxpr(step)(w, x), DeviceMesh.prime(8), ["param", "data"], ["w", "x"],
                       state_outputs=[(1, 0)])
    free_derived(r.graph, 1)
    free = {op.name for op in r.graph.ops if op.free_devices}
    forward = {op.name for op in r.graph.ops if op.name.startswith("jvp()/") and not op.is_source}
    backward = {op.name for op in r.graph.ops if op.name.startswith("transpose(") and not op.is_source}
    # the forward ops the loss is computed by; jvp's residual 1 - tanh^2 feeds only the backward
    assert forward - free == {"jvp()/dot_general", "jvp()/tanh", "jvp()/reduce_sum"}
    assert backward and backward <= free
    assert {"mul", "sub", "writeback/w"} <= free                     # the update w - 0.1 * g and its write-back


@pytest.mark.parametrize("fully", [False, True])
def test_recursive_programming_levels_at_once_on_a_traced_gpt_step(monkeypatch, fully):
    """A traced 4-layer GPT training step (reshapes, broadcasts, the backward and update marked free_devices,
    write-back ops): recursive_programming decides its levels at once (searchers.rp_levels) and must give
    exactly the op-by-op plan."""
    from gpt import GPT

    import searchers.recursive_programming as rp
    import searchers.rp_levels as rpl
    from mshard._src.jaxpr.op_graph import jaxpr_to_graph
    from mshard._src.planning.prepare import free_derived
    from searchers import DeviceMesh
    from searchers.cost import CostParams

    net = GPT(nnx.Rngs(0), vocab=32, hidden=32, heads=4, ffn=64, seq=8, layers=4)
    graphdef, state, rest = nnx.split(net, nnx.Param, ...)
    leaves = jax.tree.leaves(state)

    def step(state, ids, labels):
        def loss(state):
            logits = nnx.merge(graphdef, state, rest)(ids)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))
        value, grads = jax.value_and_grad(loss)(state)
        return value, jax.tree.map(lambda p, g: p - 0.1 * g, state, grads)

    ids = jnp.zeros((16, 8), jnp.int32)
    cj = jax.make_jaxpr(step)(state, ids, ids)
    n = len(leaves)
    r = jaxpr_to_graph(cj, DeviceMesh.prime(8), ["param"] * n + ["data", "data"],
                       [f"p{i}" for i in range(n)] + ["ids", "labels"], state_outputs=[(1 + i, i) for i in range(n)])
    free_derived(r.graph, 1)
    ran = []
    real = rpl.LevelBatch.sweep
    monkeypatch.setattr(rpl.LevelBatch, "sweep", lambda self, *a: ran.append(self.n_levels) or real(self, *a))
    plans = {}
    for least in (10**9, 1):
        monkeypatch.setattr(rp, "LEVEL_MIN_OPS", least)
        plans[least] = rp.recursive_programming(r.graph, CostParams(), fully_use_devices=fully, cache=False)
    assert ran and min(ran) > 0                       # the level path ran in every round
    assert plans[1].strategies == plans[10**9].strategies
    assert plans[1].cost.total == plans[10**9].cost.total


@pytest.mark.parametrize("mode,searches", [("dynamic_programming", 1), ("ilp", 1), ("recursive_programming", 2)])
def test_a_training_step_keeps_its_state_layout_in_one_search_where_the_searcher_ties_exactly(monkeypatch, mode,
                                                                                             searches):
    """Updated state is stored in its input's layout. dynamic_programming and ilp search under the write-back
    ties (Op.follow_operand) in one pass; recursive_programming applies them after its search and searches
    again with the state held. Either way every write-back keeps its input's layout."""
    import dataclasses
    import functools

    import optax

    from mshard import nn
    from mshard._src.planning import search
    from searchers.graph import operand_layout, result_layout

    seen = []
    real = search.SEARCHERS[mode]

    @functools.wraps(real.fn)
    def spy(graph, params, **kw):
        r = real.fn(graph, params, **kw)
        if any(op.kind == "writeback" for op in graph.ops):
            seen.append((graph, r.strategies))
        return r

    monkeypatch.setitem(search.SEARCHERS, mode, dataclasses.replace(real, fn=spy))
    x, y = jnp.ones((16, 16)), jnp.ones((16, 8))
    with auto(mode):
        step = nn.TrainOneStepCell(nn.WithLossCell(MLP(16, 32, 8), lambda p, y: jnp.mean((p - y) ** 2)),
                                   optax.sgd(0.1))
        step(x, y)
        notes = " ".join(step.plan(x, y).notes)
    assert len(seen) == searches
    graph, strategies = seen[-1]
    wb = [o for o in graph.ops if o.kind == "writeback"]
    assert len(wb) == 2                                       # w1 and w2
    for op in wb:
        src = graph.ops[graph.tensors[op.inputs[1]].producer]
        assert operand_layout(op, strategies[op.id], 1) == result_layout(src, strategies[src.id], 0), op.name
    assert ("tied to its input" in notes) == (searches == 1)
    assert ("searched again" in notes) == (searches == 2)


def test_a_searched_gpt_training_step_moves_no_more_than_data_parallel():
    """Issue 14 (training steps no worse than data parallel): the GPT of examples/train_gpt.py (1 block), one SGD
    step, searched by dynamic_programming over a data-parallel batch, compiles to no more bytes and collectives
    than data_parallel's one all-reduce. Its bias and norm gradients are two-stage sums (batch, then sequence):
    XLA merges their all-reduces with the rest, and searchers.graph.mark_merged_reductions must say so; when it
    charged them a latency each, the search gathered the batch for them instead (3.2x data parallel's bytes, seen
    once the parameter-only ops were freed from fully_use_devices)."""
    import optax
    from train_gpt import LOSS, make_gpt, synthetic_batches

    from mshard import nn

    x, y = synthetic_batches(1)[0]

    def compiled(**ctx):
        with ms.parallel_context(device_num=8, gradients_mean=True, **ctx):
            step = nn.TrainOneStepCell(nn.WithLossCell(make_gpt(nnx.Rngs(0), layers=1), LOSS), optax.sgd(0.01))
            rep = ms.comm_report(step, x, y)
            loss = step(x, y)
        return rep, loss

    dp, dp_loss = compiled(parallel_mode="data_parallel")
    auto_rep, auto_loss = compiled(parallel_mode="auto_parallel", search_mode="dynamic_programming",
                                   dataset_strategy="data_parallel")
    bytes_of = lambda r: sum(v["bytes"] for v in r.by_kind.values())
    assert bytes_of(auto_rep) <= bytes_of(dp) and auto_rep.total_count <= dp.total_count, (auto_rep.by_kind,
                                                                                         dp.by_kind)
    # float32: the same sums over a split batch, reordered (n * 2**-24 relative, n <= 512 tokens)
    assert jnp.allclose(auto_loss, dp_loss, rtol=1e-4, atol=1e-5)


def _conv_step(x, y, **ctx):
    """(plan, comm report, loss) of one SGD step of examples/models.py's ConvNet (conv, BatchNorm, head) on 8
    devices under ``ctx``."""
    import optax
    from models import ConvNet

    from mshard import nn

    with ms.parallel_context(device_num=8, gradients_mean=True, **ctx):
        step = nn.TrainOneStepCell(nn.WithLossCell(ConvNet(), nn.MSELoss()), optax.sgd(0.01))
        return step.plan(x, y), ms.comm_report(step, x, y), float(step(x, y))


def test_a_batch_norm_steps_independent_all_reduces_are_priced_as_xla_merges_them():
    """Issue 14: XLA's combiner merges every set of all-reduces that do not depend on one another, not only a step's
    final gradient sums: a batch norm's mean and mean square, or its two backward sums, are one all-reduce each.
    searchers.graph.mark_merged_reductions sorts the reductions into such sets by depth; the data-parallel step that
    computes one device's values (semi_auto's default: the batch statistics all-reduced) then costs as many
    latencies as it compiles all-reduces (5), where the plan priced 7 before. Pricing 7, recursive_programming
    preferred a plan of 7 collectives and 29,572 B under full_batch (the next test)."""
    from models import ConvNet, inputs

    (x,) = inputs("conv")
    y = jnp.zeros_like(ConvNet()(x))
    plan, rep, _ = _conv_step(x, y, parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")
    latency, bandwidth = 5e-6, 100e9                                    # DeviceMesh's defaults per axis
    charged = (plan.cost.comm_time - sum(plan.cost.communication.values()) / bandwidth) / latency
    assert rep.total_count == rep.count("all-reduce") > 1, rep.by_kind
    # float64: the subtraction loses ~1e-22 s of a 5e-6 s latency, far below 1e-9 of it
    assert charged == pytest.approx(rep.count("all-reduce"), rel=1e-9), (charged, rep.by_kind)


def test_a_searched_conv_step_moves_no_more_than_the_data_parallel_that_equals_one_device():
    """Issue 14 (training steps no worse than data parallel): data_parallel mode computes each replica's batch
    statistics (MindSpore's data parallel; its loss is not one device's), so a searched conv+BatchNorm step, which
    computes one device's values, is held to the data parallel that does too: semi_auto's default, the batch
    statistics all-reduced. recursive_programming under full_batch moved 29,572 B in 7 collectives against its
    11,012 B in 5 before the reductions were priced by merged set."""
    from models import ConvNet, inputs

    (x,) = inputs("conv")
    y = jnp.zeros_like(ConvNet()(x))
    _, base, base_loss = _conv_step(x, y, parallel_mode="semi_auto_parallel", dataset_strategy="data_parallel")
    _, _, one_loss = _conv_step(x, y, parallel_mode="stand_alone")
    _, auto, auto_loss = _conv_step(x, y, parallel_mode="auto_parallel", search_mode="recursive_programming",
                                    dataset_strategy="full_batch")
    moved = lambda r: sum(v["moved"] for v in r.by_kind.values())
    assert moved(auto) <= moved(base) and auto.total_count <= base.total_count, (auto.by_kind, base.by_kind)
    # float32: the same batch statistics and loss summed in another order over 16 x 8 x 8 values per channel
    # (n * 2**-24 relative, n <= 1024)
    assert auto_loss == pytest.approx(one_loss, rel=1e-4) and base_loss == pytest.approx(one_loss, rel=1e-4)


def _bench_step(name, **ctx):
    """(comm report, loss, plan notes) of one SGD step of examples/models.py's ``name`` (the nets bench/plans_vs_baselines.py
    measures) on 8 devices under ``ctx``."""
    import optax
    from models import EmbedClassifier

    from mshard import nn

    net = EmbedClassifier() if name == "embed" else {"mlp": MLP, "transformer": TransformerBlock}[name]()
    data = inputs(name)
    with ms.parallel_context(device_num=8, gradients_mean=True, **ctx):
        if name == "embed":
            cell = net                                       # the classifier computes its own loss
        else:
            data = (data[0], jnp.zeros_like(net(data[0])))
            cell = nn.WithLossCell(net, nn.MSELoss())
        step = nn.TrainOneStepCell(cell, optax.sgd(0.01))
        return ms.comm_report(step, *data), float(step(*data)), step.plan(*data).notes


@pytest.mark.parametrize("mode", ["dynamic_programming", "sharding_propagation"])
@pytest.mark.parametrize("name", ["mlp", "transformer", "embed"])
def test_a_searched_bench_net_step_moves_no_more_than_data_parallel(name, mode):
    """Issue 37: the compiled HLO is the witness, not the cost model. A searched training step of each bench net
    (bench/plans_vs_baselines.py's MLP, transformer block and embedding classifier; the GPT and conv net have their
    own tests above) over a data-parallel batch moves no more bytes per device than data_parallel's program, and
    computes the same loss. sharding_propagation, MindSpore's algorithm, keeps its propagation (issue 40): where it
    moves more, its plan says which obvious plan costs less, with both figures."""
    base, base_loss, _ = _bench_step(name, parallel_mode="data_parallel")
    auto, auto_loss, notes = _bench_step(name, parallel_mode="auto_parallel", search_mode=mode,
                                         dataset_strategy="data_parallel")
    moved = lambda r: sum(v["moved"] for v in r.by_kind.values())
    if mode == "sharding_propagation" and moved(auto) > moved(base):
        assert any("kept the propagation" in n for n in notes), (auto.by_kind, base.by_kind, notes)
    else:
        assert moved(auto) <= moved(base), (auto.by_kind, base.by_kind)
    # float32: the same loss summed in another order over the split batch (n * 2**-24 relative, n <= 2048)
    assert auto_loss == pytest.approx(base_loss, rel=1e-4, abs=1e-6)
