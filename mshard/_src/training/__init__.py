"""Layer 6, training: training cells, gradient semantics, ZeRO, pipeline stages and schedules."""
