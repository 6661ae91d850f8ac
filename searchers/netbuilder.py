"""A small builder for synthetic training graphs: forward ops plus einsum-style backward ops.

The backward of an op with iteration space ``dims`` is, per operand ``k`` that needs a
gradient, one op over the *same* iteration space: its operands are the result gradient (mapped
like the result) and the forward operands the derivative needs (mapped as in the forward op);
its result is mapped like operand ``k``. So the gradient of a dot_general is the two transposed
dot_generals (dx = dy.W^T, dW = x^T.dy), the gradient of a reduction is a broadcast, the
gradient of a broadcast operand is a reduction. Tensors used several times get ``add`` ops that
accumulate their gradients; each parameter gets an update op (``sub``: w - lr*dw).

>>> from searchers.graph import DeviceMesh
>>> b = NetBuilder(DeviceMesh((2,)))
>>> x = b.data("x", (4, 8)); w = b.param("w", (8, 2))
>>> y = b.op("mm", "dot_general", {"m": 4, "k": 8, "n": 2}, [x, w], [("m", "k"), ("k", "n")], ("m", "n"))
>>> loss = b.op("loss", "reduce_sum", {"m": 4, "n": 2}, [y], [("m", "n")], ())
>>> g = b.backward(loss)
>>> [op.name for op in g.ops]
['x', 'w', 'mm', 'loss', 'loss/seed', 'loss/grad0', 'mm/grad1', 'w/update']
>>> g.ops[6].in_dims, g.ops[6].out_dims      # dW = dy . x, reduction over m
([('m', 'n'), ('m', 'k')], [('k', 'n')])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .graph import DeviceMesh, Graph, Op

# Which forward operands a gradient op reads besides the result gradient:
# "others": every operand but the one differentiated; "all": every operand; "none": none.
_NEEDS = {"dot_general": "others", "conv_general_dilated": "others", "mul": "others", "div": "all",
          "add": "none", "sub": "none", "reduce_sum": "none", "broadcast_in_dim": "none",
          "transpose": "none", "neg": "none"}
_GRAD_KIND = {"dot_general": "dot_general", "conv_general_dilated": "conv_general_dilated",
              "reduce_sum": "broadcast_in_dim", "reduce_max": "select_n", "reduce_window_max": "select_n",
              "transpose": "transpose", "sub": "neg", "neg": "neg"}


class NetBuilder:
    """Builds a :class:`~searchers.graph.Graph` op by op; ``layer`` and ``scope`` label what follows."""

    def __init__(self, mesh: DeviceMesh, *, itemsize: int = 4):
        self.graph = Graph(mesh)
        self.itemsize = itemsize
        self.layer: str | None = None
        self.scope = ""
        self._tape: list[int] = []           # forward op ids whose result needs a gradient
        self._needs_grad: set[int] = set()   # tensor ids
        self._params: list[int] = []         # tensor ids

    def _name(self, name: str) -> str:
        return f"{self.scope}/{name}" if self.scope else name

    def _source(self, name: str, shape: Sequence[int], kind: str) -> int:
        tid = self.graph.source(self._name(name), shape, kind=kind, itemsize=self.itemsize)
        self.graph.ops[-1].layer = self.layer
        return tid

    def data(self, name: str, shape: Sequence[int]) -> int:
        return self._source(name, shape, "data")

    def const(self, name: str, shape: Sequence[int]) -> int:
        return self._source(name, shape, "const")

    def param(self, name: str, shape: Sequence[int]) -> int:
        tid = self._source(name, shape, "param")
        self._needs_grad.add(tid)
        self._params.append(tid)
        return tid

    def op(self, name: str, kind: str, dims: dict[str, int], inputs: Sequence[int],
           in_dims: Sequence[Sequence[str | None]], out_dims: Sequence[str | None],
           out_shape: Sequence[int] | None = None, **kw: Any) -> int:
        """Add a one-result op; returns the result tensor id."""
        shapes = None if out_shape is None else [out_shape]
        (tid,) = self.graph.add_op(self._name(name), kind, dims, inputs, in_dims, [tuple(out_dims)],
                                   out_shapes=shapes, itemsize=self.itemsize, layer=self.layer, **kw)
        if any(t in self._needs_grad for t in inputs):
            self._needs_grad.add(tid)
            self._tape.append(self.graph.ops[-1].id)
        return tid

    def elementwise(self, name: str, kind: str, inputs: Sequence[int]) -> int:
        """Same-shape elementwise op over generic dims ``a0, a1, ...``."""
        shape = self.graph.tensors[inputs[0]].shape
        names = tuple(f"a{i}" for i in range(len(shape)))
        return self.op(name, kind, dict(zip(names, shape)), inputs, [names] * len(inputs), names)

    # -- backward ---------------------------------------------------------------------------
    def backward(self, loss: int, *, update: bool = True) -> Graph:
        """Append the backward pass of scalar ``loss`` (and parameter updates); returns the graph."""
        g = self.graph
        grads: dict[int, list[int]] = {}
        self.layer = g.producer(loss).layer
        self.scope = g.producer(loss).name
        grads[loss] = [self.const("seed", g.tensors[loss].shape)]
        self.scope = ""
        for op_id in reversed(self._tape):
            fwd = g.ops[op_id]
            (y,) = fwd.outputs
            if y not in grads:
                continue
            self.layer = f"{fwd.layer}/bwd" if fwd.layer else None
            gy = self._accumulate(f"{fwd.name}/grad_acc", grads.pop(y))
            for k, x in enumerate(fwd.inputs):
                if x in self._needs_grad:
                    grads.setdefault(x, []).append(self._grad(fwd, k, gy))
        for p in self._params:
            if p in grads:
                player = g.producer(p).layer
                self.layer = f"{player}/update" if player else None
                gp = self._accumulate(f"{g.tensors[p].name}/grad_acc", grads.pop(p))
                if update:
                    g.outputs.append(self.elementwise(f"{g.tensors[p].name}/update", "sub", [p, gp]))
                else:
                    g.outputs.append(gp)
        self.layer = None
        return g

    def _accumulate(self, name: str, parts: list[int]) -> int:
        acc = parts[0]
        for i, t in enumerate(parts[1:]):
            acc = self._raw_elementwise(f"{name}{i}" if i else name, "add", [acc, t])
        return acc

    def _raw_elementwise(self, name: str, kind: str, inputs: Sequence[int]) -> int:
        shape = self.graph.tensors[inputs[0]].shape
        names = tuple(f"a{i}" for i in range(len(shape)))
        (tid,) = self.graph.add_op(name, kind, dict(zip(names, shape)), inputs, [names] * len(inputs),
                                   [names], itemsize=self.itemsize, layer=self.layer)
        return tid

    def _grad(self, fwd: Op, k: int, gy: int) -> int:
        needs = _NEEDS.get(fwd.kind, "all")
        if needs == "none" and fwd.kind in ("add",) and fwd.in_dims[k] == fwd.out_dims[0]:
            return gy                                   # d(a+b)/da = identity
        others = [] if needs == "none" else [i for i in range(len(fwd.inputs)) if needs == "all" or i != k]
        inputs = [gy] + [fwd.inputs[i] for i in others]
        in_dims = [fwd.out_dims[0]] + [fwd.in_dims[i] for i in others]
        x = self.graph.tensors[fwd.inputs[k]]
        kind = _GRAD_KIND.get(fwd.kind, "mul")
        if fwd.kind in ("add", "reduce_sum") and fwd.in_dims[k] != fwd.out_dims[0]:
            kind = "reduce_sum" if fwd.kind == "add" else "broadcast_in_dim"
        (tid,) = self.graph.add_op(f"{fwd.name}/grad{k}", kind, dict(fwd.dims), inputs, in_dims,
                                   [fwd.in_dims[k]], out_shapes=[x.shape], itemsize=self.itemsize,
                                   unsplittable=fwd.unsplittable, layer=self.layer)
        return tid
