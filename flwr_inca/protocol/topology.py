"""Communication topologies: who sends to whom at each mixing iteration, and with which weight.

A topology produces, for iteration t, the *attempted* messages as three aligned arrays
``(senders, receivers, weights)``: receiver aggregates the sender's ``y^(t-1)`` with that weight
(``W_t[receiver, sender]``). The sender keeps ``1 - sum(weights it sends)``, so every ``W_t`` is
column stochastic (paper Eq. (3)); this is checked for every iteration.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from .._checks import check_int

__all__ = [
    "Messages",
    "Topology",
    "RandomNeighbors",
    "StaticTopology",
    "EdgeSchedule",
    "resolve_topology",
    "check_column_stochastic",
]

_WEIGHT_TOL = 1e-9


@dataclass(frozen=True)
class Messages:
    """Messages of one iteration: ``W[receivers[m], senders[m]] = weights[m]``."""

    senders: np.ndarray  # int64 (m,)
    receivers: np.ndarray  # int64 (m,)
    weights: np.ndarray  # float64 (m,)

    def __len__(self) -> int:
        return int(self.senders.shape[0])


class Topology(ABC):
    """Source of attempted messages. Stateless: per-run state lives in the iterator."""

    @abstractmethod
    def iterate(self, n: int, iterations: int, rng: np.random.Generator) -> Iterator[Messages]:
        """Yield the attempted messages of iterations 1..T among ``n`` parties (``rng``: the run's
        topology stream)."""

    def check(self, n: int, iterations: int | None = None) -> None:
        """Raise ``ValueError`` if this topology cannot run with ``n`` parties for ``iterations``."""

    @property
    def static(self) -> bool:
        """True when every iteration uses the same messages (paper Thm 4.9's setting)."""
        return False


class RandomNeighbors(Topology):
    """Each party picks ``k`` distinct out-neighbours other than itself, uniformly, every iteration.

    Weights are ``1/(k+1)`` to each out-neighbour and to itself (paper Sec. 5). With ``fresh=True``
    a party never picks a neighbour it picked in an earlier iteration (paper Fig. 2), which needs
    ``k * T <= n - 1``.
    """

    def __init__(self, k: int = 1, fresh: bool = False) -> None:
        self.k = check_int("neighbors", k)
        self.fresh = bool(fresh)

    def check(self, n: int, iterations: int | None = None) -> None:
        if self.k >= n:
            raise ValueError(f"neighbors must be in [1, n-1] = [1, {n - 1}], got {self.k}")
        if self.fresh and iterations is not None and self.k * iterations > n - 1:
            raise ValueError(
                f"fresh neighbours need neighbors * iterations <= n - 1, got {self.k} * {iterations} "
                f"> {n - 1}"
            )

    def iterate(self, n: int, iterations: int, rng: np.random.Generator) -> Iterator[Messages]:
        self.check(n, iterations)
        k = self.k
        senders = np.repeat(np.arange(n, dtype=np.int64), k)
        weights = np.full(senders.shape[0], 1.0 / (k + 1))
        history = np.empty((n, 0), dtype=np.int64)
        for _ in range(iterations):
            picks = _distinct_picks(n, k, rng, history if self.fresh else None)
            if self.fresh:
                history = np.concatenate([history, picks], axis=1)
            yield Messages(senders, picks.reshape(-1), weights)

    def __repr__(self) -> str:
        return f"RandomNeighbors(k={self.k}, fresh={self.fresh})"


def _distinct_picks(
    n: int, k: int, rng: np.random.Generator, history: np.ndarray | None
) -> np.ndarray:
    """(n, k) receivers: distinct per row, never the row's own index, never in ``history[row]``.

    Rejection sampling, vectorized over parties: conflicting entries are redrawn uniformly among
    the other n-1 parties, which keeps every row a uniform k-subset.
    """
    own = np.arange(n, dtype=np.int64)[:, None]
    picks = (own + rng.integers(1, n, size=(n, k))) % n  # uniform over the other n-1 parties
    for _ in range(10_000):
        bad = np.zeros((n, k), dtype=bool)
        for j in range(1, k):  # a later copy of an earlier pick in the same row
            bad[:, j] |= np.any(picks[:, j : j + 1] == picks[:, :j], axis=1)
        if history is not None and history.shape[1] > 0:
            bad |= np.any(picks[:, :, None] == history[:, None, :], axis=2)
        rows, cols = np.nonzero(bad)
        if rows.size == 0:
            return picks
        picks[rows, cols] = (rows + rng.integers(1, n, size=rows.size)) % n
    raise RuntimeError("could not sample distinct neighbours")  # pragma: no cover - probability ~0


class StaticTopology(Topology):
    """The same directed edges at every iteration; default weights ``1/(deg_out(sender)+1)``."""

    def __init__(
        self,
        edges: Iterable[Sequence[float]],
        n: int | None = None,
        name: str = "edges",
    ) -> None:
        self.name = name
        self._messages = _edges_to_messages(edges, n, "edges")
        self._n = n

    @property
    def static(self) -> bool:
        return True

    def check(self, n: int, iterations: int | None = None) -> None:
        if self._n is not None and self._n != n:
            raise ValueError(f"topology {self.name!r} was built for {self._n} parties, got n={n}")
        if len(self._messages) and int(max(self._messages.senders.max(), self._messages.receivers.max())) >= n:
            raise ValueError(f"topology {self.name!r} names a party >= n = {n}")
        check_column_stochastic(self._messages, n, where=f"topology {self.name!r}")

    def iterate(self, n: int, iterations: int, rng: np.random.Generator) -> Iterator[Messages]:
        self.check(n, iterations)
        for _ in range(iterations):
            yield self._messages

    # -------------------------------------------------------------- named graphs
    @classmethod
    def ring(cls, n: int) -> StaticTopology:
        """Undirected ring: i sends to i-1 and i+1 (weights 1/3)."""
        _check_n(n)
        i = np.arange(n)
        nb = np.unique(np.stack([np.stack([i, (i + 1) % n], 1), np.stack([i, (i - 1) % n], 1)]).reshape(-1, 2), axis=0)
        nb = nb[nb[:, 0] != nb[:, 1]]
        return cls(nb.tolist(), n, "ring")

    @classmethod
    def hypercube(cls, n: int) -> StaticTopology:
        """Hypercube on n = 2^m parties: i sends to the m parties differing in one bit."""
        _check_n(n)
        m = int(round(np.log2(n)))
        if 2**m != n:
            raise ValueError(f"hypercube topology needs n to be a power of 2, got n={n}")
        i = np.arange(n)
        edges = np.concatenate([np.stack([i, i ^ (1 << b)], 1) for b in range(m)])
        return cls(edges.tolist(), n, "hypercube")

    @classmethod
    def complete(cls, n: int) -> StaticTopology:
        """Everyone sends to everyone (weights 1/n)."""
        _check_n(n)
        i, j = np.nonzero(~np.eye(n, dtype=bool))
        return cls(np.stack([i, j], 1).tolist(), n, "complete")

    @classmethod
    def erdos_renyi(cls, n: int, p: float, seed: int | None = 0) -> StaticTopology:
        """Undirected Erdős–Rényi G(n, p), sampled once with ``seed``."""
        _check_n(n)
        if not (0.0 < p <= 1.0) or not np.isfinite(p):
            raise ValueError(f"erdos_renyi: edge probability p must be in (0, 1], got {p!r}")
        rng = np.random.default_rng(seed)
        upper = np.triu(rng.random((n, n)) < p, k=1)
        i, j = np.nonzero(upper | upper.T)
        return cls(np.stack([i, j], 1).tolist(), n, f"erdos_renyi(p={p})")

    def __repr__(self) -> str:
        return f"StaticTopology({self.name!r}, messages={len(self._messages)})"


class EdgeSchedule(Topology):
    """User-supplied, possibly time-varying, edge lists: ``edges_per_iteration[t-1]`` for iteration t."""

    def __init__(self, edges_per_iteration: Sequence[Iterable[Sequence[float]]], n: int | None = None) -> None:
        if len(edges_per_iteration) == 0:
            raise ValueError("edges_per_iteration must hold one edge list per iteration, got none")
        self._steps = [_edges_to_messages(e, n, f"edges_per_iteration[{t}]") for t, e in enumerate(edges_per_iteration)]
        self._n = n

    def check(self, n: int, iterations: int | None = None) -> None:
        if iterations is not None and len(self._steps) != iterations:
            raise ValueError(
                f"edges_per_iteration has {len(self._steps)} entries, expected iterations = {iterations}"
            )
        for t, m in enumerate(self._steps):
            if len(m) and int(max(m.senders.max(), m.receivers.max())) >= n:
                raise ValueError(f"edges_per_iteration[{t}] names a party >= n = {n}")
            check_column_stochastic(m, n, where=f"edges_per_iteration[{t}]")

    def iterate(self, n: int, iterations: int, rng: np.random.Generator) -> Iterator[Messages]:
        self.check(n, iterations)
        yield from self._steps


def resolve_topology(topology: str | Topology, neighbors: int, n: int, seed: int | None = 0) -> Topology:
    """Build a topology from a name (``random``, ``random-fresh``, ``ring``, ``hypercube``,
    ``complete``, ``erdos-renyi:<p>``) or return the given instance."""
    if isinstance(topology, Topology):
        return topology
    if topology == "random":
        return RandomNeighbors(neighbors, fresh=False)
    if topology == "random-fresh":
        return RandomNeighbors(neighbors, fresh=True)
    if topology == "ring":
        return StaticTopology.ring(n)
    if topology == "hypercube":
        return StaticTopology.hypercube(n)
    if topology == "complete":
        return StaticTopology.complete(n)
    if isinstance(topology, str) and topology.startswith("erdos-renyi"):
        _, _, p = topology.partition(":")
        try:
            prob = float(p) if p else 0.2
        except ValueError:
            raise ValueError(f"topology: expected 'erdos-renyi:<p>', got {topology!r}") from None
        return StaticTopology.erdos_renyi(n, prob, seed)
    raise ValueError(
        "topology: expected 'random', 'random-fresh', 'ring', 'hypercube', 'complete', "
        f"'erdos-renyi:<p>' or a Topology, got {topology!r}"
    )


def check_column_stochastic(messages: Messages, n: int, where: str = "W_t") -> np.ndarray:
    """Validate one iteration's messages; return each party's self weight ``1 - sum(out weights)``.

    Raises ``ValueError`` for self-messages, duplicate (sender, receiver) pairs, weights outside
    (0, 1], or a sender whose out-weights exceed 1 (which would make ``W_t`` not column stochastic).
    """
    s, r, w = messages.senders, messages.receivers, messages.weights
    if s.size == 0:
        return np.ones(n)
    if s.min() < 0 or r.min() < 0 or s.max() >= n or r.max() >= n:
        raise ValueError(f"{where}: party indices must be in [0, {n - 1}]")
    if np.any(s == r):
        raise ValueError(f"{where}: a party cannot send a message to itself (its weight is implicit)")
    if not np.all(np.isfinite(w)) or np.any(w <= 0) or np.any(w > 1):
        raise ValueError(f"{where}: message weights must be in (0, 1]")
    pair = s * n + r
    if np.unique(pair).size != pair.size:
        raise ValueError(f"{where}: duplicate (sender, receiver) message")
    out = np.bincount(s, weights=w, minlength=n)
    if np.any(out > 1 + _WEIGHT_TOL):
        j = int(np.argmax(out))
        raise ValueError(
            f"{where}: not column stochastic: party {j} sends total weight {out[j]:.12g} > 1"
        )
    return np.maximum(1.0 - out, 0.0)


def _edges_to_messages(edges: Iterable[Sequence[float]], n: int | None, where: str) -> Messages:
    rows = [tuple(e) for e in edges]
    if any(len(e) not in (2, 3) for e in rows):
        raise ValueError(f"{where}: each edge must be (sender, receiver) or (sender, receiver, weight)")
    if not rows:
        return Messages(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    s = np.array([e[0] for e in rows])
    r = np.array([e[1] for e in rows])
    if not (np.all(s == np.round(s)) and np.all(r == np.round(r))):
        raise ValueError(f"{where}: sender and receiver must be integers")
    s = s.astype(np.int64)
    r = r.astype(np.int64)
    if all(len(e) == 3 for e in rows):
        w = np.array([float(e[2]) for e in rows])
    elif any(len(e) == 3 for e in rows):
        raise ValueError(f"{where}: give a weight for every edge or for none")
    else:
        deg = np.bincount(s, minlength=int(s.max()) + 1)
        w = 1.0 / (deg[s] + 1.0)
    m = Messages(s, r, w)
    size = n if n is not None else int(max(s.max(), r.max())) + 1
    check_column_stochastic(m, size, where=where)
    return m


def _check_n(n: int) -> None:
    check_int("n (number of parties)", n, 2)
