"""What every searcher promises (issue 5): a strategy per op from its candidates, the predicted
cost equal to graph_cost, user strategies untouched, fully_use_devices, any device count,
the search cache and a silent progress bar under pytest."""

import io
import re

import pytest

from searchers.cache import SEARCH_CACHE, graph_key
from searchers.cost import CostParams, graph_cost
from searchers.dynamic_programming import dynamic_programming
from searchers.generators import conv_net, mlp_chain, random_dag, transformer_stack
from searchers.graph import DeviceMesh, Graph
from searchers.ilp import ilp
from searchers.progress import Progress, progress_enabled
from searchers.propagation import sharding_propagation
from searchers.recursive_programming import recursive_programming
from searchers.result import SearchResult
from searchers.strategies import enumerate_strategies

P = CostParams()
SEARCHERS = {"dynamic_programming": dynamic_programming, "recursive_programming": recursive_programming,
             "ilp": ilp}


def valid(g, strategies, fully=False):
    assert set(strategies) == {op.id for op in g.ops}
    for op in g.ops:
        assert strategies[op.id] in enumerate_strategies(op, g.mesh, fully_use_devices=fully), op.name


def small_graphs(mesh):
    return {
        "mlp": mlp_chain(2, 16, 8, mesh),
        "mlp_training": mlp_chain(1, 16, 8, mesh, backward=True),
        "block": transformer_stack(1, 2, 6, 12, 2, 24, mesh, backward=False),
        "conv": conv_net(4, 4, (2, 4), 6, mesh),
        "random": random_dag(30, 1, mesh),
    }


@pytest.mark.parametrize("name", SEARCHERS)
@pytest.mark.parametrize("graph", ["mlp", "mlp_training", "block", "conv", "random"])
def test_result_is_a_valid_plan_with_its_graph_cost(name, graph):
    g = small_graphs(DeviceMesh((2, 2)))[graph]
    res = SEARCHERS[name](g, P, cache=False)
    assert isinstance(res, SearchResult) and res.algorithm == name and res.seconds >= 0
    valid(g, res.strategies)
    ref = graph_cost(g, res.strategies, P)
    # float64: the plan's cost is graph_cost of the same strategies, at most re-summed (~n * 2**-53, far below 1e-9)
    assert res.cost.total == pytest.approx(ref.total, rel=1e-9)
    assert res.cost.memory == pytest.approx(ref.memory, rel=1e-9)


@pytest.mark.parametrize("name", SEARCHERS)
def test_user_strategies_survive(name):
    g = transformer_stack(1, 2, 6, 12, 2, 24, DeviceMesh((2, 2)), backward=True)
    fixed = {}
    for op in g.ops:
        if op.kind == "data":
            op.fixed = ((0, 1), (), ())
        elif op.name.endswith("mlp/fc1/dot_general"):
            op.fixed = ((), (), (0, 1), ())             # b s f d: f split (Megatron column)
        elif op.name.endswith("attn/wq"):
            op.fixed = ((), (1,), ())                   # a parameter layout
        elif op.name.endswith("ln2/rsqrt"):
            op.fixed = ((), ())                         # replicated on purpose
        if op.fixed is not None:
            fixed[op.id] = op.fixed
    assert len(fixed) == 4
    res = SEARCHERS[name](g, P, cache=False)
    for oid, s in fixed.items():
        assert res.strategies[oid] == s, g.ops[oid].name


@pytest.mark.parametrize("name", [*SEARCHERS, "sharding_propagation"])
@pytest.mark.parametrize("free", [False, True])
def test_free_devices_ops_are_exempt_from_fully_use_devices(name, free):
    """x and the consumer of exp(x) hold 2-way layouts on a (2, 2) mesh. Under fully_use_devices exp must
    use both axes (its result then gathered for the consumer); marked free_devices (a training step's backward
    or update) it keeps the 2-way layout and nothing moves. sharding_propagation keeps it either way: a neighbour
    takes the layout that needs no redistribution, fully_use_devices restricts the cost-model searchers only."""
    g = Graph(DeviceMesh((2, 2)))
    x = g.source("x", (8,), fixed=((0,),))
    (y,) = g.add_op("exp", "exp", {"i": 8}, [x], [("i",)], [("i",)], free_devices=free)
    g.add_op("neg", "neg", {"i": 8}, [y], [("i",)], [("i",)], fixed=((0,),))
    search = sharding_propagation if name == "sharding_propagation" else SEARCHERS[name]
    res = search(g, P, fully_use_devices=True, cache=False)
    if free or name == "sharding_propagation":
        assert res.strategies[1] == ((0,),) and res.cost.communication == 0
        assert (((0,),) in enumerate_strategies(g.ops[1], g.mesh, fully_use_devices=True)) == free
    else:
        assert sorted(a for axes in res.strategies[1] for a in axes) == [0, 1] and res.cost.communication > 0


@pytest.mark.parametrize("name", SEARCHERS)
def test_fully_use_devices_uses_every_axis(name):
    mesh = DeviceMesh((2, 2, 2))
    g = mlp_chain(2, 16, 8, mesh, backward=True)
    res = SEARCHERS[name](g, P, fully_use_devices=True, cache=False)
    valid(g, res.strategies, fully=True)
    for op in g.ops:
        if not op.is_source:            # inputs are exempt: a tensor's layout follows its users
            used = sorted(a for axes in res.strategies[op.id] for a in axes)
            assert used == [0, 1, 2], (op.name, res.strategies[op.id])
    free = SEARCHERS[name](g, P, cache=False)
    # 1e-9: the ILP's mip_rel_gap (and float64 re-summation, ~1e-15): a constrained plan cannot beat the free optimum
    assert res.cost.total >= free.cost.total * (1 - 1e-9) or name == "recursive_programming"


@pytest.mark.parametrize("name", SEARCHERS)
@pytest.mark.parametrize("devices", [6, 12])
def test_device_counts_that_are_not_powers_of_two(name, devices):
    mesh = DeviceMesh.prime(devices)
    assert mesh.shape == ((2, 3) if devices == 6 else (2, 2, 3))
    g = mlp_chain(2, 24, 12, mesh, backward=True)
    res = SEARCHERS[name](g, P, cache=False)
    valid(g, res.strategies)
    # float64: the plan's cost is graph_cost of the same strategies, at most re-summed (~n * 2**-53, far below 1e-9)
    assert res.cost.total == pytest.approx(graph_cost(g, res.strategies, P).total, rel=1e-9)
    # the 24-row batch splits over every device in the data-parallel way somewhere
    assert any(res.strategies[op.id] and any(len(a) for a in res.strategies[op.id]) for op in g.ops)


@pytest.mark.parametrize("name", SEARCHERS)
def test_a_graph_without_ops_and_a_one_device_mesh(name):
    assert SEARCHERS[name](Graph(DeviceMesh((2,))), P, cache=False).strategies == {}
    g = mlp_chain(1, 4, 4, DeviceMesh((1,)))
    res = SEARCHERS[name](g, P, cache=False)
    assert all(all(a == () or a == (0,) for a in s) for s in res.strategies.values())


@pytest.mark.parametrize("name", [*SEARCHERS, "sharding_propagation"])
def test_second_search_of_the_same_graph_is_a_cache_hit(name):
    SEARCH_CACHE.clear()
    search = {**SEARCHERS, "sharding_propagation": sharding_propagation}[name]
    g = mlp_chain(2, 16, 8, DeviceMesh((2, 2)))
    first = search(g, P)
    again = search(mlp_chain(2, 16, 8, DeviceMesh((2, 2))), P)      # an equal, new graph
    assert SEARCH_CACHE.hits == 1 and SEARCH_CACHE.misses == 1
    assert again.strategies == first.strategies and again.cost == first.cost
    assert any("from the search cache" in n for n in again.notes)
    again.strategies.clear()                                               # callers may edit results
    assert search(g, P).strategies == first.strategies
    # other options, other parameters, a changed graph, or cache=False: a new search
    search(g, P, fully_use_devices=True)
    search(g, CostParams(beta=1.0))
    g.ops[0].fixed = ((0,), ())
    search(g, P)
    assert SEARCH_CACHE.misses == 4
    search(g, P, cache=False)
    assert SEARCH_CACHE.misses == 4 and SEARCH_CACHE.hits == 2


def test_graph_key_sees_structure_not_identity():
    a, b = mlp_chain(2, 16, 8, DeviceMesh((2, 2))), mlp_chain(2, 16, 8, DeviceMesh((2, 2)))
    assert graph_key(a) == graph_key(b)
    assert graph_key(a) != graph_key(mlp_chain(2, 16, 16, DeviceMesh((2, 2))))
    assert graph_key(a) != graph_key(mlp_chain(2, 16, 8, DeviceMesh((2, 2, 1))))


@pytest.mark.parametrize("name", SEARCHERS)
def test_searchers_print_nothing_under_pytest(name, capsys):
    assert not progress_enabled()
    SEARCHERS[name](transformer_stack(1, 2, 6, 12, 2, 24, DeviceMesh((2, 2))), P, cache=False)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_progress_bar_appears_only_after_its_delay():
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80)
    with Progress("searching", total=4, enabled=True, delay=0.0, console=console) as bar:
        bar.advance(2)
        bar.update(description="still searching")
    assert bar.shown
    with Progress("quick", total=4, enabled=True, delay=30.0, console=console) as quick:
        quick.advance(4)
    assert not quick.shown                   # finished before the delay: never drawn


def test_sharding_propagation_keeps_its_own_contract():
    g = mlp_chain(2, 16, 8, DeviceMesh((2, 2)))
    g.ops[0].fixed = ((0, 1), ())
    res = sharding_propagation(g, P)
    valid(g, res.strategies)
    # 1e-9: the mip_rel_gap of the exact core solver dynamic_programming may call, and float64 re-summation
    assert dynamic_programming(g, P, cache=False).cost.total <= res.cost.total * (1 + 1e-9)


@pytest.mark.parametrize("name", SEARCHERS)
def test_elementwise_op_strategy_follow(name):
    """relu's only consumer wants its operand split along k (relu's j): with the flag, relu follows."""
    g = Graph(DeviceMesh((2,)))
    x = g.source("x", (8, 6))
    w = g.source("w", (6, 4), kind="param")
    (r,) = g.add_op("relu", "relu", {"i": 8, "j": 6}, [x], [("i", "j")], [("i", "j")])
    g.add_op("mm", "dot_general", {"m": 8, "k": 6, "n": 4}, [r, w], [("m", "k"), ("k", "n")], [("m", "n")],
             fixed=((), (0,), ()))
    res = SEARCHERS[name](g, P, elementwise_op_strategy_follow=True, cache=False)
    assert res.strategies[2] == ((), (0,))
    assert any("elementwise_op_strategy_follow" in n for n in res.notes)


def _data_consumers(g):
    """Ids of the ops that read a data input."""
    return {c for op in g.ops if op.kind == "data" for t in op.outputs for c in g.tensors[t].consumers}


def _obvious_plans(g):
    """Built here from the graph alone: the replicated plan, and the data-parallel one (every data input split on
    its batch dim over the axes that divide it, each op computing in the layout its operands arrive in)."""
    from searchers.follow import follow_operands
    from searchers.graph import replicated
    from searchers.strategies import data_parallel_strategy
    plans = {"replicated": {op.id: op.fixed or replicated(op) for op in g.ops}}
    held = [op for op in g.ops if op.kind == "data" and op.fixed is None]
    for op in held:
        op.fixed = data_parallel_strategy(op, g.mesh)
    plans["data parallel"] = follow_operands(g, P).strategies
    for op in held:
        op.fixed = None
    return plans


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)])
@pytest.mark.parametrize("graph", ["mlp", "mlp_training", "block", "conv", "random", "random_b"])
def test_sharding_propagation_keeps_its_propagation_and_notes_a_cheaper_baseline(shape, graph):
    """docs/design.md invariant 6, issue 40: sharding_propagation is MindSpore's algorithm. It returns what it
    propagates, never a baseline; where an obvious plan costs less on the cost model, a note gives both figures."""
    mesh = DeviceMesh(shape)
    g = random_dag(40, 7, mesh) if graph == "random_b" else small_graphs(mesh)[graph]
    res = sharding_propagation(g, P, cache=False)
    bare = sharding_propagation(g, P, baselines=False, cache=False)
    assert res.strategies == bare.strategies
    valid(g, res.strategies)
    noted = [n for n in res.notes if "kept the propagation" in n]
    cheapest = min(graph_cost(g, plan, P).total for plan in _obvious_plans(g).values())
    if noted:
        figures = [float(x) for x in re.findall(r"costs ([0-9.e+-]+) on this cost model, below the propagated "
                                                r"plan's ([0-9.e+-]+)", noted[0])[0]]
        assert figures[0] < figures[1]
    else:   # no note: no obvious plan was cheaper (1e-6: the relative tolerance the check itself allows)
        assert res.cost.total <= cheapest * (1 + 1e-6)


def test_sharding_propagation_notes_the_cheaper_baseline_it_does_not_take():
    """The 2-layer training MLP on a (2, 2) mesh with its first op fixed: the propagation is dearer than data
    parallel by the cost model (0.004 against 7e-9), and sharding_propagation says so instead of swapping."""
    g = small_graphs(DeviceMesh((2, 2)))["mlp_training"]
    res = sharding_propagation(g, P, cache=False)
    assert res.strategies == sharding_propagation(g, P, baselines=False, cache=False).strategies
    assert any("kept the propagation" in n for n in res.notes), res.notes


@pytest.mark.parametrize("name", SEARCHERS)
@pytest.mark.parametrize("fully", [False, True])
@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)])
@pytest.mark.parametrize("graph", ["mlp", "mlp_training", "block", "conv", "random", "random_b"])
def test_no_search_returns_a_plan_worse_than_the_obvious_ones(name, fully, shape, graph):
    """docs/design.md invariant 6: on its own cost model a cost-model search's plan costs no more than the
    data-parallel plan and the replicated one, wherever that plan is one the search may return (under
    fully_use_devices: every unfixed op a candidate). sharding_propagation keeps its own plan (the test above)."""
    mesh = DeviceMesh(shape)
    g = random_dag(40, 7, mesh) if graph == "random_b" else small_graphs(mesh)[graph]
    res = SEARCHERS[name](g, P, fully_use_devices=fully, cache=False)
    movable = [op for op in g.ops if op.fixed is None and op.follow_operand is None and op.id not in g.operand_ties]
    entry = _data_consumers(g)          # under fully_use_devices the batch must enter over every device
    checked = []
    for base, plan in _obvious_plans(g).items():
        if fully and any(op.id in entry and plan[op.id] not in enumerate_strategies(op, mesh, fully_use_devices=True)
                         for op in movable):
            continue                    # not a plan this search may return: it does not bound it
        # 1e-9: float64 re-summation of the same costs (~1e-15) and the ILP's mip_rel_gap
        assert res.cost.total <= graph_cost(g, plan, P).total * (1 + 1e-9), (base, res.notes)
        checked.append(base)
    if not checked:
        # under fully_use_devices neither obvious plan is one the search may return (the replicated one never is;
        # the data-parallel one where a data reader cannot use every device in it): what binds a cost-model search
        # then is fully_use_devices itself, every data reader on a strategy that uses every device
        assert fully
        valid(g, res.strategies)
        for op in movable:
            if op.id in entry and enumerate_strategies(op, mesh, fully_use_devices=True):
                assert res.strategies[op.id] in enumerate_strategies(op, mesh, fully_use_devices=True), op.name


@pytest.mark.parametrize("name", [*SEARCHERS, "sharding_propagation"])
def test_ops_no_data_reaches_do_not_keep_the_data_parallel_plan_out_under_fully_use_devices(name):
    """x (data) @ exp(w) on a (2, 2, 2) mesh. The data-parallel plan splits x's rows over all 8 devices and
    computes exp(w), which no data reaches, whole: nothing moves. fully_use_devices makes the search split exp(w)
    and gather it again; the data-parallel plan still bounds a cost-model search (docs/design.md invariant 6), so no
    bytes move. sharding_propagation keeps MindSpore's default and notes the cheaper plan."""
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (64, 32))
    w = g.source("w", (32, 16), kind="param")
    (ew,) = g.add_op("exp", "exp", {"k": 32, "n": 16}, [w], [("k", "n")], [("k", "n")])
    g.add_op("mm", "dot_general", {"m": 64, "k": 32, "n": 16}, [x, ew], [("m", "k"), ("k", "n")], [("m", "n")])
    assert ((), ()) not in enumerate_strategies(g.ops[2], g.mesh, fully_use_devices=True)
    search = sharding_propagation if name == "sharding_propagation" else SEARCHERS[name]
    res = search(g, P, fully_use_devices=True, cache=False)
    dp = graph_cost(g, _obvious_plans(g)["data parallel"], P)
    assert dp.communication == 0
    if name == "sharding_propagation":
        # MindSpore's default for an op nothing configures splits its first operand's dim 0, exp(w)'s too: the
        # propagation gathers w and keeps that plan, saying the data-parallel plan is cheaper (issue 40)
        assert res.cost.communication > 0 and any("kept the propagation" in n for n in res.notes), res.notes
        return
    # 1e-9: float64 re-summation of the same costs (~1e-15) and the ILP's mip_rel_gap
    assert res.cost.total <= dp.total * (1 + 1e-9) and res.cost.communication == 0, res.notes


@pytest.mark.parametrize("name", [*SEARCHERS, "sharding_propagation"])
def test_under_full_batch_data_parallel_slices_the_whole_batch_for_free(name):
    """full_batch: x arrives whole on every device (fixed replicated). Data parallel is then free to start: the
    product takes its share of x's rows by a local slice and exp(w), which no data reaches, stays whole, so
    nothing moves. w has one column: under fully_use_devices the search splits exp(w) on its rows and gathers them
    (or sums partial products); this plan bounds it."""
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (64, 32), fixed=((), ()))
    w = g.source("w", (32, 1), kind="param")
    (ew,) = g.add_op("exp", "exp", {"k": 32, "n": 1}, [w], [("k", "n")], [("k", "n")])
    g.add_op("mm", "dot_general", {"m": 64, "k": 32, "n": 1}, [x, ew], [("m", "k"), ("k", "n")], [("m", "n")])
    sliced = {0: ((), ()), 1: ((), ()), 2: ((), ()), 3: ((0, 1, 2), (), ())}
    assert graph_cost(g, sliced, P).communication == 0
    search = sharding_propagation if name == "sharding_propagation" else SEARCHERS[name]
    res = search(g, P, fully_use_devices=True, cache=False)
    # 1e-9: float64 re-summation of the same costs (~1e-15) and the ILP's mip_rel_gap
    assert res.cost.total <= graph_cost(g, sliced, P).total * (1 + 1e-9) and res.cost.communication == 0, res.notes


def test_the_registry_declares_what_each_searcher_takes():
    """searchers.protocol: every search_mode is a Searcher whose declared options are keyword parameters of its
    function (the planner passes only those), and the exact searchers are the ones that tie write-backs."""
    import inspect

    from searchers.protocol import SEARCHERS

    for name, s in SEARCHERS.items():
        params = inspect.signature(s.fn).parameters
        assert "fully_use_devices" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()), name
        assert all(o in params for o in s.options), (name, s.options)
    assert {n for n, s in SEARCHERS.items() if s.ties_exactly} == {"dynamic_programming", "ilp"}
    for mode in ("sharding_propagation", "recursive_programming", "dynamic_programming", "ilp"):
        assert mode in SEARCHERS
