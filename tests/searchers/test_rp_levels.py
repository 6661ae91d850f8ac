"""recursive_programming decided level by level (searchers.rp_levels) and its flat slot index
(searchers.slots): the level-at-once path must give exactly the op-by-op loop's plan."""

import numpy as np
import pytest

import searchers.recursive_programming as rp
import searchers.rows as rows
import searchers.rp_levels as rpl
from searchers.cost import CostParams
from searchers.generators import random_dag, transformer_stack
from searchers.graph import DeviceMesh, Graph
from searchers.rows import distinct_rows
from searchers.rp_levels import levels_of
from searchers.slots import slot_graph
from searchers.spec import distinct_spec_keys, spec_keys

P = CostParams()


def _longest_paths(src, dst, n):
    """Longest path (in edges) ending at each node, by the textbook recurrence in node order."""
    preds = [[] for _ in range(n)]
    for a, b in zip(src.tolist(), dst.tolist(), strict=True):
        preds[b].append(a)
    out = [0] * n
    for v in range(n):
        out[v] = max((out[u] + 1 for u in preds[v]), default=0)
    return np.array(out)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("min_size,most", [(1, 64), (5, 64), (40, 64), (1, 3)])
def test_levels_are_exact_longest_paths_and_the_tail_is_the_rest(seed, min_size, most):
    rng = np.random.default_rng(seed)
    n = 300
    a = rng.integers(0, n, size=700)
    b = rng.integers(0, n, size=700)
    keep = a != b
    src, dst = np.minimum(a, b)[keep], np.maximum(a, b)[keep]
    level, k = levels_of(src, dst, n, min_size, most)
    longest = _longest_paths(src, dst, n)
    head = longest < k
    assert (level[head] == longest[head]).all()            # exact where the searcher uses them
    assert (level[~head] >= k).all()                       # the tail: every node at or past level k
    assert all((longest == i).sum() >= min_size for i in range(k))
    # stopped at the first small level, at the cap, or at the end
    assert k == longest.max() + 1 or (longest == k).sum() < min_size or k == most
    assert k <= most


def test_distinct_rows_groups_equal_rows_even_when_every_hash_collides(monkeypatch):
    rng = np.random.default_rng(0)
    key = rng.integers(0, 3, size=(500, 4))
    for mix in (None, np.ones(64, dtype=np.int64)):          # ones: rows with equal sums collide
        if mix is not None:
            monkeypatch.setattr(rows, "_MIX", mix)
        first, inv = distinct_rows(key)
        assert (key[first][inv] == key).all()               # every row equals its group's first row
        assert len(first) == len(np.unique(key, axis=0))    # and groups are distinct


def _multi_output_dag(n_ops, seed, mesh):
    """Random ops on 2-D tensors, some with two results (a split), so result refs have j > 0."""
    rng = np.random.default_rng(seed)
    g = Graph(mesh)
    pool = [g.source(f"x{i}", (8, 16)) for i in range(3)] + [g.source("w", (16, 16), kind="param")]
    while len(g) < n_ops:
        x = pool[-1 - int(rng.integers(0, min(len(pool), 6)))]
        m, k = g.tensors[x].shape
        r = rng.random()
        if r < 0.3 and k == 16:
            w = g.source(f"w{len(g)}", (16, 16), kind="param")
            pool += g.add_op(f"mm{len(g)}", "dot_general", {"m": m, "k": 16, "n": 16}, [x, w],
                             [("m", "k"), ("k", "n")], [("m", "n")])
        elif r < 0.6:
            pool += g.add_op(f"split{len(g)}", "split", {"i": m, "j": k}, [x], [("i", "j")], [("i", "j"), ("i", "j")])
        else:
            y = pool[-1 - int(rng.integers(0, min(len(pool), 6)))]
            if g.tensors[y].shape == (m, k):
                pool += g.add_op(f"add{len(g)}", "add", {"i": m, "j": k}, [x, y], [("i", "j"), ("i", "j")], [("i", "j")])
            else:
                pool += g.add_op(f"exp{len(g)}", "exp", {"i": m, "j": k}, [x], [("i", "j")], [("i", "j")])
    return g


def test_slots_match_the_graph():
    g = _multi_output_dag(120, 0, DeviceMesh((2, 2)))
    s = slot_graph(g)
    res_slot = {}
    for op in g.ops:            # blocks: operands then results, consecutive, in op order
        assert s.base[op.id + 1] - s.base[op.id] == len(op.inputs) + len(op.outputs)
        for j, t in enumerate(op.outputs):
            res_slot[t] = s.base[op.id] + len(op.inputs) + j
    for op in g.ops:
        mine = [res_slot[t] for t in op.inputs]
        pos = list(range(len(op.inputs)))
        # consumer refs, in edge order (consumer op, operand index)
        for c in g.ops:
            for k, t in enumerate(c.inputs):
                if g.tensors[t].producer == op.id:
                    mine.append(s.base[c.id] + k)
                    pos.append(len(op.inputs) + op.outputs.index(t))
        assert s.refs(op.id) == mine
        assert s.ref_pos[s.ref_ptr[op.id]:s.ref_ptr[op.id + 1]].tolist() == pos
        assert all(s.owner[x] == op.id for x in range(s.base[op.id], s.base[op.id + 1]))


def _unread_results_chains(chains: int, length: int, mesh: DeviceMesh) -> Graph:
    """Parallel chains of elementwise ops, built interleaved (levels of ``chains`` ops), each with an op that has four
    results of which only the first is read: its block is wider than any position a ref meets (a traced GPT training
    step has such ops, and the level path sized its tables by the refs alone)."""
    g = Graph(mesh)
    xs = [g.source(f"x{c}", (16, 8)) for c in range(chains)]
    for i in range(length):
        for c in range(chains):
            if i == length // 2:
                xs[c] = g.add_op(f"split{c}.{i}", "split", {"i": 16, "j": 8}, [xs[c]], [("i", "j")],
                                 [("i", "j")] * 4)[0]
            else:
                (xs[c],) = g.add_op(f"neg{c}.{i}", "neg", {"i": 16, "j": 8}, [xs[c]], [("i", "j")], [("i", "j")])
    return g


def _graphs():
    fixed = random_dag(1200, 6, DeviceMesh((2, 2, 2)))
    for op in fixed.ops[::7]:
        if op.is_source:
            op.fixed = tuple(((0,) if i == 0 and op.dims[d] % 2 == 0 else ()) for i, d in enumerate(op.dims))
    return [
        pytest.param(random_dag(1500, 1, DeviceMesh((2, 2, 2))), {}, id="random-2x2x2"),
        pytest.param(random_dag(1500, 2, DeviceMesh((2, 3))), {}, id="random-2x3"),
        pytest.param(random_dag(1500, 3, DeviceMesh((2, 2, 2))), {"fully_use_devices": True}, id="random-fully"),
        pytest.param(random_dag(1500, 4, DeviceMesh((2, 2))), {"refine": 3, "polish": 0}, id="random-refine-3"),
        pytest.param(_multi_output_dag(800, 5, DeviceMesh((2, 2, 2))), {}, id="two-results"),
        pytest.param(fixed, {}, id="fixed-sources"),
        pytest.param(_unread_results_chains(40, 12, DeviceMesh((2, 2, 2))), {}, id="unread-results"),
        pytest.param(transformer_stack(3, 8, 32, 64, 4, 128, DeviceMesh((2, 2, 2)), backward=True), {},
                     id="transformer"),
    ]


@pytest.mark.parametrize("g,kw", _graphs())
def test_levels_at_once_give_the_op_by_op_plan(monkeypatch, g, kw):
    monkeypatch.setattr(rp, "LEVEL_MIN_OPS", 10**9)               # every op, one by one
    one = rp.recursive_programming(g, P, cache=False, **kw)
    sweeps = []
    real = rpl.LevelBatch.sweep

    def counted(self, rnd, state, lay):
        sweeps.append((rnd, self.n_levels, len(self.tail)))
        return real(self, rnd, state, lay)

    monkeypatch.setattr(rpl.LevelBatch, "sweep", counted)
    for least in (1, 16):
        monkeypatch.setattr(rp, "LEVEL_MIN_OPS", least)
        sweeps.clear()
        at_once = rp.recursive_programming(g, P, cache=False, **kw)
        assert sweeps and all(k > 0 for _, k, _ in sweeps)     # the level path ran, every round
        assert at_once.strategies == one.strategies
        assert at_once.cost.total == one.cost.total


@pytest.mark.parametrize("g", [_multi_output_dag(300, 7, DeviceMesh((2, 2))), random_dag(800, 8, DeviceMesh((2, 3))),
                               transformer_stack(2, 4, 8, 16, 2, 32, DeviceMesh((2, 2)), backward=True)])
def test_distinct_spec_keys_are_spec_keys_in_order_of_first_use(g):
    keys, index = distinct_spec_keys(g)
    per_op = spec_keys(g)
    assert [keys[i] for i in index.tolist()] == per_op
    assert keys == list(dict.fromkeys(per_op))              # distinct, first use first
