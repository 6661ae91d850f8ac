"""MindSpore's ``ops.Print()``: print strings and tensors, eagerly or from inside a compiled step.

>>> import jax.numpy as jnp
>>> from mshard._src.frontend.debug_print import Print
>>> Print()("x:", jnp.arange(3))
x: [0 1 2]
"""

from __future__ import annotations

from typing import Any

import jax

from mshard._src.jaxpr.marks import has_tracers


class Print:
    """``ops.Print()(*inputs)``: print the inputs (strings and tensors) separated by spaces.

    Outside a compiled region it prints at once; inside one (``ms.jit``, a training step) it prints each time the
    compiled program runs (``jax.debug.print``), with the tensors' values of that run. Returns None.

    Args:
        none: the primitive takes no arguments; the call takes the things to print.

    >>> import jax.numpy as jnp
    >>> from mshard import ops
    >>> ops.Print()("loss", jnp.float32(0.5))
    loss 0.5
    """

    def __call__(self, *inputs: Any) -> None:
        if not has_tracers(inputs):
            print(*inputs)
            return None
        fmt = " ".join("{}" for _ in inputs)
        jax.debug.print(fmt, *inputs)
        return None
