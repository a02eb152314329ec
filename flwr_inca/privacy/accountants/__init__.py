"""Round accountants: compose per-round GDP costs into (epsilon, delta), one accountant per file.

=================  =================================================================  ==============
name               what                                                               needs
=================  =================================================================  ==============
``"exact"``        exact composition of Gaussian rounds, no subsampling (default)     nothing
``"opacus-prv"``   Poisson-subsampled rounds, numerical PRV bound (Gopi et al. 2021)  ``[opacus]``
``"opacus-rdp"``   Poisson-subsampled rounds, Renyi-DP bound (Mironov et al. 2019)    ``[opacus]``
=================  =================================================================  ==============

The names before 0.2, ``"gdp"``, ``"prv"`` and ``"rdp"`` (and the classes ``GdpAccountant``,
``PrvAccountant``, ``RdpAccountant``), still work and warn: ``"gdp"`` meant something else than
Opacus's ``"gdp"`` (a CLT approximation of subsampled rounds), and ``RdpAccountant`` is also the name
of Flower's own accountant (``flwr.serverapp.RdpAccountant``).
"""

from __future__ import annotations

import warnings
from typing import Any

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
_OLD_NAMES = {"gdp": "exact", "prv": "opacus-prv", "rdp": "opacus-rdp"}
_OLD_CLASSES = {"GdpAccountant": ExactAccountant, "PrvAccountant": OpacusPrvAccountant,
                "RdpAccountant": OpacusRdpAccountant}


def resolve_accountant_name(name: str, *, warn: bool = True) -> str:
    """The current name of accountant ``name`` (a name before 0.2 is mapped, with a
    ``DeprecationWarning`` if ``warn``); ``ValueError`` naming the choices for an unknown one."""
    if name in _OLD_NAMES:
        if warn:
            warnings.warn(f"accountant {name!r} is now called {_OLD_NAMES[name]!r}; the old name will be "
                          "removed in a later release", DeprecationWarning, stacklevel=3)
        return _OLD_NAMES[name]
    if name not in _REGISTRY:
        raise ValueError(f"accountant must be one of {list(ACCOUNTANTS)}, got {name!r}")
    return name


def create_accountant(name: str) -> RoundAccountant:
    """A new accountant by name: ``"exact"`` (no subsampling), ``"opacus-prv"`` or ``"opacus-rdp"``
    (Poisson subsampling; need the ``opacus`` extra)."""
    return _REGISTRY[resolve_accountant_name(name)]()


def _old_class(module: str, name: str) -> Any:
    """A class by its name before 0.2, with a ``DeprecationWarning`` (for modules' ``__getattr__``)."""
    if name not in _OLD_CLASSES:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    new = _OLD_CLASSES[name]
    warnings.warn(f"{name} is now called {new.__name__}; the old name will be removed in a later release",
                  DeprecationWarning, stacklevel=3)
    return new


def __getattr__(name: str) -> Any:
    return _old_class(__name__, name)
