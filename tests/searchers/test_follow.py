"""semi_auto's default (searchers.follow): every op not fixed computes in the layout its operands arrive in."""

from searchers.cost import CostParams, graph_cost
from searchers.follow import follow_operands
from searchers.graph import DeviceMesh, Graph, operand_layout, result_layout

P = CostParams()


def _mlp(fix_w1=None):
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (16, 8), fixed=((0, 1, 2), ()))                      # the batch, data parallel
    w1 = g.source("w1", (8, 32), kind="param", fixed=fix_w1)
    w2 = g.source("w2", (32, 4), kind="param")
    (h,) = g.add_op("mm1", "dot_general", {"m": 16, "k": 8, "n": 32}, [x, w1], [("m", "k"), ("k", "n")], [("m", "n")])
    (r,) = g.add_op("relu", "max", {"i": 16, "j": 32}, [h], [("i", "j")], [("i", "j")])
    (y,) = g.add_op("mm2", "dot_general", {"m": 16, "k": 32, "n": 4}, [r, w2], [("m", "k"), ("k", "n")], [("m", "n")])
    g.add_op("softmax_max", "reduce_max", {"i": 16, "j": 4}, [y], [("i", "j")], [("i",)],
                    reduce="max", unsplittable=frozenset({"j"}))
    return g


def test_the_batch_flows_on_and_nothing_new_is_split():
    g = _mlp()
    r = follow_operands(g, P)
    assert r.strategies[1] == ((), ()) and r.strategies[2] == ((), ())          # unfixed weights stay whole
    for op in g.ops[3:]:
        assert result_layout(op, r.strategies[op.id], 0)[0] == (0, 1, 2), op.name
        assert all(not axes for d, axes in zip(op.dims, r.strategies[op.id], strict=True) if d != "m" and d != "i")
    assert r.cost.total == graph_cost(g, r.strategies, P).total


def test_a_user_split_flows_on_and_axes_are_never_taken_twice():
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (16, 8), fixed=((0,), ()))
    w1 = g.source("w1", (8, 32), kind="param", fixed=((), (1, 2)))               # column parallel, 4 ways
    (h,) = g.add_op("mm1", "dot_general", {"m": 16, "k": 8, "n": 32}, [x, w1], [("m", "k"), ("k", "n")], [("m", "n")])
    (r,) = g.add_op("relu", "max", {"i": 16, "j": 32}, [h], [("i", "j")], [("i", "j")])
    # an op reading the split tensor twice takes each of its axes once
    g.add_op("odd", "add", {"a": 16, "b": 32}, [r, r], [("a", "b"), ("a", "b")], [("a", "b")])
    res = follow_operands(g, P)
    assert res.strategies[2] == ((0,), (), (1, 2))
    assert result_layout(g.ops[3], res.strategies[3], 0) == ((0,), (1, 2))
    assert res.strategies[4] == ((0,), (1, 2))


def test_an_unsplittable_dim_stays_whole_and_a_parameter_follows_its_first_fixed_consumer():
    g = _mlp()
    g.ops[5].fixed = ((0,), (1, 2), ())                                         # mm2 row parallel, fixed
    r = follow_operands(g, P)
    assert operand_layout(g.ops[5], r.strategies[5], 1) == ((1, 2), ())
    assert r.strategies[2] == ((1, 2), ())                                       # w2 stored as mm2 computes with it
    assert r.strategies[6][1] == ()                                              # reduce_max's j is unsplittable


def test_an_operand_tie_keeps_the_layout_its_op_computed_it_in():
    g = Graph(DeviceMesh((2, 2)))
    w = g.source("w", (4, 6), kind="param")
    g.add_op("mm", "dot_general", {"k": 4, "n": 6}, [w], [("k", "n")], [("n",)])
    g.ops[-1].fixed = ((), (0, 1))
    g.add_op("mm/operand0", "residual", {"i": 4, "j": 6}, [w], [("i", "j")], [("i", "j")])
    g.operand_ties[g.ops[-1].id] = (1, 0)
    r = follow_operands(g, P)
    assert result_layout(g.ops[2], r.strategies[2], 0) == ((), (0, 1))


def test_the_per_op_baselines_tie_an_operand_to_an_op_before_it_and_not_to_one_after_it():
    # data parallel (per op) splits every op's leading loop dim; a residual operand-tied to a matmul takes the layout
    # that matmul computed the operand in where the matmul comes first, and stays whole where the matmul comes after
    # it (a pass in program order has not decided it yet: pinned_strategy's "replicated while the tied op is
    # undecided")
    from searchers.baselines import baseline_plans
    from searchers.cost import CostParams

    g = Graph(DeviceMesh((2, 2)))
    w = g.source("w", (4, 6), kind="param")
    before = g.add_op("before", "residual", {"i": 4, "j": 6}, [w], [("i", "j")], [("i", "j")])[0]
    g.add_op("mm", "dot_general", {"k": 4, "n": 6}, [w], [("k", "n")], [("n",)])
    g.add_op("after", "residual", {"i": 4, "j": 6}, [w], [("i", "j")], [("i", "j")])
    g.add_op("use", "add", {"i": 4, "j": 6}, [before, g.ops[-1].outputs[0]], [("i", "j")] * 2, [("i", "j")])
    g.operand_ties[1] = (2, 0)
    g.operand_ties[3] = (2, 0)
    plan = baseline_plans(g, CostParams(), fully_use_devices=False)["data parallel (per op)"]
    assert plan[2] == ((0, 1), ())                    # mm: its leading loop dim k over both axes
    assert plan[3] == ((0, 1), ())                    # after: w's dim 0 as mm computed it
    assert plan[1] == ((), ())                        # before: mm undecided yet
    assert plan[4] == ((0, 1), ())                    # an untied op: its own leading dim


def _merge(major: int, arriving):
    """x [2, major, 8, 32], laid out as ``arriving``, read by a reshape to [2, major * 8, 32] (jax.numpy's row-major
    order: merged row ``i * 8 + j``), whose loop dims are the reshape rule's (mshard/_src/jaxpr/rules.py)."""
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (2, major, 8, 32), fixed=arriving)
    g.add_op("reshape", "reshape", {"r0": 2, "r1_0": major, "r1_1": 8, "r2": 32}, [x], [("r0", "r1_0", "r1_1", "r2")],
             [("r0", ("r1_0", "r1_1"), "r2")], out_shapes=[(2, major * 8, 32)])
    return g


def test_a_reshape_does_not_follow_a_split_of_the_minor_part_of_a_merged_dim_alone():
    """With only the inner dim split, each device holds merged rows ``i * 8 + j`` for every ``i``: not a block of
    the merged dim, so no layout of the result says it (the plan priced that reshape free, XLA moved the operand
    with an all-to-all it did not price). The split goes to the major part where that divides (the operand moved by
    one all-to-all), else the part is computed whole; where the major part is split into its size, the minor part's
    split is a block and is kept."""
    from searchers.strategies import is_legal
    cases = [
        (8, ((0,), (), (1, 2), ()), ((0,), (1, 2), (), ())),    # major 8 takes the 4-way split
        (2, ((0,), (), (1, 2), ()), ((0,), (), (), ())),        # major 2 cannot: computed whole on that dim
        (2, ((), (0,), (1, 2), ()), ((), (0,), (1, 2), ())),    # major split into its size: the minor's is a block
    ]
    for major, arriving, want in cases:
        g = _merge(major, arriving)
        got = follow_operands(g, P).strategies[1]
        assert is_legal(g.ops[1], got, g.mesh), (major, arriving, got)
        assert got == want, (major, arriving, got)
