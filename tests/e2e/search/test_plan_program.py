"""A searched plan is the program it runs (issue 12, point 3), for the models of examples/models.py.

For every search mode and each model's training step (loss + gradients): the plan's predicted communication per
collective kind is within 10% of the compiled HLO's bytes moved, and replaying the plan's strategies in
semi_auto_parallel through the strategy file compiles to the same collectives (kind and bytes, one by one) and the
same values as one device. On main (3f22c0c) the auto modes missed the 10% on 11 of 24 rows of
bench/predicted_vs_hlo.py: the cost model priced the cheapest conceivable redistribution, not XLA's, and no
collective-permute at all.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from models import MODELS, inputs

import mshard as ms
from mshard._src.edges.comm_report import CommReport

MODES = ("sharding_propagation", "recursive_programming", "dynamic_programming")


def step(m, *a):
    """The model's output and the gradient of every parameter, of a loss that weighs each output element
    differently (a plain sum would hide permuted or misplaced output shards: its cotangent is all ones)."""
    def loss(m):
        y = m(*a)
        w = jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape) * 0.37)
        return jnp.sum(y * w), y
    (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(m)
    return y, grads


def sum_step(m, *a):
    """The loss the random-plan test's redistribution counts were established on (its cotangent is all ones, so
    only the gradients, not the output's placement, are compared there)."""
    return nnx.value_and_grad(lambda m, *a: jnp.sum(m(*a)))(m, *a)


def assert_same_values(got, ref):
    """Every output element and every gradient element against one device. float32: each value sums at most a
    few thousand products (64- to 256-term dot products, a batch of up to 64 rows, the conv's windows), reordered
    by the partitioning: <= n * 2**-24 relative to the sum of the terms' magnitudes (n <= 4096: 2.4e-4), so
    rtol 3e-4 and an atol of 3e-4 of the leaf's largest value for elements that cancel near zero."""
    gl, rl = jax.tree.leaves(got), jax.tree.leaves(ref)
    assert len(gl) == len(rl)
    for k, (a, b) in enumerate(zip(gl, rl, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (k, a.shape, b.shape)
        np.testing.assert_allclose(a, b, rtol=3e-4, atol=3e-4 * float(np.abs(b).max() or 1.0), err_msg=f"leaf {k}")


def collectives(f, *args):
    rep = CommReport.from_hlo(f.lower(*args).compile().as_text())
    return rep, sorted((c.kind, c.nbytes, c.group_size) for c in rep.collectives)


def search_and_replay(model, mode, tmp_path, **ctx):
    """Search ``model``'s training step under ``mode``, save the plan to a strategy file and replay it in
    semi_auto_parallel: asserts both compile to the same collectives one by one and that both programs' values equal
    one device's; -> (the searched plan, its compiled comm report)."""
    xs = inputs(model)
    with ms.parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8, **ctx):
        m = MODELS[model]()
        f = ms.jit(step)
        plan = f.plan(m, *xs)
        rep, want = collectives(f, m, *xs)
        searched = f(m, *xs)
    plan.save(tmp_path / "plan.json")
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, **ctx,
                             strategy_ckpt_config={"load_file": str(tmp_path / "plan.json")}):
        m2 = MODELS[model]()
        g = ms.jit(step)
        assert collectives(g, m2, *xs)[1] == want
        replayed = g(m2, *xs)
    ref = step(MODELS[model](), *xs)
    assert_same_values(replayed, ref)
    assert_same_values(searched, ref)
    return plan, rep


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("model", ["mlp", "conv", "embed", pytest.param("transformer", marks=pytest.mark.slow)])
def test_predicted_communication_is_the_compiled_programs_and_replays(model, mode, tmp_path):
    plan, rep = search_and_replay(model, mode, tmp_path)
    for kind in set(plan.cost.communication) | set(rep.by_kind):
        pred, real = plan.cost.communication.get(kind, 0.0), rep.moved(kind)
        assert abs(pred - real) <= 0.10 * max(pred, real), (kind, pred, real, plan.redistributions)


@pytest.mark.parametrize("mode", [*MODES, "ilp"])
@pytest.mark.parametrize("model", ["mlp", "embed"])
def test_full_batch_plans_replay_to_the_same_collectives(model, mode, tmp_path):
    """Issue 40: the replay above under ``full_batch`` (every input whole on every device), the weights as the
    models' ``nnx.Param``s, for every searcher, ilp included. A two-MatMul MLP under full_batch is where a
    sharding_propagation plan once replayed to other collectives (tests/e2e/regressions, regression 5)."""
    search_and_replay(model, mode, tmp_path, dataset_strategy="full_batch")


@pytest.mark.parametrize("mode", ["data_parallel", "stand_alone"])
@pytest.mark.parametrize("model", ["mlp", "conv", "embed", "transformer"])
def test_data_parallel_and_stand_alone_regions_run_their_plan(model, mode):
    """One planning path (issue 12): a data_parallel / stand_alone region is planned like every other mode, and its
    Plan is the program: the batch split over every device, every parameter whole, the communication it predicts
    is the compiled HLO's (within 10%, as for the searched modes); stand_alone predicts and compiles none. On main
    before this path (07bb735) such a region had no plan of its own: ``plan()`` answered with semi_auto's."""
    xs = inputs(model)
    with ms.parallel_context(parallel_mode=mode, device_num=8, gradients_mean=True):
        m = MODELS[model]()
        f = ms.jit(step)
        plan = f.plan(m, *xs)
        rep, _ = collectives(f, m, *xs)
        got = f(m, *xs)
    assert plan.algorithm == mode
    assert all(not any(d for d in spec) for spec in plan.param_specs.values())       # parameters whole
    if mode == "stand_alone":
        assert not rep.collectives and not any(plan.cost.communication.values())
    else:
        assert rep.by_kind      # the gradient of whole parameters over a split batch is reduced
    for kind in set(plan.cost.communication) | set(rep.by_kind):
        pred, real = plan.cost.communication.get(kind, 0.0), rep.moved(kind)
        assert abs(pred - real) <= 0.10 * max(pred, real), (kind, pred, real, plan.redistributions)
    assert_same_values(got, step(MODELS[model](), *xs))


def _steps_of(r, mesh) -> int:
    from searchers.cost import redistribution_steps
    idx = {n: i for i, n in enumerate(("d0", "d1", "d2"))}
    lay = lambda axes: tuple(tuple(idx[a] for a in d) for d in axes)
    return len(redistribution_steps(lay(r.src_axes), lay(r.dst_axes), mesh))


def test_random_plans_compile_to_exactly_their_redistributions():
    """Issue 14 (the ranking): every redistribution a plan lists is compiled to the collectives the cost model
    prices for it (searchers.xla_reshard, checked pair by pair against HLO elsewhere), and no other collective
    besides the partial sums' all-reduces, on seeded random plans of the MLP training step (the rank bench's draw,
    bench/rank_vs_hlo.py). A tensor computed from constants alone (the ones of the sum's gradient, the zeros of the
    ReLU's) is priced free, as XLA re-broadcasts it where it is read, so it must not be moved: before this (at
    92dfe22) the planner pinned such a broadcast at its own layout and XLA moved it to each reader's with an
    all-to-all and a collective-permute (2-6 collectives a plan more than planned)."""
    import random

    from searchers import protocol
    from searchers.cost import graph_cost
    from searchers.graph import DeviceMesh
    from searchers.result import SearchResult
    from searchers.strategies import enumerate_strategies

    rng = random.Random(0)

    def draw(graph, params, **options):
        st = {op.id: op.fixed if op.fixed is not None
              else rng.choice(enumerate_strategies(op, graph.mesh, fully_use_devices=True)) for op in graph.ops}
        return SearchResult(st, graph_cost(graph, st, params), "random", 0.0)

    slot = "dynamic_programming"
    saved = protocol.SEARCHERS[slot]
    protocol.register(slot, draw)
    xs = inputs("mlp")
    ref = sum_step(MODELS["mlp"](), *xs)
    try:
        for _ in range(5):
            with ms.parallel_context(parallel_mode="auto_parallel", search_mode=slot, device_num=8):
                m = MODELS["mlp"]()
                f = ms.jit(sum_step)
                plan = f.plan(m, *xs)
                rep, _ = collectives(f, m, *xs)
                got = f(m, *xs)
            # less the leading collectives another reader's redistribution of the same tensor already ran (XLA
            # computes them once: a weight gathered whole once and sliced to two layouts)
            planned = sum(_steps_of(r, DeviceMesh((2, 2, 2))) - r.shared for r in plan.redistributions)
            # partial sums are resolved by all-reduces, or reduce-scattered where every reader wants them split over
            # the reduced axes (mshard/_src/planning/scattered_sums.py): those are priced on their op, not listed
            compiled = sum(1 for c in rep.collectives if c.kind not in ("all-reduce", "reduce-scatter"))
            assert compiled == planned, (compiled, planned, [str(r) for r in plan.redistributions])
            assert rep.moved("reduce-scatter") == plan.cost.communication.get("reduce-scatter", 0.0)
            assert_same_values(got, ref)
    finally:
        protocol.SEARCHERS[slot] = saved
