"""What the MindSpore-style scripts share: MNIST's shapes in memory (the tutorials' reader replaced)."""

import numpy as np


class FakeMnist:
    """Random images [1, 28, 28] float32 and labels int32, indexable like MindSpore's sources."""

    def __init__(self, n=128, seed=0):
        rng = np.random.default_rng(seed)
        self.images = rng.normal(size=(n, 1, 28, 28)).astype(np.float32)
        self.labels = rng.integers(0, 10, size=(n,)).astype(np.int32)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]

    def __len__(self):
        return len(self.labels)
