"""searchers.direct_reshard (issue 40): the direct steps of every layout pair take every device's block to the
block the destination layout gives it, and they are priced as the collectives they are.

The oracle does not share the planner's code: each device's block is an array of global element indices, cut
from the whole tensor by the layout (a dim split by axes (a, b) is cut into |a| x |b| tiles, a major), and the
moves act on those blocks as JAX's tiled collectives do over the devices that differ only in the move's mesh
axis (member order = the axis index): a slice keeps tile ``i`` of the dim, an all-to-all sends chunk ``j`` of
the split dim to member ``j`` and concatenates what it receives along the other dim, an all-gather concatenates
every member's block along the dim."""

import itertools
import math
import random

import numpy as np
import pytest
from helpers import all_layouts as layouts

from searchers.direct_reshard import best_steps, cheaper_than_xla, plan, steps
from searchers.xla_reshard import reshard


def blocks(layout, mesh, shape):
    """Every device's block (global flat indices) under ``layout``; devices numbered row-major over ``mesh``."""
    whole = np.arange(math.prod(shape)).reshape(shape)
    out = []
    for dev in range(math.prod(mesh)):
        coord = np.unravel_index(dev, mesh)
        idx = []
        for d, axes in enumerate(layout):
            tile, count = 0, 1
            for a in axes:
                tile, count = tile * mesh[a] + int(coord[a]), count * mesh[a]
            size = shape[d] // count
            idx.append(slice(tile * size, (tile + 1) * size))
        out.append(whole[tuple(idx)])
    return out


def members(dev, axes, mesh):
    """The devices that differ from ``dev`` only in the mesh ``axes``, ordered by those axes' coordinates with the
    first axis major (one axis: that axis's order; a stack (a, b): a's index times |b| plus b's)."""
    coord = list(np.unravel_index(dev, mesh))
    group = []
    for idx in itertools.product(*[range(mesh[a]) for a in axes]):
        for a, i in zip(axes, idx, strict=True):
            coord[a] = i
        group.append(int(np.ravel_multi_index(coord, mesh)))
    return group


def _axes(m):
    """The mesh axes of a move: its stack where it moves one (``axes``), else its one axis."""
    return tuple(m.axes) or (m.axis,)


def step(cur, m, mesh):
    """Every device's block after move ``m``."""
    axes = _axes(m)
    k = math.prod(mesh[a] for a in axes)
    new = []
    for dev in range(len(cur)):
        group = members(dev, axes, mesh)
        me = group.index(dev)
        if m.kind == "slice":
            new.append(np.split(cur[dev], k, axis=m.dim)[me])
        elif m.kind == "all-to-all":
            new.append(np.concatenate([np.split(cur[g], k, axis=m.dim)[me] for g in group], axis=m.src_dim))
        else:
            new.append(np.concatenate([cur[g] for g in group], axis=m.src_dim))
    return new


def run_moves(moves, src, mesh, shape):
    cur = blocks(src, mesh, shape)
    for m in moves:
        cur = step(cur, m, mesh)
    return cur


CASES = [((2, 4), (8, 16)), ((2, 2, 2), (8, 16)), ((2, 2, 2), (8, 8, 8))]


def pairs(mesh, shape, sample=None):
    """Every layout pair, or a fixed random sample of ``sample`` of them (rank 3 on 2 x 2 x 2 has ~17,000)."""
    ls = layouts(len(shape), len(mesh))
    out = list(itertools.product(ls, ls))
    return out if sample is None or sample >= len(out) else random.Random(0).sample(out, sample)


@pytest.mark.parametrize("mesh,shape,sample", [(*c, n) for c, n in zip(CASES, (None, None, 800), strict=True)],
                         ids=["2x4", "2x2x2", "2x2x2-rank3"])
def test_every_pair_reaches_the_destination_blocks(mesh, shape, sample):
    for src, dst in pairs(mesh, shape, sample):
        got = run_moves(plan(src, dst, mesh), src, mesh, shape)
        want = blocks(dst, mesh, shape)
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True)), (src, dst, plan(src, dst, mesh))


@pytest.mark.parametrize("mesh,shape,sample", [(*CASES[0], None), (*CASES[1], 600)], ids=["2x4", "2x2x2"])
def test_steps_price_what_each_device_sends(mesh, shape, sample):
    """Bytes per device as a fraction of the tensor, counted from the oracle's blocks: an all-to-all sends all but
    its own chunk of its block, an all-gather receives the k - 1 other blocks (the ring count the cost model and
    ``mshard.comm_report`` use)."""
    total = math.prod(shape)
    for src, dst in pairs(mesh, shape, sample):
        cur = blocks(src, mesh, shape)
        sent = 0.0
        for m in plan(src, dst, mesh):
            k = math.prod(mesh[a] for a in _axes(m))
            if m.kind == "all-to-all":
                sent += cur[0].size * (k - 1) / k / total
            elif m.kind == "all-gather":
                sent += cur[0].size * (k - 1) / total
            cur = step(cur, m, mesh)
        assert sum(s.moved for s in steps(src, dst, mesh)) == pytest.approx(sent, abs=1e-12), (src, dst)


def test_the_cost_model_takes_the_cheaper_of_xla_and_direct():
    """On a 2 x 2 x 2 mesh the direct steps beat XLA's on some pairs (an axis leaving a dim while another is added:
    XLA gathers the whole tensor) and lose on others (XLA permutes); the executor and the cost model take the
    cheaper, so the priced bytes never exceed XLA's."""
    mesh = (2, 2, 2)
    better = 0
    for src, dst in itertools.product(layouts(2, 3), repeat=2):
        xla = sum(s.moved for s in reshard(src, dst, mesh))
        best = sum(s.moved for s in best_steps(src, dst, mesh))
        assert best <= xla + 1e-12
        better += cheaper_than_xla(src, dst, mesh)
    assert better > 0
    # the pair of the module doc: the split of dim 0 moves to dim 1 beside a new axis. XLA: 2 all-gathers, 3/4 of
    # the tensor; direct: one all-to-all of half a quarter, 1/8
    src, dst = ((0,), (1,)), ((), (1, 0, 2))
    assert sum(s.moved for s in reshard(src, dst, mesh)) == 0.75
    assert sum(s.moved for s in best_steps(src, dst, mesh)) == 0.125


def test_a_whole_stack_moves_in_one_all_to_all():
    """Rows split by (0, 1) to columns split by (0, 1, 2): axis by axis, axis 0 cannot leave the rows before axis 1,
    which is gathered; XLA all-to-alls and permutes. As a stack: one all-to-all of (0, 1) over 4 devices, each
    sending 3/4 of its 1/4, then axis 2 sliced onto the columns: 3/16 of the tensor, less than XLA's. The way back
    gathers axis 2 first, then moves the stack (0, 1)."""
    mesh = (2, 2, 2)
    src, dst = ((0, 1), ()), ((), (0, 1, 2))
    assert [(m.kind, _axes(m)) for m in plan(src, dst, mesh)] == [("all-to-all", (0, 1)), ("slice", (2,))]
    assert sum(s.moved for s in steps(src, dst, mesh)) == pytest.approx(3 / 16)
    assert sum(s.moved for s in reshard(src, dst, mesh)) > 3 / 16
    assert [(m.kind, _axes(m)) for m in plan(dst, src, mesh)] == [("all-gather", (2,)), ("all-to-all", (0, 1))]
    for a, b in ((src, dst), (dst, src)):
        got = run_moves(plan(a, b, mesh), a, mesh, (8, 16))
        assert all(np.array_equal(g, w) for g, w in zip(got, blocks(b, mesh, (8, 16)), strict=True))


@pytest.mark.parametrize("mesh,shape,sample", [(*CASES[1], None), (*CASES[2], 3000)], ids=["2x2x2", "2x2x2-rank3"])
def test_every_step_splits_each_dim_by_a_prefix_of_its_source_or_destination(mesh, shape, sample):
    """Why a plan divides wherever its two layouts do, whatever the shape: after every move, each dim is split by
    a prefix of its source stack or of its destination stack. (A stack move that first sliced the destination's
    next axis onto the source dim broke this: the differential fuzzer's dim of 4 split 8 ways.)"""
    for src, dst in pairs(mesh, shape, sample):
        cur = [list(d) for d in src]
        for m in plan(src, dst, mesh):
            axes = _axes(m)
            if m.src_dim is not None:
                del cur[m.src_dim][-len(axes):]
            if m.dim is not None:
                cur[m.dim] += list(axes)
            for d, now in enumerate(cur):
                assert now in (list(src[d][:len(now)]), list(dst[d][:len(now)])), (src, dst, m, cur)
