"""One legality (docs/design.md invariant 5): the same rule decides what a searcher may choose for a primitive object and
what a user may ask of it, swept in both directions; and every strategy a plan reports is one the user could type
back in (invariant 3)."""

import itertools
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import mshard as ms
from mshard import nn, ops
from mshard._src.jaxpr import marks
from mshard._src.jaxpr.op_graph import jaxpr_to_graph
from mshard.errors import StrategyError
from searchers import DeviceMesh
from searchers.graph import operand_layout
from searchers.strategies import enumerate_strategies

MESH = DeviceMesh.prime(8)

# (primitive object factory, tensor shapes, attributes)
CASES = {
    "MatMul": (lambda: ops.MatMul(), [(8, 16), (16, 8)], ()),
    "MatMul_tb": (lambda: ops.MatMul(transpose_b=True), [(8, 16), (8, 16)], ()),
    "BatchMatMul_tb": (lambda: ops.BatchMatMul(transpose_b=True), [(2, 4, 8, 4), (2, 4, 8, 4)], ()),
    "Softmax": (lambda: ops.Softmax(-1), [(4, 8, 16)], ()),
    "LogSoftmax": (lambda: ops.LogSoftmax(-1), [(8, 16)], ()),
    "LayerNorm": (lambda: ops.LayerNorm(-1, -1), [(8, 16), (16,), (16,)], ()),
    "ReduceSum": (lambda: ops.ReduceSum(), [(8, 16)], (1,)),
    "Add": (lambda: ops.Add(), [(8, 16), (8, 16)], ()),
    "BiasAdd": (lambda: ops.BiasAdd(), [(8, 16), (16,)], ()),
    "ReLU": (lambda: ops.ReLU(), [(8, 16)], ()),
    "Transpose": (lambda: ops.Transpose(), [(8, 16)], ((1, 0),)),
    "Reshape": (lambda: ops.Reshape(), [(8, 16)], ((8, 4, 4),)),
    "Gather": (lambda: ops.Gather(), [(16, 8), (8,)], (0,)),
    "Conv2D_same": (lambda: ops.Conv2D(8, 3, pad_mode="same"), [(2, 4, 8, 8), (8, 4, 3, 3)], ()),
    "Conv2D_valid": (lambda: ops.Conv2D(8, 3, pad_mode="valid"), [(2, 4, 8, 8), (8, 4, 3, 3)], ()),
}


def _args(shapes, attrs):
    return [jnp.zeros(s, jnp.int32 if i == 1 and len(s) == 1 else jnp.float32) for i, s in enumerate(shapes)], attrs


def _searchable(make, shapes, attrs) -> set:
    """The MindSpore strategies a searcher may give the object: every strategy of its op in a traced region."""
    prim = make()
    tensors, attrs = _args(shapes, attrs)
    with marks.recording_into(marks.TraceRecord(device_num=8)):
        closed = jax.make_jaxpr(lambda *t: prim(*t, *attrs))(*tensors)
    tr = jaxpr_to_graph(closed, MESH, ["data"] * len(tensors), [f"x{i}" for i in range(len(tensors))],
                        primitives=True)
    groups = [te for te in tr.eqns if te.group]
    if not groups:         # an object planned as the JAX it computes (Reshape): that one equation's strategies
        (te,) = [te for te in tr.eqns if te.primitive != "mshard_mark"]
        op = tr.graph.ops[te.op]
        return {tuple(tuple(MESH.count(axes) for axes in operand_layout(op, s, i)) for i in range(len(op.inputs)))
                for s in enumerate_strategies(op, MESH)}
    (te,) = groups
    op, note = tr.graph.ops[te.op], te.eqn.params["note"]
    out = set()
    for s in enumerate_strategies(op, MESH):
        where = dict(zip(op.dims, s, strict=True))
        out.add(tuple(tuple(MESH.count(where.get(letter, ())) if letter else 1 for letter in dims)
                      for dims in note.in_dims))
    return out


def _accepted(make, shapes, attrs) -> set:
    """Every strategy (split counts 1/2/4/8, each input's product <= 8) the object's .shard accepts in a region."""
    tensors, attrs = _args(shapes, attrs)
    per_input = [[c for c in itertools.product((1, 2, 4, 8), repeat=len(s)) if math.prod(c) <= 8] for s in shapes]
    out = set()
    for st in itertools.product(*per_input):
        prim = make().shard(st)
        try:
            with marks.recording_into(marks.TraceRecord(device_num=8)):
                jax.eval_shape(lambda *t, prim=prim: prim(*t, *attrs), *tensors)
        except StrategyError:
            continue
        out.add(st)
    return out


# Strategies a user may ask for that a search never picks: XLA's partitioner computes wrong values for them, so the
# program realises them another way (mshard._src.planning.xla_guards: a 3x3 "same" window split over height or width with split
# out-channels runs with the kernel gathered over its out-channels); a search must not price a layout the program
# does not run.
GUARDED = {"Conv2D_same": lambda st: (st[0][2] > 1 or st[0][3] > 1) and st[1][0] > 1}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_searcher_may_choose_exactly_what_a_user_may_ask(case):
    """On main, searches split Softmax's axis (the attention net got ((1, 1, 1, 8),)) while
    ops.Softmax(axis=-1).shard(((1, 1, 1, 8),)) was refused; a primitive object was not one op of the search."""
    make, shapes, attrs = CASES[case]
    searchable, accepted = _searchable(make, shapes, attrs), _accepted(make, shapes, attrs)
    guarded = {st for st in accepted if GUARDED.get(case, lambda st: False)(st)}
    assert searchable, case
    assert searchable - accepted == set(), f"{case}: searched but refused: {sorted(searchable - accepted)[:5]}"
    assert accepted - searchable == guarded, f"{case}: accepted but never searched: {sorted(accepted - searchable)[:5]}"
    assert guarded or case not in GUARDED, case          # the guarded pairs exist and are asked for


def test_softmax_axis_is_neither_searched_nor_accepted():
    with pytest.raises(StrategyError, match="Softmax cannot split dim 3"):
        prim = ops.Softmax(axis=-1).shard(((1, 1, 1, 8),))
        with marks.recording_into(marks.TraceRecord(device_num=8)):
            jax.eval_shape(prim, jnp.zeros((2, 4, 8, 8)))
    assert all(st[0][-1] == 1 for st in _searchable(lambda: ops.Softmax(-1), [(2, 4, 8, 8)], ()))


SEARCH_MODES = ("sharding_propagation", "recursive_programming", "dynamic_programming")


def _objects(net) -> dict[tuple[str, str], ops.Primitive]:
    """(module scope, kind) -> the net's primitive object of that kind in that module (plan names are scope/Kind)."""
    out = {}
    for path, sub in nnx.iter_graph(net):
        if isinstance(sub, nnx.Module):
            for v in vars(sub).values():
                if isinstance(v, ops.Primitive):
                    out[("/".join(map(str, path)), v.kind)] = v
    return out


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_searched_attention_reports_strategies_a_user_could_type_back_in(mode):
    """Every primitive object's reported strategy is accepted by its own .shard (one device matrix, shared dims
    agreeing, Softmax's axis whole) and, typed back in semi_auto, runs equal to one device. On main
    sharding_propagation gave Softmax ((1, 1, 1, 8),) and MatMuls strategies whose inputs disagreed."""
    ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8)
    make = lambda: nn.MultiHeadAttention(32, 4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (8, 16, 32))
    plan = ms.jit(lambda m, x: m(x)).plan(make(), x)
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", search_mode="recursive_programming")
    net = make()
    objects = _objects(net)
    typed = 0
    for op in plan.ops:
        prim = objects.get((op.name.rsplit("/", 1)[0] if "/" in op.name else "", op.kind))
        if prim is None:
            continue
        if op.kind == "Softmax":
            assert op.strategy[0][-1] == 1, (op.name, op.strategy)
        prim.shard(op.strategy)              # raises StrategyError for a strategy that is not one
        typed += 1
    assert typed == 11                       # q, k, v, projection: MatMul + BiasAdd; qk, softmax, pv
    y = ms.jit(lambda m, x: m(x))(net, x)    # the primitive objects' checks run while it traces
    # float32: 32-term projections and a 16-term softmax, sums reordered by the partitioning
    assert jnp.allclose(y, make()(x), rtol=1e-4, atol=1e-5)


class ThreeOps(nn.Cell):
    """The issue's 2-layer MLP: mm1 column parallel, relu1 and mm2 left to the search."""

    def __init__(self, rngs):
        self.w1 = nnx.Param(jax.random.normal(rngs.params(), (32, 128)))
        self.w2 = nnx.Param(jax.random.normal(rngs.params(), (128, 16)))
        self.mm1, self.relu, self.mm2 = ops.MatMul(name="mm1"), ops.ReLU(name="relu1"), ops.MatMul(name="mm2")

    def __call__(self, x):
        return self.mm2(self.relu(self.mm1(x, self.w1[...])), self.w2[...])


def _hlo_collectives(region, *args):
    from mshard._src.edges.comm_report import CommReport
    return sorted((c.kind, c.nbytes) for c in CommReport.from_hlo(region.lower(*args).compile().as_text()).collectives)


@pytest.mark.parametrize("mode", SEARCH_MODES)
def test_plan_strategies_replay_to_the_same_collectives(mode, tmp_path):
    """plan.strategy_of('mm2/') was ((2, 4), (8, 1)) on main (sharding_propagation): not a strategy, refused by
    MatMul.shard. Now each entry is typed back in semi_auto (primitive .shard, and the strategy file) and
    compiles to the searched program's collectives."""
    x = jax.random.normal(jax.random.key(1), (64, 32))
    ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode=mode, device_num=8)
    net = ThreeOps(nnx.Rngs(0))
    net.mm1.shard(((2, 1), (1, 4)))
    searched = ms.jit(lambda n, x: n(x))
    plan = searched.plan(net, x)
    want = _hlo_collectives(searched, net, x)
    plan.save(tmp_path / "plan.json")
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    typed = ThreeOps(nnx.Rngs(0))
    for attr, name in (("mm1", "mm1/"), ("relu", "relu1/"), ("mm2", "mm2/")):
        getattr(typed, attr).shard(plan.strategy_of(name))
    replay = ms.jit(lambda n, x: n(x))
    assert _hlo_collectives(replay, typed, x) == want
    # float32: 32- and 128-term sums reordered by the partitioning
    assert jnp.allclose(replay(typed, x), ThreeOps(nnx.Rngs(0))(x), rtol=1e-4, atol=1e-4)
    ms.set_auto_parallel_context(strategy_ckpt_config={"load_file": str(tmp_path / "plan.json")})
    loaded = ms.jit(lambda n, x: n(x))
    assert _hlo_collectives(loaded, ThreeOps(nnx.Rngs(0)), x) == want
    assert "redistribution" not in plan.summary() or plan.redistributions


def test_an_operand_arriving_in_another_layout_is_listed_as_a_redistribution(capsys):
    """mm2 asks for its weight split over the model axes while the dataset strategy delivers it split 8 ways: the
    plan lists that move on its own line (from -> to, collective, bytes), the summary shows it, prints nothing."""
    ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8,
                                 dataset_strategy=((2, 1), (1, 1), (8, 1)))
    x = jax.random.normal(jax.random.key(1), (64, 32))
    mm1, mm2 = ops.MatMul(name="mm1").shard(((2, 1), (1, 4))), ops.MatMul(name="mm2").shard(((2, 4), (4, 1)))
    f = ms.jit(lambda x, w1, w2: mm2(mm1(x, w1), w2))
    plan = f.plan(x, jnp.ones((32, 128)), jnp.ones((128, 16)))
    moves = [r for r in plan.redistributions if r.op == "mm2/MatMul" and r.operand == 1]
    assert len(moves) == 1 and moves[0].src == (8, 1) and moves[0].dst == (4, 1)
    assert moves[0].communication.get("all-gather", 0) > 0
    text = plan.summary()
    assert "redistribution: mm2/MatMul operand 1 (128, 16): (8, 1) -> (4, 1)" in text
    assert "<table>" in text._repr_html_()
    assert "mm2/MatMul" in plan.explain("mm2/")
    assert capsys.readouterr().out == ""                  # summary and explain return, they do not print
    with pytest.raises(AttributeError):
        plan.ops[0].strategy = ((1, 1), (1, 1))           # a frozen value: the plan cannot drift from the program


@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
def test_semi_auto_plan_is_the_program_it_runs(train):
    """On main, semi_auto's plan said relu1 (8, 1) (a data-parallel default) while the program let XLA propagate
    (a 16 KB all-reduce) and replaying the plan compiled to an 8 KB all-to-all. Now semi_auto plans through the
    same path as auto (user strategies fixed, every other op in the layout its operands arrive in), pins every op,
    and its plan replays to its own collectives; its predicted bytes per collective kind match the HLO's."""
    from mshard._src.edges.comm_report import CommReport
    x = jax.random.normal(jax.random.key(1), (64, 32))
    fn = (lambda n, x: nnx.value_and_grad(lambda n: jnp.sum(n(x) ** 2))(n)) if train else (lambda n, x: n(x))
    ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    net = ThreeOps(nnx.Rngs(0))
    net.mm1.shard(((2, 1), (1, 4)))
    f = ms.jit(fn)
    plan = f.plan(net, x)
    assert plan.algorithm == "follow_operands"
    assert plan.strategy_of("relu1") == ((2, 4),)          # the column-parallel split flows on, as it runs
    report = CommReport.from_hlo(f.lower(net, x).compile().as_text())
    for kind in set(plan.cost.communication) | set(report.by_kind):
        pred, real = plan.cost.communication.get(kind, 0.0), report.moved(kind)
        assert abs(pred - real) <= 0.10 * max(pred, real), (kind, pred, real)
    typed = ThreeOps(nnx.Rngs(0))
    for attr, name in (("mm1", "mm1"), ("relu", "relu1"), ("mm2", "mm2")):
        getattr(typed, attr).shard(plan.strategy_of(name))
    g = ms.jit(fn)
    assert _hlo_collectives(g, typed, x) == _hlo_collectives(f, net, x)
    # float32: 32- and 128-term sums reordered by the partitioning (the loss sums 1024 squares of order 1e2). The
    # weight gradients reach ~3e4, so an entry that cancels to near 0 carries an absolute error of up to
    # ~128 * 2**-24 (~8e-6) of the leaf's largest entries: atol is 1e-5 of each leaf's largest magnitude (a fixed
    # atol=1e-3 failed at 0.006 on a machine whose XLA:CPU sums in another order)
    for a, b in zip(jax.tree.leaves(f(net, x)), jax.tree.leaves(fn(ThreeOps(nnx.Rngs(0)), x)), strict=True):
        assert jnp.allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(b))))


RESHAPES = [((64, 8), (4, 128)), ((8, 6), (48,)), ((2, 64), (128,)), ((8, 16), (8, 4, 4)), ((4, 6, 8), (24, 8)),
            ((6, 4), (4, 6)), ((12, 8), (8, 12)), ((4, 2, 8), (4, 16)), ((16, 4), (2, 8, 4)), ((4, 6), (2, 12))]


@pytest.mark.parametrize("shape, new", RESHAPES, ids=[f"{a}->{b}" for a, b in RESHAPES])
def test_reshape_accepts_exactly_the_splits_whose_blocks_stay_blocks(shape, new):
    """ops.Reshape's .shard accepts a split exactly where each device's block, placed in the new shape, is a block
    of the new shape too (numpy on the flat indices, tests/fuzz_programs.py ``_blocks_stay_blocks``); every split
    count a power of two up to 8 that divides its dim."""
    from fuzz_programs import _blocks_stay_blocks
    options = [[c for c in (1, 2, 4, 8) if n % c == 0] for n in shape]
    for counts in itertools.product(*options):
        if math.prod(counts) > 8:
            continue
        try:
            ops.Reshape().shard((counts,)).spec([shape], [new])
            accepted = True
        except StrategyError:
            accepted = False
        assert accepted == _blocks_stay_blocks(shape, new, counts), (shape, new, counts)

