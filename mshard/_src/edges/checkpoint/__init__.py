"""Distributed checkpoints: the on-disk store (orbax), checksums, what a checkpoint holds, save/load and MindSpore's
distributed-checkpoint names, the step manager, inference layouts."""
