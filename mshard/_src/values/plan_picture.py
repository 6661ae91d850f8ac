"""``plan.show()``: the per-op strategy graph of a small region, as a picture.

Nodes are the plan's entries (an op, or a primitive object once) and the region's inputs; an edge is a value one
entry passes to another. A node shows the op's name, kind and MindSpore strategy (user-fixed ones bold); an edge
that arrives in another layout than its consumer computes in is red and says what the redistribution moves.
In Jupyter it renders as an SVG; ``str()`` gives the same graph as text, one edge per line.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from mshard._src.values.errors import PlanError

MAX_NODES = 80        # beyond this a picture is unreadable: summary(group_by="module") is the view to use


@dataclass(frozen=True)
class PlanGraph:
    """The strategy graph of one plan: ``nodes`` ``(name, kind, label, fixed)`` in program order and ``edges``
    ``(src, dst, redistribution text or "")``."""

    title: str
    nodes: tuple[tuple[str, str, str, bool], ...]
    edges: tuple[tuple[str, str, str], ...]

    def __str__(self) -> str:
        lines = [self.title]
        lines += [f"  {n}: {k} {lab}{' (user)' if f else ''}" for n, k, lab, f in self.nodes]
        lines += [f"  {s} -> {d}{'  [' + r + ']' if r else ''}" for s, d, r in self.edges]
        return "\n".join(lines)

    def _layers(self) -> dict[str, int]:
        depth = {n: 0 for n, *_ in self.nodes}
        for s, d, _ in self.edges:           # nodes and edges are in program order: one pass is a longest path
            depth[d] = max(depth[d], depth[s] + 1)
        return depth

    def _repr_svg_(self) -> str:
        depth = self._layers()
        rows: dict[int, int] = {}
        pos = {}
        W, H, GX, GY = 210, 44, 60, 18
        for n, *_ in self.nodes:
            c = depth[n]
            r = rows.get(c, 0)
            rows[c] = r + 1
            pos[n] = (10 + c * (W + GX), 30 + r * (H + GY))
        width = 20 + (max(depth.values(), default=0) + 1) * (W + GX)
        height = 40 + max(rows.values(), default=1) * (H + GY)
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
               f'font-family="monospace" font-size="11">',
               f'<text x="10" y="16" font-weight="bold">{html.escape(self.title)}</text>',
               '<defs><marker id="a" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
               '<path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>']
        for s, d, red in self.edges:
            (x1, y1), (x2, y2) = pos[s], pos[d]
            colour = "#c0392b" if red else "#555"
            out.append(f'<line x1="{x1 + W}" y1="{y1 + H / 2}" x2="{x2}" y2="{y2 + H / 2}" stroke="{colour}" '
                       f'marker-end="url(#a)"><title>{html.escape(red or s + " -> " + d)}</title></line>')
        for n, kind, label, fixed in self.nodes:
            x, y = pos[n]
            fill = "#eef5ff" if kind in ("data", "param") else "#ffffff"
            out.append(f'<rect x="{x}" y="{y}" width="{W}" height="{H}" rx="5" fill="{fill}" stroke="#333"/>')
            bold = ' font-weight="bold"' if fixed else ""
            out.append(f'<text x="{x + 6}" y="{y + 17}"{bold}>{html.escape(_clip(n, 30))}</text>')
            out.append(f'<text x="{x + 6}" y="{y + 34}" fill="#444">{html.escape(_clip(label, 32))}</text>')
        out.append("</svg>")
        return "".join(out)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def plan_graph(plan) -> PlanGraph:
    """The :class:`PlanGraph` of ``plan`` (a plan made in this process: a loaded plan has no graph)."""
    explainer = plan._explainer
    if explainer is None:
        raise PlanError("plan.show(): a plan loaded from a file keeps the strategies but not the graph; call "
                        "region.plan(*args) to draw it.")
    if len(plan.ops) > MAX_NODES:
        raise PlanError(f"plan.show(): {len(plan.ops)} ops are too many to draw (at most {MAX_NODES}); use "
                        f"plan.summary(group_by='module') for a large region, or show a smaller region.")
    graph = explainer.graph
    entry = {i: op for op in plan.ops for i in op.op_ids}
    nodes, seen = [], set()
    red = {(r.op, r.operand): r for r in plan.redistributions}
    edges: dict[tuple[str, str], str] = {}
    for op in graph.ops:
        e = entry.get(op.id)
        if e is None:
            continue
        for i, tid in enumerate(op.inputs):
            prod = graph.producer(tid)
            while prod.id not in entry and not prod.is_source and prod.inputs:    # through marks and copies
                prod = graph.producer(prod.inputs[0])
            src = entry.get(prod.id)
            if src is None and prod.kind in ("data", "param"):
                name = prod.name or f"{prod.kind}{prod.id}"
                if name not in seen:
                    seen.add(name)
                    axes = plan.graph_axes.get(prod.name)
                    nodes.append((name, prod.kind, _axes_label(axes), False))
                src_name = name
            elif src is None or src.name == e.name:
                continue
            else:
                src_name = src.name
            r = red.get((e.name, i))
            key = (src_name, e.name)
            text = "" if r is None else ", ".join(f"{k} {v:,.0f} B" for k, v in r.communication.items()) or \
                f"{r.src} -> {r.dst}"
            edges[key] = edges.get(key) or text
        if e.name not in seen:
            seen.add(e.name)
            nodes.append((e.name, e.kind, str(e.strategy), e.fixed))
    order = {n: k for k, (n, *_) in enumerate(nodes)}
    ordered = sorted(((s, d, t) for (s, d), t in edges.items()), key=lambda x: (order[x[1]], order[x[0]]))
    title = f"mshard plan ({plan.algorithm}) on mesh {dict(zip(plan.mesh.names, plan.mesh.shape))}"
    return PlanGraph(title, tuple(nodes), tuple(ordered))


def _axes_label(axes) -> str:
    if not axes:
        return ""
    return "(" + ", ".join("+".join(a) if a else "-" for a in axes) + ")"
