"""``IncaStrategy``: FedAvg's sampling, evaluation and ``start``, with IncA instead of a trusted
aggregator: the server only relays encrypted peer messages.

IncA runs inside Flower's own ``Strategy.start``, through the hooks every Flower strategy has:

* ``configure_train`` samples the nodes as FedAvg does, checks the privacy budget, and sends the
  global model with the round's IncA settings (the *join*);
* the sampled nodes train with *your* train function; each keeps its clipped update and answers with
  a public key only;
* ``aggregate_train`` then runs IncA's mixing for ``iterations`` exchanges on the grid handed to
  ``configure_train`` (kept per round, as Flower's DP wrappers keep their pending state), routing
  end-to-end encrypted payloads it cannot read; the new global model is the weight-tracked average of
  the final messages (public in the threat model). The round's execution trace is certified exactly
  under the configured threat model and charged to a persistent privacy ledger.

Training stops before a round that would take the privacy spent past ``max_epsilon``: the strategy
raises :class:`IncaBudgetExhausted`, a ``flwr.serverapp.exception.PrivacyBudgetExhausted`` as Flower's
own DP strategies raise, which carries the global model.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from logging import ERROR, INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, PrivacySpent
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from .._checks import check_int
from ..privacy.calibration import Calibration, calibrate
from ..privacy.certificate import certify
from ..privacy.ledger import BudgetExceededError, PrivacyLedger
from ..privacy.views import random_collusion, random_eavesdrop
from ..protocol.config import IncaConfig
from ..protocol.engine import sample_trace
from ..protocol.schedules import InjectionSchedule
from ..protocol.trace import ExecutionTrace
from ..protocol.utility import noise_std
from .config import MixingConfig, PersistenceConfig, PrivacyTarget, RelayConfig, build_groups
from .relay import Reply, Request, RoundRelay, collect_finals, run_iterations
from .shared import INCA_KEY, MIX_ACTION, RoundParams, flatten_arrays, unflatten_arrays
from .wire import FIELD, decode_reply, encode_request

__all__ = ["IncaStrategy", "IncaBudgetExhausted", "RoundRecord"]

# keys of the SeedSequences behind the server's random choices (spawn_key, after the strategy's seed)
_CERTIFY, _PREDICT = 0, 1


class IncaBudgetExhausted(PrivacyBudgetExhausted, BudgetExceededError):
    """The next round would take the privacy spent past ``max_epsilon``: training stops before it.

    Raised by ``configure_train`` before any node is contacted, hence out of ``Strategy.start``, like
    Flower's ``PrivacyBudgetExhausted`` (which it is; also a :class:`flwr_inca.privacy.BudgetExceededError`).

    Attributes:
        server_round: the round that did not start.
        arrays: the global model when training stopped (what ``start`` would have returned).
        epsilon: privacy spent so far, at ``delta``.
        predicted_epsilon: what it would have been after the round (``inf`` if the budget was overrun).
        max_epsilon, delta: the budget.
    """

    def __init__(self, reason: str, *, server_round: int, arrays: ArrayRecord, epsilon: float,
                 predicted_epsilon: float, max_epsilon: float, delta: float) -> None:
        super().__init__(reason)
        self.server_round, self.arrays = server_round, arrays
        self.epsilon, self.predicted_epsilon = epsilon, predicted_epsilon
        self.max_epsilon, self.delta = max_epsilon, delta


@dataclass
class RoundRecord:
    """What happened in one IncA round (kept in ``IncaStrategy.rounds``)."""

    round: int
    roster: list[int]  # node ids; party i of the trace is roster[i]
    trace: ExecutionTrace | None = None
    update: np.ndarray | None = None  # the averaged update applied to the model (float64)
    finalists: list[int] = field(default_factory=list)
    mu: float = math.nan
    epsilon: float = math.nan
    failed: str = ""  # why the round failed, if it did
    client_metrics: dict[int, MetricRecord] = field(default_factory=dict)  # by node id (if forwarded)
    noise_std: float = math.nan  # of the update, per coordinate (inf without finals)
    seconds: float = 0.0


@dataclass
class _PendingRound:
    """What ``configure_train`` keeps for ``aggregate_train`` of the same round."""

    grid: Grid
    arrays: ArrayRecord
    started: float


@dataclass
class _Joined:
    """The nodes that joined a round: their public keys, value dimensions and metrics (by node id)."""

    keys: dict[int, bytes] = field(default_factory=dict)
    dims: dict[int, int] = field(default_factory=dict)
    metrics: dict[int, MetricRecord] = field(default_factory=dict)

    @property
    def roster(self) -> list[int]:
        return sorted(self.keys)


@dataclass
class _Mixed:
    """The outcome of a round's relayed mixing."""

    relay: RoundRelay
    params: RoundParams
    counters: dict[str, int]


class _TrainMetrics(MetricRecord):
    """The MetricRecord a round returns to Flower (``Result.train_metrics_clientapp``): the nodes'
    forwarded train metrics, and, until a later release, IncA's server-side metrics, whose reading
    from here warns (read them from ``IncaStrategy.train_metrics_serverapp``)."""

    def __getitem__(self, key: str):
        if isinstance(key, str) and key.startswith("inca-"):
            warnings.warn(f"reading {key!r} from Result.train_metrics_clientapp is deprecated: IncA's "
                          "server-side metrics are in IncaStrategy.train_metrics_serverapp[round]",
                          FutureWarning, stacklevel=2)
        return super().__getitem__(key)


class IncaStrategy(FedAvg):
    """Federated averaging without a trusted aggregator (IncA), with per-round exact accounting.

    A drop-in replacement for ``FedAvg`` in a ServerApp that trains with ``strategy.start``: same
    sampling, evaluation and ``Result``, given a ClientApp whose train function is registered with
    ``IncaClient.train()`` (see :class:`flwr_inca.flower.IncaClient`). What differs: the nodes'
    updates are clipped to ``clip_norm`` and averaged by IncA with calibrated noise, so the model is
    differentially private; the server never sees an update; and ``start`` raises
    :class:`IncaBudgetExhausted` when ``max_epsilon`` would be exceeded.

    Args:
        privacy: a :class:`PrivacyTarget` (target, threat, budget).
        mixing: a :class:`MixingConfig` (iterations, noise, when a round fails).
        relay: a :class:`RelayConfig` (timeouts, retries).
        persistence: a :class:`PersistenceConfig` (ledger path, trace directory).
        forward_client_metrics: also aggregate the train metrics nodes report (not protected).
        seed: seeds the server's choices (certification draws, budget predictions); None = fresh.
        fraction_train ... evaluate_metrics_aggr_fn: FedAvg's arguments, with FedAvg's meaning.
        **settings: any field of the four groups directly, e.g. ``epsilon=1.0, iterations=20,
            ledger_path="ledger.json"`` (not together with that group's object).

    Attributes:
        train_metrics_serverapp: IncA's server-side metrics by round (``inca-epsilon``, ``inca-mu``,
            ``inca-finalists``, ...); Flower's ``Result`` has no field for them.
        rounds: a :class:`RoundRecord` by round; ``ledger``: the :class:`PrivacyLedger`.
    """

    def __init__(
        self,
        *,
        privacy: PrivacyTarget | None = None,
        mixing: MixingConfig | None = None,
        relay: RelayConfig | None = None,
        persistence: PersistenceConfig | None = None,
        forward_client_metrics: bool = False,
        seed: int | None = None,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        **settings: Any,
    ) -> None:
        groups = build_groups({"privacy": privacy, "mixing": mixing, "relay": relay,
                               "persistence": persistence}, settings)
        self.privacy: PrivacyTarget = groups["privacy"]
        self.mixing: MixingConfig = groups["mixing"]
        self.relay: RelayConfig = groups["relay"]
        self.persistence: PersistenceConfig = groups["persistence"]
        if self.mixing.calibrated and self.privacy.epsilon is None:
            raise ValueError("give sigma_star and sigma_delta, or a per-round target epsilon to calibrate "
                             "them")
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
                         arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
                         train_metrics_aggr_fn=train_metrics_aggr_fn,
                         evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        self.forward_client_metrics = bool(forward_client_metrics)
        self.seed = (int(np.random.SeedSequence().entropy) if seed is None
                     else check_int("seed (or None)", seed, 0))
        self.ledger = PrivacyLedger(self.persistence.ledger_path, delta=self.privacy.delta,
                                    max_epsilon=self.privacy.max_epsilon,
                                    accountant=self.privacy.accountant_name)
        self.calibrations: dict[int, Calibration] = {}
        self.rounds: dict[int, RoundRecord] = {}
        self.train_metrics_serverapp: dict[int, MetricRecord] = {}
        self._predicted: dict[int, float] = {}
        self._pending: dict[int, _PendingRound] = {}

    # ----------------------------------------------------------------------------- summary
    def summary(self) -> None:
        super().summary()
        mix, priv = self.mixing, self.privacy
        log(INFO, "\t└──> IncA:")
        log(INFO, "\t\t├── iterations T = %d, neighbours k = %d, schedule %s", mix.iterations, mix.neighbors,
            mix.schedule)
        if not mix.calibrated:
            log(INFO, "\t\t├── sigma_star = %.4g, sigma_delta = %.4g", mix.sigma_star, mix.sigma_delta)
        else:
            log(INFO, "\t\t├── sigmas calibrated for (%.3g, %.1e)-DP per round", priv.epsilon, priv.delta)
        log(INFO, "\t\t├── clip norm %.4g, value sensitivity %.4g, sample rate %.4g", priv.clip_norm,
            priv.sensitivity, priv.sample_rate)
        budget = "unlimited" if priv.max_epsilon is None else f"{priv.max_epsilon:g}"
        log(INFO, "\t\t└── threat: %s; budget: %s at delta %.1e (%s accountant, %d round(s) spent)",
            priv.describe_threat(), budget, priv.delta, self.ledger.accountant.name, self.ledger.rounds)
        if self.ledger.rounds:
            log(INFO, "IncA: resuming privacy ledger %s: %d round(s), epsilon = %.4g", self.ledger.path,
                self.ledger.rounds, self.ledger.epsilon())

    def privacy_spent(self) -> PrivacySpent:
        """Privacy spent so far by the rounds in the ledger, at the target's delta (as Flower's DP
        strategies report it)."""
        return PrivacySpent(epsilon=float(self.ledger.epsilon()), delta=self.privacy.delta,
                            num_releases=self.ledger.rounds, accounting_method=self.ledger.accountant.name)

    # ----------------------------------------------------------------------------- start
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start``, except that ``Result.arrays`` is never empty: when no round
        changed the model (``num_rounds=0``, or every round failed), it is the initial model, and the
        log says so (Flower's own ``start`` leaves it empty then)."""
        result = super().start(grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds,
                               timeout=timeout, train_config=train_config, evaluate_config=evaluate_config,
                               evaluate_fn=evaluate_fn)
        if len(result.arrays) == 0:
            log(WARNING, "IncA: no round changed the model; Result.arrays is the initial model")
            result.arrays = initial_arrays
        return result

    # ----------------------------------------------------------------------------- join
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """FedAvg's sampling and messages, with the round's IncA settings: the nodes *join* the round.

        Raises :class:`IncaBudgetExhausted` (before contacting any node) if the round would take the
        privacy spent past ``max_epsilon``.
        """
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if not messages:  # fraction_train == 0: no training, as in FedAvg
            return messages
        self._check_budget(server_round, len(messages), arrays)
        inca = ConfigRecord({"round": server_round, "clip-norm": self.privacy.clip_norm,
                             "iterations": self.mixing.iterations, "arrays-key": self.arrayrecord_key,
                             "forward-metrics": self.forward_client_metrics})
        for msg in messages:  # FedAvg's messages share one RecordDict
            msg.content[INCA_KEY] = inca
        self._pending[server_round] = _PendingRound(grid, arrays, time.time())
        return messages

    def _check_budget(self, server_round: int, n: int, arrays: ArrayRecord) -> None:
        budget, delta = self.privacy.max_epsilon, self.privacy.delta
        if budget is None:
            return
        spent = self.ledger.epsilon()
        if spent > budget:
            after = math.inf
            reason = (f"IncA: stopping before round {server_round}: the certified cost of the rounds so "
                      f"far brought epsilon to {spent:.4g} > max_epsilon = {budget:.4g} "
                      f"(delta = {delta:.1e})")
        else:
            after = self.ledger.epsilon_after(self.predicted_mu(max(n, 2)), self.privacy.sample_rate)
            if after <= budget:
                return
            reason = (f"IncA: stopping before round {server_round}: it would bring epsilon from {spent:.4g} "
                      f"to about {after:.4g} > max_epsilon = {budget:.4g} (delta = {delta:.1e})")
        log(WARNING, "%s", reason)
        raise IncaBudgetExhausted(reason, server_round=server_round, arrays=arrays, epsilon=spent,
                                  predicted_epsilon=after, max_epsilon=budget, delta=self.privacy.delta)

    # ----------------------------------------------------------------------------- round
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Mix the updates of the nodes that joined (relayed, end to end encrypted), certify and charge
        the round, and return the new model (None if the round failed) with the round's metrics."""
        replies = list(replies)
        pending = self._pending.pop(server_round, None)
        if pending is None:
            if replies:
                raise ValueError(f"round {server_round} was not configured by this strategy's "
                                 "configure_train")
            return None, None  # nothing was sent (fraction_train == 0)
        joined = self._join(replies)
        record = RoundRecord(server_round, joined.roster, client_metrics=joined.metrics)
        self.rounds[server_round] = record
        vector, spec = flatten_arrays(pending.arrays)
        minimum = self.mixing.min_finalists
        if len(record.roster) < max(2, minimum):
            record.failed = f"only {len(record.roster)} node(s) joined (min_finalists = {minimum})"
            log(ERROR, "IncA round %d failed: %s; the global model is unchanged", server_round, record.failed)
            return None, None
        dims = sorted(set(joined.dims.values()))
        if dims != [vector.size]:
            raise ValueError(f"nodes report value dimensions {dims}, the model has {vector.size}")
        mixed = self._mix(server_round, pending.grid, joined, vector.size)
        new_arrays = self._certify_charge_and_apply(record, mixed, vector, spec, pending.arrays)
        record.seconds = time.time() - pending.started
        metrics = self._round_metrics(record, mixed)
        self.train_metrics_serverapp[server_round] = metrics
        log(INFO, "\t└──> IncA: epsilon = %.4g (round mu = %.4g), %d/%d finals", record.epsilon, record.mu,
            len(record.finalists), len(record.roster))
        return new_arrays, self._train_metrics(metrics, joined)

    def _join(self, replies: list[Message]) -> _Joined:
        """The nodes that joined: a reply with a public key and the value's dimension."""
        joined = _Joined()
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            if msg.has_error():
                log(INFO, "\t> node %d did not join the round: %s", node,
                    msg.error.reason.splitlines()[0][:200] if msg.error.reason else msg.error.code)
                continue
            recs = msg.content.config_records
            if INCA_KEY not in recs:
                log(WARNING, "\t> node %d replied without IncA data: is its train function registered with "
                    "IncaClient.train()?", node)
                continue
            joined.keys[node] = recs[INCA_KEY]["public-key"]
            joined.dims[node] = int(recs[INCA_KEY]["dim"])
            if self.forward_client_metrics:
                for rec in msg.content.metric_records.values():
                    joined.metrics[node] = rec
        return joined

    def _mix(self, server_round: int, grid: Grid, joined: _Joined, d: int) -> _Mixed:
        """Run the round's mixing through the relay: iterations 1..T, then the final reports."""
        roster = joined.roster
        n = len(roster)
        s_star, s_delta = self._sigmas(n)
        mix = self.mixing
        schedule = InjectionSchedule.resolve(mix.schedule, mix.iterations)
        params = RoundParams(server_round, mix.iterations, min(mix.neighbors, n - 1), s_star, s_delta,
                             schedule, roster, [joined.keys[node] for node in roster], mix.precision)
        relay = RoundRelay(n, mix.iterations, d, schedule, s_star, s_delta, mix.precision)
        counters = {"errors": 0, "malformed": 0, "timeouts": 0}
        has_roster: set[int] = set()  # nodes that keep the roster: their requests omit it

        def exchange(commit: int, requests: list[Request]) -> dict[int, Reply]:
            return self._mix_exchange(grid, params, roster, requests, counters, has_roster)

        def progress(u: int, total: int) -> None:
            online = len(relay.online[u]) if u <= mix.iterations else len(relay.finals)
            what = f"iteration {u}/{mix.iterations}" if u <= mix.iterations else "final report"
            log(INFO, "\t> IncA %s: %d/%d nodes", what, online, n)

        run_iterations(relay, exchange, progress=progress)
        collect_finals(relay, exchange, final_retries=self.relay.final_retries, progress=progress)
        return _Mixed(relay, params, counters)

    def _certify_charge_and_apply(self, record: RoundRecord, mixed: _Mixed, vector: np.ndarray, spec,
                                  arrays: ArrayRecord) -> ArrayRecord | None:
        """Certify and charge the round (its messages were exchanged: its privacy is spent whatever happens
        next), then the new model, or None if the round fails."""
        relay, server_round = mixed.relay, record.round
        trace = relay.trace(meta={"round": server_round})
        record.trace, record.finalists = trace, sorted(relay.finals)
        if self.persistence.trace_path is not None:
            trace.save(self.persistence.trace_path / f"round-{server_round:04d}.json")
        record.mu, record.epsilon = self._certify_and_spend(trace, server_round)
        estimate = relay.estimate()
        record.noise_std, lost_finals = self._noise_check(trace, record.finalists, record.roster)
        if estimate is None or len(relay.finals) < self.mixing.min_finalists:
            record.failed = (f"only {len(relay.finals)} final message(s) reported "
                             f"(min_finalists = {self.mixing.min_finalists})")
        elif lost_finals:
            record.failed = lost_finals
        if record.failed:
            log(ERROR, "IncA round %d failed: %s; the global model is unchanged", server_round, record.failed)
            return None
        record.update = estimate
        return unflatten_arrays(vector + estimate, spec, keep=arrays)

    def _round_metrics(self, record: RoundRecord, mixed: _Mixed) -> MetricRecord:
        """IncA's server-side metrics of a round that mixed."""
        relay, counters, n = mixed.relay, mixed.counters, len(record.roster)
        return MetricRecord({
            "inca-epsilon": float(record.epsilon), "inca-mu": float(record.mu), "inca-parties": n,
            "inca-finalists": len(relay.finals),
            "inca-online-fraction": float(np.mean([len(o) / n for o in relay.online[1:]])),
            "inca-rejected-payloads": relay.rejected_payloads, "inca-errors": counters["errors"],
            "inca-timeouts": counters["timeouts"], "inca-malformed-replies": counters["malformed"],
            "inca-invalid-replies": relay.invalid_replies, "inca-restores": relay.restores,
            "inca-sigma-star": float(mixed.params.sigma_star),
            "inca-sigma-delta": float(mixed.params.sigma_delta),
            "inca-noise-std": float(record.noise_std), "inca-round-failed": int(bool(record.failed)),
        })

    def _train_metrics(self, server_metrics: MetricRecord, joined: _Joined) -> MetricRecord:
        """What Flower records in ``Result.train_metrics_clientapp``: the forwarded client metrics,
        aggregated, and (deprecated) the server-side metrics."""
        out = _TrainMetrics(dict(server_metrics))
        if self.forward_client_metrics and joined.metrics:
            agg = self.train_metrics_aggr_fn([RecordDict({"metrics": m}) for m in joined.metrics.values()],
                                             self.weighted_by_key)
            for key, value in agg.items():
                out[key] = value
        return out

    # ----------------------------------------------------------------------------- sigmas and privacy
    def _sigmas(self, n: int) -> tuple[float, float]:
        mix, priv = self.mixing, self.privacy
        if not mix.calibrated:
            return float(mix.sigma_star), float(mix.sigma_delta)
        if n not in self.calibrations:
            log(INFO, "IncA: calibrating noise for n = %d parties over %d simulated runs", n,
                priv.calibration_runs)
            self.calibrations[n] = calibrate(
                priv.epsilon, priv.delta, n, iterations=mix.iterations, neighbors=min(mix.neighbors, n - 1),
                collusion=priv.collusion, observed_fraction=priv.observed_fraction,
                dropout=priv.calibration_dropout, schedule=mix.schedule, runs=priv.calibration_runs,
                seed=self.seed, value_sensitivity=priv.sensitivity)
            cal = self.calibrations[n]
            log(INFO, "IncA: sigma_star = %.4g, sigma_delta = %.4g (%.0f%% of runs certified)",
                cal.sigma_star, cal.sigma_delta, 100 * cal.success_fraction)
        cal = self.calibrations[n]
        return cal.sigma_star, cal.sigma_delta

    def _certify(self, trace: ExecutionTrace, seeds: np.random.SeedSequence) -> float:
        """The worst certified mu over ``threat_draws`` adversaries drawn from ``seeds``."""
        priv = self.privacy
        worst = 0.0
        for draw in seeds.spawn(priv.threat_draws):
            seed = _int_seed(draw)
            if priv.observed_fraction is not None:
                view = random_eavesdrop(trace, priv.observed_fraction, seed)
            else:
                view = random_collusion(trace, priv.collusion, seed)
            worst = max(worst, certify(trace, view, value_sensitivity=priv.sensitivity).max_mu)
        return worst

    def _certify_and_spend(self, trace: ExecutionTrace, server_round: int) -> tuple[float, float]:
        """Certify a round whose messages were exchanged and record its cost: ``(mu, epsilon)``.

        The cost is spent whatever happens: without a certificate (an error while certifying) the
        round is recorded as unbounded (mu = inf) before the error surfaces.
        """
        rate = self.privacy.sample_rate
        try:
            mu = self._certify(trace, np.random.SeedSequence(self.seed, spawn_key=(_CERTIFY, server_round)))
        except Exception:
            self.ledger.spend(math.inf, rate, force=True, note=f"round {server_round}: not certified")
            raise
        return mu, self.ledger.spend(mu, rate, force=True, note=f"round {server_round}")

    def _noise_check(self, trace: ExecutionTrace, finalists: list[int],
                     roster: list[int]) -> tuple[float, str]:
        """The update's noise std per coordinate, and why the round must fail ("" if it need not):
        lost final messages that leave more than ``max_noise_inflation`` times the noise."""
        if not finalists:
            return math.inf, ""
        noise = noise_std(trace, finalists)
        missing = sorted(set(trace.steps[-1].online.tolist()) - set(finalists))
        if not missing:
            return noise, ""
        full = noise_std(trace)
        tiny = 1e-12 * max(trace.sigma_star, trace.sigma_delta, 1e-300)  # round-off of exact cancellation
        limit = self.mixing.max_noise_inflation
        if noise + tiny <= limit * (full + tiny):
            return noise, ""
        return noise, (f"the final messages of node(s) {[roster[i] for i in missing]} were lost: the "
                       f"update's noise std is {noise:.3g} per coordinate instead of {full:.3g} "
                       f"(max_noise_inflation = {limit})")

    def predicted_mu(self, n: int) -> float:
        """Predicted cost of a round with n parties: the worst certified mu over ``budget_check_runs``
        simulated executions (cached per n)."""
        if n not in self._predicted:
            mix = self.mixing
            s_star, s_delta = self._sigmas(n)
            config = IncaConfig(iterations=mix.iterations, neighbors=min(mix.neighbors, n - 1),
                                sigma_star=s_star, sigma_delta=s_delta, schedule=mix.schedule,
                                dropout=self.privacy.calibration_dropout)
            root = np.random.SeedSequence(self.seed, spawn_key=(_PREDICT, n))
            runs = root.spawn(self.privacy.budget_check_runs)
            worst = 0.0
            for run in runs:
                execution, threat = run.spawn(2)
                worst = max(worst, self._certify(sample_trace(n, config, seed=_int_seed(execution)), threat))
            self._predicted[n] = worst
        return self._predicted[n]

    # ----------------------------------------------------------------------------- exchanges
    def _send_and_receive(self, grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
        """``Grid.send_and_receive`` with this strategy's poll interval (same semantics: replies in
        arrival order; nodes that did not answer within ``timeout`` are simply absent)."""
        pending = set(grid.push_messages(messages))
        deadline = time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            got = list(grid.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self.relay.poll_interval)
        return replies

    def _mix_exchange(self, grid: Grid, params: RoundParams, roster: list[int], requests: list[Request],
                      counters: dict[str, int], has_roster: set[int]) -> dict[int, Reply]:
        """One mixing exchange: the requests out, the replies that arrived in time back (by party)."""
        messages = []
        for req in requests:
            forwarded = [replace(m, payload=self.relay_payload(params.round, m.sender, m.receiver,
                                                               m.iteration, m.payload))
                         for m in req.incoming]
            data = encode_request(replace(req, incoming=forwarded), params,
                                  with_roster=req.party not in has_roster)
            content = RecordDict({INCA_KEY: ConfigRecord({FIELD: data})})
            messages.append(Message(content, dst_node_id=roster[req.party],
                                    message_type=f"{MessageType.TRAIN}.{MIX_ACTION}"))
        index = {node: i for i, node in enumerate(roster)}
        replies: dict[int, Reply] = {}
        arrived = 0
        for msg in self._send_and_receive(grid, messages, self.relay.exchange_timeout):
            i = index.get(int(msg.metadata.src_node_id))
            if i is None:
                continue
            arrived += 1
            if msg.has_error():
                counters["errors"] += 1
                continue
            record = msg.content.config_records.get(INCA_KEY)
            if record is None or record.get("need-roster"):
                has_roster.discard(i)
                continue
            try:
                replies[i], keeps_roster = decode_reply(record[FIELD], i)
            except (KeyError, ValueError):
                counters["malformed"] += 1
                continue
            if keeps_roster:
                has_roster.add(i)
        counters["timeouts"] += len(requests) - arrived
        return replies

    def relay_payload(self, server_round: int, sender: int, receiver: int, iteration: int,
                      payload: bytes) -> bytes:
        """Hook on every peer payload the relay forwards (identity; subclasses may observe it)."""
        return payload


def _int_seed(seed: np.random.SeedSequence) -> int:
    """A 64-bit integer seed drawn from ``seed`` (for functions that take an int seed)."""
    return int(seed.generate_state(1, dtype=np.uint64)[0])
