"""mshard._src.jaxpr.op_graph: jaxpr -> searchers.Graph on real models, forward and under jax.grad.

Every model is checked by :func:`check_trace`: every (non-inlined) equation became exactly one op
of its primitive's kind, operand and result shapes fit the op's iteration space, every loop-dim
split the mesh allows is legal on every tensor dim mapped to it, op names follow docs/design.md §2
(``scope/primitive``, repeats ``_1``, ``_2``, ... in program order), the Var map and
``Graph.outputs`` point at the right tensors. Warnings are errors (pyproject), so these models
also prove that no primitive of theirs lacks a rule.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend import core as jcore

from mshard._src.jaxpr import rules
from mshard._src.jaxpr.op_graph import TraceResult, jaxpr_to_graph
from mshard.errors import PlanError
from searchers import DeviceMesh
from searchers.graph import strategy_of_layout
from searchers.strategies import is_legal

MESH8 = DeviceMesh.prime(8)
RNG = np.random.default_rng(0)


def f32(*shape):
    return jnp.asarray(RNG.normal(size=shape), jnp.float32)


def _expected_ops(jaxpr, scope=""):
    """(eqn, scope/primitive) for every equation that should become an op, program order."""
    out = []
    for eqn in jaxpr.eqns:
        s = "/".join(p for p in (scope, str(eqn.source_info.name_stack)) if p)
        key = rules.INLINE.get(eqn.primitive.name)
        sub = eqn.params.get(key) if key else None
        if sub is not None:
            out += _expected_ops(sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub, s)
        else:
            out.append((eqn, "/".join(p for p in (s, eqn.primitive.name) if p)))
    return out


def _split_counts(mesh):
    counts = {1}
    for n in mesh.shape:
        counts |= {c * n for c in counts}
    return counts


def check_trace(r: TraceResult, kinds, names):
    g, cj = r.graph, r.closed_jaxpr
    expected = _expected_ops(cj.jaxpr)
    assert [t.eqn for t in r.eqns] == [e for e, _ in expected]
    # names: scope/primitive, repeats numbered in program order, all unique
    seen: dict[str, int] = {}
    for t, (_, base) in zip(r.eqns, expected, strict=True):
        n = seen.get(base, 0)
        seen[base] = n + 1
        assert t.name == (base if n == 0 else f"{base}_{n}"), (t.name, base)
        assert g.ops[t.op].name == t.name and g.ops[t.op].kind == t.primitive
    assert len({op.name for op in g.ops}) == len(g.ops)
    # every op is a source or a traced equation
    traced = {t.op for t in r.eqns}
    assert all(op.is_source or op.id in traced for op in g.ops)
    assert [g.ops[i].kind for i in r.input_ops] == list(kinds)
    assert [g.ops[i].name for i in r.input_ops] == list(names)
    counts = _split_counts(g.mesh)
    for t in r.eqns:
        op = g.ops[t.op]
        in_shapes = [tuple(getattr(v.aval, "shape", ())) for v in t.eqn.invars]
        assert [g.tensors[i].shape for i in op.inputs] == in_shapes
        assert [g.tensors[i].shape for i in op.outputs] == [tuple(v.aval.shape) for v in t.eqn.outvars]
        for tid, dims in [*zip(op.inputs, op.in_dims, strict=True), *zip(op.outputs, op.out_dims, strict=True)]:
            for size, d in zip(g.tensors[tid].shape, dims, strict=True):
                if isinstance(d, tuple):     # a dim made of several loop dims (a reshape's merged run): their product
                    assert math.prod(op.dims[x] for x in d) == size, (op.name, d, size)
                    continue
                if d is None or d in op.unsplittable:
                    continue
                legal = op.split_sizes()[list(op.dims).index(d)]     # a split must divide this
                assert all(size % c == 0 for c in counts if legal % c == 0), (op.name, d, size)
                if tid in op.inputs:
                    assert size == op.dims[d]
        assert t.op in r.ops_of(t.eqn)
        if len(r.ops_of(t.eqn)) == 1:   # a sub-jaxpr inlined at several places maps its vars to the last
            assert r.op_of(t.eqn) == t.op
            for v, tid in zip(t.eqn.outvars, t.outputs, strict=True):
                assert r.tensor_of(v) == tid
    # producers precede consumers, outputs are the jaxpr's results
    for p, c, _, _ in g.edges():
        assert p < c
    assert len(g.outputs) == len(cj.jaxpr.outvars)
    for v, tid in zip(cj.jaxpr.outvars, g.outputs, strict=True):
        assert g.tensors[tid].shape == tuple(v.aval.shape)
        if not isinstance(v, jcore.Literal):
            assert r.tensor_of(v) == tid


def trace(fn, args, kinds, names, mesh=MESH8):
    cj = jax.make_jaxpr(fn)(*args)
    r = jaxpr_to_graph(cj, mesh, kinds, names)
    check_trace(r, kinds, names)
    return r


def _flat(params, prefix=""):
    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    return [prefix + jax.tree_util.keystr(p) for p, _ in leaves]


# -- models ------------------------------------------------------------------------------------
def mlp(x, w1, b1, w2, b2):
    with jax.named_scope("dense1"):
        h = jax.nn.relu(x @ w1 + b1)
    with jax.named_scope("dense2"):
        return h @ w2 + b2


MLP_ARGS = (f32(8, 4), f32(4, 16), f32(16), f32(16, 2), f32(2))
MLP_KINDS = ["data"] + ["param"] * 4
MLP_NAMES = ["x", "w1", "b1", "w2", "b2"]


def test_mlp_names_and_spaces():
    r = trace(mlp, MLP_ARGS, MLP_KINDS, MLP_NAMES)
    g = r.graph
    assert [op.name for op in g.ops] == [
        "x", "w1", "b1", "w2", "b2", "dense1/dot_general", "dense1/broadcast_in_dim", "dense1/add",
        "dense1/max/literal1", "dense1/max", "dense2/dot_general", "dense2/broadcast_in_dim", "dense2/add"]
    mm = g.ops[5]
    assert mm.dims == {"m0": 8, "n0": 16, "k0": 4} and mm.in_dims == [("m0", "k0"), ("k0", "n0")]
    assert mm.reduction_dims == ("k0",) and mm.inputs == [0, 1]
    assert g.ops[8].kind == "const" and g.ops[9].in_dims == [("i0", "i1"), ()]
    assert g.outputs == g.ops[12].outputs
    # relu's max sits inside custom_jvp_call -> jit: inlined, with the path recorded
    (mx,) = [t for t in r.eqns if t.primitive == "max"]
    assert [e.primitive.name for e in mx.path] == ["custom_jvp_call", "jit"]
    for outer in mx.path:   # the inlined sub-jaxprs' inputs map to the outer tensors
        sub = outer.params[rules.INLINE[outer.primitive.name]]
        assert r.tensor_of(sub.jaxpr.invars[0]) == r.tensor_of(outer.invars[0]) == g.ops[7].outputs[0]


def test_mlp_grad():
    fn = jax.grad(lambda *a: (mlp(*a) ** 2).sum(), argnums=(1, 2, 3, 4))
    r = trace(fn, MLP_ARGS, MLP_KINDS, MLP_NAMES)
    names = [t.name for t in r.eqns]
    assert "jvp(dense1)/dot_general" in names and "transpose(jvp(dense1))/dot_general" in names
    assert "transpose(jvp(dense2))/reduce_sum_1" in names
    assert len(r.graph.outputs) == 4


def layer_norm(x, g, b):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * lax.rsqrt(v + 1e-5) * g + b


def block(x, p, heads=2):
    b, s, d = x.shape
    with jax.named_scope("attn"):
        h = layer_norm(x, p["ln1_g"], p["ln1_b"])
        q, k, v = (jnp.reshape(h @ p[w], (b, s, heads, d // heads)) for w in ("wq", "wk", "wv"))
        a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, s, d) @ p["wo"]
    x = x + o
    with jax.named_scope("mlp"):
        h = jax.nn.gelu(layer_norm(x, p["ln2_g"], p["ln2_b"]) @ p["w1"]) @ p["w2"]
    return x + h


D = 8
BLOCK_P = {"ln1_g": f32(D), "ln1_b": f32(D), "wq": f32(D, D), "wk": f32(D, D), "wv": f32(D, D),
           "wo": f32(D, D), "ln2_g": f32(D), "ln2_b": f32(D), "w1": f32(D, 4 * D), "w2": f32(4 * D, D)}


def test_transformer_block():
    names = ["x"] + _flat(BLOCK_P, "p")
    kinds = ["data"] + ["param"] * len(BLOCK_P)
    r = trace(block, (f32(2, 4, D), BLOCK_P), kinds, names)
    g = r.graph
    kinds_seen = {op.kind for op in g.ops}
    assert {"dot_general", "reduce_max", "exp", "reduce_sum", "div", "rsqrt", "tanh", "reshape"} <= kinds_seen
    mms = [t.name for t in r.eqns if t.primitive == "dot_general" and t.name.startswith("attn/")]
    assert mms == ["attn/dot_general", "attn/dot_general_1", "attn/dot_general_2",   # q, k, v
                   "attn/bqhd,bkhd->bhqk/dot_general", "attn/bhqk,bkhd->bqhd/dot_general",  # jnp.einsum's
                   "attn/dot_general_3"]                                                     # scope; wo
    (qk,) = [g.ops[t.op] for t in r.eqns if t.name == "attn/bqhd,bkhd->bhqk/dot_general"]
    assert qk.reduction_dims == ("k0",) and set(qk.dims) == {"b0", "b1", "m0", "n0", "k0"}
    # [b, s, 8] -> [b, s, 2 heads, 4]: the 8 is made of the heads (2) and the head dim (4), a loop dim each; a
    # device's block of the 8 is contiguous, so the head dim is split only once the heads are split whole (2)
    split_heads = next(g.ops[t.op] for t in r.eqns if t.name == "attn/reshape")
    assert split_heads.in_dims == [("r0", "r1", ("r2_0", "r2_1"))]
    assert split_heads.out_dims == [("r0", "r1", "r2_0", "r2_1")] and not split_heads.split_limit
    assert split_heads.nested() == ((3, ((2, 2),)),) and not split_heads.unsplittable
    # the merge back [.., 2, 4] -> [.., 8]: the same loop dims, the other way round
    merge_heads = next(g.ops[t.op] for t in r.eqns if t.name == "attn/reshape_3")
    assert merge_heads.in_dims == [("r0", "r1", "r2_0", "r2_1")] and not merge_heads.unsplittable
    assert merge_heads.out_dims == [("r0", "r1", ("r2_0", "r2_1"))]


def test_transformer_block_grad():
    names = ["x"] + _flat(BLOCK_P, "p")
    kinds = ["data"] + ["param"] * len(BLOCK_P)
    r = trace(jax.grad(lambda x, p: block(x, p).sum(), argnums=1), (f32(2, 4, D), BLOCK_P), kinds, names)
    assert len(r.graph.outputs) == len(BLOCK_P)
    assert sum(t.primitive == "dot_general" for t in r.eqns) >= 3 * 8


NHWC = ("NHWC", "HWIO", "NHWC")


def convnet(x, w1, w2, wd):
    with jax.named_scope("conv1"):
        h = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=NHWC))
        h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    with jax.named_scope("conv2"):
        h = jax.nn.relu(lax.conv_general_dilated(h, w2, (1, 1), "SAME", dimension_numbers=NHWC))
        h = lax.reduce_window(h, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4
    with jax.named_scope("head"):
        return h.reshape(h.shape[0], -1) @ wd


CONV_ARGS = (f32(4, 8, 8, 3), f32(3, 3, 3, 8), f32(1, 1, 8, 8), f32(2 * 2 * 8, 10))


def test_convnet():
    r = trace(convnet, CONV_ARGS, ["data", "param", "param", "param"], ["x", "w1", "w2", "wd"])
    g = r.graph
    (c1,) = [g.ops[t.op] for t in r.eqns if t.name == "conv1/conv_general_dilated"]
    # a 3x3 "same" window: height and width are shared by input and output, split with a 2-row halo exchange
    assert c1.in_dims[0] == ("n", "s0", "s1", "c") and c1.out_dims[0] == ("n", "s0", "s1", "o")
    assert {"k0", "k1"} <= c1.unsplittable and not {"n", "s0", "s1"} & c1.unsplittable
    assert c1.halo == {"s0": 2, "s1": 2} and c1.halo_apart == {"o"}
    (c2,) = [g.ops[t.op] for t in r.eqns if t.name == "conv2/conv_general_dilated"]
    assert not {"n", "o", "c", "s0", "s1"} & c2.unsplittable   # a 1x1 conv splits spatially too
    (pool,) = [g.ops[t.op] for t in r.eqns if t.primitive == "reduce_window_max"]
    assert pool.in_dims[0] == ("i0", None, None, "i3") and {"i1", "i2"} <= pool.unsplittable


def test_convnet_grad():
    r = trace(jax.grad(lambda *a: convnet(*a).sum(), argnums=(1, 2, 3)), CONV_ARGS,
              ["data", "param", "param", "param"], ["x", "w1", "w2", "wd"])
    prims = {t.primitive for t in r.eqns}
    assert {"select_and_scatter_add", "conv_general_dilated", "pad"} & prims >= {"select_and_scatter_add"}
    # the kernel gradient contracts over the batch: data parallelism all-reduces it
    kgrads = [r.graph.ops[t.op] for t in r.eqns
              if t.primitive == "conv_general_dilated" and t.name.startswith("transpose(")]
    assert kgrads


def lm_loss(table, w_out, ids, labels):
    with jax.named_scope("embed"):
        h = table[ids]
    with jax.named_scope("head"):
        logits = h @ w_out
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()


V, E = 16, 8
LM_ARGS = (f32(V, E), f32(E, V), jnp.asarray(RNG.integers(0, V, (2, 4)), jnp.int32),
           jnp.asarray(RNG.integers(0, V, (2, 4)), jnp.int32))
LM_KINDS = ["param", "param", "data", "data"]
LM_NAMES = ["table", "w_out", "ids", "labels"]


def test_embedding_cross_entropy():
    r = trace(lm_loss, LM_ARGS, LM_KINDS, LM_NAMES)
    g = r.graph
    (emb,) = [g.ops[t.op] for t in r.eqns if t.name == "embed/gather"]
    assert emb.inputs[0] == 0 and emb.in_dims[0] == ("v", "o0") and emb.out_dims[0] == ("g0", "g1", "o0")
    assert emb.reduction_dims == ("v",) and emb.reduce == "sum" and not emb.unsplittable
    assert g.tensors[g.outputs[0]].shape == ()


def test_embedding_cross_entropy_grad():
    r = trace(jax.grad(lm_loss, argnums=(0, 1)), LM_ARGS, LM_KINDS, LM_NAMES)
    g = r.graph
    (sc,) = [g.ops[t.op] for t in r.eqns
             if t.primitive == "scatter-add" and t.name.startswith("transpose(jvp(embed")]
    assert sc.out_dims[0] == ("p0", "p1") and set(sc.reduction_dims) == {"u0", "u1"}
    assert "p0" not in sc.unsplittable   # a vocabulary-split table gets its gradient without communication
    assert g.tensors[g.outputs[0]].shape == (V, E)


# -- tracer mechanics --------------------------------------------------------------------------------
def test_shared_jit_traced_at_each_call():
    f = jax.jit(lambda a: jnp.sin(a) * 2)
    r = trace(lambda x: f(f(x)), (f32(4, 6),), ["data"], ["x"])
    sins = [t for t in r.eqns if t.primitive == "sin"]
    assert [t.name for t in sins] == ["sin", "sin_1"]
    if sins[0].eqn is sins[1].eqn:   # one cached sub-jaxpr: both places are ops
        assert r.ops_of(sins[0].eqn) == [sins[0].op, sins[1].op]
    assert all(t.path and t.path[0].primitive.name == "jit" for t in sins)


def test_mshard_mark_is_elementwise_identity():
    mark = jcore.Primitive("mshard_mark")
    mark.def_abstract_eval(lambda x, **_: jax.core.ShapedArray(x.shape, x.dtype))
    r = trace(lambda x, w: mark.bind(x, tag="in") @ w, (f32(8, 4), f32(4, 2)), ["data", "param"], ["x", "w"])
    (m,) = r.marks
    op = r.graph.ops[m.op]
    assert op.kind == "mshard_mark" and op.name == "mshard_mark" and m.eqn.params["tag"] == "in"
    assert op.in_dims == [("i0", "i1")] and op.out_dims == [("i0", "i1")] and not op.unsplittable
    assert r.op_of(m.eqn) == m.op and r.graph.ops[m.op + 1].inputs[0] == op.outputs[0]


def test_scan_is_one_op_whose_carry_keeps_its_layout():
    """One op (its body is not traced); the carry's input and result share free loop dims (scan_carry_rule), the
    scanned input and the stacked result stay replicated."""
    fn = lambda x: lax.scan(lambda c, a: (c + jnp.tanh(a), c * a), jnp.zeros(6), x)
    r = trace(fn, (f32(4, 6),), ["data"], ["x"])
    (sc,) = [r.graph.ops[t.op] for t in r.eqns if t.primitive == "scan"]
    assert len(sc.inputs) == 2 and len(sc.outputs) == 2
    assert sc.in_dims[0] == sc.out_dims[0] == ("c0_0",) and "c0_0" not in sc.unsplittable
    assert sc.in_dims[1] == (None, None) and set(sc.out_dims[1]) <= sc.unsplittable
    assert not any(t.primitive == "tanh" for t in r.eqns)


def _mesh(names=("d0", "d1", "d2")):
    return jax.make_mesh((2, 2, 2), names, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def test_shard_map_on_the_region_mesh_is_a_fixed_boundary():
    """Its operands flow into fixed sinks (in_specs), its results come from fixed sources (out_specs), and no op
    stands for the shard_map itself; on another mesh it stays one replicated op."""
    from jax.sharding import PartitionSpec as P

    def fn(mesh):
        a, b, _ = mesh.axis_names
        body = jax.shard_map(lambda u: jax.lax.psum(u, a), mesh=mesh, in_specs=P(a, b),
                             out_specs=P(None, b), check_vma=False)
        return lambda x: jnp.exp(body(jnp.tanh(x)))
    cj = jax.make_jaxpr(fn(_mesh()))(f32(8, 8))
    r = jaxpr_to_graph(cj, MESH8, ["data"], ["x"])
    g = r.graph
    by_name = {op.name: op for op in g.ops}
    assert "shard_map" not in [op.kind for op in g.ops]
    sink, src = by_name["shard_map/in0"], by_name["shard_map/out0"]
    assert sink.kind == "shard_map_in" and sink.fixed == ((0,), (1,))
    assert g.producer(sink.inputs[0]).kind == "tanh"
    assert src.is_source and src.fixed == ((), (1,))
    (exp,) = [g.ops[t.op] for t in r.eqns if t.primitive == "exp"]
    assert exp.inputs == src.outputs
    other = jaxpr_to_graph(jax.make_jaxpr(fn(_mesh(("a", "b", "c"))))(f32(8, 8)), MESH8, ["data"], ["x"])
    (sm,) = [other.graph.ops[t.op] for t in other.eqns if t.primitive == "shard_map"]
    assert sm.fixed is None and sm.unsplittable == set(sm.dims)


def test_sharding_constraint_on_the_region_mesh_is_fixed():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def fixed_of(mesh, spec):
        fn = lambda x: jax.lax.with_sharding_constraint(x * 2.0, NamedSharding(mesh, spec))
        r = trace(fn, (f32(8, 4),), ["data"], ["x"])
        (op,) = [r.graph.ops[t.op] for t in r.eqns if t.primitive == "sharding_constraint"]
        return op.fixed
    assert fixed_of(_mesh(), P(("d1", "d2"), "d0")) == ((1, 2), (0,))
    assert fixed_of(_mesh(), P(None, "d2")) == ((), (2,))
    assert fixed_of(_mesh(("a", "b", "c")), P("a")) is None        # not the region mesh: the search decides


def test_literals_consts_and_outputs():
    c = jnp.arange(6.0)
    r = trace(lambda x: (x, x * 2.0 + c, 3.0), (f32(4, 6),), ["data"], ["x"])
    g = r.graph
    assert g.outputs[0] == g.ops[0].outputs[0]
    assert [g.ops[i].kind for i in r.const_ops] == ["const"] * len(r.closed_jaxpr.consts)
    lits = [op for op in g.ops if op.kind == "const" and "/literal" in op.name]
    assert lits and all(op.dims == {} for op in lits)
    assert g.producer(g.outputs[2]).name == "output/literal2"


def test_reshape_split_divides_follows_mesh():
    """A run with no common factors ([12, 8] -> [8, 12]: 12 is no multiple of 8) keeps the leading dims' shared
    loop dim, whose split must also divide the new leading dim."""
    fn = lambda x: x.reshape(8, 12)
    r8 = trace(fn, (f32(12, 8),), ["data"], ["x"])
    r2 = trace(fn, (f32(12, 8),), ["data"], ["x"], mesh=DeviceMesh((2,)))
    op8, op2 = r8.graph.ops[-1], r2.graph.ops[-1]
    assert op8.in_dims == [("r0", None)] and op8.out_dims == [("r0", "r0_1")]
    # r0 (12 rows, 8 new rows) may be split only by a count that divides both: gcd(12, 8) = 4
    assert op8.split_limit == {"r0": 4} and op8.split_sizes()[0] == 4 and op2.split_sizes()[0] == 4
    assert "r0" not in op8.unsplittable and "r0_1" in op8.unsplittable


def test_reshape_of_a_merged_run_follows_its_common_factors():
    """[16, 8] -> [2, 8, 8]: the 16 rows are 2 x 8, so the run's loop dims are (2, 8, 8); the rows are the first two,
    the new dims one each. Rows split 8 ways are the result split (2, 4, 1): the minor factor (8) splits only after
    the 2 is split whole."""
    r = trace(lambda x: x.reshape(2, 8, 8), (f32(16, 8),), ["data"], ["x"])
    op = r.graph.ops[-1]
    assert op.in_dims == [(("r0_0", "r0_1"), "r1")] and op.out_dims == [("r0_0", "r0_1", "r1")]
    assert op.dims == {"r0_0": 2, "r0_1": 8, "r1": 8} and op.nested() == ((1, ((0, 2),)),)
    mesh = r.graph.mesh
    rows8 = strategy_of_layout(op, (tuple(range(len(mesh.shape))), ()), 0, mesh)
    assert [mesh.count(a) for a in rows8] == [2, 4, 1] and is_legal(op, rows8, mesh)
    assert not is_legal(op, ((), rows8[1], ()), mesh)          # the minor factor alone: rows not contiguous


def test_itemsizes_and_bad_arguments():
    r = trace(lambda x: (x.astype(jnp.bfloat16), x > 0), (f32(4, 6),), ["data"], ["x"])
    assert [r.graph.tensors[t].itemsize for t in r.graph.outputs] == [2, 1]
    cj = jax.make_jaxpr(lambda x, y: x + y)(f32(2), f32(2))
    with pytest.raises(PlanError, match="2 inputs"):
        jaxpr_to_graph(cj, MESH8, ["data"], ["x"])


def test_updated_state_is_tied_to_its_input_by_a_writeback_op():
    """state_outputs (result index, input index): a writeback op consumes the new value and the input it
    replaces on the same loop dims; an unchanged state (the result is the input itself) gets none."""
    fn = lambda w, c, x: (jnp.sum(x @ w), w, c + 1.0)        # user output, then the new w (unchanged), new c
    cj = jax.make_jaxpr(fn)(f32(4, 6), f32(6), f32(8, 4))
    r = jaxpr_to_graph(cj, MESH8, ["param", "param", "data"], ["w", "c", "x"], state_outputs=[(1, 0), (2, 1)])
    g = r.graph
    (wb,) = [op for op in g.ops if op.kind == "writeback"]
    assert wb.name == "writeback/c" and g.producer(wb.inputs[0]).kind == "add"
    assert g.producer(wb.inputs[1]).name == "c" and wb.in_dims[0] == wb.in_dims[1] == tuple(wb.dims)
    assert not any(op.kind == "writeback" for op in jaxpr_to_graph(cj, MESH8, ["param", "param", "data"],
                                                                     ["w", "c", "x"]).graph.ops)
