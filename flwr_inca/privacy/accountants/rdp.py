"""Renyi-DP composition of (subsampled) Gaussian rounds, through Opacus's RDP analysis."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..._checks import check_delta, check_real
from .base import RoundAccountant, RoundCost, grouped, rdp_curve, rdp_epsilon, require_opacus

__all__ = ["OpacusRdpAccountant"]

# Opacus's default orders stop at 63, which floors epsilon near log(1/delta)/62 for weak rounds;
# larger orders make the bound useful for small mu.
ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [
    80, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192, 16384,
]


class OpacusRdpAccountant(RoundAccountant):
    """A valid upper bound for Poisson-subsampled rounds (looser than PRV, always fast).

    Needs Opacus (``pip install "flwr-inca[opacus]"``); checked when the accountant is created.
    Named after its backend so that it is not mistaken for ``flwr.serverapp.RdpAccountant``
    (dp-accounting, Flower's client-level accounting of its own DP strategies).
    """

    name = "opacus-rdp"

    def __init__(self, orders: Sequence[float] | None = None) -> None:
        require_opacus(self.name)
        if orders is not None and (isinstance(orders, (str, bytes)) or not list(orders)):
            raise ValueError(f"orders must be a non-empty list of Renyi orders > 1, got {orders!r}")
        self.orders = [check_real("orders (each)", a, 1.0, low_open=True) for a in orders] \
            if orders is not None else list(ORDERS)

    def epsilon(self, rounds: Sequence[RoundCost], delta: float) -> float:
        delta = check_delta("delta", delta)
        groups = grouped(rounds)
        if any(r.mu == math.inf for r in rounds):
            return math.inf
        if not groups:
            return 0.0
        orders = tuple(self.orders)
        # = get_privacy_spent of sum(compute_rdp(q=q, noise_multiplier=sigma, steps=count, orders=...))
        return rdp_epsilon([(rdp_curve(q, sigma, orders), count) for sigma, q, count in groups], delta)
