"""Privacy accountant: per-execution guarantees (exact, or a sound bound at scale), calibration,
conversions and a budget ledger.

Typical use::

    from flwr_inca.privacy import random_collusion, certify
    cert = certify(result.trace, random_collusion(result.trace, 0.1, seed=0), delta=1e-5)
    cert.max_mu, cert.epsilon, cert.weakest[:3]

Each name is imported when first used: a process that needs only the ledger (or the conversions) does
not load the certificates' solvers, SciPy's sparse matrices or numba.
"""

from .._lazy import lazy_exports

_WHERE = {
    "ACCOUNTANTS": ".accountants",
    "AdversarialResult": ".adversary",
    "AdversaryView": ".views",
    "AttackAudit": ".attack",
    "BoundSettings": ".bound",
    "BudgetExceededError": ".ledger",
    "Calibration": ".calibration",
    "Certificate": ".certificate",
    "ExactAccountant": ".accountants",
    "OpacusPrvAccountant": ".accountants",
    "OpacusRdpAccountant": ".accountants",
    "PrivacyLedger": ".ledger",
    "RoundAccountant": ".accountants",
    "RoundCertificate": ".rounds",
    "RoundCost": ".accountants",
    "SensitivityBound": ".bound",
    "SensitivityProfile": ".certificate",
    "StructureReport": ".structure",
    "adversarial_collusion": ".adversary",
    "analyze_structure": ".structure",
    "attack_audit": ".attack",
    "attack_baseline": ".attack",
    "bound_profile": ".bound",
    "calibrate": ".calibration",
    "certification_seeds": ".rounds",
    "certification_views": ".rounds",
    "certify": ".certificate",
    "certify_round": ".rounds",
    "choose_solver": ".certificate",
    "classic_epsilon": ".conversions",
    "classic_mu": ".conversions",
    "collusion_view": ".views",
    "create_accountant": ".accountants",
    "delta_for_epsilon": ".conversions",
    "eavesdrop_view": ".views",
    "epsilon_for_delta": ".conversions",
    "mu_for_epsilon": ".conversions",
    "profile": ".certificate",
    "random_collusion": ".views",
    "random_eavesdrop": ".views",
    "recorded_finals": ".views",
    "with_finals": ".views",
}

__all__ = list(_WHERE)

__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())
