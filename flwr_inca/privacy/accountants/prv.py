"""Numerical privacy-random-variable composition (Gopi et al. 2021), through Opacus.

:func:`prv_epsilon` is Opacus's ``PRVAccountant.get_epsilon`` step for step (the same safe domain, mesh,
discretisation, FFT composition and upper bound, so the same epsilon to the last bit), with what does
not change between a ledger's charges computed once: the per-step Renyi-DP curve of each distinct
round (Opacus recomputes it for every group at every query, about 70% of a query's time; a group of
``c`` identical rounds has ``c`` times that curve, which is how ``compute_rdp`` scales it too) and the
truncated PRV's mean for a given domain. A ledger that charges rounds on a fixed grid of mu (see
``SimulationConfig.mu_resolution``) has few distinct rounds, so a query after each charge costs a few
discretisations and FFTs instead of recomposing the whole history from scratch. The discretisation's
truncated PRV (:func:`_prv_classes`) is Opacus's with the same values and fewer operations (its mean, an
integral of the cdf at one point at a time, about 4x faster).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence

import numpy as np

from ..._checks import check_bytes, check_delta, check_real
from .base import (PRV_MEANS, RDP_CURVES, Memo, RoundAccountant, RoundCost, grouped, rdp_curve, rdp_epsilon,
                   require_opacus)

__all__ = ["OpacusPrvAccountant", "prv_epsilon"]


def prv_epsilon(groups: Sequence[tuple[float, float, int]], delta: float, eps_error: float = 0.01,
                memo: dict[str, Memo] | None = None) -> float:
    """Opacus's PRV upper bound on epsilon at ``delta`` for ``groups`` of ``(noise_multiplier,
    sample_rate, count)`` (``PRVAccountant`` with that history, ``get_epsilon(delta, eps_error=...)``).

    ``memo`` keeps the per-step RDP curves and truncated means between calls (default: the process-wide
    ones); the result does not depend on it.
    """
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.prv import Domain, compose_heterogeneous, discretize

    memo = memo if memo is not None else {"rdp": RDP_CURVES, "mean": PRV_MEANS}
    orders = tuple(RDPAccountant.DEFAULT_ALPHAS)
    delta_error = delta / 1000  # PRVAccountant.get_epsilon's default
    counts = [count for _, _, count in groups]
    total = sum(counts)
    curves = [rdp_curve(q, sigma, orders, memo["rdp"]) for sigma, q, _ in groups]

    # compute_safe_domain_size (Gopi et al., Remark 5.6, as Opacus implements it): the RDP bound of
    # the whole composition, and of each single round, at Opacus's deltas (a single round whose bound is
    # already below the largest so far cannot change the maximum)
    L_max = rdp_epsilon(list(zip(curves, counts)), delta_error / 4)
    for curve in curves:
        L_max = max(L_max, rdp_epsilon([(curve, 1)], delta_error / (8 * total), within=L_max))
    L = max(L_max, eps_error) + 3
    mesh_size = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
    # the grid has 2L / mesh_size points (grows with sqrt(rounds) / eps_error): a few float arrays of it per
    # group, and the FFTs of the composition, refused before Opacus allocates them (10^9 rounds: 205 TiB)
    check_bytes(f"the PRV accountant's grid for {total} rounds at eps_error = {eps_error:g}",
                8.0 * (2 * L / mesh_size) * (3 * len(groups) + 8), "fewer rounds or a larger eps_error")
    domain = Domain.create_aligned(-L, L, mesh_size)

    dprvs = []
    gaussian_prv, truncated_prv = _prv_classes()
    for sigma, q, _ in groups:
        tprv = truncated_prv(gaussian_prv(q, sigma), domain.t_min, domain.t_max)
        key = (float(q), float(sigma), float(domain.t_min), float(domain.t_max))
        mean = memo["mean"].get(key, tprv.mean)
        tprv.mean = lambda mean=mean: mean  # discretize() asks for it once; the same number, memoized
        dprvs.append(discretize(tprv, domain))
    composed = compose_heterogeneous(dprvs=dprvs, num_self_compositions=counts)
    _, _, eps_upper = composed.compute_epsilon(delta, delta_error, eps_error)
    return float(eps_upper)


@functools.cache
def _prv_classes() -> tuple[type, type]:
    """Opacus's subsampled-Gaussian and truncated PRVs, with the same values to the last bit and fewer
    operations where the truncated PRV's mean integrates its cdf at one point at a time (about 10^3 calls
    a round class): the cdf at a scalar point skips the array machinery, and the truncated cdf's constant
    term ``cdf(t_min)`` is computed once (Opacus recomputes it at every call)."""
    from opacus.accountants.analysis.prv.prvs import (
        SQRT2,
        PoissonSubsampledGaussianPRV,
        TruncatedPrivacyRandomVariable,
        erfc,
    )

    class SubsampledGaussianPRV(PoissonSubsampledGaussianPRV):
        def cdf(self, t):
            if np.ndim(t):
                return super().cdf(t)
            # Opacus's expression, operation for operation, on one point (bit-identical: the same numpy
            # and scipy functions on float64 scalars; tested against Opacus's accountant)
            q, sigma = self.sample_rate, self.noise_multiplier
            if not t > np.log(1 - q):
                return np.float64(0.0)
            z = np.log((np.exp(t) + q - 1) / q)
            return (-q * erfc((2 * z * sigma**2 - 1) / (2 * SQRT2 * sigma)) / 2
                    - (1 - q) * erfc((2 * z * sigma**2 + 1) / (2 * SQRT2 * sigma)) / 2 + 1.0)

    class TruncatedPRV(TruncatedPrivacyRandomVariable):
        def __init__(self, prv, t_min: float, t_max: float) -> None:
            super().__init__(prv, t_min, t_max)
            self._cdf_min = self._prv.cdf(self.t_min)

        def cdf(self, t):
            if not np.ndim(t) and self.t_min <= t < self.t_max:
                return (self._prv.cdf(t) - self._cdf_min) / self._remaining_mass
            return np.where(t < self.t_min, 0.0, np.where(
                t < self.t_max, (self._prv.cdf(t) - self._cdf_min) / self._remaining_mass, 1.0))

    return SubsampledGaussianPRV, TruncatedPRV


class OpacusPrvAccountant(RoundAccountant):
    """Near-exact for Poisson-subsampled rounds; returns an upper bound within ``eps_error``.

    Needs Opacus (``pip install "flwr-inca[opacus]"``); checked when the accountant is created.
    Gives Opacus's ``PRVAccountant`` epsilon (:func:`prv_epsilon`), remembering what repeated queries on
    a growing history share: each round's RDP curve and truncated mean in the process-wide memos (any
    ledger's), or, with ``shared_memo=False``, in this accountant's own (e.g. to time one ledger alone).
    """

    name = "opacus-prv"

    def __init__(self, eps_error: float = 0.01, *, shared_memo: bool = True) -> None:
        check_real("eps_error", eps_error, 0.0, low_open=True)
        require_opacus(self.name)
        self.eps_error = float(eps_error)
        rdp, mean = (RDP_CURVES, PRV_MEANS) if shared_memo else (Memo(64), Memo(64))
        self._memo = {"rdp": rdp, "mean": mean, "epsilon": Memo(16)}

    def epsilon(self, rounds: Sequence[RoundCost], delta: float) -> float:
        delta = check_delta("delta", delta)
        if any(r.mu == math.inf for r in rounds):
            return math.inf
        groups = grouped(rounds)
        if not groups:
            return 0.0
        key = (tuple(groups), float(delta), self.eps_error)
        return self._memo["epsilon"].get(key, lambda: self._compose(groups, delta))

    def _compose(self, groups: list[tuple[float, float, int]], delta: float) -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # log(1 - q) at q = 1 is harmless
            # Opacus sizes the PRV's discretisation domain with an RDP bound and warns when its best
            # order is the largest one; that bound only sets the domain, the epsilon is the PRV's
            warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
            return prv_epsilon(groups, delta, self.eps_error, self._memo)
