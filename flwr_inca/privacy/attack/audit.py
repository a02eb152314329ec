"""An empirical privacy audit: the optimal attacker against a certificate, on the mechanism's real messages.

For each target party the audit runs the mechanism many times with fresh noise (IncA: the engine replays
the recorded execution), hands the adversary exactly the messages its view observes, and runs

* a **reconstruction attack**: the best linear unbiased (GLS) estimate of the target's value
  (:mod:`.attacker`). A certificate mu promises that no unbiased estimator has an error std below
  ``value_sensitivity / mu`` (Cramér-Rao for the Gaussian view), so ``error std x mu / sensitivity`` is
  at least 1; the optimal attacker reaches exactly 1 against an exact certificate.
* a **distinguishing attack** between two neighbouring values of the target (0 and the value
  sensitivity): the likelihood-ratio test, a threshold on the same GLS statistic. Its true- and
  false-positive rates, with Clopper-Pearson intervals, give empirical lower bounds on epsilon at delta
  and on the GDP mu (:mod:`.stats`).

A certificate is **beaten** when the attack does better than it allows beyond the statistical
uncertainty: the ratio's interval lies below 1, or the interval of the empirical epsilon (mu) lies above
the certified epsilon (mu). Intervals are simultaneous over the targets and the three checks (Bonferroni)
at the audit's confidence, so a correct certificate is reported beaten with probability at most
``(1 - confidence) / 2``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..._checks import check_int, check_real
from ..._json import jsonable
from ...protocol.trace import ExecutionTrace
from ..certificate import Certificate, certify
from ..conversions import epsilon_for_delta
from ..views import AdversaryView
from . import DEFAULT_RUNS
from .attacker import LinearAttacker, build_attacker
from .mechanisms import IncaMechanism, LinearMechanism, baseline_mechanism
from .stats import Rates, choose_threshold, std_interval

__all__ = [
    "MAX_MESSAGES",
    "MAX_STATISTICS",
    "AttackAudit",
    "TargetAudit",
    "attack_audit",
    "attack_baseline",
    "check_attack_size",
    "default_targets",
]

_CHECKS = 3  # reconstruction ratio, empirical mu, empirical epsilon: the intervals of one target
_ROC_POINTS = 400
# the attacker's covariance is a dense (m, m) matrix over the observed messages, held a few times while it is
# factorized: about 4 * 8 m^2 bytes (4.6 GB at this limit; an n = 1000 execution observes about 3000)
MAX_MESSAGES = 12_000
# the runs' statistics are kept for the ROC and the tests: (targets x runs) float64 and a label each
MAX_STATISTICS = 50_000_000
# one engine call handles this many (party x run) entries at most: bounds the engine's memory (a few
# (n, batch) arrays of float64) whatever n is
_BATCH_ENTRIES = 2**21


@dataclass(frozen=True)
class TargetAudit:
    """The attack on one party against its certificate (stds and thresholds in value units).

    ``promised_std = value_sensitivity / mu`` is the smallest error std the certificate allows an
    unbiased attacker; ``ratio = error_std / promised_std`` must be >= 1. ``reasons`` says why the
    certificate is beaten (empty: it holds against this attack).
    """

    party: int
    mu: float
    epsilon: float
    promised_std: float
    predicted_std: float  # the attacker's error std under the mechanism's noise, computed (no sampling)
    error_std: float  # measured: root mean squared error over the runs
    error_std_interval: tuple[float, float]
    ratio: float
    ratio_interval: tuple[float, float]
    mu_empirical: float
    mu_interval: tuple[float, float]
    epsilon_empirical: float
    epsilon_interval: tuple[float, float]
    mu_test: Rates | None
    epsilon_test: Rates | None
    roc: tuple[np.ndarray, np.ndarray]  # (FPR, TPR) of the distinguisher over all thresholds
    reasons: tuple[str, ...] = ()

    @property
    def beaten(self) -> bool:
        return bool(self.reasons)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "party": self.party, "mu": self.mu, "epsilon": self.epsilon, "promised_std": self.promised_std,
            "predicted_std": self.predicted_std, "error_std": self.error_std,
            "error_std_interval": self.error_std_interval, "ratio": self.ratio,
            "ratio_interval": self.ratio_interval, "mu_empirical": self.mu_empirical,
            "mu_interval": self.mu_interval, "epsilon_empirical": self.epsilon_empirical,
            "epsilon_interval": self.epsilon_interval, "beaten": self.beaten, "reasons": list(self.reasons),
        }
        for name, test in (("mu_test", self.mu_test), ("epsilon_test", self.epsilon_test)):
            if test is not None:
                out[name] = {"threshold": test.threshold, "tpr": test.tpr, "fpr": test.fpr,
                             "tpr_interval": test.tpr_interval, "fpr_interval": test.fpr_interval,
                             "positives": test.positives, "negatives": test.negatives}
        return out


@dataclass
class AttackAudit:
    """The outcome of :func:`attack_audit`: one :class:`TargetAudit` per target, and how it was run."""

    targets: list[TargetAudit]
    mechanism: str
    adversary: str
    runs: int
    confidence: float
    delta: float
    value_sensitivity: float
    seed: int
    messages: int  # observed messages per run (m)
    kept_messages: int  # of which linearly independent (the attacker's covariance rank)
    certificate_method: str
    seconds: float
    structure_seconds: float  # of which building the attacker (unit responses, factorization)
    notes: list[str] = field(default_factory=list)

    @property
    def beaten(self) -> bool:
        return any(t.beaten for t in self.targets)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``flwr_inca._json``: an unbounded value is written ``"inf"``)."""
        return jsonable({
            "mechanism": self.mechanism, "adversary": self.adversary, "runs": self.runs,
            "confidence": self.confidence, "delta": self.delta, "value_sensitivity": self.value_sensitivity,
            "seed": self.seed, "messages": self.messages, "kept_messages": self.kept_messages,
            "certificate_method": self.certificate_method, "seconds": self.seconds,
            "structure_seconds": self.structure_seconds, "beaten": self.beaten,
            "targets": [t.to_dict() for t in self.targets], "notes": self.notes,
        })


def default_targets(mu: dict[int, float]) -> list[int]:
    """The weakest party (largest mu) and a median one (among parties with 0 < mu < inf)."""
    if not mu:
        raise ValueError("the certificate has no honest party to attack")
    ranked = sorted(mu, key=lambda i: (-mu[i], i))
    finite = [i for i in ranked if 0 < mu[i] < math.inf]
    chosen = [ranked[0]]
    if finite:
        median = finite[len(finite) // 2]
        if median != chosen[0]:
            chosen.append(median)
    return chosen


def attack_audit(
    trace: ExecutionTrace,
    view: AdversaryView,
    targets: Sequence[int] | None = None,
    *,
    runs: int = DEFAULT_RUNS,
    value_sensitivity: float | None = None,
    delta: float = 1e-5,
    confidence: float = 0.99,
    certificate: Certificate | None = None,
    seed: int | None = None,
    batch: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> AttackAudit:
    """Attack the certificate of the recorded IncA execution ``trace`` against ``view`` (module docstring).

    Args:
        trace: the execution; the engine replays it with fresh noise ``runs`` times.
        view: the adversary (``collusion_view``, ``random_collusion``, ``with_finals``, ...).
        targets: honest parties to attack (default :func:`default_targets`: the weakest and a median one).
        runs: fresh-noise runs (>= 100); the ratio's interval half-width is about ``z / sqrt(2 runs)``.
        value_sensitivity: the change of a value the certificate covers (default: the certificate's, or 1).
        delta: delta of the certified and the empirical epsilon.
        confidence: simultaneous confidence of the intervals, in (0, 1).
        certificate: the certificate to audit (default: :func:`certify` on ``trace`` and ``view``).
        seed: seed of the runs' values and noise (default: fresh entropy; the audit records it).
        batch: runs per engine call (default: bounded by memory, :data:`_BATCH_ENTRIES` / n).
        progress: called as ``progress(done, total)`` after each engine call.
    """
    if certificate is None:
        sensitivity = 1.0 if value_sensitivity is None else value_sensitivity
        certificate = certify(trace, view, value_sensitivity=sensitivity, delta=delta)
    if certificate.view.parties != trace.parties:
        raise ValueError("the certificate is for another execution (its view has another number of parties)")
    notes = list(certificate.notes)
    if certificate.method != "exact":
        notes.append("the certificate is a sound upper bound on mu: the optimal attacker's error std x mu / "
                     "sensitivity is then above 1 by the bound's slack")
    return _audit(IncaMechanism(trace, view), certificate.mu, certificate.method,
                  _sensitivity(certificate.value_sensitivity, value_sensitivity), view.describe(),
                  targets, runs=runs, delta=delta, confidence=confidence, seed=seed, batch=batch,
                  progress=progress, notes=notes)


def attack_baseline(
    baseline: Any,
    execution: Any,
    corrupted: Sequence[int],
    targets: Sequence[int] | None = None,
    *,
    mu: dict[int, float] | None = None,
    runs: int = DEFAULT_RUNS,
    value_sensitivity: float = 1.0,
    delta: float = 1e-5,
    confidence: float = 0.99,
    seed: int | None = None,
    batch: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> AttackAudit:
    """The same audit for a baseline with a linear-Gaussian view: GOPA, CorDP-DME or local DP.

    ``execution`` is ``baseline.sample_execution(n, seed)``; ``corrupted`` the colluders. ``mu`` (party ->
    mu for a change of ``value_sensitivity``) is the certificate to audit; default: the exact one of the
    baseline's :meth:`observation_model` (:class:`~flwr_inca.privacy.SensitivityProfile`).
    """
    from ..certificate import SensitivityProfile

    mechanism = baseline_mechanism(baseline, execution, corrupted)
    sensitivity = check_real("value_sensitivity", value_sensitivity, 0.0, low_open=True)
    if mu is None:
        model = baseline.observation_model(execution, mechanism.corrupted)
        prof = SensitivityProfile.from_model(model)
        values = prof.mu(baseline.sigma_star, baseline.sigma_delta) * sensitivity
        mu = {int(i): float(v) for i, v in zip(prof.honest, values)}
    adversary = f"collusion of {mechanism.corrupted.size} parties"
    return _audit(mechanism, mu, "exact", sensitivity, adversary, targets, runs=runs, delta=delta,
                  confidence=confidence, seed=seed, batch=batch, progress=progress, notes=[])


def _sensitivity(certified: float, requested: float | None) -> float:
    if requested is not None and not math.isclose(float(requested), certified, rel_tol=1e-12):
        raise ValueError(f"value_sensitivity {requested!r} differs from the certificate's {certified!r}")
    return float(certified)


def _check_targets(targets: Sequence[int] | None, mu: dict[int, float], parties: int) -> np.ndarray:
    if targets is None:
        return np.asarray(default_targets(mu), dtype=np.int64)
    chosen = []
    for t in targets:
        t = check_int("target party", t, 0, parties - 1)
        if t not in mu:
            raise ValueError(f"target party {t} is corrupted (or not certified): attack honest parties only")
        if t not in chosen:
            chosen.append(t)
    if not chosen:
        raise ValueError("give at least one target party")
    return np.asarray(chosen, dtype=np.int64)


def check_attack_size(messages: int, runs: int, targets: int) -> None:
    """Refuse, before allocating anything, an audit whose memory would not be bounded: ``messages`` observed
    per run (at most :data:`MAX_MESSAGES`), ``runs x targets`` statistics (at most :data:`MAX_STATISTICS`)."""
    m = int(messages)
    if m > MAX_MESSAGES:
        raise ValueError(f"the adversary observes {m} messages per run: the attacker's {m} x {m} covariance "
                         f"needs about {32 * m * m / 2**30:.0f} GiB (limit {MAX_MESSAGES} messages); audit a "
                         "smaller execution or a smaller coalition")
    if runs * targets > MAX_STATISTICS:
        raise ValueError(f"runs x targets must be at most {MAX_STATISTICS} (the statistics kept in memory), "
                         f"got {runs} x {targets}")


def _audit(mechanism: LinearMechanism, mu: dict[int, float], method: str, sensitivity: float, adversary: str,
           targets: Sequence[int] | None, *, runs: int, delta: float, confidence: float, seed: int | None,
           batch: int | None, progress: Callable[[int, int], None] | None, notes: list[str]) -> AttackAudit:
    """Build the attacker, run the fresh-noise runs, and judge each target's certificate."""
    start = time.perf_counter()
    runs = check_int("runs", runs, 100)
    delta = check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
    confidence = check_real("confidence", confidence, 0.0, 1.0, low_open=True, high_open=True)
    chosen = _check_targets(targets, mu, mechanism.parties)
    check_attack_size(mechanism.rows, runs, chosen.size)
    batch = _default_batch(mechanism.parties) if batch is None else check_int("batch", batch, 1)
    seed = int(np.random.SeedSequence().entropy) if seed is None else check_int("seed", seed, 0)
    # engine calls: the unit responses of the noise (one per batch of variables) and of the targets' values,
    # then two per batch of runs (the observed messages, what the adversary computes)
    total = -(-mechanism.noise_variables // batch) + 1 + 2 * -(-runs // batch)
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    attacker = build_attacker(mechanism, chosen, batch, step)
    structure_seconds = time.perf_counter() - start
    statistic, labels = _run(mechanism, attacker, runs, batch, sensitivity, seed, step)
    for p in chosen:
        if not 0 < mu[int(p)] < math.inf:
            notes.append(f"party {int(p)}: the certificate claims " + (
                "no protection (mu = inf): nothing to check" if mu[int(p)] else
                "that nothing of its value is observed (mu = 0): nothing to attack"))
    alpha = (1.0 - confidence) / (_CHECKS * chosen.size)  # Bonferroni: simultaneous intervals
    results = [_judge(int(p), mu[int(p)], sensitivity, float(attacker.predicted_std[k]), statistic[k],
                      labels[k], delta, alpha) for k, p in enumerate(chosen)]
    return AttackAudit(results, mechanism=mechanism.label, adversary=adversary, runs=runs,
                       confidence=confidence, delta=delta, value_sensitivity=sensitivity, seed=seed, messages=mechanism.rows,
                       kept_messages=attacker.kept_messages, certificate_method=method,
                       seconds=time.perf_counter() - start, structure_seconds=structure_seconds, notes=notes)


def _default_batch(parties: int) -> int:
    """Runs per engine call: at most :data:`_BATCH_ENTRIES` (party x run) entries, 64 to 4096 runs."""
    return max(64, min(4096, _BATCH_ENTRIES // parties))


def _run(mechanism: LinearMechanism, attacker: LinearAttacker, runs: int, batch: int, sensitivity: float,
         seed: int, step: Callable[[], None]) -> tuple[np.ndarray, np.ndarray]:
    """The attacker's statistic (K, runs) and the target's true value as a label (K, runs): 0 or 1 for a
    value of 0 or ``sensitivity``. Every batch draws fresh values for everybody else (uniform in
    [0, sensitivity]: the adversary knows them, so they must cancel) and fresh noise."""
    K = attacker.targets.size
    statistic, labels = np.empty((K, runs)), np.empty((K, runs), dtype=np.int8)
    root = np.random.SeedSequence(seed)
    for b, child in enumerate(root.spawn(-(-runs // batch))):
        lo, hi = b * batch, min((b + 1) * batch, runs)
        width = hi - lo
        rng = np.random.default_rng(child)
        values = rng.uniform(0.0, sensitivity, (mechanism.parties, width))
        for k in range(K):  # balanced labels, each target independently
            labels[k, lo:hi] = rng.permutation(np.arange(width) % 2)
            values[attacker.targets[k]] = labels[k, lo:hi] * sensitivity
        noise_seed = int(child.generate_state(1, dtype=np.uint64)[0] >> 1)
        observed = mechanism.observe(values, noise_seed)
        step()
        # what the adversary computes itself: the messages of every value it knows and of its own noise.
        # One engine run without any target's value, then, for target k, the other targets' values added
        # through their unit responses (the adversary of target k knows them; it never uses x_k)
        guess = values.copy()
        guess[attacker.targets] = 0.0
        residual = observed - mechanism.known(guess, noise_seed)
        step()
        for k in range(K):
            others = np.flatnonzero(np.arange(K) != k)
            known_others = attacker.responses[:, others] @ values[attacker.targets[others]]
            statistic[k, lo:hi] = attacker.estimate(residual - known_others, k)
    return statistic, labels


def _judge(party: int, mu: float, sensitivity: float, predicted_std: float, statistic: np.ndarray,
           labels: np.ndarray, delta: float, alpha: float) -> TargetAudit:
    """The three checks of one target (module docstring), each interval at two-sided level ``alpha``."""
    truth = labels * sensitivity
    errors = statistic - truth
    n = errors.size
    ss = float(errors @ errors)
    error_std = math.sqrt(ss / n)
    std_lo, std_hi = std_interval(ss, n, alpha)
    promised = sensitivity / mu if mu > 0 else math.inf
    ratio = error_std / promised if math.isfinite(promised) and promised > 0 else math.nan
    ratio_iv = (std_lo / promised, std_hi / promised) if math.isfinite(ratio) else (math.nan, math.nan)
    eps = epsilon_for_delta(mu, delta)
    positives, negatives = int(labels.sum()), int(labels.size - labels.sum())
    mu_test = eps_test = None
    mu_hat, mu_iv, eps_hat, eps_iv = 0.0, (0.0, 0.0), 0.0, (0.0, 0.0)
    if math.isfinite(predicted_std):
        rate_alpha = alpha / 2  # each bound combines two rates
        tau = choose_threshold(predicted_std, sensitivity, positives, negatives, rate_alpha, "mu")
        mu_test = Rates.count(statistic, labels, tau, rate_alpha)
        mu_hat, mu_iv = mu_test.mu()
        tau = choose_threshold(predicted_std, sensitivity, positives, negatives, rate_alpha, "epsilon", delta)
        eps_test = Rates.count(statistic, labels, tau, rate_alpha)
        eps_hat, eps_iv = eps_test.epsilon(delta)
    reasons = []
    if ratio_iv[1] < 1:
        reasons.append(f"the attack's error std is {ratio:.4g} [{ratio_iv[0]:.4g}, {ratio_iv[1]:.4g}] of the "
                       "smallest the certificate allows")
    if mu_iv[0] > mu:
        reasons.append(f"the distinguisher shows mu >= {mu_iv[0]:.4g}, above the certified {mu:.4g}")
    if eps_iv[0] > eps:
        reasons.append(f"the distinguisher shows epsilon >= {eps_iv[0]:.4g} at delta = {delta:g}, above the "
                       f"certified {eps:.4g}")
    return TargetAudit(party, mu, eps, promised, predicted_std, error_std, (std_lo, std_hi), ratio, ratio_iv,
                       mu_hat, mu_iv, eps_hat, eps_iv, mu_test, eps_test, _roc(statistic, labels),
                       tuple(reasons))


def _roc(statistic: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FPR, TPR) of ``statistic > threshold`` over every threshold, thinned to about _ROC_POINTS points
    (evenly in log FPR, so that the tail, where the privacy loss shows, keeps its detail)."""
    order = np.argsort(-statistic, kind="stable")
    ones = labels[order].astype(bool)
    tpr = np.concatenate([[0.0], np.cumsum(ones) / max(ones.sum(), 1)])
    fpr = np.concatenate([[0.0], np.cumsum(~ones) / max((~ones).sum(), 1)])
    keep = np.unique(np.concatenate([
        np.searchsorted(fpr, np.geomspace(max(fpr[fpr > 0].min(initial=1.0), 1e-9), 1.0, _ROC_POINTS)),
        np.linspace(0, fpr.size - 1, _ROC_POINTS // 4).astype(np.int64)]))
    keep = keep[keep < fpr.size]
    return fpr[keep], tpr[keep]
