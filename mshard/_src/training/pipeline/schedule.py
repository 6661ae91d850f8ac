"""Pipeline schedules as tick tables: which (kind, micro-batch, chunk) every stage runs at every tick.

A schedule is plain data (numpy), made before anything is traced, and is what the executor
(:mod:`mshard._src.training.pipeline.run`) runs: one ``lax.scan`` over the ticks, in which every stage looks its own
entry up. Every operation takes one tick (a forward ``F`` or a backward ``B`` of one chunk of one micro-batch);
an operation starts one tick after the operations it needs: ``F(i, c)`` after ``F(i, c-1)`` (the previous
virtual stage), ``B(i, c)`` after ``B(i, c+1)`` and, on the last virtual stage, after ``F(i, last)``. Each
stage runs its own operations in a fixed order, as early as those allow:

* ``gpipe``: every forward, then every backward (``M`` micro-batches in flight per stage);
* ``1f1b`` (PipeDream-flush): stage ``s`` warms up with ``S-s-1`` forwards, then alternates one forward and one
  backward, then cools down with the remaining backwards: at most ``S - s`` micro-batches in flight;
* ``interleaved`` (Megatron's interleaved 1F1B): ``v`` chunks (virtual stages) per stage, virtual stage
  ``c*S + s`` on stage ``s``; forwards go in groups of ``S`` micro-batches chunk by chunk, warm-up
  ``(S-s-1)*2 + (v-1)*S`` forwards, then one forward one backward. Needs ``M % S == 0``.

The bubble is counted from the table: idle stage-ticks over all stage-ticks. With every operation one tick it is
``(S-1)/(M+S-1)`` for gpipe and 1f1b and ``(S-1)/(v*M+S-1)`` interleaved (a tick of a chunk is ``1/v`` of a
stage's work); :func:`bubble_formula` gives those and the tests and ``bench/pipeline.py`` compare them.

>>> s = make_schedule("1f1b", stages=2, micro=4)
>>> s.ticks, round(s.bubble(), 4), s.in_flight()
(10, 0.2, [2, 1])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mshard._src.values.errors import PipelineError

IDLE, FWD, BWD = 0, 1, 2
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Schedule:
    """``table[t, s] = (kind, micro_batch, chunk)``; kind IDLE / FWD / BWD."""

    name: str
    stages: int
    micro: int
    chunks: int
    table: np.ndarray        # int32 [ticks, stages, 3]

    @property
    def ticks(self) -> int:
        return int(self.table.shape[0])

    def bubble(self) -> float:
        """Idle stage-ticks over all stage-ticks."""
        return float(np.mean(self.table[:, :, 0] == IDLE))

    def in_flight(self) -> list[int]:
        """Per stage, the most micro-batch chunks forwarded and not yet backwarded at once."""
        out = []
        for s in range(self.stages):
            live, most = 0, 0
            for kind, _, _ in self.table[:, s]:
                live += 1 if kind == FWD else -1 if kind == BWD else 0
                most = max(most, live)
            out.append(most)
        return out

    def timeline(self) -> str:
        """The table as text: a row per stage, a column per tick, ``F3`` / ``B3`` (micro-batch 3; ``F3.1`` for
        chunk 1 of the interleaved schedule), ``.`` idle.

        >>> print(make_schedule("gpipe", stages=2, micro=2).timeline())
        stage 0: F0 F1 .  .  B0 B1
        stage 1: .  F0 F1 B0 B1 .
        """
        cells = [[self._cell(t, s) for t in range(self.ticks)] for s in range(self.stages)]
        w = max(len(c) for row in cells for c in row)
        return "\n".join(f"stage {s}: " + " ".join(c.ljust(w) for c in row).rstrip() for s, row in enumerate(cells))

    def _cell(self, t: int, s: int) -> str:
        k, i, c = (int(v) for v in self.table[t, s])
        if k == IDLE:
            return "."
        return f"{'F' if k == FWD else 'B'}{i}" + (f".{c}" if self.chunks > 1 else "")

    def _repr_html_(self) -> str:
        """A notebook's picture of the schedule: a row per stage, a cell per tick (forwards blue, backwards green,
        idle ticks blank), with the bubble against its formula."""
        colour = {IDLE: "#ffffff", FWD: "#cfe2ff", BWD: "#d1e7dd"}
        rows = "".join(
            f"<tr><th>stage {s}</th>" + "".join(
                f"<td style='background:{colour[int(self.table[t, s, 0])]};text-align:center;min-width:2.2em'>"
                f"{'' if int(self.table[t, s, 0]) == IDLE else self._cell(t, s)}</td>" for t in range(self.ticks))
            + "</tr>" for s in range(self.stages))
        head = "<tr><th>tick</th>" + "".join(f"<th>{t}</th>" for t in range(self.ticks)) + "</tr>"
        return (f"<b>{self.name}</b>: {self.stages} stages, {self.micro} micro-batches"
                f"{f', {self.chunks} chunks' if self.chunks > 1 else ''}; bubble {self.bubble():.3f} (formula "
                f"{bubble_formula(self.name, self.stages, self.micro, self.chunks):.3f})"
                f"<table>{head}{rows}</table>")

    def when(self) -> dict[tuple[int, int, int], int]:
        """``(kind, micro_batch, virtual_stage) -> tick``."""
        out = {}
        for t in range(self.ticks):
            for s in range(self.stages):
                k, i, c = (int(v) for v in self.table[t, s])
                if k != IDLE:
                    out[(k, i, c * self.stages + s)] = t
        return out


def bubble_formula(name: str, stages: int, micro: int, chunks: int = 1) -> float:
    """The textbook bubble: ``(S-1)/(M+S-1)``, interleaved ``(S-1)/(v*M+S-1)``."""
    v = chunks if name == "interleaved" else 1
    return (stages - 1) / (v * micro + stages - 1)


def _orders(name: str, S: int, M: int, v: int) -> list[list[tuple[int, int, int]]]:
    """Each stage's operations in the order it runs them: (kind, micro_batch, chunk)."""
    orders = []
    for s in range(S):
        if name == "gpipe":
            o = [(FWD, i, 0) for i in range(M)] + [(BWD, i, 0) for i in range(M)]
        elif name == "1f1b":
            w = min(S - s - 1, M)
            o = [(FWD, i, 0) for i in range(w)]
            for i in range(M - w):
                o += [(FWD, w + i, 0), (BWD, i, 0)]
            o += [(BWD, i, 0) for i in range(M - w, M)]
        else:
            # Megatron's interleaved order: micro-batches in groups of S, chunk by chunk; backwards from the last
            # chunk down
            fwd = [(FWD, g * S + j, c) for g in range(M // S) for c in range(v) for j in range(S)]
            bwd = [(BWD, g * S + j, c) for g in range(M // S) for c in reversed(range(v)) for j in range(S)]
            w = min((S - s - 1) * 2 + (v - 1) * S, len(fwd))
            o = fwd[:w]
            for k in range(len(fwd) - w):
                o += [fwd[w + k], bwd[k]]
            o += bwd[len(fwd) - w:]
        orders.append(o)
    return orders


def make_schedule(name: str, *, stages: int, micro: int, chunks: int = 1) -> Schedule:
    """The tick table of schedule ``name`` (module doc) for ``stages`` stages and ``micro`` micro-batches."""
    S, M = stages, micro
    v = chunks if name == "interleaved" else 1
    if name not in SCHEDULES:
        raise PipelineError(f"pipeline schedule {name!r}: expected one of {SCHEDULES}")
    if name == "interleaved" and M % S:
        raise PipelineError(f"interleaved pipeline: micro_size {M} must be a multiple of pipeline_stages {S}")
    V = v * S
    orders = _orders(name, S, M, v)
    done: dict[tuple[int, int, int], int] = {}     # (kind, micro, virtual stage) -> tick it ran
    pos, free = [0] * S, [0] * S
    rows: list[list[tuple[int, int, int]]] = []
    t = 0
    while any(p < len(o) for p, o in zip(pos, orders)):
        row = [(IDLE, 0, 0)] * S
        for s in range(S):
            if pos[s] >= len(orders[s]) or free[s] > t:
                continue
            k, i, c = orders[s][pos[s]]
            vs = c * S + s
            if k == FWD:
                need = [(FWD, i, vs - 1)] if vs > 0 else []
            else:
                need = [(BWD, i, vs + 1)] if vs < V - 1 else [(FWD, i, vs)]
            if all(n in done and done[n] < t for n in need):
                row[s] = (k, i, c)
                pos[s] += 1
                free[s] = t + 1
        for s, (k, i, c) in enumerate(row):
            if k != IDLE:
                done[(k, i, c * S + s)] = t
        rows.append(row)
        t += 1
        if t > 4 * (v * M + S) * 2:
            raise RuntimeError(f"pipeline schedule {name} (S={S}, M={M}, v={v}) does not finish")
    return Schedule(name, S, M, v, np.asarray(rows, np.int32).reshape(len(rows), S, 3))
