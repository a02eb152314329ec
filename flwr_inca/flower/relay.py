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
a rejected payload is re-encrypted by its sender from the sender's sealed state. Computation is
deterministic, so retries are safe, and the party's mutable state travels sealed through the relay,
so a late reply from a straggler can never make party and relay disagree. The recorded
``inca-trace/1`` is therefore exactly Algorithm 2 with the online sets ``O^(t)`` above.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..protocol.schedules import InjectionSchedule
from ..protocol.topology import Messages, check_column_stochastic
from ..protocol.trace import ExecutionTrace, TraceStep
from .crypto import NONCE

__all__ = ["Outgoing", "Request", "Reply", "RoundRelay", "payload_size", "drive"]


def payload_size(d: int) -> int:
    """Bytes of one sealed peer message carrying (omega, y) for a d-dim value."""
    return NONCE + 16 + 8 + 8 * d


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
    state: bytes  # the party's sealed state (b"" before initialization)
    task: int = -1  # iteration to compute, -1 for none
    incoming: list[Outgoing] = field(default_factory=list)
    delivered_weight: float = 0.0
    retransmit: list[tuple[int, int, bytes]] = field(default_factory=list)  # (iteration, receiver, sealed state)
    final: bool = False  # report the final message (online at T)


@dataclass
class Reply:
    """What one party answered (parsed by the adapter; the relay validates it)."""

    party: int
    computed: int = -1  # iteration computed in this exchange, -1 for none
    state: bytes = b""  # sealed state after the computation
    rejected: list[int] = field(default_factory=list)  # senders whose payloads failed authentication
    outgoing: list[Outgoing] = field(default_factory=list)  # commit for Request.commit
    retransmissions: list[Outgoing] = field(default_factory=list)
    final: np.ndarray | None = None
    final_omega: float | None = None


class RoundRelay:
    """Bookkeeping of one round among ``n`` parties (indices 0..n-1) for ``iterations`` iterations."""

    def __init__(self, n: int, iterations: int, d: int, schedule: InjectionSchedule,
                 sigma_star: float, sigma_delta: float) -> None:
        if n < 2:
            raise ValueError(f"a round needs at least 2 parties, got {n}")
        self.n, self.T, self.d = n, iterations, d
        self.schedule, self.sigma_star, self.sigma_delta = schedule, sigma_star, sigma_delta
        self.online: list[set[int]] = [set(range(n))] + [set() for _ in range(iterations)]  # O^(t)
        self.outbox: list[dict[tuple[int, int], Outgoing]] = [dict() for _ in range(iterations + 1)]
        self.state: list[bytes] = [b""] * n
        self.commit_state: list[dict[int, bytes]] = [dict() for _ in range(n)]  # state sealed when committing to u
        self.pending: list[int | None] = [0] * n  # everyone computes step 0
        self.bad: set[tuple[int, int, int]] = set()  # (iteration, sender, receiver) awaiting retransmission
        self.retransmit_due: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (iteration, receiver)
        self.finals: dict[int, tuple[np.ndarray, float]] = {}
        self.rejected_payloads = 0
        self.invalid_replies = 0
        self.exchanges = 0

    # ---------------------------------------------------------------------------- requests
    def _task_ready(self, i: int, t: int) -> bool:
        return not any(it == t and r == i for (it, _, r) in self.bad)

    def requests(self, commit: int) -> list[Request]:
        """Requests for the exchange that commits to iteration ``commit`` (T + 1: final reports)."""
        out = []
        for i in range(self.n):
            t = self.pending[i]
            final_round = commit > self.T
            if final_round and i not in self.online[self.T]:
                if not self.retransmit_due[i]:
                    continue  # dropped before the end and owes nothing
            if final_round and i in self.finals and not self.retransmit_due[i]:
                continue
            req = Request(i, commit, self.state[i], final=final_round and i in self.online[self.T])
            if t is not None and self._task_ready(i, t):
                req.task = t
                if t > 0:
                    box = self.outbox[t]
                    req.incoming = [m for (s, r), m in sorted(box.items()) if r == i and s in self.online[t]]
                    req.delivered_weight = float(sum(m.weight for (s, r), m in box.items()
                                                     if s == i and r in self.online[t]))
            req.retransmit = [(u, r, self.commit_state[i][u]) for (u, r) in self.retransmit_due[i]]
            out.append(req)
        return out

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
            if key in self.bad and (i, m.receiver) in self.outbox[m.iteration] and len(m.payload) == payload_size(self.d):
                old = self.outbox[m.iteration][(i, m.receiver)]
                self.outbox[m.iteration][(i, m.receiver)] = Outgoing(i, m.receiver, old.weight, m.payload, m.iteration)
                self.bad.discard(key)
                self.retransmit_due[i] = [x for x in self.retransmit_due[i] if x != (m.iteration, m.receiver)]
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
        if req.task >= 0:
            if rep.computed != req.task or not rep.state:
                return  # did not compute: pending stays, cannot commit
            self.state[i] = rep.state
            self.pending[i] = None
        elif rep.computed >= 0:
            raise ValueError("computed without a task")
        if self.pending[i] is not None:
            return  # still has a pending computation: cannot commit
        if commit <= self.T:
            self._commit(commit, i, rep.outgoing)
        elif rep.final is not None and i in self.online[self.T]:
            y = np.asarray(rep.final, dtype=np.float64)
            if y.shape != (self.d,) or not np.all(np.isfinite(y)) or not np.isfinite(rep.final_omega or np.nan):
                raise ValueError("malformed final message")
            self.finals[i] = (y, float(rep.final_omega))

    def _commit(self, u: int, i: int, outgoing: list[Outgoing]) -> None:
        msgs = Messages(np.array([m.sender for m in outgoing], dtype=np.int64),
                        np.array([m.receiver for m in outgoing], dtype=np.int64),
                        np.array([m.weight for m in outgoing], dtype=np.float64))
        if np.any(msgs.senders != i):
            raise ValueError("a party can only send its own messages")
        check_column_stochastic(msgs, self.n, where=f"party {i} at iteration {u}")
        size = payload_size(self.d)
        if any(len(m.payload) != size for m in outgoing):
            raise ValueError("malformed payload")
        for m in outgoing:
            self.outbox[u][(i, m.receiver)] = Outgoing(i, m.receiver, m.weight, m.payload, u)
        self.online[u].add(i)
        self.commit_state[i][u] = self.state[i]
        if u > 0:
            self.pending[i] = u

    # ---------------------------------------------------------------------------- results
    def trace(self, meta: dict | None = None) -> ExecutionTrace:
        steps = []
        for t in range(1, self.T + 1):
            on = self.online[t]
            delivered = [m for (s, r), m in sorted(self.outbox[t].items()) if s in on and r in on]
            steps.append(TraceStep(
                np.array(sorted(on), dtype=np.int64),
                Messages(np.array([m.sender for m in delivered], dtype=np.int64),
                         np.array([m.receiver for m in delivered], dtype=np.int64),
                         np.array([m.weight for m in delivered], dtype=np.float64)),
            ))
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





def drive(relay: RoundRelay, exchange, final_retries: int = 2, progress=None) -> None:
    """Run a round: exchanges committing to 1..T, the final report, then up to ``final_retries`` more
    exchanges for finals still missing. ``exchange(commit, requests)`` delivers the requests and
    returns the parsed replies that arrived (by party index); ``progress(done, total)`` is optional.
    """
    total = relay.T + 1
    for u in range(1, relay.T + 2):
        requests = relay.requests(u)
        relay.ingest(u, exchange(u, requests), requests)
        if progress is not None:
            progress(u, total)
    for _ in range(final_retries):
        if not relay.missing_finals():
            break
        requests = relay.requests(relay.T + 1)
        if not requests:
            break
        relay.ingest(relay.T + 1, exchange(relay.T + 1, requests), requests)
