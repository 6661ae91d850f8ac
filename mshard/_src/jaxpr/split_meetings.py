"""Where user splits meet: the whole-graph relation that axis assignment keeps disjoint (docs/design.md invariant 4).

A *claim* is one tensor dim that the user split: a data input with a dataset_strategy tuple or a shard
``in_strategy``, a parameter with a ``parameter_plan``, or an operand/result of a mark (a primitive
object's strategy, a shard-wrapped function's in/out strategy). A claim reaches every op its dim flows
into through the traced graph (:func:`mshard._src.jaxpr.op_graph.jaxpr_to_graph`): from op to op along each op's
iteration space (the same loop dim on an operand and a result), in both directions, through embedding
gathers, convs, reshapes, layer norms, remat and custom_vjp bodies (inlined), scans over layers (along a
carry: :data:`OPAQUE`), and stops at an op with a
user strategy of its own (another mark with a strategy, a ``with_sharding_constraint``, a ``shard_map``
boundary), which decides that tensor's layout itself.

Two claims *meet* where they reach one op on different loop dims: the op computes with both splits at
once, so they must take disjoint mesh axes, or the partitioner reshuffles one of them (silently: numbers
stay right, collectives multiply). :class:`SplitMeetings` answers, for a claim, which other claims it meets
and in which op; :class:`mshard._src.planning.axis_assignment.Assigner` avoids their axes and raises ``LayoutError`` where it
cannot. Two claims *join* where they reach one op on the same loop dim (:meth:`SplitMeetings.joins`): the
Assigner gives the later one the earlier one's axes where the split counts agree, so a shard-wrapped
``x @ w`` with ``in_strategy=((2, 2), (2, 2))`` splits the contraction over one axis on both inputs.

>>> import jax, jax.numpy as jnp
>>> from searchers import DeviceMesh
>>> from mshard._src.jaxpr.op_graph import jaxpr_to_graph
>>> cj = jax.make_jaxpr(lambda ids, t, w: jnp.take(t, ids, axis=0) @ w)(
...     jnp.zeros((8,), jnp.int32), jnp.ones((16, 4)), jnp.ones((4, 6)))
>>> tr = jaxpr_to_graph(cj, DeviceMesh.prime(8), ["data", "param", "param"], ["ids", "t", "w"])
>>> ids, w = (tr.graph.ops[tr.input_ops[i]].outputs[0] for i in (0, 2))
>>> m = SplitMeetings(tr.graph, {("input", 0): [(ids, {0: 0})], ("input", 2): [(w, {0: 0, 1: 1})]}, stops=set())
>>> m.meets(("input", 2), 1)
{(('input', 0), 0): 'dot_general'}
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence

from searchers import Graph
from searchers.graph import OPAQUE_KINDS

ClaimKey = Hashable          # ("input", i) or a mark key (note uid, "in"/"out", index)
ClaimDim = tuple[ClaimKey, int]

# ops traced as one opaque op (mshard._src.jaxpr.rules: scan/while/cond bodies are not inlined). A claim passes through a
# scan along its carries (the rule's loop dims: carry k's input and result), not from its constants or scanned
# inputs (what the body makes of them is the body's ops'); through a while or a cond from an operand to every
# operand and result of the same shape, on the same dim. Claims never meet in an opaque op: its body's ops compute
# (with their own strategies; the partitioner reshards a carry at the loop's boundary). Under jax.grad a strategy
# on a loop-invariant operand of a scan body is hoisted out of the scan: it must not meet the carry's split there
OPAQUE = OPAQUE_KINDS


def _majors(dims: Sequence) -> tuple[str | None, ...]:
    """Each tensor dim's loop dim; for a dim made of several (a reshape's merged dim), the major one: a claim on a
    merged dim passes a reshape to the dim its major part leads, as a split of it does."""
    return tuple(d if d is None or isinstance(d, str) else d[0] for d in dims)


class SplitMeetings:
    """For each claimed tensor dim, the ops it reaches and the other claims it meets there.

    ``sources``: claim key -> the places that carry it (one per traced place of a mark, its transpose included),
    each a graph tensor and the dims worth following (the split ones) as {claim dim: tensor dim}: they differ
    where a mark was batched over data-parallel replicas, which adds a tensor dim (at a place of its own for
    a transpose). ``stops``: op ids a claim does not pass (ops with a user strategy).

    A primitive object traced as one op (``jaxpr_to_graph(..., primitives=True)``) with a strategy is a *sink*:
    ``sinks`` maps its op id to the inputs a claim may enter it through (those without a strategy of their own);
    a claim that enters reaches the op there and goes no further, as it went no further than the object's body
    when its marks were ops. ``at``: claims placed on an op's loop dims directly ({claim dim: loop dim}), the
    object's own input strategies.
    """

    def __init__(self, graph: Graph, sources: Mapping[ClaimKey, Sequence[tuple[int, Mapping[int, int]]]],
                 stops: Iterable[int], sinks: Mapping[int, Iterable[int]] | None = None,
                 at: Mapping[ClaimKey, Sequence[tuple[int, Mapping[int, str]]]] | None = None):
        self.graph = graph
        stop = set(stops)
        sink = {oid: frozenset(slots) for oid, slots in (sinks or {}).items()}
        # op id -> loop dim -> claimed dims reaching it there
        reach: dict[int, dict[str, set[ClaimDim]]] = defaultdict(lambda: defaultdict(set))
        for key, places in (at or {}).items():
            for oid, loops in places:
                for d, loop in loops.items():
                    if loop is not None:
                        reach[oid][loop].add((key, d))
        uses = self._uses(graph)
        for key, places in sources.items():
            for tid, dims in places:
                for d, td in dims.items():
                    self._spread(key, d, td, [tid], uses, stop, reach, sink)
        self._meets: dict[ClaimDim, dict[ClaimDim, str]] = defaultdict(dict)
        self._joins: dict[ClaimDim, dict[ClaimDim, str]] = defaultdict(dict)
        for oid, by_loop in sorted(reach.items()):      # program order: name the first op where they meet
            loops = list(by_loop.items())
            for _, claims in loops:
                for x in claims:
                    for y in claims:
                        if x[0] != y[0]:
                            self._joins[x].setdefault(y, graph.ops[oid].name)
            if graph.ops[oid].kind in OPAQUE:          # no meeting in an opaque op (see OPAQUE)
                continue
            for a, (la, ca) in enumerate(loops):
                for lb, cb in loops[a + 1:]:
                    if la == lb:
                        continue
                    for x in ca:
                        for y in cb:
                            if x[0] != y[0]:
                                self._meets[x].setdefault(y, graph.ops[oid].name)
                                self._meets[y].setdefault(x, graph.ops[oid].name)

    @staticmethod
    def _uses(graph: Graph) -> dict[int, list[tuple[int, tuple[str | None, ...], int]]]:
        """tensor id -> (op id, that op's loop dim per tensor dim, slot) for every op reading or writing it; slot
        ``k`` for the op's input k, ``-1 - j`` for its result j."""
        uses: dict[int, list[tuple[int, tuple[str | None, ...], int]]] = defaultdict(list)
        for op in graph.ops:
            for k, (tid, dims) in enumerate(zip(op.inputs, op.in_dims)):
                uses[tid].append((op.id, _majors(dims), k))
            for j, (tid, dims) in enumerate(zip(op.outputs, op.out_dims)):
                uses[tid].append((op.id, _majors(dims), -1 - j))
        return uses

    def _spread(self, key: ClaimKey, dim: int, tdim: int, tids: Sequence[int], uses, stop: set[int], reach,
                sink: Mapping[int, frozenset[int]]) -> None:
        g = self.graph
        seen: set[tuple[int, int]] = set()
        todo = [(t, tdim) for t in tids if tdim < len(g.tensors[t].shape) and g.tensors[t].shape[tdim] > 1]
        seen.update(todo)
        while todo:
            tid, d = todo.pop()
            for oid, dims, slot in uses[tid]:
                if oid in stop:
                    continue
                if oid in sink:              # reached through an open input: meets there, goes no further
                    if slot in sink[oid] and dims[d] is not None:
                        reach[oid][dims[d]].add((key, dim))
                    continue
                op = g.ops[oid]
                loop = dims[d]
                if loop is None and op.kind in OPAQUE and op.kind != "scan":
                    loop = f"~{d}"           # a while's or cond's same-shaped carries and branches keep their dims
                    shape = g.tensors[tid].shape
                    nxt = [(t2, d) for t2 in [*op.inputs, *op.outputs] if g.tensors[t2].shape == shape]
                elif loop is None:
                    continue
                else:
                    nxt = [(t2, d2) for t2, dims2 in [*zip(op.inputs, op.in_dims), *zip(op.outputs, op.out_dims)]
                           for d2, l2 in enumerate(_majors(dims2)) if l2 == loop]
                here = reach[oid][loop]
                if (key, dim) in here:
                    continue
                here.add((key, dim))
                for t2, d2 in nxt:
                    if (t2, d2) not in seen and g.tensors[t2].shape[d2] > 1:
                        seen.add((t2, d2))
                        todo.append((t2, d2))

    def joins(self, key: ClaimKey, dim: int) -> dict[ClaimDim, str]:
        """The claims that reach one op on the same loop dim as ``(key, dim)`` (a MatMul's contracted dim on both
        operands), each with the name of such an op: with equal split counts they should take the same axes."""
        return dict(self._joins.get((key, dim), {}))

    def meets(self, key: ClaimKey, dim: int) -> dict[ClaimDim, str]:
        """The claims that claim ``(key, dim)`` meets, each with the name of an op where they meet."""
        return dict(self._meets.get((key, dim), {}))
