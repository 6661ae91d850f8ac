"""Pipeline schedules (issue 15): the tick tables obey the data dependencies, run every operation once, keep the
in-flight bound of their kind, and have the textbook bubble: (S-1)/(M+S-1) for gpipe and 1f1b (Huang et al.
2019; Narayanan et al. 2021 for PipeDream-flush) and (S-1)/(v*M+S-1) interleaved (Narayanan et al. 2021, sec.
2.2.2). The formulas are the independent reference; the tables are made by simulation."""

import itertools

import pytest

from mshard._src.training.pipeline.run import ring_size
from mshard._src.training.pipeline.schedule import BWD, FWD, bubble_formula, make_schedule
from mshard.errors import PipelineError

CASES = [(name, S, M, v) for name in ("gpipe", "1f1b") for S in (2, 4) for M in (4, 8, 16) for v in (1,)] + \
        [("interleaved", S, M, v) for S in (2, 4) for M in (4, 8, 16) for v in (2, 3)]


@pytest.mark.parametrize("name,S,M,v", CASES)
def test_bubble_equals_the_formula_and_dependencies_hold(name, S, M, v):
    sched = make_schedule(name, stages=S, micro=M, chunks=v)
    assert sched.bubble() == pytest.approx(bubble_formula(name, S, M, v), abs=1e-12)
    when = sched.when()
    V = S * v
    assert len(when) == 2 * M * V            # every forward and backward of every chunk, once
    for i, vs in itertools.product(range(M), range(V)):
        if vs > 0:
            assert when[(FWD, i, vs - 1)] < when[(FWD, i, vs)]
        if vs < V - 1:
            assert when[(BWD, i, vs + 1)] < when[(BWD, i, vs)]
        else:
            assert when[(FWD, i, vs)] < when[(BWD, i, vs)]


@pytest.mark.parametrize("S,M", [(2, 4), (2, 16), (4, 4), (4, 16)])
def test_in_flight_bounds(S, M):
    # 1F1B keeps at most S - s micro-batches between forward and backward on stage s; GPipe keeps all M
    assert make_schedule("1f1b", stages=S, micro=M).in_flight() == [S - s for s in range(S)]
    assert make_schedule("gpipe", stages=S, micro=M).in_flight() == [M] * S
    # the executor's input ring follows: flat in M for 1f1b, M for gpipe
    assert ring_size(make_schedule("1f1b", stages=S, micro=M)) <= S
    assert ring_size(make_schedule("gpipe", stages=S, micro=M)) == M


def test_interleaved_needs_whole_groups():
    with pytest.raises(PipelineError, match="multiple of pipeline_stages"):
        make_schedule("interleaved", stages=4, micro=6, chunks=2)
    assert issubclass(PipelineError, ValueError)


def test_balance_is_optimal_against_every_cut():
    """The stage helper's partition has the smallest largest stage of all contiguous partitions (brute force)."""
    import random

    from mshard._src.training.pipeline.balance import balance
    rng = random.Random(0)
    for _ in range(200):
        n, S = rng.randint(2, 9), rng.randint(1, 4)
        if n < S:
            continue
        costs = [rng.choice([1, 2, 3, 5, 8, 13]) * rng.random() for _ in range(n)]
        got = balance(costs, S)
        assert got == sorted(got) and set(got) == set(range(S))          # contiguous, every stage used
        worst = max(sum(c for c, s in zip(costs, got, strict=True) if s == k) for k in range(S))
        best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (n,), strict=True))
                   for cuts in itertools.combinations(range(1, n), S - 1))
        assert worst == pytest.approx(best, rel=1e-12)
