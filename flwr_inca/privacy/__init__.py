"""Privacy accountant: per-execution guarantees (exact, or a sound bound at scale), calibration,
conversions and a budget ledger.

Typical use::

    from flwr_inca.privacy import random_collusion, certify
    cert = certify(result.trace, random_collusion(result.trace, 0.1, seed=0), delta=1e-5)
    cert.max_mu, cert.epsilon, cert.weakest[:3]
"""

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
from .attack import AttackAudit, attack_audit, attack_baseline
from .bound import BoundSettings, SensitivityBound, bound_profile
from .calibration import Calibration, calibrate
from .certificate import Certificate, SensitivityProfile, certify, choose_solver, profile
from .conversions import (
    classic_epsilon,
    classic_mu,
    delta_for_epsilon,
    epsilon_for_delta,
    mu_for_epsilon,
)
from .ledger import BudgetExceededError, PrivacyLedger
from .rounds import RoundCertificate, certification_seeds, certification_views, certify_round
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
    "ACCOUNTANTS",
    "AdversarialResult",
    "AdversaryView",
    "AttackAudit",
    "BoundSettings",
    "BudgetExceededError",
    "Calibration",
    "Certificate",
    "ExactAccountant",
    "OpacusPrvAccountant",
    "OpacusRdpAccountant",
    "PrivacyLedger",
    "RoundAccountant",
    "RoundCertificate",
    "RoundCost",
    "SensitivityBound",
    "SensitivityProfile",
    "StructureReport",
    "adversarial_collusion",
    "analyze_structure",
    "attack_audit",
    "attack_baseline",
    "bound_profile",
    "calibrate",
    "certification_seeds",
    "certification_views",
    "certify",
    "certify_round",
    "choose_solver",
    "classic_epsilon",
    "classic_mu",
    "collusion_view",
    "create_accountant",
    "delta_for_epsilon",
    "eavesdrop_view",
    "epsilon_for_delta",
    "mu_for_epsilon",
    "profile",
    "random_collusion",
    "random_eavesdrop",
    "recorded_finals",
    "with_finals",
]

