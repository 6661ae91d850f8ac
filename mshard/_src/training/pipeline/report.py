"""What a pipelined step's plan says about its stages: the cells and ops of every stage, their forward FLOPs and
parameter bytes, the activations that cross each stage boundary, and the schedule.

``TrainOneStepCell.plan(*data).pipeline`` is one of these; ``plan.summary()`` prints it.
"""

from __future__ import annotations

import dataclasses
import html
import re
from dataclasses import dataclass, field

import numpy as np

from mshard._src.training.pipeline.schedule import make_schedule
from mshard._src.training.pipeline.stages import cell_of, eqn_flops

_SCOPE = re.compile(r"mshard_pp_stage_\d+_c\d+/?")


@dataclass(frozen=True)
class StageInfo:
    stage: int                       # virtual stage (segment * stages + stage)
    cells: tuple[str, ...]           # the cells given this stage (by the user or the stage helper)
    ops: int                         # top-level ops it computes
    flops: float                     # their forward FLOPs, one micro-batch
    param_bytes: int                 # bytes of the parameters it reads


@dataclass(frozen=True)
class Boundary:
    src: int
    dst: int
    tensors: tuple[tuple[tuple[int, ...], str], ...]      # (shape, dtype) per activation handed on
    nbytes: int                                           # per micro-batch, whole (before any in-stage split)
    layouts: tuple[str, ...] = ()                         # per activation, its layout inside a stage
    device_nbytes: int = 0                                # per micro-batch, what one device sends


@dataclass(frozen=True)
class PipelineReport:
    schedule: str
    stages: int
    chunks: int
    micro_size: int
    stage_axes: tuple[str, ...]
    ticks: int
    bubble: float
    ring_slots: int
    stage_info: tuple[StageInfo, ...]
    boundaries: tuple[Boundary, ...]
    op_stage: dict = field(default_factory=dict)          # "name/primitive#index" -> virtual stage (-1: every stage)
    auto_assigned: bool = False
    stored_param_bytes: tuple[int, int] = (0, 0)          # parameter bytes one device stores across the stage axes
                                                          # (before any in-stage split), and the whole model's
    in_stage: str = ""                                    # how a stage's devices share a micro-batch

    def schedule_table(self):
        """The schedule this step runs (:class:`~mshard._src.training.pipeline.schedule.Schedule`: ``.timeline()``, and a
        picture in a notebook)."""
        return make_schedule(self.schedule, stages=self.stages, micro=self.micro_size, chunks=self.chunks)

    def _repr_html_(self) -> str:
        """The stages (cells, ops, FLOPs, parameter bytes), the activations crossing each boundary, and the
        schedule's picture: what a notebook shows for ``step.plan(*batch).pipeline``."""
        e = html.escape
        stages = "".join(f"<tr><td>{s.stage}</td><td>{e(', '.join(s.cells))}</td><td>{s.ops}</td>"
                         f"<td>{s.flops:,.0f}</td><td>{s.param_bytes:,}</td></tr>" for s in self.stage_info)
        bounds = "".join(f"<tr><td>{b.src} &rarr; {b.dst}</td><td>{e(_tensors(b))}</td><td>{b.nbytes:,}</td>"
                         f"<td>{b.device_nbytes:,}</td><td>collective-permute</td></tr>" for b in self.boundaries)
        return (f"<b>pipeline</b>: {e(self.schedule)}, {self.stages} stages x {self.chunks} chunk(s) over mesh axes "
                f"{e(str(self.stage_axes))}, {self.micro_size} micro-batches"
                + ("; stages placed by the stage helper" if self.auto_assigned else "")
                + f"; parameters stored per device across the stages: {self._stored()}"
                + (f"; inside a stage: {e(self.in_stage)}" if self.in_stage else "")
                + "<table><tr><th>stage</th><th>cells</th><th>ops</th><th>forward FLOPs / micro-batch</th>"
                  f"<th>parameter bytes</th></tr>{stages}</table>"
                + "<table><tr><th>boundary</th><th>activations</th><th>bytes / micro-batch</th>"
                  f"<th>sent per device</th><th>sent by</th></tr>{bounds}</table>" + self.schedule_table()._repr_html_())

    def _stored(self) -> str:
        held, whole = self.stored_param_bytes
        return f"{held:,} B of {whole:,} B ({whole / max(held, 1):.2f}x less)"

    def lines(self) -> list[str]:
        out = [f"pipeline: {self.schedule}, {self.stages} stages x {self.chunks} chunk(s) over mesh axes "
               f"{self.stage_axes}, {self.micro_size} micro-batches, {self.ticks} ticks, bubble {self.bubble:.3f} "
               f"(idle stage-ticks), input ring {self.ring_slots} slot(s)"
               + ("; stages placed by the stage helper" if self.auto_assigned else ""),
               f"  parameters stored per device across the stages: {self._stored()}"]
        if self.in_stage:
            out.append(f"  inside a stage: {self.in_stage}")
        for s in self.stage_info:
            cells = ", ".join(s.cells[:6]) + (" ..." if len(s.cells) > 6 else "")
            out.append(f"  stage {s.stage}: {s.ops} ops, {s.flops:,.0f} forward FLOPs/micro-batch, parameters "
                       f"{s.param_bytes:,} B; cells {cells}")
        for b in self.boundaries:
            out.append(f"  stage {b.src} -> {b.dst}: {_tensors(b)} ({b.nbytes:,} B per micro-batch, "
                       f"{b.device_nbytes:,} B sent per device, collective-permute)")
        return out


def _tensors(b: Boundary) -> str:
    lays = b.layouts or ("",) * len(b.tensors)
    return ", ".join(f"{dt}{list(sh)}" + (f" {lay}" if lay else "") for (sh, dt), lay in zip(b.tensors, lays))


def with_layouts(rep: PipelineReport, slot_of: list[list[int]], carry_specs, axis_size: dict[str, int],
                 in_stage: str) -> PipelineReport:
    """``rep`` with each boundary activation's layout inside a stage (``carry_specs``: per carry slot, None: left
    to XLA, shown as ``?``; no specs at all: the cells' strategies decide) and the bytes one device sends."""
    bounds = []
    for b, slots in zip(rep.boundaries, slot_of):
        lays, sent = [], 0
        for (shape, dt), sl in zip(b.tensors, slots):
            spec = carry_specs[sl] if carry_specs is not None else None
            n = int(np.prod(shape)) * np.dtype(dt).itemsize
            if spec is None:
                lays.append("?" if carry_specs is not None else "(strategies)")
                sent += n
                continue
            parts = [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in spec]
            lays.append("(" + ", ".join("x".join(p) or "-" for p in parts + [()] * (len(shape) - len(parts))) + ")")
            sent += n // int(np.prod([axis_size[a] for p in parts for a in p]))
        bounds.append(dataclasses.replace(b, layouts=tuple(lays), device_nbytes=sent))
    return dataclasses.replace(rep, boundaries=tuple(bounds), in_stage=in_stage)


def build_report(prog, sched, stage_axes, ring_slots: int, cells: dict[str, int]) -> PipelineReport:
    """From a :class:`~mshard._src.training.pipeline.stages.StageProgram`, its schedule and the cell -> stage map."""
    names = list(cells)
    jaxpr = prog.closed.jaxpr
    op_stage = {}
    ops = [0] * prog.V
    flops = [0.0] * prog.V
    reads: list[set] = [set() for _ in range(prog.V)]
    n_p = prog.n_params
    params = {v: i for i, v in enumerate(jaxpr.invars[:n_p])}
    for j, eqn in enumerate(jaxpr.eqns):
        st = prog.stage[j]
        c = cell_of(eqn)
        name = "/".join(x for x in ([names[c]] if c is not None else []) + [_SCOPE.sub("", str(eqn.source_info.name_stack))]
                        if x)
        op_stage[f"{name + '/' if name else ''}{eqn.primitive.name}#{j}"] = st
        where = range(prog.V) if st < 0 else (st,)
        for k in where:
            if st < 0 and j not in prog.needs[k]:
                continue
            ops[k] += 1
            flops[k] += eqn_flops(eqn)
            reads[k].update(params[v] for v in eqn.invars if not hasattr(v, "val") and v in params)
    sizes = [int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize for v in jaxpr.invars[:n_p]]
    info = tuple(StageInfo(k, tuple(c for c, s in cells.items() if s == k), ops[k], flops[k],
                           sum(sizes[i] for i in reads[k])) for k in range(prog.V))
    bounds = tuple(Boundary(k, k + 1, tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in b), n)
                   for k, (b, n) in enumerate(zip(prog.boundary, prog.activation_bytes())))
    return PipelineReport(sched.name, sched.stages, sched.chunks, sched.micro, tuple(stage_axes), sched.ticks,
                          sched.bubble(), ring_slots, info, bounds, op_stage, bool(prog.auto))
