"""How the round's client updates become the model update: the ``Mixer`` interface and its references.

A mixer works in three steps, in this order (the product's first promise: charge first, then release):

1. :meth:`Mixer.plan` decides, *before any value exists*, what the round will do and what it costs:
   for IncA the execution trace (topology, dropouts) is sampled and certified against the threat; a
   trusted server knows its noise. Nothing in a plan depends on the clients' data.
2. :meth:`Mixer.charge` runs the round's privacy through the run's
   :class:`~flwr_inca.privacy.session.RoundSession`, as a deployment of the mechanism would: reserved
   before anything is revealed, each step guarded, the release allowed only if it fits, then charged
   (the default: a mechanism that reveals nothing before its release).
3. :meth:`Mixer.mix` turns the clipped updates of the participants (rows, in the plan's order) into
   the released update, following the plan; it is applied only if the charge released the round.

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
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from .._checks import check_int, check_real
from ..privacy.calibration import Calibration
from ..privacy.rounds import RoundCertificate
from ..privacy.session import RoundCharge, RoundSession
from ..protocol.config import IncaConfig
from ..protocol.engine import replay, sample_trace
from ..protocol.noise import NoiseSource
from ..protocol.trace import ExecutionTrace
from ..protocol.utility import output_coefficients
from ..rounds import Calibrators, IncaRounds, choose_iterations
from ..settings import MixingConfig, PrivacyTarget
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
        messages: messages a participant sends in the round, on average (1: its update, to a server or as
            its final message; a gossip protocol: one per neighbour per step).
    """

    round: int
    participants: int
    mu: float
    certified: bool
    trace: ExecutionTrace | None = None
    info: dict[str, Any] = field(default_factory=dict)
    messages: float = 1.0


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

    def charge(self, session: RoundSession, plan: RoundPlan) -> RoundCharge:
        """Run the round's privacy through ``session`` as a deployment of the mechanism would, and return
        its charge. The default: a mechanism that reveals nothing before its release (a trusted server,
        local noise published at once): the release is reserved if it fits and charged ``plan.mu``;
        otherwise nothing was revealed, nothing is charged, and training stops (``charge.stop``)."""
        opened = session.open(plan.round, ceilings=[], note=f"round {plan.round}")
        cost = RoundCertificate(plan.mu, (str(plan.info.get("method", "certified")),))
        if opened.may_release(cost):
            return opened.settle(cost)
        return opened.refuse()

    def spend_what_is_left(self, ledger, rounds_left: int, sample_rate: float, participants: int) -> None:
        """Before a round of ``participants``: calibrate for what is left of the budget over the rounds left
        (mechanisms whose noise follows a per-round target; default: nothing changes)."""

    def predicted_cost(self, participants: int, runs: int) -> float | None:
        """What a deployment predicts, before a round of ``participants`` starts, that the round will cost
        (GDP mu), from ``runs`` simulated executions (no value): the round session's admission
        (:meth:`~flwr_inca.privacy.session.RoundSession.admit`, as ``IncaStrategy`` asks it). None
        (default): the round's own cost is known before it starts (a mechanism whose noise is fixed)."""
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
    """IncA among the round's participants: a fresh execution per round, certified before anything of it
    is released, through the same :class:`~flwr_inca.rounds.IncaRounds` as ``IncaStrategy``: the same
    calibration rule, predictions, ceilings and adversaries (for the same seed and settings).

    Noise: ``mixing.sigma_star``/``sigma_delta`` given (value units), or calibrated for the round target
    (less ``privacy.calibration_margin``) at the expected participants, then reused for nearby counts
    (:class:`~flwr_inca.privacy.calibration.NoiseCalibrator`; ``calibrators``: the calibrator of each T, to
    share calibrations between runs, e.g. a study's). ``mixing.iterations="auto"`` chooses T once, before
    round 1 (:func:`~flwr_inca.rounds.choose_iterations`), and notes the choice.

    Cost: the sampled trace is certified exactly against the threat (worst of ``threat_draws``
    adversaries) every ``certify_every``-th round; other rounds are charged the largest certified mu so
    far (a prediction, marked ``certified=False``). ``certification="local-bound"`` certifies nothing and
    charges every round ``S / sigma_star``, sound for any execution, at the local-DP level.

    :meth:`charge` runs the round as a deployment does (:class:`~flwr_inca.rounds.IncaRound`): reserved
    before its first message, each iteration guarded when the no-finals ceiling does not fit, the
    finals collected only if the certificate with all of them fits; a refused round is charged what its
    delivered iterations revealed. The whole trace is known, so one factorization serves every step.
    """

    name = "inca"

    def __init__(self, *, privacy: PrivacyTarget | None = None, mixing: MixingConfig | None = None,
                 calibrators: Calibrators | None = None, noise_ahead_bytes: int = 512 * 2**20) -> None:
        super().__init__()
        self.privacy = privacy if privacy is not None else PrivacyTarget()
        self.mixing = mixing if mixing is not None else MixingConfig()
        if calibrators is not None and not callable(calibrators):
            raise ValueError(f"calibrators must map iterations to a NoiseCalibrator, got {type(calibrators).__name__}")
        self.calibrators = calibrators  # T -> calibrator, shared between runs (e.g. a study's); None: the run's own
        self.noise_ahead_bytes = check_int("noise_ahead_bytes", noise_ahead_bytes, 0)
        self.rounds: IncaRounds | None = None
        self.notes: list[str] = []  # what the mixer chose before round 1 (the history keeps them)
        self._worst_certified = 0.0

    @classmethod
    def from_config(cls, config: SimulationConfig) -> Mixer:
        return cls(privacy=config.privacy, mixing=config.mixing, **dict(config.mixer_options))

    @property
    def threat(self) -> str:
        return self.privacy.describe_threat()

    def describe(self) -> str:
        mix = self.mixing
        cert = ("exact certificate every round" if mix.certify_every == 1
                else f"exact certificate every {mix.certify_every} rounds, a prediction in between")
        if mix.certification == "local-bound":
            cert = "no certificate: every round charged the local bound S / sigma_star"
        return (f"inca (T = {mix.iterations}, k = {mix.neighbors}, {mix.schedule}, {mix.topology}, "
                f"dropout {mix.dropout!r}; threat: {self.threat}; {cert})")

    # ------------------------------------------------------------------------ noise
    @staticmethod
    def threat_seed(seed: int) -> int:
        """The root of the certification adversaries and predictions of a simulation with ``seed`` (an
        ``IncaStrategy(seed=threat_seed(seed))`` with the same settings draws the same)."""
        return seeding.seed_of(seed, seeding.THREAT)

    def prepare(self, context: MixContext) -> None:
        super().prepare(context)
        if self.mixing.calibrated and context.mu_round is None:
            raise ValueError("inca needs sigma_star and sigma_delta, or a budget (max_epsilon) to calibrate them")
        n = max(2, int(context.participants))
        calibration_seed = seeding.seed_of(context.seed, seeding.CALIBRATION)
        calibrator = None
        if self.mixing.automatic:  # T for the expected participants and dropouts, chosen once
            choice = choose_iterations(self.privacy, self.mixing, n, mu_target=context.mu_round,
                                       value_sensitivity=context.value_sensitivity,
                                       seed=self.threat_seed(context.seed), calibration_seed=calibration_seed,
                                       calibrators=self.calibrators)
            self.mixing = replace(self.mixing, iterations=choice.iterations)
            self.notes.append(choice.describe(self.mixing.neighbors))
            calibrator = choice.calibrator
        if calibrator is None and self.calibrators is not None and self.mixing.calibrated:
            calibrator = self.calibrators(int(self.mixing.iterations))
        self.rounds = IncaRounds(self.privacy, self.mixing, seed=self.threat_seed(context.seed),
                                 value_sensitivity=context.value_sensitivity, mu_target=context.mu_round,
                                 calibration_seed=calibration_seed, calibrator=calibrator)
        self.rounds.sigmas(n)  # calibrated once, before round 1

    @property
    def calibration(self) -> Calibration | None:
        """The calibration of the expected participants' noise (None: sigmas given)."""
        if self.rounds is None or self.rounds.calibrator is None:
            return None
        ctx = self.context
        target = ctx.mu_round * (1.0 - self.privacy.calibration_margin)
        return self.rounds.calibrator.calibration(max(2, int(ctx.participants)), target, ctx.delta,
                                                  ctx.value_sensitivity)

    def sigmas(self, participants: int) -> tuple[float, float]:
        """(sigma_star, sigma_delta) in value units for a round of ``participants`` parties."""
        return self.rounds.sigmas(participants)

    def inca_config(self, participants: int) -> IncaConfig:
        return self.rounds.config(participants)

    def spend_what_is_left(self, ledger, rounds_left: int, sample_rate: float, participants: int) -> None:
        """IncA's rounds calibrated for what is left of the budget (:meth:`IncaRounds.spend_what_is_left`)."""
        self.rounds.spend_what_is_left(ledger, rounds_left, sample_rate, n=participants)

    # ------------------------------------------------------------------------ round
    def certificate(self, trace: ExecutionTrace, round: int, finals: list[int] | None = None) -> RoundCertificate:
        """The round's worst certified mu over its adversaries (as ``IncaStrategy`` certifies it), with
        the finals of ``finals`` observed (None: every party online at T; ``[]``: none)."""
        return self.rounds.prefix(trace, round).with_finals(finals)

    def predicted_cost(self, participants: int, runs: int) -> float:
        """``IncaStrategy``'s prediction (:meth:`IncaRounds.predicted_mu`), cached."""
        return self.rounds.predicted_mu(participants, runs)

    def plan(self, round: int, participants: int) -> RoundPlan:
        config = self.rounds.config(participants)
        start = time.perf_counter()
        trace = sample_trace(participants, config, seeding.seed_of(self.context.seed, seeding.TRACE, round))
        info: dict[str, Any] = {"sigma_star": config.sigma_star, "sigma_delta": config.sigma_delta,
                                "finalists": int(trace.steps[-1].online.size)}
        if self.noise_ahead_bytes > 0 and not self._aggregate:  # drawn while the round is certified and trained
            info["noise_ahead"] = NoiseAhead(self._noise_seed(round), trace, self.context.dimension,
                                             np.dtype(self.context.precision), self.noise_ahead_bytes)
        sampled = time.perf_counter()
        mix = self.mixing
        if mix.certification == "local-bound":
            mu, certified = self.rounds.local_bound(participants), False
            info["cost"] = "local bound S / sigma_star (valid for any execution; not a certificate)"
            info["method"] = "local-bound"
        elif (round - 1) % mix.certify_every == 0 or self._worst_certified == 0.0:
            info["prefix"] = prefix = self.rounds.prefix(trace, round)
            cert = prefix.with_finals()
            mu, certified = cert.mu, True
            self._worst_certified = max(self._worst_certified, mu)
            info["cost"], info["method"] = "certified", cert.method
        else:
            mu, certified = self._worst_certified, False
            info["cost"] = "predicted: largest certified mu so far (not certified)"
            info["method"] = "predicted"
        info["seconds_trace"] = sampled - start
        info["seconds_certify"] = time.perf_counter() - sampled
        sent = sum(int(step.messages.senders.size) for step in trace.steps) + info["finalists"]
        return RoundPlan(round, participants, mu, certified, trace, info, messages=sent / participants)

    def charge(self, session: RoundSession, plan: RoundPlan) -> RoundCharge:
        """The round through the session as a deployment runs it (see the class doc). A round charged a
        prediction or the local bound (not certified) is charged that, as one release."""
        prefix = plan.info.get("prefix")
        if prefix is None:
            return super().charge(session, plan)
        rnd = self.rounds.start(session, plan.round, plan.participants, prefix=prefix)
        for t in range(1, plan.trace.iterations + 1):
            if not rnd.may_deliver(t):
                plan.info["delivered_iterations"] = t - 1
                return rnd.refuse()
        plan.info["delivered_iterations"] = plan.trace.iterations
        if not rnd.may_collect_finals():
            return rnd.refuse()
        return rnd.settle()

    def _noise_seed(self, round: int) -> int:
        return seeding.seed_of(self.context.seed, seeding.NOISE, round)

    @property
    def _aggregate(self) -> bool:
        return self.mixing.simulated_noise == "aggregate" and self.mixing.dissemination == "exact"

    def mix(self, updates: np.ndarray, plan: RoundPlan, noise: NoiseSource | None = None) -> np.ndarray:
        """IncA on the updates: with ``simulated_noise="aggregate"``, the round's update drawn from its exact
        distribution (:meth:`aggregate`); otherwise (or with explicit ``noise``, e.g.
        ``PartyNoise.explicit(...)`` to reproduce a Flower round) every message of the planned execution."""
        if noise is None and self._aggregate:
            return self.aggregate(updates, plan)
        ahead = plan.info.pop("noise_ahead", None)
        try:
            result = replay(plan.trace, updates, self._noise_seed(plan.round), dissemination=self.mixing.dissemination,
                            noise=noise if noise is not None else ahead)
        finally:
            if ahead is not None:
                ahead.close()
        return result.estimate

    def aggregate(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        """The round's update drawn from its exact distribution: with exact dissemination the estimate is
        ``(b . (x + eta*) + a . eta) / sum(b)`` for the execution's coefficients ``(b, a)``
        (:func:`~flwr_inca.protocol.utility.output_coefficients`), i.e. the b-weighted mean of the updates plus
        Gaussian noise of std ``sqrt(s*^2 |b|^2 + sD^2 |a|^2) / sum(b)`` per coordinate, independent across
        coordinates: d random numbers instead of every message's (tests/test_simulation.py checks both paths
        give the same distribution). NaN when no finalist carries a value."""
        trace = plan.trace
        b, a = output_coefficients(trace)
        total = b.sum()
        if not total > 0:
            return np.full(updates.shape[1], np.nan, dtype=updates.dtype)
        mean = (b / total) @ updates.astype(np.float64, copy=False)
        std = math.sqrt(trace.sigma_star**2 * float(b @ b) + trace.sigma_delta**2 * float(np.sum(a * a))) / total
        rng = seeding.stream(self.context.seed, seeding.NOISE, plan.round)
        return (mean + std * rng.standard_normal(updates.shape[1])).astype(updates.dtype)

    def abandon(self, plan: RoundPlan) -> None:
        ahead = plan.info.pop("noise_ahead", None)
        if ahead is not None:
            ahead.close()


# the baselines' modes (local-dp, dp-gossip, muffliato, gopa) register when the registry is imported; their
# module imports this one's names, so it comes last
from . import baseline_mixers  # noqa: E402, F401
