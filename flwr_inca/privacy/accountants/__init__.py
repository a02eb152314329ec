"""Round accountants: compose per-round GDP costs into (epsilon, delta), one accountant per file."""

from __future__ import annotations

from .base import RoundAccountant, RoundCost
from .gdp import GdpAccountant, compose_mu
from .prv import PrvAccountant
from .rdp import RdpAccountant

__all__ = [
    "RoundAccountant", "RoundCost", "GdpAccountant", "RdpAccountant", "PrvAccountant",
    "compose_mu", "create_accountant",
]

_REGISTRY = {"gdp": GdpAccountant, "rdp": RdpAccountant, "prv": PrvAccountant}


def create_accountant(name: str) -> RoundAccountant:
    """``"gdp"`` (exact, no subsampling), ``"rdp"`` or ``"prv"`` (Opacus; subsampling supported)."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"accountant must be one of {sorted(_REGISTRY)}, got {name!r}") from None
