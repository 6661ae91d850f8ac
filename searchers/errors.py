"""The errors the searchers raise: mshard's own hierarchy (``mshard.errors`` re-exports these), rooted here so
that the searchers, which never import JAX, raise mshard's types without importing the ``mshard`` package.

>>> from searchers.errors import SearchGraphError
>>> from searchers.graph import prime_factors
>>> try:
...     prime_factors(0)
... except SearchGraphError as e:
...     print(isinstance(e, ValueError), type(e).__mro__[2].__name__)
True MshardError
"""


class MshardError(Exception):
    """Base of every error mshard raises on purpose."""


class SearchError(MshardError, ValueError):
    """A strategy search that cannot run or finish."""


class SearchGraphError(SearchError):
    """A graph, mesh, strategy or generator argument the searchers cannot use (names the op and the bad value)."""


class SearchLimitError(SearchError):
    """A search beyond a limit: too many combinations, no plan within device_memory_capacity, no solution within
    the time limit."""
