"""What every searcher returns.

>>> r = SearchResult({0: ((),)}, Cost(), "replicate", 0.0)
>>> r.algorithm, r.notes
('replicate', [])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .cost import Cost
from .graph import Strategy


@dataclass
class SearchResult:
    """A searcher's answer: a strategy per op id, its predicted :class:`~searchers.cost.Cost`
    (:func:`~searchers.cost.graph_cost` of those strategies), the algorithm's name, the wall
    time of the search in seconds, and human-readable notes (fallbacks, limits hit, ...)."""

    strategies: dict[int, Strategy]
    cost: Cost
    algorithm: str
    seconds: float
    notes: list[str] = field(default_factory=list)
