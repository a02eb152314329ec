"""Pairwise-noise aggregation (paper App. D.3, Algorithm 4): GOPA and CorDP-DME.

Each edge {i, j} (i < j) of an undirected graph carries a pairwise term ``p_ij ~ N(0, sigma_delta^2)``
that j adds and i subtracts; each party also adds its own ``eta*_i ~ N(0, sigma_star^2)`` and
publishes ``x_i^p = x_i + eta*_i + sum_{j < i} p_ij - sum_{j > i} p_ij``; the sum of what was
published is the estimate's numerator, in which the pairwise terms cancel.

Dropouts break the cancellation. A party that drops out before publishing (``dropped_before``,
a fraction gamma_1) leaves the terms it shares with publishing neighbours uncancelled:

* **GOPA** (Sabater et al. 2022): k_PR random neighbours per party and a **roll-back** round in which
  every publishing party removes (reveals) the terms it shares with neighbours that did not publish.
  A party that drops out *during* the roll-back (``dropped_rollback``, a fraction gamma_2) has
  published but does not roll back: its terms with the first-phase dropouts stay.
* **CorDP-DME** (Vithana et al. 2025, as the paper runs it): the complete graph and no roll-back.

Both use the same two noise scales as IncA's analysis (sigma_star on ``x + eta*``, sigma_delta on
every other term), so their adversary views are :class:`ObservationModel` s in the same form and the
same exact certificate calibrates them.

The adversary of Collusion DP knows the graph, the dropouts, every published value, every revealed
(rolled-back) term, and the values, noise and pairwise terms of the corrupted parties. What is left is
``y_r = x~_i + sum_e s(i, e) p_e`` over the published honest parties i, with the unknown p_e those of
edges between two honest parties that were not revealed: ``H`` selects the published honest parties
(``G_B = I``) and ``G_A = A A^T`` with A the signed incidence matrix of those edges. Eavesdropping
reveals nothing more than what is published (the terms travel on secure channels), so an eavesdropper
is the coalition of nobody.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import scipy.sparse as sp

from .._checks import check_bytes
from ..privacy.linear_system import ObservationModel
from ..protocol.topology import RandomNeighbors
from .base import (
    BaselineResult,
    LinearGaussianBaseline,
    OutputWeights,
    Threat,
    as_values,
    check_positive_int,
    check_sigma,
    honest_mask,
    noise_rng,
    random_corrupted,
    shaped,
)

__all__ = [
    "GOPA",
    "CorDPDME",
    "PairwiseExecution",
    "complete_edges",
    "k_out_edges",
    "pairwise_estimate",
    "pairwise_masked_values",
    "pairwise_model",
    "uncancelled_estimate",
]

_TAG_GRAPH, _TAG_DROPOUT, _TAG_STAR, _TAG_PAIR = 11, 12, 13, 14


@dataclass(frozen=True)
class PairwiseExecution:
    """One run of Algorithm 4 without values or noise: the graph and who dropped out when.

    Attributes:
        parties: n.
        edges: (E, 2) int64, ``edges[e] = (i, j)`` with ``i < j``; j adds ``p_e``, i subtracts it.
        dropped_before: (n,) bool, did not publish (the first-phase dropouts).
        dropped_rollback: (n,) bool, published but dropped out during the roll-back round.
        rollback: whether the protocol has a roll-back round (GOPA) or not (CorDP-DME).
    """

    parties: int
    edges: np.ndarray
    dropped_before: np.ndarray
    dropped_rollback: np.ndarray
    rollback: bool

    def __post_init__(self) -> None:
        n = check_positive_int("parties", self.parties, 2)
        e = np.asarray(self.edges)
        if e.ndim != 2 or e.shape[1] != 2 or (e.size and (e.min() < 0 or e.max() >= n or np.any(e[:, 0] >= e[:, 1]))):
            raise ValueError(f"edges must be an (E, 2) array of pairs i < j in [0, {n - 1}]")
        for name in ("dropped_before", "dropped_rollback"):
            mask = np.asarray(getattr(self, name))
            if mask.shape != (n,) or mask.dtype != bool:
                raise ValueError(f"{name} must be a bool array of shape ({n},)")
        if np.any(self.dropped_before & self.dropped_rollback):
            raise ValueError("a party cannot drop out both before publishing and during the roll-back")

    @property
    def published(self) -> np.ndarray:
        """(n,) bool: parties whose masked value entered the sum."""
        return ~self.dropped_before

    def edge_status(self) -> tuple[np.ndarray, np.ndarray]:
        """``(revealed, uncancelled)`` bool masks over the edges.

        An edge with both ends published cancels in the sum; with no end published it never appears.
        With exactly one end published, the term is removed in the roll-back (and so revealed) when
        the protocol has one and that end did not drop out during it; otherwise it stays in the sum.
        """
        pub = self.published
        i, j = self.edges[:, 0], self.edges[:, 1]
        dangling = pub[i] != pub[j]
        keeper = np.where(pub[i], i, j)  # the published end of a dangling edge
        rolled = dangling & self.rollback & ~self.dropped_rollback[keeper]
        return rolled, dangling & ~rolled

    def published_signs(self, dangling: np.ndarray) -> np.ndarray:
        """For the dangling edges selected by ``dangling`` (a mask over the edges), how their published end
        holds the term: +1 where it added it (the edge's j), -1 where it subtracted it (its i)."""
        return np.where(self.published[self.edges[dangling, 1]], 1.0, -1.0)


def k_out_edges(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Each party picks k distinct random others (GOPA's k_PR); the undirected pairs, deduplicated."""
    k = check_positive_int("k_PR (neighbours per party)", k)
    if k >= n:
        raise ValueError(f"k_PR must be in [1, n-1] = [1, {n - 1}], got {k}")
    m = next(RandomNeighbors(k).iterate(n, 1, rng))
    pairs = np.sort(np.stack([m.senders, m.receivers], axis=1), axis=1)
    return np.unique(pairs, axis=0)


def complete_edges(n: int) -> np.ndarray:
    pairs = n * (n - 1) // 2
    # the two index arrays, their stack and its copy: 48 bytes a pair at the peak
    check_bytes(f"the complete graph of {n} parties ({pairs} pairs)", 48.0 * pairs, "fewer parties")
    i, j = np.triu_indices(n, k=1)
    return np.stack([i, j], axis=1).astype(np.int64)


def _sample_dropouts(n: int, gamma: float, gamma_rollback: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``round(gamma n)`` parties drop out, ``round(gamma_rollback n)`` of them during the roll-back."""
    total = round(gamma * n)
    during = min(round(gamma_rollback * n), total)
    who = rng.choice(n, size=total, replace=False)
    before = np.zeros(n, dtype=bool)
    rollback = np.zeros(n, dtype=bool)
    before[who[during:]] = True
    rollback[who[:during]] = True
    return before, rollback


def pairwise_masked_values(x_tilde: np.ndarray, edges: np.ndarray, pair_terms: np.ndarray) -> np.ndarray:
    """``x_i^p = x~_i + sum_{j < i} p_ij - sum_{j > i} p_ij`` for every party (Alg. 4 line 8).

    ``x_tilde``: (n, d) = x + eta*; ``pair_terms``: (E, d) the terms of ``edges`` (value units).
    """
    out = x_tilde.copy()
    np.add.at(out, edges[:, 1], pair_terms)
    np.subtract.at(out, edges[:, 0], pair_terms)
    return out


def pairwise_estimate(masked: np.ndarray, execution: PairwiseExecution, pair_terms: np.ndarray) -> np.ndarray:
    """The aggregation phase: the mean over published parties of their masked values, less the terms
    removed in the roll-back (Alg. 4 lines 10-11, plus GOPA's roll-back)."""
    pub = execution.published
    if not pub.any():
        return np.full(masked.shape[1], np.nan)
    total = masked[pub].sum(axis=0)
    revealed, _ = execution.edge_status()
    if revealed.any():
        total = total - execution.published_signs(revealed) @ pair_terms[revealed]
    return total / pub.sum()


def uncancelled_estimate(x_tilde: np.ndarray, execution: PairwiseExecution, unit_terms: np.ndarray,
                         sigma_delta: float) -> np.ndarray:
    """:func:`pairwise_estimate`'s estimate from the published noisy values and only the pairwise terms that
    stay in the sum, ``O((n + U) d)`` instead of ``O(E d)``: a term of two publishing ends, or one rolled back,
    leaves the estimate exactly, so it need not be drawn.

    ``x_tilde``: (n, d) = x + eta*; ``unit_terms``: (U, d) unit draws of the uncancelled terms
    (:meth:`PairwiseExecution.edge_status`, in edge order), scaled by ``sigma_delta``.
    """
    pub = execution.published
    if not pub.any():
        return np.full(x_tilde.shape[1], np.nan)
    _, uncancelled = execution.edge_status()
    total = x_tilde[pub].sum(axis=0) + sigma_delta * (execution.published_signs(uncancelled) @ unit_terms)
    return total / pub.sum()


def pairwise_model(execution: PairwiseExecution, corrupted: np.ndarray) -> ObservationModel:
    """The Collusion-DP view of ``execution`` (module docstring), for unit noise variances."""
    n = execution.parties
    is_h = honest_mask(n, corrupted)
    honest = np.flatnonzero(is_h)
    pos = np.full(n, -1)
    pos[honest] = np.arange(honest.size)
    pub = execution.published
    observed = honest[pub[honest]]  # published honest parties, one row each
    row = np.full(n, -1)
    row[observed] = np.arange(observed.size)
    m = observed.size
    H = np.zeros((m, honest.size))
    H[np.arange(m), pos[observed]] = 1.0
    revealed, _ = execution.edge_status()
    i, j = execution.edges[:, 0], execution.edges[:, 1]
    unknown = is_h[i] & is_h[j] & ~revealed & (pub[i] | pub[j])
    ui, uj = i[unknown], j[unknown]
    cols = np.arange(ui.size)
    entries = [(row[ui][pub[ui]], cols[pub[ui]], -1.0), (row[uj][pub[uj]], cols[pub[uj]], 1.0)]
    r = np.concatenate([e[0] for e in entries])
    c = np.concatenate([e[1] for e in entries])
    v = np.concatenate([np.full(e[0].size, e[2]) for e in entries])
    A = sp.csr_matrix((v, (r, c)), shape=(m, ui.size))
    G_A = (A @ A.T).toarray()
    rows = np.stack([observed, np.zeros_like(observed)], axis=1)
    return ObservationModel(honest, rows, H, np.eye(m), G_A)


@dataclass(frozen=True)
class _PairwiseBaseline(LinearGaussianBaseline):
    """Shared machinery of GOPA and CorDP-DME (see the module docstring)."""

    sigma_star: float
    sigma_delta: float
    gamma: float = 0.0
    rollback: ClassVar[bool]

    def _check(self) -> None:
        check_sigma("sigma_star", self.sigma_star)
        check_sigma("sigma_delta", self.sigma_delta)
        g = float(self.gamma)
        if not (math.isfinite(g) and 0.0 <= g < 1.0):
            raise ValueError(f"gamma (fraction of parties that drop out) must be in [0, 1), got {self.gamma!r}")

    def _edges(self, n: int, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def _dropouts(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def sample_execution(self, n: int, seed: int | None = None) -> PairwiseExecution:
        n = check_positive_int("n (number of parties)", n, 2)
        edges = self._edges(n, noise_rng(seed, _TAG_GRAPH))
        before, during = self._dropouts(n, noise_rng(seed, _TAG_DROPOUT))
        return PairwiseExecution(n, edges, before, during, self.rollback)

    def execute(self, x: Any, execution: PairwiseExecution, seed: int | None = None) -> BaselineResult:
        values, scalar = as_values(x)
        n, d = values.shape
        if n != execution.parties:
            raise ValueError(f"x has {n} rows but the execution has {execution.parties} parties")
        edges = execution.edges.shape[0]
        # every term drawn (one per edge and coordinate), scaled, and the rolled-back ones selected
        check_bytes(f"the pairwise terms of {self.name}'s {edges} edges x {d} coordinates", 24.0 * edges * d,
                    "fewer parties or coordinates")
        x_tilde = values + self.sigma_star * noise_rng(seed, _TAG_STAR).standard_normal((n, d))
        pair = self.sigma_delta * noise_rng(seed, _TAG_PAIR).standard_normal((edges, d))
        masked = pairwise_masked_values(x_tilde, execution.edges, pair)
        estimate = pairwise_estimate(masked, execution, pair)
        revealed, uncancelled = execution.edge_status()
        return BaselineResult(shaped(estimate, scalar), np.flatnonzero(execution.published),
                              details={"uncancelled_terms": int(uncancelled.sum()),
                                       "revealed_terms": int(revealed.sum()),
                                       "edges": int(execution.edges.shape[0])})

    def adversary(self, execution: PairwiseExecution, threat: Threat, seed: int | None = None) -> np.ndarray:
        if threat.kind == "collusion":
            return random_corrupted(execution.parties, threat.fraction, seed)
        return np.zeros(0, dtype=np.int64)  # terms travel on secure channels: nothing beyond the published

    def _view_size(self, execution: PairwiseExecution, view: np.ndarray) -> tuple[int, int]:
        is_h = honest_mask(execution.parties, view)
        return int((is_h & execution.published).sum()), int(is_h.sum())

    def _observation_model(self, execution: PairwiseExecution, view: np.ndarray) -> ObservationModel:
        return pairwise_model(execution, view)

    def output_weights(self, execution: PairwiseExecution) -> OutputWeights:
        pub = execution.published
        _, uncancelled = execution.edge_status()
        return OutputWeights(pub.astype(float), float(uncancelled.sum()), float(pub.sum()))

    def honest_outputs(self, execution: PairwiseExecution, view: np.ndarray) -> int:
        return int((execution.published & honest_mask(execution.parties, view)).sum())


@dataclass(frozen=True)
class GOPA(_PairwiseBaseline):
    """GOPA: k_PR random neighbours per party, pairwise terms, and a roll-back round.

    Args:
        sigma_star: std of each party's independent noise (value units).
        sigma_delta: std of each pairwise term.
        neighbors: k_PR, the neighbours each party picks (the graph is the union of the picks).
        gamma: fraction of parties that drop out, ``round(gamma n)`` in all.
        gamma_rollback: gamma_2, the fraction that drops out during the roll-back (taken out of gamma;
            ``round(gamma_2 n)`` parties, at most all the dropouts).
    """

    neighbors: int = 20
    gamma_rollback: float = 0.0
    name: ClassVar[str] = "GOPA"
    rollback: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._check()
        check_positive_int("neighbors (k_PR)", self.neighbors)
        g2 = float(self.gamma_rollback)
        if not (math.isfinite(g2) and 0.0 <= g2 <= self.gamma):
            raise ValueError(f"gamma_rollback (gamma_2) must be in [0, gamma] = [0, {self.gamma:g}], "
                             f"got {self.gamma_rollback!r}")

    def _edges(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return k_out_edges(n, self.neighbors, rng)

    def _dropouts(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return _sample_dropouts(n, self.gamma, self.gamma_rollback, rng)


@dataclass(frozen=True)
class CorDPDME(_PairwiseBaseline):
    """CorDP-DME: pairwise terms on the complete graph, no roll-back (every dropout leaves its terms
    with all publishing parties uncancelled).

    :meth:`noise_lower_bound` is the error the paper plots for it (Sec. 5.2): only the variance of the
    noise that remains, ignoring the values missing from the output.
    """

    name: ClassVar[str] = "CorDP-DME"
    rollback: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self._check()

    def _edges(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return complete_edges(n)

    def _dropouts(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        return _sample_dropouts(n, self.gamma, 0.0, rng)

    def noise_lower_bound(self, n: int) -> float:
        """``sigma_star^2 / n_P + sigma_delta^2 * n_D / n_P`` with ``n_D = round(gamma n)`` dropouts and
        ``n_P = n - n_D`` publishing parties: every dropout leaves one term per publishing party."""
        dropped = round(self.gamma * n)
        published = n - dropped
        if published <= 0:
            return math.inf
        return (self.sigma_star**2 * published + self.sigma_delta**2 * dropped * published) / published**2
