"""A round's predicted cost, before it starts: what the round session's admission checks.

A round's exact cost is the certificate of its execution (who was online, who sent what weight to
whom; paper Sec. 4.1), known only as the round runs. Before it starts, a deployment *predicts* it: the
worst certified mu over ``runs`` simulated executions of the round's n parties at the round's sigmas
and dropout model (:func:`predicted_round_mu`). If the ledger's epsilon after a round of that cost
exceeds the budget, the round is not started (:meth:`flwr_inca.privacy.session.RoundSession.admit`).
The prediction depends only on simulated executions (no value), so stopping reveals nothing about the
data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from .._checks import check_int
from ..protocol.config import IncaConfig
from ..protocol.dropout import NoDropout
from ..protocol.engine import sample_trace
from .prefix import RoundPrefix
from .rounds import worst_mu

__all__ = ["DROPOUT_FREE_SHARE", "PREDICT_KEY", "PREDICTION_REUSE_WITHIN", "Predictions", "predicted_round_mu",
           "prediction_seeds", "worst_over_executions"]

PREDICT_KEY = 1  # first spawn_key entry of the prediction seeds (after rounds.CERTIFY_KEY = 0)
DROPOUT_FREE_KEY = 1  # last spawn_key entry of the seeds of the dropout-free executions of a prediction
DROPOUT_FREE_SHARE = 0.25  # of a prediction's runs, the share (rounded up) drawn with nobody dropping out
# a prediction made for n parties serves every party count within this share of n: the worst of a few sampled
# executions varies more between seeds than between such counts, and rounds whose participants vary (clients
# available or not) would otherwise pay a new prediction, several certificates, at every round
PREDICTION_REUSE_WITHIN = 0.05


class Predictions:
    """Predicted round costs by (party count, runs), each serving counts within
    :data:`PREDICTION_REUSE_WITHIN` of the one it was made for (the nearest is used)."""

    def __init__(self) -> None:
        self._made: dict[tuple[int, int], object] = {}

    def get(self, n: int, runs: int) -> object | None:
        """The prediction made for the nearest party count to ``n`` within reach (at ``runs``), or None."""
        near = [(abs(m - n), m) for (m, r) in self._made if r == runs and abs(m - n) <= PREDICTION_REUSE_WITHIN * m]
        return self._made[(min(near)[1], runs)] if near else None

    def put(self, n: int, runs: int, prediction: object) -> None:
        self._made[(int(n), int(runs))] = prediction


def prediction_seeds(seed: int | None, n: int) -> np.random.SeedSequence:
    """The root of the simulated executions that predict a round of ``n`` parties, for a training seeded
    with ``seed`` (the same seed as :func:`flwr_inca.privacy.rounds.certification_seeds`)."""
    return np.random.SeedSequence(seed, spawn_key=(PREDICT_KEY, int(n)))


def worst_over_executions(seeds: np.random.SeedSequence, runs: int,
                          cost: Callable[[int, np.random.SeedSequence], float]) -> float:
    """The worst of ``cost(execution_seed, threat_seeds)`` over ``runs`` simulated executions drawn from
    ``seeds`` (each run spawns an execution seed, as an int, and the seeds of its adversaries). A NaN
    counts as unbounded (inf). The same ``seeds`` always give the same runs."""
    runs = check_int("runs (budget_check_runs: simulated executions)", runs)
    # spawn from a copy: spawning advances a SeedSequence, and each call must draw the same executions
    fresh = np.random.SeedSequence(seeds.entropy, spawn_key=seeds.spawn_key, pool_size=seeds.pool_size)
    worst = 0.0
    for run in fresh.spawn(runs):
        execution, threat = run.spawn(2)
        worst = worst_mu([worst, cost(int(execution.generate_state(1, dtype=np.uint64)[0]), threat)])
    return worst


def predicted_round_mu(
    n: int,
    config: IncaConfig,
    seeds: np.random.SeedSequence,
    runs: int,
    *,
    threat_draws: int = 1,
    collusion: float = 0.0,
    observed_fraction: float | None = None,
    value_sensitivity: float = 1.0,
) -> float:
    """Predicted cost (GDP mu) of an IncA round of ``n`` parties run with ``config`` (its sigmas, schedule,
    topology and dropout model): the worst, over ``runs`` executions sampled from ``seeds``
    (:func:`prediction_seeds`), of the round's certificate with every final observed, against
    ``threat_draws`` random adversaries (:class:`~flwr_inca.privacy.prefix.RoundPrefix`, as a round is
    certified). With a dropout model, ``ceil(runs * DROPOUT_FREE_SHARE)`` of the ``runs`` executions (when
    ``runs >= 2``) are drawn with nobody dropping out: a round where every party stays is possible whatever
    the model (a deployment's nodes may drop out less than expected), and it costs more at n >= 100 (the
    noise of a party that leaves is never cancelled, which hides the others); a prediction without them let
    such rounds overrun the last round's share of the budget. A prediction, not a bound: an actual
    execution may cost more (it is then refused by the pre-final rule, see :mod:`flwr_inca.privacy.prefinal`)."""

    def cost_of(model: IncaConfig) -> Callable[[int, np.random.SeedSequence], float]:
        def cost(execution: int, threat: np.random.SeedSequence) -> float:
            trace = sample_trace(n, model, seed=execution)
            return RoundPrefix(trace, threat, threat_draws, collusion=collusion, observed_fraction=observed_fraction,
                               value_sensitivity=value_sensitivity).with_finals().mu
        return cost

    runs = check_int("runs (budget_check_runs: simulated executions)", runs)
    free = math.ceil(runs * DROPOUT_FREE_SHARE) if runs >= 2 and config.dropout is not None and not isinstance(
        config.dropout, NoDropout) else 0
    worst = worst_over_executions(seeds, runs - free, cost_of(config))
    if free:
        stay = np.random.SeedSequence(seeds.entropy, spawn_key=(*seeds.spawn_key, DROPOUT_FREE_KEY))
        worst = worst_mu([worst, worst_over_executions(stay, free, cost_of(replace(config, dropout=None)))])
    return worst
