"""A small synthetic classification task shared by the simulator's tests: FEATURES inputs, CLASSES
classes, labels from a random linear model plus a little noise (so a linear model can learn them)."""

import numpy as np

FEATURES, CLASSES = 12, 3


def linear_task(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x (n, FEATURES) float32, y (n,) int64), the same for the same seed."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((FEATURES, CLASSES))
    x = rng.standard_normal((n, FEATURES)).astype(np.float32)
    y = np.argmax(x @ w + 0.3 * rng.standard_normal((n, CLASSES)), axis=1).astype(np.int64)
    return x, y
