"""The collectives of a compiled program's HLO text, parsed: kind -> count and bytes (a value; no JAX).

Bytes are the per-device size of each collective's result buffer as compiled (tuple-shaped,
i.e. combined, collectives count once with all their elements); ``moved`` estimates the bytes
each device sends with ring algorithms from the replica-group size k (all-reduce 2S(k-1)/k,
all-gather S(k-1)/k of the gathered result, reduce-scatter S(k-1) of the scattered result,
all-to-all S(k-1)/k). :func:`mshard.comm_report` compiles an mshard callable and parses it here.

>>> text = "%ar = f32[8,4]{1,0} all-reduce(f32[8,4]{1,0} %x), replica_groups={{0,1}}, to_apply=%add"
>>> r = CommReport.from_hlo(text)
>>> r.count("all-reduce"), r.bytes("all-reduce")
(1, 128)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_LINE = re.compile(r"=\s*(?P<shape>\((?:[^=]|/\*index=\d+\*/)*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                   r"(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\(")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


@dataclass
class Collective:
    kind: str
    nbytes: int
    group_size: int
    text: str

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The device groups the collective runs over (device ids as in ``jax.devices()``), from any of XLA's
        ``replica_groups`` forms: explicit ``{{0,4},{1,5}}``, iota ``[4,2]<=[2,4]T(1,0)``, or mesh axes
        ``mesh['axis_0'=2,'axis_1'=4] {'axis_0'}``; ``()`` where the text gives none (collective-permute).

        >>> Collective("all-reduce", 4, 2, "x = f32[1] all-reduce(y), replica_groups=[4,2]<=[2,4]T(1,0)").groups
        ((0, 4), (1, 5), (2, 6), (3, 7))
        """
        return _groups(self.text)

    @property
    def moved(self) -> float:
        k = max(self.group_size, 1)
        factor = {"all-reduce": 2 * (k - 1) / k, "all-gather": (k - 1) / k, "reduce-scatter": (k - 1),
                  "all-to-all": (k - 1) / k, "collective-permute": 1.0}[self.kind]
        return self.nbytes * factor


def _nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _DTYPE_BYTES.get(dtype, 4)
    return total


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def _groups(line: str) -> tuple[tuple[int, ...], ...]:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]*)\](?:T\(([0-9,]*)\))?\))?"
                  r"\s*\{([^}]*)\}", line)
    if m:
        axes = [(k, int(v)) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))]
        sizes = [n for _, n in axes]
        ids = (_iota(m.group(2), m.group(3)) if m.group(2) else np.arange(int(np.prod(sizes)))).reshape(sizes)
        names = [k for k, _ in axes]
        over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4))]
        keep = [i for i in range(len(sizes)) if i not in over]
        rows = ids.transpose(keep + over).reshape(-1, int(np.prod([sizes[i] for i in over] or [1])))
        return tuple(tuple(int(x) for x in r) for r in rows)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]*)\](?:T\(([0-9,]*)\))?", line)
    if m:
        rows = _iota(m.group(3), m.group(4)).reshape(int(m.group(1)), int(m.group(2)))
        return tuple(tuple(int(x) for x in r) for r in rows)
    m = re.search(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}", line)
    if m:
        return tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
    return ()


def _group_size(line: str) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return int(np.prod([sizes[a] for a in re.findall(r"'([^']+)'", m.group(2))] or [1]))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
    if m:
        return int(m.group(2))
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    return 2 if m else 1


@dataclass
class CommReport:
    """The collectives found in compiled HLO text, as :func:`mshard.comm_report` returns them.

    ``count(kind)``, ``bytes(kind)`` (per device) and ``moved(kind)`` (a ring estimate) per collective kind
    (``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"``, ``"collective-permute"``);
    ``total_count``, ``by_kind`` and ``as_dict()``; ``print`` gives a table, a notebook an HTML table.

    Args:
        collectives: the :class:`Collective`s found, in program order; ``CommReport.from_hlo(text)`` builds them.

    >>> text = "%ag = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %x), replica_groups={{0,1,2,3}}, dimensions={0}"
    >>> r = CommReport.from_hlo(text)
    >>> r.total_count, r.bytes("all-gather"), r.moved("all-gather"), r.count("all-reduce")
    (1, 128, 96.0, 0)
    """

    collectives: list[Collective] = field(default_factory=list)

    @staticmethod
    def from_hlo(text: str) -> CommReport:
        out = []
        for line in text.splitlines():
            m = _LINE.search(line)
            if m and "-done" not in line.split("=")[1].split("(")[0]:
                out.append(Collective(m.group("kind"), _nbytes(m.group("shape")), _group_size(line), line.strip()))
        return CommReport(out)

    def count(self, kind: str) -> int:
        return sum(c.kind == kind for c in self.collectives)

    def bytes(self, kind: str) -> int:
        return sum(c.nbytes for c in self.collectives if c.kind == kind)

    def moved(self, kind: str) -> float:
        return sum(c.moved for c in self.collectives if c.kind == kind)

    @property
    def total_count(self) -> int:
        return len(self.collectives)

    @property
    def by_kind(self) -> dict[str, dict[str, float]]:
        return {k: {"count": self.count(k), "bytes": self.bytes(k), "moved": self.moved(k)}
                for k in KINDS if self.count(k)}

    def as_dict(self) -> dict[str, Any]:
        return {"by_kind": self.by_kind, "total_count": self.total_count}

    def table(self):
        t = Table(title="collectives in compiled HLO (per device)")
        for col in ("kind", "count", "bytes", "moved (ring est.)"):
            t.add_column(col, justify="right" if col != "kind" else "left")
        for k, v in self.by_kind.items():
            t.add_row(k, str(v["count"]), f"{v['bytes']:,}", f"{v['moved']:,.0f}")
        if not self.collectives:
            t.add_row("(none)", "0", "0", "0")
        return t

    def __str__(self) -> str:
        console = Console(width=100, record=True, force_terminal=False, force_jupyter=False, color_system=None)
        with console.capture() as cap:
            console.print(self.table())
        return cap.get()

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{k}</td><td>{v['count']}</td><td>{v['bytes']:,}</td><td>{v['moved']:,.0f}</td></tr>"
                       for k, v in self.by_kind.items()) or "<tr><td>(none)</td><td>0</td><td>0</td><td>0</td></tr>"
        return ("<b>collectives in compiled HLO (per device)</b><table><tr><th>kind</th><th>count</th><th>bytes</th>"
                f"<th>moved (ring est.)</th></tr>{rows}</table>")
