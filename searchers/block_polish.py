"""Exact re-choice of small trees of ops: a local search a greedy searcher finishes with.

A greedy searcher (recursive_programming) decides op by op; where the optimum needs several
neighbouring ops to change together (a chain that should stay replicated rather than split
and gathered at its end, say), no single-op move improves the plan. This module takes a
*block*: an induced tree of up to ``block_size`` movable ops grown breadth-first from a seed
(each op added has exactly one neighbour already in the block, so the block's edges form a
tree), holds everything outside it at its current choice, and solves the block exactly by
dynamic programming on the tree (min-sum messages from the leaves to the seed, then back). A
block moves only when that lowers its cost, so the plan's total never rises.

The caller supplies a :class:`BlockView` over its own state; costs are numpy vectors over an
op's choices, and pairwise costs matrices over two ops' choices.

>>> import numpy as np
>>> class Chain:                        # a - b - c, two choices each; a and c prefer 1, b prefers 0
...     nb = {0: [1], 1: [0, 2], 2: [1]}
...     own = {0: np.array([1.0, 0.0]), 1: np.array([0.0, 0.5]), 2: np.array([1.0, 0.0])}
...     cur = {0: 0, 1: 0, 2: 0}
...     def neighbours(self, v): return self.nb[v]
...     def movable(self, v): return True
...     def unary(self, v, inside): return self.own[v]
...     def pair(self, a, b): return np.array([[0.0, 1.0], [1.0, 0.0]])   # a mismatch costs 1
...     def current(self, v): return self.cur[v]
...     def choose(self, v, i): self.cur[v] = i
>>> view = Chain()
>>> polish_blocks(view, [1], block_size=3), view.cur           # all three switch together
(1, {0: 1, 1: 1, 2: 1})
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

_REL_TIE = 1e-9


class BlockView(Protocol):
    """What :func:`polish_blocks` needs to see of a searcher's state."""

    def neighbours(self, v: int) -> Sequence[int]:
        """The ops sharing an edge with ``v`` (repeats allowed)."""

    def movable(self, v: int) -> bool:
        """Whether ``v``'s choice may change (not a user strategy, not folded away)."""

    def unary(self, v: int, inside: set[int]) -> np.ndarray:
        """``v``'s own cost per choice plus its edges to every op not in ``inside``, at their current choices."""

    def pair(self, a: int, b: int) -> np.ndarray:
        """``M[i, j]``: the cost of all edges between ``a`` at choice ``i`` and ``b`` at choice ``j``."""

    def current(self, v: int) -> int | None:
        """``v``'s current choice index, or None if it is not among its choices."""

    def choose(self, v: int, i: int) -> None:
        """Set ``v``'s choice."""


def tree_block(view: BlockView, seed: int, limit: int) -> list[tuple[int, int]]:
    """An induced tree of movable ops grown breadth-first from ``seed``: ``(op, parent)`` pairs,
    the seed first with parent -1."""
    block = {seed}
    out = [(seed, -1)]
    i = 0
    while i < len(out) and len(out) < limit:
        v = out[i][0]
        i += 1
        for u in view.neighbours(v):
            if u in block or not view.movable(u):
                continue
            if sum(1 for w in set(view.neighbours(u)) if w in block) != 1:
                continue                            # a second link into the block would close a cycle
            block.add(u)
            out.append((u, v))
            if len(out) >= limit:
                break
    return out


def solve_block(view: BlockView, nodes: list[tuple[int, int]]) -> bool:
    """Give the tree block ``nodes`` its exact best choices against its surroundings; True when
    that is cheaper than the current choices (which are then replaced)."""
    inside = {v for v, _ in nodes}
    unary = {v: view.unary(v, inside) for v, _ in nodes}
    acc = dict(unary)
    pick: dict[int, np.ndarray] = {}
    mats: dict[int, np.ndarray] = {}
    for v, par in reversed(nodes[1:]):               # leaves first: min-sum message to the parent
        M = mats[v] = view.pair(v, par)
        tot = acc[v][:, None] + M
        pick[v] = np.argmin(tot, axis=0)
        acc[par] = acc[par] + tot.min(axis=0)
    root = nodes[0][0]
    choice = {root: int(np.argmin(acc[root]))}
    for v, par in nodes[1:]:
        choice[v] = int(pick[v][choice[par]])
    now = {v: view.current(v) for v, _ in nodes}
    if any(c is None for c in now.values()):
        cur = np.inf
    else:
        cur = float(sum(unary[v][now[v]] for v, _ in nodes)
                    + sum(mats[v][now[v], now[p]] for v, p in nodes[1:]))   # type: ignore[index]
    best = float(acc[root][choice[root]])
    if not best < cur - _REL_TIE * abs(cur):
        return False
    for v, _ in nodes:
        if choice[v] != now[v]:
            view.choose(v, choice[v])
    return True


def polish_blocks(view: BlockView, seeds: Iterable[int], block_size: int, memo: dict | None = None) -> int:
    """Solve the block grown from each seed in turn; the number of blocks that moved.

    With ``memo`` and a view that has ``block_key(nodes)`` (a hashable description of
    everything the block's problem depends on: its ops' structures, current choices and
    surroundings), a block equal to one solved before takes that answer without solving:
    repeated layers cost one solve."""
    keyf = getattr(view, "block_key", None) if memo is not None else None
    moved = 0
    for v in seeds:
        if not view.movable(v):
            continue
        nodes = tree_block(view, v, block_size)
        if keyf is None:
            moved += solve_block(view, nodes)
            continue
        key = keyf(nodes)
        got = memo.get(key)                            # type: ignore[union-attr]
        if got is None:
            before = [view.current(u) for u, _ in nodes]
            ok = solve_block(view, nodes)
            got = memo[key] = tuple(view.current(u) for u, _ in nodes) if ok else ()   # type: ignore[index]
            if ok and before == list(got):
                got = memo[key] = ()                   # type: ignore[index]
        if got:
            for (u, _), i in zip(nodes, got):
                if view.current(u) != i:
                    view.choose(u, i)                  # type: ignore[arg-type]
            moved += 1
    return moved
