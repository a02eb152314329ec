"""The settings every driver shares: ``IncaStrategy`` (Flower), the simulator, the CLI and the study.

Three frozen, validated groups, the same objects under the same names everywhere, so that a setup
moves from the simulator to Flower by changing the driver, not the settings:

* :class:`PrivacyTarget`: the budget, the per-round target, the threat a round is certified against;
* :class:`MixingConfig`: the IncA execution of a round (iterations, noise, dropouts, when it fails);
* :class:`PersistenceConfig`: where the privacy ledger and the execution traces are kept.

Two epsilons, two names: ``max_epsilon`` is the total budget of a training (never exceeded), and
``round_epsilon`` the per-round target the noise is calibrated for (by default the budget's share of
``budget_rounds`` rounds). Every field can also be given to a driver directly as a keyword
(``IncaStrategy(max_epsilon=1.0, iterations=20)``, ``SimulationConfig(max_epsilon=1.0, iterations=20)``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ._checks import (
    MAX_PARTIES,
    check_bool,
    check_delta,
    check_epsilon,
    check_int,
    check_iterations,
    check_probability,
    check_real,
    check_rounds,
    check_runs,
    check_scale,
    check_workers,
)
from .privacy.accountants import create_accountant, resolve_accountant_name
from .protocol.config import IncaConfig
from .protocol.dropout import DropoutModel, resolve_dropout
from .protocol.schedules import RECOMMENDED_SCHEDULE

__all__ = ["MixingConfig", "PersistenceConfig", "PrivacyTarget", "build_groups"]

CERTIFICATIONS = ("exact", "local-bound")


@dataclass(frozen=True)
class PrivacyTarget:
    """The budget, the per-round target, and the threat every round is certified against.

    Attributes:
        max_epsilon: total budget of the training at ``delta``, never exceeded: a round that would exceed
            it does not start, or is stopped before what does not fit is released (docs/privacy.md, "The
            round session"). None: unlimited (every round is still certified and charged).
        round_epsilon: per-round target at ``delta`` the noise is calibrated for when no sigmas are given.
            None (default): the budget's share of ``budget_rounds`` rounds under the accountant.
        delta: of the target and of the total the ledger reports, in (0, 1).
        budget_rounds: rounds the budget is planned for (None: the rounds of the training being run).
        clip_norm: L2 clip of what one party contributes (Flower: its model update; the simulator: its
            update, or each example's gradient at record level), in model units.
        value_sensitivity: how much one protected unit can change a party's value. None: 2 ``clip_norm``
            (party level, replace-one); the simulator derives it from its training settings.
        sample_rate: Poisson sampling rate of the protected unit per round (record-level DP in Flower;
            the simulator derives it).
        accountant: ``"exact"`` (default without subsampling), ``"opacus-prv"`` (default with) or
            ``"opacus-rdp"``.
        collusion: fraction of corrupted parties certified against (Collusion DP, random sets).
        observed_fraction: certify against an eavesdropper who sees this fraction of the messages
            (Eavesdrop DP) instead of colluders.
        threat_draws: random corrupted sets (or intercepted message sets) per round; the worst is charged.
        calibration_runs: simulated executions the noise is calibrated over.
        calibration_success: share of those executions the noise must make meet the target (1: all).
        calibration_margin: the noise is calibrated for the per-round target lowered by this relative
            margin (a fresh execution certifies within a fraction of a percent of the target).
        budget_check_runs: simulated executions whose worst certified cost predicts a round's cost before
            it starts (a round predicted not to fit does not start).
        max_consecutive_refusals: a round refused by the budget (its execution certified too costly) is
            skipped, charged what it revealed; training stops after this many refusals in a row.
        mu_resolution: each charge is rounded *up* to this relative grid (at most 0.5% more by default),
            so that the PRV accountant composes few distinct rounds; 0 charges exactly.
        spend_budget: with the noise calibrated for the budget (no ``round_epsilon``), calibrate each round
            for what is left of ``max_epsilon`` over the rounds left (:func:`flwr_inca.rounds.budget_share`):
            rounds that certified below their target leave more to the later ones, so the budget is spent,
            never exceeded. False: every round is calibrated for the same planned share.
    """

    max_epsilon: float | None = None
    round_epsilon: float | None = None
    delta: float = 1e-5
    budget_rounds: int | None = None
    clip_norm: float = 1.0
    value_sensitivity: float | None = None
    sample_rate: float = 1.0
    accountant: str | None = None
    collusion: float = 0.1
    observed_fraction: float | None = None
    threat_draws: int = 1
    calibration_runs: int = 20
    calibration_success: float = 1.0
    calibration_margin: float = 0.01
    budget_check_runs: int = 10
    max_consecutive_refusals: int = 3
    mu_resolution: float = 0.005
    spend_budget: bool = True

    def __post_init__(self) -> None:
        if self.max_epsilon is not None:
            check_epsilon("max_epsilon (total budget, or None)", self.max_epsilon)
        if self.round_epsilon is not None:
            check_epsilon("round_epsilon (per-round target, or None)", self.round_epsilon)
        check_delta("delta", self.delta)
        if self.budget_rounds is not None:
            check_rounds("budget_rounds", self.budget_rounds)
        check_scale("clip_norm", self.clip_norm, zero=False)
        if self.value_sensitivity is not None:
            check_scale("value_sensitivity", self.value_sensitivity, zero=False)
        check_probability("sample_rate", self.sample_rate, zero=False)
        check_probability("collusion (a fraction of the parties)", self.collusion, one=False)
        if self.observed_fraction is not None:
            check_probability("observed_fraction", self.observed_fraction)
        check_workers("threat_draws", self.threat_draws)
        check_runs("calibration_runs", self.calibration_runs)
        check_probability("calibration_success (a share of the calibration runs)", self.calibration_success,
                          zero=False)
        check_real("calibration_margin", self.calibration_margin, 0.0, 1.0, high_open=True)
        check_runs("budget_check_runs (simulated executions that predict a round's cost)", self.budget_check_runs)
        check_rounds("max_consecutive_refusals (rounds refused by the budget in a row before training stops)",
                     self.max_consecutive_refusals)
        check_real("mu_resolution", self.mu_resolution, 0.0, 1.0, high_open=True)
        check_bool("spend_budget", self.spend_budget)
        accountant = create_accountant(self.accountant_name)  # unknown names and missing extras fail now
        try:  # fail now, not after a round has spent privacy
            accountant.check_sample_rate(self.sample_rate)
        except ValueError as exc:
            raise ValueError(f"accountant {accountant.name!r} cannot account sample_rate = "
                             f"{self.sample_rate}: {exc}") from None

    @property
    def sensitivity(self) -> float:
        """``value_sensitivity``, or its default 2 * ``clip_norm``."""
        if self.value_sensitivity is not None:
            return float(self.value_sensitivity)
        return 2 * float(self.clip_norm)

    @property
    def accountant_name(self) -> str:
        """The accountant (``accountant``, or the default for ``sample_rate``)."""
        if self.accountant is None:
            return "exact" if self.sample_rate == 1 else "opacus-prv"
        return resolve_accountant_name(self.accountant)

    def describe_threat(self) -> str:
        if self.observed_fraction is not None:
            return f"eavesdropping on {self.observed_fraction:.0%} of the messages"
        return f"collusion of {self.collusion:.0%} of the parties"


@dataclass(frozen=True)
class MixingConfig:
    """The IncA execution of each round, and when a round fails (keeping the model).

    Attributes:
        iterations: mixing iterations T per round (one peer exchange each, plus the final report), or
            ``"auto"`` (default): the fewest of 10, 20, 40, 80 (at most ``max_iterations``) whose noise left
            uncancelled by the expected dropouts (``dropout``) is at most ``dropout_noise_share`` of the
            central noise (:func:`flwr_inca.rounds.choose_iterations`); 10 without expected dropouts or with
            given sigmas. The noise that dropouts leave uncancelled falls as T grows, because calibration then
            needs less cancelling noise; each iteration costs ``neighbors`` messages per party.
        max_iterations: the communication budget of ``"auto"``: at most this many iterations (default 40).
        dropout_noise_share: ``"auto"``'s aim: uncancelled-dropout noise variance over central noise variance.
        neighbors: out-neighbours k each party picks per iteration.
        sigma_star, sigma_delta: noise levels in value units; both None (default): calibrated for the
            per-round target of the :class:`PrivacyTarget`.
        schedule: ``"auto"`` (default): D_Inc with a value-free tail, its value injected in equal parts in all
            but the last L steps (L = 3 from T = 9 on, T // 3 below: :func:`~flwr_inca.protocol.schedules.
            recommended_tail`), which needs less cancelling noise for the same certified privacy, hence leaves
            less noise uncancelled by dropouts (``flwr-inca reproduce frontier``); ``"incremental"`` (D_Inc,
            the paper's), ``"incremental:tail=L"`` or ``"early"`` (D_EI).
        topology: how parties pick peers (the simulator; a Flower node picks ``neighbors`` at random).
        dropout: the within-round dropout model: what calibration and the pre-round prediction expect
            (both drivers) and what the simulator draws. None: nobody drops out.
        dissemination: how the simulator estimates the average from the final messages (``"exact"``).
        precision: of the peer messages, ``"float32"`` or ``"float64"``.
        certification: ``"exact"`` certificates every round (default), or (simulator) ``"local-bound"``:
            every round charged ``S / sigma_star``, sound for any execution, at the local-DP level.
        certify_every: (simulator) certify every this many rounds; rounds in between are charged the
            largest certified mu so far (a prediction, marked as such).
        simulated_noise: (simulator) ``"aggregate"`` (default): a round's update drawn from its exact
            distribution (with exact dissemination it is linear in the values and Gaussian in the noise, with
            coefficients the execution determines: d random numbers per round); ``"messages"``: every
            message's noise drawn, as parties would (T n d numbers; the path replays and audits use).
        min_finalists: a round fails (model kept, cost charged) if fewer final messages arrive.
        max_noise_inflation: (Flower) a round fails if lost final messages make the update's noise more
            than this factor larger than with every final.
        max_update_norm: (Flower) a round fails if the averaged update's L2 norm exceeds it, in model units.
            None: 10 * (``clip_norm`` + the expected norm of the update's noise); ``math.inf``: no guard.
    """

    iterations: int | str = "auto"
    neighbors: int = 1
    sigma_star: float | None = None
    sigma_delta: float | None = None
    schedule: str = RECOMMENDED_SCHEDULE
    topology: str = "random"
    dropout: DropoutModel | None = None
    dissemination: str = "exact"
    precision: str = "float32"
    certification: str = "exact"
    certify_every: int = 1
    simulated_noise: str = "aggregate"
    min_finalists: int = 2
    max_noise_inflation: float = 2.0
    max_update_norm: float | None = None
    max_iterations: int = 40
    dropout_noise_share: float = 0.25

    def __post_init__(self) -> None:
        if (self.sigma_star is None) != (self.sigma_delta is None):
            raise ValueError("give both sigma_star and sigma_delta, or neither (then they are calibrated)")
        check_iterations("max_iterations", self.max_iterations)
        check_real("dropout_noise_share", self.dropout_noise_share, 0.0, 1e6, low_open=True)
        # validates iterations, neighbors, sigmas, schedule, topology, dropout and dissemination
        iterations = self.max_iterations if self.iterations == "auto" else self.iterations
        IncaConfig(iterations=iterations, neighbors=self.neighbors, schedule=self.schedule,
                   topology=self.topology, dropout=self.dropout, dissemination=self.dissemination,
                   sigma_star=0.0 if self.sigma_star is None else self.sigma_star,
                   sigma_delta=0.0 if self.sigma_delta is None else self.sigma_delta)
        resolve_dropout(self.dropout)
        if self.precision not in ("float32", "float64"):
            raise ValueError(f"precision must be 'float32' or 'float64', got {self.precision!r}")
        if self.certification not in CERTIFICATIONS:
            raise ValueError(f"certification must be one of {CERTIFICATIONS}, got {self.certification!r}")
        if self.certification == "local-bound" and self.sigma_star == 0:
            raise ValueError("certification='local-bound' needs sigma_star > 0 (mu = S / sigma_star)")
        check_rounds("certify_every", self.certify_every)
        if self.simulated_noise not in ("aggregate", "messages"):
            raise ValueError(f"simulated_noise must be 'aggregate' or 'messages', got {self.simulated_noise!r}")
        check_int("min_finalists", self.min_finalists, 1, MAX_PARTIES)
        check_real("max_noise_inflation", self.max_noise_inflation, 1.0, finite=False)
        if self.max_update_norm is not None:
            check_real("max_update_norm (or None)", self.max_update_norm, 0.0, low_open=True, finite=False)

    @property
    def calibrated(self) -> bool:
        """True when the noise is calibrated for the privacy target (no sigmas given)."""
        return self.sigma_star is None

    @property
    def automatic(self) -> bool:
        """True when the iterations are chosen for the expected dropouts (``iterations="auto"``)."""
        return self.iterations == "auto"


@dataclass(frozen=True)
class PersistenceConfig:
    """Where a training's lasting records go.

    Attributes:
        ledger_path: the privacy ledger (JSON). A ledger that exists is resumed: what it records counts as
            spent (a training that should start afresh needs another file). A relative path is relative to
            the ServerApp's working directory (``IncaStrategy``) or to the simulation's ``output_dir`` (the
            simulator keeps it in memory only when it has no output directory). None: memory only.
        trace_dir: if set, each round's execution trace is saved there as ``round-<r>.json``.
        ledger_owner: the training the ledger accounts for, recorded in the file; a ledger recorded for
            another owner is refused unless ``share_ledger``. None: the Flower app's id (``IncaStrategy``)
            or the simulation's output directory.
        share_ledger: accept a ledger recorded for another owner: both trainings then charge one budget.
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


GROUPS: dict[str, type] = {"privacy": PrivacyTarget, "mixing": MixingConfig, "persistence": PersistenceConfig}


def build_groups(groups: dict[str, type], given: dict[str, Any], options: dict[str, Any],
                 owner: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The settings groups of ``groups`` (name -> class) from the group objects ``given`` (by name, None if
    not given) and flat keyword ``options`` (any group's field names). Returns ``(groups, rest)``: the
    built objects, and the options that belong to no group (``owner`` decides what they are)."""
    where = {f.name: name for name, cls in groups.items() for f in fields(cls)}
    flat: dict[str, dict[str, Any]] = {name: {} for name in groups}
    rest = {}
    for key, value in options.items():
        if key in where:
            flat[where[key]][key] = value
        else:
            rest[key] = value
    out = {}
    for name, cls in groups.items():
        obj = given.get(name)
        if obj is None:
            out[name] = cls(**flat[name])
            continue
        if not isinstance(obj, cls):
            raise ValueError(f"{owner}: {name} must be a {cls.__name__}, got {type(obj).__name__}")
        if flat[name]:
            raise ValueError(f"{owner}: give {sorted(flat[name])} either as keywords or in {name}=, not both")
        out[name] = obj
    return out, rest
