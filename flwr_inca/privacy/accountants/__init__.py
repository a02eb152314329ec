"""Round accountants: compose per-round GDP costs into (epsilon, delta), one accountant per file.

=================  =================================================================  ==============
name               what                                                               needs
=================  =================================================================  ==============
``"exact"``        exact composition of Gaussian rounds, no subsampling (default)     nothing
``"opacus-prv"``   Poisson-subsampled rounds, numerical PRV bound (Gopi et al. 2021)  ``[opacus]``
``"opacus-rdp"``   Poisson-subsampled rounds, Renyi-DP bound (Mironov et al. 2019)    ``[opacus]``
=================  =================================================================  ==============

The Opacus-backed names carry the ``opacus-`` prefix: Opacus's own ``"gdp"`` is a CLT approximation,
and ``RdpAccountant`` is also the name of Flower's own accountant (``flwr.serverapp.RdpAccountant``).
"""

from __future__ import annotations

from .base import RoundAccountant, RoundCost
from .exact import ExactAccountant, compose_mu
from .prv import OpacusPrvAccountant
from .rdp import OpacusRdpAccountant

__all__ = [
    "RoundAccountant", "RoundCost", "ExactAccountant", "OpacusRdpAccountant", "OpacusPrvAccountant",
    "ACCOUNTANTS", "compose_mu", "create_accountant", "resolve_accountant_name",
]

_REGISTRY: dict[str, type[RoundAccountant]] = {
    "exact": ExactAccountant, "opacus-prv": OpacusPrvAccountant, "opacus-rdp": OpacusRdpAccountant,
}
ACCOUNTANTS = tuple(_REGISTRY)


def resolve_accountant_name(name: str) -> str:
    """``name`` if it names an accountant; ``ValueError`` naming the choices otherwise."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"accountant must be one of {list(ACCOUNTANTS)}, got {name!r}")
    return name


def create_accountant(name: str) -> RoundAccountant:
    """A new accountant by name: ``"exact"`` (no subsampling), ``"opacus-prv"`` or ``"opacus-rdp"``
    (Poisson subsampling; need the ``opacus`` extra)."""
    return _REGISTRY[resolve_accountant_name(name)]()
