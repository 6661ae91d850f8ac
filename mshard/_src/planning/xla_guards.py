"""Guards for layouts XLA's SPMD partitioner miscompiles: mshard never emits them.

A guard names an op kind, a condition on the layouts its operands would be computed in, and a
substitution: the same strategy realised safely (an operand resharded before the op; the op's output
keeps the layout the strategy gives it, so what the user asked for is still what the program holds). It
cites the reproducer that shows plain ``jax.jit`` giving wrong values, and a strict-xfail test in
``tests/unit/planning/test_xla_guards.py`` keeps checking that XLA is still wrong: when a JAX upgrade fixes it, that test
fails and says to lift the guard. Searches never reach a guarded layout: a convolution's halo dims (its
"same" windows, :func:`mshard._src.jaxpr.rules.conv_rule`, ``ops.Conv2D.halo``) are never split together with its
out-channels (``halo_apart``, which the searchers' candidate strategies keep), so only a user's strategy can ask
for one.

>>> [g.name for g in GUARDS]
['conv_halo_out_channels']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mshard._src.jaxpr.marks import OpNote
from mshard._src.jaxpr.walk import iter_marks
from mshard._src.planning.axis_assignment import RegionLayouts

DimAxes = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Guard:
    name: str
    kind: str                                                     # the primitive object's kind (OpNote.kind)
    applies: Callable[[OpNote, list[DimAxes | None]], bool]       # (note, the "in" layouts) -> miscompiled?
    safe: Callable[[OpNote, list[DimAxes | None]], list[DimAxes | None]]   # -> the "in" layouts to emit instead
    computes: Callable[[OpNote, DimAxes], DimAxes]                # (note, output 0's layout) -> the layout it
    #                                                               computes in with the safe inputs (XLA's
    #                                                               partitioner replicates the op when asked
    #                                                               for the output layout at once)
    repro: str                                                    # the reproducer in docs/xla_repro/
    says: str                                                     # the plan's note


def _conv_halo_out_channels(note: OpNote, ins: list[DimAxes | None]) -> bool:
    x, w = (ins + [None, None])[:2]
    if x is None or w is None or note.in_dims is None:
        return False
    kernel = note.in_shapes[1]
    windowed = any(note.in_dims[0][d] in ("h", "w") and x[d] and kernel[d] > 1 for d in (2, 3))
    return windowed and bool(w[0])


def _kernel_whole_on_out_channels(note: OpNote, ins: list[DimAxes | None]) -> list[DimAxes | None]:
    x, w = ins[0], ins[1]
    assert w is not None
    return [x, ((),) + tuple(w[1:])] + list(ins[2:])


def _out_without_out_channels(note: OpNote, out: DimAxes) -> DimAxes:
    """The convolution's result as it computes with the whole kernel: the asked layout without the out-channel
    split (dim 1), which the output then takes by a local slice."""
    return (out[0], ()) + tuple(out[2:])


GUARDS: tuple[Guard, ...] = (
    Guard("conv_halo_out_channels", "Conv2D", _conv_halo_out_channels, _kernel_whole_on_out_channels,
          _out_without_out_channels, "r1_conv_halo_outfeature.py",
          "its input's height/width is split across a kernel window and its out-channels are split: XLA's "
          "partitioner computes wrong values for that pair (JAX 0.10), so the kernel is gathered over its "
          "out-channels before the convolution and the output keeps the asked layout"),
)


def apply_guards(jaxpr, layouts: RegionLayouts) -> list[str]:
    """Rewrite ``layouts.marks`` so no guarded layout is emitted; -> one plan note per substitution."""
    notes: list[str] = []
    seen: set[int] = set()
    by_kind = {g.kind: g for g in GUARDS}
    for eqn in iter_marks(jaxpr):
        note: OpNote = eqn.params["note"]
        guard = by_kind.get(note.kind)
        if guard is None or note.uid in seen:
            continue
        seen.add(note.uid)
        n = len(note.in_shapes)
        ins = [layouts.marks.get((note.uid, "in", i)) for i in range(n)]
        if not guard.applies(note, ins):
            continue
        safe = guard.safe(note, ins)
        for i, (old, new) in enumerate(zip(ins, safe)):
            if new != old:
                for role in ("in", "ct"):
                    if (note.uid, role, i) in layouts.marks or role == "in":
                        layouts.marks[(note.uid, role, i)] = new
        out = layouts.marks.get((note.uid, "out", 0))
        if out is not None:
            layouts.staged[(note.uid, "out", 0)] = guard.computes(note, out)
        who = note.given_name or note.kind
        notes.append(f"guard {guard.name} ({guard.repro}): {who} {guard.says}")
    return notes
