"""Layer 4, runtime: emitting a planned program, regions (``ms.jit``), the fast call path, dry runs, datasets,
communication fusion."""
