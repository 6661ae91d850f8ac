"""``ms.visualize``: where a tensor lives — every distinct shard, its index ranges in each dim, the devices that
hold it and their coordinates on the named mesh axes, for any rank (``jax.debug.visualize_array_sharding`` draws
rank 1 and 2 only, without axis names).

>>> import jax, numpy as np
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> mesh = jax.make_mesh((2, 4), ("dp", "mp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
>>> v = visualize(jax.device_put(np.zeros((4, 8, 4)), NamedSharding(mesh, P("dp", None, "mp"))))
>>> v.shard_shape, len(v.rows), v.rows[0]["slices"]
((2, 8, 1), 8, '[0:2, :, 0:1]')
"""

from __future__ import annotations

import html
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from rich.console import Console
from rich.table import Table

from mshard._src.values.errors import LayoutError, StrategyTypeError

__all__ = ["ShardingView", "visualize"]


def _fmt(sl: slice, n: int) -> str:
    start, stop, _ = sl.indices(n)
    return ":" if (start, stop) == (0, n) else f"{start}:{stop}"


class ShardingView:
    """The shards of one tensor: ``rows`` (one per distinct shard: ``slices``, ``devices``, ``coords``), and a
    rich table in a terminal, an HTML table in a notebook, plain text from ``str``."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding):
        self.shape, self.dtype, self.sharding = tuple(shape), dtype, sharding
        self.shard_shape = tuple(sharding.shard_shape(self.shape))
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) else None
        where = {}
        if mesh is not None:
            for pos, d in np.ndenumerate(mesh.devices):
                where[d.id] = ", ".join(f"{a}={i}" for a, i in zip(mesh.axis_names, pos))
        groups: dict[tuple, list] = {}
        for dev, idx in sharding.devices_indices_map(self.shape).items():
            key = tuple(slice(*s.indices(n)[:2]) for s, n in zip(idx, self.shape))
            groups.setdefault(tuple((s.start, s.stop) for s in key), []).append(dev)
        self.rows = []
        for key, devs in sorted(groups.items()):
            devs = sorted(devs, key=lambda d: d.id)
            self.rows.append({
                "slices": "[" + ", ".join(_fmt(slice(a, b), n) for (a, b), n in zip(key, self.shape)) + "]",
                "devices": [d.id for d in devs],
                "coords": "; ".join(where.get(d.id, "") for d in devs if where.get(d.id))})
        self.title = (f"{self.shape} {np.dtype(dtype).name}: {len(self.rows)} shard(s) of {self.shard_shape}, each on "
                      f"{len(self.rows[0]['devices']) if self.rows else 0} device(s)")
        if mesh is not None:
            self.title += f"; spec {sharding.spec} on mesh {dict(zip(mesh.axis_names, mesh.devices.shape))}"

    def __rich__(self):
        t = Table(title=self.title)
        for col in ("shard", "index ranges", "devices", "mesh coordinates"):
            t.add_column(col)
        for i, r in enumerate(self.rows):
            t.add_row(str(i), r["slices"], ", ".join(map(str, r["devices"])), r["coords"])
        return t

    def __str__(self) -> str:
        console = Console(width=140, record=True, force_terminal=False, force_jupyter=False, color_system=None)
        with console.capture() as cap:
            console.print(self.__rich__())
        return cap.get()

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{i}</td><td>{html.escape(r['slices'])}</td><td>{', '.join(map(str, r['devices']))}"
                       f"</td><td>{html.escape(r['coords'])}</td></tr>" for i, r in enumerate(self.rows))
        return (f"<b>{html.escape(self.title)}</b><table><tr><th>shard</th><th>index ranges</th><th>devices</th>"
                f"<th>mesh coordinates</th></tr>{rows}</table>")

    def __repr__(self) -> str:
        return f"ShardingView({self.title})"


def visualize(x: Any, shape: tuple[int, ...] | None = None) -> ShardingView:
    """Where a tensor lives: every distinct shard, its index ranges, the devices that hold it and their mesh
    coordinates. Prints nothing: ``print(ms.visualize(w))`` in a script, a table in a notebook.

    Not in MindSpore; unlike ``jax.debug.visualize_array_sharding`` it takes any rank and names the mesh axes.

    Args:
        x: a ``jax.Array``, a ``jax.ShapeDtypeStruct`` with a sharding, or a ``jax.sharding.Sharding``.
        shape: the tensor's shape; required when ``x`` is a Sharding, ignored otherwise.

    Returns:
        A :class:`ShardingView`: ``shard_shape``, and ``rows`` (one per distinct shard: ``slices``, ``devices``,
        ``coords``).

    >>> import jax
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((8,), ("dp",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> v = visualize(NamedSharding(mesh, P("dp")), shape=(16, 4))
    >>> v.shard_shape, len(v.rows), v.rows[1]
    ((2, 4), 8, {'slices': '[2:4, :]', 'devices': [1], 'coords': 'dp=1'})
    """
    if isinstance(x, jax.sharding.Sharding):
        if shape is None:
            raise StrategyTypeError("ms.visualize: a Sharding needs the tensor's shape: visualize(sharding, shape=(...)).")
        return ShardingView(tuple(shape), np.float32, x)
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        raise StrategyTypeError(f"ms.visualize: {type(x).__name__} has no sharding; pass a jax.Array, a ShapeDtypeStruct with "
                         f"sharding=..., or a Sharding and a shape.")
    for d, (n, s) in enumerate(zip(x.shape, sharding.shard_shape(x.shape))):
        if n % s:
            raise LayoutError(f"ms.visualize: dim {d} of size {n} does not split evenly into shards of {s}.")
    return ShardingView(tuple(x.shape), x.dtype, sharding)
