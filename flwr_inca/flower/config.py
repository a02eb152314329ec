"""``IncaStrategy``'s settings, in four frozen, validated groups.

* :class:`PrivacyTarget`: what a round must guarantee, against whom, and the total budget;
* :class:`MixingConfig`: the IncA execution of a round (iterations, noise, when a round fails);
* :class:`RelayConfig`: timeouts and retries of the relayed exchanges;
* :class:`PersistenceConfig`: where the privacy ledger and the execution traces are kept.

Every field can also be given to ``IncaStrategy`` directly as a keyword (``IncaStrategy(epsilon=1.0,
iterations=20)``); the groups are for settings kept and shared as objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .._checks import check_bool, check_int, check_probability, check_real
from ..privacy.accountants import create_accountant, resolve_accountant_name
from ..protocol.config import IncaConfig
from ..protocol.dropout import DropoutModel, resolve_dropout

__all__ = ["PrivacyTarget", "MixingConfig", "RelayConfig", "PersistenceConfig", "CONFIG_GROUPS"]


@dataclass(frozen=True)
class PrivacyTarget:
    """The privacy each round must have, the threat it is certified against, and the budget.

    Attributes:
        epsilon: per-round target; when the mixing noise is not given, it is calibrated for
            (``epsilon``, ``delta``) per round against the threat below.
        delta: of the per-round target and of the total reported by the ledger, in (0, 1).
        max_epsilon: total budget at ``delta``, never exceeded; training stops (``IncaBudgetExhausted``)
            before a round predicted to exceed it; a round whose certificate would exceed it is stopped
            before its final messages and skipped (docs/privacy.md). None: unlimited.
        clip_norm: L2 bound C of each node's update (new model - global model), in model units.
        value_sensitivity: how much one protected unit can change a node's value; default 2C
            (party-level, replace-one). For record-level DP give the per-record sensitivity of your
            local step (e.g. lr * C_example / expected batch size) and its ``sample_rate``.
        sample_rate: Poisson sampling rate of the protected unit per round (record-level DP).
        accountant: ``"exact"`` (default without subsampling), ``"opacus-prv"`` (default with) or
            ``"opacus-rdp"``; the names before 0.2 (``"gdp"``, ``"prv"``, ``"rdp"``) still work.
        collusion: fraction rho of corrupted nodes certified against (Collusion DP: random sets,
            ``threat_draws`` draws, the worst kept).
        observed_fraction: certify against an eavesdropper who sees this fraction of the messages
            (Eavesdrop DP) instead of colluders.
        threat_draws: random corrupted sets (or intercepted message sets) per certification.
        budget_check_runs: simulated executions whose worst certified cost is the predicted cost of the
            next round when checking ``max_epsilon``. The actual round may cost more (its topology is
            random): it is then stopped before its final messages, charged what was observed without
            them, and skipped (the model kept; see ``max_consecutive_refusals``); ``max_epsilon`` is never
            exceeded.
        calibration_runs: simulated executions the noise is calibrated over.
        calibration_dropout: dropout model of those executions (None: nobody drops out).
        reserve_stopped_round: make ``max_epsilon`` a hard limit also for a round stopped before its
            final messages (default). When the most such a round could cost on any execution
            (``flwr_inca.privacy.prefinal.no_finals_bound``) does not fit the budget left, the round
            runs *guarded*: before each iteration's messages are forwarded, what the adversaries would
            then have observed is certified, and the round stops before the first iteration that would
            not fit (docs/privacy.md, "The budget guard"). False (the behaviour before the guard): only
            the predicted cost is checked; a round stopped before its finals is charged the exact cost
            of what was observed, which can take the total past ``max_epsilon`` (logged as an error);
            training then stops.
        max_consecutive_refusals: a round refused by the budget (stopped before its finals, or by the guard)
            is *skipped*: charged what it revealed, the model kept, and training goes on with the next
            round's fresh execution (while the pre-round check lets it start). Training stops
            (``IncaBudgetExhausted``) after this many refused rounds in a row (a round charged in full
            resets the count), so a cost that is systematically under-predicted cannot spend the budget
            round after round; 1 stops at the first refused round. A round the guard stopped before any
            of its messages was delivered stops training at once. Same name and meaning as
            ``flwr_inca.simulation.SimulationConfig.max_consecutive_refusals``.
    """

    epsilon: float | None = None
    delta: float = 1e-5
    max_epsilon: float | None = None
    clip_norm: float = 1.0
    value_sensitivity: float | None = None
    sample_rate: float = 1.0
    accountant: str | None = None
    collusion: float = 0.1
    observed_fraction: float | None = None
    threat_draws: int = 3
    budget_check_runs: int = 10
    calibration_runs: int = 20
    calibration_dropout: DropoutModel | None = None
    reserve_stopped_round: bool = True
    max_consecutive_refusals: int = 3

    def __post_init__(self) -> None:
        check_bool("reserve_stopped_round", self.reserve_stopped_round)
        check_int("max_consecutive_refusals (rounds refused by the budget in a row before training stops)",
                  self.max_consecutive_refusals, 1)
        if self.epsilon is not None:
            check_real("epsilon", self.epsilon, 0.0, low_open=True)
        check_probability("delta", self.delta, zero=False, one=False)
        if self.max_epsilon is not None:
            check_real("max_epsilon", self.max_epsilon, 0.0, low_open=True)
        check_real("clip_norm", self.clip_norm, 0.0, low_open=True)
        if self.value_sensitivity is not None:
            check_real("value_sensitivity", self.value_sensitivity, 0.0, low_open=True)
        check_probability("sample_rate", self.sample_rate, zero=False)
        check_probability("collusion fraction", self.collusion, one=False)
        if self.observed_fraction is not None:
            check_probability("observed_fraction", self.observed_fraction)
        check_int("threat_draws", self.threat_draws)
        check_int("budget_check_runs", self.budget_check_runs)
        check_int("calibration_runs", self.calibration_runs)
        resolve_dropout(self.calibration_dropout)
        if self.accountant is not None:
            resolve_accountant_name(self.accountant)  # unknown names fail, old ones warn
        accountant = create_accountant(self.accountant_name)  # unknown names and missing extras fail now
        try:  # fail now, not after a round has spent privacy
            accountant.check_sample_rate(self.sample_rate)
        except ValueError as exc:
            raise ValueError(f"accountant {accountant.name!r} cannot account sample_rate = "
                             f"{self.sample_rate}: {exc}") from exc

    @property
    def sensitivity(self) -> float:
        """``value_sensitivity``, or its default 2 * ``clip_norm``."""
        if self.value_sensitivity is not None:
            return float(self.value_sensitivity)
        return 2 * float(self.clip_norm)

    @property
    def accountant_name(self) -> str:
        """The accountant's current name (``accountant``, or the default for ``sample_rate``)."""
        if self.accountant is None:
            return "exact" if self.sample_rate == 1 else "opacus-prv"
        return resolve_accountant_name(self.accountant, warn=False)

    def describe_threat(self) -> str:
        if self.observed_fraction is not None:
            return f"eavesdrop {self.observed_fraction:g}"
        return f"collusion {self.collusion:g}"


@dataclass(frozen=True)
class MixingConfig:
    """The IncA execution of each round, and when a round fails (keeping the model).

    Attributes:
        iterations: mixing iterations T per round (one relayed exchange each, plus the final report).
        neighbors: out-neighbours k each node picks per iteration (with its own randomness).
        sigma_star, sigma_delta: noise levels in update units; both None (default): calibrated per
            round for the ``PrivacyTarget``.
        schedule: ``"incremental"`` (D_Inc) or ``"early"`` (D_EI).
        precision: of the peer messages, ``"float32"`` (the precision of the model, and the bandwidth
            of FedAvg) or ``"float64"`` (exact arithmetic, twice the bytes).
        min_finalists: a round fails if fewer final messages arrive.
        max_noise_inflation: a node online at the last iteration whose final message is lost takes its
            share of the others' cancelling noise with it; the round fails if that makes the noise of the
            update more than this factor larger than with every final (``inca-noise-std``).
        max_update_norm: robustness guard: the round fails (model kept, cost charged) if the L2 norm of
            the averaged update exceeds it, in model units. None (default): 10 * (``clip_norm`` + the
            expected norm of the update's noise, ``sqrt(d) * inca-noise-std``), which an honest round
            exceeds with probability below 1e-20; ``math.inf``: no guard (a non-finite update still
            fails the round). Nodes are assumed to follow the protocol (a deviating node is outside the
            threat model); the guard only bounds what one can do to the model.
    """

    iterations: int = 10
    neighbors: int = 1
    sigma_star: float | None = None
    sigma_delta: float | None = None
    schedule: str = "incremental"
    precision: str = "float32"
    min_finalists: int = 2
    max_noise_inflation: float = 2.0
    max_update_norm: float | None = None

    def __post_init__(self) -> None:
        if (self.sigma_star is None) != (self.sigma_delta is None):
            raise ValueError("give both sigma_star and sigma_delta, or neither (then epsilon is required)")
        # validates iterations, neighbors, sigmas and the schedule with clear errors
        IncaConfig(iterations=self.iterations, neighbors=self.neighbors, schedule=self.schedule,
                   sigma_star=0.0 if self.sigma_star is None else self.sigma_star,
                   sigma_delta=0.0 if self.sigma_delta is None else self.sigma_delta)
        if self.precision not in ("float32", "float64"):
            raise ValueError(f"precision must be 'float32' or 'float64', got {self.precision!r}")
        check_int("min_finalists", self.min_finalists)
        check_real("max_noise_inflation", self.max_noise_inflation, 1.0, finite=False)
        if self.max_update_norm is not None:
            check_real("max_update_norm (or None)", self.max_update_norm, 0.0, low_open=True, finite=False)

    @property
    def calibrated(self) -> bool:
        """True when the noise is calibrated for the privacy target (no sigmas given)."""
        return self.sigma_star is None


@dataclass(frozen=True)
class RelayConfig:
    """The relayed mixing exchanges.

    Attributes:
        exchange_timeout: seconds to wait for the nodes in each mixing exchange; a node that has not
            answered by then is offline for that iteration (Algorithm 2).
        poll_interval: seconds between polls for replies (Flower's ``send_and_receive`` polls every
            0.1 s; a round makes T + 1 exchanges or more, so mixing polls faster).
        final_retries: extra exchanges for final messages still missing after the final report.
    """

    exchange_timeout: float = 60.0
    poll_interval: float = 0.01
    final_retries: int = 2

    def __post_init__(self) -> None:
        check_real("exchange_timeout (seconds)", self.exchange_timeout, 0.0, low_open=True)
        check_real("poll_interval (seconds)", self.poll_interval, 0.0, self.exchange_timeout, low_open=True)
        check_int("final_retries", self.final_retries, 0)


@dataclass(frozen=True)
class PersistenceConfig:
    """Where a round's lasting records go.

    Attributes:
        ledger_path: the privacy ledger (JSON); a restarted ServerApp resumes the budget it spent.
            None: memory only. Several processes may charge one file safely (it is locked).
        trace_dir: if set, each round's ``inca-trace/1`` is saved there as ``round-<r>.json``.
        ledger_owner: the training the ledger accounts for, recorded in the file; a ledger recorded for
            another owner is refused (before any node is contacted) unless ``share_ledger``. None
            (default): the Flower app's id (``<publisher>/<name>``, under ``flwr run``), else the main
            module's name (``python:<module>``, e.g. for ``run_simulation`` from a script).
        share_ledger: accept a ledger recorded for another owner: both trainings then charge one budget
            (right when they train on the same data); each entry records who spent it.
    """

    ledger_path: str | os.PathLike[str] | None = "inca_ledger.json"
    trace_dir: str | os.PathLike[str] | None = None
    ledger_owner: str | None = None
    share_ledger: bool = False

    def __post_init__(self) -> None:
        for name in ("ledger_path", "trace_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path or None, got {value!r}")
        if self.ledger_owner is not None and (not isinstance(self.ledger_owner, str) or not self.ledger_owner):
            raise ValueError(f"ledger_owner must be a non-empty string or None, got {self.ledger_owner!r}")
        check_bool("share_ledger", self.share_ledger)

    @property
    def trace_path(self) -> Path | None:
        return None if self.trace_dir is None else Path(self.trace_dir)


CONFIG_GROUPS = {"privacy": PrivacyTarget, "mixing": MixingConfig, "relay": RelayConfig,
                 "persistence": PersistenceConfig}
_FIELD_GROUP = {f.name: group for group, cls in CONFIG_GROUPS.items() for f in fields(cls)}


def build_groups(given: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The four settings groups from the group objects ``given`` (by group name, None if not given)
    and flat keyword ``options`` (any group's field names)."""
    flat: dict[str, dict[str, Any]] = {group: {} for group in CONFIG_GROUPS}
    for key, value in options.items():
        if key not in _FIELD_GROUP:
            groups = ", ".join(c.__name__ for c in CONFIG_GROUPS.values())
            raise TypeError(f"IncaStrategy() got an unexpected keyword argument {key!r}; the settings are "
                            f"FedAvg's and the fields of {groups}")
        flat[_FIELD_GROUP[key]][key] = value
    out = {}
    for group, cls in CONFIG_GROUPS.items():
        obj = given.get(group)
        if obj is None:
            out[group] = cls(**flat[group])
            continue
        if not isinstance(obj, cls):
            raise ValueError(f"{group} must be a {cls.__name__}, got {type(obj).__name__}")
        if flat[group]:
            raise ValueError(f"give {sorted(flat[group])} either as keywords or in {group}=, not both")
        out[group] = obj
    return out
