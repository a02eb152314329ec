"""``IncaStrategy``: FedAvg's drop-in replacement where the server only relays encrypted peer messages.

Per round: the sampled nodes train with *your* train function; each keeps its clipped update and
answers with a public key only. The nodes then run IncA's mixing for ``iterations`` exchanges through
this ServerApp, which routes end-to-end encrypted payloads it cannot read; the new global model is the
weight-tracked average of the final messages (public in the threat model). Every round's execution
trace is certified exactly under the configured threat model, added to a persistent privacy ledger,
and reported as ``inca-epsilon`` in the round's metrics; training stops before a round that would
exceed ``max_epsilon``.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from logging import ERROR, INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info, sample_nodes
from flwr.supercore import log

from ..protocol.config import IncaConfig
from ..protocol.dropout import DropoutModel
from ..protocol.engine import sample_trace
from ..protocol.schedules import InjectionSchedule
from ..protocol.trace import ExecutionTrace
from ..protocol.utility import noise_std
from ..privacy.calibration import Calibration, calibrate
from ..privacy.certificate import certify
from ..privacy.ledger import PrivacyLedger
from ..privacy.views import random_collusion, random_eavesdrop
from .client import INCA_KEY, MIX_ACTION, flatten_arrays, unflatten_arrays
from .node import RoundParams
from .relay import Reply, Request, RoundRelay, drive
from .wire import FIELD, decode_reply, encode_request

__all__ = ["IncaStrategy", "RoundRecord"]


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
    seconds: float = 0.0


class IncaStrategy(FedAvg):
    """Federated averaging without a trusted aggregator (IncA), with per-round exact accounting.

    Args (beyond FedAvg's sampling arguments):
        iterations: IncA mixing iterations T per round (one exchange each).
        neighbors: out-neighbours k each node picks per iteration (with its own randomness).
        sigma_star, sigma_delta: noise levels in update units; if both are None they are calibrated
            for (``epsilon``, ``delta``) per round against the configured threat.
        epsilon, delta: per-round target used for calibration; ``delta`` is also the delta at which
            the ledger reports epsilon.
        max_epsilon: total budget; training stops before a round that would exceed it.
        clip_norm: L2 bound C applied to each node's update (party-level DP).
        value_sensitivity: how much one protected unit can change a node's value; default 2C
            (party-level, replace-one). For record-level DP give the per-record sensitivity of your
            local step (e.g. lr * C_example / expected batch size) and its ``sample_rate``.
        sample_rate: Poisson sampling rate of the protected unit per round (record-level DP).
        accountant: "gdp" (exact, default without subsampling), "rdp" or "prv" (default with).
        collusion: fraction rho of corrupted nodes certified against (random sets, ``threat_draws``
            draws, worst kept); or ``observed_fraction`` for Eavesdrop DP.
        min_finalists: a round fails (model unchanged) if fewer nodes report final messages.
        max_noise_inflation: a node online at the last iteration whose final message is lost takes
            its share of the others' cancelling noise with it; the round fails (model unchanged) if
            that makes the noise of the update more than this factor larger than with every final
            (reported as ``inca-noise-std``, per coordinate).
        exchange_timeout: seconds to wait for the nodes in each mixing exchange.
        poll_interval: seconds between polls for replies (Flower's ``send_and_receive`` polls every
            0.1 s; IncA makes T + 2 exchanges per round, so it polls faster).
        precision: of the peer messages, "float32" (default: the precision of the model, and the
            bandwidth of FedAvg) or "float64" (exact arithmetic, twice the bytes).
        ledger_path: where the privacy ledger is persisted (None: memory only); a restarted
            ServerApp resumes the budget it spent.
        trace_dir: if set, each round's ``inca-trace/1`` is saved there.
        forward_client_metrics: also aggregate the train metrics nodes report (not protected).
        calibration_runs, calibration_dropout: simulated runs (and dropout model) for calibration.
        budget_check_runs: simulated executions whose worst certified cost is the predicted cost of
            the next round when checking ``max_epsilon``. The certified cost of the actual round
            may still exceed it (its topology is random); it is then recorded exactly, and training
            stops.
        seed: seeds the server's choices (certification draws); None = fresh.
    """

    def __init__(
        self,
        *,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        iterations: int = 10,
        neighbors: int = 1,
        sigma_star: float | None = None,
        sigma_delta: float | None = None,
        epsilon: float | None = None,
        delta: float = 1e-5,
        max_epsilon: float | None = None,
        clip_norm: float = 1.0,
        value_sensitivity: float | None = None,
        sample_rate: float = 1.0,
        accountant: str | None = None,
        collusion: float = 0.1,
        observed_fraction: float | None = None,
        threat_draws: int = 3,
        schedule: str = "incremental",
        min_finalists: int = 2,
        max_noise_inflation: float = 2.0,
        exchange_timeout: float = 60.0,
        poll_interval: float = 0.01,
        precision: str = "float32",
        final_retries: int = 2,
        ledger_path: str | Path | None = "inca_ledger.json",
        trace_dir: str | Path | None = None,
        forward_client_metrics: bool = False,
        calibration_runs: int = 20,
        calibration_dropout: DropoutModel | None = None,
        budget_check_runs: int = 10,
        seed: int | None = None,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        evaluate_metrics_aggr_fn: Callable | None = None,
        train_metrics_aggr_fn: Callable | None = None,
    ) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes, weighted_by_key=weighted_by_key,
                         arrayrecord_key=arrayrecord_key, configrecord_key=configrecord_key,
                         train_metrics_aggr_fn=train_metrics_aggr_fn,
                         evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        if (sigma_star is None) != (sigma_delta is None):
            raise ValueError("give both sigma_star and sigma_delta, or neither (then epsilon is required)")
        if sigma_star is None and epsilon is None:
            raise ValueError("give sigma_star and sigma_delta, or a per-round target epsilon to calibrate them")
        if not (0 < delta < 1):
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")
        if epsilon is not None and not (math.isfinite(epsilon) and epsilon > 0):
            raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise ValueError(f"clip_norm must be > 0, got {clip_norm!r}")
        if not (0 < sample_rate <= 1):
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if isinstance(min_finalists, bool) or not isinstance(min_finalists, int) or min_finalists < 1:
            raise ValueError(f"min_finalists must be an integer >= 1, got {min_finalists!r}")
        if not (max_noise_inflation >= 1):
            raise ValueError(f"max_noise_inflation must be >= 1, got {max_noise_inflation!r}")
        if not (exchange_timeout > 0):
            raise ValueError(f"exchange_timeout must be > 0 seconds, got {exchange_timeout!r}")
        if precision not in ("float32", "float64"):
            raise ValueError(f"precision must be 'float32' or 'float64', got {precision!r}")
        if not (0 < poll_interval <= exchange_timeout):
            raise ValueError(f"poll_interval must be in (0, exchange_timeout], got {poll_interval!r}")
        if not (0 <= collusion < 1):
            raise ValueError(f"collusion fraction must be in [0, 1), got {collusion!r}")
        if observed_fraction is not None and not (0 <= observed_fraction <= 1):
            raise ValueError(f"observed_fraction must be in [0, 1], got {observed_fraction!r}")
        if isinstance(threat_draws, bool) or not isinstance(threat_draws, int) or threat_draws < 1:
            raise ValueError(f"threat_draws must be an integer >= 1, got {threat_draws!r}")
        # validates iterations, neighbors, sigmas and the schedule with clear errors
        IncaConfig(iterations=iterations, neighbors=neighbors, sigma_star=sigma_star or 0.0,
                   sigma_delta=sigma_delta or 0.0, schedule=schedule)
        self.iterations, self.neighbors, self.schedule_name = int(iterations), int(neighbors), schedule
        self.sigma_star, self.sigma_delta = sigma_star, sigma_delta
        self.epsilon, self.delta, self.max_epsilon = epsilon, float(delta), max_epsilon
        self.clip_norm = float(clip_norm)
        self.value_sensitivity = float(value_sensitivity) if value_sensitivity is not None else 2 * self.clip_norm
        self.sample_rate = float(sample_rate)
        self.collusion, self.observed_fraction, self.threat_draws = collusion, observed_fraction, threat_draws
        self.min_finalists, self.exchange_timeout = min_finalists, float(exchange_timeout)
        self.max_noise_inflation = float(max_noise_inflation)
        self.poll_interval = float(poll_interval)
        self.precision = precision
        self.final_retries = int(final_retries)
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.forward_client_metrics = bool(forward_client_metrics)
        self.calibration_runs, self.calibration_dropout = int(calibration_runs), calibration_dropout
        if isinstance(budget_check_runs, bool) or not isinstance(budget_check_runs, int) or budget_check_runs < 1:
            raise ValueError(f"budget_check_runs must be an integer >= 1, got {budget_check_runs!r}")
        self.budget_check_runs = budget_check_runs
        self._predicted: dict[int, float] = {}
        self.seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**63)
        self.ledger = PrivacyLedger(ledger_path, delta=self.delta, max_epsilon=max_epsilon,
                                    accountant=accountant or ("gdp" if self.sample_rate == 1 else "prv"))
        try:  # fail now, not after a round has spent privacy
            self.ledger.accountant.check_sample_rate(self.sample_rate)
        except ValueError as exc:
            raise ValueError(f"accountant {self.ledger.accountant.name!r} cannot account sample_rate = "
                             f"{self.sample_rate}: {exc}") from exc
        self.calibrations: dict[int, Calibration] = {}
        self.rounds: dict[int, RoundRecord] = {}

    # ----------------------------------------------------------------------------- summary
    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> IncA:")
        log(INFO, "\t\t├── iterations T = %d, neighbours k = %d, schedule %s", self.iterations,
            self.neighbors, self.schedule_name)
        if self.sigma_star is not None:
            log(INFO, "\t\t├── sigma_star = %.4g, sigma_delta = %.4g", self.sigma_star, self.sigma_delta)
        else:
            log(INFO, "\t\t├── sigmas calibrated for (%.3g, %.1e)-DP per round", self.epsilon, self.delta)
        log(INFO, "\t\t├── clip norm %.4g, value sensitivity %.4g, sample rate %.4g", self.clip_norm,
            self.value_sensitivity, self.sample_rate)
        threat = (f"eavesdrop {self.observed_fraction:g}" if self.observed_fraction is not None
                  else f"collusion {self.collusion:g}")
        budget = "unlimited" if self.max_epsilon is None else f"{self.max_epsilon:g}"
        log(INFO, "\t\t└── threat: %s; budget: %s at delta %.1e (%s accountant, %d round(s) spent)",
            threat, budget, self.delta, self.ledger.accountant.name, self.ledger.rounds)

    # ----------------------------------------------------------------------------- sigmas
    def _sigmas(self, n: int) -> tuple[float, float]:
        if self.sigma_star is not None:
            return float(self.sigma_star), float(self.sigma_delta)
        if n not in self.calibrations:
            log(INFO, "IncA: calibrating noise for n = %d parties over %d simulated runs", n, self.calibration_runs)
            self.calibrations[n] = calibrate(
                self.epsilon, self.delta, n, iterations=self.iterations, neighbors=min(self.neighbors, n - 1),
                collusion=self.collusion, observed_fraction=self.observed_fraction,
                dropout=self.calibration_dropout, schedule=self.schedule_name, runs=self.calibration_runs,
                seed=self.seed, value_sensitivity=self.value_sensitivity)
            cal = self.calibrations[n]
            log(INFO, "IncA: sigma_star = %.4g, sigma_delta = %.4g (%.0f%% of runs certified)",
                cal.sigma_star, cal.sigma_delta, 100 * cal.success_fraction)
        cal = self.calibrations[n]
        return cal.sigma_star, cal.sigma_delta

    def _certify(self, trace: ExecutionTrace, server_round: int) -> float:
        worst = 0.0
        for draw in range(self.threat_draws):
            seed = [self.seed, server_round, draw]
            if self.observed_fraction is not None:
                view = random_eavesdrop(trace, self.observed_fraction, seed)
            else:
                view = random_collusion(trace, self.collusion, seed)
            worst = max(worst, certify(trace, view, value_sensitivity=self.value_sensitivity).max_mu)
        return worst

    def _certify_and_spend(self, trace: ExecutionTrace, server_round: int) -> tuple[float, float]:
        """Certify a round whose messages were exchanged and record its cost: ``(mu, epsilon)``.

        The cost is spent whatever happens: without a certificate (an error while certifying) the
        round is recorded as unbounded (mu = inf) before the error surfaces.
        """
        try:
            mu = self._certify(trace, server_round)
        except Exception:
            self.ledger.spend(math.inf, self.sample_rate, force=True, note=f"round {server_round}: not certified")
            raise
        return mu, self.ledger.spend(mu, self.sample_rate, force=True, note=f"round {server_round}")

    def _noise_check(self, trace: ExecutionTrace, finalists: list[int], roster: list[int]) -> tuple[float, str]:
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
        if noise + tiny <= self.max_noise_inflation * (full + tiny):
            return noise, ""
        return noise, (f"the final messages of node(s) {[roster[i] for i in missing]} were lost: the update's "
                       f"noise std is {noise:.3g} per coordinate instead of {full:.3g} "
                       f"(max_noise_inflation = {self.max_noise_inflation})")

    def predicted_mu(self, n: int) -> float:
        """Predicted cost of a round with n parties: the worst certified mu over
        ``budget_check_runs`` simulated executions (cached per n)."""
        if n not in self._predicted:
            s_star, s_delta = self._sigmas(n)
            config = IncaConfig(iterations=self.iterations, neighbors=min(self.neighbors, n - 1),
                                sigma_star=s_star, sigma_delta=s_delta, schedule=self.schedule_name,
                                dropout=self.calibration_dropout)
            self._predicted[n] = max(
                self._certify(sample_trace(n, config, seed=(self.seed * 1_000_003 + 7919 * n + r) % 2**63), 10**9 + r)
                for r in range(self.budget_check_runs))
        return self._predicted[n]

    # ----------------------------------------------------------------------------- round
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
            time.sleep(self.poll_interval)
        return replies

    def _mix_exchange(self, grid: Grid, params: RoundParams, roster: list[int], requests: list[Request],
                      counters: dict[str, int], has_roster: set[int]) -> dict[int, Reply]:
        messages = []
        for req in requests:
            forwarded = [replace(m, payload=self.relay_payload(m.sender, m.receiver, m.iteration, m.payload))
                         for m in req.incoming]
            data = encode_request(replace(req, incoming=forwarded), params, with_roster=req.party not in has_roster)
            content = RecordDict({INCA_KEY: ConfigRecord({FIELD: data})})
            messages.append(Message(content, dst_node_id=roster[req.party],
                                    message_type=f"{MessageType.TRAIN}.{MIX_ACTION}"))
        index = {node: i for i, node in enumerate(roster)}
        replies: dict[int, Reply] = {}
        arrived = 0
        for msg in self._send_and_receive(grid, messages, self.exchange_timeout):
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

    def relay_payload(self, sender: int, receiver: int, iteration: int, payload: bytes) -> bytes:
        """Hook on every peer payload the relay forwards (identity; subclasses may observe it)."""
        return payload

    def _train_round(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid,
                     timeout: float) -> tuple[ArrayRecord | None, MetricRecord | None, RoundRecord]:
        start = time.time()
        num_nodes = int(len(list(grid.get_node_ids())) * self.fraction_train)
        sample_size = max(num_nodes, self.min_train_nodes)
        node_ids, available = sample_nodes(grid, self.min_available_nodes, sample_size)
        log(INFO, "configure_train: Sampled %s nodes (out of %s)", len(node_ids), len(available))
        config["server-round"] = server_round
        inca_cfg = ConfigRecord({"round": server_round, "clip-norm": self.clip_norm,
                                 "iterations": self.iterations, "arrays-key": self.arrayrecord_key,
                                 "forward-metrics": self.forward_client_metrics})
        content = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config, INCA_KEY: inca_cfg})
        messages = [Message(content, dst_node_id=int(nid), message_type=MessageType.TRAIN) for nid in node_ids]
        keys: dict[int, bytes] = {}
        metrics: dict[int, MetricRecord] = {}
        dims = set()
        for msg in self._send_and_receive(grid, messages, timeout):
            if msg.has_error():
                log(INFO, "\t> node %d did not join the round: %s", msg.metadata.src_node_id,
                    msg.error.reason.splitlines()[0][:200] if msg.error.reason else msg.error.code)
                continue
            recs = msg.content.config_records
            if INCA_KEY not in recs:
                log(WARNING, "\t> node %d replied without IncA data: is its train function wrapped with "
                    "IncaClient.train()?", msg.metadata.src_node_id)
                continue
            keys[int(msg.metadata.src_node_id)] = recs[INCA_KEY]["public-key"]
            dims.add(int(recs[INCA_KEY]["dim"]))
            if self.forward_client_metrics:
                for rec in msg.content.metric_records.values():
                    metrics[int(msg.metadata.src_node_id)] = rec
        roster = sorted(keys)
        record = RoundRecord(server_round, roster, client_metrics=metrics)
        self.rounds[server_round] = record
        vector, spec = flatten_arrays(arrays)
        if len(roster) < max(2, self.min_finalists):
            record.failed = f"only {len(roster)} node(s) joined (min_finalists = {self.min_finalists})"
            return None, None, record
        if dims != {vector.size}:
            raise ValueError(f"nodes report value dimensions {sorted(dims)}, the model has {vector.size}")
        n, d = len(roster), vector.size
        s_star, s_delta = self._sigmas(n)
        schedule = InjectionSchedule.resolve(self.schedule_name, self.iterations)
        params = RoundParams(server_round, self.iterations, min(self.neighbors, n - 1), s_star, s_delta,
                             schedule, roster, [keys[nid] for nid in roster], self.precision)
        relay = RoundRelay(n, self.iterations, d, schedule, s_star, s_delta, self.precision)
        counters = {"errors": 0, "malformed": 0, "timeouts": 0}
        has_roster: set[int] = set()  # nodes that keep the roster: their requests omit it

        def exchange(commit: int, requests: list[Request]) -> dict[int, Reply]:
            return self._mix_exchange(grid, params, roster, requests, counters, has_roster)

        def progress(u: int, total: int) -> None:
            online = len(relay.online[u]) if u <= self.iterations else len(relay.finals)
            what = f"iteration {u}/{self.iterations}" if u <= self.iterations else "final report"
            log(INFO, "\t> IncA %s: %d/%d nodes", what, online, n)

        drive(relay, exchange, final_retries=self.final_retries, progress=progress)
        trace = relay.trace(meta={"round": server_round})
        record.trace, record.finalists = trace, sorted(relay.finals)
        if self.trace_dir is not None:
            trace.save(self.trace_dir / f"round-{server_round:04d}.json")
        # the messages were exchanged: the round's privacy cost is spent whatever happens next
        record.mu, record.epsilon = self._certify_and_spend(trace, server_round)
        estimate = relay.estimate()
        noise, lost_finals = self._noise_check(trace, record.finalists, roster)
        if estimate is None or len(relay.finals) < self.min_finalists:
            record.failed = (f"only {len(relay.finals)} final message(s) reported "
                             f"(min_finalists = {self.min_finalists})")
            new_arrays = None
        elif lost_finals:
            record.failed = lost_finals
            new_arrays = None
        else:
            record.update = estimate
            new_arrays = unflatten_arrays(vector + estimate, spec, keep=arrays)
        online = np.mean([len(o) / n for o in relay.online[1:]])
        out = {
            "inca-epsilon": float(record.epsilon), "inca-mu": float(record.mu), "inca-parties": n,
            "inca-finalists": len(relay.finals), "inca-online-fraction": float(online),
            "inca-rejected-payloads": relay.rejected_payloads, "inca-errors": counters["errors"],
            "inca-restores": relay.restores,
            "inca-timeouts": counters["timeouts"],
            "inca-sigma-star": float(s_star), "inca-sigma-delta": float(s_delta),
            "inca-noise-std": float(noise),
            "inca-round-failed": int(bool(record.failed)),
        }
        if self.forward_client_metrics and metrics:
            agg = self.train_metrics_aggr_fn([RecordDict({"metrics": m}) for m in metrics.values()],
                                             self.weighted_by_key)
            out.update({k: v for k, v in agg.items()})
        record.seconds = time.time() - start
        return new_arrays, MetricRecord(out), record

    # ----------------------------------------------------------------------------- start
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run ``num_rounds`` IncA rounds; same signature and ``Result`` as ``FedAvg.start``."""
        log(INFO, "Starting %s strategy:", self.__class__.__name__)
        log_strategy_start_info(num_rounds, initial_arrays, train_config, evaluate_config)
        self.summary()
        log(INFO, "")
        if self.ledger.rounds:
            log(INFO, "IncA: resuming privacy ledger %s: %d round(s), epsilon = %.4g", self.ledger.path,
                self.ledger.rounds, self.ledger.epsilon())
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        t_start = time.time()
        if evaluate_fn:
            res = evaluate_fn(0, initial_arrays)
            log(INFO, "Initial global evaluation results: %s", res)
            if res is not None:
                result.evaluate_metrics_serverapp[0] = res
        arrays = initial_arrays
        for current_round in range(1, num_rounds + 1):
            log(INFO, "")
            log(INFO, "[ROUND %s/%s]", current_round, num_rounds)
            if self.max_epsilon is not None:
                n_planned = max(int(len(list(grid.get_node_ids())) * self.fraction_train), self.min_train_nodes)
                planned = self.predicted_mu(max(n_planned, 2))
                after = self.ledger.epsilon_after(planned, self.sample_rate)
                if after > self.max_epsilon:
                    log(WARNING, "IncA: stopping before round %d: it would bring epsilon from %.4g to about "
                        "%.4g > max_epsilon = %.4g (delta = %.1e)", current_round, self.ledger.epsilon(),
                        after, self.max_epsilon, self.delta)
                    break
            new_arrays, metrics, record = self._train_round(current_round, arrays, train_config, grid, timeout)
            if record.failed:
                log(ERROR, "IncA round %d failed: %s; the global model is unchanged", current_round, record.failed)
            if new_arrays is not None:
                arrays = new_arrays
                result.arrays = new_arrays
            if metrics is not None:
                log(INFO, "\t└──> IncA: epsilon = %.4g (round mu = %.4g), %d/%d finals", metrics["inca-epsilon"],
                    metrics["inca-mu"], metrics["inca-finalists"], metrics["inca-parties"])
                result.train_metrics_clientapp[current_round] = metrics
            evaluate_replies = grid.send_and_receive(
                messages=self.configure_evaluate(current_round, arrays, evaluate_config, grid), timeout=timeout)
            agg = self.aggregate_evaluate(current_round, evaluate_replies)
            if agg is not None:
                log(INFO, "\t└──> Aggregated MetricRecord: %s", agg)
                result.evaluate_metrics_clientapp[current_round] = agg
            if evaluate_fn:
                res = evaluate_fn(current_round, arrays)
                log(INFO, "\t└──> MetricRecord: %s", res)
                if res is not None:
                    result.evaluate_metrics_serverapp[current_round] = res
            if self.max_epsilon is not None and self.ledger.epsilon() > self.max_epsilon:
                log(WARNING, "IncA: round %d overran the budget (epsilon %.4g > max_epsilon %.4g); stopping",
                    current_round, self.ledger.epsilon(), self.max_epsilon)
                break
        log(INFO, "")
        log(INFO, "Strategy execution finished in %.2fs", time.time() - t_start)
        for line in io.StringIO(str(result)):
            log(INFO, "\t%s", line.strip("\n"))
        return result

    # FedAvg's single-exchange training does not apply: training happens in start()
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        raise NotImplementedError("IncaStrategy trains through start(); it has no single train exchange")

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        raise NotImplementedError("IncaStrategy aggregates through relayed mixing in start()")
