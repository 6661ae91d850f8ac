"""searchers.memory: the fused count (values XLA computes inside their readers' fusions are not stored)."""

from searchers.graph import DeviceMesh, Graph
from searchers.memory import fused_live_ranges, memory_profile


def _chain():
    """x -> dot(w) -> add(b) -> tanh -> dot(w2) -> out, on one device: 4-byte floats."""
    g = Graph(DeviceMesh((1,)))
    x = g.source("x", (8, 16))                                      # 512 B
    w = g.source("w", (16, 32), kind="param")                       # 2,048 B
    b = g.source("b", (32,), kind="param")                          # 128 B
    w2 = g.source("w2", (32, 4), kind="param")                      # 512 B
    (h,) = g.add_op("dot", "dot_general", {"i": 8, "k": 16, "j": 32}, [x, w], [("i", "k"), ("k", "j")],
                    [("i", "j")], [(8, 32)])                          # 1,024 B
    (a,) = g.add_op("add", "add", {"i": 8, "j": 32}, [h, b], [("i", "j"), ("j",)], [("i", "j")])
    (t,) = g.add_op("tanh", "tanh", {"i": 8, "j": 32}, [a], [("i", "j")], [("i", "j")])
    (y,) = g.add_op("dot2", "dot_general", {"i": 8, "j": 32, "o": 4}, [t, w2], [("i", "j"), ("j", "o")],
                    [("i", "o")], [(8, 4)])                           # 128 B
    g.outputs.append(y)
    return g, {"h": h, "a": a, "t": t}


def test_an_elementwise_value_read_only_by_elementwise_ops_is_not_stored():
    g, t = _chain()
    strategies = {op.id: tuple(() for _ in op.dims) for op in g.ops}
    _first, last, mat = fused_live_ranges(g)
    # add's result feeds tanh alone: fused; tanh's result feeds a dot: stored; dot's result feeds add: stored
    assert not mat[t["a"]] and mat[t["t"]] and mat[t["h"]]
    # tanh reads add's operands instead: the dot's result lives until tanh (step 6), not only until add (step 5)
    assert last[t["h"]] == g.tensors[t["t"]].producer
    # by hand, per step (ops 0-3 are x, w, b, w2; 4 dot, 5 add, 6 tanh, 7 dot2), each value from its producer to
    # its last reader: x 512 B (to 4), w 2,048 (to 4), b 128 (to 5), w2 512 (to 7), h 1,024 (to 5), a 1,024 (to 6),
    # t 1,024 (to 7), y 128
    assert list(memory_profile(g, strategies)) == [512, 2560, 2688, 3200, 4224, 2688, 2560, 1664]
    # fused: a is not stored; tanh reads h and b in its place, so both live to step 6
    assert list(memory_profile(g, strategies, fused=True)) == [512, 2560, 2688, 3200, 4224, 1664, 2688, 1664]
