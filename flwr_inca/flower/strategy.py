"""``IncaStrategy``: FedAvg's sampling, evaluation and ``start``, with IncA instead of a trusted
aggregator: the server only relays end-to-end encrypted peer messages.

IncA runs inside Flower's own ``Strategy.start``, through the hooks every Flower strategy has:

* ``configure_train`` samples the nodes as FedAvg does, asks the round session whether the round may
  start (its predicted cost must fit the budget left), and sends the global model with the round's IncA
  settings (the *join*);
* the sampled nodes train with *your* train function; each keeps its clipped update and answers with a
  public key only;
* ``aggregate_train`` runs IncA's mixing among the nodes that joined: iterations 1..T relayed through the
  server as encrypted payloads it cannot read, then the final messages (public in the threat model),
  whose weight-tracked average is the new global model.

Every round goes through the :class:`~flwr_inca.privacy.session.RoundSession` of the strategy's ledger
(:mod:`flwr_inca.rounds` for IncA's certificates), the same policy as the simulator's: before the first
message leaves, the ledger durably reserves the most the round can reveal before its finals; before each
iteration is delivered (when that ceiling did not fit the budget: a *guarded* round) and before the
finals are asked for (the pre-final rule), what will then be revealed is certified and reserved; the
round is then charged the exact certificate of what was revealed. A round that would not fit is stopped
before what does not fit leaves, charged what was delivered and skipped (the model kept); training stops
(:class:`IncaBudgetExhausted`) before a round predicted not to fit, after ``max_consecutive_refusals``
refused rounds in a row, or after a round none of whose messages could be delivered. A ServerApp killed
mid-round leaves its reservation in the ledger; the next one to open it charges it.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from logging import DEBUG, ERROR, INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid, PrivacySpent
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from .._checks import check_int
from ..privacy.calibration import NoiseCalibrator
from ..privacy.ledger import LedgerOwnerError, PrivacyLedger
from ..privacy.session import BudgetExhausted, RoundSession
from ..rounds import IncaRounds, choose_iterations, round_target, trace_privacy
from ..settings import build_groups
from .config import CONFIG_GROUPS, MixingConfig, PersistenceConfig, PrivacyTarget, RelayConfig
from .offenders import Offenders
from .round import (
    RelayedRound,
    RoundRecord,
    check_flower_mixing,
    lost_finals_check,
    round_metrics,
    update_check,
)
from .shared import INCA_KEY, flatten_arrays, unflatten_arrays
from .transport import Joined, end_run, join_round

__all__ = ["IncaBudgetExhausted", "IncaStrategy", "RoundRecord"]

class IncaBudgetExhausted(PrivacyBudgetExhausted, BudgetExhausted):
    """Training stops: the next round is predicted not to fit ``max_epsilon`` (raised by
    ``configure_train`` before any node is contacted), or a refused round ended training (raised by
    ``aggregate_train`` after charging it). It is Flower's ``PrivacyBudgetExhausted`` and the session's
    :class:`~flwr_inca.privacy.session.BudgetExhausted` (its attributes), and carries ``arrays``: the
    global model when training stopped."""

    def __init__(self, stop: BudgetExhausted, arrays: ArrayRecord) -> None:
        super().__init__(str(stop))
        self.round, self.epsilon, self.predicted_epsilon = stop.round, stop.epsilon, stop.predicted_epsilon
        self.max_epsilon, self.delta = stop.max_epsilon, stop.delta
        self.started, self.delivered = stop.started, stop.delivered
        self.arrays = arrays


@dataclass
class _Pending:
    """What ``configure_train`` keeps for ``aggregate_train`` of the same round."""

    grid: Grid
    arrays: ArrayRecord
    started: float


class IncaStrategy(FedAvg):
    """Federated averaging without a trusted aggregator (IncA), with per-round exact accounting.

    A drop-in replacement for ``FedAvg`` in a ServerApp that trains with ``strategy.start``: same
    sampling, evaluation and ``Result``, given a ClientApp whose train function is registered with
    ``IncaClient.train()`` (see :class:`flwr_inca.flower.IncaClient`). What differs: the nodes'
    updates are clipped to ``clip_norm`` and averaged by IncA with calibrated noise, so the model is
    differentially private; the server never sees an update; and ``start`` raises
    :class:`IncaBudgetExhausted` when ``max_epsilon`` would be exceeded.

    Args:
        privacy: a :class:`PrivacyTarget` (budget, per-round target, threat).
        mixing: a :class:`MixingConfig` (iterations, noise, when a round fails).
        relay: a :class:`RelayConfig` (timeouts, retries).
        persistence: a :class:`PersistenceConfig` (ledger path, trace directory).
        forward_client_metrics: also aggregate the train metrics nodes report (not protected).
        seed: seeds the server's choices (certification adversaries, budget predictions, calibration);
            None = fresh.
        fraction_train ... evaluate_metrics_aggr_fn: FedAvg's arguments, with FedAvg's meaning.
        **settings: any field of the four groups directly, e.g. ``max_epsilon=1.0, iterations=20,
            ledger_path="ledger.json"`` (not together with that group's object).

    Attributes:
        train_metrics_serverapp: IncA's server-side metrics by round (``inca-epsilon``, ``inca-mu``,
            ``inca-finalists``, ...); Flower's ``Result`` has no field for them.
        rounds: a :class:`RoundRecord` by round; ``ledger``: the :class:`PrivacyLedger`; ``session``: the
            :class:`~flwr_inca.privacy.session.RoundSession` every round goes through.
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
        groups, rest = build_groups(CONFIG_GROUPS, {"privacy": privacy, "mixing": mixing, "relay": relay,
                                                    "persistence": persistence}, settings, "IncaStrategy")
        if rest:
            names = ", ".join(cls.__name__ for cls in CONFIG_GROUPS.values())
            raise TypeError(f"IncaStrategy() got an unexpected keyword argument {next(iter(rest))!r}; the "
                            f"settings are FedAvg's and the fields of {names}")
        self.privacy: PrivacyTarget = groups["privacy"]
        self.mixing: MixingConfig = groups["mixing"]
        self.relay: RelayConfig = groups["relay"]
        self.persistence: PersistenceConfig = groups["persistence"]
        check_flower_mixing(self.mixing)
        if self.mixing.calibrated and self.privacy.round_epsilon is None and self.privacy.max_epsilon is None:
            raise ValueError("give sigma_star and sigma_delta, or a budget to calibrate them for: max_epsilon "
                             "(the total, shared by the rounds) or round_epsilon (per round)")
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
                         arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
                         train_metrics_aggr_fn=train_metrics_aggr_fn,
                         evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        self.forward_client_metrics = bool(forward_client_metrics)
        self.seed = (int(np.random.SeedSequence().entropy) if seed is None
                     else check_int("seed (or None)", seed, 0))
        priv, pers = self.privacy, self.persistence
        # bound to its owner here when ledger_owner is given, else when the first round starts (the
        # default owner is the Flower app, known from the grid)
        self.ledger = PrivacyLedger(pers.ledger_path, delta=priv.delta,
                                    max_epsilon=priv.max_epsilon, accountant=priv.accountant_name,
                                    owner=pers.ledger_owner, shared=pers.share_ledger and pers.ledger_owner is not None)
        self.session = RoundSession(self.ledger, sample_rate=priv.sample_rate,
                                    max_consecutive_refusals=priv.max_consecutive_refusals,
                                    resolution=priv.mu_resolution)
        self.rounds: dict[int, RoundRecord] = {}
        self.train_metrics_serverapp: dict[int, MetricRecord] = {}
        self.num_rounds: int | None = None  # set by start(): the rounds a budget is shared by by default
        self._inca: IncaRounds | None = None
        self._calibrator: NoiseCalibrator | None = None  # the one iterations='auto' calibrated for its choice
        self._pending: dict[int, _Pending] = {}
        self._ended: set[int] = set()  # nodes told that the run is over
        self._warned = False  # the usefulness check was made (before round 1)
        self.offenders = Offenders(self.relay.max_offences)  # offences by node id; barred nodes are not sampled

    # ----------------------------------------------------------------------------- IncA's rounds
    @property
    def inca(self) -> IncaRounds:
        """How this training's rounds are calibrated, predicted and certified (:class:`IncaRounds`)."""
        if self._inca is None:
            if self.mixing.automatic:
                if self.mixing.calibrated and self.mixing.dropout is not None:
                    raise ValueError("iterations='auto' is chosen when the first round starts (for its number "
                                     "of nodes)")
                self._choose_iterations(0)  # given noise or no dropouts expected: the choice needs no n
            self._inca = IncaRounds(self.privacy, self.mixing, seed=self.seed,
                                    value_sensitivity=self.privacy.sensitivity, mu_target=self._round_target(),
                                    calibrator=self._calibrator, log=lambda line: log(INFO, "IncA: %s", line))
        return self._inca

    def _round_target(self) -> float | None:
        rounds = self.privacy.budget_rounds or self.num_rounds
        if self.mixing.calibrated and self.privacy.round_epsilon is None and rounds is None:
            raise ValueError("the rounds the budget is shared by are unknown: give budget_rounds (or "
                             "round_epsilon), or train with strategy.start(num_rounds=...)")
        return round_target(self.privacy, rounds or 1) if self.mixing.calibrated else None

    def _choose_iterations(self, n: int) -> None:
        """``iterations="auto"``: T chosen for ``n`` nodes and the expected dropouts, once, and logged."""
        choice = choose_iterations(self.privacy, self.mixing, n, mu_target=self._round_target(),
                                   value_sensitivity=self.privacy.sensitivity, seed=self.seed,
                                   log=lambda line: log(INFO, "IncA: %s", line))
        self.mixing = replace(self.mixing, iterations=choice.iterations)
        self._calibrator = choice.calibrator
        log(INFO, "IncA: %s", choice.describe(self.mixing.neighbors))

    # ----------------------------------------------------------------------------- summary and start
    def summary(self) -> None:
        super().summary()
        mix, priv = self.mixing, self.privacy
        log(INFO, "\t└──> IncA:")
        iterations = (f"auto (chosen at the first round, at most {mix.max_iterations})"
                      if mix.iterations == "auto" else f"T = {mix.iterations}")
        log(INFO, "\t\t├── iterations %s, neighbours k = %d, schedule %s", iterations, mix.neighbors, mix.schedule)
        if not mix.calibrated:
            log(INFO, "\t\t├── sigma_star = %.4g, sigma_delta = %.4g", mix.sigma_star, mix.sigma_delta)
        elif priv.round_epsilon is not None:
            log(INFO, "\t\t├── noise calibrated for (%.3g, %.1e)-DP per round", priv.round_epsilon, priv.delta)
        else:
            log(INFO, "\t\t├── noise calibrated for the budget's share of %s round(s)",
                priv.budget_rounds or self.num_rounds)
        log(INFO, "\t\t├── clip norm %.4g, value sensitivity %.4g, sample rate %.4g", priv.clip_norm,
            priv.sensitivity, priv.sample_rate)
        budget = "unlimited" if priv.max_epsilon is None else f"{priv.max_epsilon:g}"
        log(INFO, "\t\t└── threat: %s; budget: %s at delta %.1e (%s accountant)", priv.describe_threat(), budget,
            priv.delta, self.ledger.accountant.name)
        self._announce_ledger()

    def _announce_ledger(self) -> None:
        """Where the budget lives and what it has spent: a WARNING when this training resumes spent budget."""
        ledger = self.ledger
        where = ledger.path.resolve() if ledger.path is not None else "memory only"
        if ledger.rounds:
            log(WARNING, "IncA: privacy ledger %s already records %d round(s), epsilon = %.4g: this training "
                "continues that budget (for a fresh one, use another ledger_path)", where, ledger.rounds,
                ledger.epsilon())
        else:
            log(INFO, "IncA: privacy ledger %s (new)", where)

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start`` (same arguments, same ``Result``), with three differences:

        * ``num_rounds`` is also the number of rounds a budget is shared by (unless ``budget_rounds``);
        * afterwards, also when it stops by :class:`IncaBudgetExhausted` or an error, the nodes that took
          part are told the run is over (``query.inca_end``) and remove their data of the run;
        * ``Result.arrays`` is never empty: when no round changed the model, it is the initial model.
        """
        self.num_rounds = check_int("num_rounds", num_rounds, 0)
        try:
            result = super().start(grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds,
                                   timeout=timeout, train_config=train_config, evaluate_config=evaluate_config,
                                   evaluate_fn=evaluate_fn)
        finally:
            self._end_run(grid)
        if len(result.arrays) == 0:
            log(WARNING, "IncA: no round changed the model; Result.arrays is the initial model")
            result.arrays = initial_arrays
        return result

    def _end_run(self, grid: Grid) -> None:
        """Tell the nodes of this strategy's rounds that the run is over (not waiting for nodes that stopped
        answering in the last round they were in: gone, most likely)."""
        answering: dict[int, bool] = {}
        for _, record in sorted(self.rounds.items()):
            finalists = set(record.finalists)
            if record.trace is not None and record.trace.meta.get("finals-collected") is False:
                finalists = set(record.trace.steps[-1].online.tolist())  # answered up to T; no final asked
            for i, node in enumerate(record.roster):
                answering[node] = i in finalists
            for node in record.excluded:
                answering[node] = True  # it replied to the join
        nodes = sorted(node for node, ok in answering.items() if ok and node not in self._ended)
        self._ended.update(nodes)
        end_run(grid, nodes, min(self.relay.exchange_timeout, 15.0), self.relay.poll_interval,
                self.relay.max_poll_interval)

    def privacy_spent(self) -> PrivacySpent:
        """Privacy spent so far (reservations of rounds in progress included), at the target's delta, as
        Flower's DP strategies report it."""
        return PrivacySpent(epsilon=float(self.ledger.epsilon()), delta=self.privacy.delta,
                            num_releases=self.ledger.rounds, accounting_method=self.ledger.accountant.name)

    # ----------------------------------------------------------------------------- join
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """FedAvg's sampling and messages, with the round's IncA settings: the nodes *join* the round.

        Raises :class:`IncaBudgetExhausted` (before contacting any node) if the round may not start.
        """
        messages = list(super().configure_train(server_round, arrays, config, grid))
        admitted = set(self.offenders.admit(server_round, [m.metadata.dst_node_id for m in messages]))
        messages = [m for m in messages if m.metadata.dst_node_id in admitted]  # barred nodes are not sampled
        if not messages:  # fraction_train == 0: no training, as in FedAvg
            return messages
        self._bind_ledger(grid)
        n = max(len(messages), 2)
        try:
            self.check_round(server_round, n)
        except BudgetExhausted as stop:
            log(WARNING, "IncA: %s", stop)
            raise IncaBudgetExhausted(stop, arrays) from None
        if not self.rounds and not self._warned:  # before round 1: would the noise drown the updates?
            self._warned = True
            self._warn_if_useless(n, flatten_arrays(arrays)[0].size)
        inca = ConfigRecord({"round": server_round, "clip-norm": self.privacy.clip_norm,
                             "iterations": self.mixing.iterations, "arrays-key": self.arrayrecord_key,
                             "forward-metrics": self.forward_client_metrics})
        for msg in messages:  # FedAvg's messages share one RecordDict
            msg.content[INCA_KEY] = inca
        self._pending[server_round] = _Pending(grid, arrays, time.time())
        return messages

    def check_round(self, server_round: int, nodes: int, num_rounds: int | None = None) -> None:
        """Whether round ``server_round`` of ``nodes`` nodes may start, as the ledger reads now: raises the
        session's :class:`~flwr_inca.privacy.session.BudgetExhausted` if not; nothing is reserved or charged
        either way. ``configure_train`` makes this check before it contacts any node (first choosing T
        when ``iterations="auto"`` and calibrating for what is left of the budget, as the round will); an
        app can make it before Flower starts, to refuse a run on a spent ledger without starting the engine.
        ``num_rounds``: the rounds the budget is shared by, as ``start(num_rounds=...)`` will set them (needed
        before ``start`` when the noise is calibrated for the budget's share, unless ``budget_rounds``).
        """
        nodes = check_int("nodes", nodes, 2)
        if num_rounds is not None:
            num_rounds = check_int("num_rounds", num_rounds, 1)
            if self.num_rounds not in (None, num_rounds):
                raise ValueError(f"num_rounds = {num_rounds} differs from the {self.num_rounds} rounds start() set")
            self.num_rounds = num_rounds
        if self.mixing.automatic:
            self._choose_iterations(nodes)
        if self.privacy.max_epsilon is not None:  # calibrated for what is left of the budget (spend_budget)
            planned = self.privacy.budget_rounds or self.num_rounds or server_round
            self.ledger.refresh()
            self.inca.spend_what_is_left(self.ledger, planned - server_round + 1, self.privacy.sample_rate,
                                        n=nodes)
        self.session.admit(server_round, predicted_mu=lambda: self.inca.predicted_mu(nodes))

    def _warn_if_useless(self, n: int, dimension: int) -> None:
        rounds = self.privacy.budget_rounds or self.num_rounds or 1
        try:
            why = self.inca.usefulness_warning(n, max(dimension, 1), self.privacy.clip_norm, rounds)
        except Exception as exc:  # noqa: BLE001 - a warning never stops training
            why = ""
            log(DEBUG, "IncA: the usefulness check failed: %s", exc)
        if why:
            log(WARNING, "IncA: %s", why)

    def _bind_ledger(self, grid: Grid) -> None:
        """Claim the ledger for this training (``ledger_owner``, or the Flower app) before the first round:
        a ledger kept for another training is refused, with a one-line error, before any node is
        contacted (unless ``share_ledger``). Another run holding reservations in it is said."""
        if self.ledger.owner is None:
            owner = self.persistence.ledger_owner or _default_ledger_owner(grid)
            try:
                self.ledger.claim(owner, shared=self.persistence.share_ledger)
            except LedgerOwnerError as exc:
                log(ERROR, "IncA: %s", exc)
                raise
        for run in self.ledger.live_runs():
            log(WARNING, "IncA: another run (pid %s on %s) is charging the same ledger %s now: both reserve "
                "against one budget", run.get("pid"), run.get("host"), self.ledger.path)

    # ----------------------------------------------------------------------------- round
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Mix the updates of the nodes that joined (relayed, end to end encrypted), charge the round, and
        return the new model (None if the round failed or was refused) with the nodes' forwarded metrics.
        Raises :class:`IncaBudgetExhausted` (after charging) when a refused round ends training."""
        replies = list(replies)
        pending = self._pending.pop(server_round, None)
        if pending is None:
            if replies:
                raise ValueError(f"round {server_round} was not configured by this strategy's configure_train")
            return None, None  # nothing was sent (fraction_train == 0)
        vector, spec = flatten_arrays(pending.arrays)
        joined = join_round(server_round, replies, vector.size, self.forward_client_metrics)
        record = RoundRecord(server_round, joined.roster, client_metrics=joined.metrics, excluded=joined.excluded)
        self.rounds[server_round] = record
        minimum = self.mixing.min_finalists
        if len(record.roster) < max(2, minimum):
            record.failed = f"only {len(record.roster)} node(s) joined (min_finalists = {minimum})"
            log(ERROR, "IncA round %d failed: %s; the global model is unchanged", server_round, record.failed)
            return None, None
        mixed = RelayedRound(record, pending.grid, joined, vector.size, inca=self.inca, session=self.session,
                             mixing=self.mixing, relay=self.relay, payload_hook=self.relay_payload)
        if mixed.open(self.ledger.path):
            mixed.run()
            mixed.charge()
        else:
            mixed = None
        new_arrays = None
        if mixed is not None:
            if mixed.released:
                new_arrays = self._after_charge(record, "applying the update", None, self._apply, record, mixed,
                                                vector, spec, pending.arrays)
            self._after_charge(record, "saving the trace", None, self._save_trace, record)
            # the round's offences by node id (repeated ones bar the node from later rounds)
            record.offenders = self._after_charge(record, "recording offences", {}, self.offenders.record_round,
                                                  server_round, record.roster, mixed.relay,
                                                  bool(record.failed) and not record.refused)
        forwarded = self._after_charge(record, "aggregating the nodes' train metrics", None, self._train_metrics,
                                       joined)
        record.seconds = time.time() - pending.started
        metrics = self._after_charge(record, "computing IncA's metrics", MetricRecord(), round_metrics, record,
                                     mixed, self.ledger.epsilon(), self.session.refusals)
        self.train_metrics_serverapp[server_round] = metrics
        self._log_round(record)
        if record.charge is not None and record.charge.stop:
            raise IncaBudgetExhausted(self.session.stop(record.charge), pending.arrays)
        return new_arrays, forwarded

    def _apply(self, record: RoundRecord, mixed: RelayedRound, vector: np.ndarray, spec,
               arrays: ArrayRecord) -> ArrayRecord | None:
        """The new model from the final messages, or None (the round fails, the model is kept): too few
        finals, too much uncancelled noise, or an update that is not finite or exceeds the guard."""
        relay = mixed.relay
        estimate = relay.estimate()
        record.noise_std, lost_finals = lost_finals_check(record.trace, record.finalists, record.roster,
                                                          self.mixing.max_noise_inflation)
        if estimate is None or len(relay.finals) < self.mixing.min_finalists:
            record.failed = (f"only {len(relay.finals)} final message(s) reported "
                             f"(min_finalists = {self.mixing.min_finalists})")
        elif lost_finals:
            record.failed = lost_finals
        else:
            record.failed = self.update_check(estimate, record.noise_std)
        if record.failed:
            return None
        record.update = estimate
        return unflatten_arrays(vector + estimate, spec, keep=arrays)

    def update_norm_bound(self, noise_std: float, d: int) -> float:
        """The largest L2 norm an averaged update may have (``max_update_norm``, or its default: 10 times
        ``clip_norm`` plus the expected norm ``sqrt(d) * noise_std`` of the update's noise)."""
        if self.mixing.max_update_norm is not None:
            return float(self.mixing.max_update_norm)
        return 10.0 * (self.privacy.clip_norm + math.sqrt(d) * noise_std)

    def update_check(self, update: np.ndarray, noise_std: float) -> str:
        """Why the averaged update ``update`` (whose noise std per coordinate is ``noise_std``) must not be
        applied ("" if it may be): not finite, or its L2 norm above :meth:`update_norm_bound`."""
        return update_check(update, self.update_norm_bound(noise_std, update.size), self.privacy.clip_norm)

    # ----------------------------------------------------------------------------- after the charge
    def _after_charge(self, record: RoundRecord, what: str, default: Any, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, for a step after the round was charged: an error is logged and recorded (the
        round, its charge and its model stand), and ``default`` is returned instead."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported, never lost
            why = f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            record.post_charge_errors.append(why)
            log(ERROR, "IncA round %d: %s (the round was charged to the ledger; training goes on)", record.round,
                why)
            return default

    def _save_trace(self, record: RoundRecord) -> None:
        if self.persistence.trace_path is None or record.trace is None:
            return
        priv = self.privacy
        record.trace.meta["privacy"] = trace_privacy(
            priv, record.round, certification_seed=self.seed, value_sensitivity=priv.sensitivity,
            sample_rate=priv.sample_rate, accountant=self.ledger.accountant.name, charge=record.charge)
        record.trace.save(self.persistence.trace_path / f"round-{record.round:04d}.json")

    def _log_round(self, record: RoundRecord) -> None:
        """One INFO line per round; the round's other metrics at DEBUG."""
        metrics = self.train_metrics_serverapp[record.round]
        status = ("refused: " + record.failed) if record.refused else ("FAILED: " + record.failed if record.failed
                                                                       else "model updated")
        eps = self.ledger.epsilon()
        log(INFO if not record.failed or record.refused else ERROR,
            "IncA round %d: %d/%d finals, round mu = %.4g, epsilon = %.4g%s; %s", record.round,
            len(record.finalists), len(record.roster), record.mu, eps,
            "" if self.privacy.max_epsilon is None else f" of {self.privacy.max_epsilon:g}", status)
        log(DEBUG, "IncA round %d metrics: %s", record.round, dict(metrics))

    def _train_metrics(self, joined: Joined) -> MetricRecord | None:
        """The nodes' forwarded train metrics, aggregated as FedAvg does (None if none are forwarded)."""
        if not (self.forward_client_metrics and joined.metrics):
            return None
        return self.train_metrics_aggr_fn([RecordDict({"metrics": m}) for m in joined.metrics.values()],
                                          self.weighted_by_key)

    @property
    def rounds_trained(self) -> int:
        """Rounds whose update was applied to the global model."""
        return sum(1 for r in self.rounds.values() if r.update is not None)

    @property
    def rounds_refused(self) -> int:
        """Rounds the privacy budget refused and skipped (charged what they revealed; model unchanged)."""
        return sum(1 for r in self.rounds.values() if r.refused)

    def relay_payload(self, server_round: int, sender: int, receiver: int, iteration: int,
                      payload: bytes) -> bytes:
        """Hook on every peer payload the relay forwards, just before it leaves (identity; subclasses may
        observe it)."""
        return payload


def _default_ledger_owner(grid: Grid) -> str:
    """The training a ledger belongs to when ``ledger_owner`` is not given: the Flower app (its FAB id,
    under ``flwr run``), else the main module (a script or ``python -m``)."""
    try:
        fab_id = grid.run.fab_id
    except Exception:  # noqa: BLE001 - a grid without run information (tests, custom grids)
        fab_id = ""
    if fab_id:
        return fab_id
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None) or os.path.splitext(os.path.basename(getattr(main, "__file__", "") or ""))[0]
    return f"python:{name or 'interactive'}"
