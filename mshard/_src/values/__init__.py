"""Layer 1, values: errors, the parallel context, layouts and their legality check, the plan value, the HLO parser,
process agreement and joining. No tracing here."""
