"""ilp: an exact integer program over every op's strategies (Alpa; docs/algorithms.md §6) — the yardstick.

Variables: a binary ``x[v, s]`` per op ``v`` and candidate ``s`` (one per op: ``sum_s x[v, s] = 1``).
Objective: ``sum x[v, s] * cost_v[s]`` plus, per pair of adjacent ops ``(a, b)``, the
redistribution ``R_ab[s, t]`` of the chosen pair — linearised with Alpa's edge variables
``e[a, b, s, t]`` (``sum_t e = x[a, s]``, ``sum_s e = x[b, t]``). Two shrinks keep it small and
exact: candidates of an op whose rows (columns) of ``R`` are equal share one edge index
(strategies that give a tensor the same layout), and a matrix that depends on one side only
becomes a vector on that side; ops with one candidate (user strategies) are folded into their
neighbours (:mod:`searchers.pairwise_problem`). With ``elementwise_op_strategy_follow`` an elementwise
op shares its consumer's variables.

Memory: at every step (op, in program order) the live tensors, at the layout their producer
gives them, must fit in ``device_memory_capacity`` bytes per device (:mod:`searchers.memory`);
only steps that could exceed it get a row. A capacity no choice can meet raises ``ValueError``
before solving.

Solved with ``scipy.optimize.milp`` (HiGHS). ``time_limit`` seconds bound the whole search: where the exact
eliminations do not settle it, dynamic_programming's plan (the fallback) is computed first, its improvement passes
within a quarter of the time left, and HiGHS gets what is left. When HiGHS stops at the limit the better of its best
solution and dynamic_programming's is returned and a note gives the gap to the proven lower bound; when no solution
was found in time (or the program is too large to build, ``max_variables``), a note says so and the
dynamic_programming answer is returned instead (``fallback=False`` raises ``SearchLimitError``). Its progress lines
name the searcher that runs (``ilp (its fallback, dynamic_programming)``). A plan that exceeds the memory capacity is
refitted (:func:`~searchers.memory_fit.fit_memory`) outside that bound.

>>> from searchers.graph import DeviceMesh, Graph
>>> from searchers.cost import CostParams
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4,), fixed=((0,),))
>>> _ = g.add_op("neg", "neg", {"i": 4}, [x], [("i",)], [("i",)])
>>> r = ilp(g, CostParams())
>>> r.strategies, r.algorithm
({0: ((0,),), 1: ((0,),)}, 'ilp')
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from .baselines import no_worse_than_baselines
from .cache import cached_search
from .cost import CostParams, graph_cost
from .cost_vectors import candidate_tables
from .dynamic_programming import dynamic_programming, exact_choice, solve_problem
from .errors import SearchLimitError
from .graph import Graph
from .graph_index import GraphIndex
from .memory import death_steps, live_ranges
from .memory_fit import fit_memory, fits_memory
from .pairwise import PairwiseSolution, solve_pairwise
from .pairwise_problem import PairwiseProblem
from .progress import Progress
from .recursive_programming import recursive_programming
from .result import SearchResult
from .spec import op_spec

ALGORITHM = "ilp"

# -- memory rows ----------------------------------------------------------------------------------
def memory_rows(graph: Graph, prob: PairwiseProblem, capacity: float, index: dict[int, int], *,
                max_nonzeros: int | None = None) -> list[tuple[dict[int, np.ndarray], float]] | None:
    """Rows ``sum bytes <= capacity`` for the steps that could exceed ``capacity`` (see the module
    doc), over the live nodes numbered by ``index``. Raises ``ValueError`` when even the smallest
    layouts exceed it at some step; returns ``None`` when the rows would hold more than
    ``max_nonzeros`` coefficients."""
    n = len(graph.ops)
    if not n or not math.isfinite(capacity):
        return []
    mesh = graph.mesh
    first, last = live_ranges(graph)
    # per tensor: bytes per candidate of its producer, as (owner node, vector over owner's candidates)
    owner: dict[int, tuple[int, np.ndarray]] = {}
    const = np.zeros(n + 1)
    lo_d = np.zeros(n + 1)
    hi_d = np.zeros(n + 1)
    for op in graph.ops:
        if not op.outputs:
            continue
        spec = op_spec(op, graph)
        cands = prob.cands[op.id]
        t = candidate_tables(spec.in_maps, spec.out_maps, spec.reduction, cands, mesh)
        for j, tid in enumerate(op.outputs):
            vec = t.out_div[:, j] * graph.tensors[tid].nbytes
            f, l1 = first[tid], last[tid] + 1
            v = op.id
            if v in prob.decided:
                const[f] += vec[prob.decided[v]]
                const[l1] -= vec[prob.decided[v]]
                continue
            if v in prob.follows:
                while v in prob.follows:
                    lead, fmap = prob.follows[v]
                    vec = np.where(fmap >= 0, vec[np.maximum(fmap, 0)], 0.0)
                    v = lead
                if v in prob.decided:
                    const[f] += vec[prob.decided[v]]
                    const[l1] -= vec[prob.decided[v]]
                    continue
            owner[tid] = (v, vec)
            lo_d[f] += vec.min()
            lo_d[l1] -= vec.min()
            hi_d[f] += vec.max()
            hi_d[l1] -= vec.max()
    base = np.cumsum(const[:-1])
    low = base + np.cumsum(lo_d[:-1])
    high = base + np.cumsum(hi_d[:-1])
    worst = int(np.argmax(low))
    if low[worst] > capacity * (1 + 1e-12):
        raise SearchLimitError(
            f"ilp: no choice of strategies fits device_memory_capacity={capacity:,.0f} bytes per device: "
            f"at op {graph.ops[worst].name!r} (step {worst}) the live tensors need at least "
            f"{low[worst]:,.0f} bytes even at their smallest layouts. Raise device_memory_capacity "
            f"(set_cost_model_context), use more devices, or recompute activations.")
    out: list[tuple[dict[int, np.ndarray], float]] = []
    tids = np.array(sorted(owner), dtype=np.int64)
    if not len(tids):
        return out
    tf, tl = first[tids], last[tids]
    steps = [s for s in death_steps(graph).tolist() if high[s] > capacity]
    if max_nonzeros is not None and steps:
        sizes = np.array([len(prob.cands[owner[int(t)][0]]) for t in tids])
        starts = np.zeros(len(graph.ops) + 1)
        np.add.at(starts, tf, sizes)
        np.add.at(starts, tl + 1, -sizes)
        live_nnz = np.cumsum(starts[:-1])
        if float(live_nnz[steps].sum()) > max_nonzeros:
            return None
    for step in steps:
        coefs: dict[int, np.ndarray] = {}
        for tid in tids[(tf <= step) & (tl >= step)]:
            v, vec = owner[int(tid)]
            k = index[v]
            coefs[k] = coefs[k] + vec if k in coefs else vec
        out.append((coefs, capacity - float(base[step])))
    return out


# -- the searcher -----------------------------------------------------------------------------
@cached_search
def ilp(graph: Graph, params: CostParams, *, fully_use_devices: bool = False,
        elementwise_op_strategy_follow: bool = False, time_limit: float = 60.0,
        mip_rel_gap: float = 1e-9, memory_limit: bool = True, max_candidates: int | None = None,
        max_variables: int = 4_000_000, fallback: bool = True, eliminate: bool = True) -> SearchResult:
    """The optimal strategies of ``graph`` under the cost model and the memory limit (module doc).

    ``eliminate``: where no memory row is needed, first try exact eliminations and the integer program on the
    core they leave (:func:`~searchers.dynamic_programming.exact_choice`), the same optimum in far less time (the
    MiniGPT forward: 156 ops, 0.28 s against 7.7 s, bench/search_traced.py); the whole program is solved where
    that is not proven.

    ``time_limit`` (seconds) bounds the solver; ``memory_limit=False`` drops the memory rows;
    ``max_candidates`` keeps each op's first candidates (then it is exact only over those);
    a program with more than ``max_variables`` variables is not built (HiGHS would need many GB),
    which is handled like a time-out.
    """
    t0 = time.perf_counter()
    notes: list[str] = []
    dp_first: tuple[SearchResult | None, list[str]] | None = None
    with Progress(f"ilp: {len(graph)} ops", None) as bar:
        prob = PairwiseProblem.prepared(graph, params, notes, fully_use_devices=fully_use_devices,
                                max_candidates=max_candidates,
                                elementwise_op_strategy_follow=elementwise_op_strategy_follow)
        live = prob.live()
        index = {v: i for i, v in enumerate(live)}
        n_x = sum(len(prob.cands[v]) for v in live)
        rows = None
        if n_x <= max_variables:
            rows = (memory_rows(graph, prob, params.device_memory_capacity, index, max_nonzeros=max_variables)
                    if memory_limit else [])
        if rows is None:
            sol = PairwiseSolution(None, False, "too large", size={"nodes": len(live), "x": n_x, "e": 0})
        else:
            if rows:
                notes.append(f"memory: {len(rows)} step(s) could exceed device_memory_capacity="
                             f"{params.device_memory_capacity:,.0f} B and are constrained")
            left = max(0.01, time_limit - (time.perf_counter() - t0))
            # no memory row: exact eliminations leave a small core, and the integer program on it is the optimum
            found = exact_choice(prob, bar, left) if eliminate and not rows else None
            if found is not None:
                picked = [found[v] for v in live]
                sol = PairwiseSolution(picked, True, "optimal", prob.total(found), prob.total(found), 0.0,
                                       time.perf_counter() - t0, {"nodes": len(live), "x": n_x, "e": 0})
                notes.append("solved exactly by eliminations and an integer program on the core they leave")
            else:
                # the time limit bounds the whole search: dynamic_programming's plan (what ilp returns, or compares
                # its answer with, where HiGHS proves nothing) first, its improvement passes within a quarter of the
                # time left; HiGHS gets the rest
                left = time_limit - (time.perf_counter() - t0)
                dp_first = _dp_within_memory(graph, params, prob, max_candidates is None, fully_use_devices,
                                             elementwise_op_strategy_follow, memory_limit,
                                             improve_seconds=max(0.0, left / 4))
                pairs = prob.pair_list(index)
                left = time_limit - (time.perf_counter() - t0)
                if left <= 0:
                    sol = PairwiseSolution(None, False, "time limit", size={"nodes": len(live), "x": n_x,
                                                                            "e": len(pairs)})
                else:
                    bar.update(description=f"ilp: {len(live)} ops, {len(pairs)} pairs, {left:.3g} s of the time "
                                           f"limit {time_limit:g} s left")
                    sol = solve_pairwise([prob.unary[v] for v in live], pairs, time_limit=left,
                                         mip_rel_gap=mip_rel_gap, memory_rows=rows, max_variables=max_variables)
    if sol.status == "infeasible":
        raise SearchLimitError(f"ilp: no choice of strategies fits device_memory_capacity="
                         f"{params.device_memory_capacity:,.0f} bytes per device (the integer program is "
                         f"infeasible). Raise device_memory_capacity (set_cost_model_context) or use more devices.")
    if sol.choice is None:
        if sol.status == "too large":
            msg = (f"ilp: the integer program is too large to build ({sol.size['x']} strategy variables"
                   f"{'' if not sol.size['e'] else ' and ' + str(sol.size['e']) + ' edge variables'} > "
                   f"max_variables={max_variables}); use dynamic_programming")
        else:
            msg = (f"ilp: no solution found within time_limit={time_limit:g} s ({sol.size.get('x', 0)} strategy "
                   f"and {sol.size.get('e', 0)} edge variables); raise time_limit, or use dynamic_programming")
        if not fallback:
            raise SearchLimitError(msg)
        dp, fit_notes = dp_first or _dp_within_memory(graph, params, prob, max_candidates is None, fully_use_devices,
                                                      elementwise_op_strategy_follow, memory_limit)
        if dp is None:
            raise SearchLimitError(f"{msg}; {fit_notes[0]}. Raise device_memory_capacity "
                                   "(set_cost_model_context), use more devices, or recompute activations.")
        how = "the dynamic_programming plan with memory priced instead" if fit_notes else \
            "the dynamic_programming plan instead"
        return SearchResult(dp.strategies, dp.cost, ALGORITHM, time.perf_counter() - t0,
                            notes + [f"{msg}: returned {how}"] + (fit_notes or dp.notes))
    choice = prob.expand({v: sol.choice[i] for i, v in enumerate(live)})
    strategies = prob.strategies(choice)
    cost = graph_cost(graph, strategies, params)
    if not sol.optimal:
        notes.append(f"ilp stopped at time_limit={time_limit:g} s before proving optimality: the plan costs "
                     f"{sol.objective:.6g}, the lower bound is {sol.bound:.6g} (gap {100 * sol.gap:.3g}%)")
        # an unproven incumbent may be far from the optimum: never return a plan costlier than dynamic_programming's
        # the incumbent meets the memory rows: dynamic_programming's plan replaces it only where it fits too
        dp, fit_notes = dp_first or _dp_within_memory(graph, params, prob, max_candidates is None, fully_use_devices,
                                                      elementwise_op_strategy_follow, memory_limit)
        if dp is not None and fit_notes:
            dp = dataclasses.replace(dp, notes=fit_notes)
        if dp is not None and dp.cost.total < cost.total:
            notes.append(f"the dynamic_programming plan costs less ({dp.cost.total:.6g} against {cost.total:.6g}) "
                         "and is returned instead")
            strategies, cost = dp.strategies, dp.cost
            notes += dp.notes
    return no_worse_than_baselines(graph, params, SearchResult(strategies, cost, ALGORITHM, time.perf_counter() - t0,
                                                               notes), fully_use_devices=fully_use_devices,
                                   index=prob.index)


def _dp_within_memory(graph: Graph, params: CostParams, prob: PairwiseProblem, share: bool, fully_use_devices: bool,
                      follow: bool, memory_limit: bool, improve_seconds: float = 10.0
                      ) -> tuple[SearchResult | None, list[str]]:
    """What ilp returns or compares with where HiGHS gives no proven answer: dynamic_programming's plan (on ilp's own
    ``prob`` where ``share``), and where ilp enforces the capacity and that plan exceeds it (dynamic_programming
    ignores the capacity), the memory fit's plan instead; ``(plan or None where no plan fits, the fit's notes)``,
    the notes empty where dynamic_programming's plan is returned as it is."""
    dp = _dp_plan(graph, params, fully_use_devices, follow, prob if share else None, improve_seconds)
    if not memory_limit or fits_memory(graph, dp.strategies, params.device_memory_capacity, prob.index):
        return dp, []
    return _fit(graph, params, fully_use_devices, follow, dp, prob.index)


def _fit(graph: Graph, params: CostParams, fully_use_devices: bool, follow: bool,
         first: SearchResult, index: GraphIndex | None = None) -> tuple[SearchResult | None, list[str]]:
    """A plan with memory priced until it fits (:func:`~searchers.memory_fit.fit_memory`): the weight is searched
    with recursive_programming (0.2 s a search on a GPT-1.3B-shaped training graph of 2,678 ops, against 3-4 s for
    dynamic_programming), then dynamic_programming runs once at the weight found. ``first``: dynamic_programming's plan
    at the caller's weights, which does not fit."""
    return fit_memory(graph, params, lambda q: recursive_programming(graph, q, fully_use_devices=fully_use_devices,
                                                                     elementwise_op_strategy_follow=follow, cache=False),
                      refine=lambda q: _dp_plan(graph, q, fully_use_devices, follow), first=first, index=index)


def _dp_plan(graph: Graph, params: CostParams, fully_use_devices: bool, follow: bool,
             prob: PairwiseProblem | None = None, improve_seconds: float = 10.0) -> SearchResult:
    """dynamic_programming's plan, what ilp falls back to or compares with when HiGHS stops at its time limit;
    ``prob``: ilp's own prepared problem under ``params`` (its default candidates), where it has one."""
    if prob is None:
        return dynamic_programming(graph, params, fully_use_devices=fully_use_devices,
                                   elementwise_op_strategy_follow=follow, improve_seconds=improve_seconds, cache=False)
    # the problem's own note (elementwise_op_strategy_follow) is among ilp's notes already
    return solve_problem(graph, params, prob, [], time.perf_counter(), fully_use_devices=fully_use_devices,
                         improve_seconds=improve_seconds, label="ilp (its fallback, dynamic_programming)")
