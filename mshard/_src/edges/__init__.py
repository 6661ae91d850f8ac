"""Layer 7, edges: what reads or writes the world around a program: checkpoints, reports, pictures, processes."""
