"""A graph's tensors as flat *layout slots*, built with numpy: the index a greedy searcher keeps
its layouts in.

Every op owns a block of consecutive slots: one per operand, then one per result. An edge
joins the producer's result slot to the consumer's operand slot. ``refs`` of an op are the
slots on the far side of its edges, the ones its cost reads: its operands' producer results
(operand order), then its results' consumer operands (edge order). ``ref_pos`` says which slot
of the op's own block each ref meets: operand ``k`` is ``k``, result ``j`` is ``n_operands + j``.

>>> from searchers.graph import DeviceMesh, Graph
>>> g = Graph(DeviceMesh((2,)))
>>> x = g.source("x", (4,))
>>> (y,) = g.add_op("neg", "neg", {"i": 4}, [x], [("i",)], [("i",)])
>>> s = slot_graph(g)
>>> s.base.tolist(), s.e_in.tolist(), s.e_src.tolist()        # x: slot 0; neg: operand 1, result 2
([0, 1, 3], [1], [0])
>>> s.refs(0), s.refs(1), s.ref_pos[s.ref_ptr[1]:s.ref_ptr[2]].tolist()
([1], [0], [0])
"""

from __future__ import annotations

import math
from itertools import chain
from typing import NamedTuple

import numpy as np

from .graph import Graph


class Flat(NamedTuple):
    """Every op's operand and result tensor ids, flattened in op order, and every tensor's bytes."""

    n_in: np.ndarray       # (n,) operands per op
    n_out: np.ndarray      # (n,) results per op
    inputs: np.ndarray     # operand tensor ids, op by op
    outputs: np.ndarray    # result tensor ids, op by op
    nbytes: np.ndarray     # per tensor


def flat_ops(graph: Graph) -> Flat:
    """The :class:`Flat` view of ``graph``."""
    ins = [op.inputs for op in graph.ops]
    outs = [op.outputs for op in graph.ops]
    n_in = np.fromiter(map(len, ins), dtype=np.intp, count=len(ins))
    n_out = np.fromiter(map(len, outs), dtype=np.intp, count=len(outs))
    return Flat(n_in, n_out, np.fromiter(chain.from_iterable(ins), dtype=np.intp, count=int(n_in.sum())),
                np.fromiter(chain.from_iterable(outs), dtype=np.intp, count=int(n_out.sum())),
                np.array([math.prod(t.shape) * t.itemsize for t in graph.tensors], dtype=np.int64))


class Slots(NamedTuple):
    base: np.ndarray       # (n + 1,) first slot of each op's block; base[n] is the slot count
    n_in: np.ndarray       # (n,) operands per op
    e_in: np.ndarray       # per edge (consumer, operand order): the consumer's operand slot
    e_src: np.ndarray      # per edge: the producer's result slot
    e_bytes: np.ndarray    # per edge: the tensor's bytes
    ref_ptr: np.ndarray    # (n + 1,) each op's refs are ref_slot[ref_ptr[v]:ref_ptr[v + 1]]
    ref_slot: np.ndarray
    ref_pos: np.ndarray
    owner: np.ndarray      # per slot: the op whose block it is in

    def refs(self, v: int) -> list[int]:
        return self.ref_slot[self.ref_ptr[v]:self.ref_ptr[v + 1]].tolist()


def starts(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums with the total appended: where each of ``counts``' runs starts."""
    out = np.zeros(len(counts) + 1, dtype=np.intp)
    np.cumsum(counts, out=out[1:])
    return out


def slot_graph(graph: Graph, flat: Flat | None = None) -> Slots:
    """The :class:`Slots` of ``graph`` (``flat``: its :func:`flat_ops`, if already at hand)."""
    f = flat_ops(graph) if flat is None else flat
    n_in, n_out, flat_in, flat_out = f.n_in, f.n_out, f.inputs, f.outputs
    n = len(n_in)
    base = starts(n_in + n_out)
    owner = np.repeat(np.arange(n), n_in + n_out)
    # operand slots, then result slots, each in op order
    in_ptr, out_ptr = starts(n_in), starts(n_out)
    e_owner = np.repeat(np.arange(n), n_in)
    e_in = base[e_owner] + (np.arange(len(flat_in)) - in_ptr[e_owner])
    r_owner = np.repeat(np.arange(n), n_out)
    res_slot = np.zeros(len(f.nbytes), dtype=np.intp)
    res_slot[flat_out] = base[r_owner] + n_in[r_owner] + (np.arange(len(flat_out)) - out_ptr[r_owner])
    e_src = res_slot[flat_in]
    # refs: an edge is a ref of its consumer (the producer's slot) and of its producer (the
    # consumer's slot); a stable sort by owner keeps operands first, then edge order
    prod = owner[e_src]
    who = np.concatenate([e_owner, prod])
    order = np.argsort(who, kind="stable")
    ref_slot = np.concatenate([e_src, e_in])[order]
    ref_pos = np.concatenate([e_in - base[e_owner], e_src - base[prod]])[order]
    ref_ptr = starts(np.bincount(who, minlength=n))
    return Slots(base, n_in, e_in, e_src, f.nbytes[flat_in], ref_ptr, ref_slot, ref_pos, owner)
