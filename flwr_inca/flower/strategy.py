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

``max_epsilon`` is a hard limit (the *pre-final rule*): the trace of iterations 1..T is certified
before any final message is asked for, as if every final were revealed (an upper bound whatever then
arrives). If charging that would exceed ``max_epsilon``, the finals are never collected: the round
is charged the exact cost of what was observed without them, the model is kept, and the round is
*skipped*: training goes on with the next round's fresh execution (one outlier execution does not end
training). Otherwise the finals are collected and the round is charged the exact cost of those that
arrived. A round starts only if its predicted cost fits; if the most it could cost when stopped before
its finals (:func:`flwr_inca.privacy.prefinal.no_finals_bound`) does not fit as well, it runs *guarded*:
before the relay forwards each iteration's messages, what the adversaries would then have observed is
certified, and the round stops before the first iteration that would not fit, charged what was
delivered, and is skipped too (``reserve_stopped_round``; docs/privacy.md, "The budget guard").
Training stops, by raising :class:`IncaBudgetExhausted` (a ``flwr.serverapp.exception.PrivacyBudgetExhausted``
as Flower's own DP strategies raise, which carries the global model), before a round whose predicted
cost does not fit, after ``max_consecutive_refusals`` refused rounds in a row, after a guarded round
none of whose messages could be delivered, or when (guard off) a refused round's charge went past
``max_epsilon``.
"""

from __future__ import annotations

import math
import os
import re
import sys
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
from ..privacy.budget_check import check_round_budget, predicted_round_mu, prediction_seeds
from ..privacy.calibration import Calibration, calibrate
from ..privacy.ledger import BudgetExceededError, LedgerOwnerError, PrivacyLedger
from ..privacy.prefix import RoundPrefix, padded_trace, prefix_ceilings
from ..privacy.rounds import RoundCertificate, certification_seeds
from ..protocol.config import IncaConfig
from ..protocol.schedules import InjectionSchedule
from ..protocol.trace import ExecutionTrace
from ..protocol.utility import noise_std
from .config import MixingConfig, PersistenceConfig, PrivacyTarget, RelayConfig, build_groups
from .crypto import check_public_key
from .offenders import Offenders
from .relay import Reply, Request, RoundRelay, collect_finals, run_iterations
from .shared import END_ACTION, INCA_KEY, MIX_ACTION, RoundParams, flatten_arrays, unflatten_arrays
from .wire import FIELD, decode_reply, encode_request

__all__ = ["IncaBudgetExhausted", "IncaStrategy", "RoundRecord"]

# the SeedSequences behind the server's random choices: the certification adversaries use
# flwr_inca.privacy.rounds.certification_seeds, the budget predictions flwr_inca.privacy.budget_check.prediction_seeds


class IncaBudgetExhausted(PrivacyBudgetExhausted, BudgetExceededError):
    """A round would take the privacy spent past ``max_epsilon``: training stops.

    Raised by ``configure_train`` before any node is contacted (the next round is predicted not to fit),
    or by ``aggregate_train`` when a round refused by the budget ends training: its certificate before its
    final messages did not fit, so its finals were never collected (``stopped_before_finals``; in a guarded
    round, the messages of an iteration would not fit and were not forwarded: ``delivered_iterations``
    < T), it was charged what was observed, the model is unchanged, and it was the
    ``max_consecutive_refusals``-th refused round in a row (or nothing of it could be delivered, or the
    guard is off and the charge overran the budget). A refused round that does not end training is only
    skipped (``RoundRecord.refused``). Either way it leaves ``Strategy.start``, like Flower's
    ``PrivacyBudgetExhausted`` (which it is; also a :class:`flwr_inca.privacy.BudgetExceededError`).

    Attributes:
        server_round: the round that did not start, or that was stopped before its finals.
        arrays: the global model when training stopped (what ``start`` would have returned).
        epsilon: privacy spent so far, at ``delta`` (the stopped round's charge included).
        predicted_epsilon: what it would have been after the round (``inf`` if the budget was overrun;
            for a round stopped before its finals, its certified cost with every final revealed; NaN
            for a round the budget guard stopped earlier).
        max_epsilon, delta: the budget.
        stopped_before_finals: the round ran (some of) its mixing but was stopped before its final
            messages.
        delivered_iterations: for such a round, the iterations whose messages were delivered: T when
            only the finals were withheld, fewer when the budget guard stopped it mid-round.
    """

    def __init__(self, reason: str, *, server_round: int, arrays: ArrayRecord, epsilon: float,
                 predicted_epsilon: float, max_epsilon: float, delta: float,
                 stopped_before_finals: bool = False, delivered_iterations: int | None = None) -> None:
        super().__init__(reason)
        self.server_round, self.arrays = server_round, arrays
        self.epsilon, self.predicted_epsilon = epsilon, predicted_epsilon
        self.max_epsilon, self.delta = max_epsilon, delta
        self.stopped_before_finals = stopped_before_finals
        self.delivered_iterations = delivered_iterations


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
    refused: bool = False  # the budget refused it: skipped, charged what it revealed, the model unchanged
    client_metrics: dict[int, MetricRecord] = field(default_factory=dict)  # by node id (if forwarded)
    noise_std: float = math.nan  # of the update, per coordinate (inf without finals)
    seconds: float = 0.0
    excluded: dict[int, str] = field(default_factory=dict)  # sampled nodes that did not join, and why
    post_charge_errors: list[str] = field(default_factory=list)  # what failed after the round was charged
    offenders: dict[int, str] = field(default_factory=dict)  # nodes that deviated in the round, and how


@dataclass
class _PendingRound:
    """What ``configure_train`` keeps for ``aggregate_train`` of the same round."""

    grid: Grid
    arrays: ArrayRecord
    started: float
    guarded: bool = False  # run under the budget guard (the no-finals ceiling did not fit)


@dataclass
class _Joined:
    """The nodes that joined a round: their public keys and metrics (by node id), and the sampled nodes
    that did not join, with the reason."""

    keys: dict[int, bytes] = field(default_factory=dict)
    metrics: dict[int, MetricRecord] = field(default_factory=dict)
    excluded: dict[int, str] = field(default_factory=dict)

    @property
    def roster(self) -> list[int]:
        return sorted(self.keys)


@dataclass
class _Mixed:
    """The outcome of a round's relayed mixing."""

    relay: RoundRelay
    params: RoundParams
    counters: dict[str, int]
    prefinal_mu: float | None = None  # certified before the finals (None: not certified yet)
    prefinal_method: str | None = None  # the certificate method(s) behind prefinal_mu
    prefinal_epsilon: float = math.nan  # what the ledger would hold after charging prefinal_mu
    stopped: str = ""  # why the finals were not collected ("" if they were)
    prefix: RoundPrefix | None = None  # the pre-final certificate's factorizations (lost finals reuse them)
    guard: _Guard | None = None  # the budget guard of a guarded round


@dataclass
class _Guard:
    """The budget guard of one round: before the messages of iteration t are delivered, the view of what
    the adversaries will then have observed (iterations 1..t, no finals) must fit the budget.

    ``ceilings[t]`` (:func:`~flwr_inca.privacy.prefix.prefix_ceilings`) bounds that view's cost on any
    execution: while it fits, nothing is certified. ``delivered``: the last iteration whose messages
    were (or may be) delivered; ``cost``: a certified bound on what they revealed (exact when it was
    certified, else the ceiling that fit); ``blocked``: the certificate that did not fit (the round
    stopped before delivering iteration ``delivered + 1``)."""

    ceilings: np.ndarray
    fits: Callable[[float], bool]
    certify_through: Callable[[int], RoundPrefix]  # a RoundPrefix of the trace so far (iterations 1..t)
    delivered: int = 0
    cost: RoundCertificate = field(default_factory=lambda: RoundCertificate(0.0, ()))
    blocked: RoundCertificate | None = None
    checks: int = 0  # exact certifications made

    @property
    def cost_method(self) -> str:
        """How ``cost`` was obtained, for the ledger: ``"ceiling"`` or the certificate's method."""
        return "ceiling" if self.cost.methods == ("ceiling",) else self.cost.method

    def may_deliver(self, t: int) -> bool:
        if self.fits(float(self.ceilings[t])):
            self.delivered, self.cost = t, RoundCertificate(float(self.ceilings[t]), ("ceiling",))
            return True
        self.checks += 1
        prefix = self.certify_through(t)
        cert = prefix.through(t)
        if self.fits(cert.mu):
            self.delivered, self.cost = t, cert
            return True
        # stop: what was delivered (iterations 1..t-1) exactly, from the same factorization, if below the
        # ceiling it was let through with
        self.blocked = cert
        if self.cost.methods == ("ceiling",) and t > 1:
            exact = prefix.through(t - 1)
            if exact.mu < self.cost.mu:
                self.cost = exact
        return False


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
        # bound to its owner here when ledger_owner is given, else when the first round starts (the
        # default owner is the Flower app, known from the grid)
        self.ledger = PrivacyLedger(self.persistence.ledger_path, delta=self.privacy.delta,
                                    max_epsilon=self.privacy.max_epsilon,
                                    accountant=self.privacy.accountant_name,
                                    owner=self.persistence.ledger_owner,
                                    shared=self.persistence.share_ledger and self.persistence.ledger_owner is not None)
        self.calibrations: dict[int, Calibration] = {}
        self.rounds: dict[int, RoundRecord] = {}
        self.train_metrics_serverapp: dict[int, MetricRecord] = {}
        self._predicted: dict[int, float] = {}
        self._pending: dict[int, _PendingRound] = {}
        self._ended: set[int] = set()  # nodes told that the run is over
        self._prefix_ceilings: dict[int, np.ndarray] = {}  # prefix_ceilings by number of parties
        self._stopped_round: int | None = None  # training stopped at this (refused) round: no round after it
        self._stop_reason = ""  # why, in a few words
        self._refusals = 0  # rounds refused by the budget in a row (max_consecutive_refusals)
        self.offenders = Offenders()  # hostile nodes: offences by node id; barred nodes are not sampled

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

    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start`` (same arguments, same ``Result``), with two differences:

        * afterwards, also when it stops by :class:`IncaBudgetExhausted` or an error, the nodes that took
          part are told the run is over (``query.inca_end``) and remove their data of the run;
        * ``Result.arrays`` is never empty: when no round changed the model (``num_rounds=0``, or every
          round failed), it is the initial model, and the log says so (Flower's own ``start`` leaves it
          empty then).
        """
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
        """Tell the nodes of this strategy's rounds that the run is over, so that they remove its data.
        Best effort, and not waiting for nodes that stopped answering in the last round they were in
        (gone, most likely): such a node removes the data later (``IncaClient(stale_after=...)``)."""
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
        if not nodes:
            return
        self._ended.update(nodes)
        content = RecordDict({INCA_KEY: ConfigRecord({"end": True})})
        messages = [Message(content, dst_node_id=node, message_type=f"{MessageType.QUERY}.{END_ACTION}")
                    for node in nodes]
        try:
            replies = self._send_and_receive(grid, messages, min(self.relay.exchange_timeout, 15.0))
        except Exception as exc:  # noqa: BLE001 - the run is over; the nodes clean up later instead
            log(WARNING, "IncA: could not tell the nodes that the run is over: %s", exc)
            return
        done = sum(1 for r in replies if not r.has_error())
        log(INFO, "IncA: run over: %d/%d node(s) removed their round data", done, len(nodes))

    def privacy_spent(self) -> PrivacySpent:
        """Privacy spent so far by the rounds in the ledger, at the target's delta (as Flower's DP
        strategies report it)."""
        return PrivacySpent(epsilon=float(self.ledger.epsilon()), delta=self.privacy.delta,
                            num_releases=self.ledger.rounds, accounting_method=self.ledger.accountant.name)

    # ----------------------------------------------------------------------------- join
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """FedAvg's sampling and messages, with the round's IncA settings: the nodes *join* the round.

        Raises :class:`IncaBudgetExhausted` (before contacting any node) if the round would take the
        privacy spent past ``max_epsilon``.
        """
        messages = list(super().configure_train(server_round, arrays, config, grid))
        # hostile nodes: nodes barred for repeated offences are not sampled (logged)
        admitted = set(self.offenders.admit(server_round, [m.metadata.dst_node_id for m in messages]))
        messages = [m for m in messages if m.metadata.dst_node_id in admitted]
        if not messages:  # fraction_train == 0: no training, as in FedAvg
            return messages
        self._bind_ledger(grid)
        guarded = self._check_budget(server_round, len(messages), arrays)
        inca = ConfigRecord({"round": server_round, "clip-norm": self.privacy.clip_norm,
                             "iterations": self.mixing.iterations, "arrays-key": self.arrayrecord_key,
                             "forward-metrics": self.forward_client_metrics})
        for msg in messages:  # FedAvg's messages share one RecordDict
            msg.content[INCA_KEY] = inca
        self._pending[server_round] = _PendingRound(grid, arrays, time.time(), guarded)
        return messages

    def _bind_ledger(self, grid: Grid) -> None:
        """Claim the ledger for this training (``ledger_owner``, or the Flower app) before the first round:
        a ledger kept for another training is refused, with a one-line error, before any node is
        contacted (unless ``share_ledger``)."""
        if self.ledger.owner is not None:
            return
        owner = self.persistence.ledger_owner or _default_ledger_owner(grid)
        try:
            self.ledger.claim(owner, shared=self.persistence.share_ledger)
        except LedgerOwnerError as exc:
            log(ERROR, "IncA: %s", exc)
            raise

    def _check_budget(self, server_round: int, n: int, arrays: ArrayRecord) -> bool:
        """Raise :class:`IncaBudgetExhausted` unless the round may start: no round was stopped before its
        finals, and the round's predicted cost fits the budget. Returns whether the round runs *guarded*:
        with ``reserve_stopped_round`` (default), when the most it can cost if stopped before its finals
        (``no_finals_bound``) does not fit as well, every iteration's messages are delivered only if what
        the adversaries will then have observed fits (see :class:`_Guard`). Either way a round that
        certifies too costly is stopped in time, and what it is charged fits: the budget is a hard
        limit."""
        budget, delta = self.privacy.max_epsilon, self.privacy.delta
        self.ledger.refresh()  # another process sharing the ledger may have spent
        if budget is None:
            return False
        spent = self.ledger.epsilon()
        if self._stopped_round is not None:
            after = math.inf
            reason = (f"IncA: not starting round {server_round}: training stopped at round {self._stopped_round} "
                      f"({self._stop_reason}); spent: epsilon = {spent:.4g} of max_epsilon = {budget:.4g} "
                      f"(delta = {delta:.1e})")
        else:
            n = max(n, 2)
            check = check_round_budget(self.ledger, server_round, lambda: self.predicted_mu(n),
                                       self.privacy.sample_rate)
            after = check.predicted_epsilon
            if check.fits:
                if not self.privacy.reserve_stopped_round:
                    return False
                ceiling = self.no_finals_mu(n)
                reserved = self.ledger.epsilon_after(ceiling, self.privacy.sample_rate)
                if reserved <= budget:
                    return False
                log(INFO, "IncA: round %d runs guarded: stopped before its finals it could cost up to mu = "
                    "%.4g (epsilon %.4g > max_epsilon = %.4g), so each iteration's messages are delivered "
                    "only if what they reveal fits", server_round, ceiling, reserved, budget)
                return True
            reason = f"IncA: {check.reason}"  # the budget is overrun, or the round's predicted cost does not fit
        log(WARNING, "%s", reason)
        raise IncaBudgetExhausted(reason, server_round=server_round, arrays=arrays, epsilon=spent,
                                  predicted_epsilon=after, max_epsilon=budget, delta=self.privacy.delta)

    # ----------------------------------------------------------------------------- round
    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Mix the updates of the nodes that joined (relayed, end to end encrypted), certify and charge
        the round, and return the new model (None if the round failed) with the round's metrics.

        A round stopped before its final messages (or by the budget guard) because they would have taken the
        privacy spent past ``max_epsilon`` is charged what was observed and skipped (None: the model is kept);
        :class:`IncaBudgetExhausted` is raised (after charging it) if it ends training
        (``max_consecutive_refusals``)."""
        replies = list(replies)
        pending = self._pending.pop(server_round, None)
        if pending is None:
            if replies:
                raise ValueError(f"round {server_round} was not configured by this strategy's "
                                 "configure_train")
            return None, None  # nothing was sent (fraction_train == 0)
        vector, spec = flatten_arrays(pending.arrays)
        joined = self._join(server_round, replies, vector.size)
        record = RoundRecord(server_round, joined.roster, client_metrics=joined.metrics, excluded=joined.excluded)
        self.rounds[server_round] = record
        minimum = self.mixing.min_finalists
        if len(record.roster) < max(2, minimum):
            record.failed = f"only {len(record.roster)} node(s) joined (min_finalists = {minimum})"
            log(ERROR, "IncA round %d failed: %s; the global model is unchanged", server_round, record.failed)
            return None, None
        mixed = self._mix(server_round, pending.grid, joined, vector.size, guarded=pending.guarded)
        # the messages were exchanged: the round's privacy is spent. Charge it first; nothing after the
        # charge may lose it or the new model: what fails there is logged and counted
        # (inca-post-charge-errors), and the round goes on
        self._certify_and_charge(record, mixed)
        record.refused = bool(mixed.stopped)
        self._refusals = self._refusals + 1 if record.refused else 0  # a round charged in full resets it
        if mixed.stopped:
            record.failed = mixed.stopped
            new_arrays = None
        else:
            new_arrays = self._after_charge(record, "applying the update", None,
                                            self._apply, record, mixed, vector, spec, pending.arrays)
        self._after_charge(record, "saving the trace", None, self._save_trace, record)
        # hostile nodes: the round's offences by node id (repeated ones bar the node from later rounds)
        record.offenders = self._after_charge(record, "recording offences", {}, self.offenders.record_round,
                                              server_round, record.roster, mixed.relay,
                                              bool(record.failed) and not record.refused)
        record.seconds = time.time() - pending.started
        metrics = self._after_charge(record, "computing IncA's metrics", None, self._round_metrics, record, mixed)
        forwarded = self._after_charge(record, "aggregating the nodes' train metrics", None,
                                       self._train_metrics, joined)
        if metrics is None:
            metrics = MetricRecord({"inca-epsilon": float(record.epsilon), "inca-mu": float(record.mu)})
        metrics["inca-post-charge-errors"] = len(record.post_charge_errors)
        metrics["inca-stopped-before-finals"] = int(bool(mixed.stopped))
        metrics["inca-round-refused"] = int(record.refused)
        metrics["inca-consecutive-refusals"] = self._refusals
        self.train_metrics_serverapp[server_round] = metrics
        log(INFO, "\t└──> IncA: epsilon = %.4g (round mu = %.4g), %d/%d finals", record.epsilon, record.mu,
            len(record.finalists), len(record.roster))
        if mixed.stopped:
            self._refused_round(record, mixed, pending.arrays)  # skipped, or raises: training stops
        return new_arrays, _client_side_metrics(metrics, forwarded)

    def _refused_round(self, record: RoundRecord, mixed: _Mixed, arrays: ArrayRecord) -> None:
        """After a round the budget refused (stopped before its finals or by the guard; already charged what it
        revealed): the round is skipped and training goes on, or training stops (raising
        :class:`IncaBudgetExhausted`) when this is the ``max_consecutive_refusals``-th refusal in a row, when
        none of its messages could be delivered, or when (guard off) its charge overran ``max_epsilon``.
        Whether training goes on depends only on the round's trace and the ledger (docs/privacy.md)."""
        budget = float(self.privacy.max_epsilon)  # a round is stopped only under a budget
        guard = mixed.guard
        delivered = self.mixing.iterations
        if guard is not None and guard.blocked is not None:
            delivered = guard.delivered
            what = (f"IncA: round {record.round} stopped by the budget guard before delivering the messages "
                    f"of iteration {delivered + 1} of {self.mixing.iterations}: what the adversaries would "
                    f"then have observed is certified at mu = {guard.blocked.mu:.4g}, more than the budget "
                    f"left (max_epsilon = {budget:.4g}, delta = {self.privacy.delta:.1e}). The round was "
                    f"charged what iterations 1..{delivered} revealed (mu = {record.mu:.4g}), epsilon is now "
                    f"{record.epsilon:.4g}; the global model is unchanged")
        else:
            what = (f"IncA: round {record.round} stopped before its final messages: certified before them, "
                    f"it would have brought epsilon to {mixed.prefinal_epsilon:.4g} > max_epsilon = "
                    f"{budget:.4g} (delta = {self.privacy.delta:.1e}). The finals were not collected; the "
                    f"round was charged what was observed without them (mu = {record.mu:.4g}), epsilon is "
                    f"now {record.epsilon:.4g}; the global model is unchanged")
        cap = self.privacy.max_consecutive_refusals
        if record.epsilon > budget:  # only with the guard off: what was observed is still charged
            log(ERROR, "IncA: max_epsilon = %.4g exceeded: epsilon = %.4g after round %d, stopped before its "
                "finals with the budget guard off (reserve_stopped_round=False)", budget, record.epsilon,
                record.round)
            why = "max_epsilon was exceeded with the budget guard off (reserve_stopped_round=False)"
        elif delivered == 0:
            why = ("none of its messages could be delivered: the budget left does not afford the first "
                   "iteration of a round")
        elif self._refusals >= cap:
            why = (f"{self._refusals} round(s) in a row were refused by the budget (max_consecutive_refusals "
                   f"= {cap})")
        else:
            log(WARNING, "%s. The round is skipped and training goes on with the next round (%d refused in a "
                "row; training stops at max_consecutive_refusals = %d)", what, self._refusals, cap)
            return
        self._stopped_round, self._stop_reason = record.round, why
        reason = f"{what}. Training stops: {why}"
        log(WARNING, "%s", reason)
        raise IncaBudgetExhausted(reason, server_round=record.round, arrays=arrays, epsilon=record.epsilon,
                                  predicted_epsilon=mixed.prefinal_epsilon, max_epsilon=budget,
                                  delta=self.privacy.delta, stopped_before_finals=True,
                                  delivered_iterations=delivered)

    @property
    def rounds_trained(self) -> int:
        """Rounds whose update was applied to the global model."""
        return sum(1 for r in self.rounds.values() if r.update is not None)

    @property
    def rounds_refused(self) -> int:
        """Rounds the privacy budget refused and skipped (charged what they revealed; model unchanged)."""
        return sum(1 for r in self.rounds.values() if r.refused)

    def _after_charge(self, record: RoundRecord, what: str, default: Any, fn: Callable[..., Any],
                      *args: Any) -> Any:
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

    def _join(self, server_round: int, replies: list[Message], d: int) -> _Joined:
        """The nodes that joined: a reply with a valid X25519 public key and a value of the model's
        dimension ``d``. Any other reply excludes its node from the round (logged by node id), never the
        round: a node cannot stop training or break the roster for the others."""
        joined = _Joined()
        for msg in replies:
            node = int(msg.metadata.src_node_id)
            if msg.has_error():
                joined.excluded[node] = "error: " + _error_summary(msg.error.reason, msg.error.code)
                log(INFO, "\t> node %d did not join round %d: %s", node, server_round, joined.excluded[node])
                continue
            recs = msg.content.config_records
            if INCA_KEY not in recs:
                joined.excluded[node] = "no IncA data in its reply"
                log(WARNING, "\t> node %d replied without IncA data: is its train function registered with "
                    "IncaClient.train()?", node)
                continue
            why = _join_problem(recs[INCA_KEY], d)
            if why:
                joined.excluded[node] = why
                log(WARNING, "\t> node %d excluded from round %d: %s", node, server_round, why)
                continue
            joined.keys[node] = recs[INCA_KEY]["public-key"]
            if self.forward_client_metrics:
                for rec in msg.content.metric_records.values():
                    joined.metrics[node] = rec
        by_key: dict[bytes, list[int]] = {}
        for node, key in joined.keys.items():
            by_key.setdefault(key, []).append(node)
        for nodes in (v for v in by_key.values() if len(v) > 1):  # a copied key: who is the culprit?
            for node in nodes:
                joined.excluded[node] = f"its public key is also the key of node(s) {[m for m in nodes if m != node]}"
                log(WARNING, "\t> node %d excluded from round %d: %s", node, server_round, joined.excluded[node])
                del joined.keys[node]
                joined.metrics.pop(node, None)
        return joined

    def _mix(self, server_round: int, grid: Grid, joined: _Joined, d: int, guarded: bool = False) -> _Mixed:
        """Run the round's mixing through the relay: iterations 1..T, the certificate before the finals,
        then the final reports, unless that certificate does not fit the budget (``stopped``). A guarded
        round (see :meth:`_check_budget`) also stops before delivering an iteration's messages if what
        they would reveal does not fit."""
        roster = joined.roster
        n = len(roster)
        s_star, s_delta = self._sigmas(n)
        mix = self.mixing
        schedule = InjectionSchedule.resolve(mix.schedule, mix.iterations)
        params = RoundParams(server_round, mix.iterations, min(mix.neighbors, n - 1), s_star, s_delta,
                             schedule, roster, [joined.keys[node] for node in roster], mix.precision)
        relay = RoundRelay(n, mix.iterations, d, schedule, s_star, s_delta, mix.precision,
                           neighbors=params.neighbors, roster=roster)  # hostile nodes: commits checked
        counters = {"errors": 0, "malformed": 0, "timeouts": 0}
        has_roster: set[int] = set()  # nodes that keep the roster: their requests omit it

        def exchange(commit: int, requests: list[Request]) -> dict[int, Reply]:
            return self._mix_exchange(grid, params, roster, requests, counters, has_roster)

        def progress(u: int, total: int) -> None:
            online = len(relay.online[u]) if u <= mix.iterations else len(relay.finals)
            what = f"iteration {u}/{mix.iterations}" if u <= mix.iterations else "final report"
            log(INFO, "\t> IncA %s: %d/%d nodes", what, online, n)

        mixed = _Mixed(relay, params, counters)
        rate = self.privacy.sample_rate
        if guarded:
            mixed.guard = self._guard(server_round, relay)
        try:
            delivered = run_iterations(relay, exchange, progress=progress,
                                       may_deliver=None if mixed.guard is None else mixed.guard.may_deliver)
        except BaseException:
            # messages were delivered: charge a bound on what they revealed before the error surfaces
            # (the guard's, else the ceiling over every execution)
            guard = mixed.guard
            mu = guard.cost.mu if guard is not None else self.no_finals_mu(n)
            self.ledger.spend(mu, rate, force=True, method=None if guard is None else guard.cost_method,
                              note=f"round {server_round}: mixing failed (bound on what was delivered charged)")
            raise
        if delivered < mix.iterations:
            guard = mixed.guard
            mixed.stopped = (f"the messages of iteration {delivered + 1} would reveal mu = "
                             f"{guard.blocked.mu:.4g}, taking epsilon past max_epsilon = "
                             f"{self.privacy.max_epsilon:.4g}: they were not delivered (budget guard)")
            log(WARNING, "IncA round %d: %s", server_round, mixed.stopped)
            return mixed
        # the pre-final rule: certify iterations 1..T as if every final were revealed, before any is
        self._certify_before_finals(server_round, mixed)
        if mixed.stopped:
            log(WARNING, "IncA round %d: %s", server_round, mixed.stopped)
            return mixed
        try:
            collect_finals(relay, exchange, final_retries=self.relay.final_retries, progress=progress)
        except BaseException:
            # some finals may have been revealed: charge the bound that holds whatever arrived
            self.ledger.spend(float(mixed.prefinal_mu), self.privacy.sample_rate, force=True,
                              note=f"round {server_round}: final exchange failed (pre-final bound charged)",
                              method=mixed.prefinal_method)
            raise
        return mixed

    def _certify_before_finals(self, server_round: int, mixed: _Mixed) -> None:
        """Certify the round before its finals (``mixed.prefinal_mu``, every final counted as revealed) and
        decide whether they may be collected (``mixed.stopped`` says why not). Its messages up to T were
        exchanged: without a certificate the round is charged as unbounded before the error surfaces."""
        rate = self.privacy.sample_rate
        try:
            trace = mixed.relay.trace(meta={"round": server_round})
            mixed.prefix = self._round_prefix(trace, self._certify_seeds(server_round))
            cert = mixed.prefix.with_finals(None)
        except Exception:
            guard = mixed.guard
            mu = math.inf if guard is None else guard.cost.mu  # a guarded round: what was delivered fit
            self.ledger.spend(mu, rate, force=True, note=f"round {server_round}: not certified",
                              method=None if guard is None else guard.cost_method)
            raise
        mu = mixed.prefinal_mu = cert.mu
        mixed.prefinal_method = cert.method
        budget = self.privacy.max_epsilon
        if budget is None:
            return
        self.ledger.refresh()  # another process sharing the ledger may have spent during the mixing
        mixed.prefinal_epsilon = self.ledger.epsilon_after(mu, rate)
        if not mixed.prefinal_epsilon <= budget:
            mixed.stopped = (f"its final messages would bring epsilon to {mixed.prefinal_epsilon:.4g} > "
                             f"max_epsilon = {budget:.4g} (certified before them: mu = {mu:.4g}); they are "
                             "not collected")

    def _certify_and_charge(self, record: RoundRecord, mixed: _Mixed) -> None:
        """Certify what the round revealed and charge it to the ledger (``record.mu``, ``record.epsilon``):
        the final messages that arrived (none if the round was stopped before them). Its messages were
        exchanged, so its privacy is spent whatever happens next: without a certificate the round is
        charged as unbounded (mu = inf) before the error surfaces."""
        server_round, relay = record.round, mixed.relay
        guard = mixed.guard
        if guard is not None and guard.blocked is not None:  # stopped by the guard: charge what was delivered
            note = (f"round {server_round}: stopped by the budget guard before delivering the messages of "
                    f"iteration {guard.delivered + 1}")
            record.mu = guard.cost.mu
            record.epsilon = self.ledger.spend(record.mu, self.privacy.sample_rate, force=True, note=note,
                                               method=guard.cost_method)
            record.trace = self._after_charge(record, "recording the trace", None, _guarded_trace, relay,
                                              guard.delivered, server_round)
            return
        try:
            trace = relay.trace(meta={"round": server_round})
        except Exception:
            self.ledger.spend(math.inf, self.privacy.sample_rate, force=True,
                              note=f"round {server_round}: no trace")
            raise
        if mixed.stopped:
            trace.meta["finals-collected"] = False  # meta["finalists"] is [], none was asked for
        record.trace, record.finalists = trace, sorted(relay.finals)
        record.mu, record.epsilon = self._certify_and_spend(trace, server_round, mixed.prefinal_mu,
                                                            record.finalists, mixed.prefinal_method, mixed.prefix)

    def _apply(self, record: RoundRecord, mixed: _Mixed, vector: np.ndarray, spec,
               arrays: ArrayRecord) -> ArrayRecord | None:
        """The new model from the final messages, or None (the round fails, the model is kept): too few
        finals, too much uncancelled noise, or an update that is not finite or exceeds the guard."""
        relay, server_round = mixed.relay, record.round
        estimate = relay.estimate()
        record.noise_std, lost_finals = self._noise_check(record.trace, record.finalists, record.roster)
        if estimate is None or len(relay.finals) < self.mixing.min_finalists:
            record.failed = (f"only {len(relay.finals)} final message(s) reported "
                             f"(min_finalists = {self.mixing.min_finalists})")
        elif lost_finals:
            record.failed = lost_finals
        else:
            record.failed = self._update_check(estimate, record.noise_std)
        if record.failed:
            log(ERROR, "IncA round %d failed: %s; the global model is unchanged", server_round, record.failed)
            return None
        record.update = estimate
        return unflatten_arrays(vector + estimate, spec, keep=arrays)

    def update_norm_bound(self, noise_std: float, d: int) -> float:
        """The largest L2 norm an averaged update may have (``max_update_norm``, or its default: 10 times
        ``clip_norm`` plus the expected norm ``sqrt(d) * noise_std`` of the update's noise)."""
        if self.mixing.max_update_norm is not None:
            return float(self.mixing.max_update_norm)
        return 10.0 * (self.privacy.clip_norm + math.sqrt(d) * noise_std)

    def _update_check(self, update: np.ndarray, noise_std: float) -> str:
        """Why the averaged update must not be applied ("" if it may be)."""
        if not np.all(np.isfinite(update)):
            return "the averaged update is not finite"
        with np.errstate(over="ignore"):
            norm = float(np.linalg.norm(update))
        bound = self.update_norm_bound(noise_std, update.size)
        if not norm <= bound:
            return (f"the averaged update has L2 norm {norm:.4g} > max_update_norm = {bound:.4g} (an honest "
                    f"round stays far below: updates are clipped to {self.privacy.clip_norm:g}); a node may "
                    "have sent a corrupted final message")
        return ""

    def _save_trace(self, record: RoundRecord) -> None:
        if self.persistence.trace_path is not None and record.trace is not None:
            record.trace.save(self.persistence.trace_path / f"round-{record.round:04d}.json")

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
            "inca-excluded-nodes": len(record.excluded),
        })

    def _train_metrics(self, joined: _Joined) -> MetricRecord | None:
        """The nodes' forwarded train metrics, aggregated as FedAvg does (None if none are forwarded)."""
        if not (self.forward_client_metrics and joined.metrics):
            return None
        return self.train_metrics_aggr_fn([RecordDict({"metrics": m}) for m in joined.metrics.values()],
                                          self.weighted_by_key)

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

    def _certify(self, trace: ExecutionTrace, seeds: np.random.SeedSequence,
                 finals: list[int] | None = None) -> float:
        """The worst certified mu over ``threat_draws`` adversaries drawn from ``seeds``, observing the final
        messages of ``finals`` (None: of every party online at T); see
        :class:`flwr_inca.privacy.prefix.RoundPrefix` (the simulator certifies with it too)."""
        return self._certify_round(trace, seeds, finals).mu

    def _certify_round(self, trace: ExecutionTrace, seeds: np.random.SeedSequence,
                       finals: list[int] | None = None) -> RoundCertificate:
        """:meth:`_certify` with the certificate method(s) that gave the mu (for the ledger): the adversaries
        of :func:`flwr_inca.privacy.rounds.certify_round`, computed as the pre-final rule does
        (:meth:`_round_prefix`; mu rounded up by 1e-9 relative), so every charge comes from one method."""
        return self._round_prefix(trace, seeds).with_finals(finals)

    def _certify_seeds(self, server_round: int) -> np.random.SeedSequence:
        return certification_seeds(self.seed, server_round)

    def _round_prefix(self, trace: ExecutionTrace, seeds: np.random.SeedSequence) -> RoundPrefix:
        """The round's adversaries (the same as :meth:`_certify_round`'s), each factorized once: the cost
        with any subset of the finals and of any prefix (:class:`flwr_inca.privacy.prefix.RoundPrefix`)."""
        priv = self.privacy
        return RoundPrefix(trace, seeds, priv.threat_draws, collusion=priv.collusion,
                           observed_fraction=priv.observed_fraction, value_sensitivity=priv.sensitivity)

    def _guard(self, server_round: int, relay: RoundRelay) -> _Guard:
        """The budget guard of a guarded round on ``relay``."""
        n, rate, budget = relay.n, self.privacy.sample_rate, float(self.privacy.max_epsilon)
        seeds = self._certify_seeds(server_round)

        def fits(mu: float) -> bool:
            self.ledger.refresh()  # another process sharing the ledger may have spent
            return self.ledger.epsilon_after(mu, rate) <= budget

        def certify_through(t: int) -> RoundPrefix:
            return self._round_prefix(_trace_through(relay, t), seeds)

        return _Guard(self.prefix_ceilings(n), fits, certify_through)

    def _certify_and_spend(self, trace: ExecutionTrace, server_round: int, prefinal_mu: float | None = None,
                           finals: list[int] | None = None, prefinal_method: str | None = None,
                           prefix: RoundPrefix | None = None) -> tuple[float, float]:
        """Certify a round whose messages were exchanged and record its cost: ``(mu, epsilon)``.

        ``finals``: the parties whose final messages were revealed (None: every party online at T);
        ``prefinal_mu``: the round's certificate with every final revealed, if already known. Fewer finals
        are certified anew; both certificates bound what was observed, and the smaller is charged (so
        the charge never exceeds the pre-final one, which the budget was checked against). ``prefix``: the
        pre-final certificate's factorizations, if kept: fewer finals then cost a small solve each.

        The cost is spent whatever happens: without a certificate (an error while certifying) the
        round is recorded as unbounded (mu = inf), or at its pre-final bound if known, before the error
        surfaces. The ledger entry records the certificate method that gave the charged mu
        (``"exact"``, ``"bound"``, or ``"exact+bound"`` when the round's adversaries needed both).
        """
        rate = self.privacy.sample_rate
        seeds = self._certify_seeds(server_round)
        online = trace.steps[-1].online.tolist()
        partial = finals is not None and sorted(finals) != sorted(online)
        note = f"round {server_round}"
        if partial:
            note += (": stopped before its final messages" if not finals
                     else f": {len(finals)} of {len(online)} final messages revealed")
        try:
            if prefix is None and (prefinal_mu is None or partial):
                prefix = self._round_prefix(trace, seeds)  # one factorization serves both certificates
            if prefinal_mu is None:
                pre = prefix.with_finals()
                prefinal_mu, prefinal_method = pre.mu, pre.method
            mu, method = prefinal_mu, prefinal_method
            if partial:
                observed = prefix.with_finals(finals)
                if observed.mu < prefinal_mu:
                    mu, method = observed.mu, observed.method
        except Exception:
            bound = math.inf if prefinal_mu is None else prefinal_mu
            self.ledger.spend(bound, rate, force=True, note=f"{note}: not certified",
                              method=None if prefinal_mu is None else prefinal_method)
            raise
        return mu, self.ledger.spend(mu, rate, force=True, note=note, method=method)

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

    def prefix_ceilings(self, n: int) -> np.ndarray:
        """(T+1,) the most the messages of iterations 1..t can reveal on any execution of n parties, t = 0..T
        (:func:`flwr_inca.privacy.prefix.prefix_ceilings` at this round's sigmas; cached per n)."""
        if n not in self._prefix_ceilings:
            s_star, s_delta = self._sigmas(n)
            schedule = InjectionSchedule.resolve(self.mixing.schedule, self.mixing.iterations)
            self._prefix_ceilings[n] = prefix_ceilings(schedule, s_star, s_delta, self.privacy.sensitivity)
        return self._prefix_ceilings[n]

    def no_finals_mu(self, n: int) -> float:
        """The most a round of n parties can cost if stopped before its final messages, on any execution
        (:func:`flwr_inca.privacy.prefinal.no_finals_bound` at this round's sigmas: the last of
        :meth:`prefix_ceilings`)."""
        return float(self.prefix_ceilings(n)[-1])

    def predicted_mu(self, n: int) -> float:
        """Predicted cost of a round with n parties: the worst certified mu over ``budget_check_runs``
        simulated executions (cached per n)."""
        if n not in self._predicted:
            mix, priv = self.mixing, self.privacy
            s_star, s_delta = self._sigmas(n)
            config = IncaConfig(iterations=mix.iterations, neighbors=min(mix.neighbors, n - 1),
                                sigma_star=s_star, sigma_delta=s_delta, schedule=mix.schedule,
                                dropout=priv.calibration_dropout)
            self._predicted[n] = predicted_round_mu(
                n, config, prediction_seeds(self.seed, n), priv.budget_check_runs, threat_draws=priv.threat_draws,
                collusion=priv.collusion, observed_fraction=priv.observed_fraction,
                value_sensitivity=priv.sensitivity)
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
            except (KeyError, ValueError) as exc:
                counters["malformed"] += 1
                replies[i] = Reply(i, invalid=f"malformed reply: {exc}")  # hostile nodes: an offence
                continue
            if keeps_roster:
                has_roster.add(i)
        counters["timeouts"] += len(requests) - arrived
        return replies

    def relay_payload(self, server_round: int, sender: int, receiver: int, iteration: int,
                      payload: bytes) -> bytes:
        """Hook on every peer payload the relay forwards (identity; subclasses may observe it)."""
        return payload


def _trace_through(relay: RoundRelay, t: int) -> ExecutionTrace:
    """The trace of ``relay``'s iterations 1..``t`` as committed, the later ones exchanging nothing: its
    prefix certificates through ``t`` are those of the round however it continues."""
    steps = [relay.step(u) for u in range(1, t + 1)]
    return padded_trace(relay.n, steps, relay.T, relay.schedule, relay.sigma_star, relay.sigma_delta)


def _guarded_trace(relay: RoundRelay, delivered: int, server_round: int) -> ExecutionTrace:
    """The trace of a round the guard stopped after delivering the messages of iterations 1..``delivered``:
    the iterations committed so far, the later ones exchanging nothing (``meta["delivered-iterations"]``
    says where the real ones end)."""
    trace = _trace_through(relay, delivered + 1)
    trace.meta.update({"round": server_round, "finalists": [], "finals-collected": False,
                       "delivered-iterations": delivered})
    return trace


def _client_side_metrics(server_metrics: MetricRecord, forwarded: MetricRecord | None) -> _TrainMetrics:
    """What Flower records in ``Result.train_metrics_clientapp``: the forwarded client metrics and
    (deprecated there) IncA's server-side metrics."""
    out = _TrainMetrics(dict(server_metrics))
    for key, value in (forwarded or {}).items():
        out[key] = value
    return out


def _error_summary(reason: str | None, code: int) -> str:
    """One line of a node's error reply. Flower writes ``<class 'ValueError'>:<'message'>``, and wraps an
    exception in the train function as ``... ClientAppException occurred. Message: message`` (after the
    Ray traceback, in a simulation): the message is what says what went wrong."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", reason or "")
    wrapped = re.findall(r"occurred\. Message: ([^\n]*)", text)
    plain = re.match(r"<class '([\w.]+)'>:<'([^\n]*)", text)
    if wrapped:
        line = wrapped[-1]
    elif plain:
        line = f"{plain.group(1).rsplit('.', 1)[-1]}: {plain.group(2)}"
    else:
        line = next((x.strip() for x in text.splitlines() if x.strip()), f"error code {code}")
    line = line.removesuffix("'>")
    return line[:300]


def _join_problem(reply: ConfigRecord, d: int) -> str:
    """Why a join reply is unusable ("" if it is fine): a missing or invalid public key, or a value whose
    dimension is not the model's."""
    if "public-key" not in reply:
        return "its join reply has no public key"
    try:
        check_public_key(reply["public-key"])
    except ValueError as exc:
        return str(exc)
    dim = reply.get("dim")
    if isinstance(dim, bool) or not isinstance(dim, int):
        return f"its join reply has no integer 'dim', got {dim!r}"
    if dim != d:
        return f"it reports a value of dimension {dim}, the model has {d}"
    return ""


def _default_ledger_owner(grid: Grid) -> str:
    """The training a ledger belongs to when ``ledger_owner`` is not given: the Flower app (its FAB id,
    under ``flwr run``), else the main module (``run_simulation`` from a script or ``python -m``)."""
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
