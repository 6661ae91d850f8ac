"""Layer 3, planning: mesh-axis assignment of user splits, the searched plan of a region, guards around XLA's
known miscompiles, flax's sharding metadata."""
