"""Layer 5, front end: what a user writes: ``ms.shard``, primitive objects, Cells, layers, losses, ``AutoParallel``."""
