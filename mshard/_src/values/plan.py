"""The Plan: what a region was given and what the searcher decided, readable and saveable.

>>> import jax, jax.numpy as jnp, mshard as ms
>>> from mshard import ops
>>> ms.set_auto_parallel_context(parallel_mode="auto_parallel", search_mode="sharding_propagation")
>>> mm = ops.MatMul().shard(((2, 1), (1, 4)))
>>> plan = ms.jit(lambda x, w: jax.nn.relu(mm(x, w))).plan(jnp.ones((16, 8)), jnp.ones((8, 32)))
>>> plan.strategy_of("MatMul")
((2, 1), (1, 4))
>>> ms.reset_auto_parallel_context()
"""

from __future__ import annotations

import html
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from jax.sharding import PartitionSpec
from rich.console import Console, Group
from rich.table import Table

from mshard._src.values.errors import PlanError
from mshard._src.values.layout import spec_of
from mshard._src.values.plan_picture import plan_graph
from searchers import DeviceMesh

FORMAT = "mshard.strategy"
VERSION = 1


@dataclass(frozen=True)
class PlanCost:
    """Predicted cost: compute (s/device), communication ({kind: bytes per device}), memory (bytes/device),
    comm_time (s) and total (the searcher's weighted objective)."""

    compute: float = 0.0
    communication: dict = field(default_factory=dict)
    memory: float = 0.0
    comm_time: float = 0.0
    total: float = 0.0

    @staticmethod
    def of(cost) -> PlanCost:
        if cost is None:
            return PlanCost()
        return PlanCost(cost.compute, {k: float(v) for k, v in cost.comm_bytes.items() if v}, cost.memory,
                        cost.comm_time, cost.total)


@dataclass(frozen=True)
class PlanOp:
    """One op of the plan (a primitive object counts once, under its own name): its compute strategy."""

    name: str
    kind: str
    strategy: tuple[tuple[int, ...], ...]          # MindSpore: one split tuple per input
    fixed: bool                                     # given by the user (or a loaded strategy file)
    cost: PlanCost = field(default_factory=PlanCost)
    op_ids: tuple[int, ...] = ()                    # graph ops it covers
    copies: tuple[tuple[int, ...], ...] = ()        # per input dim, the copies a Layout's interleaved_parallel asks


@dataclass(frozen=True)
class Redistribution:
    """An operand that arrives in another layout than its op computes in: from -> to, and what it costs."""

    op: str                                         # the plan entry whose operand it is
    operand: int
    shape: tuple[int, ...]
    src: tuple[int, ...]                            # split counts per dim as it arrives
    dst: tuple[int, ...]                            # ... and as the op computes
    src_axes: tuple[tuple[str, ...], ...]
    dst_axes: tuple[tuple[str, ...], ...]
    communication: dict = field(default_factory=dict)   # predicted {collective kind: bytes per device}
    shared: int = 0           # leading collectives an earlier reader's redistribution of the tensor already ran
    xla_bytes: float | None = None  # run by mshard's direct collectives: what XLA's own change would move

    def __str__(self) -> str:
        kinds = ", ".join(f"{k} {v:,.0f} B" for k, v in self.communication.items()) or "local slicing"
        reuse = f", after {self.shared} collective(s) another reader ran" if self.shared else ""
        direct = (f"; one collective per moved mesh axis, where XLA's change moves {self.xla_bytes:,.0f} B"
                  if self.xla_bytes is not None else "")
        return f"{self.op} operand {self.operand} {self.shape}: {self.src} -> {self.dst} ({kinds}{reuse}{direct})"


class PlanSummary(str):
    """``plan.summary()``: the plan as text (``print`` it), a rich renderable in a terminal and HTML in Jupyter."""

    _html: str = ""
    _renderables: tuple = ()

    def __rich__(self):
        return Group(*self._renderables)

    def _repr_html_(self) -> str:
        return self._html


@dataclass(frozen=True)
class Plan:
    """A region's plan: the strategy of every op, the parameters' layouts and the predicted cost.

    Built by ``f.plan(*args)`` or when ``f`` first runs; ``plan.save(path)`` writes MindSpore's strategy file (as
    JSON) and ``ms.load_plan`` reads one back. A value: nothing in it changes after it is made. Read it with
    ``strategies``, ``strategy_of(regex)``, ``find(regex)``, ``summary()``, ``explain(regex)`` and ``show()``.

    Args:
        mesh: the region's device mesh (axis names and sizes).
        ops: one :class:`PlanOp` per op, in program order.
        param_specs: parameter path -> ``PartitionSpec`` over ``mesh``.
        cost: the predicted :class:`PlanCost`.
        algorithm: what decided it (a search mode, ``"data_parallel"``, ``"user"``, ``"loaded"`` ...).
        seconds: how long the searcher ran.
        notes: the planner's notes (``summary()`` shows them).
        graph_axes: trace op name -> mesh axes per loop dim.
        redistributions: the operands that arrive in another layout than their op computes in.
        _explainer: internal: what ``explain`` asks for alternatives (None for a loaded plan).
        pipeline: a pipelined training step's stages; None otherwise.
        peak_bytes: the cost model's peak bytes per device over program order (every live value, inputs included).

    >>> import jax.numpy as jnp, mshard as ms
    >>> with ms.parallel_context(parallel_mode="data_parallel", device_num=8):
    ...     plan = ms.jit(lambda x: x * 2).plan(jnp.ones((8, 4)))
    >>> plan.algorithm == "data_parallel", plan.strategies, plan.mesh.shape
    (True, {'mul': ((8, 1), ())}, (2, 2, 2))
    """

    mesh: DeviceMesh
    ops: tuple[PlanOp, ...]
    param_specs: dict[str, PartitionSpec]
    cost: PlanCost
    algorithm: str
    seconds: float = 0.0
    notes: tuple[str, ...] = ()
    graph_axes: dict[str, list[list[str]]] = field(default_factory=dict)   # trace op name -> axes per loop dim
    redistributions: tuple[Redistribution, ...] = ()
    _explainer: Any = field(default=None, repr=False, compare=False)
    pipeline: Any = None      # a pipelined training step's stages (mshard._src.training.pipeline.report.PipelineReport)
    # the cost model's peak bytes per device over program order (searchers.memory: every live value in its planned
    # layout, the inputs included); a training step's memory fit reads it
    peak_bytes: float = 0.0

    # -- queries -----------------------------------------------------------------------------
    @property
    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """``{op name: MindSpore strategy tuple}`` in program order."""
        return {op.name: op.strategy for op in self.ops}

    def find(self, pattern: str) -> list[str]:
        """Op names matching the regex ``pattern`` (``re.search``), in program order; a name ``find`` returned
        (``jvp(network)/...`` holds regex characters) matches itself first."""
        if any(op.name == pattern for op in self.ops):
            return [pattern]
        rx = re.compile(pattern)
        return [op.name for op in self.ops if rx.search(op.name)]

    def strategy_of(self, pattern: str) -> tuple[tuple[int, ...], ...]:
        """The strategy of the first op (program order) whose name matches the regex ``pattern``."""
        names = self.find(pattern)
        if not names:
            raise PlanError(f"Plan.strategy_of: no op name matches {pattern!r}; op names include "
                            f"{[op.name for op in self.ops[:8]]}. Use plan.find(regex) to list them.")
        return self.strategies[names[0]]

    def op(self, pattern: str) -> PlanOp:
        name = self.find(pattern)
        if not name:
            raise PlanError(f"Plan: no op name matches {pattern!r}.")
        return next(o for o in self.ops if o.name == name[0])

    # -- showing ------------------------------------------------------------------------------
    def by_module(self) -> list[dict]:
        """One row per module and pass (the op name's path before its last ``/``, ``(top)`` for ops outside any
        module; ``forward`` / ``backward`` for a training step's ``jvp(...)`` / ``transpose(jvp(...))`` scopes),
        in program order: its op count, op kinds, distinct strategies, user-fixed ops, predicted communication."""
        rows: dict[tuple, dict] = {}
        for op in self.ops:
            mod, stage = _module_of(op.name)
            r = rows.setdefault((mod, stage), {"module": mod, "pass": stage, "ops": 0, "kinds": {}, "strategies": [],
                                               "fixed": 0, "comm_bytes": 0.0, "compute_s": 0.0})
            r["ops"] += 1
            r["kinds"][op.kind] = r["kinds"].get(op.kind, 0) + 1
            if op.strategy not in r["strategies"]:
                r["strategies"].append(op.strategy)
            r["fixed"] += bool(op.fixed)
            r["comm_bytes"] += sum(op.cost.communication.values())
            r["compute_s"] += op.cost.compute
        return list(rows.values())

    def table(self, max_rows: int = 60, group_by: str | None = None):
        t = Table(title=f"mshard plan ({self.algorithm}) on mesh {dict(zip(self.mesh.names, self.mesh.shape))}")
        if group_by == "module":
            t.add_column("module", overflow="fold")
            for col in ("pass", "ops", "kinds", "strategies", "fixed", "comm bytes", "compute s"):
                t.add_column(col)
            rows = self.by_module()
            for r in rows[:max_rows]:
                kinds = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in list(r["kinds"].items())[:4])
                strat = "; ".join(map(str, r["strategies"][:2])) + (" ..." if len(r["strategies"]) > 2 else "")
                t.add_row(r["module"], r["pass"], str(r["ops"]), kinds, strat, str(r["fixed"] or ""),
                          f"{r['comm_bytes']:,.0f}", f"{r['compute_s']:.2e}")
            if len(rows) > max_rows:
                t.add_row(f"... {len(rows) - max_rows} more modules", "", "", "", "", "", "", "")
            return t
        if group_by is not None:
            raise PlanError(f"Plan.table: group_by={group_by!r}; use None (one row per op) or 'module'.")
        for col in ("op", "kind", "strategy", "fixed", "comm bytes", "compute s"):
            t.add_column(col)
        for op in self.ops[:max_rows]:
            t.add_row(op.name, op.kind, str(op.strategy), "user" if op.fixed else "",
                      f"{sum(op.cost.communication.values()):,.0f}", f"{op.cost.compute:.2e}")
        if len(self.ops) > max_rows:
            t.add_row(f"... {len(self.ops) - max_rows} more", "", "", "", "", "")
        return t

    def summary(self, max_rows: int = 60, group_by: str | None = None) -> PlanSummary:
        """Every op's strategy and predicted cost, the redistributions between them, the parameters' layouts and
        the notes. Prints nothing: ``print(plan.summary())`` in a script; a notebook shows it as HTML.
        ``group_by="module"`` gives one row per module (op names carry the module path of the call that made them,
        e.g. ``blocks.0/attention/query/MatMul``) instead of one per op.

        >>> import mshard as ms
        >>> from mshard._src.values.layout import prime_mesh
        >>> "mshard plan (user)" in Plan(prime_mesh(8), (), {}, PlanCost(), "user").summary()
        True
        """
        lines = [f"params: { {k: str(v) for k, v in list(self.param_specs.items())[:12]} }",
                 f"predicted: compute {self.cost.compute:.3e} s, communication "
                 f"{ {k: f'{v:,.0f}' for k, v in self.cost.communication.items()} } B/device, "
                 f"memory {self.cost.memory:,.0f} B/device, total {self.cost.total:.4g}"]
        lines += [f"redistribution: {r}" for r in self.redistributions[:max_rows]]
        if len(self.redistributions) > max_rows:
            lines.append(f"... {len(self.redistributions) - max_rows} more redistributions")
        lines += [f"note: {n}" for n in self.notes]
        if self.pipeline is not None:
            lines += self.pipeline.lines()
        renderables = (self.table(max_rows, group_by), *lines)
        console = Console(width=140, record=True, force_terminal=False, force_jupyter=False, color_system=None)
        with console.capture() as cap:
            for r in renderables:
                console.print(r)
        out = PlanSummary(cap.get())
        out._renderables = renderables
        out._html = self._html_table(max_rows, group_by) + "".join(f"<div>{html.escape(x)}</div>" for x in lines)
        return out

    def _html_table(self, max_rows: int = 200, group_by: str | None = None) -> str:
        """The table of :meth:`table` as one HTML table (what a notebook shows; no ANSI, names escaped)."""
        e = html.escape
        if group_by == "module":
            head = ("module", "pass", "ops", "strategies", "fixed", "comm bytes")
            rows = [(r["module"], r["pass"], r["ops"], "; ".join(map(str, r["strategies"][:3])), r["fixed"] or "",
                     f"{r['comm_bytes']:,.0f}") for r in self.by_module()]
        else:
            head = ("op", "kind", "strategy", "fixed", "comm bytes")
            rows = [(o.name, o.kind, o.strategy, "user" if o.fixed else "",
                     f"{sum(o.cost.communication.values()):,.0f}") for o in self.ops]
        more = len(rows) - max_rows
        body = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows[:max_rows])
        if more > 0:
            body += f"<tr><td colspan='{len(head)}'>... {more} more</td></tr>"
        return (f"<b>mshard plan ({e(self.algorithm)})</b> on mesh "
                f"{e(str(dict(zip(self.mesh.names, self.mesh.shape))))}<table><tr>"
                + "".join(f"<th>{h}</th>" for h in head) + f"</tr>{body}</table>")

    def _repr_html_(self) -> str:
        return self._html_table()

    def show(self):
        """The per-op strategy graph of a small region (:class:`mshard._src.values.plan_picture.PlanGraph`): an SVG in Jupyter,
        text from ``str()``; redistributed edges are red with what they move.

        >>> import jax.numpy as jnp, mshard as ms
        >>> ms.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
        >>> f = ms.shard(lambda x, w: jnp.tanh(x @ w), in_strategy=((2, 1), (1, 4)))
        >>> g = f.region().plan(jnp.ones((8, 16)), jnp.ones((16, 8))).show()
        >>> [n for n, *_ in g.nodes][-1], g._repr_svg_().startswith("<svg")
        ('tanh', True)
        >>> ms.reset_auto_parallel_context()
        """
        return plan_graph(self)

    def explain(self, pattern: str, alternatives: int = 3) -> str:
        """Why the first op matching ``pattern`` got its strategy: its cost terms and the best alternatives
        (returned, not printed)."""
        op = self.op(pattern)
        if self._explainer is None:
            return f"{op.name}: strategy {op.strategy} ({'user' if op.fixed else self.algorithm}); loaded plan: " \
                   f"no graph to compare alternatives."
        return self._explainer(op, alternatives)

    # -- the strategy file --------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "algorithm": self.algorithm,
                "mesh": {"names": list(self.mesh.names), "shape": list(self.mesh.shape)},
                "ops": [{"name": o.name, "kind": o.kind, "strategy": [list(s) for s in o.strategy],
                         "fixed": o.fixed} | ({"interleaved": [list(c) for c in o.copies]} if o.copies else {})
                        for o in self.ops],
                "params": {k: [list(d) if isinstance(d, tuple) else d for d in v] for k, v in self.param_specs.items()},
                "graph_axes": self.graph_axes,
                "cost": {"compute": self.cost.compute, "communication": self.cost.communication,
                         "memory": self.cost.memory, "total": self.cost.total}}

    def save(self, path: str | os.PathLike) -> None:
        """Write the versioned JSON strategy file (MindSpore's strategy checkpoint, as JSON)."""
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)


_PASS = re.compile(r"^(transpose\()?jvp\(([^()]*)\)\)?")


def _module_of(name: str) -> tuple[str, str]:
    """``("network/backbone/blocks.0/attention", "backward")`` for
    ``"transpose(jvp(network))/backbone/blocks.0/attention/MatMul"``."""
    stage = ""
    m = _PASS.match(name)
    if m:
        stage = "backward" if m.group(1) else "forward"
        name = m.group(2) + name[m.end():]
    return (name.rsplit("/", 1)[0] if "/" in name else "(top)"), stage


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a strategy file written by :meth:`Plan.save` (or by ``strategy_ckpt_config={"save_file": path}``).

    Put it in ``strategy_ckpt_config={"load_file": path}`` to make a region reproduce it with no annotations.
    A file that cannot be read, is not an mshard strategy file or has another version raises
    :class:`~mshard.errors.PlanError`.

    Args:
        path: the strategy file.

    Returns:
        The :class:`Plan` it holds (``algorithm`` as saved; no search graph, so ``explain`` shows no alternatives).

    >>> import os, tempfile, jax.numpy as jnp, mshard as ms
    >>> from mshard import ops
    >>> path = os.path.join(tempfile.mkdtemp(), "strategy.json")
    >>> with ms.parallel_context(parallel_mode="semi_auto_parallel", device_num=8):
    ...     mm = ops.MatMul().shard(((1, 1), (1, 8)))
    ...     ms.jit(lambda x, w: mm(x, w)).plan(jnp.ones((8, 4)), jnp.ones((4, 8))).save(path)
    >>> load_plan(path).strategy_of("MatMul")
    ((1, 1), (1, 8))
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"load_plan: cannot read strategy file {os.fspath(path)!r}: {e}. Save one with plan.save(path)."
                        ) from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError(f"load_plan: {os.fspath(path)!r} is not an mshard strategy file (format {FORMAT!r}).")
    if data.get("version") != VERSION:
        raise PlanError(f"load_plan: {os.fspath(path)!r} has version {data.get('version')!r}; this mshard reads "
                        f"version {VERSION}.")
    mesh = DeviceMesh(tuple(data["mesh"]["shape"]), tuple(data["mesh"]["names"]))
    ops = tuple(PlanOp(o["name"], o["kind"], tuple(tuple(s) for s in o["strategy"]), o["fixed"],
                       copies=tuple(tuple(c) for c in o.get("interleaved", ()))) for o in data["ops"])
    params = {k: spec_of(tuple(tuple(d) if isinstance(d, list) else ((d,) if d else ()) for d in v))
              for k, v in data["params"].items()}
    c = data.get("cost", {})
    return Plan(mesh, ops, params, PlanCost(c.get("compute", 0.0), c.get("communication", {}), c.get("memory", 0.0),
                                            0.0, c.get("total", 0.0)),
                data.get("algorithm", "loaded"), graph_axes=data.get("graph_axes", {}))
