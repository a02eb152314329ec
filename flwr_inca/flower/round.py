"""One IncA round on Flower's grid: the relayed mixing, the round session asked before each step leaves,
the charge, and what is recorded of the round (``RoundRecord``, its metrics, its failure rules).

:class:`~flwr_inca.flower.strategy.IncaStrategy` creates a :class:`RelayedRound` in ``aggregate_train``,
once the nodes joined: :meth:`RelayedRound.run` runs iterations 1..T through the relay (the session's
guard before each iteration's payloads leave) and, if the pre-final rule lets it, the final exchange;
:meth:`RelayedRound.charge` then charges exactly what was revealed (or, after an error, the round's
reservation, a bound on it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from logging import DEBUG, ERROR, INFO
from pathlib import Path

import numpy as np
from flwr.app import MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log

from ..privacy.prefix import padded_trace
from ..privacy.session import RoundCharge, RoundSession
from ..protocol.trace import ExecutionTrace
from ..protocol.utility import noise_std
from ..rounds import IncaRound, IncaRounds
from ..settings import MixingConfig
from .config import RelayConfig
from .relay import RoundRelay, collect_finals, run_iterations
from .shared import RoundParams
from .transport import Joined, MixingExchange, PayloadHook

__all__ = ["RelayedRound", "RoundRecord", "check_flower_mixing", "lost_finals_check", "round_metrics",
           "update_check"]


@dataclass
class RoundRecord:
    """What happened in one IncA round (kept in ``IncaStrategy.rounds``)."""

    round: int
    roster: list[int]  # node ids; party i of the trace is roster[i]
    trace: ExecutionTrace | None = None
    update: np.ndarray | None = None  # the averaged update applied to the model (float64)
    finalists: list[int] = field(default_factory=list)
    charge: RoundCharge | None = None  # what the round session charged (None: the round did not start)
    failed: str = ""  # why the round failed or was refused, if it was
    client_metrics: dict[int, MetricRecord] = field(default_factory=dict)  # by node id (if forwarded)
    noise_std: float = math.nan  # of the update, per coordinate (inf without finals)
    seconds: float = 0.0
    excluded: dict[int, str] = field(default_factory=dict)  # sampled nodes that did not join, and why
    post_charge_errors: list[str] = field(default_factory=list)  # what failed after the round was charged
    offenders: dict[int, str] = field(default_factory=dict)  # nodes that deviated in the round, and how

    @property
    def mu(self) -> float:
        return self.charge.mu if self.charge is not None else 0.0

    @property
    def epsilon(self) -> float:
        return self.charge.epsilon if self.charge is not None else math.nan

    @property
    def refused(self) -> bool:
        return self.charge is not None and self.charge.refused


class RelayedRound:
    """The mixing of one round among the nodes that joined, through the relay, and its charge.

    Attributes:
        relay: the relay's record of the round (who was online, the messages, the finals).
        params: the round's protocol parameters; ``exchange``: its transport (counters of errors, timeouts).
        privacy: the round in the session (:class:`~flwr_inca.rounds.IncaRound`).
        stopped: why the budget refused the round ("" if its finals were collected).
        error: the error that failed the round ("" if none).
    """

    def __init__(self, record: RoundRecord, grid: Grid, joined: Joined, d: int, *, inca: IncaRounds,
                 session: RoundSession, mixing: MixingConfig, relay: RelayConfig,
                 payload_hook: PayloadHook | None = None) -> None:
        self.record, self.inca, self.session, self.mixing, self.relay_config = record, inca, session, mixing, relay
        roster, n = joined.roster, len(joined.roster)
        s_star, s_delta = inca.sigmas(n)
        self.params = RoundParams(record.round, mixing.iterations, min(mixing.neighbors, n - 1), s_star, s_delta,
                                  inca.schedule, roster, [joined.keys[node] for node in roster], mixing.precision)
        # commits are checked: k peers, weights 1/(k+1)
        self.relay = RoundRelay(n, mixing.iterations, d, inca.schedule, s_star, s_delta, mixing.precision,
                                neighbors=self.params.neighbors, roster=roster)
        self.exchange = MixingExchange(grid, self.params, timeout=relay.exchange_timeout,
                                       poll_interval=relay.poll_interval,
                                       max_poll_interval=relay.max_poll_interval, payload_hook=payload_hook)
        self.privacy: IncaRound | None = None
        self.stopped = self.error = ""

    def open(self, ledger_path: Path | None) -> bool:
        """Reserve the round before its first message (False: the ledger cannot be written, the round is
        failed and nothing left)."""
        record, relay = self.record, self.relay
        try:
            self.privacy = self.inca.start(self.session, record.round, relay.n,
                                           trace_through=lambda t: trace_through(relay, t))
        except OSError as exc:  # nothing may leave before the reservation is written: the round does not start
            record.failed = (f"the privacy ledger {ledger_path} cannot be written ({exc.strerror or exc}): the "
                             "round was not started")
            log(ERROR, "IncA round %d failed: %s", record.round, record.failed)
            return False
        if self.privacy.guarded:
            log(INFO, "IncA round %d runs guarded: its no-finals ceiling does not fit the budget left, so each "
                "iteration's messages are delivered only if what they reveal fits", record.round)
        return True

    def run(self) -> None:
        """Iterations 1..T (each delivered only if the session lets it), then the final exchange if the
        pre-final rule lets it. An error fails the round, charged its reservation; training goes on."""
        relay, privacy, T = self.relay, self.privacy, self.mixing.iterations
        try:
            delivered = run_iterations(relay, self.exchange, progress=self._progress, may_deliver=privacy.may_deliver)
            if delivered < T:
                self.stopped = (f"the messages of iteration {delivered + 1} would reveal mu = "
                                f"{privacy.open.blocked.mu:.4g}, more than the budget left: they were not delivered "
                                "(budget guard)")
            elif not privacy.may_collect_finals(relay.trace(meta={"round": self.record.round})):
                self.stopped = (f"its final messages would reveal mu = {privacy.prefinal.mu:.4g} (certified "
                                "before them), more than the budget left: they were not collected")
            else:
                collect_finals(relay, self.exchange, final_retries=self.relay_config.final_retries,
                               progress=self._progress)
        except Exception as exc:  # noqa: BLE001 - the round fails, charged its reservation; training goes on
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if privacy.charge is None:
                privacy.fail(f"mixing failed ({self.error})")
        except BaseException as exc:  # interrupted: charge the reservation (a bound on what left), then stop
            if privacy.charge is None:
                privacy.fail(f"mixing interrupted ({type(exc).__name__})")
            raise

    def _progress(self, u: int, total: int) -> None:
        T, relay = self.mixing.iterations, self.relay
        online = len(relay.online[u]) if u <= T else len(relay.finals)
        what = f"iteration {u}/{T}" if u <= T else "final report"
        log(DEBUG, "\t> IncA %s: %d/%d nodes", what, online, relay.n)

    def charge(self) -> None:
        """Charge the round (exactly what it revealed) and record its trace. Nothing after the charge may
        lose it: an error while certifying charges the round's reservation, a bound on what was revealed."""
        record, relay, privacy = self.record, self.relay, self.privacy
        if self.error:
            record.charge = privacy.charge
            record.failed = f"the round failed ({self.error}); charged its reservation"
            return
        try:
            if self.stopped:
                record.charge = privacy.refuse()
                record.failed = self.stopped
                record.trace = stopped_trace(relay, privacy.delivered, record.round)
            else:
                record.finalists = sorted(relay.finals)
                record.trace = relay.trace(meta={"round": record.round})
                record.charge = privacy.settle(record.finalists)
        except Exception as exc:  # noqa: BLE001 - a certificate that failed: the reservation is the charge
            record.charge = privacy.charge or privacy.fail(f"not certified ({type(exc).__name__}: {exc})")
            record.failed = record.failed or f"the round could not be certified ({type(exc).__name__}: {exc})"
            log(ERROR, "IncA round %d: %s; charged its reservation (mu = %.4g)", record.round, record.failed,
                record.charge.mu)
        if record.charge.unsettled:
            log(ERROR, "IncA round %d: %s; its reservation (at least its cost) stays charged", record.round,
                record.charge.unsettled)

    @property
    def released(self) -> bool:
        """The finals were collected and the round charged: its update may be applied."""
        return not (self.stopped or self.error or self.record.failed)


def trace_through(relay: RoundRelay, t: int) -> ExecutionTrace:
    """The trace of ``relay``'s iterations 1..``t`` as committed, the later ones exchanging nothing: its
    prefix certificates through ``t`` are those of the round however it continues."""
    steps = [relay.step(u) for u in range(1, t + 1)]
    return padded_trace(relay.n, steps, relay.T, relay.schedule, relay.sigma_star, relay.sigma_delta)


def stopped_trace(relay: RoundRelay, delivered: int, server_round: int) -> ExecutionTrace:
    """The trace of a refused round: the iterations whose messages were committed, the later ones exchanging
    nothing (``meta["delivered-iterations"]`` says where the delivered ones end; no final was asked for)."""
    trace = trace_through(relay, min(delivered + 1, relay.T))
    trace.meta.update({"round": server_round, "finalists": [], "finals-collected": False,
                       "delivered-iterations": delivered})
    return trace


# ----------------------------------------------------------------------------------- when a round fails
def lost_finals_check(trace: ExecutionTrace, finalists: list[int], roster: list[int],
                      max_noise_inflation: float) -> tuple[float, str]:
    """The update's noise std per coordinate when only ``finalists``' final messages arrived, and why the
    round must fail ("" if it need not): lost final messages whose share of the cancelling noise leaves
    the update's noise more than ``max_noise_inflation`` times the noise with every final. ``roster``:
    the node id of each party (for the message)."""
    if not finalists:
        return math.inf, ""
    noise = noise_std(trace, finalists)
    missing = sorted(set(trace.steps[-1].online.tolist()) - set(finalists))
    if not missing:
        return noise, ""
    full = noise_std(trace)
    tiny = 1e-12 * max(trace.sigma_star, trace.sigma_delta, 1e-300)  # round-off of exact cancellation
    if noise + tiny <= max_noise_inflation * (full + tiny):
        return noise, ""
    return noise, (f"the final messages of node(s) {[roster[i] for i in missing]} were lost: the update's noise "
                   f"std is {noise:.3g} per coordinate instead of {full:.3g} "
                   f"(max_noise_inflation = {max_noise_inflation})")


def update_check(update: np.ndarray, bound: float, clip_norm: float) -> str:
    """Why the averaged update must not be applied ("" if it may be): not finite, or its L2 norm above
    ``bound`` (an honest round stays far below: updates are clipped to ``clip_norm``)."""
    if not np.all(np.isfinite(update)):
        return "the averaged update is not finite"
    with np.errstate(over="ignore"):
        norm = float(np.linalg.norm(update))
    if not norm <= bound:
        return (f"the averaged update has L2 norm {norm:.4g} > max_update_norm = {bound:.4g} (an honest round "
                f"stays far below: updates are clipped to {clip_norm:g}); a node may have sent a corrupted final "
                "message")
    return ""


def check_flower_mixing(mixing: MixingConfig) -> None:
    """The settings a Flower deployment cannot honour, named (the simulator's alone)."""
    unsupported = {"topology": "random", "dissemination": "exact", "certification": "exact", "certify_every": 1}
    for name, supported in unsupported.items():
        if getattr(mixing, name) != supported:
            raise ValueError(f"IncaStrategy supports {name}={supported!r} only (got {getattr(mixing, name)!r}): "
                             "that setting is the simulator's")


# ----------------------------------------------------------------------------------- metrics
def round_metrics(record: RoundRecord, mixed: RelayedRound | None, epsilon: float,
                  refusals: int) -> MetricRecord:
    """IncA's server-side metrics of a round (``IncaStrategy.train_metrics_serverapp``); ``epsilon``: the
    ledger's when the round charged nothing, ``refusals``: the session's count of refusals in a row."""
    n, charge = len(record.roster), record.charge
    metrics = MetricRecord({
        "inca-epsilon": float(charge.epsilon) if charge else float(epsilon),
        "inca-mu": float(charge.mu) if charge else 0.0, "inca-parties": n,
        "inca-finalists": len(record.finalists), "inca-round-failed": int(bool(record.failed)),
        "inca-round-refused": int(record.refused), "inca-excluded-nodes": len(record.excluded),
        "inca-post-charge-errors": len(record.post_charge_errors), "inca-consecutive-refusals": refusals,
        "inca-noise-std": float(record.noise_std), "inca-offenders": len(record.offenders)})
    if mixed is not None and mixed.privacy is not None:
        relay, counters = mixed.relay, mixed.exchange.counters
        metrics.update({
            "inca-online-fraction": float(np.mean([len(o) / n for o in relay.online[1:]])),
            "inca-delivered-iterations": int(mixed.privacy.delivered),
            "inca-rejected-payloads": relay.rejected_payloads, "inca-errors": counters["errors"],
            "inca-timeouts": counters["timeouts"], "inca-malformed-replies": counters["malformed"],
            "inca-invalid-replies": relay.invalid_replies, "inca-restores": relay.restores,
            "inca-sigma-star": float(mixed.params.sigma_star), "inca-sigma-delta": float(mixed.params.sigma_delta),
            "inca-guarded": int(mixed.privacy.guarded)})
    return metrics

