"""A convolution's "same" window: its spatial dims split with a halo exchange, priced, never with out-channels."""

import numpy as np
import pytest

from searchers.cost import CostParams, op_cost
from searchers.cost_vectors import op_cost_vector
from searchers.graph import DeviceMesh, Graph
from searchers.propagation import sharding_propagation
from searchers.strategies import enumerate_strategies

N, C, H, W, O = 8, 4, 16, 16, 6


def conv_graph(x_layout=None, relu_first=False):
    """x (n c h w) -> [relu ->] a 3x3 "same" conv, as mshard traces one (halo 2 rows on h and w, o kept apart)."""
    g = Graph(DeviceMesh((2, 2, 2)))
    x = g.source("x", (N, C, H, W), fixed=x_layout)
    w = g.source("w", (O, C, 3, 3), kind="param")
    if relu_first:
        (x,) = g.add_op("relu", "max", {"n": N, "c": C, "h": H, "w": W}, [x], [("n", "c", "h", "w")],
                        [("n", "c", "h", "w")])
    g.add_op("conv", "conv_general_dilated", {"n": N, "o": O, "h": H, "w": W, "c": C, "kh": 3, "kw": 3}, [x, w],
             [("n", "c", "h", "w"), ("o", "c", "kh", "kw")], [("n", "o", "h", "w")],
             unsplittable=frozenset({"kh", "kw"}), halo={"h": 2, "w": 2}, halo_apart=frozenset({"o"}))
    return g


def test_no_candidate_splits_a_halo_dim_with_out_channels_but_a_user_strategy_may():
    g = conv_graph()
    conv = g.ops[-1]
    dims = list(conv.dims)
    h, w, o = dims.index("h"), dims.index("w"), dims.index("o")
    cands = enumerate_strategies(conv, g.mesh)
    assert any(s[h] for s in cands) and any(s[o] for s in cands)       # each alone is a candidate
    assert not any((s[h] or s[w]) and s[o] for s in cands)
    conv.fixed = tuple((0,) if i == h else (1,) if i == o else () for i in range(len(dims)))
    assert enumerate_strategies(conv, g.mesh) == [conv.fixed]


def test_the_halo_is_priced_as_two_permutes_per_split_dim_on_the_widened_block():
    g = conv_graph()
    conv = g.ops[-1]
    dims = list(conv.dims)
    s = tuple((0, 1) if d == "h" else (2,) if d == "w" else () for d in dims)   # h over 4 devices, w over 2
    c = op_cost(conv, s, g, CostParams())
    block = N * C * H * W * 4 / 8                  # x's local bytes
    along_h = block * 2 / (H / 4)                  # 2 halo rows of a 4-row block
    along_w = (block + along_h) * 2 / (W / 2)      # then 2 columns of the block widened by the h halo
    assert c.comm_bytes["collective-permute"] == pytest.approx(along_h + along_w, rel=1e-12)
    # four permutes at the default 5 us latency, 100 GB/s
    assert c.comm_time == pytest.approx(4 * 5e-6 + (along_h + along_w) / 100e9, rel=1e-12)
    # the searchers' vectorised costs agree with op_cost on every candidate
    cands = enumerate_strategies(conv, g.mesh)
    vec = op_cost_vector(conv, cands, g, CostParams())
    ref = np.array([op_cost(conv, t, g, CostParams()).total for t in cands])
    np.testing.assert_allclose(vec, ref, rtol=1e-12)


@pytest.mark.parametrize("axes", [((0,), ()), ((), (1,)), ((0, 1), (2,))])
def test_a_relu_split_on_height_or_width_keeps_its_layout_through_the_conv(axes):
    """The issue's case: a ReLU laid out over H and/or W (a user's strategy) feeding a 3x3 "same" conv. Before halos
    the conv's spatial dims were unsplittable and the ReLU's result was gathered."""
    from searchers.cost import redistribution_total
    from searchers.graph import operand_layout, result_layout
    ah, aw = axes
    g = conv_graph(relu_first=True)
    relu, conv = g.ops[-2], g.ops[-1]
    relu.fixed = ((), (), ah, aw)
    r = sharding_propagation(g, CostParams(), cache=False, baselines=False)
    got = dict(zip(conv.dims, r.strategies[conv.id], strict=True))
    assert got["h"][:len(ah)] == ah and got["w"][:len(aw)] == aw and got["o"] == ()
    # the ReLU's result reaches the conv as it is (at most sliced further, which moves nothing)
    have = result_layout(relu, relu.fixed)
    want = operand_layout(conv, r.strategies[conv.id], 0)
    assert redistribution_total(have, want, N * C * H * W * 4, g.mesh, CostParams()) == 0.0
