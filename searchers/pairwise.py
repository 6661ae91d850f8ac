"""The exact pairwise problem under every exact searcher: choose one candidate per node to minimise the sum of
unary costs and pairwise (edge) costs, as a mixed-integer program (``scipy.optimize.milp``, HiGHS).

:func:`solve_pairwise` is what :mod:`searchers.ilp` solves for the whole graph and
:mod:`searchers.dynamic_programming` for the core its eliminations leave; it lives here so neither searcher
imports the other for it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import sparse
from scipy.optimize import LinearConstraint, milp

_STATUS = {0: "optimal", 1: "stopped at the time limit", 2: "infeasible", 3: "unbounded", 4: "failed"}


@dataclass
class PairwiseSolution:
    """The answer of :func:`solve_pairwise`: a candidate per node (``None`` when none was found),
    whether it is proven optimal, the objective, the lower bound and their relative gap."""

    choice: list[int] | None
    optimal: bool
    status: str
    objective: float = math.nan
    bound: float = math.nan
    gap: float = math.nan
    seconds: float = 0.0
    size: dict[str, int] = field(default_factory=dict)


def _groups(m: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(representative index per group, group of every row (axis 0) or column (axis 1))."""
    a = m if axis == 0 else m.T
    _, first, inv = np.unique(a, axis=0, return_index=True, return_inverse=True)
    return first, inv.reshape(-1)


def solve_pairwise(unary: Sequence[np.ndarray], pairs: Sequence[tuple[int, int, np.ndarray]], *,
                   time_limit: float = 60.0, mip_rel_gap: float = 1e-9,
                   memory_rows: Sequence[tuple[dict[int, np.ndarray], float]] = (),
                   max_variables: int | None = None) -> PairwiseSolution:
    """Minimise ``sum_v unary[v][c_v] + sum_(a,b,R) R[c_a, c_b]`` over one candidate ``c_v`` per node.

    ``pairs`` are ``(a, b, R)`` with ``R`` of shape ``(len(unary[a]), len(unary[b]))``; entries may
    be ``inf`` (forbidden). ``memory_rows``: ``({node: bytes per candidate}, capacity)`` rows,
    each ``sum_v bytes_v[c_v] <= capacity``. With more than ``max_variables`` variables after the
    shrinks the program is not built: the answer has no choice and status ``"too large"``.

    >>> sol = solve_pairwise([np.array([1.0, 0.0]), np.array([0.0, 1.0])],
    ...                      [(0, 1, np.array([[0.0, 5.0], [5.0, 0.0]]))])
    >>> sol.choice, sol.optimal, round(sol.objective, 9)
    ([0, 0], True, 1.0)
    """
    t0 = time.perf_counter()
    n = len(unary)
    if n == 0:
        return PairwiseSolution([], True, "optimal", 0.0, 0.0, 0.0, 0.0)
    n_x = sum(len(u) for u in unary)
    if max_variables is not None and n_x > max_variables:        # before any work on the pairs
        return PairwiseSolution(None, False, "too large", seconds=time.perf_counter() - t0,
                                size={"nodes": n, "x": n_x, "e": 0})
    uvec = [np.array(u, dtype=float) for u in unary]
    const = 0.0
    # pairs: compress equal rows/columns; one-sided matrices become vectors
    edges = []
    for a, b, m in pairs:
        ra, ga = _groups(m, 0)
        rb, gb = _groups(m, 1)
        r = m[np.ix_(ra, rb)]
        if len(ra) == 1 or len(rb) == 1:
            if len(ra) == 1 and len(rb) == 1:
                const += float(r[0, 0])
            elif len(ra) == 1:
                uvec[b] = uvec[b] + r[0, gb]
            else:
                uvec[a] = uvec[a] + r[ga, 0]
            continue
        edges.append((a, b, ga, gb, r))
    offs = np.zeros(n + 1, dtype=np.int64)
    offs[1:] = np.cumsum([len(u) for u in uvec])
    nx = int(offs[-1])
    n_e = sum(int(np.isfinite(e[4]).sum()) for e in edges)
    if max_variables is not None and nx + n_e > max_variables:
        return PairwiseSolution(None, False, "too large", seconds=time.perf_counter() - t0,
                                size={"nodes": n, "x": nx, "e": n_e})
    scale_ref = sum(float(np.min(u[np.isfinite(u)])) if np.isfinite(u).any() else 0.0 for u in uvec)
    cost_parts = [np.where(np.isfinite(u), u, 0.0) for u in uvec]
    ub_parts = [np.where(np.isfinite(u), 1.0, 0.0) for u in uvec]
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    lo: list[float] = []
    hi: list[float] = []
    nrow = 0
    # one candidate per node
    for v in range(n):
        k = len(uvec[v])
        rows.append(np.full(k, nrow))
        cols.append(np.arange(offs[v], offs[v + 1]))
        vals.append(np.ones(k))
        lo.append(1.0)
        hi.append(1.0)
        nrow += 1
    ne = 0
    e_costs = []
    for a, b, ga, gb, r in edges:
        ok = np.isfinite(r)
        ia, ib = np.nonzero(ok)
        ids = nx + ne + np.arange(len(ia))
        ne += len(ia)
        e_costs.append(r[ia, ib])
        scale_ref += float(np.min(r[ok])) if ok.any() else 0.0
        A, B = r.shape
        # sum_t e[g, t] - sum_{s in g} x[a, s] = 0 for every row group g; the same for columns
        for side, node, grp, eidx in ((0, a, ga, ia), (1, b, gb, ib)):
            G = A if side == 0 else B
            rows.append(nrow + eidx)
            cols.append(ids)
            vals.append(np.ones(len(ids)))
            rows.append(nrow + grp)
            cols.append(offs[node] + np.arange(len(grp)))
            vals.append(-np.ones(len(grp)))
            lo.extend([0.0] * G)
            hi.extend([0.0] * G)
            nrow += G
    for coefs, cap in memory_rows:
        for v, byts in coefs.items():
            nz = np.nonzero(byts)[0]
            rows.append(np.full(len(nz), nrow))
            cols.append(offs[v] + nz)
            vals.append(np.asarray(byts, dtype=float)[nz])
        lo.append(-np.inf)
        hi.append(float(cap))
        nrow += 1
    nvar = nx + ne
    c = np.concatenate(cost_parts + e_costs) if nvar else np.zeros(0)
    scale = 1000.0 / scale_ref if scale_ref > 0 else (1000.0 / max(np.abs(c).max(), 1e-300) if nvar and
                                                       np.abs(c).max() > 0 else 1.0)
    ub = np.concatenate(ub_parts + [np.ones(ne)])
    integrality = np.concatenate([np.ones(nx), np.zeros(ne)])   # e is integral once x is
    A_ = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(nrow, nvar))
    size = {"nodes": n, "x": nx, "e": ne, "rows": nrow, "nonzeros": int(A_.nnz)}
    res = milp(c * scale, integrality=integrality, bounds=(np.zeros(nvar), ub),
               constraints=LinearConstraint(A_, np.array(lo), np.array(hi)),
               options={"time_limit": max(0.01, float(time_limit)), "mip_rel_gap": mip_rel_gap,
                        "disp": False})
    secs = time.perf_counter() - t0
    status = _STATUS.get(res.status, "failed")
    if res.x is None:
        return PairwiseSolution(None, False, status, seconds=secs, size=size)
    x = res.x
    choice = [int(np.argmax(x[offs[v]:offs[v + 1]])) for v in range(n)]
    obj = float(float(res.fun) / scale + const)
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(bound) / scale + const if bound is not None and np.isfinite(bound) else math.nan
    gap = float(getattr(res, "mip_gap", math.nan) or 0.0) if res.status != 0 else 0.0
    return PairwiseSolution(choice, res.status == 0, status, obj, bound, gap, secs, size)
