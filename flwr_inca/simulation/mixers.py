"""How the round's client updates become the model update: the ``Mixer`` interface and its references.

A mixer works in two steps, in this order (the product's first promise: charge first, then do
anything that can fail):

1. :meth:`Mixer.plan` decides, *before any value exists*, what the round will do and what it costs:
   for IncA the execution trace (topology, dropouts) is sampled and certified against the threat; a
   trusted server knows its noise. Nothing in a plan depends on the clients' data, so the runner
   checks and charges the privacy ledger with ``plan.mu`` before any client trains.
2. :meth:`Mixer.mix` turns the clipped updates of the participants (rows, in the plan's order) into
   the released update, following the plan.

Adding a mechanism (local DP, DP gossip, Muffliato, GOPA, ...) is one small class::

    @register_mixer
    class LocalDP(Mixer):
        name = "local-dp"

        def plan(self, round, participants):
            z = 1.0 / self.context.mu_round             # noise multiplier meeting the round target
            return RoundPlan(round, participants, mu=1.0 / z, certified=True,
                             info={"noise_multiplier": z})

        def mix(self, updates, plan):
            rng = self.rng(plan.round)
            std = plan.info["noise_multiplier"] * self.context.value_sensitivity
            return (updates + std * rng.standard_normal(updates.shape)).mean(axis=0)

and ``SimulationConfig(mode="local-dp")`` then runs it (``config.mixer_options`` reach
:meth:`Mixer.from_config` for the mechanism's own parameters).

``plan.mu`` is the round's GDP parameter for one protected unit (one record or one client), with the
value sensitivity already applied; ``math.inf`` means "no guarantee" (e.g. FedAvg).
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .._checks import check_int, check_probability, check_real
from ..privacy.budget_check import predicted_round_mu, prediction_seeds
from ..privacy.calibration import Calibration, calibrate
from ..privacy.conversions import epsilon_for_delta
from ..privacy.prefix import RoundPrefix
from ..privacy.rounds import RoundCertificate, certification_seeds
from ..protocol.config import IncaConfig
from ..protocol.dropout import DropoutModel
from ..protocol.engine import replay, sample_trace
from ..protocol.noise import NoiseSource
from ..protocol.trace import ExecutionTrace
from . import seeding
from .noise import NoiseAhead

if TYPE_CHECKING:
    from .config import SimulationConfig

__all__ = [
    "MIXERS",
    "CentralDPMixer",
    "FedAvgMixer",
    "IncaMixer",
    "MixContext",
    "Mixer",
    "RoundPlan",
    "create_mixer",
    "register_mixer",
]


@dataclass(frozen=True)
class MixContext:
    """What a mixer knows before round 1 (set by the runner through :meth:`Mixer.prepare`).

    Attributes:
        value_sensitivity: L2 change of one client's update when the protected unit changes.
        mu_round: per-round GDP target to calibrate noise for (None: no target; noise given).
        delta: the delta at which the run's epsilon is reported.
        participants: expected participants per round (what calibration simulates).
        dimension: d, the length of an update.
        seed: the simulation's seed (mixers derive their streams with ``seeding``).
        precision: dtype of the updates :meth:`Mixer.mix` gets (``"float32"`` or ``"float64"``).
    """

    value_sensitivity: float
    mu_round: float | None
    delta: float
    participants: int
    dimension: int
    seed: int
    precision: str = "float32"


@dataclass
class RoundPlan:
    """What a round will do and what it costs, decided before any value exists.

    Attributes:
        round: 1-based round number.
        participants: number of clients whose updates :meth:`Mixer.mix` will get.
        mu: GDP parameter of the round for one protected unit (``inf``: no guarantee).
        certified: True if ``mu`` is exact for this round (a certificate of its execution, or an
            exact mechanism); False if it is a prediction or a bound (then ``info["cost"]`` says which).
        trace: IncA's execution trace (None for mechanisms without one).
        info: mechanism details for the history (noise levels, finalists, seconds spent, notes).
    """

    round: int
    participants: int
    mu: float
    certified: bool
    trace: ExecutionTrace | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Mixer(ABC):
    """Turns a round's clipped client updates into the released model update (see module doc)."""

    name: ClassVar[str] = "abstract"
    private: ClassVar[bool] = True  # False: adds no noise; the run must have no budget

    def __init__(self) -> None:
        self.context: MixContext | None = None

    @classmethod
    def from_config(cls, config: SimulationConfig) -> Mixer:
        """Build the mixer from the simulation's configuration (default: no parameters)."""
        return cls(**dict(config.mixer_options))

    def prepare(self, context: MixContext) -> None:
        """Called once before round 1 (calibrate noise here)."""
        self.context = context

    def rng(self, round: int) -> np.random.Generator:
        """This mixer's noise stream for ``round``."""
        return seeding.stream(self.context.seed, seeding.NOISE, round)

    @abstractmethod
    def plan(self, round: int, participants: int) -> RoundPlan:
        """The round's plan and cost for ``participants`` clients; must not depend on their data."""

    @abstractmethod
    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        """``updates``: (participants, d) clipped updates. Returns the released update (d,)
        (NaN if the round produced no output, e.g. every IncA party dropped out)."""

    def abandon(self, plan: RoundPlan) -> None:
        """The planned round will not be mixed (its charge was refused): release what it holds."""

    def stopped_cost(self, plan: RoundPlan, fits: Callable[[float], bool] | None = None) -> float:
        """What a round whose charge was refused has spent anyway (GDP mu): 0 for a mechanism that reveals
        nothing before its release. A deployment learns a round's exact cost only as it runs (IncA: before
        its final messages), so such a mechanism has spent what it revealed until then. ``fits`` (the
        budget guard): a deployment that checks ``fits`` before each step it reveals stops at the last
        step that fits; the cost is then that step's (``plan.info["delivered_iterations"]`` for IncA)."""
        return 0.0

    def predicted_cost(self, participants: int, runs: int) -> float | None:
        """What a deployment predicts, before a round of ``participants`` starts, that the round will cost
        (GDP mu), from ``runs`` simulated executions (no value): the runner's pre-round budget check
        (:func:`flwr_inca.privacy.budget_check.check_round_budget`, as ``IncaStrategy`` runs it). None
        (default): no prediction, for a mechanism that reveals nothing before its release (a round it
        cannot afford spends nothing, and training stops at once)."""
        return None

    def describe(self) -> str:
        return self.name


MIXERS: dict[str, type[Mixer]] = {}


def register_mixer(cls: type[Mixer]) -> type[Mixer]:
    """Class decorator: make ``cls`` available as ``SimulationConfig(mode=cls.name)``."""
    if not (isinstance(cls, type) and issubclass(cls, Mixer)) or cls.name in ("", "abstract"):
        raise ValueError("register_mixer: expected a Mixer subclass with a name")
    MIXERS[cls.name] = cls
    return cls


def create_mixer(config: SimulationConfig) -> Mixer:
    """A new mixer of ``config.mode`` with its ``from_config``; ``ValueError`` naming ``mixer_options``
    for an option the mechanism does not take."""
    try:
        cls = MIXERS[config.mode]
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(MIXERS)}, got {config.mode!r}") from None
    try:
        return cls.from_config(config)
    except TypeError as exc:  # an unknown or missing keyword argument
        raise ValueError(f"mixer_options for mode {config.mode!r}: {exc}") from None


# ------------------------------------------------------------------------------------------ FedAvg
@register_mixer
class FedAvgMixer(Mixer):
    """Trusted server, no noise: the plain mean of the (clipped) updates. No privacy (mu = inf)."""

    name = "fedavg"
    private = False

    def plan(self, round: int, participants: int) -> RoundPlan:
        return RoundPlan(round, participants, math.inf, False, info={"cost": "none (no noise)"})

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        return updates.mean(axis=0, dtype=np.float64).astype(updates.dtype)


# ------------------------------------------------------------------------------------------ central DP
@register_mixer
class CentralDPMixer(Mixer):
    """Trusted server adds Gaussian noise to the sum: ``(sum_i x_i + N(0, (z S)^2 I)) / n``.

    ``z`` (noise multiplier) is ``1 / mu_round`` for a budget, or given; the round is then exactly
    ``1/z``-GDP for a change of size S (the value sensitivity) of one update (Gaussian mechanism).
    """

    name = "central-dp"

    def __init__(self, noise_multiplier: float | None = None) -> None:
        super().__init__()
        if noise_multiplier is not None:
            noise_multiplier = check_real("noise_multiplier", noise_multiplier, 0.0, low_open=True)
        self.noise_multiplier = noise_multiplier

    @classmethod
    def from_config(cls, config: SimulationConfig) -> Mixer:
        return cls(noise_multiplier=config.noise_multiplier, **dict(config.mixer_options))

    def prepare(self, context: MixContext) -> None:
        super().prepare(context)
        if self.noise_multiplier is None:
            if context.mu_round is None:
                raise ValueError("central-dp needs noise_multiplier, or a budget (epsilon) to derive it from")
            self.noise_multiplier = 1.0 / context.mu_round

    def plan(self, round: int, participants: int) -> RoundPlan:
        z = float(self.noise_multiplier)
        return RoundPlan(
            round,
            participants,
            1.0 / z,
            True,
            info={"noise_multiplier": z, "noise_std": z * self.context.value_sensitivity / participants,
                  "method": "gaussian"},
        )

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        n, d = updates.shape
        std = plan.info["noise_multiplier"] * self.context.value_sensitivity
        total = updates.sum(axis=0, dtype=np.float64) + std * self.rng(plan.round).standard_normal(d)
        return (total / n).astype(updates.dtype)


# ------------------------------------------------------------------------------------------ IncA
def calibration_point(name: str, context: MixContext, margin: float) -> tuple[int, float]:
    """``(participants, per-round target mu less the relative margin)`` a mixer calibrates its noise for;
    a clear error when there is no budget to calibrate against."""
    if context.mu_round is None:
        raise ValueError(f"{name} needs sigma_star and sigma_delta, or a budget (epsilon) to calibrate them")
    return max(2, int(context.participants)), context.mu_round * (1.0 - margin)


@register_mixer
class IncaMixer(Mixer):
    """IncA among the round's participants: fresh execution per round, certified before it runs.

    Noise: ``sigma_star``/``sigma_delta`` given (value units), or calibrated once for the round target
    at the expected number of participants (``calibration_runs`` simulated executions). The target
    is lowered by ``calibration_margin`` (1%): calibration picks noise just above the floor, where a
    fresh execution's certified mu varies by a fraction of a percent around the target, and a round
    certified above it would end training before the planned rounds. With ``n`` participants
    sigma_star is scaled by
    ``sqrt(n_cal / n)`` (it protects through the sum of n values), sigma_delta is kept.

    Cost: every ``certify_every``-th round (1 = every round) the sampled trace is certified exactly
    against ``collusion`` (random corrupted sets, worst of ``threat_draws``) or ``observed_fraction``
    (Eavesdrop DP). Other rounds are charged a *prediction*, the largest certified mu so far, and
    marked ``certified=False``. ``certification="local-bound"`` certifies nothing and charges every round
    ``S / sigma_star``, a bound valid for any execution (all an adversary can learn about x_i passes
    through x_i + eta*_i): sound, but at the local-DP level; for runs where exact certificates are too
    costly (about 10,000 parties here).

    Every party online at the last iteration delivers its final message in a simulated trace, so the
    certificate of the sampled trace is also the pre-final bound of issue 15 (more finals can only
    raise mu): what is charged before the round is never below what the round reveals.
    """

    name = "inca"

    def __init__(
        self,
        *,
        iterations: int = 10,
        neighbors: int = 1,
        schedule: str = "incremental",
        topology: str = "random",
        dropout: DropoutModel | None = None,
        dissemination: str = "exact",
        collusion: float = 0.1,
        observed_fraction: float | None = None,
        threat_draws: int = 1,
        sigma_star: float | None = None,
        sigma_delta: float | None = None,
        calibration_runs: int = 10,
        calibration_margin: float = 0.01,
        certification: str = "exact",
        certify_every: int = 1,
        noise_ahead_bytes: int = 512 * 2**20,
    ) -> None:
        super().__init__()
        if (sigma_star is None) != (sigma_delta is None):
            raise ValueError("give both sigma_star and sigma_delta, or neither (then they are calibrated)")
        # validates iterations, neighbors, sigmas, schedule, topology, dropout, dissemination
        IncaConfig(
            sigma_star=sigma_star or 0.0,
            sigma_delta=sigma_delta or 0.0,
            iterations=iterations,
            neighbors=neighbors,
            schedule=schedule,
            topology=topology,
            dropout=dropout,
            dissemination=dissemination,
        )
        collusion = check_probability("collusion (a fraction of the participants)", collusion, one=False)
        if observed_fraction is not None:
            observed_fraction = check_probability("observed_fraction", observed_fraction)
        threat_draws = check_int("threat_draws", threat_draws)
        calibration_runs = check_int("calibration_runs", calibration_runs)
        certify_every = check_int("certify_every", certify_every)
        calibration_margin = check_real("calibration_margin", calibration_margin, 0.0, 1.0, high_open=True)
        noise_ahead_bytes = check_int("noise_ahead_bytes", noise_ahead_bytes, 0)
        if certification not in ("exact", "local-bound"):
            raise ValueError(f"certification must be 'exact' or 'local-bound', got {certification!r}")
        if certification == "local-bound" and sigma_star == 0:
            raise ValueError("certification='local-bound' needs sigma_star > 0 (mu = S / sigma_star)")
        self.iterations, self.neighbors = int(iterations), int(neighbors)
        self.schedule, self.topology, self.dropout = schedule, topology, dropout
        self.dissemination = dissemination
        self.collusion, self.observed_fraction, self.threat_draws = (
            float(collusion),
            observed_fraction,
            threat_draws,
        )
        self.sigma_star, self.sigma_delta = sigma_star, sigma_delta
        self.calibration_runs, self.calibration_margin = calibration_runs, float(calibration_margin)
        self.certification, self.certify_every = certification, certify_every
        self.noise_ahead_bytes = int(noise_ahead_bytes)
        self.calibration: Calibration | None = None
        self._calibrated_n = 0
        self._worst_certified = 0.0
        self._predicted: dict[tuple[int, int], float] = {}  # predicted_cost by (participants, runs)

    @classmethod
    def from_config(cls, config: SimulationConfig) -> Mixer:
        return cls(
            iterations=config.iterations,
            neighbors=config.neighbors,
            schedule=config.schedule,
            topology=config.topology,
            dropout=config.dropout,
            dissemination=config.dissemination,
            collusion=config.collusion,
            observed_fraction=config.observed_fraction,
            threat_draws=config.threat_draws,
            sigma_star=config.sigma_star,
            sigma_delta=config.sigma_delta,
            calibration_runs=config.calibration_runs,
            certification=config.certification,
            certify_every=config.certify_every,
            **dict(config.mixer_options),
        )

    @property
    def threat(self) -> str:
        if self.observed_fraction is not None:
            return f"eavesdropping on {self.observed_fraction:.0%} of the messages"
        return f"collusion of {self.collusion:.0%} of the participants"

    def describe(self) -> str:
        cert = (
            "exact certificate every round"
            if self.certify_every == 1
            else f"exact certificate every {self.certify_every} rounds, a prediction in between"
        )
        if self.certification == "local-bound":
            cert = "no certificate: every round charged the local bound S / sigma_star"
        return (
            f"inca (T = {self.iterations}, k = {self.neighbors}, {self.schedule}, {self.topology}, "
            f"dropout {self.dropout!r}; threat: {self.threat}; {cert})"
        )

    # ------------------------------------------------------------------------ noise
    def prepare(self, context: MixContext) -> None:
        super().prepare(context)
        if self.sigma_star is not None:
            return
        n, target = calibration_point("inca", context, self.calibration_margin)
        self.calibration = calibrate(
            epsilon_for_delta(target, context.delta),
            context.delta,
            n,
            iterations=self.iterations,
            neighbors=min(self.neighbors, n - 1),
            collusion=self.collusion,
            observed_fraction=self.observed_fraction,
            dropout=self.dropout,
            topology=self.topology,
            schedule=self.schedule,
            runs=self.calibration_runs,
            seed=seeding.seed_of(context.seed, seeding.CALIBRATION),
            value_sensitivity=context.value_sensitivity,
        )
        self._calibrated_n = n

    def sigmas(self, participants: int) -> tuple[float, float]:
        """(sigma_star, sigma_delta) in value units for a round of ``participants`` parties."""
        if self.sigma_star is not None:
            return float(self.sigma_star), float(self.sigma_delta)
        cal = self.calibration
        return cal.sigma_star * math.sqrt(self._calibrated_n / participants), cal.sigma_delta

    def inca_config(self, participants: int) -> IncaConfig:
        s_star, s_delta = self.sigmas(participants)
        return IncaConfig(
            sigma_star=s_star,
            sigma_delta=s_delta,
            iterations=self.iterations,
            neighbors=min(self.neighbors, participants - 1),
            schedule=self.schedule,
            topology=self.topology,
            dropout=self.dropout,
            dissemination=self.dissemination,
        )

    # ------------------------------------------------------------------------ round
    @staticmethod
    def threat_seed(seed: int) -> int:
        """The root of the threat draws of a simulation with ``seed``."""
        return seeding.seed_of(seed, seeding.THREAT)

    def certify(self, trace: ExecutionTrace, round: int, seed: int, finals: list[int] | None = None) -> float:
        """Worst certified mu over ``threat_draws`` random corrupted sets (or eavesdropped message
        sets), drawn by :func:`flwr_inca.privacy.rounds.certification_views`: the same draws as ``IncaStrategy``
        for its seed (tests/test_simulation_flower.py checks it). ``finals``: the parties whose final
        messages are observed (None: every party online at T; ``[]``: a round stopped before them)."""
        return self.certificate(trace, round, seed, finals).mu

    def certificate(self, trace: ExecutionTrace, round: int, seed: int,
                    finals: list[int] | None = None) -> RoundCertificate:
        """:meth:`certify`'s worst mu with the certificate methods that gave it (for the ledger)."""
        return self.round_prefix(trace, round, seed).with_finals(finals)

    def round_prefix(self, trace: ExecutionTrace, round: int, seed: int) -> RoundPrefix:
        """The round's adversaries factorized once (:class:`flwr_inca.privacy.prefix.RoundPrefix`, as
        ``IncaStrategy`` computes them): the cost with any finals and of any prefix of the round."""
        return RoundPrefix(trace, certification_seeds(int(seed), round), self.threat_draws,
                           collusion=self.collusion, observed_fraction=self.observed_fraction,
                           value_sensitivity=self.context.value_sensitivity)

    def stopped_cost(self, plan: RoundPlan, fits: Callable[[float], bool] | None = None) -> float:
        """IncaStrategy's pre-final rule: a round whose cost with its final messages does not fit is
        stopped before them, having spent what its mixing revealed without them, certified exactly on
        the same adversaries (and never above a certified plan's cost, which bounds it). With ``fits``,
        its budget guard too: the round stops before the first iteration whose messages would reveal
        more than fits, and costs what the iterations before it revealed (the whole trace is known, so
        the largest affordable prefix is found directly: :meth:`RoundPrefix.largest_affordable`).
        ``plan.info["delivered_iterations"]``: the iterations whose messages were delivered."""
        if plan.trace is None:
            return 0.0
        prefix = self.round_prefix(plan.trace, plan.round, self.threat_seed(self.context.seed))
        T = plan.trace.iterations
        if fits is None:
            delivered, cert = T, prefix.through(T)
        else:
            delivered, cert = prefix.largest_affordable(fits)
        plan.info["delivered_iterations"] = delivered
        return min(cert.mu, plan.mu) if plan.certified else cert.mu

    def _local_bound(self, config: IncaConfig) -> float:
        """``certification="local-bound"``'s cost of any round at ``config``'s sigmas: mu = S / sigma_star."""
        return self.context.value_sensitivity / config.sigma_star

    def predicted_cost(self, participants: int, runs: int) -> float:
        """``IncaStrategy``'s prediction (:func:`flwr_inca.privacy.budget_check.predicted_round_mu`): the
        worst certified mu over ``runs`` executions of ``participants`` parties sampled with this mixer's
        settings (sigmas at that n, topology, within-round dropout), against its threat, drawn from
        ``prediction_seeds`` of its threat seed (an ``IncaStrategy`` with that seed and the same settings
        predicts the same mu). ``certification="local-bound"``: the bound every round is charged.
        Cached per (participants, runs)."""
        key = (int(participants), int(runs))
        if key not in self._predicted:
            config = self.inca_config(participants)
            if self.certification == "local-bound":
                mu = self._local_bound(config)
            else:
                mu = predicted_round_mu(
                    participants, config, prediction_seeds(self.threat_seed(self.context.seed), participants), runs,
                    threat_draws=self.threat_draws, collusion=self.collusion,
                    observed_fraction=self.observed_fraction, value_sensitivity=self.context.value_sensitivity)
            self._predicted[key] = mu
        return self._predicted[key]

    def plan(self, round: int, participants: int) -> RoundPlan:
        config = self.inca_config(participants)
        start = time.perf_counter()
        trace = sample_trace(participants, config, seeding.seed_of(self.context.seed, seeding.TRACE, round))
        info: dict[str, Any] = {
            "sigma_star": config.sigma_star,
            "sigma_delta": config.sigma_delta,
            "finalists": int(trace.steps[-1].online.size),
        }
        if self.noise_ahead_bytes > 0:  # the round's noise is drawn while it is certified and trained
            info["noise_ahead"] = NoiseAhead(
                self._noise_seed(round),
                trace,
                self.context.dimension,
                np.dtype(self.context.precision),
                self.noise_ahead_bytes,
            )
        sampled = time.perf_counter()
        if self.certification == "local-bound":
            mu, certified = self._local_bound(config), False
            info["cost"] = "local bound S / sigma_star (valid for any execution; not a certificate)"
            info["method"] = "local-bound"
        elif (round - 1) % self.certify_every == 0 or self._worst_certified == 0.0:
            cert = self.certificate(trace, round, self.threat_seed(self.context.seed))
            mu, certified = cert.mu, True
            self._worst_certified = max(self._worst_certified, mu)
            info["cost"] = "certified"
            info["method"] = cert.method
        else:
            mu, certified = self._worst_certified, False
            info["cost"] = "predicted: largest certified mu so far (not certified)"
            info["method"] = "predicted"
        info["seconds_trace"] = sampled - start
        info["seconds_certify"] = time.perf_counter() - sampled
        return RoundPlan(round, participants, mu, certified, trace, info)

    def _noise_seed(self, round: int) -> int:
        return seeding.seed_of(self.context.seed, seeding.NOISE, round)

    def mix(self, updates: np.ndarray, plan: RoundPlan, noise: NoiseSource | None = None) -> np.ndarray:
        """IncA on the updates, replaying the planned execution. ``noise`` replaces the simulated
        noise (e.g. ``PartyNoise.explicit(...)`` to reproduce a Flower round)."""
        ahead = plan.info.pop("noise_ahead", None)
        try:
            result = replay(
                plan.trace,
                updates,
                self._noise_seed(plan.round),
                dissemination=self.dissemination,
                noise=noise if noise is not None else ahead,
            )
        finally:
            if ahead is not None:
                ahead.close()
        return result.estimate

    def abandon(self, plan: RoundPlan) -> None:
        ahead = plan.info.pop("noise_ahead", None)
        if ahead is not None:
            ahead.close()
