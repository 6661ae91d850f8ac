"""MindSpore's out-strategy propagation and strategy save/load unit tests (issue 40), in our own words.

Source: MindSpore's ``tests/ut/python/parallel/test_auto_parallel_out_strategy_propagation.py`` (auto_parallel,
sharding_propagation, 8 devices, its sizes). MindSpore's tests compile each network and read the strategies it
chose; here each network also runs on 8 devices, forward and backward, and every output and gradient is compared
with the same expression in plain JAX on one device. Each of MindSpore's expected strategies either holds, or the
test says why mshard's differs and measures the bytes of both programs.

- A MatMul ``((4, 2), (1, 2))`` (transpose_b) with out_strategy ``((8, 1),)``: the op after it (an Add, a ReLU after a
  reshape to ``(16, -1)`` or ``(-1, 16)``) takes ``(8, 1)``; a reshape before it passes ``(8, 1)`` on.
- The same MatMul reshaped to ``(4, -1)``: the ReLU takes ``(4, 2)``, as MindSpore's, with no data moved (asserted
  below, with the bytes).
- Strategy save/load: the strategies a propagation gives every op, saved with ``set_op_strategy_config("SAVE")``
  and loaded with ``"LOAD"`` into the same network without any ``shard`` call, give the same strategies and compile
  to the same collectives, with and without out_strategies, by counts or by ``Layout`` (with fully_use_devices on and
  off). Before this stop a MatMul
  saved with an out_strategy (its marks and body saved apart) was not found when loaded into a MatMul with none,
  and a file saved on a ``Layout``'s named mesh was not applied to the default one.
- The same with ``interleaved_parallel`` in the Layout (MindSpore's test 4): saved and loaded alike, the MatMuls
  computed in copies that move what the whole MatMuls move.
- ``set_op_strategy_config`` rejects a mode other than SAVE/LOAD, a relative path and a non-JSON path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_close

import mshard as ms
from mshard import Layout, ops

pytestmark = pytest.mark.slow

PROP = dict(parallel_mode="auto_parallel", search_mode="sharding_propagation", device_num=8)
DP, MP = 4, 2
R = np.random.default_rng(40)


def _arr(*shape):
    return jnp.asarray(R.normal(size=shape), jnp.float32)


def _matmul():
    return ops.MatMul(transpose_b=True).shard(((DP, MP), (1, MP)), out_strategy=((DP * MP, 1),))


def _case(name):
    """(network over (x, w, *rest), the same in plain JAX, its arguments, the op whose strategy MindSpore checks,
    MindSpore's expected strategy for it). ``w`` is the MatMul's weight [8, 32] (transpose_b)."""
    mm, add, relu, reshape = _matmul(), ops.Add(), ops.ReLU(), ops.Reshape()
    cases = {
        # test 2: ReLU -> MatMul(out (8, 1)) -> Add
        "relu_matmul_add": (lambda x, w, b: add(mm(relu(x), w), b),
                            lambda x, w, b: jax.nn.relu(x) @ w.T + b,
                            (_arr(64, 32), _arr(8, 32), _arr(64, 8)), "Add", ((8, 1), (8, 1))),
        # test 3: Reshape [32, 64] -> (-1, 32) -> MatMul(out (8, 1)) -> ReLU
        "reshape_matmul_relu": (lambda x, w: relu(mm(reshape(x, (-1, 32)), w)),
                                lambda x, w: jax.nn.relu(x.reshape(-1, 32) @ w.T),
                                (_arr(32, 64), _arr(8, 32)), "ReLU", ((8, 1),)),
        # test 5: MatMul(out (8, 1)) -> Reshape (16, -1) -> ReLU: 16 rows still split 8 ways
        "matmul_reshape16_relu": (lambda x, w: relu(reshape(mm(x, w), (16, -1))),
                                  lambda x, w: jax.nn.relu((x @ w.T).reshape(16, -1)),
                                  (_arr(64, 32), _arr(8, 32)), "ReLU", ((8, 1),)),
        # test 6: MatMul(out (8, 1)) -> Reshape (-1, 16) -> Add -> ReLU
        "matmul_reshape_add_relu": (lambda x, w, b: relu(add(reshape(mm(x, w), (-1, 16)), b)),
                                    lambda x, w, b: jax.nn.relu((x @ w.T).reshape(-1, 16) + b),
                                    (_arr(64, 32), _arr(8, 32), _arr(32, 16)), "Add", ((8, 1), (8, 1))),
    }
    return cases[name]


def _run(net, args):
    """The forward plan, output and the gradients of sum(y * c) for x and w, all on 8 devices."""
    x, w, *rest = args
    wp = nnx.Param(w)
    c = _arr(*jax.eval_shape(net, *args).shape)

    def grads(x, w, *rest):
        return jax.grad(lambda x, w: jnp.sum(net(x, w, *rest) * c), argnums=(0, 1))(x, w)
    with ms.parallel_context(**PROP):
        f = ms.jit(lambda x, w, *rest: net(x, w[...], *rest))
        plan = f.plan(x, wp, *rest)
        y = f(x, wp, *rest)
        g = ms.jit(lambda x, w, *rest: grads(x, w[...], *rest))(x, wp, *rest)
    return plan, y, g, c


@pytest.mark.parametrize("name", ["relu_matmul_add", "reshape_matmul_relu", "matmul_reshape16_relu",
                                  "matmul_reshape_add_relu"])
def test_an_out_strategy_propagates_to_the_next_op(name):
    net, ref, args, op, want = _case(name)
    plan, y, g, c = _run(net, args)
    assert plan.strategy_of("MatMul") == ((DP, MP), (1, MP))
    assert plan.strategy_of(op) == want, plan.strategies
    # float32: 32-term dot products reordered by the split (<= 32 * 2**-24 = 2e-6 relative each)
    assert_close(y, ref(*args))
    assert_close(g, jax.grad(lambda x, w: jnp.sum(ref(x, w, *args[2:]) * c), argnums=(0, 1))(*args[:2]))


def test_a_reshape_to_four_rows_after_an_eight_way_split():
    """MindSpore's test 4: MatMul(out (8, 1)) -> Reshape (4, -1) -> ReLU. The [64, 8] result split 8 ways by rows is
    the flat array in 8 contiguous blocks of 64; as [4, 128], the same blocks are (4, 2) (each of the 4 rows in two
    halves), so the reshape moves nothing and the ReLU takes (4, 2), as MindSpore's propagation gives. The reshape's
    rule runs over the factors both shapes are made of, (4, 16, 8) (jaxpr/rules.py ``reshape_rule``); before it kept
    a split of the leading dim only, and the ReLU took (4, 1), gathered from (8, 1) with 512 B per device."""
    mm, relu, reshape = _matmul(), ops.ReLU(), ops.Reshape()
    x, w = _arr(64, 32), _arr(8, 32)
    with ms.parallel_context(**PROP):
        f = ms.jit(lambda x, w: relu(reshape(mm(x, w[...]), (4, -1))))
        plan = f.plan(x, nnx.Param(w))
        rep = ms.comm_report(f, x, nnx.Param(w))
        y = f(x, nnx.Param(w))
    assert plan.strategy_of("ReLU") == ((4, 2),) and plan.strategy_of("Reshape") == ((8, 1),)
    # the out_strategy's reduction: the MatMul's partial sums over MP ([16, 8] f32 per device) reduce-scattered into
    # its (8, 1) rows, [8, 8] per device, as MindSpore's ReduceScatter; nothing else (MindSpore's program: the same)
    assert {k: v["bytes"] for k, v in rep.by_kind.items()} == {"reduce-scatter": 8 * 8 * 4}
    assert_close(y, jax.nn.relu((x @ w.T).reshape(4, -1)))


def _two_matmuls(s1, s2, o1=None, o2=None, *, transpose_b=True):
    """MindSpore's save/load network: Add -> MatMul -> Add -> MatMul -> Add (names add1..add3, matmul1/2)."""
    mm1 = ops.MatMul(transpose_b=transpose_b, name="matmul1")
    mm2 = ops.MatMul(transpose_b=transpose_b, name="matmul2")
    if s1 is not None:
        mm1.shard(s1, out_strategy=o1)
    if s2 is not None:
        mm2.shard(s2, out_strategy=o2)
    adds = [ops.Add(name=f"add{i}") for i in (1, 2, 3)]

    def net(x, b1, b2, b3, w1, w2):
        return adds[2](mm2(adds[1](mm1(adds[0](x, b1), w1[...]), b2), w2[...]), b3)
    return net


SAVE_LOAD = {
    # test 1: in_strategies only
    "counts": (dict(s1=((4, 2), (1, 2)), s2=((2, 4), (1, 4))), True),
    # test 2: with out_strategies (8, 1): the MatMuls are traced as marks and a body, not as one op
    "out_strategies": (dict(s1=((4, 2), (1, 2)), s2=((2, 4), (1, 4)), o1=((8, 1),), o2=((8, 1),)), True),
    # test 5: Layouts on a named mesh (dp, mp, sp), no transpose
    "layouts": (None, False),
    # test 6: the same with fully_use_devices
    "layouts_fully_use_devices": (None, False),
}


def _layouts():
    lay = Layout((2, 2, 2), ("dp", "mp", "sp"))
    return dict(s1=(lay("dp", "mp"), lay("mp", "sp")), o1=(lay(("dp", "mp"), "sp"),),
                s2=(lay(("dp", "mp"), "sp"), lay("sp", "None")), o2=(lay(("dp", "mp", "sp"), "None"),))


@pytest.mark.parametrize("case", list(SAVE_LOAD))
def test_saved_strategies_load_into_the_network_without_shard_calls(case, tmp_path):
    config, transpose_b = SAVE_LOAD[case]
    config = config or _layouts()
    w_shapes = ((8, 32), (16, 8)) if transpose_b else ((32, 8), (8, 16))
    data = [_arr(*s) for s in ((64, 32), (64, 32), (64, 8), (64, 16))]
    args = (*data, *[nnx.Param(_arr(*s)) for s in w_shapes])
    path = str(tmp_path / "strategy.json")
    runs = []
    for mode, given in (("SAVE", config), ("LOAD", dict(s1=None, s2=None))):
        with ms.parallel_context(**PROP, dataset_strategy="full_batch"):
            ms.set_algo_parameters(fully_use_devices=case.endswith("fully_use_devices"))
            ms.set_op_strategy_config(mode=mode, path=path)
            f = ms.jit(_two_matmuls(**given, transpose_b=transpose_b))
            plan = f.plan(*args)
            rep = ms.comm_report(f, *args)
            runs.append((plan, {k: (v["count"], v["bytes"]) for k, v in rep.by_kind.items()}, f(*args)))
            ms.reset_algo_parameters()
    (saved, saved_comm, y_saved), (loaded, loaded_comm, y_loaded) = runs
    assert any("5 op strategies" in n for n in loaded.notes), loaded.notes
    assert loaded.strategies == saved.strategies
    if case == "out_strategies":
        # an out_strategy is a redistribution of its own (matmul1's result reduced, then cut to (8, 1)); in the
        # network without shard calls no op holds it, so add2 reads matmul1's result as it is reduced, rows split
        # (d0, d1), and changes it to columns split (d0, d1, d2) from there, where the saved program starts from
        # the out_strategy's rows (d0, d1, d2) and runs one 8-way all-to-all of 256 B. The loaded change is one
        # all-to-all of the stack (d0, d1) over 4 devices (512 B) and a slice (searchers/direct_reshard.py); XLA's
        # own, before stack moves, was an all-to-all and one more collective-permute of 256 B. The saved matmul1's
        # partial sums over d2 ([16, 8] f32) are reduce-scattered into its out_strategy's rows (d0, d1, d2), [8, 8],
        # as MindSpore's ReduceScatter (mshard/_src/planning/scattered_sums.py); matmul2's ([32, 16], rows over d2,
        # reduced over (d0, d1)) are reduce-scattered into rows (d2, d0, d1), [8, 16], and permuted to its
        # out_strategy's (d0, d1, d2) (the permute an all-reduce needed too). Loaded, matmul1's result is read as
        # columns over (d0, d1, d2): it is reduce-scattered onto columns over d2 ([16, 4]), and (d0, d1) join the
        # columns by an all-to-all and a 256 B permute; 2,880 B moved against the saved program's 2,656 B (before
        # reduce-scatters: 1,024 B and 864 B, besides all-reduces of 2,560 B of partial sums in each)
        assert saved_comm == {"reduce-scatter": (2, 768), "all-to-all": (2, 512), "collective-permute": (1, 512)}
        assert loaded_comm == {"reduce-scatter": (2, 768), "all-to-all": (2, 512), "collective-permute": (2, 768)}
    else:
        assert loaded_comm == saved_comm
    x, b1, b2, b3, w1, w2 = args
    t = (lambda w: w[...].T) if transpose_b else (lambda w: w[...])
    want = ((x + b1) @ t(w1) + b2) @ t(w2) + b3
    # float32: 32- and 8-term dot products reordered by the splits
    assert_close(y_saved, want)
    assert_close(y_loaded, want)
    if not case.startswith("layouts"):       # MindSpore's expectations (add2: tests/e2e/search/test_mindspore_propagation_expectations.py)
        s = saved.strategies
        assert s["matmul1/MatMul"] == ((4, 2), (1, 2)) and s["matmul2/MatMul"] == ((2, 4), (1, 4))
        assert s["add1/Add"] == ((4, 2), (4, 2))
        assert s["add3/Add"] == (((8, 1), (8, 1)) if case == "out_strategies" else ((2, 4), (2, 4)))


def test_interleaved_layouts_save_and_load(tmp_path):
    """MindSpore's save/load test 4: test 5's network on ``Layout((2, 2, 2, 2), ("dp", "mp", "sp",
    "interleaved_parallel"))``, where the MatMuls' rows are laid out with the interleaved axis (copies on each
    device, not devices). MindSpore saves with the layouts, loads with the same layouts, and checks the loaded
    layouts equal the saved ones. Here also: each MatMul is computed in 2 copies, and loaded into the network without
    ``shard`` calls the device splits load while the plan says the copies were not given."""
    ip = "interleaved_parallel"
    lay = Layout((2, 2, 2, 2), ("dp", "mp", "sp", ip))
    config = dict(s1=(lay(("dp", ip), "mp"), lay("mp", "sp")), o1=(lay(("dp", ip, "mp"), "sp"),),
                  s2=(lay(("dp", ip, "mp"), "sp"), lay("sp", "None")), o2=(lay(("dp", ip, "mp", "sp"), "None"),))
    data = [_arr(*s) for s in ((64, 32), (64, 32), (64, 8), (64, 16))]
    args = (*data, *[nnx.Param(_arr(*s)) for s in ((32, 8), (8, 16))])
    path = str(tmp_path / "strategy.json")
    runs = {}
    for run, mode, given in (("whole", None, _layouts()), ("saved", "SAVE", config), ("loaded", "LOAD", config),
                             ("no_shard", "LOAD", dict(s1=None, s2=None))):
        with ms.parallel_context(**PROP, dataset_strategy="full_batch"):
            if mode:
                ms.set_op_strategy_config(mode=mode, path=path)
            f = ms.jit(_two_matmuls(**given, transpose_b=False))
            rep = ms.comm_report(f, *args)
            runs[run] = (f.plan(*args), {k: (v["count"], v["bytes"]) for k, v in rep.by_kind.items()}, f(*args))
    saved, loaded, no_shard, whole = (runs[k][0] for k in ("saved", "loaded", "no_shard", "whole"))
    assert loaded.strategies == saved.strategies
    mms = ("matmul1/MatMul", "matmul2/MatMul")
    assert [saved.op(m).copies for m in mms] == [loaded.op(m).copies for m in mms] == [((2, 1), (1, 1))] * 2
    assert {m: saved.strategy_of(m) for m in mms} == {m: whole.strategy_of(m) for m in mms}
    assert all(f"matmul{i}/copy{c}/MatMul" in saved.strategies for i in (1, 2) for c in (0, 1))
    # Each MatMul's partial sums: matmul1's [32, 4] f32 per device (512 B) over mp, matmul2's [16, 16] (1,024 B) over
    # sp; all-reduced, 2 * S * (2-1)/2 each: 1,536 B. Computed whole, each is reduce-scattered into its out_strategy's
    # rows, which extend its own by the reduced axis (mshard/_src/planning/scattered_sums.py): S/2 each, 768 B.
    # Computed in copies, device (dp, mp) reads copy mp of its dp rows whole: the copies' partial sums are put back
    # first and the put-back is reduce-scattered once over the reduced axis (mshard/_src/planning/joined_sums.py),
    # the same 768 B, as MindSpore (its program keeps the interleaved tensor map (dp, interleaved_parallel, mp),
    # which reduce-scatters each copy's sums into it). Before joined_sums, the copies were all-reduced: 1,536 B
    for run in ("saved", "loaded", "whole", "no_shard"):
        assert runs[run][1] == {"reduce-scatter": (2, 768)}, (run, runs[run][1])
    for plan in (saved, loaded):        # the plan prices the program it runs: one reduce-scatter per MatMul
        assert plan.cost.communication == {"reduce-scatter": 768.0}
        assert [plan.op(m).cost.communication for m in mms] == [{"reduce-scatter": 256.0}, {"reduce-scatter": 512.0}]
        assert all(not plan.op(f"matmul{i}/copy{c}/MatMul").cost.communication for i in (1, 2) for c in (0, 1))
    assert {m: no_shard.strategy_of(m) for m in mms} == {m: saved.strategy_of(m) for m in mms}
    assert any("computed in interleaved_parallel copies when saved" in n for n in no_shard.notes), no_shard.notes
    x, b1, b2, b3, w1, w2 = args
    want = ((x + b1) @ w1[...] + b2) @ w2[...] + b3
    for run in runs.values():
        # float32: 32- and 8-term dot products reordered by the splits
        assert_close(run[2], want)


def test_a_matmul_with_an_out_strategy_computes_as_its_in_strategy_says():
    """MindSpore's in_strategy is how the operator computes; out_strategy only redistributes its result. A MatMul
    configured ``((2, 4), (1, 4))`` with out_strategy ``((8, 1),)`` is traced as its marks and its body apart, and
    the search used to choose the body's split freely: it contracted over all 8 devices (its operand moved to
    ``(1, 8)`` by an all-to-all) and all-reduced the whole [64, 16] result, 4,096 B per device, where the
    configured split reduces its [32, 16] partial sums over 4 devices (now a reduce-scatter into the out_strategy's
    rows)."""
    mm = ops.MatMul(transpose_b=True).shard(((2, 4), (1, 4)), out_strategy=((8, 1),))
    x, w = _arr(64, 8), _arr(16, 8)
    with ms.parallel_context(**PROP, dataset_strategy="full_batch"):
        f = ms.jit(lambda x, w: mm(x, w[...]))
        plan = f.plan(x, nnx.Param(w))
        rep = ms.comm_report(f, x, nnx.Param(w))
        y = f(x, nnx.Param(w))
    body = [k for k in plan.graph_axes if k.endswith("dot_general")]
    assert len(body) == 1
    assert sorted(len(a) for a in plan.graph_axes[body[0]]) == [0, 1, 2]      # rows 2 ways, k 4 ways, n whole
    # the [32, 16] partial sums over the k split's 4 devices are reduce-scattered into the out_strategy's rows, [8, 16]
    # per device, as MindSpore's ReduceScatter (mshard/_src/planning/scattered_sums.py): nothing is all-reduced
    assert "all-to-all" not in rep.by_kind and "all-reduce" not in rep.by_kind
    assert rep.by_kind["reduce-scatter"]["count"] == 1 and rep.bytes("reduce-scatter") == 8 * 16 * 4
    assert_close(y, x @ w.T)


def test_a_file_saved_for_other_shapes_loads_what_fits(tmp_path):
    """A strategy file saved on a batch of 64 split 8 ways, loaded into the same network on a batch of 12 (which 8
    does not divide): the ops whose saved split does not divide here are searched instead, the plan says which,
    and a StrategyIgnoredWarning says so; the parameters' layouts load. Before, the plan reported the saved
    split and failed its own check ("planner bug: please report this")."""
    path = str(tmp_path / "strategy.json")
    w1, w2 = nnx.Param(_arr(16, 32)), nnx.Param(_arr(32, 16))

    def net(mm1):
        return lambda x, w1, w2: ops.MatMul(name="mm2")(ops.ReLU(name="relu")(mm1(x, w1[...])), w2[...])
    with ms.parallel_context(**PROP, dataset_strategy="full_batch"):
        ms.set_op_strategy_config(mode="SAVE", path=path)
        saved = ms.jit(net(ops.MatMul(name="mm1").shard(((8, 1), (1, 1))))).plan(_arr(64, 16), w1, w2)
    assert saved.strategy_of("mm1") == ((8, 1), (1, 1))
    x = _arr(12, 16)
    with ms.parallel_context(**PROP, dataset_strategy="full_batch"):
        ms.set_op_strategy_config(mode="LOAD", path=path)
        f = ms.jit(net(ops.MatMul(name="mm1")))
        with pytest.warns(ms.errors.StrategyIgnoredWarning, match="saved for other shapes"):
            plan = f.plan(x, w1, w2)
        y = f(x, w1, w2)
    note = next(n for n in plan.notes if n.startswith("strategy file"))
    assert "2 parameter layouts loaded" in note and "mm1/MatMul" in note, note
    assert all(12 % s[0][0] == 0 for s in plan.strategies.values())
    # float32: 16- and 32-term dot products reordered by the splits
    assert_close(y, jax.nn.relu(x @ w1[...]) @ w2[...])


@pytest.mark.parametrize("mode, path", [("SAVE", "./strategy.json"), ("LOAD", "./strategy.json"),
                                        ("SAVE", "/tmp/strategy.yaml"), ("LOAD", "/tmp/strategy.yaml"),
                                        ("READ", "/tmp/strategy.json")])
def test_set_op_strategy_config_rejects_a_bad_mode_or_path(mode, path):
    """MindSpore raises KeyError for these; mshard's context errors are ValueErrors naming the value and the fix."""
    with pytest.raises(ms.errors.ContextError, match="set_op_strategy_config: (mode|path)="):
        ms.set_op_strategy_config(mode=mode, path=path)


def test_out_strategies_add2_moves_no_more_than_mindspores_strategies():
    """MindSpore's save/load test 2 expects add2 ``(2, 4)`` between matmul1's out_strategy ``(8, 1)`` and matmul2's
    ``(2, 4)``; mshard's propagation gives ``(1, 8)``. Both reach matmul2's operand with one all-to-all; the plan
    moves 3,584 B per device, as MindSpore's strategies replayed in semi_auto_parallel do. Before this stop add2 was
    ``(1, 1)``, 5,120 B (with the all-reduce the reduce-scatter replaced since: see the assert): propagation ranked redistributions by the alpha-beta time, where one all-gather's
    latency beat an all-to-all and a permute; it now ranks them by their bytes first, as MindSpore's redistribution
    cost does (searchers/spread.py)."""
    config = SAVE_LOAD["out_strategies"][0]
    data = [_arr(*s) for s in ((64, 32), (64, 32), (64, 8), (64, 16))]
    args = (*data, *[nnx.Param(_arr(*s)) for s in ((8, 32), (16, 8))])
    with ms.parallel_context(**PROP, dataset_strategy="full_batch"):
        f = ms.jit(_two_matmuls(**config))
        plan = f.plan(*args)
        ours = ms.comm_report(f, *args)
        y_ours = f(*args)
    adds = [ops.Add(name=f"add{i}").shard(st) for i, st in ((1, ((4, 2), (4, 2))), (2, ((2, 4), (2, 4))),
                                                             (3, ((8, 1), (8, 1))))]
    mm1 = ops.MatMul(transpose_b=True).shard(config["s1"], out_strategy=config["o1"])
    mm2 = ops.MatMul(transpose_b=True).shard(config["s2"], out_strategy=config["o2"])

    def theirs_net(x, b1, b2, b3, w1, w2):
        return adds[2](mm2(adds[1](mm1(adds[0](x, b1), w1[...]), b2), w2[...]), b3)
    with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8, dataset_strategy="full_batch"):
        g = ms.jit(theirs_net)
        theirs = ms.comm_report(g, *args)
        y = g(*args)
    assert plan.strategy_of("add2") == ((1, 8), (1, 8))
    moved = {k: sum(v["bytes"] for v in r.by_kind.values()) for k, r in (("ours", ours), ("theirs", theirs))}
    # 3,584 B when the MatMuls' partial sums were all-reduced (matmul1's [16, 8], 512 B; matmul2's [32, 16],
    # 2,048 B); reduce-scattered towards their out_strategies' rows (mshard/_src/planning/scattered_sums.py), they
    # are [8, 8] and [8, 16]: 3,584 - 512 - 2,048 + 256 + 512, in both programs
    assert moved == {"ours": 1792, "theirs": 1792}, (ours.by_kind, theirs.by_kind)
    x, b1, b2, b3, w1, w2 = args
    want = ((x + b1) @ w1[...].T + b2) @ w2[...].T + b3
    # float32: 32- and 8-term dot products reordered by the splits
    assert_close(y_ours, want)
    assert_close(y, want)
