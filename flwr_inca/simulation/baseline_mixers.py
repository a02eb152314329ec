"""The baselines as training mechanisms: local DP, DP gossip / D-SGD and Muffliato as simulator
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

The gossip mixers release the *average* of the parties' estimates as the model update (the
simulator keeps one model) and put each party's own estimate in ``plan.info["node_updates"]`` (rows in
the order of the updates they got; ``plan.info["rows"]`` maps them to the round's participants), so
that a caller (``on_round``) can follow every party's model and report the worst one. The simulator
trains every participant from the current (average) model, so a party's gradient is taken there, not
at its own model: this favours the gossip methods (their gradients are taken at a less noisy point).

:class:`WithinRoundDropout` wraps any mixer: a ``gamma`` share of the round's participants
(``round(gamma n)``, uniformly) drops out after training, before mixing; the wrapped mixer mixes the
rest. (IncA has its own in-round dropout model, ``SimulationConfig.dropout``.)
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import connected_components

from ..baselines import (
    DPGossip,
    GossipExecution,
    LocalDP,
    Muffliato,
    gossip_matrix,
    graph_adjacency,
    noisy_gossip_step,
    pndp_mean_privacy_loss,
)
from . import seeding
from .mixers import MixContext, Mixer, RoundPlan, register_mixer

__all__ = ["DPGossipMixer", "LocalDPMixer", "MuffliatoMixer", "WithinRoundDropout"]

# purposes of this module's streams (beside seeding's; never reorder)
_GRAPH, _DROPOUT = 101, 102


class _LocalNoiseMixer(Mixer):
    """Shared by the mixers whose parties noise their own update: ``z = 1 / mu_round`` unless given."""

    def __init__(self, noise_multiplier: float | None = None) -> None:
        super().__init__()
        if noise_multiplier is not None and not (
            isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier) and noise_multiplier > 0
        ):
            raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
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


def _check_degree(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@register_mixer
class DPGossipMixer(_LocalNoiseMixer):
    """D-SGD with DP gossip averaging (Koskela & Kulkarni, App. F) on a sparse Erdos-Renyi graph among the round's participants (the same graph for the same count)
    per round (edge probability ``expected_degree / (n - 1)``); ``gossip_steps`` averaging steps per
    round (the first one noisy: ``W (x + eta)``, the others ``W y``)."""

    name = "dp-gossip"

    def __init__(self, noise_multiplier: float | None = None, expected_degree: int = 10,
                 gossip_steps: int = 1) -> None:
        super().__init__(noise_multiplier)
        self.expected_degree = _check_degree("expected_degree", expected_degree)
        self.gossip_steps = _check_degree("gossip_steps", gossip_steps)

    def plan(self, round: int, participants: int) -> RoundPlan:
        p = min(1.0, self.expected_degree / max(1, participants - 1))
        baseline = DPGossip(self.sigma, graph=f"erdos-renyi:{p:.12g}", iterations=self.gossip_steps)
        execution = baseline.sample_execution(participants, seed=seeding.seed_of(self.context.seed, _GRAPH, 0))
        z = float(self.noise_multiplier)
        return RoundPlan(round, participants, 1.0 / z, True, info={
            "noise_multiplier": z, "execution": execution, "edge_probability": p,
            "cost": "local DP (a neighbour sees x_i + eta_i)"})

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        execution = plan.info.pop("execution")
        rng = seeding.stream(self.context.seed, seeding.NOISE, plan.round)
        nodes = noisy_gossip_step(updates.astype(np.float64), execution.W, self.sigma, rng)
        for _ in range(self.gossip_steps - 1):
            nodes = execution.W @ nodes
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
        self.expected_degree = None if expected_degree is None else _check_degree("expected_degree", expected_degree)
        self.iterations = None if iterations is None else _check_degree("iterations", iterations)
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
        max_degree = float(np.asarray((execution.adjacency > 0).sum(axis=1)).max())
        # the mean pairwise loss alpha T d S^2 / (2 n sigma^2) is that of a Gaussian of mu: alpha mu^2 / 2
        sigma = S * math.sqrt(T * max_degree / n) / self.context.mu_round
        mu = math.sqrt(2.0 * pndp_mean_privacy_loss(sigma, 1.0, T, max_degree, n, S))
        return RoundPlan(round, participants, mu, False, info={
            "noise_std": sigma, "graph": graph, "iterations": T, "execution": execution,
            "mu_collusion": S / sigma,
            "cost": f"Pairwise Network DP, mean over pairs (Muffliato's own, weaker accounting); against "
                    f"a colluding neighbour it is local DP with mu = {S / sigma:.4g}"})

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
        return RoundPlan(round, participants, inner.mu, inner.certified, inner.trace, info)

    def mix(self, updates: np.ndarray, plan: RoundPlan) -> np.ndarray:
        inner: RoundPlan = plan.info["inner_plan"]
        out = self.inner.mix(updates[plan.info["rows"]], inner)
        if "node_updates" in inner.info:
            plan.info["node_updates"] = inner.info.pop("node_updates")
        return out

    def abandon(self, plan: RoundPlan) -> None:
        self.inner.abandon(plan.info["inner_plan"])

    def describe(self) -> str:
        return f"{self.inner.describe()}; {self.gamma:.0%} of the participants drop out before mixing"


def _connected(adjacency: sp.spmatrix) -> bool:
    return connected_components(adjacency, directed=False, return_labels=False) == 1


def round_half(x: float) -> int:
    """Round half up (``round(0.5) == 1``), so that a share of a small cohort is not lost to banker's rounding."""
    return math.floor(x + 0.5)
