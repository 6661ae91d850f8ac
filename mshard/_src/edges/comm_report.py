"""``ms.comm_report``: the collectives of a region's compiled HLO — kind -> count and bytes.

Bytes are the per-device size of each collective's result buffer as compiled (tuple-shaped,
i.e. combined, collectives count once with all their elements); ``moved`` estimates the bytes
each device sends with ring algorithms from the replica-group size k (all-reduce 2S(k-1)/k,
all-gather S(k-1)/k of the gathered result, reduce-scatter S(k-1) of the scattered result,
all-to-all S(k-1)/k).

>>> import jax.numpy as jnp, mshard as ms
>>> print(ms.comm_report(ms.jit(lambda x: x * 2), jnp.ones(8)).total_count)
0
"""

from __future__ import annotations

from collections.abc import Callable

from flax import nnx

from mshard._src.frontend.cell import Cell, cell_region
from mshard._src.runtime.region import Region
from mshard._src.values.hlo import KINDS as KINDS
from mshard._src.values.hlo import Collective as Collective
from mshard._src.values.hlo import CommReport as CommReport


def hlo_text(f: Callable, *args) -> str:
    """Compiled HLO of any mshard callable (ms.jit region, shard-wrapped function, Cell) or a jax.jit function."""
    if hasattr(f, "lower"):               # ms.jit regions, shard-wrapped functions, TrainOneStepCell, jax.jit
        lowered = f.lower(*args)
    elif isinstance(f, Cell) and getattr(f, "_mshard_shard", None):
        lowered = cell_region(f).lower(f, *args)
    elif isinstance(f, nnx.Module):
        lowered = Region(lambda c, *a: c(*a)).lower(f, *args)
    else:
        lowered = Region(f).lower(*args)
    return lowered.compile().as_text()


def comm_report(f: Callable, *args) -> CommReport:
    """The collectives of ``f(*args)``'s compiled HLO, per kind: count, bytes and a ring estimate of bytes moved.

    Compiles ``f`` for ``args`` under the current context and runs nothing. Bytes are per device, as compiled
    (the module docstring says how they are counted). Not in MindSpore.

    Args:
        f: any mshard callable (``ms.jit`` region, shard-wrapped function, Cell, TrainOneStepCell) or a
            ``jax.jit`` function.
        *args: the arguments to compile ``f`` for (arrays or ``jax.ShapeDtypeStruct``s).

    Returns:
        A :class:`CommReport` (``count(kind)``, ``bytes(kind)``, ``by_kind``; ``print`` it for a table).

    >>> import jax.numpy as jnp, mshard as ms
    >>> with ms.parallel_context(parallel_mode="data_parallel", device_num=8):
    ...     r = ms.comm_report(ms.jit(lambda x: x.sum()), jnp.ones(16))
    >>> r.by_kind
    {'all-reduce': {'count': 1, 'bytes': 4, 'moved': 7.0}}
    """
    return CommReport.from_hlo(hlo_text(f, *args))
