"""Auditing a certificate by attack: the optimal attacker on the mechanism's real messages.

The certificate of a recorded execution is exact; this is evidence that does not rest on its algebra.
The engine replays the execution with fresh noise many times, the adversary gets exactly the messages its
view observes (and the colluders' own values and noise), and two attacks run on them: the best linear
unbiased reconstruction of a target's value, and the likelihood-ratio test between two neighbouring
values of it. Their error std and true/false-positive rates, with confidence intervals, are compared with
what the certificate allows::

    from flwr_inca.privacy import attack_audit, collusion_view
    audit = attack_audit(trace, collusion_view(trace, [3, 7, 9]), runs=40_000, seed=0)
    for t in audit.targets:
        print(t.party, t.ratio, t.ratio_interval, t.epsilon_interval, t.beaten)

``flwr-inca attack TRACE`` runs it from the command line (docs/privacy.md, "Auditing a certificate by
attack"). GOPA, CorDP-DME and local DP are audited the same way with :func:`attack_baseline`.
"""

from ..._lazy import lazy_exports

# simulated runs of an audit when not given (the command line's --runs): names no solver, so the command
# line's help imports none
DEFAULT_RUNS = 40_000

# each other name is imported when first used
_WHERE = {
    "MAX_MESSAGES": ".audit",
    "AttackAudit": ".audit",
    "TargetAudit": ".audit",
    "attack_audit": ".audit",
    "attack_baseline": ".audit",
    "check_attack_size": ".audit",
    "default_targets": ".audit",
    "IncaMechanism": ".mechanisms",
    "LinearMechanism": ".mechanisms",
    "baseline_mechanism": ".mechanisms",
    "plot_attack": ".plot",
}

__all__ = ["DEFAULT_RUNS", *_WHERE]

__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())
