"""The pre-round budget check: training stops *before* a round whose predicted cost does not fit.

A round's exact cost is the certificate of its execution (who was online, who sent what weight to
whom; paper Sec. 4.1), known only as the round runs. Before it starts, a deployment *predicts* it: the
worst certified mu over ``runs`` simulated executions of the round's n parties at the round's sigmas
and dropout model (:func:`predicted_round_mu`). If the ledger's epsilon after a round of that cost
exceeds the budget, the round is not started: nothing of it is revealed, nothing is charged, and
training stops (:func:`check_round_budget`). A round that starts and then certifies too costly is
refused by the pre-final rule or the budget guard (:mod:`flwr_inca.privacy.prefinal`): charged what it
revealed and skipped. The check spares the budget those charges when no round can fit.

One rule for both adapters: ``IncaStrategy`` checks before every round; the simulator, which samples a
round's execution before anything of it is released, evaluates the same check for the rounds whose
own execution does not fit (docs/simulation.md, "The pre-round budget check"). The decision depends
only on the ledger and on simulated executions (no value), so stopping reveals nothing about the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._checks import check_int
from ..protocol.config import IncaConfig
from ..protocol.engine import sample_trace
from .ledger import PrivacyLedger
from .prefix import RoundPrefix
from .rounds import worst_mu

__all__ = ["PREDICT_KEY", "RoundBudgetCheck", "check_round_budget", "predicted_round_mu", "prediction_seeds",
           "worst_over_executions"]

PREDICT_KEY = 1  # first spawn_key entry of the prediction seeds (after rounds.CERTIFY_KEY = 0)


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
    certified). A prediction, not a bound: an actual execution may cost more (it is then refused by the
    pre-final rule, see :mod:`flwr_inca.privacy.prefinal`)."""

    def cost(execution: int, threat: np.random.SeedSequence) -> float:
        trace = sample_trace(n, config, seed=execution)
        return RoundPrefix(trace, threat, threat_draws, collusion=collusion, observed_fraction=observed_fraction,
                           value_sensitivity=value_sensitivity).with_finals().mu

    return worst_over_executions(seeds, runs, cost)


@dataclass(frozen=True)
class RoundBudgetCheck:
    """The pre-round check of round ``round``: may it start?

    Attributes:
        round: the round about to start.
        epsilon: privacy spent before it (the ledger, at ``delta``).
        predicted_mu: its predicted cost, as it would be charged (NaN: not predicted, because there is
            no budget or the budget is already overrun).
        predicted_epsilon: the ledger's epsilon after a round of ``predicted_mu`` (inf: the budget is
            already overrun; NaN: no budget).
        max_epsilon: the budget (None: unlimited); ``delta``: its delta.
    """

    round: int
    epsilon: float
    predicted_mu: float
    predicted_epsilon: float
    max_epsilon: float | None
    delta: float

    @property
    def fits(self) -> bool:
        """Whether the round may start."""
        return self.max_epsilon is None or self.predicted_epsilon <= self.max_epsilon

    @property
    def reason(self) -> str:
        """Why it may not ("" if it may), with the numbers; the adapters add what they did."""
        if self.fits:
            return ""
        if math.isnan(self.predicted_mu):
            return (f"stopping before round {self.round}: the certified cost of the rounds so far brought epsilon "
                    f"to {self.epsilon:.4g} > max_epsilon = {self.max_epsilon:.4g} (delta = {self.delta:.1e})")
        return (f"stopping before round {self.round}: it would bring epsilon from {self.epsilon:.4g} to about "
                f"{self.predicted_epsilon:.4g} > max_epsilon = {self.max_epsilon:.4g} (delta = {self.delta:.1e})")


def check_round_budget(ledger: PrivacyLedger, round: int, predicted_mu: Callable[[], float],
                       sample_rate: float = 1.0) -> RoundBudgetCheck:
    """Whether round ``round`` may start on ``ledger`` (its ``max_epsilon`` is the budget): it may unless
    the budget is already overrun, or the ledger's epsilon after one more round of ``predicted_mu()``
    (called only when needed: the prediction costs ``runs`` certificates) at ``sample_rate`` exceeds it.
    The ledger is read as it is (``refresh`` it first when another process may spend on it)."""
    budget, delta, spent = ledger.max_epsilon, ledger.delta, ledger.epsilon()
    if budget is None:
        return RoundBudgetCheck(round, spent, math.nan, math.nan, None, delta)
    if spent > budget:
        return RoundBudgetCheck(round, spent, math.nan, math.inf, budget, delta)
    mu = float(predicted_mu())
    return RoundBudgetCheck(round, spent, mu, ledger.epsilon_after(mu, sample_rate), budget, delta)
