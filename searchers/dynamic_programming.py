"""dynamic_programming: MindSpore's graph eliminations (docs/algorithms.md §4).

Every op lists its candidate strategies with a cost vector; every pair of adjacent ops gets a
redistribution cost matrix (:mod:`searchers.pairwise_problem`; parallel edges are summed — *edge
elimination*). Ops with one candidate (user strategies) are folded into their neighbours.
Then the graph is shrunk, each step recorded:

* *merge / contract* — an op with one neighbour is folded into the neighbour's cost vector,
  ``c'_j[b] = min_s R_vj[s, b] + c_v[s]`` (remembering the argmin);
* *op elimination* — an op with two neighbours ``h, j`` becomes the edge
  ``R'_hj[a, b] = min_s R_hv[a, s] + c_v[s] + R_vj[s, b]`` (argmin table kept); when ``h`` and
  ``j`` are already adjacent the new matrix is added to theirs (*triangle elimination*);
* an op left without neighbours takes its cheapest candidate.

These steps are exact. When none applies (every remaining op has three or more neighbours —
training graphs, whose forward and backward passes form a ladder, always leave such a core)
the remaining graph is solved exactly when it is small: by enumeration (``exact_limit``
combinations) or by the integer program of :mod:`searchers.ilp` on the reduced graph
(``core_ilp_limit`` candidate pairs, ``core_time_limit`` seconds; tried once, on the first
core). Otherwise
the documented fallback applies, *star elimination*: the op with the most neighbours (a star's
centre) is fixed to the candidate with the least cost against optimistic neighbours,
``c_v[s] + sum_u min_t (R_vu[s, t] + c_u[t])``; its edges become vectors on its neighbours and
the exact eliminations resume. The recorded steps are then replayed backwards to recover
every op's strategy.

A plan reached through star eliminations is exact *given* the star-eliminated ops' choices,
so it is improved by further passes (block coordinate descent): the same eliminations with the
star-eliminated ops held at the choices of a starting plan give a plan no worse than it. The
starting plans are the greedy pass, every op replicated, MindSpore's data-parallel default and
sharding_propagation's plan; the best result then seeds up to ``improve_passes`` passes that
prefer other star centres, so the ops held fixed before are optimised too. Last, iterated
local improvement (each op re-chosen against its neighbours' choices) polishes the plan. The
notes say when the plan came through star elimination (it is then not guaranteed optimal).
The plan is no worse than sharding_propagation's whenever that plan's strategies are candidates here
and its pass runs within ``improve_seconds``.

Repeated layers: every vector and matrix carries a content key (equal keys, equal arrays);
elimination results are memoised on the keys of their inputs, so the eliminations of the
second and later copies of a layer are dictionary lookups (a 24-layer model costs about one
layer of arithmetic plus bookkeeping).

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4, 6), fixed=((), (0,)))
>>> (y,) = g.add_op("exp", "exp", {"i": 4, "j": 6}, [x], [("i", "j")], [("i", "j")])
>>> _ = g.add_op("neg", "neg", {"i": 4, "j": 6}, [y], [("i", "j")], [("i", "j")])
>>> dynamic_programming(g, CostParams()).strategies
{0: ((), (0,)), 1: ((), (0,)), 2: ((), (0,))}
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .baselines import no_worse_than_baselines
from .cache import cached_search
from .cost import CostParams, graph_cost
from .graph import Graph, Strategy
from .graph_index import GraphIndex
from .memory import peak_memory
from .pairwise import solve_pairwise
from .pairwise_problem import PairwiseProblem
from .progress import Progress
from .result import SearchResult
from .spread import propagate
from .strategies import data_parallel_strategy

ALGORITHM = "dynamic_programming"

_BLOCK = 1 << 20          # floats per block of the op-elimination minimum


def _series(mh: np.ndarray, c: np.ndarray, mj: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``N[a, b] = min_s mh[s, a] + c[s] + mj[s, b]`` and its argmin (first on ties)."""
    S, A = mh.shape
    B = mj.shape[1]
    left = mh + c[:, None]
    step = max(1, _BLOCK // max(1, A * B))
    best = arg = None
    for s0 in range(0, S, step):
        t = left[s0:s0 + step, :, None] + mj[s0:s0 + step, None, :]
        k = t.argmin(axis=0)
        v = np.take_along_axis(t, k[None], axis=0)[0]
        if best is None:
            best, arg = v, k + s0
        else:
            better = v < best
            best = np.where(better, v, best)
            arg = np.where(better, k + s0, arg)
    assert best is not None and arg is not None
    return best, arg.astype(np.int32)


class _Eliminator:
    """Runs the eliminations on a :class:`~searchers.pairwise_problem.PairwiseProblem` (mutating it).

    ``values``: when given, star elimination fixes an op to its value there instead of the
    greedy choice, and prefers ops outside ``taboo`` (see :func:`dynamic_programming`)."""

    def __init__(self, prob: PairwiseProblem, bar: Progress, memo: dict[int, tuple], *,
                 values: dict[int, int] | None = None, taboo: frozenset[int] = frozenset()):
        self.p, self.bar, self.memo = prob, bar, memo
        self.values, self.taboo = values, taboo
        self.records: list[tuple] = []
        self.small: list[int] = []                 # heap of nodes that may have <= 2 neighbours
        self.big: list[tuple[bool, int, int]] = []  # heap of (taboo, -degree, node) for star elimination
        self.fixed_approx: list[int] = []
        self.hits = self.misses = 0

    def push(self, v: int) -> None:
        d = len(self.p.adj[v])
        if d <= 2:
            heapq.heappush(self.small, v)
        else:
            heapq.heappush(self.big, (v in self.taboo, -d, v))

    def drain(self) -> None:
        """Apply exact eliminations until every live node has three or more neighbours."""
        p, small = self.p, self.small
        while small:
            v = heapq.heappop(small)
            if not p.alive[v]:
                continue
            nb = p.adj[v]
            d = len(nb)
            if d > 2:
                continue
            if d == 0:
                self.records.append((0, v, int(np.argmin(p.unary[v]))))
            elif d == 1:
                ((u, i),) = nb.items()
                self._leaf(v, u, i)
                self.push(u)
            else:
                (h, ih), (j, ij) = nb.items()
                self._series(v, h, ih, j, ij)
                self.push(h)
                self.push(j)
            p.alive[v] = False
            self.bar.advance()

    def _leaf(self, v: int, u: int, i: int) -> None:
        p, keys = self.p, self.p.keys
        m, mk = p.oriented(i, v)                 # v x u
        key = keys(("leaf", mk, p.ukey[v]))
        got = self.memo.get(key)
        if got is None:
            self.misses += 1
            t = m + p.unary[v][:, None]
            arg = t.argmin(axis=0).astype(np.int32)
            got = self.memo[key] = (t[arg, np.arange(t.shape[1])], arg)
        else:
            self.hits += 1
        p.remove_pair(i)
        p.add_unary(u, got[0], key)
        self.records.append((1, v, u, got[1]))

    def _series(self, v: int, h: int, ih: int, j: int, ij: int) -> None:
        p, keys = self.p, self.p.keys
        mh, kh = p.oriented(ih, v)               # v x h
        mj, kj = p.oriented(ij, v)               # v x j
        key = keys(("series", kh, p.ukey[v], kj))
        got = self.memo.get(key)
        if got is None:
            self.misses += 1
            got = self.memo[key] = _series(mh, p.unary[v], mj)
        else:
            self.hits += 1
        p.remove_pair(ih)
        p.remove_pair(ij)
        p.add_pair(h, j, got[0], key)
        self.records.append((2, v, h, j, got[1]))

    def star(self) -> bool:
        """Fix the live node with the most neighbours (see the module doc); False if none is left."""
        p, big = self.p, self.big
        while big:
            _, negd, v = heapq.heappop(big)
            if p.alive[v] and len(p.adj[v]) == -negd:
                break
        else:
            return False
        if self.values is not None:
            choice = self.values[v]
        else:
            score = p.unary[v].copy()
            for u, i in p.adj[v].items():
                m, _ = p.oriented(i, v)
                score += (m + p.unary[u][None, :]).min(axis=1)
            choice = int(np.argmin(score))
        nbrs = list(p.adj[v])
        p.fix(v, choice)
        self.fixed_approx.append(v)
        for u in nbrs:
            self.push(u)
        self.bar.advance()
        return True

    def replay(self, choice: dict[int, int]) -> dict[int, int]:
        for rec in reversed(self.records):
            kind, v = rec[0], rec[1]
            if kind == 0:
                choice[v] = rec[2]
            elif kind == 1:
                choice[v] = int(rec[3][choice[rec[2]]])
            else:
                choice[v] = int(rec[4][choice[rec[2]], choice[rec[3]]])
        return choice


@dataclass
class _Pass:
    choice: dict[int, int]
    fixed: list[int]
    notes: list[str]
    hits: int
    misses: int


def _one_pass(base: PairwiseProblem, memo: dict[int, tuple], bar: Progress, *, values: dict[int, int] | None,
              taboo: frozenset[int], exact_limit: int, core_ilp_limit: int, core_time_limit: float) -> _Pass:
    """Eliminate everything on a copy of ``base`` and replay: a choice for every live node of ``base``."""
    prob = base.normalised()
    notes: list[str] = []
    el = _Eliminator(prob, bar, memo, values=values, taboo=taboo)
    for v in prob.live():
        el.push(v)
    core_choice: dict[int, int] = {}
    tried_ilp = False
    while True:
        el.drain()
        if not el.big:
            break
        small_core = prob.cells <= core_ilp_limit
        if small_core or prob.cells <= exact_limit:
            core = prob.live()
            if not core:
                break
            if math.prod(len(prob.cands[v]) for v in core) <= exact_limit:
                core_choice = _enumerate(prob, core)
                break
        if not tried_ilp and core_time_limit > 0 and small_core and not el.fixed_approx:
            tried_ilp = True
            pairs = prob.pair_list({v: k for k, v in enumerate(core)})
            bar.update(description=f"dynamic_programming: integer program on a core of {len(core)} ops")
            sol = solve_pairwise([prob.unary[v] for v in core], pairs, time_limit=core_time_limit)
            if sol.choice is not None and sol.optimal:
                core_choice = {v: sol.choice[k] for k, v in enumerate(core)}
                break
            notes.append(f"a core of {len(core)} ops was not solved to optimality by the integer program within "
                         f"{core_time_limit:g} s; star elimination decides the rest")
        if not el.star():
            break
    choice = el.replay({v: prob.decided[v] for v in prob.decided if v not in base.decided} | core_choice)
    return _Pass(choice, el.fixed_approx, notes, el.hits, el.misses)


def exact_choice(prob: PairwiseProblem, bar: Progress, time_limit: float) -> dict[int, int] | None:
    """The optimal choice for every live node of ``prob``, by exact eliminations and an integer program (within
    ``time_limit`` s) on the core they leave; ``None`` where that is not proven (the integer program ran out of
    time, and star elimination, which is not exact, would decide the rest). Eliminating a leaf or a chain node is
    exact for a pairwise problem, so the answer is the whole problem's optimum: :mod:`searchers.ilp`'s fast path
    where no memory row couples every op."""
    p = _one_pass(prob, {}, bar, values=None, taboo=frozenset(), exact_limit=200_000, core_ilp_limit=1 << 62,
                  core_time_limit=max(0.01, time_limit))
    return None if p.fixed or p.notes else p.choice


def _enumerate(prob: PairwiseProblem, nodes: list[int]) -> dict[int, int]:
    """Exact minimum over the live ``nodes`` by enumeration (chunked, vectorised)."""
    sizes = tuple(len(prob.cands[v]) for v in nodes)
    pairs = prob.pair_list({v: k for k, v in enumerate(nodes)})
    total = math.prod(sizes)
    best_val, best_flat = math.inf, 0
    for start in range(0, total, 1 << 16):
        flat = np.arange(start, min(total, start + (1 << 16)))
        ch = np.unravel_index(flat, sizes)
        val = np.zeros(len(flat))
        for k, v in enumerate(nodes):
            val += prob.unary[v][ch[k]]
        for a, b, m in pairs:
            val += m[ch[a], ch[b]]
        j = int(np.argmin(val))
        if val[j] < best_val:
            best_val, best_flat = float(val[j]), int(flat[j])
    pick = np.unravel_index(best_flat, sizes)
    return {v: int(pick[k]) for k, v in enumerate(nodes)}


def _polish(prob: PairwiseProblem, nodes: list[int], choice: dict[int, int], sweeps: int = 8) -> int:
    """Iterated conditional modes on ``prob`` (not yet eliminated): re-choose each node against its
    neighbours' choices until no node improves (at most ``sweeps`` rounds); returns the changes."""
    changed = 0
    for _ in range(sweeps):
        moved = 0
        for v in nodes:
            cost = prob.unary[v].copy()
            for u, i in prob.adj[v].items():
                m = prob.mat[i]
                cost += m[:, choice[u]] if prob.lo[i] == v else m[choice[u], :]  # type: ignore[index]
            best = int(np.argmin(cost))
            if cost[best] < cost[choice[v]] - 1e-12 * abs(cost[choice[v]]):
                choice[v] = best
                moved += 1
        changed += moved
        if not moved:
            break
    return changed


def _seeds(graph: Graph, params: CostParams, prob: PairwiseProblem, live: list[int], fully: bool,
           max_candidates: int | None) -> Iterator[tuple[str, dict[int, int]]]:
    """Starting plans for the passes after a star elimination: every op replicated (or its first
    candidate), MindSpore's data-parallel default, and the propagation's plan (:func:`searchers.spread.propagate`
    through every op: sharding_propagation's walk without its derived ops' search, which is this one)."""

    index: dict[int, dict[Strategy, int]] = {}

    def pick(v: int, s: Strategy) -> int:
        cands = prob.cands[v]
        d = index.get(id(cands))
        if d is None:
            d = index[id(cands)] = {c: i for i, c in enumerate(cands)}
        return d.get(tuple(tuple(a) for a in s), 0)

    yield "replicated", {v: 0 for v in live}
    yield "data parallel", {v: pick(v, data_parallel_strategy(graph.ops[v], graph.mesh)) for v in live}
    sp = propagate(graph, params, max_candidates, GraphIndex(graph)).strategies
    yield "sharding_propagation", {v: pick(v, sp[v]) for v in live}


@cached_search
def dynamic_programming(graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
                        elementwise_op_strategy_follow: bool = False, max_candidates: int | None = None,
                        exact_limit: int = 200_000, core_ilp_limit: int = 200_000,
                        core_time_limit: float = 1.0, improve_passes: int = 12,
                        improve_seconds: float = 10.0, polish: bool = True) -> SearchResult:
    """Strategies for every op of ``graph`` by graph eliminations (see the module doc).

    ``exact_limit``: the most candidate combinations a remaining core is enumerated over;
    ``core_ilp_limit``: the most candidate pairs (edge variables before compression) for which a
    core is handed to the integer program, with ``core_time_limit`` seconds (0: never);
    ``improve_passes``: the most improvement passes after a star elimination, within
    ``improve_seconds`` for the starting plans and passes together (a pass that would start later
    is skipped, so the result depends on the machine only for large graphs); ``polish``:
    local improvement at the end. ``max_candidates`` keeps each op's first candidates.
    """
    t0 = time.perf_counter()
    notes: list[str] = []
    prob = PairwiseProblem.prepared(graph, params, notes, fully_use_devices=fully_use_devices,
                            max_candidates=max_candidates,
                            elementwise_op_strategy_follow=elementwise_op_strategy_follow)
    return solve_problem(graph, params, prob, notes, t0, fully_use_devices=fully_use_devices,
                         max_candidates=max_candidates, exact_limit=exact_limit, core_ilp_limit=core_ilp_limit,
                         core_time_limit=core_time_limit, improve_passes=improve_passes,
                         improve_seconds=improve_seconds, polish=polish)


def solve_problem(graph: Graph, params: CostParams, prob: PairwiseProblem, notes: list[str], t0: float, *,
                  fully_use_devices: bool = False, max_candidates: int | None = None, exact_limit: int = 200_000,
                  core_ilp_limit: int = 200_000, core_time_limit: float = 1.0, improve_passes: int = 12,
                  improve_seconds: float = 10.0, polish: bool = True, label: str = ALGORITHM) -> SearchResult:
    """:func:`dynamic_programming` on ``prob``, the graph's ``PairwiseProblem.prepared`` problem under
    ``params`` and the same options (not modified: every pass works on a copy). ilp hands over the problem it has
    already built, one representation for both exact searchers. ``notes`` and ``t0``: the search's so far; ``label``:
    the searcher its progress lines name (ilp's fallback says so)."""
    live = prob.live()
    memo: dict[int, tuple] = {}
    kw: dict[str, Any] = {"exact_limit": exact_limit, "core_ilp_limit": core_ilp_limit,
                          "core_time_limit": core_time_limit}
    later = dict(kw, core_time_limit=0.0)         # the integer program is tried in the first pass only
    with Progress(f"{label}: {len(graph)} ops", len(live)) as bar:
        first = _one_pass(prob, memo, bar, values=None, taboo=frozenset(), **kw)
        notes.extend(first.notes)
        choice, hits, misses = first.choice, first.hits, first.misses
        approx = len(first.fixed)
        if approx:
            notes.append(f"star elimination (the fallback for graphs the exact eliminations cannot reduce) "
                         f"decided {approx} op(s): the plan is not guaranteed optimal")
            best = prob.total(choice)
            taboo = frozenset(first.fixed)
            passes, origin = 0, "greedy star choices"
            start = time.perf_counter()
            for name, seed in _seeds(graph, params, prob, live, fully_use_devices, max_candidates):
                if time.perf_counter() - start > improve_seconds:
                    break
                bar.update(completed=0, description=f"{label}: pass from {name}")
                nxt = _one_pass(prob, memo, bar, values=seed, taboo=frozenset(), **later)
                passes += 1
                hits, misses = hits + nxt.hits, misses + nxt.misses
                cost = prob.total(nxt.choice)
                if cost < best * (1 - 1e-12):
                    choice, best, origin = nxt.choice, cost, name
                taboo |= frozenset(nxt.fixed)
            for k in range(improve_passes):
                if time.perf_counter() - start > improve_seconds:
                    notes.append(f"improvement passes stopped after improve_seconds={improve_seconds:g} s")
                    break
                bar.update(completed=0, description=f"{label}: improvement pass {k + 1}")
                nxt = _one_pass(prob, memo, bar, values=choice, taboo=taboo, **later)
                passes += 1
                hits, misses = hits + nxt.hits, misses + nxt.misses
                cost = prob.total(nxt.choice)
                improved = cost < best * (1 - 1e-12)
                if improved:
                    choice, best = nxt.choice, cost
                if not improved and set(nxt.fixed) <= taboo:
                    break
                taboo |= frozenset(nxt.fixed)
            notes.append(f"best start: {origin}; {passes} further pass(es) of exact eliminations with the "
                         f"star-eliminated ops held at a plan's choices")
            if polish:
                moved = _polish(prob, live, choice)
                if moved:
                    notes.append(f"local improvement changed {moved} op choice(s)")
    choice = prob.expand(choice)
    strategies = prob.strategies(choice)
    predicted = graph_cost(graph, strategies, params)
    peak, step = peak_memory(graph, strategies)
    if peak > params.device_memory_capacity:
        notes.append(f"the plan's peak memory {peak:,.0f} B per device (at op {graph.ops[step].name!r}) exceeds "
                     f"device_memory_capacity={params.device_memory_capacity:,.0f} B; search_mode='ilp' enforces it")
    if hits:
        notes.append(f"repeated structure: {hits} of {hits + misses} eliminations reused an earlier identical one")
    return no_worse_than_baselines(graph, params, SearchResult(strategies, predicted, ALGORITHM,
                                                               time.perf_counter() - t0, notes),
                                   fully_use_devices=fully_use_devices, index=prob.index)
