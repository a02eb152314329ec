"""IncA's training rounds, for any driver: the noise for n parties, what a round may cost before it
starts, and the certificates its :class:`~flwr_inca.privacy.session.RoundSession` needs as it runs.

``IncaStrategy`` (Flower) and the simulator both hold one :class:`IncaRounds` and run every IncA round
through :meth:`IncaRounds.start`, which opens the round in the session and returns an :class:`IncaRound`:

* :meth:`IncaRound.may_deliver` (t): before the messages of iteration t are delivered (the guard: the
  prefix ceilings over every execution, else the exact certificate of iterations 1..t);
* :meth:`IncaRound.may_collect_finals`: the *pre-final rule*: iterations 1..T are certified as if every
  final message were revealed (an upper bound whatever then arrives) and reserved before any is asked for;
* :meth:`IncaRound.settle` (the finals that arrived), :meth:`IncaRound.refuse` (stopped before the
  finals or by the guard: charged what was delivered) or :meth:`IncaRound.fail` (an error).

A deployment learns its round's trace as the round runs (``trace_through(t)``: iterations 1..t as
committed); a simulator samples it first and passes the whole trace: the prefix certificates are the
same (a message of iteration t depends only on what happened up to t), from one factorization.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ._checks import check_int, check_real
from ._search import last_fitting
from .privacy.budget_check import Predictions, predicted_round_mu, prediction_seeds
from .privacy.calibration import NoiseCalibrator
from .privacy.conversions import mu_for_epsilon
from .privacy.ledger import PrivacyLedger
from .privacy.plan import round_mu
from .privacy.prefix import RoundPrefix, prefix_ceilings
from .privacy.rounds import RoundCertificate, certification_seeds
from .privacy.session import RoundCharge, RoundSession
from .protocol.config import IncaConfig
from .protocol.dropout import NoDropout
from .protocol.engine import sample_trace
from .protocol.schedules import InjectionSchedule
from .protocol.trace import ExecutionTrace
from .protocol.utility import noise_std, output_coefficients
from .settings import MixingConfig, PrivacyTarget

__all__ = ["Calibrators", "IncaRound", "IncaRounds", "IterationChoice", "ReproducedCharge", "budget_share",
           "choose_iterations", "dropout_noise_share", "noise_calibrator", "reproduce_charge", "round_target",
           "sampled_executions", "trace_privacy"]


def round_target(privacy: PrivacyTarget, rounds: int, sample_rate: float | None = None,
                 accountant: str | None = None) -> float | None:
    """The per-round GDP target (per unit of value sensitivity) the noise is calibrated for:
    ``round_epsilon`` at ``delta``, or the budget ``max_epsilon``'s share of ``budget_rounds`` (default
    ``rounds``) rounds under the accountant; None without either."""
    if privacy.round_epsilon is not None:
        return mu_for_epsilon(privacy.round_epsilon, privacy.delta)
    if privacy.max_epsilon is None:
        return None
    q = privacy.sample_rate if sample_rate is None else sample_rate
    return round_mu(privacy.max_epsilon, privacy.delta, privacy.budget_rounds or rounds, q,
                    accountant or privacy.accountant_name)


def trace_privacy(privacy: PrivacyTarget, round: int, *, certification_seed: int | None, value_sensitivity: float,
                  sample_rate: float, accountant: str, charge: RoundCharge | None) -> dict:
    """What a saved trace carries so that ``flwr-inca audit TRACE`` (and ``attack``) reproduce its round's
    certificate and charge without flags (``trace.meta["privacy"]``): the sensitivity, the sampling rate, the
    delta, the accountant, the threat and the seed of its adversaries, and what the round was charged."""
    return {"round": int(round), "value_sensitivity": float(value_sensitivity), "sample_rate": float(sample_rate),
            "delta": privacy.delta, "accountant": accountant, "collusion": privacy.collusion,
            "observed_fraction": privacy.observed_fraction, "threat_draws": privacy.threat_draws,
            "certification_seed": certification_seed, "mu_resolution": privacy.mu_resolution,
            "charged_mu": None if charge is None else charge.mu,
            "certified_mu": None if charge is None else charge.certified_mu,
            "charge_method": None if charge is None else charge.method,
            "ledger_epsilon": None if charge is None else charge.epsilon}


def budget_share(ledger: PrivacyLedger, rounds_left: int, sample_rate: float = 1.0, *,
                 guess: float | None = None, resolution: float = 1e-3) -> float | None:
    """The per-round mu (charged) that spends what ``ledger`` has left of its ``max_epsilon`` over
    ``rounds_left`` more rounds at ``sample_rate`` (None: no budget, or nothing left); never more than is
    left. The exact accountant composes Gaussian rounds in closed form (mu_total^2 = sum mu_r^2). The
    others are searched on the accountant's own composition, over the grid ``(1 + resolution)^k`` (pass
    the charges' ``mu_resolution``: the points then recur from round to round, and the accountant's memo
    of each round's curve is reused; a new point costs about 0.3 s with Opacus's PRV): a bracket grown
    from ``guess`` (e.g. the last round's share), then regula falsi (Illinois) on log epsilon; the largest
    grid point that fits is returned, at most ``resolution`` below the exact share."""
    budget = ledger.max_epsilon
    rounds_left = check_int("rounds_left", rounds_left)
    if budget is None or ledger.epsilon() >= budget:
        return None
    if ledger.accountant.name == "exact" and sample_rate == 1.0:
        total = mu_for_epsilon(budget, ledger.delta)
        spent = sum(c.mu**2 for c in ledger.costs())
        return math.sqrt(max(total**2 - spent, 0.0) / rounds_left) or None
    step = math.log1p(check_real("resolution", resolution, 0.0, low_open=True))
    limit = math.ceil(math.log(1e6) / step)  # shares outside [1e-6, 1e6] are of no use

    def excess(k: int) -> float:  # increasing in k; <= 0 where the share fits
        eps = ledger.epsilon_after(math.exp(k * step), sample_rate, rounds=rounds_left)
        return math.log(max(eps, 1e-300)) - math.log(budget)

    # from a guess (the last round's share: the next one is usually within a grid step or two of it)
    near = guess is not None and guess > 0
    start = round(math.log(guess) / step) if near else 0
    k = last_fitting(excess, start, -limit, limit, stride=1 if near else 8)
    return None if k is None else math.exp(k * step)


# a prediction made at sigmas whose ratio is within this (relative) of the ratio now is scaled, not redone
PROPORTIONAL = 1e-5

# spend_budget never lowers a round's target below this share of the planned one: rounds noisier than that
# would train little, and what is left is better reported as spent
SPEND_FLOOR = 0.5

ITERATION_CANDIDATES = (10, 20, 40, 80)  # what iterations="auto" chooses from

Calibrators = Callable[[int], NoiseCalibrator]  # the calibrator of a training's noise at T iterations


def noise_calibrator(privacy: PrivacyTarget, mixing: MixingConfig, iterations: int, seed: int,
                     log: Callable[[str], None] | None = None) -> NoiseCalibrator:
    """The calibrator of a training's noise at ``iterations`` T (the protocol and threat of the settings)."""
    return NoiseCalibrator(
        iterations=iterations, neighbors=mixing.neighbors, collusion=privacy.collusion,
        observed_fraction=privacy.observed_fraction, dropout=mixing.dropout, topology=mixing.topology,
        schedule=mixing.schedule, runs=privacy.calibration_runs, target_success=privacy.calibration_success,
        seed=seed, progress=log)


@dataclass(frozen=True)
class IterationChoice:
    """What ``iterations="auto"`` chose: ``iterations``, and for each candidate T tried, the share of the
    update's noise variance that dropouts leave uncancelled, relative to the central noise; ``screened``:
    the candidates passed over on a screening calibration (their share is the screen's, over
    ``screen_runs`` runs); ``reason`` when no candidate was calibrated (fixed noise, no dropouts expected);
    ``calibrator``: the chosen T's (reuse it: it holds the calibration made for the choice)."""

    iterations: int
    shares: dict[int, float]
    aim: float
    reason: str = ""
    calibrator: NoiseCalibrator | None = field(default=None, compare=False, repr=False)
    screened: tuple[int, ...] = ()
    screen_runs: int = 0

    def describe(self, neighbors: int) -> str:
        messages = f"{self.iterations * neighbors + 1} messages per party per round"
        if self.reason:
            return f"iterations='auto' chose T = {self.iterations} ({messages}): {self.reason}"
        tried = ", ".join(f"T = {t}: {share:.3g}" + ("*" if t in self.screened else "")
                          for t, share in self.shares.items())
        screen = (f"; * screened over {self.screen_runs} of the calibration runs: over {SCREEN_MARGIN:g} times "
                  "the aim, passed over" if self.screened else "")
        missed = "" if self.shares[self.iterations] <= self.aim else (
            f"; the aim is not reached within max_iterations = {max(self.shares)}: more iterations leave less "
            "noise at more messages")
        return (f"iterations='auto' chose T = {self.iterations} ({messages}): uncancelled-dropout noise over "
                f"central noise {tried} (aim: at most {self.aim:g}){screen}{missed}")


def dropout_noise_share(traces: Sequence[ExecutionTrace]) -> float:
    """The noise variance that dropouts leave uncancelled in a round's update, over its central noise
    variance, for executions ``traces`` (with their sigmas): ``sum sigma_delta^2 |a|^2 / sum sigma_star^2 |b|^2``
    over the traces' output coefficients (``b``: of the parties' sigma_star terms, ``a``: of the cancelling
    terms left uncancelled); 0 without dropouts."""
    central = uncancelled = 0.0
    for trace in traces:
        b, a = output_coefficients(trace)
        central += trace.sigma_star**2 * float(b @ b)
        uncancelled += trace.sigma_delta**2 * float(np.sum(a * a))
    return uncancelled / central if central > 0 else math.inf


def sampled_executions(config: IncaConfig, n: int, seed: int, runs: int = 4) -> list[ExecutionTrace]:
    """``runs`` executions of ``config`` among ``n`` parties, drawn from ``seed`` (what ``"auto"`` compares)."""
    seeds = np.random.SeedSequence(seed, spawn_key=(3, n)).generate_state(runs, dtype=np.uint64)
    return [sample_trace(n, config, seed=int(s)) for s in seeds]


# "auto" screens a candidate T over this share of its calibration runs first, and passes it over when the
# screen's share exceeds the aim by this factor (the screen's alpha may differ from the full calibration's,
# so its share is only near the full one's: 0.6x to 1.3x of it at n = 30 and 100, gamma 0.05 to 0.3)
SCREEN_FRACTION = 0.2
SCREEN_MARGIN = 2.0


def choose_iterations(privacy: PrivacyTarget, mixing: MixingConfig, n: int, *, mu_target: float | None,
                      value_sensitivity: float, seed: int, calibration_seed: int | None = None,
                      calibrators: Calibrators | None = None, screen: bool = True,
                      log: Callable[[str], None] | None = None) -> IterationChoice:
    """``iterations="auto"``: the fewest candidate T (10, 20, 40, 80, at most ``max_iterations``) whose
    calibrated noise leaves at most ``dropout_noise_share`` of the central noise uncancelled under the
    expected dropouts (:func:`dropout_noise_share`); the largest allowed when none does. Each candidate is
    calibrated for ``n`` parties at the round target, as the rounds will be (``calibrators``: the calibrator
    of each T, e.g. shared between a study's runs; None: new ones, seeded by ``calibration_seed``).

    ``screen``: a candidate below the largest, not yet calibrated for ``n``, is first calibrated over the
    first :data:`SCREEN_FRACTION` of its runs (:meth:`NoiseCalibrator.screening`, a fifth of the cost);
    if that share exceeds the aim :data:`SCREEN_MARGIN` times over, the candidate is passed over without its
    full calibration (it would miss the aim too). The candidate chosen is always calibrated in full and
    judged on that.

    Without expected dropouts (``mixing.dropout`` None or :class:`NoDropout`), or with fixed noise (the
    sigmas given: the noise a dropout leaves is then a fixed multiple of sigma_delta^2, whatever T), the
    fewest candidate is chosen without calibrating anything."""
    candidates = [t for t in ITERATION_CANDIDATES if t <= mixing.max_iterations] or [mixing.max_iterations]
    if not mixing.calibrated or mixing.dropout is None or isinstance(mixing.dropout, NoDropout):
        reason = ("the noise is given (sigma_star, sigma_delta): more iterations would not lower it" if
                  not mixing.calibrated else "no dropouts expected, so no noise is left uncancelled")
        return IterationChoice(candidates[0], {}, mixing.dropout_noise_share, reason)
    cal_seed = seed if calibration_seed is None else int(calibration_seed)
    aim = mixing.dropout_noise_share
    screen_runs = 0

    def share(T: int, calibrator: NoiseCalibrator) -> float:
        rounds = IncaRounds(privacy, replace(mixing, iterations=T), seed=seed, value_sensitivity=value_sensitivity,
                            mu_target=mu_target, calibrator=calibrator)
        return dropout_noise_share(sampled_executions(rounds.config(n), n, seed))

    shares: dict[int, float] = {}
    screened: list[int] = []
    for T in candidates:
        calibrator = calibrators(T) if calibrators is not None else noise_calibrator(privacy, mixing, T, cal_seed, log)
        runs = math.ceil(SCREEN_FRACTION * calibrator.settings["runs"])
        if screen and T != candidates[-1] and runs < calibrator.settings["runs"] and not calibrator.has_calibration(
                n, mu_target * (1.0 - privacy.calibration_margin), privacy.delta):
            look = share(T, calibrator.screening(runs))
            if look > SCREEN_MARGIN * aim:
                shares[T], screen_runs = look, runs
                screened.append(T)
                continue
        shares[T] = share(T, calibrator)
        if shares[T] <= aim:
            break  # else the largest candidate allowed
    return IterationChoice(T, shares, aim, calibrator=calibrator, screened=tuple(screened), screen_runs=screen_runs)


class IncaRounds:
    """How a training's IncA rounds are calibrated, predicted and certified.

    Args:
        privacy, mixing: the settings (:mod:`flwr_inca.settings`).
        seed: the root of the certification adversaries and the budget predictions (an ``IncaStrategy``
            and a simulation with the same seed and settings certify and predict alike).
        value_sensitivity: what one protected unit changes in a party's value (value units).
        mu_target: the per-round GDP target (per unit of sensitivity) to calibrate for (None: the
            sigmas must be given in ``mixing``).
        calibration_seed: the calibration's seed (default ``seed``).
        calibrator: share one :class:`~flwr_inca.privacy.calibration.NoiseCalibrator` between trainings
            (e.g. a study's runs); None: a new one.
        log: receives one line when the noise is calibrated.
    """

    def __init__(self, privacy: PrivacyTarget, mixing: MixingConfig, *, seed: int, value_sensitivity: float,
                 mu_target: float | None, calibration_seed: int | None = None,
                 calibrator: NoiseCalibrator | None = None, log: Callable[[str], None] | None = None) -> None:
        if mixing.calibrated and mu_target is None:
            raise ValueError("give sigma_star and sigma_delta, or a budget (max_epsilon or round_epsilon) to "
                             "calibrate them for")
        if mixing.automatic:
            raise ValueError("IncaRounds needs the iterations chosen: see choose_iterations (iterations='auto')")
        self.privacy, self.mixing, self.seed = privacy, mixing, int(seed)
        self.value_sensitivity, self.mu_target = float(value_sensitivity), mu_target
        self.log = log
        self.calibrator = calibrator
        if mixing.calibrated and calibrator is None:
            self.calibrator = noise_calibrator(privacy, mixing, int(mixing.iterations),
                                               self.seed if calibration_seed is None else int(calibration_seed), log)
        self.schedule = InjectionSchedule.resolve(mixing.schedule, mixing.iterations)
        self._share_guess: float | None = None  # the last budget share: where the next search starts
        self.planned_target = mu_target  # the target before any retargeting (the budget's share)
        self._ceilings: dict[tuple[int, float | None], np.ndarray] = {}
        self._predicted = Predictions()  # (mu, the target, party count and sigmas it was made at) by party count

    # ------------------------------------------------------------------------------ noise
    def sigmas(self, n: int) -> tuple[float, float]:
        """(sigma_star, sigma_delta) in value units for a round of ``n`` parties."""
        mix = self.mixing
        if not mix.calibrated:
            return float(mix.sigma_star), float(mix.sigma_delta)
        target = self.mu_target * (1.0 - self.privacy.calibration_margin)
        return self.calibrator.sigmas(n, target, self.privacy.delta, self.value_sensitivity)

    def config(self, n: int) -> IncaConfig:
        """The protocol a round of ``n`` parties runs (its sigmas, topology, dropout model)."""
        s_star, s_delta = self.sigmas(n)
        mix = self.mixing
        return IncaConfig(sigma_star=s_star, sigma_delta=s_delta, iterations=mix.iterations,
                          neighbors=min(mix.neighbors, n - 1), schedule=mix.schedule, topology=mix.topology,
                          dropout=mix.dropout, dissemination=mix.dissemination)

    def update_noise(self, n: int, runs: int = 5) -> float:
        """The std per coordinate of the noise in a round's averaged update among ``n`` parties (the mean
        over ``runs`` sampled executions: the central noise and what dropouts leave uncancelled)."""
        seeds = np.random.SeedSequence(self.seed, spawn_key=(2, int(n))).generate_state(runs, dtype=np.uint64)
        config = self.config(n)
        return float(np.mean([noise_std(sample_trace(n, config, seed=int(s))) for s in seeds]))

    def usefulness_warning(self, n: int, dimension: int, update_norm: float, rounds: int) -> str:
        """A warning ("" if none) when the noise would drown the updates: the noise of a round's averaged update
        (norm ``sqrt(d)`` times its std) against the largest norm an averaged update can have
        (``update_norm``, e.g. ``clip_norm``), compared with the ``sqrt(rounds)`` by which ``rounds`` rounds
        average noise away. Says how many parties (the noise of the average falls as 1/n at a fixed
        per-round target) or how much more budget would bring it within reach."""
        noise = self.update_noise(n)
        ratio = math.sqrt(dimension) * noise / update_norm
        reach = math.sqrt(max(rounds, 1))
        if not ratio > reach:
            return ""
        factor = ratio / reach
        return (f"with {n} parties, the noise of each round's averaged update (std {noise:.3g} per coordinate over "
                f"d = {dimension}, norm about {math.sqrt(dimension) * noise:.3g}) is {ratio:.3g} times the largest "
                f"averaged update (norm {update_norm:g}), more than the {reach:.3g} that {rounds} round(s) can "
                f"average away: the model will learn little. About {math.ceil(n * factor)} parties, or a budget "
                f"about {factor:.3g} times larger, would bring it within reach (docs/results.md, \"Where IncA "
                "pays off\")")

    def local_bound(self, n: int) -> float:
        """``S / sigma_star``: what any round of ``n`` parties can cost, whatever its execution (everything
        an adversary learns about x_i passes through x_i + eta*_i)."""
        s_star = self.sigmas(n)[0]
        return self.value_sensitivity / s_star if s_star > 0 else math.inf

    # ------------------------------------------------------------------------------ before a round
    def ceilings(self, n: int) -> np.ndarray:
        """(T+1,) the most the messages of iterations 1..t can reveal on any execution of ``n`` parties,
        t = 0..T (:func:`~flwr_inca.privacy.prefix.prefix_ceilings`; cached per n and target)."""
        key = (int(n), self.mu_target)
        if key not in self._ceilings:
            s_star, s_delta = self.sigmas(n)
            ceilings = prefix_ceilings(self.schedule, s_star, s_delta, self.value_sensitivity)
            if self.mixing.certification == "local-bound":
                ceilings = np.minimum(ceilings, self.local_bound(n))
            self._ceilings[key] = ceilings
        return self._ceilings[key]

    # ------------------------------------------------------------------------------ spending the budget
    def retarget(self, mu_target: float) -> None:
        """Calibrate the next rounds for the per-round target ``mu_target`` (per unit of sensitivity). The
        calibration is scale-free (both sigmas scale by the same factor), so this costs no new calibration,
        and a prediction made at another target scales with it exactly."""
        if not self.mixing.calibrated:
            raise ValueError("retarget: the sigmas are given, not calibrated for a target")
        self.mu_target = check_real("mu_target", mu_target, 0.0, low_open=True)

    def spend_what_is_left(self, ledger: PrivacyLedger, rounds_left: int, sample_rate: float = 1.0,
                           n: int | None = None) -> float | None:
        """Retarget for the share of what ``ledger`` has left over ``rounds_left`` rounds, when the noise is
        calibrated for the budget's share and ``spend_budget`` is on (:func:`budget_share`; the share is
        charged rounded up, so the target is it less the resolution); returns the new target, or None when
        nothing changed.

        ``n``: the round's parties. The round is admitted on its predicted (worst sampled) cost, which lies
        above the calibration target; the target is then also capped so that this prediction fits all that
        is left, else the last rounds, whose share is nearly all that is left, would be refused and
        training would stop early with budget unspent. A target below ``SPEND_FLOOR`` times the planned one
        (a budget nearly spent, e.g. by an earlier training on the same ledger) is not taken."""
        priv = self.privacy
        if not (self.mixing.calibrated and priv.round_epsilon is None and priv.spend_budget):
            return None
        grid = priv.mu_resolution or 1e-3  # the charges' grid: search points that recur between rounds
        share = budget_share(ledger, max(int(rounds_left), 1), sample_rate, guess=self._share_guess,
                             resolution=grid)
        if share is None:
            return None
        self._share_guess = share
        target = share / (1.0 + priv.mu_resolution)
        if n is not None:
            predicted = self.predicted_mu(n) * target / self.mu_target  # scales with the target
            if not ledger.can_afford(predicted * (1.0 + priv.mu_resolution), sample_rate):
                whole = budget_share(ledger, 1, sample_rate, guess=predicted, resolution=grid)
                if whole is not None:
                    target = min(target, target * whole / predicted / (1.0 + priv.mu_resolution))
        target = min(target, self.largest_target())
        if target < SPEND_FLOOR * self.planned_target:
            # what is left is too little for a useful round: not spread thin over noise-drowned rounds; the
            # planned target stays, and the budget's admission refuses the round if it does not fit
            target = self.planned_target
        self.retarget(target)
        return self.mu_target

    def largest_target(self) -> float:
        """The largest per-round target the calibration can serve: the paper's procedure bounds a round's
        epsilon with the classic Gaussian bound, valid only below 1 (a larger share of what is left is not
        taken: that budget stays unspent); inf for the exact procedure."""
        if not (self.mixing.calibrated and self.calibrator.settings["procedure"] == "paper"):
            return math.inf
        # sigmas() calibrates for the target lowered by calibration_margin, at an epsilon below 1
        return mu_for_epsilon(1.0, self.privacy.delta) * (1.0 - 1e-6) / (1.0 - self.privacy.calibration_margin)

    def _scale_free(self) -> bool:
        return (self.mixing.calibrated and self.calibrator.settings["procedure"] == "exact"
                and self.mixing.certification == "exact")

    def predicted_mu(self, n: int, runs: int | None = None) -> float:
        """A round of ``n`` parties' predicted cost: the worst certified mu over ``runs`` (default
        ``budget_check_runs``) simulated executions at its sigmas and dropout model, against the threat
        (:func:`~flwr_inca.privacy.budget_check.predicted_round_mu`); the local bound with
        ``certification="local-bound"``. Cached per (n, runs); a prediction serves party counts near its
        own (:class:`~flwr_inca.privacy.budget_check.Predictions`)."""
        runs = self.privacy.budget_check_runs if runs is None else int(runs)
        cached = self._predicted.get(int(n), runs)
        if cached is not None:
            mu, made_at, made_for, (star, delta) = cached
            if made_at == self.mu_target:
                return mu
            # the certificate of a view scales as S / sigma when both sigmas scale together: exactly with
            # the target for the exact (scale-free) calibration; for another (the paper's procedure, which
            # keeps sigma_star / sigma_delta fixed to about 1e-6 as its target moves) when the sigmas now
            # are proportional to those the prediction was made at, within PROPORTIONAL
            if self._scale_free():
                return mu * self.mu_target / made_at
            now_star, now_delta = self.sigmas(made_for)  # at the party count it was made for, which it serves
            if abs(now_star * delta / (now_delta * star) - 1.0) <= PROPORTIONAL:
                return mu * star / now_star
        if self.mixing.certification == "local-bound":
            mu = self.local_bound(n)
        else:
            priv = self.privacy
            mu = predicted_round_mu(
                n, self.config(n), prediction_seeds(self.seed, n), runs, threat_draws=priv.threat_draws,
                collusion=priv.collusion, observed_fraction=priv.observed_fraction,
                value_sensitivity=self.value_sensitivity)
        self._predicted.put(n, runs, (mu, self.mu_target, int(n), self.sigmas(n)))
        return mu

    # ------------------------------------------------------------------------------ certificates
    def prefix(self, trace: ExecutionTrace, round: int) -> RoundPrefix:
        """Round ``round``'s adversaries on ``trace``, factorized once (:class:`RoundPrefix`): its cost with
        any finals and of any prefix. Drawn from ``certification_seeds(seed, round)``."""
        priv = self.privacy
        return RoundPrefix(trace, certification_seeds(self.seed, round), priv.threat_draws,
                           collusion=priv.collusion, observed_fraction=priv.observed_fraction,
                           value_sensitivity=self.value_sensitivity)

    def start(self, session: RoundSession, round: int, n: int, *,
              trace_through: Callable[[int], ExecutionTrace] | None = None,
              prefix: RoundPrefix | None = None) -> IncaRound:
        """Open round ``round`` of ``n`` parties in ``session`` (reserving before its first message, see
        :meth:`RoundSession.open`). ``trace_through(t)``: the trace of iterations 1..t as committed, the
        later ones exchanging nothing (a deployment); or ``prefix``: the whole round's, factorized (a
        simulator). Raises ``OSError`` when the ledger cannot be written (the round must not start)."""
        if (trace_through is None) == (prefix is None):
            raise ValueError("give trace_through (a deployment) or prefix (a sampled trace), not both")
        return IncaRound(self, session, int(round), int(n), trace_through, prefix)


class IncaRound:
    """One IncA round's privacy as it runs: see the module doc for the order of the calls."""

    def __init__(self, rounds: IncaRounds, session: RoundSession, round: int, n: int,
                 trace_through: Callable[[int], ExecutionTrace] | None, prefix: RoundPrefix | None) -> None:
        self.rounds, self.round, self.n = rounds, round, n
        self.iterations = rounds.mixing.iterations
        self._trace_through = trace_through
        self._prefix = prefix  # the factorization the latest certificates came from
        self._prefix_covers = self.iterations if prefix is not None else 0
        self.prefinal: RoundCertificate | None = None  # the certificate with every final revealed
        self.charge: RoundCharge | None = None
        self.open = session.open(round, ceilings=rounds.ceilings(n)[1:], certify_through=self._through,
                                 note=f"round {round}")

    @property
    def guarded(self) -> bool:
        """The no-finals ceiling did not fit the budget left: each iteration is reserved before delivery."""
        return self.open.guarded

    @property
    def delivered(self) -> int:
        return self.open.delivered

    def _through(self, t: int) -> RoundCertificate:
        if self._prefix is None or self._prefix_covers < t:
            self._prefix = self.rounds.prefix(self._trace_through(t), self.round)
            self._prefix_covers = t
        return self._prefix.through(t)

    def may_deliver(self, t: int) -> bool:
        """Whether the messages of iteration ``t`` may be delivered (reserved first when they may)."""
        return self.open.may_deliver(t)

    def may_collect_finals(self, trace: ExecutionTrace | None = None) -> bool:
        """The pre-final rule: certify iterations 1..T (``trace``, as committed; a simulator's is known) as
        if every final were revealed, and reserve that before any final is asked for. False: they must
        not be asked for (call :meth:`refuse`)."""
        if trace is not None:
            self._prefix, self._prefix_covers = self.rounds.prefix(trace, self.round), self.iterations
        cert = self.prefinal = self._prefix.with_finals()
        if self.rounds.mixing.certification == "local-bound":
            cert = self.prefinal = RoundCertificate(self.rounds.local_bound(self.n), ("local-bound",))
        return self.open.may_release(cert)

    def cost_with(self, finals: list[int] | None) -> RoundCertificate:
        """What the round revealed with the final messages of ``finals`` (None: every party online at T):
        never above the pre-final certificate, which bounds it too."""
        if self.rounds.mixing.certification == "local-bound":
            return self.prefinal
        cert = self._prefix.with_finals(finals)
        return cert if cert.mu <= self.prefinal.mu else self.prefinal

    def settle(self, finals: list[int] | None = None, cost: RoundCertificate | None = None) -> RoundCharge:
        """Charge the round the cost of the finals that arrived (or ``cost``, e.g. a prediction)."""
        self.charge = self.open.settle(cost if cost is not None else self.cost_with(finals))
        return self.charge

    def refuse(self) -> RoundCharge:
        """Charge a round stopped before its finals (or by the guard) what it delivered, and skip it."""
        revealed = None
        if self.open.delivered == self.iterations and self._prefix is not None and self._prefix_covers == self.iterations:
            revealed = self._prefix.through(self.iterations)
        self.charge = self.open.refuse(revealed)
        return self.charge

    def fail(self, why: str) -> RoundCharge:
        """Charge a round that ended in an error its reservation (a bound on what it revealed)."""
        self.charge = self.open.fail(why)
        return self.charge


@dataclass(frozen=True)
class ReproducedCharge:
    """A round's charge recomputed from its saved trace alone (:func:`reproduce_charge`).

    Attributes:
        round: the round.
        certified_mu: the round's certificate as training computed it (the worst of its adversaries, the
            finals that arrived, or what was delivered when it was refused).
        charged_mu: that, rounded up as training charged it; ``method``: the certificate's method.
        epsilon_round: the round alone at ``delta`` under the accountant (with its sampling rate).
        recorded_mu: what the trace says training charged (None: it does not say).
        refused: the round was stopped before its finals (``delivered`` iterations delivered).
    """

    round: int
    certified_mu: float
    charged_mu: float
    method: str
    epsilon_round: float
    delta: float
    accountant: str
    recorded_mu: float | None
    refused: bool
    delivered: int

    @property
    def agrees(self) -> bool:
        """Whether the recomputed charge is the one training recorded (None recorded: nothing to compare)."""
        return self.recorded_mu is None or self.charged_mu == self.recorded_mu


def reproduce_charge(trace: ExecutionTrace) -> ReproducedCharge:
    """Recompute a saved round's charge from its trace (``trace.meta["privacy"]``, written by ``IncaStrategy``
    and the simulator): the same adversaries (same seed and draws), the same finals, the same rounding.
    ``ValueError`` when the trace does not carry what is needed (a trace saved without a training)."""
    from .privacy.accountants import RoundCost, create_accountant
    from .privacy.session import charge_resolution
    from .privacy.views import recorded_finals

    meta = trace.meta.get("privacy")
    if not isinstance(meta, dict) or meta.get("certification_seed") is None:
        raise ValueError("the trace carries no training's privacy settings (meta 'privacy'): give the threat "
                         "and the sensitivity as options")
    rnd = int(meta["round"])
    prefix = RoundPrefix(trace, certification_seeds(int(meta["certification_seed"]), rnd), int(meta["threat_draws"]),
                         collusion=float(meta["collusion"]), observed_fraction=meta.get("observed_fraction"),
                         value_sensitivity=float(meta["value_sensitivity"]))
    refused = trace.meta.get("finals-collected") is False
    delivered = int(trace.meta.get("delivered-iterations", trace.iterations))
    if refused:
        cert = prefix.through(delivered) if delivered else RoundCertificate(0.0, ())
    else:
        full, arrived = prefix.with_finals(), prefix.with_finals(recorded_finals(trace))
        cert = arrived if arrived.mu <= full.mu else full
    charged = charge_resolution(cert.mu, float(meta.get("mu_resolution", 0.0)))
    accountant = str(meta["accountant"])
    epsilon = create_accountant(accountant).epsilon([RoundCost(charged, float(meta["sample_rate"]))],
                                                    float(meta["delta"])) if charged > 0 else 0.0
    recorded = meta.get("charged_mu")
    return ReproducedCharge(rnd, cert.mu, charged, cert.method, epsilon, float(meta["delta"]), accountant,
                            None if recorded is None else float(recorded), refused, delivered)
