"""Local noise, then gossip: Muffliato (Cyffers et al. 2022) and DP gossip averaging (Koskela &
Kulkarni, App. F).

Every party adds ``eta_i ~ N(0, sigma^2)`` to its value once, then the parties gossip on a fixed graph:
``y^(0) = x + eta``, ``y^(t) = W y^(t-1)`` (paper App. D.2, Algorithm 3), or with Chebyshev
acceleration (Muffliato's Theorem 2) ``y^(t) = P_t(W) y^(0)`` for the rescaled Chebyshev polynomials
``P_t(W) = T_t(W / lam) / T_t(1 / lam)``, lam bounding the non-unit eigenvalues of W. Each party's
estimate is its own ``y_i^(T)``.

* **Muffliato**: a symmetric, doubly stochastic W (max-degree weights ``W_ij = 1/(1 + max(d_i, d_j))``,
  which is ``(A + I)/(d + 1)`` on a d-regular graph) on a hypercube, ring, random regular or
  Erdos-Renyi graph. Its own accounting (paper App. B) is Pairwise Network DP, a *mean* privacy loss
  over the pairs of parties (:func:`pndp_mean_privacy_loss`, :func:`muffliato_sigma`).
* **DP gossip** (Koskela & Kulkarni): W = row-normalised ``(A + I)`` (averaging over the closed
  neighbourhood) on an Erdos-Renyi graph.

Under Eavesdrop or Collusion DP, a neighbour of party i (or anyone intercepting i's first message)
observes ``y_i^(0) = x_i + eta_i``: the view is a post-processing of ``x + eta`` and contains
``x_i + eta_i`` itself, so party i is exactly ``s / sigma``-GDP, the guarantee of local DP (paper
Sec. 5.1: "when executed under E-DP or C-DP, Muffliato matches the error of Local DP"). The
observation model makes that checkable with the same exact certificate as IncA (one noise scale:
``sigma_star`` = sigma, no ``sigma_delta``). Each party keeps its own estimate; it is not part of the
view.

The averaging cores are pure functions of ``(values, W, noise, rng)`` (:func:`gossip`,
:func:`noisy_gossip_step`), so a training loop can call them one round at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
import scipy.sparse as sp
from scipy.optimize import minimize_scalar

from ..privacy.linear_system import ObservationModel
from ..privacy.views import coalition_size
from ..protocol.topology import resolve_topology
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
    "DPGossip",
    "GossipExecution",
    "GossipView",
    "Muffliato",
    "gossip",
    "gossip_matrix",
    "graph_adjacency",
    "max_degree",
    "muffliato_iterations",
    "muffliato_sigma",
    "noisy_gossip_step",
    "nonunit_eigenvalue_bound",
    "pndp_mean_privacy_loss",
    "rdp_to_dp_epsilon",
    "second_eigenvalue",
]

_TAG_GRAPH, _TAG_NOISE, _TAG_VIEW = 21, 22, 23


# ----------------------------------------------------------------------------------------- graphs
def graph_adjacency(graph: str, n: int, seed: int | None = 0) -> sp.csr_matrix:
    """Symmetric 0/1 adjacency (no self-loops) of ``"hypercube"``, ``"ring"``, ``"complete"``,
    ``"erdos-renyi:<p>"`` or ``"random-regular:<d>"`` on n parties (random graphs drawn from ``seed``)."""
    n = check_positive_int("n (number of parties)", n, 2)
    if not isinstance(graph, str):
        raise ValueError(f"graph must be a name, got {graph!r}")
    if graph.startswith("random-regular"):
        _, _, d = graph.partition(":")
        try:
            degree = int(d)
        except ValueError:
            raise ValueError(f"graph: expected 'random-regular:<d>', got {graph!r}") from None
        return _random_regular(n, degree, np.random.default_rng(seed))
    if graph not in ("hypercube", "ring", "complete") and not graph.startswith("erdos-renyi"):
        raise ValueError("graph must be 'hypercube', 'ring', 'complete', 'erdos-renyi:<p>' or "
                         f"'random-regular:<d>', got {graph!r}")
    topology = resolve_topology(graph, 1, n, seed)
    m = next(topology.iterate(n, 1, np.random.default_rng(0)))
    A = sp.csr_matrix((np.ones(len(m)), (m.senders, m.receivers)), shape=(n, n))
    A = ((A + A.T) > 0).astype(float)
    A.setdiag(0)
    A.eliminate_zeros()
    return A.tocsr()


def _random_regular(n: int, d: int, rng: np.random.Generator) -> sp.csr_matrix:
    """A uniformly drawn simple d-regular graph (configuration model with rejection)."""
    if not (1 <= d < n) or (n * d) % 2:
        raise ValueError(f"random-regular:<d> needs 1 <= d < n and n*d even, got d={d}, n={n}")
    stubs = np.repeat(np.arange(n), d)
    for _ in range(10_000):
        pairs = rng.permutation(stubs).reshape(-1, 2)
        pairs.sort(axis=1)
        if np.all(pairs[:, 0] != pairs[:, 1]) and np.unique(pairs, axis=0).shape[0] == pairs.shape[0]:
            A = sp.csr_matrix((np.ones(pairs.shape[0]), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
            return (A + A.T).tocsr()
    raise ValueError(f"could not draw a simple {d}-regular graph on {n} parties")  # pragma: no cover


def max_degree(adjacency: sp.spmatrix) -> float:
    """The largest degree of a graph (Muffliato's accounting is that of the party of largest degree)."""
    return float(np.asarray((adjacency > 0).sum(axis=1)).max())


def gossip_matrix(adjacency: sp.spmatrix, weights: str = "max-degree") -> sp.csr_matrix:
    """Gossip matrix of a graph.

    ``"max-degree"``: symmetric and doubly stochastic, ``W_ij = 1 / (1 + max(d_i, d_j))`` on edges and
    ``W_ii = 1 - sum_j W_ij`` (``(A + I)/(d + 1)`` on a d-regular graph: Muffliato's hypercube matrix).
    ``"row-normalised"``: ``W = Lambda^{-1} (A + I)``, the average over the closed neighbourhood
    (Koskela & Kulkarni); row stochastic only, so the parties converge to a degree-weighted mean.
    """
    A = sp.csr_matrix(adjacency, dtype=float)
    n = A.shape[0]
    if A.shape != (n, n) or (A != A.T).nnz:
        raise ValueError("adjacency must be a square symmetric matrix")
    deg = np.asarray((A > 0).sum(axis=1)).ravel()
    if weights == "row-normalised":
        M = (A > 0).astype(float) + sp.identity(n, format="csr")
        return sp.diags(1.0 / (deg + 1.0)) @ M
    if weights == "max-degree":
        coo = sp.triu(A, k=1).tocoo()
        w = 1.0 / (1.0 + np.maximum(deg[coo.row], deg[coo.col]))
        off = sp.csr_matrix((w, (coo.row, coo.col)), shape=(n, n))
        off = off + off.T
        return (off + sp.diags(1.0 - np.asarray(off.sum(axis=1)).ravel())).tocsr()
    raise ValueError(f"weights must be 'max-degree' or 'row-normalised', got {weights!r}")


def _eigenvalues(W: sp.spmatrix) -> np.ndarray:
    """Eigenvalues of W in decreasing order (W is symmetric or similar to a symmetric matrix)."""
    D = np.asarray(W.todense())
    if np.allclose(D, D.T):
        return np.sort(np.linalg.eigvalsh(D))[::-1]
    return np.sort(np.linalg.eigvals(D).real)[::-1]


def second_eigenvalue(W: sp.spmatrix) -> float:
    """lambda_2, the second largest eigenvalue of W."""
    return float(_eigenvalues(W)[1])


def nonunit_eigenvalue_bound(W: sp.spmatrix) -> float:
    """``max(|lambda_2|, |lambda_n|)``: how fast plain gossip forgets everything but the mean."""
    ev = _eigenvalues(W)
    return float(max(abs(ev[1]), abs(ev[-1])))


def muffliato_iterations(W: sp.spmatrix, reading: str = "spectral-gap") -> int:
    """Muffliato's number of accelerated gossip steps, ``ceil(ln(n) / sqrt(lambda))``.

    Muffliato's Theorem 2 takes lambda = the spectral gap ``1 - lambda_2`` (``"spectral-gap"``, 17
    steps on the 1024-party hypercube); the paper's App. B plugs in lambda_2 itself (``"paper"``:
    9/11 there, 8 steps), which halves the noise it derives.
    """
    n = W.shape[0]
    lam2 = second_eigenvalue(W)
    if reading == "paper":
        lam = lam2
    elif reading == "spectral-gap":
        lam = 1.0 - lam2
    else:
        raise ValueError(f"reading must be 'spectral-gap' or 'paper', got {reading!r}")
    if lam <= 0:
        raise ValueError("the graph is disconnected (spectral gap 0): gossip never averages")
    return max(1, math.ceil(math.log(n) / math.sqrt(lam)))


# ----------------------------------------------------------------------------------------- cores
def _chebyshev_weights(lam: float, iterations: int) -> list[tuple[float, float]]:
    """Per step t >= 1, ``(a_t, b_t)`` with ``y^(t) = a_t W y^(t-1) - b_t y^(t-2)``: the rescaled
    Chebyshev recursion ``c_t = T_t(1/lam)``, ``a_t = 2 c_{t-1} / (lam c_t)``, ``b_t = c_{t-2} / c_t``
    (``a_t - b_t = 1``, so the mean is kept)."""
    if not (0 < lam < 1):
        raise ValueError(f"Chebyshev acceleration needs 0 < lam < 1, got {lam!r}")
    c = [1.0, 1.0 / lam]
    out = [(1.0, 0.0)]  # P_1(W) = W
    for t in range(2, iterations + 1):
        c.append(2.0 / lam * c[t - 1] - c[t - 2])
        out.append((2.0 * c[t - 1] / (lam * c[t]), c[t - 2] / c[t]))
    return out


def gossip(values: np.ndarray, W: sp.spmatrix, iterations: int, *, chebyshev: float | None = None,
           record: bool = False) -> np.ndarray | tuple[np.ndarray, list[np.ndarray]]:
    """``y^(T)`` of gossip averaging from ``y^(0) = values`` ((n, d)); with ``chebyshev = lam``, the
    accelerated recursion. ``record=True`` also returns the messages ``[y^(0), ..., y^(T-1)]``."""
    T = check_positive_int("iterations", iterations)
    y = np.asarray(values, dtype=np.float64)
    prev = None
    sent = []
    steps = _chebyshev_weights(chebyshev, T) if chebyshev is not None else [(1.0, 0.0)] * T
    for a, b in steps:
        if record:
            sent.append(y)
        nxt = W @ y
        if a != 1.0 or b != 0.0:
            nxt = a * nxt - b * prev
        prev, y = y, nxt
    return (y, sent) if record else y


def noisy_gossip_step(values: np.ndarray, W: sp.spmatrix, sigma: float, rng: np.random.Generator, *,
                      steps: int = 1, chebyshev: float | None = None) -> np.ndarray:
    """One round of DP gossip / D-SGD averaging: every party adds ``N(0, sigma^2)`` to its row once, then
    averages with its neighbours: ``W (values + noise)``; with ``steps > 1``, ``steps`` gossip steps
    (:func:`gossip`, accelerated with ``chebyshev = lam``). ``values``: (n, d); the parties' estimates, (n, d)."""
    sigma = check_sigma("sigma", sigma)
    noisy = values + sigma * rng.standard_normal(values.shape) if sigma > 0 else values
    if steps == 1 and chebyshev is None:
        return W @ noisy
    return gossip(noisy, W, steps, chebyshev=chebyshev)


def gossip_polynomials(W: sp.spmatrix, iterations: int, chebyshev: float | None = None) -> list[np.ndarray]:
    """Dense ``[P_0(W), ..., P_T(W)]``: the message at t is ``P_t(W) y^(0)``."""
    n = W.shape[0]
    _, sent = gossip(np.eye(n), W, iterations, chebyshev=chebyshev, record=True)
    final = gossip(np.eye(n), W, iterations, chebyshev=chebyshev)
    return sent + [final]


# ----------------------------------------------------------------------------------------- accounting
def pndp_mean_privacy_loss(sigma: float, alpha: float, iterations: int, degree: float, n: int,
                           sensitivity: float = 1.0) -> float:
    """Muffliato's mean privacy loss of a party of degree d (paper Eq. (65), [Cyffers et al. Eq. (7)]):
    ``alpha T d s^2 / (2 n sigma^2)``, an (alpha, .)-Renyi-DP level averaged over the other parties."""
    return alpha * iterations * degree * sensitivity**2 / (2.0 * n * sigma**2)


def rdp_to_dp_epsilon(rdp_epsilon: float, alpha: float, delta: float) -> float:
    """(alpha, rdp_epsilon)-RDP implies (epsilon, delta)-DP with ``epsilon = rdp_epsilon + ln(1/delta)
    / (alpha - 1)`` (Mironov 2017, Prop. 3; paper Eq. (66))."""
    if not alpha > 1:
        raise ValueError(f"Renyi order alpha must be > 1, got {alpha!r}")
    return rdp_epsilon + math.log(1.0 / delta) / (alpha - 1.0)


def muffliato_sigma(epsilon: float, delta: float, n: int, degree: float, iterations: int,
                    sensitivity: float = 1.0) -> tuple[float, float, float]:
    """Smallest Muffliato noise std meeting a *mean* (epsilon, delta) under Pairwise Network DP
    (paper App. B, Eqs. (65)-(68)): over the split of epsilon into the RDP part ``eps_bar`` and
    ``ln(1/delta)/(alpha - 1)``, minimise ``sigma^2 = (ln(1/delta)/(epsilon - eps_bar) + 1) d T s^2
    / (2 n eps_bar)``.

    Returns ``(sigma, eps_bar, alpha)``. On the 1024-party hypercube (d = 10) with epsilon = 0.1,
    delta = 1e-5 and T = 8: sigma^2 = 180.6, an MSE of sigma^2 / n = 0.1764 (the paper's bound).
    """
    if not (math.isfinite(epsilon) and epsilon > 0) or not (0 < delta < 1):
        raise ValueError(f"need epsilon > 0 and delta in (0, 1), got {epsilon!r}, {delta!r}")
    log_inv = math.log(1.0 / delta)
    scale = degree * iterations * sensitivity**2 / (2.0 * n)

    def sigma2(eps_bar: float) -> float:
        return (log_inv / (epsilon - eps_bar) + 1.0) * scale / eps_bar

    res = minimize_scalar(sigma2, bounds=(epsilon * 1e-9, epsilon * (1 - 1e-9)), method="bounded",
                          options={"xatol": epsilon * 1e-12})
    eps_bar = float(res.x)
    alpha = log_inv / (epsilon - eps_bar) + 1.0
    return math.sqrt(sigma2(eps_bar)), eps_bar, alpha


# ----------------------------------------------------------------------------------------- baselines
@dataclass(frozen=True)
class GossipExecution:
    """A gossip run without values: the graph, its gossip matrix and the recursion."""

    adjacency: sp.csr_matrix
    W: sp.csr_matrix
    iterations: int
    chebyshev: float | None  # lam of the accelerated recursion, None for plain gossip

    @property
    def parties(self) -> int:
        return int(self.W.shape[0])


@lru_cache(maxsize=16)
def _execution(graph: str, n: int, seed: int, weights: str, accelerated: bool,
               iterations: int | None) -> GossipExecution:
    """Graph, gossip matrix and recursion (cached: fixed graphs are the same for every run, and the
    eigenvalues of a 1024-party hypercube take a second)."""
    A = graph_adjacency(graph, n, seed)
    W = gossip_matrix(A, weights)
    T = iterations if iterations is not None else muffliato_iterations(W)
    lam = nonunit_eigenvalue_bound(W) if accelerated else None
    if lam is not None and not (0 < lam < 1):
        lam = None  # complete graph (lam = 0) or a periodic one: plain gossip
    return GossipExecution(A, W, T, lam)


@dataclass(frozen=True)
class GossipView:
    """Which messages the adversary sees: ``observed[t, i]`` means it knows ``y_i^(t)`` (t < T)."""

    corrupted: np.ndarray
    observed: np.ndarray


@dataclass(frozen=True)
class _GossipBaseline(LinearGaussianBaseline):
    sigma_star: float
    graph: str = "hypercube"
    iterations: int | None = None
    sigma_delta: float = 0.0
    weights: ClassVar[str] = "max-degree"
    accelerated: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_sigma("sigma_star (local noise std)", self.sigma_star)
        if self.sigma_delta != 0:
            raise ValueError(f"{self.name} has a single noise (sigma_star); sigma_delta must be 0")
        if self.iterations is not None:
            check_positive_int("iterations", self.iterations)

    def sample_execution(self, n: int, seed: int | None = None) -> GossipExecution:
        n = check_positive_int("n (number of parties)", n, 2)
        random_graph = self.graph.startswith(("erdos-renyi", "random-regular"))
        graph_seed = int(noise_rng(seed, _TAG_GRAPH).integers(2**63)) if random_graph else 0
        return _execution(self.graph, int(n), graph_seed, self.weights, self.accelerated, self.iterations)

    def execute(self, x: Any, execution: GossipExecution, seed: int | None = None) -> BaselineResult:
        values, scalar = as_values(x)
        n = values.shape[0]
        if n != execution.parties:
            raise ValueError(f"x has {n} rows but the execution has {execution.parties} parties")
        finals = noisy_gossip_step(values, execution.W, self.sigma_star, noise_rng(seed, _TAG_NOISE),
                                   steps=execution.iterations, chebyshev=execution.chebyshev)
        return BaselineResult(shaped(finals.mean(axis=0), scalar), np.arange(n), party_estimates=finals,
                              details={"iterations": execution.iterations})

    def adversary(self, execution: GossipExecution, threat: Threat, seed: int | None = None) -> GossipView:
        n, T = execution.parties, execution.iterations
        A = execution.adjacency
        if threat.kind == "collusion":
            C = random_corrupted(n, threat.fraction, seed)
            is_c = np.zeros(n, dtype=bool)
            is_c[C] = True
            # a party broadcasts every message to all its neighbours: a corrupted neighbour sees them all
            sees = np.asarray(A[:, C].sum(axis=1)).ravel() > 0
            return GossipView(C, np.tile(sees | is_c, (T, 1)))
        rng = np.random.default_rng(seed)
        coo = A.tocoo()
        observed = np.zeros((T, n), dtype=bool)
        for t in range(T):  # intercept ceil(f m) of the m messages of each iteration
            pick = rng.choice(coo.nnz, size=coalition_size(threat.fraction, coo.nnz), replace=False)
            observed[t, coo.row[pick]] = True
        return GossipView(np.zeros(0, dtype=np.int64), observed)

    def _view_size(self, execution: GossipExecution, view: GossipView) -> tuple[int, int]:
        is_h = honest_mask(execution.parties, view.corrupted)
        return int(view.observed[:, is_h].sum()), int(is_h.sum())

    def _builder_bytes(self, execution: GossipExecution, rows: int, honest: int) -> float:
        # the dense polynomials P_0(W), ..., P_T(W) (n x n each) next to the observation and its Gram
        n = float(execution.parties)
        return 8.0 * ((execution.iterations + 2) * n * n + rows * honest + rows * float(rows))

    def _observation_model(self, execution: GossipExecution, view: GossipView) -> ObservationModel:
        n = execution.parties
        honest = np.flatnonzero(honest_mask(n, view.corrupted))
        polys = gossip_polynomials(execution.W, execution.iterations, execution.chebyshev)
        rows, blocks = [], []
        for t in range(execution.iterations):
            who = honest[view.observed[t, honest]]
            rows.append(np.stack([who, np.full(who.size, t)], axis=1))
            blocks.append(polys[t][np.ix_(who, honest)])
        H = np.concatenate(blocks, axis=0)
        G_B = H @ H.T
        return ObservationModel(honest, np.concatenate(rows).astype(np.int64), H, (G_B + G_B.T) / 2,
                                np.zeros_like(G_B))

    def output_weights(self, execution: GossipExecution) -> OutputWeights:
        final = gossip_polynomials(execution.W, execution.iterations, execution.chebyshev)[-1]
        b = final.sum(axis=0)  # estimate = mean_i y_i^(T) = (1^T P_T x~) / n
        return OutputWeights(b, 0.0, float(execution.parties))

    def honest_outputs(self, execution: GossipExecution, view: GossipView) -> int:
        return int(honest_mask(execution.parties, view.corrupted).sum())


@dataclass(frozen=True)
class Muffliato(_GossipBaseline):
    """Muffliato: local noise, then Chebyshev-accelerated gossip with a doubly stochastic W.

    Args:
        sigma_star: std of the local noise each party adds once (value units).
        graph: ``"hypercube"`` (n a power of 2), ``"ring"``, ``"random-regular:<d>"``,
            ``"erdos-renyi:<p>"``.
        iterations: gossip steps; default ``ceil(ln n / sqrt(spectral gap))`` (Muffliato's Theorem 2).

    ``Muffliato.pndp(epsilon, delta, n)`` gives the noise of its own accounting (paper App. B),
    ``LocalDP.calibrated(...)`` the noise it needs under Eavesdrop or Collusion DP.
    """

    name: ClassVar[str] = "Muffliato"
    weights: ClassVar[str] = "max-degree"
    accelerated: ClassVar[bool] = True

    @classmethod
    def pndp(cls, epsilon: float, delta: float, n: int, graph: str = "hypercube",
             iterations: int | None = None, reading: str = "spectral-gap", seed: int | None = 0,
             sensitivity: float = 1.0) -> Muffliato:
        """Noise from Muffliato's own accounting: a mean (epsilon, delta) under Pairwise Network DP
        for the party of largest degree (paper App. B); ``reading`` picks the number of steps."""
        A = graph_adjacency(graph, n, seed)
        W = gossip_matrix(A, cls.weights)
        T = iterations if iterations is not None else muffliato_iterations(W, reading)
        sigma, _, _ = muffliato_sigma(epsilon, delta, n, max_degree(A), T, sensitivity)
        return cls(sigma, graph, T)


@dataclass(frozen=True)
class DPGossip(_GossipBaseline):
    """DP gossip averaging (Koskela & Kulkarni, App. F): local noise, then plain gossip with the
    row-normalised ``W = Lambda^{-1} (A + I)`` on an Erdos-Renyi graph (default G(n, 0.2))."""

    graph: str = "erdos-renyi:0.2"
    iterations: int | None = 20
    name: ClassVar[str] = "DP gossip"
    weights: ClassVar[str] = "row-normalised"
    accelerated: ClassVar[bool] = False
