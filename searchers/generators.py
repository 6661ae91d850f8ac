"""Synthetic operator graphs (no JAX): MLP chains, transformer stacks, conv nets, random DAGs.

Ops of a repeated layer carry the same ``layer`` key in every copy (``"block"`` for the
forward ops of a transformer block, ``"block/bwd"`` for its backward ops, ``"block/update"``
for its parameter updates), and each copy's ops are contiguous in program order, so a
searcher can recognise repeated layers. Op kinds are JAX primitive names where one exists.

>>> from searchers.graph import DeviceMesh
>>> g = mlp_chain(3, 64, 32, DeviceMesh((2, 2)))
>>> len(g), [op.kind for op in g.ops[:4]]
(10, ['data', 'param', 'dot_general', 'relu'])
>>> n = len(graph_of_size(1000, "transformer", DeviceMesh((2,))))
>>> abs(n - 1000) <= _ops_per_layer("transformer", True)[1] // 2   # as close as whole layers allow
True
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from .errors import SearchGraphError
from .graph import DeviceMesh, Graph
from .netbuilder import NetBuilder
from .strategies import data_parallel_strategy


# -- MLP -------------------------------------------------------------------------------------
def mlp_chain(layers: int, batch: int, width: int, mesh: DeviceMesh, *, backward: bool = False) -> Graph:
    """``x[batch, width]`` through ``layers`` x (dense ``w[width, width]`` + relu); with
    ``backward``, a sum loss and the backward pass. Forward: ``1 + 3 * layers`` ops."""
    b = NetBuilder(mesh)
    h = b.data("x", (batch, width))
    for i in range(layers):
        b.layer, b.scope = "mlp", f"layer{i}"
        w = b.param("w", (width, width))
        h = b.op("dot_general", "dot_general", {"m": batch, "k": width, "n": width}, [h, w],
                 [("m", "k"), ("k", "n")], ("m", "n"))
        h = b.elementwise("relu", "relu", [h])
    b.layer, b.scope = None, ""
    if not backward:
        b.graph.outputs.append(h)
        return b.graph
    loss = b.op("loss", "reduce_sum", {"m": batch, "n": width}, [h], [("m", "n")], ())
    return b.backward(loss)


# -- transformer -----------------------------------------------------------------------------
def _layer_norm(b: NetBuilder, x: int, B: int, S: int, D: int, name: str) -> int:
    bsd = {"b": B, "s": S, "d": D}
    prev = b.scope
    b.scope = f"{prev}/{name}"
    mu = b.op("reduce_sum", "reduce_sum", bsd, [x], [("b", "s", "d")], ("b", "s"))
    xc = b.op("sub", "sub", bsd, [x, mu], [("b", "s", "d"), ("b", "s")], ("b", "s", "d"))
    sq = b.op("mul", "mul", bsd, [xc, xc], [("b", "s", "d")] * 2, ("b", "s", "d"))
    var = b.op("reduce_sum_1", "reduce_sum", bsd, [sq], [("b", "s", "d")], ("b", "s"))
    rstd = b.op("rsqrt", "rsqrt", {"b": B, "s": S}, [var], [("b", "s")], ("b", "s"))
    xn = b.op("mul_1", "mul", bsd, [xc, rstd], [("b", "s", "d"), ("b", "s")], ("b", "s", "d"))
    gamma, beta = b.param("scale", (D,)), b.param("bias", (D,))
    y = b.op("mul_2", "mul", bsd, [xn, gamma], [("b", "s", "d"), ("d",)], ("b", "s", "d"))
    y = b.op("add", "add", bsd, [y, beta], [("b", "s", "d"), ("d",)], ("b", "s", "d"))
    b.scope = prev
    return y


def _block(b: NetBuilder, x: int, B: int, S: int, D: int, H: int, F: int) -> int:
    E = D // H
    proj = {"b": B, "s": S, "h": H, "e": E, "d": D}
    att = {"b": B, "h": H, "s": S, "t": S, "e": E}
    bhst = {"b": B, "h": H, "s": S, "t": S}
    y = _layer_norm(b, x, B, S, D, "ln1")
    qkv = []
    for n in ("q", "k", "v"):
        w = b.param(f"attn/w{n}", (D, H, E))
        qkv.append(b.op(f"attn/{n}/dot_general", "dot_general", proj, [y, w],
                        [("b", "s", "d"), ("d", "h", "e")], ("b", "s", "h", "e")))
    q, k, v = qkv
    sc = b.op("attn/scores/dot_general", "dot_general", att, [q, k],
              [("b", "s", "h", "e"), ("b", "t", "h", "e")], ("b", "h", "s", "t"))
    mx = b.op("attn/softmax/reduce_max", "reduce_max", bhst, [sc], [("b", "h", "s", "t")], ("b", "h", "s"),
              reduce="max")
    z = b.op("attn/softmax/sub", "sub", bhst, [sc, mx], [("b", "h", "s", "t"), ("b", "h", "s")],
             ("b", "h", "s", "t"))
    ez = b.op("attn/softmax/exp", "exp", bhst, [z], [("b", "h", "s", "t")], ("b", "h", "s", "t"))
    den = b.op("attn/softmax/reduce_sum", "reduce_sum", bhst, [ez], [("b", "h", "s", "t")], ("b", "h", "s"))
    p = b.op("attn/softmax/div", "div", bhst, [ez, den], [("b", "h", "s", "t"), ("b", "h", "s")],
             ("b", "h", "s", "t"))
    ctx = b.op("attn/context/dot_general", "dot_general", att, [p, v],
               [("b", "h", "s", "t"), ("b", "t", "h", "e")], ("b", "s", "h", "e"))
    wo = b.param("attn/wo", (H, E, D))
    o = b.op("attn/o/dot_general", "dot_general", proj, [ctx, wo],
             [("b", "s", "h", "e"), ("h", "e", "d")], ("b", "s", "d"))
    r1 = b.elementwise("attn/add", "add", [x, o])
    y2 = _layer_norm(b, r1, B, S, D, "ln2")
    w1, w2 = b.param("mlp/w1", (D, F)), b.param("mlp/w2", (F, D))
    f1 = b.op("mlp/fc1/dot_general", "dot_general", {"b": B, "s": S, "f": F, "d": D}, [y2, w1],
              [("b", "s", "d"), ("d", "f")], ("b", "s", "f"))
    act = b.elementwise("mlp/tanh", "tanh", [f1])
    f2 = b.op("mlp/fc2/dot_general", "dot_general", {"b": B, "s": S, "d": D, "f": F}, [act, w2],
              [("b", "s", "f"), ("f", "d")], ("b", "s", "d"))
    return b.elementwise("mlp/add", "add", [r1, f2])


def transformer_stack(layers: int, batch: int, seq: int, d_model: int, heads: int, d_ff: int,
                      mesh: DeviceMesh, backward: bool = True) -> Graph:
    """``layers`` pre-LN transformer blocks on activations ``x[batch, seq, d_model]``.

    A block: layer norm (reduce_sum, sub, mul, reduce_sum, rsqrt, mul, mul, add), q/k/v
    projections (dot_general with ``w[d, h, e]``), scores (dot_general ``bshe,bthe->bhst``),
    softmax (reduce_max, sub, exp, reduce_sum, div), context (dot_general), output projection
    (``w[h, e, d]``), residual add, layer norm, MLP (``w1[d, f]``, tanh, ``w2[f, d]``), residual
    add: 42 ops with its 10 parameter sources. With ``backward``: a sum loss, the backward pass
    (dx and dW dot_generals per matmul, elementwise and reduction gradients, gradient
    accumulation adds) and one update op per parameter.

    >>> g = transformer_stack(2, 2, 8, 16, 2, 32, DeviceMesh((2,)), backward=False)
    >>> len(g), sorted({op.layer for op in g.ops if op.layer})
    (85, ['block'])
    """
    if d_model % heads:
        raise SearchGraphError(f"transformer_stack: d_model={d_model} is not divisible by heads={heads}")
    b = NetBuilder(mesh)
    h = b.data("x", (batch, seq, d_model))
    for i in range(layers):
        b.layer, b.scope = "block", f"block{i}"
        h = _block(b, h, batch, seq, d_model, heads, d_ff)
    b.layer, b.scope = None, ""
    if not backward:
        b.graph.outputs.append(h)
        return b.graph
    loss = b.op("loss/reduce_sum", "reduce_sum", {"b": batch, "s": seq, "d": d_model}, [h],
                [("b", "s", "d")], ())
    return b.backward(loss)


# -- conv net --------------------------------------------------------------------------------
def conv_net(batch: int, image: int, channels: tuple[int, ...], classes: int, mesh: DeviceMesh, *,
             blocks_per_stage: int = 1, kernel: int = 3, backward: bool = False) -> Graph:
    """A VGG-like net on ``x[batch, channels[0], image, image]``: stage ``s`` has
    ``blocks_per_stage`` x (conv 'same' ``k x k`` to ``channels[s+1]`` + relu), then a 2x2 max
    pool; then a global sum pool, a dense head to ``classes`` and a sum loss.

    A conv is the iteration space ``n, o, c, h, w, kh, kw`` (input ``n c h w``, kernel
    ``o c kh kw``, result ``n o h w``; c, kh, kw are reductions) with h, w, kh, kw unsplittable
    (no halo exchange). A pool is ``n, c, h, w, ph, pw`` whose input spatial dims follow no
    loop dim.

    >>> g = conv_net(4, 8, (3, 8, 16), 10, DeviceMesh((2,)))
    >>> [op.kind for op in g.ops if not op.is_source]
    ['conv_general_dilated', 'relu', 'reduce_window_max', 'conv_general_dilated', 'relu', \
'reduce_window_max', 'reduce_sum', 'dot_general', 'reduce_sum']
    """
    if image % (2 ** (len(channels) - 1)):
        raise SearchGraphError(f"conv_net: image={image} must be divisible by 2**{len(channels) - 1}")
    b = NetBuilder(mesh)
    res = image
    x = b.data("x", (batch, channels[0], res, res))
    for s in range(len(channels) - 1):
        for blk in range(blocks_per_stage):
            cin = channels[s] if blk == 0 else channels[s + 1]
            cout = channels[s + 1]
            b.layer, b.scope = f"conv{cin}-{cout}@{res}", f"stage{s}/block{blk}"
            w = b.param("w", (cout, cin, kernel, kernel))
            dims = {"n": batch, "o": cout, "c": cin, "h": res, "w": res, "kh": kernel, "kw": kernel}
            x = b.op("conv_general_dilated", "conv_general_dilated", dims, [x, w],
                     [("n", "c", "h", "w"), ("o", "c", "kh", "kw")], ("n", "o", "h", "w"),
                     unsplittable=frozenset({"h", "w", "kh", "kw"}))
            x = b.elementwise("relu", "relu", [x])
        b.layer, b.scope = None, f"stage{s}"
        res //= 2
        x = b.op("pool", "reduce_window_max",
                 {"n": batch, "c": channels[s + 1], "h": res, "w": res, "ph": 2, "pw": 2}, [x],
                 [("n", "c", None, None)], ("n", "c", "h", "w"), reduce="max",
                 unsplittable=frozenset({"h", "w", "ph", "pw"}))
    b.layer, b.scope = None, "head"
    c = channels[-1]
    x = b.op("global_pool", "reduce_sum", {"n": batch, "c": c, "h": res, "w": res}, [x],
             [("n", "c", "h", "w")], ("n", "c"), unsplittable=frozenset({"h", "w"}))
    w = b.param("w", (c, classes))
    x = b.op("dense", "dot_general", {"n": batch, "k": c, "m": classes}, [x, w], [("n", "k"), ("k", "m")],
             ("n", "m"))
    loss = b.op("loss", "reduce_sum", {"n": batch, "m": classes}, [x], [("n", "m")], ())
    b.scope = ""
    if not backward:
        b.graph.outputs.append(loss)
        return b.graph
    return b.backward(loss)


# -- random DAG ------------------------------------------------------------------------------
def random_dag(n_ops: int, seed: int, mesh: DeviceMesh) -> Graph:
    """A random graph of exactly ``n_ops`` ops on 2-D tensors: sources, matmuls, unary and
    binary elementwise ops, row reductions, broadcast adds and transposes. Dim sizes come from
    ``{6, 8, 12, 16, 24, 32, 48, 64}``. Deterministic for a given seed.

    >>> g = random_dag(50, 0, DeviceMesh((2, 2)))
    >>> len(g), g.ops[0].is_source
    (50, True)
    """
    rng = np.random.default_rng(seed)
    sizes = [6, 8, 12, 16, 24, 32, 48, 64]
    b = NetBuilder(mesh)
    two_d: list[int] = []
    one_d: list[int] = []
    g = b.graph

    def size() -> int:
        return int(rng.choice(sizes))

    def pick(pool: list[int]) -> int:
        # favour recent tensors so the graph gets deep, not only wide
        n = len(pool)
        return pool[n - 1 - min(n - 1, int(rng.geometric(0.15)) - 1)]

    def shape(t: int) -> tuple[int, ...]:
        return g.tensors[t].shape

    while len(g) < n_ops:
        left = n_ops - len(g)
        r = rng.random()
        if not two_d or (r < 0.12 and left >= 1):
            kind = "data" if rng.random() < 0.3 else "param"
            t = b.data(f"in{len(g)}", (size(), size())) if kind == "data" else b.param(f"p{len(g)}", (size(), size()))
            two_d.append(t)
            continue
        x = pick(two_d)
        m, k = shape(x)
        name = f"op{len(g)}"
        if r < 0.35:                                  # matmul with an existing or new [k, n]
            cands = [t for t in two_d[-40:] if shape(t)[0] == k]
            if cands:
                w = cands[int(rng.integers(len(cands)))]
            elif left >= 2:
                w = b.param(f"p{len(g)}", (k, size()))
                two_d.append(w)
            else:
                continue
            n = shape(w)[1]
            two_d.append(b.op(name, "dot_general", {"m": m, "k": k, "n": n}, [x, w],
                              [("m", "k"), ("k", "n")], ("m", "n")))
        elif r < 0.55:                                # binary elementwise, same shape
            same = [t for t in two_d[-40:] if shape(t) == (m, k) and t != x]
            kind = ("add", "mul", "sub")[int(rng.integers(3))]
            if same:
                two_d.append(b.elementwise(name, kind, [x, same[int(rng.integers(len(same)))]]))
            else:
                two_d.append(b.elementwise(name, "exp", [x]))
        elif r < 0.7:                                 # unary elementwise
            two_d.append(b.elementwise(name, ("exp", "tanh", "relu")[int(rng.integers(3))], [x]))
        elif r < 0.8:                                 # row reduction
            one_d.append(b.op(name, "reduce_sum", {"i": m, "j": k}, [x], [("i", "j")], ("i",)))
        elif r < 0.9 and one_d:                       # broadcast add of a vector along a matching dim
            vecs = [v for v in one_d[-40:] if shape(v)[0] in (m, k)]
            if not vecs:
                two_d.append(b.elementwise(name, "tanh", [x]))
                continue
            v = vecs[int(rng.integers(len(vecs)))]
            along = "i" if shape(v)[0] == m else "j"
            two_d.append(b.op(name, "add", {"i": m, "j": k}, [x, v], [("i", "j"), (along,)], ("i", "j")))
        else:                                         # transpose
            two_d.append(b.op(name, "transpose", {"i": m, "j": k}, [x], [("i", "j")], ("j", "i")))
    return g


# -- sizes -----------------------------------------------------------------------------------
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mlp": {"batch": 64, "width": 1024},
    "transformer": {"batch": 8, "seq": 128, "d_model": 512, "heads": 8, "d_ff": 2048},
    "conv": {"batch": 32, "image": 32, "channels": (3, 32, 64, 128), "classes": 10},
}
FAMILIES = ("mlp", "transformer", "conv", "random")


def _build(family: str, layers: int, mesh: DeviceMesh, backward: bool, seed: int) -> Graph:
    kw = _DEFAULTS.get(family, {})
    if family == "mlp":
        return mlp_chain(layers, mesh=mesh, backward=backward, **kw)
    if family == "transformer":
        return transformer_stack(layers, mesh=mesh, backward=backward, **kw)
    if family == "conv":
        return conv_net(mesh=mesh, blocks_per_stage=layers, backward=backward, **kw)
    raise SearchGraphError(f"unknown graph family {family!r}; choose one of {FAMILIES}")


@lru_cache(maxsize=64)
def _ops_per_layer(family: str, backward: bool) -> tuple[int, int]:
    """(ops outside the repeated layers, ops per layer) of a family."""
    mesh = DeviceMesh((1,))
    one, two = len(_build(family, 1, mesh, backward, 0)), len(_build(family, 2, mesh, backward, 0))
    return one - (two - one), two - one


def layers_for(target_ops: int, family: str = "transformer", *, backward: bool = True) -> int:
    """Layer count (``blocks_per_stage`` for conv) whose graph comes closest to ``target_ops``
    ops, at least 1.

    >>> layers_for(100_000, "mlp", backward=False)
    33333
    """
    base, per = _ops_per_layer(family, backward)
    return max(1, round((target_ops - base) / per))


def graph_of_size(target_ops: int, family: str = "transformer", mesh: DeviceMesh | None = None, *,
                  backward: bool = True, seed: int = 0, fix_data: bool = False) -> Graph:
    """A graph of about ``target_ops`` ops (within one layer; ``random`` is exact; a family's
    smallest graph has one layer). ``fix_data`` fixes every data source to the data-parallel
    strategy, as MindSpore's dataset strategy does, so propagation has somewhere to start."""
    mesh = mesh or DeviceMesh.prime(8)
    if family == "random":
        g = random_dag(target_ops, seed, mesh)
    else:
        g = _build(family, layers_for(target_ops, family, backward=backward), mesh, backward, seed)
    if fix_data:
        for op in g.ops:
            if op.kind == "data":
                op.fixed = data_parallel_strategy(op, mesh)
    return g
