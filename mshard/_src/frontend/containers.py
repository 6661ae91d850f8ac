"""MindSpore's Cell containers: ``nn.SequentialCell`` and ``nn.CellList`` over ``nnx.List``.

>>> import jax.numpy as jnp
>>> from mshard import nn
>>> nn.SequentialCell([nn.Dense(4, 3), nn.ReLU(), nn.Dense(3, 2)])(jnp.ones((5, 4))).shape
(5, 2)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from flax import nnx

from mshard._src.frontend.cell import Cell
from mshard._src.values.errors import CellTypeError


def _cells(args: tuple, where: str) -> list[nnx.Module]:
    items = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
    if len(args) == 1 and isinstance(args[0], dict):
        items = list(args[0].values())
    for i, c in enumerate(items):
        if not isinstance(c, nnx.Module):
            raise CellTypeError(f"{where}: item {i} is a {type(c).__name__}, not a Cell (an nnx Module); wrap a "
                                f"function in a Cell whose construct calls it.")
    return items


class CellList(Cell):
    """MindSpore's ``CellList(args=None)``: a list of Cells held as sub-Cells (their parameters are the list's,
    with paths ``cells.0.weight``, ...). Indexing, ``len``, iteration, ``append``, ``extend`` and ``insert``.

    Args:
        args: a list of Cells (or None for an empty list).

    >>> from mshard import nn
    >>> cl = nn.CellList([nn.Dense(2, 2)])
    >>> _ = cl.append(nn.ReLU())
    >>> len(cl), type(cl[1]).__name__
    (2, 'ReLU')
    """

    def __init__(self, args: Iterable[nnx.Module] | None = None):
        self.cells = nnx.List(_cells((list(args or ()),), "CellList"))

    def __getitem__(self, i: int) -> Any:
        return self.cells[i]

    def __len__(self) -> int:
        return len(self.cells)

    def __iter__(self) -> Iterator[nnx.Module]:
        return iter(self.cells)

    def append(self, cell: nnx.Module) -> CellList:
        """Add ``cell`` at the end (MindSpore's ``append``)."""
        self.cells.append(_cells((cell,), "CellList.append")[0])
        return self

    def extend(self, cells: Iterable[nnx.Module]) -> CellList:
        """Add every Cell of ``cells`` at the end."""
        for c in _cells((list(cells),), "CellList.extend"):
            self.cells.append(c)
        return self

    def insert(self, index: int, cell: nnx.Module) -> None:
        """Insert ``cell`` before position ``index``."""
        items = list(self.cells)
        items.insert(index, _cells((cell,), "CellList.insert")[0])
        self.cells = nnx.List(items)


class SequentialCell(CellList):
    """MindSpore's ``SequentialCell(*args)``: Cells called one after another, each on the previous one's output.
    Takes the Cells as arguments, as one list, or as an ordered dict (its values).

    Args:
        *args: the Cells, or one list / dict of them.

    >>> import jax.numpy as jnp
    >>> from mshard import nn
    >>> seq = nn.SequentialCell(nn.Dense(2, 3, weight_init="ones", bias_init="zeros"), nn.ReLU())
    >>> seq(jnp.ones((1, 2))).tolist(), len(seq)
    ([[2.0, 2.0, 2.0]], 2)
    """

    def __init__(self, *args: Any):
        self.cells = nnx.List(_cells(args, "SequentialCell"))

    def __call__(self, x):
        for c in self.cells:
            x = c(x)
        return x
