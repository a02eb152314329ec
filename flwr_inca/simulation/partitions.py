"""Client data: one copy of the training set and each client's example indices.

``iid`` splits a random permutation into equal shares; ``dirichlet`` gives each class's examples to
the clients in proportions drawn from Dirichlet(alpha) (label skew, Hsu et al. 2019); ``from_indices``
takes the user's lists. Every client must hold at least one example.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._checks import check_int, check_real

__all__ = ["Partitions", "iid", "dirichlet", "from_indices"]


@dataclass(frozen=True)
class Partitions:
    """The training data and which rows each client holds.

    Attributes:
        x: (N, ...) features (float32 is what models expect).
        y: (N,) labels (or targets).
        indices: one int64 array of row indices per client.
        name: how the split was made (for the output).
    """

    x: np.ndarray
    y: np.ndarray
    indices: tuple[np.ndarray, ...]
    name: str = "user"

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"partitions: x has {len(self.x)} rows but y has {len(self.y)}")
        if len(self.indices) < 2:
            raise ValueError(f"partitions: need at least 2 clients, got {len(self.indices)}")
        n = len(self.y)
        for c, idx in enumerate(self.indices):
            if idx.ndim != 1 or idx.size == 0:
                raise ValueError(f"partitions: client {c} must hold a non-empty list of row indices")
            if idx.min() < 0 or idx.max() >= n:
                raise ValueError(f"partitions: client {c} has row indices outside [0, {n - 1}]")

    @property
    def clients(self) -> int:
        return len(self.indices)

    def sizes(self) -> np.ndarray:
        return np.array([idx.size for idx in self.indices], dtype=np.int64)

    def client(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        """The features and labels of client ``c``."""
        return self.x[self.indices[c]], self.y[self.indices[c]]


def _check_clients(num_clients: int, n: int) -> int:
    num_clients = check_int("num_clients", num_clients, 2)
    if num_clients > n:
        raise ValueError(f"num_clients = {num_clients} exceeds the {n} training examples")
    return int(num_clients)


def iid(x: np.ndarray, y: np.ndarray, num_clients: int, seed: int = 12345) -> Partitions:
    """Equal shares of a random permutation (the MNIST example's split for the same seed)."""
    num_clients = _check_clients(num_clients, len(y))
    perm = np.random.default_rng(seed).permutation(len(y))
    parts = tuple(p.astype(np.int64) for p in np.array_split(perm, num_clients))
    return Partitions(x, y, parts, f"iid ({num_clients} clients)")


def dirichlet(
    x: np.ndarray, y: np.ndarray, num_clients: int, alpha: float, seed: int = 12345, min_size: int = 1
) -> Partitions:
    """Label skew: class k's examples go to the clients in proportions ~ Dirichlet(alpha).

    Small alpha gives each client few classes. Draws are repeated (at most 100 times) until every
    client holds at least ``min_size`` examples.
    """
    num_clients = _check_clients(num_clients, len(y))
    alpha = check_real("alpha (Dirichlet concentration)", alpha, 0.0, low_open=True)
    labels = np.asarray(y)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for k in classes:
            rows = rng.permutation(np.flatnonzero(labels == k))
            share = rng.dirichlet(np.full(num_clients, float(alpha)))
            cuts = (np.cumsum(share)[:-1] * rows.size).astype(np.int64)
            for c, chunk in enumerate(np.split(rows, cuts)):
                parts[c].append(chunk)
        out = tuple(np.sort(np.concatenate(p)).astype(np.int64) for p in parts)
        if min(p.size for p in out) >= min_size:
            return Partitions(x, y, out, f"dirichlet(alpha={alpha:g}, {num_clients} clients)")
    raise ValueError(
        f"dirichlet: could not give every one of {num_clients} clients {min_size} example(s) "
        f"with alpha = {alpha:g}; use fewer clients or a larger alpha"
    )


def from_indices(x: np.ndarray, y: np.ndarray, indices: Sequence[Sequence[int]]) -> Partitions:
    """The user's split: ``indices[c]`` lists the rows of client ``c``."""
    parts = []
    for c, idx in enumerate(indices):
        arr = np.asarray(idx)
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"partitions: client {c}'s indices must be integers, got dtype {arr.dtype}")
        parts.append(arr.astype(np.int64).reshape(-1))
    return Partitions(x, y, tuple(parts), f"user ({len(parts)} clients)")
