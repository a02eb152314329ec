"""The optimal linear attacker: generalized least squares on the observed messages.

After subtracting what it knows, the adversary holds ``r = h x_i + e`` with ``e ~ N(0, Sigma)`` (the
honest parties' noise, mixed by the mechanism), ``h`` the messages caused by a unit of the target's value.
The best linear unbiased estimator of ``x_i`` is ``w^T r`` with ``w = Sigma^+ h / (h^T Sigma^+ h)``
(Gauss-Markov; it reaches the Cramér-Rao bound ``1 / (h^T Sigma^+ h)`` of every unbiased estimator), and
the likelihood-ratio test between two values of ``x_i`` is a threshold on the same statistic.

``Sigma`` is accumulated from the mechanism's responses to unit honest noise variables
(:meth:`LinearMechanism.unit_noise`): the protocol's public structure, computed by the mechanism's own
code, not by the accountant. Redundant messages (a colluder's message is a combination of messages it
received and of what it knows) make ``Sigma`` singular; a pivoted Cholesky factorization keeps a
well-conditioned set of messages, and a message that carries the target's value with (almost) no noise
beyond them is used on its own when that gives the smaller variance.

Whatever the numerical choices, ``w`` is fixed before any evaluation run and ``w^T h = 1``, so the
estimator is unbiased and its error on fresh runs is evidence in its own right: a suboptimal ``w`` only
makes the attack weaker, never a correct certificate look beaten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.linalg as la
from scipy.linalg.blas import dsyrk

from .mechanisms import LinearMechanism

__all__ = ["LinearAttacker", "build_attacker"]

# pivoted Cholesky stops when the largest remaining variance, relative to the message's own variance, is
# below this: such a message is (numerically) a combination of the kept ones
_RANK_TOL = 1e-11


@dataclass(frozen=True)
class LinearAttacker:
    """The estimator of each target's value: ``x_hat_k = weights[:, k] @ (observed - known)``.

    Attributes:
        targets: (K,) the parties attacked.
        responses: (m, K) ``h_k``: the messages caused by a unit of target k's value (no noise).
        weights: (m, K) the estimators, ``weights[:, k] @ h_k = 1``.
        predicted_std: (K,) ``sqrt(w^T Sigma w)``: the error std of the estimator under the mechanism's
            noise (value units); inf when the adversary observes nothing of the target.
        kept_messages: how many of the m observed messages the factorization kept (the others are
            combinations of them).
    """

    targets: np.ndarray
    responses: np.ndarray
    weights: np.ndarray
    predicted_std: np.ndarray
    kept_messages: int

    def estimate(self, residual: np.ndarray, k: int) -> np.ndarray:
        """(B,) the estimates of target k's value from residuals (m, B) = observed - known."""
        return self.weights[:, k] @ residual


def noise_covariance(mechanism: LinearMechanism, batch: int,
                     step: Callable[[], None] | None = None) -> np.ndarray:
    """``Sigma`` (m, m) = sum over honest unit noise variables of ``a a^T``, ``a`` the messages it causes;
    accumulated ``batch`` variables at a time (memory O(m^2 + m batch))."""
    m, p = mechanism.rows, mechanism.noise_variables
    sigma = np.zeros((m, m), order="F")
    for start in range(0, p, batch):
        block = mechanism.unit_noise(start, min(start + batch, p))
        if m:
            sigma = dsyrk(1.0, block, beta=1.0, c=sigma, lower=1, overwrite_c=1)
        if step is not None:
            step()
    sigma += np.tril(sigma, -1).T  # dsyrk wrote the lower triangle (the upper one was 0)
    return sigma


def build_attacker(mechanism: LinearMechanism, targets: np.ndarray, batch: int,
                   step: Callable[[], None] | None = None) -> LinearAttacker:
    """The GLS attacker of ``targets`` on ``mechanism`` (module docstring)."""
    targets = np.asarray(targets, dtype=np.int64)
    sigma = noise_covariance(mechanism, batch, step)
    h = mechanism.unit_values(targets)
    if step is not None:
        step()
    weights, kept = gls_weights(sigma, h)
    with np.errstate(invalid="ignore"):
        variance = np.einsum("ik,ik->k", weights, sigma @ weights)
    std = np.where(np.any(weights != 0, axis=0), np.sqrt(np.maximum(variance, 0.0)), np.inf)
    return LinearAttacker(targets, h, weights, std, kept)


def gls_weights(sigma: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, int]:
    """(m, K) unbiased estimators of minimal variance ``w_k`` with ``w_k^T h_k = 1`` (0 when ``h_k`` is 0),
    and the number of messages kept by the rank-revealing factorization of ``sigma``."""
    m, K = h.shape
    weights = np.zeros((m, K))
    var = np.diag(sigma).copy()
    noiseless = var <= 0
    live = np.flatnonzero(~noiseless)
    for k in range(K):  # a noise-free message that carries the target reveals it exactly
        hit = np.flatnonzero(noiseless & (h[:, k] != 0))
        if hit.size:
            j = hit[np.argmax(np.abs(h[hit, k]))]
            weights[j, k] = 1.0 / h[j, k]
    if live.size == 0:
        return weights, 0
    scale = np.sqrt(var[live])
    corr = sigma[np.ix_(live, live)] / np.outer(scale, scale)
    hs = h[live] / scale[:, None]
    factor, piv, rank, _ = la.lapack.dpstrf(corr, tol=_RANK_TOL, lower=1)
    piv = piv[:] - 1
    kept, rest = piv[:rank], piv[rank:]
    L = np.tril(factor[:rank, :rank])
    L_rest = factor[rank:, :rank]  # corr[rest, kept] = L_rest L^T
    z = la.solve_triangular(L, hs[kept], lower=True)  # (rank, K): whitened h on the kept messages
    info = np.einsum("ik,ik->k", z, z)
    w_kept = la.solve_triangular(L.T, z, lower=False)  # Sigma_kept^-1 h (scaled units)
    schur = np.maximum(np.diag(corr)[rest] - np.einsum("ij,ij->i", L_rest, L_rest), _RANK_TOL)
    resid = hs[rest] - L_rest @ z  # what a dropped message carries of the target beyond the kept ones
    for k in range(K):
        if weights[:, k].any():
            continue
        w = np.zeros(live.size)
        best = 1.0 / info[k] if info[k] > 0 else np.inf
        carried = np.flatnonzero(resid[:, k] != 0)
        if carried.size:
            j = int(carried[np.argmin(schur[carried] / resid[carried, k] ** 2)])
            if schur[j] / resid[j, k] ** 2 < best:  # u = e_j - corr[j, kept] corr_kept^-1 over (rest j, kept)
                coef = la.solve_triangular(L.T, L_rest[j], lower=False)
                w[kept] = -coef / resid[j, k]
                w[rest[j]] = 1.0 / resid[j, k]
                weights[live, k] = w / scale
                continue
        if np.isfinite(best):
            w[kept] = w_kept[:, k] / info[k]
        weights[live, k] = w / scale
    return weights, int(rank)
