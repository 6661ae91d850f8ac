"""Direct redistributions: a layout change as one collective per moved mesh axis.

XLA's partitioner takes some layout pairs the long way (:mod:`searchers.xla_reshard`, step 6: it
gathers the whole tensor, then slices). A layout change can always be done axis by axis instead,
each step one collective over one mesh axis on the tensor as it is at that point:

- **slice**: a mesh axis that splits no dim now splits dim ``d`` (it becomes ``d``'s minor-most
  axis): each device keeps its block; nothing moves;
- **all-to-all**: a mesh axis leaves dim ``s`` (where it is minor-most) for dim ``d`` (where it
  becomes minor-most): each device sends ``(k - 1) / k`` of its local block;
- **all-gather**: a mesh axis leaves dim ``s`` (where it is minor-most) and splits nothing: each
  device receives ``k - 1`` blocks of its local size;
- **all-to-all of a stack**: a dim's whole stack of axes ``(a, b, ...)`` leaves it for a dim split by
  none whose destination stack starts with it, keeping its order, as one all-to-all over the axes
  together (what XLA does for ``(8, 1)`` to ``(1, 8)``). Axis by axis, the stack's major axis could not
  leave before its minor ones, which had to be gathered (a loaded strategy file's rows ``(d0, d1)`` to
  columns ``(d0, d1, d2)``: XLA's all-to-all and permute moved 448 B, this all-to-all and a slice 384 B).

The order of the axes inside a dim is kept exactly (a dim's axes are a stack: an axis is added or
removed at its minor end), so every intermediate layout splits each dim by a prefix of the source's
or the destination's axes, and divides wherever the two layouts do. :func:`plan` chooses the steps
greedily: every slice and all-to-all that is ready first (slices shrink what later steps move),
then a stack's all-to-all, else the all-gather of an axis that must leave its place; of the plans
with and without stack moves, the one that moves less. :func:`cheaper_than_xla` says when the
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
    axes: tuple[int, ...] = ()      # an all-to-all of a stack: its axes, major first (``axis`` is the first)

    @property
    def group(self) -> tuple[int, ...]:
        """The mesh axes the step's groups span."""
        return self.axes or (self.axis,)


@lru_cache(maxsize=1 << 14)
def plan(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...]) -> tuple[Move, ...]:
    """The direct steps from layout ``src`` to ``dst`` (per tensor dim, the mesh axes splitting it,
    major first) on a mesh of ``mesh`` axis sizes. Axes of size 1 take no part. Of the plans with and without
    all-to-alls of whole stacks, the one that moves less (without, on a tie).

    >>> [(m.kind, m.group, m.dim) for m in plan(((0, 1), ()), ((), (0, 1, 2)), (2, 2, 2))]
    [('all-to-all', (0, 1), 1), ('slice', (2,), 1)]
    """
    by_axis = _plan(src, dst, mesh, False)
    stacked = _plan(src, dst, mesh, True)
    return stacked if _moved(_steps(stacked, src, mesh)) < _moved(_steps(by_axis, src, mesh)) * (1 - 1e-9) else by_axis


def _plan(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...], stacks: bool) -> tuple[Move, ...]:
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
        if stacks and _move_stack(cur, want, moves, settled, placed):
            continue
        # nothing is ready: gather the minor-most unsettled axis of some dim (one that leaves the layout first)
        tops = [(d, cur[d][-1]) for d in range(len(cur)) if settled(d) < len(cur[d])]
        d, a = min(tops, key=lambda t: (any(t[1] in w for w in want), t[0]))
        cur[d].pop()
        moves.append(Move("all-gather", a, None, d))
    raise AssertionError(f"direct_reshard.plan did not reach {dst} from {src}")   # pragma: no cover


def _move_stack(cur, want, moves, settled, placed) -> bool:
    """One all-to-all of a whole stack: a dim none of whose axes are settled, to an empty dim whose wanted stack
    starts with it (the longest such). The dim it lands on is then split by a prefix of its destination stack,
    so it divides wherever the destination does (an axis sliced onto the stack first might not: a dim of 4 split
    8 ways). False where there is none."""
    best = None
    for s in range(len(cur)):
        if len(cur[s]) < 2 or settled(s):
            continue
        for d in range(len(cur)):
            if (d != s and not cur[d] and tuple(want[d][:len(cur[s])]) == tuple(cur[s])
                    and (best is None or len(cur[s]) > best[0])):
                best = (len(cur[s]), s, d)
    if best is None:
        return False
    _, s, d = best
    axes = tuple(cur[s])
    cur[d], cur[s] = list(axes), []
    moves.append(Move("all-to-all", axes[0], d, s, axes))
    return True


@lru_cache(maxsize=1 << 14)
def steps(src: TensorLayout, dst: TensorLayout, mesh: tuple[int, ...]) -> tuple[Step, ...]:
    """The collectives of :func:`plan` as :class:`~searchers.xla_reshard.Step` values (result and bytes sent
    per device as fractions of the tensor's global size, ring formulas as the cost model counts them)."""
    return _steps(plan(src, dst, mesh), src, mesh)


def _steps(moves: tuple[Move, ...], src: TensorLayout, mesh: tuple[int, ...]) -> tuple[Step, ...]:
    local = 1.0 / math.prod(mesh[a] for dims in src for a in dims)
    out = []
    for m in moves:
        k = math.prod(mesh[a] for a in m.group)
        if m.kind == "slice":
            local /= k
        elif m.kind == "all-to-all":
            out.append(Step("all-to-all", k, local, local * (k - 1) / k, m.group))
        else:
            local *= k
            out.append(Step("all-gather", k, local, local * (k - 1) / k, m.group))
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
