"""Privacy accountant: exact per-execution guarantees, calibration, conversions and a budget ledger.

Typical use::

    from flwr_inca.privacy import random_collusion, certify
    cert = certify(result.trace, random_collusion(result.trace, 0.1, seed=0), delta=1e-5)
    cert.max_mu, cert.epsilon, cert.weakest[:3]
"""

from . import accountants as _accountants
from .accountants import (
    ACCOUNTANTS,
    ExactAccountant,
    OpacusPrvAccountant,
    OpacusRdpAccountant,
    RoundAccountant,
    RoundCost,
    create_accountant,
)
from .adversary import AdversarialResult, adversarial_collusion
from .calibration import Calibration, calibrate
from .certificate import Certificate, SensitivityProfile, certify, profile
from .conversions import (
    classic_epsilon,
    classic_mu,
    delta_for_epsilon,
    epsilon_for_delta,
    mu_for_epsilon,
)
from .ledger import BudgetExceededError, PrivacyLedger
from .structure import StructureReport, analyze_structure
from .views import (
    AdversaryView,
    collusion_view,
    eavesdrop_view,
    random_collusion,
    random_eavesdrop,
    recorded_finals,
    with_finals,
)

__all__ = [
    "AdversaryView", "collusion_view", "eavesdrop_view", "random_collusion", "random_eavesdrop",
    "with_finals", "recorded_finals",
    "Certificate", "SensitivityProfile", "certify", "profile",
    "StructureReport", "analyze_structure",
    "AdversarialResult", "adversarial_collusion",
    "Calibration", "calibrate",
    "epsilon_for_delta", "delta_for_epsilon", "mu_for_epsilon", "classic_mu", "classic_epsilon",
    "PrivacyLedger", "BudgetExceededError",
    "RoundCost", "RoundAccountant", "ExactAccountant", "OpacusRdpAccountant", "OpacusPrvAccountant",
    "ACCOUNTANTS", "create_accountant",
]


def __getattr__(name: str):  # the accountants' class names before 0.2, with a DeprecationWarning
    return _accountants._old_class(__name__, name)
