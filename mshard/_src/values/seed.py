"""MindSpore's global seed: ``set_seed`` / ``get_seed``, and the key stream that initialises parameters without an
explicit ``rngs`` (``Parameter(initializer("normal", ...))``, ``nn.Dense(4, 2)``).

>>> set_seed(1); a = next_key(); set_seed(1); bool((a == next_key()).all())
True
"""

from __future__ import annotations

import jax

from mshard._src.values.errors import ContextTypeError

_state = {"seed": 0, "count": 0}


def set_seed(seed: int) -> None:
    """Set the global seed (MindSpore's ``set_seed``): parameters initialised without ``rngs`` draw from it in order.

    Args:
        seed: a non-negative int.

    >>> set_seed(3); get_seed()
    3
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ContextTypeError(f"set_seed: seed must be a non-negative int, got {seed!r}.")
    _state["seed"], _state["count"] = seed, 0


def get_seed() -> int:
    """The global seed (0 until :func:`set_seed` is called).

    Returns:
        The seed last set.

    >>> set_seed(5); get_seed()
    5
    """
    return _state["seed"]


def next_key() -> jax.Array:
    """The next key of the global stream: ``fold_in(key(seed), n)`` for the n-th draw since the seed was set, so a
    script that builds the same model after the same ``set_seed`` gets the same parameters."""
    k = jax.random.fold_in(jax.random.key(_state["seed"]), _state["count"])
    _state["count"] += 1
    return k
