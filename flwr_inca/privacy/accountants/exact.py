"""Exact composition of Gaussian rounds without subsampling: mu = sqrt(sum mu_r^2).

Each IncA round is exactly a mu_r-GDP mechanism for every honest party (paper Sec. 4.1-4.2), so
without subsampling the composition is exact too (Dong, Roth & Su 2022, Cor. 3.3) and the
(epsilon, delta) conversion is tight. Not Opacus's ``"gdp"`` accountant, which approximates
*subsampled* rounds by the central limit theorem.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..conversions import epsilon_for_delta
from .base import RoundAccountant, RoundCost

__all__ = ["ExactAccountant", "compose_mu"]


def compose_mu(mus: Sequence[float]) -> float:
    """Adaptive composition of mu_r-GDP mechanisms is sqrt(sum mu_r^2)-GDP (Dong et al. 2022)."""
    return math.sqrt(math.fsum(m * m for m in mus))


class ExactAccountant(RoundAccountant):
    """Exact and tight for rounds without subsampling (every ``sample_rate`` must be 1)."""

    name = "exact"

    def check_sample_rate(self, sample_rate: float) -> None:
        if sample_rate != 1.0:
            raise ValueError(
                "the 'exact' accountant is exact only without subsampling (sample_rate = 1); "
                "use the 'opacus-prv' or 'opacus-rdp' accountant for Poisson-subsampled rounds"
            )

    def epsilon(self, rounds: Sequence[RoundCost], delta: float) -> float:
        for r in rounds:
            self.check_sample_rate(r.sample_rate)
        if not rounds:
            return 0.0
        return epsilon_for_delta(compose_mu([r.mu for r in rounds]), delta)
