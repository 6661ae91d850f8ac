"""Synthetic graph generators: op counts worked out by hand, validity, layer keys, sizes."""

import collections

import pytest

from searchers.errors import SearchGraphError
from searchers.generators import conv_net, graph_of_size, layers_for, mlp_chain, random_dag, transformer_stack
from searchers.graph import DeviceMesh, layer_instances
from searchers.strategies import enumerate_strategies

MESH = DeviceMesh((2, 2, 2))


def assert_valid(g):
    """Program order, one producer per tensor, consumer lists consistent, shapes follow dims."""
    for op in g.ops:
        for tid in op.inputs:
            assert g.tensors[tid].producer < op.id, f"{op.name} uses a tensor produced later"
        for tid, od in zip(op.outputs, op.out_dims, strict=True):
            t = g.tensors[tid]
            assert t.producer == op.id
            assert len(t.shape) == len(od)
            for size, d in zip(t.shape, od, strict=True):
                assert d is None or op.dims[d] == size
    uses = collections.Counter((tid, op.id) for op in g.ops for tid in op.inputs)
    listed = collections.Counter((t.id, c) for t in g.tensors for c in t.consumers)
    assert uses == listed
    for tid in g.outputs:
        assert 0 <= tid < len(g.tensors)


@pytest.mark.parametrize("layers", [1, 2, 5])
def test_mlp_chain_counts(layers):
    fwd = mlp_chain(layers, 16, 8, MESH)
    assert len(fwd) == 1 + 3 * layers          # x, then (w, dot_general, relu) per layer
    # backward: loss, seed, loss grad; per layer relu grad, dW, update, and dx except layer 0
    bwd = mlp_chain(layers, 16, 8, MESH, backward=True)
    assert len(bwd) == 1 + 3 * layers + 3 + 4 * layers - 1
    assert_valid(fwd)
    assert_valid(bwd)


def test_transformer_forward_counts_and_kinds():
    g = transformer_stack(3, 2, 8, 16, 2, 32, MESH, backward=False)
    assert len(g) == 1 + 42 * 3
    assert_valid(g)
    kinds = collections.Counter(op.kind for op in g.ops)
    # per block: q, k, v, scores, context, o, fc1, fc2; 10 parameters; 2 layer norms
    assert kinds["dot_general"] == 8 * 3 and kinds["param"] == 10 * 3
    assert kinds["reduce_max"] == 3 and kinds["exp"] == 3 and kinds["rsqrt"] == 2 * 3
    assert kinds["reduce_sum"] == (2 * 2 + 1) * 3      # 2 per layer norm + softmax denominator


def test_transformer_backward_looks_like_training():
    layers = 2
    g = transformer_stack(layers, 2, 8, 16, 2, 32, MESH, backward=True)
    assert_valid(g)
    dots = [op for op in g.ops if op.kind == "dot_general"]
    assert len(dots) == 3 * 8 * layers               # forward + dx + dW for each of the 8 matmuls
    updates = [op for op in g.ops if op.name.endswith("/update")]
    assert len(updates) == 10 * layers               # one per parameter
    for op in updates:                               # w - dw: the gradient has w's shape
        w, gw = (g.tensors[t] for t in op.inputs)
        assert w.shape == gw.shape and g.producer(w.id).kind == "param"
    # the dW of fc1 (w1[d, f]) reduces over batch and sequence
    dw1 = next(op for op in g.ops if op.name == "block1/mlp/fc1/dot_general/grad1")
    assert g.tensors[dw1.outputs[0]].shape == (16, 32)
    assert set(dw1.reduction_dims) == {"b", "s"}


def test_transformer_layer_keys_mark_repeated_layers():
    layers = 4
    g = transformer_stack(layers, 2, 8, 16, 2, 32, MESH, backward=True)
    inst = layer_instances(g)
    fwd = [ids for key, ids in inst if key == "block"]
    bwd = [ids for key, ids in inst if key == "block/bwd"]
    assert [len(ids) for ids in fwd] == [42] * layers     # one contiguous copy per block
    kinds = [[g.ops[i].kind for i in ids] for ids in fwd]
    assert all(k == kinds[0] for k in kinds)
    assert [g.ops[ids[0]].name.split("/")[0] for ids in bwd] == ["block3", "block2", "block1", "block0"]
    # middle blocks are identical; the last lacks the gradient-accumulation adds of its output
    # (only the loss reads it), the first lacks the dx of the input x
    mid = [[g.ops[i].kind for i in ids] for ids in bwd[1:3]]
    assert mid[0] == mid[1]
    assert len(bwd[0]) == len(bwd[1]) - 2 and len(bwd[3]) < len(bwd[1])
    assert sum(len(ids) for key, ids in inst if key == "block/update") == 10 * layers


def test_transformer_rejects_bad_heads():
    with pytest.raises(SearchGraphError, match="heads"):
        transformer_stack(1, 2, 8, 10, 3, 32, MESH)


def test_conv_net_iteration_spaces():
    g = conv_net(8, 16, (3, 8, 16), 10, MESH, blocks_per_stage=2, backward=True)
    assert_valid(g)
    convs = [op for op in g.ops if op.kind == "conv_general_dilated" and "/grad" not in op.name]
    assert len(convs) == 4
    for op in convs:
        assert tuple(op.dims) == ("n", "o", "c", "h", "w", "kh", "kw")
        assert {"h", "w"} <= op.unsplittable
        assert set(op.reduction_dims) == {"c", "kh", "kw"}
        for s in enumerate_strategies(op, g.mesh):
            assert s[3] == s[4] == ()                # h, w never split
    assert convs[0].layer != convs[1].layer          # 3->8 then 8->8 channels
    assert convs[2].layer != convs[3].layer and convs[1].layer != convs[3].layer
    pools = [op for op in g.ops if op.kind == "reduce_window_max"]
    assert [g.tensors[p.outputs[0]].shape for p in pools] == [(8, 8, 8, 8), (8, 16, 4, 4)]


def test_conv_net_rejects_bad_image():
    with pytest.raises(SearchGraphError, match="image"):
        conv_net(2, 6, (3, 4, 4), 2, MESH)


@pytest.mark.parametrize("n", [1, 2, 10, 137])
def test_random_dag_exact_size_and_valid(n):
    g = random_dag(n, seed=n, mesh=MESH)
    assert len(g) == n
    assert g.ops[0].is_source
    assert_valid(g)


def test_random_dag_is_deterministic():
    a, b, c = (random_dag(300, s, MESH) for s in (7, 7, 8))
    sig = lambda g: [(op.kind, tuple(op.dims.items()), tuple(op.inputs)) for op in g.ops]
    assert sig(a) == sig(b) and sig(a) != sig(c)
    kinds = {op.kind for op in a.ops}
    assert {"dot_general", "reduce_sum", "transpose"} <= kinds


def tiny(family, layers):
    """The family with tiny shapes (op counts do not depend on shapes) and explicit layers."""
    if family == "mlp":
        return mlp_chain(layers, 4, 4, MESH, backward=True)
    if family == "transformer":
        return transformer_stack(layers, 2, 8, 16, 2, 32, MESH, backward=True)
    return conv_net(2, 8, (3, 4, 4, 4), 2, MESH, blocks_per_stage=layers, backward=True)


@pytest.mark.parametrize("family", ["mlp", "transformer", "conv"])
@pytest.mark.parametrize("target", [100, 1000, 10_000])
def test_graph_of_size_hits_the_target(family, target):
    per = len(tiny(family, 3)) - len(tiny(family, 2))    # ops per extra layer
    g = graph_of_size(target, family, MESH)
    assert abs(len(g) - target) <= per / 2 or (layers_for(target, family) == 1 and len(g) > target)
    assert len(g) == len(tiny(family, layers_for(target, family)))


def test_graph_of_size_small_and_random():
    assert len(graph_of_size(10, "mlp", MESH, backward=False)) == 10
    assert len(graph_of_size(1000, "random", MESH)) == 1000
    g = graph_of_size(50, "transformer", MESH)       # one layer is the smallest transformer
    assert layers_for(50, "transformer") == 1 and len(g) > 50
    fixed = graph_of_size(100, "mlp", MESH, fix_data=True)
    assert [op.fixed for op in fixed.ops if op.kind == "data"] == [((0, 1, 2), ())]
    with pytest.raises(SearchGraphError, match="family"):
        graph_of_size(100, "nope", MESH)
