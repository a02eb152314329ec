"""Numerical privacy-random-variable composition (Gopi et al. 2021), through Opacus."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

from .base import RoundAccountant, RoundCost, grouped, require_opacus

__all__ = ["OpacusPrvAccountant"]


class OpacusPrvAccountant(RoundAccountant):
    """Near-exact for Poisson-subsampled rounds; returns an upper bound within ``eps_error``.

    Needs Opacus (``pip install "flwr-inca[opacus]"``); checked when the accountant is created.
    """

    name = "opacus-prv"

    def __init__(self, eps_error: float = 0.01) -> None:
        if not (eps_error > 0):
            raise ValueError(f"eps_error must be > 0, got {eps_error!r}")
        require_opacus(self.name)
        self.eps_error = float(eps_error)

    def epsilon(self, rounds: Sequence[RoundCost], delta: float) -> float:
        from opacus.accountants import PRVAccountant

        if any(r.mu == math.inf for r in rounds):
            return math.inf
        groups = grouped(rounds)
        if not groups:
            return 0.0
        acc = PRVAccountant()
        acc.history = groups
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # log(1 - q) at q = 1 is harmless
            # Opacus sizes the PRV's discretisation domain with an RDP bound and warns when its best
            # order is the largest one; that bound only sets the domain, the epsilon is the PRV's
            warnings.filterwarnings("ignore", message="Optimal order is the", category=UserWarning)
            return float(acc.get_epsilon(delta=delta, eps_error=self.eps_error))
