"""The baselines as training mechanisms: local DP, DP gossip / D-SGD, Muffliato and GOPA as simulator
``Mixer`` s, plus within-round dropouts for any mixer.

Each mixer reuses the averaging core of :mod:`flwr_inca.baselines` (no second implementation):

* ``local-dp`` (:class:`LocalDPMixer`): every participant adds ``N(0, (z S)^2)`` to its update before
  sharing it, ``z = 1 / mu_round`` (:class:`flwr_inca.baselines.LocalDP`). Exactly ``1/z``-GDP per
  round for one protected unit against *any* coalition.
* ``dp-gossip`` (:class:`DPGossipMixer`): decentralized SGD with DP gossip averaging (Koskela &
  Kulkarni, App. F): every participant adds the local-DP noise to its update and averages with its
  neighbours on a sparse Erdos-Renyi graph, ``W = rownorm(A + I)``, one gossip step per round
  (:func:`flwr_inca.baselines.noisy_gossip_step`). A neighbour sees ``x_i + eta_i``, so against
  colluding neighbours its guarantee is local DP's (``mu = S / sigma``), which is what is charged.
* ``muffliato`` (:class:`MuffliatoMixer`): local noise once, then Chebyshev-accelerated gossip on a
  sparse Erdos-Renyi graph (:class:`flwr_inca.baselines.Muffliato`), with **its own, weaker, accounting**:
  Pairwise Network DP, a *mean* privacy loss over pairs of parties (Cyffers et al. 2022, Eq. (7);
  :func:`flwr_inca.baselines.pndp_mean_privacy_loss`). Its noise is set so that this mean loss meets the
  round target; the local-DP guarantee a colluding neighbour actually faces (``S / sigma``, weaker
  than the target when ``T d_max < n``: 1.55x the target at 900 participants) is in the plan's
  ``info["mu_collusion"]``.
* ``gopa`` (:class:`GOPAMixer`): GOPA (Sabater et al. 2022; paper App. D.3, Alg. 4) among the round's
  participants: each adds its own ``eta*_i ~ N(0, sigma_star^2)`` and pairwise terms with k_PR random
  neighbours, a share drops out before publishing and a share during the roll-back round
  (:class:`flwr_inca.baselines.GOPA`). Each round's execution is certified exactly against the
  colluders (the baselines' Collusion-DP view and certificate,
  :meth:`flwr_inca.baselines.GOPA.sensitivity_profile`), before any value exists, and that mu is charged:
  the same accounting as IncA's.

The gossip mixers release the *average* of the parties' estimates as the model update (the
simulator keeps one model) and put each party's own estimate in ``plan.info["node_updates"]`` (rows in
the order of the updates they got; ``plan.info["rows"]`` maps them to the round's participants), so
that a caller (``on_round``) can follow every party's model and report the worst one. The simulator
trains every participant from the current (average) model, so a party's gradient is taken there, not
at its own model: this favours the gossip methods (their gradients are taken at a less noisy point).

:class:`WithinRoundDropout` wraps any mixer: a ``gamma`` share of the round's participants
(``round(gamma n)``, uniformly) drops out after training, before mixing; the wrapped mixer mixes the
rest. (IncA has its own in-round dropout model, ``SimulationConfig.dropout``.)

What the mixers share with :mod:`flwr_inca.baselines`, and what stays their own: the mechanisms are the
baselines' (local noise, the noisy gossip step and its further steps, the graphs and gossip matrices,
Muffliato's accounting, GOPA's executions, Collusion-DP views, certificates, estimates and calibration).
Their own are what a training round needs and a one-shot baseline run does not: the noise comes from the
simulator's per-round streams (:mod:`flwr_inca.simulation.seeding`; GOPA's pairwise terms one stream per
term, so that only the uncancelled ones need drawing), Muffliato keeps the first round's number of steps
and Chebyshev parameter for the later rounds' graphs (its spectrum is an O(n^3) eigendecomposition), GOPA's
calibration is rescaled to each round's participants, and :class:`WithinRoundDropout` draws survivors
(``round half up``) for any mixer, where GOPA's own execution draws who drops out before publishing and
during the roll-back.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from .._checks import check_int, check_probability, check_real
from ..baselines import (
    GOPA,
    DPGossip,
    GossipExecution,
    LocalDP,
    Muffliato,
    PairwiseExecution,
    Threat,
    calibrate_baseline,
    gossip_matrix,
    graph_adjacency,
    max_degree,
    noisy_gossip_step,
    pndp_mean_privacy_loss,
)
from ..baselines.base import check_positive_int
from ..baselines.calibration import NoiseCalibration
from ..baselines.pairwise import pairwise_estimate, pairwise_masked_values, uncancelled_estimate
from ..privacy.budget_check import Predictions, prediction_seeds, worst_over_executions
from ..privacy.conversions import epsilon_for_delta
from ..privacy.rounds import RoundCertificate, certification_seeds, worst_mu
from ..privacy.session import RoundCharge, RoundSession
from ..protocol.dropout import PermanentDropout
from . import seeding
from .mixers import MixContext, Mixer, RoundPlan, calibration_point, register_mixer

__all__ = ["DPGossipMixer", "GOPAMixer", "LocalDPMixer", "MuffliatoMixer", "WithinRoundDropout"]

# purposes of this module's streams (beside seeding's; never reorder)
_GRAPH, _DROPOUT, _PAIR = 101, 102, 103


class _LocalNoiseMixer(Mixer):
    """Shared by the mixers whose parties noise their own update: ``z = 1 / mu_round`` unless given."""

    def __init__(self, noise_multiplier: float | None = None) -> None:
        super().__init__()
        if noise_multiplier is not None:  # the rule of CentralDPMixer's
            noise_multiplier = check_real("noise_multiplier", noise_multiplier, 0.0, low_open=True)
        self.noise_multiplier = noise_multiplier

    @classmethod
    def from_config(cls, config: Any) -> Mixer:
        return cls(noise_multiplier=config.noise_multiplier, **dict(config.mixer_options))

    def prepare(self, context: MixContext) -> None:
        super().prepare(context)
        if self.noise_multiplier is None:
            if context.mu_round is None:
                raise ValueError(f"{self.name} needs noise_multiplier, or a budget (epsilon) to derive it from")
            self.noise_multiplier = 1.0 / context.mu_round

    @property
    def sigma(self) -> float:
        """Std of each party's local noise, in update units."""
        return float(self.noise_multiplier) * self.context.value_sensitivity

    def _seed(self, round: int) -> int:
        return seeding.seed_of(self.context.seed, seeding.NOISE, round)


@register_mixer
class LocalDPMixer(_LocalNoiseMixer):
    """Local DP: each party publishes ``x_i + N(0, (z S)^2)``; the update is their mean."""

    name = "local-dp"

    def plan(self, round: int, participants: int) -> RoundPlan:
        z = float(self.noise_multiplier)
        return RoundPlan(round, participants, 1.0 / z, True,
                         info={"noise_multiplier": z, "noise_std": self.sigma / math.sqrt(participants)})

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        n = updates.shape[0]
        result = LocalDP(self.sigma).execute(updates, n, seed=self._seed(plan.round))
        return np.asarray(result.estimate, dtype=updates.dtype)


@register_mixer
class DPGossipMixer(_LocalNoiseMixer):
    """D-SGD with DP gossip averaging (Koskela & Kulkarni, App. F) on a sparse Erdos-Renyi graph among the round's participants (the same graph for the same count)
    per round (edge probability ``expected_degree / (n - 1)``); ``gossip_steps`` averaging steps per
    round (the first one noisy: ``W (x + eta)``, the others ``W y``)."""

    name = "dp-gossip"

    def __init__(self, noise_multiplier: float | None = None, expected_degree: int = 10,
                 gossip_steps: int = 1) -> None:
        super().__init__(noise_multiplier)
        self.expected_degree = check_positive_int("expected_degree", expected_degree)
        self.gossip_steps = check_positive_int("gossip_steps", gossip_steps)

    def plan(self, round: int, participants: int) -> RoundPlan:
        p = min(1.0, self.expected_degree / max(1, participants - 1))
        baseline = DPGossip(self.sigma, graph=f"erdos-renyi:{p:.12g}", iterations=self.gossip_steps)
        execution = baseline.sample_execution(participants, seed=seeding.seed_of(self.context.seed, _GRAPH, 0))
        z = float(self.noise_multiplier)
        return RoundPlan(round, participants, 1.0 / z, True, info={
            "noise_multiplier": z, "execution": execution, "edge_probability": p,
            "cost": "local DP (a neighbour sees x_i + eta_i)"},
            messages=self.gossip_steps * execution.adjacency.nnz / participants)

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        execution = plan.info.pop("execution")
        rng = seeding.stream(self.context.seed, seeding.NOISE, plan.round)
        nodes = noisy_gossip_step(updates.astype(np.float64), execution.W, self.sigma, rng, steps=self.gossip_steps)
        plan.info["node_updates"] = nodes.astype(updates.dtype)
        return nodes.mean(axis=0).astype(updates.dtype)


@register_mixer
class MuffliatoMixer(Mixer):
    """Muffliato (Cyffers et al. 2022): local noise once, then ``iterations`` Chebyshev-accelerated
    gossip steps (default ``ceil(ln n / sqrt(spectral gap))``, its Theorem 2) with max-degree weights on
    a sparse Erdos-Renyi graph among the round's participants (expected degree ``expected_degree``,
    default ``ceil(2 ln n)``, so that it is connected), with the noise of its own accounting, Pairwise
    Network DP for the party of largest degree (a mean over pairs; see module doc)."""

    name = "muffliato"

    def __init__(self, expected_degree: int | None = None, iterations: int | None = None,
                 node_estimates: bool = True) -> None:
        super().__init__()
        self.node_estimates = bool(node_estimates)
        self.expected_degree = None if expected_degree is None else check_positive_int("expected_degree", expected_degree)
        self.iterations = None if iterations is None else check_positive_int("iterations", iterations)
        self._spectrum: tuple[int, float | None] | None = None

    def prepare(self, context: MixContext) -> None:
        super().prepare(context)
        self._spectrum = None
        if context.mu_round is None:
            raise ValueError("muffliato needs a budget (epsilon): its noise comes from its own accounting")

    def plan(self, round: int, participants: int) -> RoundPlan:
        n = participants
        degree = self.expected_degree or math.ceil(2.0 * math.log(n))
        graph = f"erdos-renyi:{min(1.0, degree / max(1, n - 1)):.12g}"
        for attempt in range(20):  # a disconnected draw never averages: draw again
            graph_seed = seeding.seed_of(self.context.seed, _GRAPH, 0, attempt)
            if self._spectrum is None:  # T and the Chebyshev lam: from the first round's graph
                try:
                    first = Muffliato(1.0, graph, self.iterations).sample_execution(n, seed=graph_seed)
                except ValueError as exc:
                    if "disconnected" not in str(exc) or attempt == 19:
                        raise
                    continue
                self._spectrum = (first.iterations, first.chebyshev)
            # later rounds (other participants) keep T and lam: the recursion keeps the mean for any
            # lam, and Muffliato's accounting depends on T and the degrees only
            A = graph_adjacency(graph, n, graph_seed)
            if n < 3 or _connected(A):
                break
        execution = GossipExecution(A, gossip_matrix(A, Muffliato.weights), *self._spectrum)
        T, S = execution.iterations, self.context.value_sensitivity
        degree = max_degree(execution.adjacency)
        # the mean pairwise loss alpha T d S^2 / (2 n sigma^2) is that of a Gaussian of mu: alpha mu^2 / 2
        sigma = S * math.sqrt(T * degree / n) / self.context.mu_round
        mu = math.sqrt(2.0 * pndp_mean_privacy_loss(sigma, 1.0, T, degree, n, S))
        return RoundPlan(round, participants, mu, False, info={
            "noise_std": sigma, "graph": graph, "iterations": T, "execution": execution,
            "mu_collusion": S / sigma,
            "cost": f"Pairwise Network DP, mean over pairs (Muffliato's own, weaker accounting); against "
                    f"a colluding neighbour it is local DP with mu = {S / sigma:.4g}"},
            messages=T * execution.adjacency.nnz / n)

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        execution = plan.info.pop("execution")
        seed = seeding.seed_of(self.context.seed, seeding.NOISE, plan.round)
        if not self.node_estimates:
            # W is doubly stochastic and the Chebyshev recursion keeps the mean (a_t - b_t = 1): the
            # parties' average is the mean of the noised updates whatever the gossip (same distribution; the
            # noise stream differs): skip the gossip when only the average is needed
            return np.asarray(LocalDP(plan.info["noise_std"]).execute(updates, updates.shape[0], seed=seed).estimate,
                              dtype=updates.dtype)
        result = Muffliato(plan.info["noise_std"], plan.info["graph"], plan.info["iterations"]).execute(
            updates, execution, seed=seed)
        plan.info["node_updates"] = np.asarray(result.party_estimates, dtype=updates.dtype)
        return np.asarray(result.estimate, dtype=updates.dtype)

    def abandon(self, plan: RoundPlan) -> None:
        plan.info.pop("execution", None)


@register_mixer
class GOPAMixer(Mixer):
    """GOPA among the round's participants, certified exactly on each round's execution.

    Each round (paper App. D.3, Alg. 4, as :class:`flwr_inca.baselines.GOPA` runs it): every participant
    adds ``eta*_i ~ N(0, sigma_star^2)`` to its clipped update and, for every edge of a graph in which
    each party picks ``neighbors`` (k_PR) random others, one end adds and the other subtracts a term
    ``p_e ~ N(0, sigma_delta^2)``; ``round(gamma n)`` participants drop out, ``round(gamma_rollback n)``
    of them during the roll-back round (after publishing; their terms with the first-phase dropouts stay
    in the sum), the others before publishing (their updates are lost). The released update is GOPA's
    estimate: the mean of the published masked updates less the terms rolled back.

    Noise: ``sigma_star``/``sigma_delta`` given (value units), or calibrated once for the round target
    (less ``calibration_margin``) at the expected participants by the baselines' exact procedure
    (:func:`flwr_inca.baselines.calibrate_baseline` on ``calibration_runs`` simulated executions, each
    against random colluders); with ``n`` participants sigma_star is scaled by ``sqrt(n_cal / n)`` and
    sigma_delta kept, as :meth:`IncaMixer.sigmas` does.

    Cost: :meth:`plan` samples the round's execution (graph and dropouts: no value) and certifies it
    exactly against ``threat_draws`` random coalitions of a ``collusion`` share of the participants
    (drawn from the same seeds as IncA's, :func:`flwr_inca.privacy.rounds.certification_seeds`), by the
    baselines' certificate (:meth:`flwr_inca.baselines.GOPA.sensitivity_profile` of the view
    :func:`flwr_inca.baselines.pairwise_model`); the runner charges that mu before the
    round's update exists, through the round session (:meth:`charge`). A round whose whole cost does not
    fit once its masked updates are published is stopped before its roll-back: it is charged the exact
    certificate of what was published (which reveals no more than the whole round).

    ``draw``: ``"uncancelled"`` (default) draws every participant's ``eta*`` and only the pairwise
    terms that stay in the estimate, ``O((n + U) d)`` for U uncancelled terms: a term of two publishing
    ends, or one that was rolled back, leaves the estimate exactly, so its draw is skipped
    (:func:`~flwr_inca.baselines.pairwise.uncancelled_estimate`). ``"all"``
    draws every term of every edge (``O(E d)``, E about ``k_PR n``) and runs the protocol's own
    arithmetic (:func:`~flwr_inca.baselines.pairwise.pairwise_masked_values`, then
    :func:`~flwr_inca.baselines.pairwise.pairwise_estimate`); each term has its own stream, so both give
    the same estimate up to rounding (tested).
    """

    name = "gopa"

    def __init__(
        self,
        *,
        neighbors: int = 20,
        gamma: float = 0.0,
        gamma_rollback: float | None = None,
        collusion: float = 0.1,
        threat_draws: int = 1,
        sigma_star: float | None = None,
        sigma_delta: float | None = None,
        calibration_runs: int = 10,
        calibration_success: float = 1.0,
        calibration_margin: float = 0.01,
        draw: str = "uncancelled",
    ) -> None:
        super().__init__()
        if (sigma_star is None) != (sigma_delta is None):
            raise ValueError("give both sigma_star and sigma_delta, or neither (then they are calibrated)")
        gamma = check_probability("gamma (share of the participants that drop out in a round)", gamma, one=False)
        if gamma_rollback is None:
            gamma_rollback = gamma / 4.0  # the middle of the paper's cases (Fig. 3b: gamma/2, gamma/4, 1/n)
        # validates neighbors, gamma_rollback in [0, gamma] and the sigmas, naming them
        GOPA(sigma_star or 0.0, sigma_delta or 0.0, gamma, neighbors=neighbors, gamma_rollback=gamma_rollback)
        self.neighbors, self.gamma, self.gamma_rollback = int(neighbors), float(gamma), float(gamma_rollback)
        self.collusion = check_probability("collusion (a fraction of the participants)", collusion, one=False)
        self.threat_draws = check_int("threat_draws", threat_draws)
        self.calibration_runs = check_int("calibration_runs", calibration_runs)
        self.calibration_success = check_real("calibration_success (a share of the calibration runs)",
                                              calibration_success, 0.0, 1.0, low_open=True)
        self.calibration_margin = check_real("calibration_margin", calibration_margin, 0.0, 1.0, high_open=True)
        if draw not in ("uncancelled", "all"):
            raise ValueError(f"draw must be 'uncancelled' or 'all', got {draw!r}")
        self.draw = draw
        self.sigma_star = None if sigma_star is None else float(sigma_star)
        self.sigma_delta = None if sigma_delta is None else float(sigma_delta)
        self.calibration: NoiseCalibration | None = None
        self._calibrated_n = 0
        self._predicted = Predictions()  # predicted_cost by participants

    @classmethod
    def from_config(cls, config: Any) -> Mixer:
        """``collusion``, ``threat_draws``, the sigmas and ``calibration_runs`` from the config (unless
        ``mixer_options`` gives them); the
        dropouts from ``mixer_options`` (``gamma``, ``gamma_rollback``) or a ``PermanentDropout(gamma)``;
        k_PR from ``mixer_options["neighbors"]`` (default 20: ``mixing.neighbors`` is IncA's k)."""
        options = dict(config.mixer_options)
        dropout, priv, mix = config.mixing.dropout, config.privacy, config.mixing
        if dropout is not None:
            if not isinstance(dropout, PermanentDropout):
                raise ValueError(f"dropout: gopa takes PermanentDropout(gamma) or mixer_options['gamma'], got "
                                 f"{dropout!r}")
            if "gamma" in options and options["gamma"] != dropout.gamma:
                raise ValueError("dropout and mixer_options['gamma'] disagree: give one of them")
            options["gamma"] = dropout.gamma
        kwargs = {"collusion": priv.collusion, "threat_draws": priv.threat_draws, "sigma_star": mix.sigma_star,
                  "sigma_delta": mix.sigma_delta, "calibration_runs": priv.calibration_runs,
                  "calibration_margin": priv.calibration_margin}
        return cls(**{**kwargs, **options})  # mixer_options win

    def describe(self) -> str:
        return (f"gopa (k_PR = {self.neighbors}, gamma = {self.gamma:g} of which {self.gamma_rollback:g} during "
                f"the roll-back; threat: collusion of {self.collusion:.0%} of the participants; exact "
                "certificate every round)")

    # ------------------------------------------------------------------------ noise
    def _baseline(self, n: int, sigma_star: float, sigma_delta: float) -> GOPA:
        return GOPA(sigma_star, sigma_delta, self.gamma, neighbors=min(self.neighbors, n - 1),
                    gamma_rollback=self.gamma_rollback)

    def prepare(self, context: MixContext) -> None:
        super().prepare(context)
        if self.sigma_star is not None:
            return
        n, target = calibration_point("gopa", context, self.calibration_margin)
        cal = calibrate_baseline(
            self._baseline(n, 1.0, 1.0), n, epsilon_for_delta(target, context.delta), context.delta,
            Threat.collusion(self.collusion), runs=self.calibration_runs,
            seed=seeding.seed_of(context.seed, seeding.CALIBRATION), procedures=("exact",),
            value_sensitivity=context.value_sensitivity, target_success=self.calibration_success)["exact"]
        if not (math.isfinite(cal.sigma_star) and math.isfinite(cal.sigma_delta)):
            raise ValueError(f"gopa: no finite noise meets the round target mu = {target:.4g} against "
                             f"{self.collusion:.0%} colluders among {n} participants")
        self.calibration, self._calibrated_n = cal, n

    def sigmas(self, participants: int) -> tuple[float, float]:
        """(sigma_star, sigma_delta) in value units for a round of ``participants`` parties."""
        if self.sigma_star is not None:
            return self.sigma_star, float(self.sigma_delta)
        cal = self.calibration
        return cal.sigma_star * math.sqrt(self._calibrated_n / participants), cal.sigma_delta

    # ------------------------------------------------------------------------ round
    def certify(self, execution: PairwiseExecution, round: int, sigma_star: float, sigma_delta: float,
                seeds: np.random.SeedSequence | None = None) -> float:
        """The worst mu (value sensitivity applied) over the round's ``threat_draws`` coalitions, each
        honest party's exact certificate of ``execution`` (a NaN counts as unbounded). ``seeds``: the
        coalitions' root (default: the round's certification seeds)."""
        gopa = self._baseline(execution.parties, sigma_star, sigma_delta)
        threat = Threat.collusion(self.collusion)
        mus = []
        if seeds is None:
            seeds = certification_seeds(self._threat_seed(), round)
        for draw in seeds.spawn(self.threat_draws):
            view = gopa.adversary(execution, threat, int(draw.generate_state(1, dtype=np.uint64)[0]))
            mus.append(worst_mu(gopa.sensitivity_profile(execution, view).mu(sigma_star, sigma_delta)))
        return worst_mu(mus) * self.context.value_sensitivity

    def _threat_seed(self) -> int:
        return seeding.seed_of(self.context.seed, seeding.THREAT)

    def predicted_cost(self, participants: int, runs: int) -> float:
        """The worst certified mu over ``runs`` executions of ``participants`` parties sampled with this
        mixer's settings (:func:`flwr_inca.privacy.budget_check.worst_over_executions`, as IncA's rounds
        are predicted). Cached per (participants, runs), serving nearby counts as IncA's predictions do."""
        cached = self._predicted.get(int(participants), int(runs))
        if cached is None:
            n = check_int("participants (GOPA needs two parties)", participants, 2)
            s_star, s_delta = self.sigmas(n)
            gopa = self._baseline(n, s_star, s_delta)

            def cost(execution: int, threat: np.random.SeedSequence) -> float:
                return self.certify(gopa.sample_execution(n, execution), 0, s_star, s_delta, threat)

            cached = worst_over_executions(prediction_seeds(self._threat_seed(), n), runs, cost)
            self._predicted.put(n, runs, cached)
        return cached

    def plan(self, round: int, participants: int) -> RoundPlan:
        n = check_int("participants (GOPA needs two parties)", participants, 2)
        start = time.perf_counter()
        s_star, s_delta = self.sigmas(n)
        execution = self._baseline(n, s_star, s_delta).sample_execution(
            n, seeding.seed_of(self.context.seed, seeding.TRACE, round))
        sampled = time.perf_counter()
        mu = self.certify(execution, round, s_star, s_delta)
        revealed, uncancelled = execution.edge_status()
        return RoundPlan(round, n, mu, True, info={
            "sigma_star": s_star, "sigma_delta": s_delta, "execution": execution, "edges": len(execution.edges),
            "published": int(execution.published.sum()), "rolled_back_terms": int(revealed.sum()),
            "uncancelled_terms": int(uncancelled.sum()), "cost": "certified", "method": "exact",
            "seconds_trace": sampled - start, "seconds_certify": time.perf_counter() - sampled},
            # one message per pairwise term (edge), the published value, the roll-back of dropped neighbours' terms
            messages=len(execution.edges) / n + 1.0 + 1.0)

    def _terms(self, round: int, edges: np.ndarray, d: int) -> np.ndarray:
        """Unit draws of the pairwise terms of ``edges`` (indices), (len(edges), d): one stream per term,
        so a term has the same value whichever others are drawn."""
        out = np.empty((len(edges), d))
        for row, e in enumerate(edges):
            seeding.stream(self.context.seed, _PAIR, round, int(e)).standard_normal(out=out[row])
        return out

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        execution: PairwiseExecution = plan.info["execution"]
        n, d = updates.shape
        if n != execution.parties:
            raise ValueError(f"updates has {n} rows but the round's plan has {execution.parties} participants")
        pub = execution.published
        if not pub.any():
            return np.full(d, np.nan, dtype=updates.dtype)
        s_star, s_delta = plan.info["sigma_star"], plan.info["sigma_delta"]
        x_tilde = updates.astype(np.float64)
        x_tilde += s_star * seeding.stream(self.context.seed, seeding.NOISE, plan.round).standard_normal((n, d))
        if self.draw == "all":  # the protocol's arithmetic: every term added and subtracted
            pair = s_delta * self._terms(plan.round, np.arange(len(execution.edges)), d)
            estimate = pairwise_estimate(pairwise_masked_values(x_tilde, execution.edges, pair), execution, pair)
        else:  # only what stays in the sum: the same estimate, O((n + U) d)
            _, uncancelled = execution.edge_status()
            terms = self._terms(plan.round, np.flatnonzero(uncancelled), d)
            estimate = uncancelled_estimate(x_tilde, execution, terms, s_delta)
        return estimate.astype(updates.dtype)

    def charge(self, session: RoundSession, plan: RoundPlan) -> RoundCharge:
        """The round as a GOPA deployment runs it through ``session``: the masked updates are published only
        if what they reveal fits, reserved first: the local ceiling ``S / sigma_star`` (a bound for any
        dropouts: everything about x_i passes through x_i + eta*_i), else the exact certificate of the
        masked values collected (the first-phase dropouts are known once they are collected, before any is
        released); the roll-back only if the round's exact certificate fits. A round refused before its
        roll-back is charged the exact certificate of what was published (no term revealed; at most the
        round's cost)."""
        s_star = plan.info["sigma_star"]
        ceiling = self.context.value_sensitivity / s_star if s_star > 0 else math.inf
        published: list[RoundCertificate] = []

        def certify_published(step: int) -> RoundCertificate:
            if not published:  # computed once, and only when needed
                execution: PairwiseExecution = plan.info["execution"]
                mu = self.certify(dataclasses.replace(execution, rollback=False), plan.round, s_star,
                                  plan.info["sigma_delta"])
                published.append(RoundCertificate(min(mu, plan.mu), ("exact",)))
            return published[0]

        opened = session.open(plan.round, ceilings=[ceiling], certify_through=certify_published,
                              note=f"round {plan.round}")
        if not opened.may_deliver(1):
            plan.info["stopped"] = "before publishing"
            return opened.refuse()
        cost = RoundCertificate(plan.mu, ("exact",))
        if opened.may_release(cost):
            return opened.settle(cost)
        plan.info["stopped"] = "before its roll-back"
        return opened.refuse(certify_published(1))


class WithinRoundDropout(Mixer):
    """Wraps ``inner``: ``round(gamma n)`` of the round's ``n`` participants (uniformly, drawn in the
    plan, before any value exists) drop out after training; ``inner`` mixes the others' updates.

    ``plan.info["rows"]`` lists the surviving rows; the inner plan's ``info`` is merged in.
    """

    def __init__(self, inner: Mixer, gamma: float) -> None:
        super().__init__()
        if not isinstance(inner, Mixer):
            raise ValueError(f"inner must be a Mixer, got {type(inner).__name__}")  # noqa: TRY004  (the project names bad arguments with ValueError)
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (0.0 <= gamma < 1.0):
            raise ValueError(f"gamma (share of participants dropping out in a round) must be in [0, 1), got {gamma!r}")
        self.inner, self.gamma = inner, float(gamma)
        self.name = inner.name  # type: ignore[misc]  (an instance attribute: the history shows the inner name)
        self.private = inner.private  # type: ignore[misc]

    def prepare(self, context: MixContext) -> None:
        super().prepare(context)
        survivors = max(2, context.participants - round_half(self.gamma * context.participants))
        self.inner.prepare(MixContext(context.value_sensitivity, context.mu_round, context.delta, survivors,
                                      context.dimension, context.seed, context.precision))

    def plan(self, round: int, participants: int) -> RoundPlan:
        drop = min(round_half(self.gamma * participants), participants - 2)
        rng = seeding.stream(self.context.seed, _DROPOUT, round)
        rows = np.sort(rng.choice(participants, size=participants - drop, replace=False))
        inner = self.inner.plan(round, int(rows.size))
        info = dict(inner.info)
        info.update(rows=rows, dropped=drop, inner_plan=inner)
        return RoundPlan(round, participants, inner.mu, inner.certified, inner.trace, info,
                         messages=inner.messages * rows.size / participants)

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        inner: RoundPlan = plan.info["inner_plan"]
        out = self.inner.mix(updates[plan.info["rows"]], inner)
        if "node_updates" in inner.info:
            plan.info["node_updates"] = inner.info.pop("node_updates")
        return out

    def abandon(self, plan: RoundPlan) -> None:
        self.inner.abandon(plan.info["inner_plan"])

    def charge(self, session: RoundSession, plan: RoundPlan) -> RoundCharge:
        return self.inner.charge(session, plan.info["inner_plan"])

    def predicted_cost(self, participants: int, runs: int) -> float | None:
        survivors = max(2, participants - min(round_half(self.gamma * participants), participants - 2))
        return self.inner.predicted_cost(survivors, runs)

    def describe(self) -> str:
        return f"{self.inner.describe()}; {self.gamma:.0%} of the participants drop out before mixing"


def _connected(adjacency: sp.spmatrix) -> bool:
    return connected_components(adjacency, directed=False, return_labels=False) == 1


def round_half(x: float) -> int:
    """Round half up (``round(0.5) == 1``), so that a share of a small cohort is not lost to banker's rounding."""
    return math.floor(x + 0.5)
