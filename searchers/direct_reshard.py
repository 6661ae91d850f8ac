"""Direct redistributions: a layout change as one collective per moved mesh axis.

XLA's partitioner takes some layout pairs the long way (:mod:`searchers.xla_reshard`, step 6: it
gathers the whole tensor, then slices). A layout change can always be done axis by axis instead,
each step one collective over one mesh axis on the tensor as it is at that point:

- **slice**: a mesh axis that splits no dim now splits dim ``d`` (it becomes ``d``'s minor-most
  axis): each device keeps its block; nothing moves;
- **all-to-all**: a mesh axis leaves dim ``s`` (where it is minor-most) for dim ``d`` (where it
  becomes minor-most): each device sends ``(k - 1) / k`` of its local block;
- **all-gather**: a mesh axis leaves dim ``s`` (where it is minor-most) and splits nothing: each
  device receives ``k - 1`` blocks of its local size.

The order of the axes inside a dim is kept exactly (a dim's axes are a stack: an axis is added or
removed at its minor end), so every intermediate layout splits each dim by a prefix of the source's
or the destination's axes, and divides wherever the two layouts do. :func:`plan` chooses the steps
greedily: every slice and all-to-all that is ready first (slices shrink what later steps move),
then the all-gather of an axis that must leave its place. :func:`cheaper_than_xla` says when the
executor emits these steps itself (``mshard._src.runtime.redistribute``) instead of leaving the
change to XLA, and the cost model prices the cheaper of the two.

>>> [(m.kind, m.axis, m.dim) for m in plan(((0,), (1,)), ((), (1, 0, 2)), (2, 2, 2))]
[('all-to-all', 0, 1), ('slice', 2, 1)]
>>> [(s.kind, s.group, s.moved) for s in steps(((0,), (1,)), ((), (1, 0, 2)), (2, 2, 2))]
[('all-to-all', 2, 0.125)]
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from .graph import TensorLayout
from .xla_reshard import Step, reshard


@dataclass(frozen=True)
class Move:
    """One step of a direct redistribution: ``kind`` ("slice", "all-to-all", "all-gather") over mesh
    ``axis``; ``dim`` the tensor dim the axis splits after the step (None after an all-gather),
    ``src_dim`` the dim it split before (None for a slice)."""

    kind: str
    axis: int
    dim: int | None
    src_dim: int | None


@lru_cache(maxsize=1 << 14)
def plan(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...]) -> tuple[Move, ...]:
    """The direct steps from layout ``src`` to ``dst`` (per tensor dim, the mesh axes splitting it,
    major first) on a mesh of ``mesh`` axis sizes. Axes of size 1 take no part."""
    cur = [[a for a in dims if mesh[a] > 1] for dims in src]
    want = [[a for a in dims if mesh[a] > 1] for dims in dst]
    moves: list[Move] = []

    def placed(a):
        return next((d for d, st in enumerate(cur) if a in st), None)

    def settled(d):        # how many of cur[d]'s axes are already dst's (a common prefix)
        n = 0
        while n < len(cur[d]) and n < len(want[d]) and cur[d][n] == want[d][n]:
            n += 1
        return n

    for _ in range(4 * len(mesh) + 4):
        if cur == want:
            return tuple(moves)
        progress = False
        for d in range(len(want)):          # the next axis of a dim whose stack is dst's so far
            while settled(d) == len(cur[d]) < len(want[d]):
                a = want[d][len(cur[d])]
                s = placed(a)
                if s is None:
                    cur[d].append(a)
                    moves.append(Move("slice", a, d, None))
                elif s != d and cur[s][-1] == a and settled(s) < len(cur[s]):
                    cur[s].pop()
                    cur[d].append(a)
                    moves.append(Move("all-to-all", a, d, s))
                else:
                    break
                progress = True
        if progress:
            continue
        # nothing is ready: gather the minor-most unsettled axis of some dim (one that leaves the layout first)
        tops = [(d, cur[d][-1]) for d in range(len(cur)) if settled(d) < len(cur[d])]
        d, a = min(tops, key=lambda t: (any(t[1] in w for w in want), t[0]))
        cur[d].pop()
        moves.append(Move("all-gather", a, None, d))
    raise AssertionError(f"direct_reshard.plan did not reach {dst} from {src}")   # pragma: no cover


@lru_cache(maxsize=1 << 14)
def steps(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...]) -> tuple[Step, ...]:
    """The collectives of :func:`plan` as :class:`~searchers.xla_reshard.Step` values (result and bytes sent
    per device as fractions of the tensor's global size, ring formulas as the cost model counts them)."""
    local = 1.0 / math.prod(mesh[a] for dims in src for a in dims)
    out = []
    for m in plan(src, dst, mesh):
        k = mesh[m.axis]
        if m.kind == "slice":
            local /= k
        elif m.kind == "all-to-all":
            out.append(Step("all-to-all", k, local, local * (k - 1) / k, (m.axis,)))
        else:
            local *= k
            out.append(Step("all-gather", k, local, local * (k - 1) / k, (m.axis,)))
    return tuple(out)


def _moved(st: tuple[Step, ...]) -> float:
    return sum(s.moved for s in st)


_ENABLED = [True]
_DEPENDENT: list = []       # memos holding prices made from cheaper_than_xla's answers (cleared when it changes)


def depends_on_direct(clear) -> None:
    """Register ``clear`` (a memo's ``cache_clear``) to run whenever :func:`xla_only` changes the answer."""
    _DEPENDENT.append(clear)


@contextmanager
def xla_only() -> Iterator[None]:
    """Inside, every redistribution is left to XLA and priced as XLA's (the program before direct
    redistributions: ``bench/reshard_vs_hlo.py`` compares the two). Plans made inside keep it."""
    _ENABLED.append(False)
    for clear in _DEPENDENT:
        clear()
    try:
        yield
    finally:
        _ENABLED.pop()
        for clear in _DEPENDENT:
            clear()


def cheaper_than_xla(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...]) -> bool:
    """Whether the direct steps send fewer bytes than XLA's own redistribution of the pair (by more than a
    rounding: on a tie XLA's is kept, it needs no ``shard_map``)."""
    return _ENABLED[-1] and _cheaper(tuple(map(tuple, src)), tuple(map(tuple, dst)), tuple(mesh))


@lru_cache(maxsize=1 << 14)
def _cheaper(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...]) -> bool:
    if src == dst:
        return False
    return _moved(steps(src, dst, mesh)) < _moved(reshard(src, dst, mesh)) * (1 - 1e-9)


def best_steps(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...]) -> tuple[Step, ...]:
    """The collectives the executor runs for the pair: the direct ones where they are cheaper, else XLA's."""
    src, dst = tuple(map(tuple, src)), tuple(map(tuple, dst))
    return steps(src, dst, mesh) if cheaper_than_xla(src, dst, mesh) else reshard(src, dst, mesh)
