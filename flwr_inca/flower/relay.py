"""The untrusted relay of one IncA round: routes opaque peer payloads and records the execution.

Flower has no peer-to-peer channel, so peer messages travel through the ServerApp. This module is
the relay's bookkeeping, free of Flower types. One request/reply exchange with every party per
iteration; for iteration ``u``:

* **commit**: a party that replies in time with well-formed encrypted messages for iteration ``u``
  (its current message, sealed for the out-neighbours *it* chose) is online at ``u``: ``O^(u)`` is
  fixed before anybody computes iteration ``u``, so every sender learns exactly which of its messages
  were delivered (receiver in ``O^(u)``) and keeps the weight of the others (Algorithm 2, line 13).
* **compute**: in the next exchange, each party in ``O^(u)`` receives its incoming payloads and its
  delivered weight and computes ``y^(u)``; in the same reply it commits to ``u + 1``.

A party that errors, times out or rejects a payload while computing keeps its computation pending
(it is not online at the next iteration, since it cannot commit) and receives the task again later;
a rejected payload is re-encrypted by its sender. A computation is accepted only together with a
valid commit (or final report), and parties keep every computed state as an immutable version in
node-local storage; the relay tells each party which version it accepted, so a late reply from a
straggler can never make party and relay disagree, and computation is deterministic, so retries are
safe. A party that lost its storage is restored from its own last committed payload (a sender can
decrypt what it sent). The recorded ``inca-trace/1`` is exactly Algorithm 2 with the online sets
``O^(t)`` above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..protocol.party import PartyState
from ..protocol.schedules import InjectionSchedule
from ..protocol.topology import Messages, check_column_stochastic
from ..protocol.trace import ExecutionTrace, TraceStep
from .crypto import NONCE

__all__ = [
    "Outgoing",
    "Reply",
    "Request",
    "RoundRelay",
    "collect_finals",
    "drive",
    "payload_size",
    "run_iterations",
]


def payload_size(d: int, precision: np.dtype | type = np.float64) -> int:
    """Bytes of one sealed peer message (a party state in ``precision``) for a d-dim value."""
    return NONCE + 16 + PartyState.size(d, precision)


@dataclass
class Outgoing:
    """A sealed payload from ``sender`` to ``receiver`` (party indices) for iteration ``iteration``."""

    sender: int
    receiver: int
    weight: float
    payload: bytes
    iteration: int


@dataclass
class Request:
    """What the relay sends to one party in one exchange."""

    party: int
    commit: int  # iteration to commit to (send messages for); T + 1 = report the final message
    version: int  # last computed iteration the relay accepted (-1: none); the party loads that state
    task: int = -1  # iteration to compute, -1 for none
    incoming: list[Outgoing] = field(default_factory=list)
    delivered_weight: float = 0.0
    retransmit: list[tuple[int, int, int]] = field(default_factory=list)  # (iteration, receiver, version)
    final: bool = False  # report the final message (online at T)
    restore: Outgoing | None = None  # the party's own last committed payload, if it lost its state


@dataclass
class Reply:
    """What one party answered (parsed by the adapter; the relay validates it)."""

    party: int
    computed: int = -1  # iteration computed in this exchange, -1 for none
    rejected: list[int] = field(default_factory=list)  # senders whose payloads failed authentication
    outgoing: list[Outgoing] = field(default_factory=list)  # commit for Request.commit
    retransmissions: list[Outgoing] = field(default_factory=list)
    final: np.ndarray | None = None
    final_omega: float | None = None
    need_restore: bool = False  # the party does not hold the state version it was told to use


class RoundRelay:
    """Bookkeeping of one round among ``n`` parties (indices 0..n-1) for ``iterations`` iterations."""

    def __init__(self, n: int, iterations: int, d: int, schedule: InjectionSchedule,
                 sigma_star: float, sigma_delta: float, precision: np.dtype | type = np.float64) -> None:
        if n < 2:
            raise ValueError(f"a round needs at least 2 parties, got {n}")
        self.n, self.T, self.d = n, iterations, d
        self.schedule, self.sigma_star, self.sigma_delta = schedule, sigma_star, sigma_delta
        self.payload_bytes = payload_size(d, precision)
        self.online: list[set[int]] = [set(range(n))] + [set() for _ in range(iterations)]  # O^(t)
        self.outbox: list[dict[tuple[int, int], Outgoing]] = [{} for _ in range(iterations + 1)]
        self.version = [-1] * n  # last computed iteration accepted from each party
        self.commit_version: list[dict[int, int]] = [{} for _ in range(n)]  # version sent at commit u
        self.restore_point: list[Outgoing | None] = [None] * n  # a payload of the party's last commit
        self.need_restore = [False] * n
        self.pending: list[int | None] = [0] * n  # everyone computes step 0
        self.bad: set[tuple[int, int, int]] = set()  # (iteration, sender, receiver) awaiting retransmission
        self.retransmit_due: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (iteration, receiver)
        self.finals: dict[int, tuple[np.ndarray, float]] = {}
        self.rejected_payloads = 0
        self.invalid_replies = 0
        self.restores = 0
        self.exchanges = 0

    # ---------------------------------------------------------------------------- requests
    def _task_ready(self, i: int, t: int) -> bool:
        return not any(it == t and r == i for (it, _, r) in self.bad)

    def requests(self, commit: int) -> list[Request]:
        """Requests for the exchange that commits to iteration ``commit`` (T + 1: final reports)."""
        out = []
        final_round = commit > self.T
        routed: dict[int, tuple[dict[int, list[Outgoing]], dict[int, float]]] = {}
        for i in range(self.n):
            done = i not in self.online[self.T] or i in self.finals
            if final_round and done and not self.retransmit_due[i]:
                continue  # nothing left to do for this party
            req = Request(i, commit, self.version[i], final=final_round and i in self.online[self.T])
            t = self.pending[i]
            if t is not None and self._task_ready(i, t):
                req.task = t
                if t > 0:
                    if t not in routed:
                        routed[t] = self._delivered(t)
                    incoming, delivered = routed[t]
                    req.incoming = incoming.get(i, [])
                    req.delivered_weight = delivered.get(i, 0.0)
            req.retransmit = [(u, r, self.commit_version[i][u]) for (u, r) in self.retransmit_due[i]]
            if self.need_restore[i]:
                req.restore = self.restore_point[i]
            out.append(req)
        return out

    def _delivered(self, t: int) -> tuple[dict[int, list[Outgoing]], dict[int, float]]:
        """Messages of iteration ``t`` between parties online at ``t``: by receiver (in sender order),
        and the total weight each sender got delivered. One pass over the outbox."""
        on = self.online[t]
        incoming: dict[int, list[Outgoing]] = {}
        delivered: dict[int, float] = {}
        for (s, r), m in sorted(self.outbox[t].items()):
            if s in on and r in on:
                incoming.setdefault(r, []).append(m)
                delivered[s] = delivered.get(s, 0.0) + m.weight
        return incoming, delivered

    # ---------------------------------------------------------------------------- replies
    def ingest(self, commit: int, replies: dict[int, Reply], requests: list[Request]) -> None:
        """Apply the replies of one exchange; parties absent from ``replies`` failed it."""
        self.exchanges += 1
        asked = {r.party: r for r in requests}
        for i, req in asked.items():
            rep = replies.get(i)
            if rep is None:
                continue
            try:
                self._ingest_one(commit, req, rep)
            except ValueError:
                self.invalid_replies += 1

    def _ingest_one(self, commit: int, req: Request, rep: Reply) -> None:
        i = req.party
        # retransmissions first: they only replace payloads known to be bad
        for m in rep.retransmissions:
            key = (m.iteration, i, m.receiver)
            outbox = self.outbox[m.iteration]
            if key in self.bad and (i, m.receiver) in outbox and len(m.payload) == self.payload_bytes:
                old = outbox[(i, m.receiver)]
                outbox[(i, m.receiver)] = Outgoing(i, m.receiver, old.weight, m.payload, m.iteration)
                self.bad.discard(key)
                self.retransmit_due[i] = [x for x in self.retransmit_due[i] if x != (m.iteration, m.receiver)]
        if rep.need_restore:
            if self.restore_point[i] is None:
                raise ValueError("nothing to restore the party from")
            self.need_restore[i] = True
            return
        if req.restore is not None:
            self.need_restore[i] = False
            self.restores += 1
        if rep.rejected:
            if req.task < 0:
                raise ValueError("rejected payloads without a task")
            for s in rep.rejected:
                if (s, i) not in self.outbox[req.task]:
                    raise ValueError("rejected a payload that was not sent")
                self.rejected_payloads += 1
                self.bad.add((req.task, s, i))
                if (req.task, i) not in self.retransmit_due[s]:
                    self.retransmit_due[s].append((req.task, i))
            return  # no computation, hence no commit
        if req.task < 0 and rep.computed >= 0:
            raise ValueError("computed without a task")
        computed = req.task >= 0 and rep.computed == req.task
        if self.pending[i] is not None and not computed:
            return  # still has a pending computation: cannot commit
        # a computation counts only with its commit (or final report): validate that first
        if commit <= self.T:
            self._check_commit(commit, i, rep.outgoing)
        elif req.final:
            self._check_final(rep)
        if computed:
            self.version[i] = req.task
            self.pending[i] = None
        if commit <= self.T:
            for m in rep.outgoing:
                self.outbox[commit][(i, m.receiver)] = Outgoing(i, m.receiver, m.weight, m.payload, commit)
            self.online[commit].add(i)
            self.commit_version[i][commit] = self.version[i]
            first = rep.outgoing[0]
            self.restore_point[i] = Outgoing(i, first.receiver, first.weight, first.payload, commit)
            self.pending[i] = commit
        elif req.final and computed:
            self.finals[i] = (np.asarray(rep.final, dtype=np.float64), float(rep.final_omega))

    def _check_final(self, rep: Reply) -> None:
        """A final message must be finite, of the round's dimension, with a weight omega in (0, n]: the
        weights of all messages add up to the injected shares, at most one per party (Eq. (9)), and a
        finalist's is positive. A zero or negative omega would silently shrink or flip the average."""
        y = None if rep.final is None else np.asarray(rep.final, dtype=np.float64)
        if y is None or y.shape != (self.d,) or not np.all(np.isfinite(y)):
            raise ValueError("missing or malformed final message")
        omega = rep.final_omega
        if omega is None or not np.isfinite(omega) or not 0.0 < omega <= self.n * (1 + 1e-9):
            raise ValueError(f"final message with weight omega = {omega}, outside (0, {self.n}]")

    def _check_commit(self, u: int, i: int, outgoing: list[Outgoing]) -> None:
        if not outgoing:
            raise ValueError("a commit must send at least one message")
        msgs = Messages(np.array([m.sender for m in outgoing], dtype=np.int64),
                        np.array([m.receiver for m in outgoing], dtype=np.int64),
                        np.array([m.weight for m in outgoing], dtype=np.float64))
        if np.any(msgs.senders != i):
            raise ValueError("a party can only send its own messages")
        check_column_stochastic(msgs, self.n, where=f"party {i} at iteration {u}")
        if any(len(m.payload) != self.payload_bytes for m in outgoing):
            raise ValueError("malformed payload")

    # ---------------------------------------------------------------------------- results
    def step(self, t: int) -> TraceStep:
        """Iteration ``t`` (1..T) as recorded: its online set and delivered messages (final once the
        exchange committing to ``t`` was ingested)."""
        on = self.online[t]
        delivered = [m for (s, r), m in sorted(self.outbox[t].items()) if s in on and r in on]
        return TraceStep(
            np.array(sorted(on), dtype=np.int64),
            Messages(np.array([m.sender for m in delivered], dtype=np.int64),
                     np.array([m.receiver for m in delivered], dtype=np.int64),
                     np.array([m.weight for m in delivered], dtype=np.float64)),
        )

    def trace(self, meta: dict | None = None) -> ExecutionTrace:
        steps = [self.step(t) for t in range(1, self.T + 1)]
        trace = ExecutionTrace(self.n, self.T, self.schedule, self.sigma_star, self.sigma_delta, steps,
                               dict(meta or {}))
        trace.meta["finalists"] = sorted(self.finals)
        trace.validate()
        return trace

    def missing_finals(self) -> list[int]:
        return sorted(self.online[self.T] - set(self.finals))

    def estimate(self) -> np.ndarray | None:
        """``sum(y) / sum(omega)`` over the reported finals (None if there are none)."""
        if not self.finals:
            return None
        ys = np.stack([self.finals[i][0] for i in sorted(self.finals)])
        omegas = np.array([self.finals[i][1] for i in sorted(self.finals)])
        return ys.sum(axis=0) / omegas.sum()


Exchange = Callable[[int, list[Request]], dict[int, Reply]]
Progress = Callable[[int, int], None]


def run_iterations(relay: RoundRelay, exchange: Exchange, progress: Progress | None = None,
                   may_deliver: Callable[[int], bool] | None = None) -> int:
    """The exchanges committing to iterations 1..T. ``exchange(commit, requests)`` delivers the requests
    and returns the parsed replies that arrived (by party index); ``progress(done, T + 1)`` is optional.

    ``may_deliver(u)`` (optional, the budget guard) is asked once iteration ``u`` is committed (its
    online set and messages are known) and before the next exchange delivers its messages; False stops
    the round there. Returns the last iteration whose messages may be delivered: T, or ``u - 1`` when
    ``may_deliver(u)`` said no (the messages of iterations 1..u-1 were delivered).

    Afterwards (T returned) the online sets, hence the trace's steps, are final: only the final
    messages are missing.
    """
    for u in range(1, relay.T + 1):
        requests = relay.requests(u)
        relay.ingest(u, exchange(u, requests), requests)
        if progress is not None:
            progress(u, relay.T + 1)
        if may_deliver is not None and not may_deliver(u):
            return u - 1
    return relay.T


def collect_finals(relay: RoundRelay, exchange: Exchange, final_retries: int = 2,
                   progress: Progress | None = None) -> None:
    """The final report (the exchange "committing" to T + 1, which also computes iteration T), then up
    to ``final_retries`` more exchanges for final messages still missing."""
    requests = relay.requests(relay.T + 1)
    relay.ingest(relay.T + 1, exchange(relay.T + 1, requests), requests)
    if progress is not None:
        progress(relay.T + 1, relay.T + 1)
    for _ in range(final_retries):
        if not relay.missing_finals():
            break
        requests = relay.requests(relay.T + 1)
        if not requests:
            break
        relay.ingest(relay.T + 1, exchange(relay.T + 1, requests), requests)


def drive(relay: RoundRelay, exchange: Exchange, final_retries: int = 2,
          progress: Progress | None = None) -> None:
    """Run a round: :func:`run_iterations`, then :func:`collect_finals`."""
    run_iterations(relay, exchange, progress)
    collect_finals(relay, exchange, final_retries, progress)
