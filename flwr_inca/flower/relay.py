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

A party that errors or times out keeps its computation pending (it is not online at the next
iteration, since it cannot commit) and receives the task again later. A computation is accepted only
from a valid reply, and parties keep every computed state as an immutable version in node-local
storage; the relay tells each party which version it accepted, so a late reply from a straggler can
never make party and relay disagree, and computation is deterministic, so retries are safe. A party
that lost its storage is restored from its own last committed payload (a sender can decrypt what it
sent). The recorded ``inca-trace/1`` is exactly Algorithm 2 with the online sets ``O^(t)`` above.

**Deviating nodes.** Every reply is validated before anything in it is indexed or used (iterations,
senders, receivers, lengths, the commit's k neighbours and weights ``1/(k+1)``, finals); a party whose
reply is invalid is *excluded* from the rest of the round: from the iteration being committed on it is
offline (never asked again, its messages of that exchange not delivered), which is exactly a dropout of
Algorithm 2, so the trace stays the execution that happened. Receivers check what they decrypt
(authentication, dimension, finite values of a magnitude whose sums cannot overflow, a weight in
``[0, n]``) and refuse a bad payload naming its sender (:class:`Rejection`). The relay cannot tell a bad
payload from a false refusal, so a refusal is first taken for damage in transit: the receiver waits and
the sender is *held* (its commits are not accepted) until it has sent the payload again, within
:data:`RETRANSMIT_EXCHANGES` exchanges, and the receiver has used it. A payload refused again, or not
sent again in time, is a *dispute*: both parties are excluded and named in :attr:`RoundRelay.offenders`.
A receiver still waiting for a payload whose sender was excluded cannot compute either: it is excluded
too (not an offender).

No message is ever taken back: a payload handed to a receiver stays delivered in the trace (its
receiver may have read it, and the certificate must count that), and an excluded receiver never sends
again, so the state it could not compute is never used. One deviating node can thus take with it only
the parties it exchanged refused payloads with in one iteration (at most its ``k`` receivers, or the
senders to it), once: it is out of the round from then on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from .._checks import check_int
from ..protocol.party import PartyState
from ..protocol.schedules import InjectionSchedule
from ..protocol.topology import Messages, check_column_stochastic
from ..protocol.trace import ExecutionTrace, TraceStep
from .crypto import NONCE

__all__ = [
    "Outgoing",
    "RETRANSMIT_EXCHANGES",
    "Rejection",
    "Reply",
    "Request",
    "RoundRelay",
    "collect_finals",
    "drive",
    "payload_size",
    "run_iterations",
]

RETRANSMIT_EXCHANGES = 2  # exchanges a sender has to send a refused payload again before a dispute


def payload_size(d: int, precision: np.dtype | type = np.float64) -> int:
    """Bytes of one sealed peer message (a party state in ``precision``) for a d-dim value."""
    return NONCE + 16 + PartyState.size(d, precision)


class Rejection(IntEnum):
    """Why a receiver refused a payload, as it reports it (the relay cannot check it)."""

    AUTHENTICATION = 1  # it did not decrypt: garbage, tampered, replayed or mis-addressed
    MALFORMED = 2  # it decrypted, but is not a party state of the round's dimension
    INVALID_VALUE = 3  # NaN, inf, a magnitude whose sums could overflow, or a weight omega outside [0, n]

    def describe(self) -> str:
        return _REJECTION_TEXT[self]


_REJECTION_TEXT = {
    Rejection.AUTHENTICATION: "failed authentication (garbage, tampered, replayed or mis-addressed)",
    Rejection.MALFORMED: "was not a party state of the round's dimension",
    Rejection.INVALID_VALUE: "held values that are not finite or out of range",
}


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
    rejected: list[tuple[int, int]] = field(default_factory=list)  # (sender, Rejection) of refused payloads
    outgoing: list[Outgoing] = field(default_factory=list)  # commit for Request.commit
    retransmissions: list[Outgoing] = field(default_factory=list)
    final: np.ndarray | None = None
    final_omega: float | None = None
    need_restore: bool = False  # the party does not hold the state version it was told to use
    invalid: str = ""  # set by the adapter: the reply could not be read (why); the party is excluded


Key = tuple[int, int, int]  # (iteration, sender, receiver) of a payload


class RoundRelay:
    """Bookkeeping of one round among ``n`` parties (indices 0..n-1) for ``iterations`` iterations.

    ``neighbors``: the out-neighbours k every party sends to per iteration (capped at n - 1), each with
    weight 1/(k+1); a commit that differs is invalid (without it, only column stochasticity is checked,
    and one party may send to every other). ``roster``: node ids, to name parties in
    :attr:`offenders` and :attr:`excluded` (default: "party i").

    Attributes:
        offenders: parties excluded from the rest of the round for deviating (an invalid reply, or one side
            of a dispute), with the reason.
        excluded: every party excluded from the rest of the round (offenders, and receivers left waiting
            for a payload from an excluded sender), with the reason.
    """

    def __init__(self, n: int, iterations: int, d: int, schedule: InjectionSchedule,
                 sigma_star: float, sigma_delta: float, precision: np.dtype | type = np.float64,
                 neighbors: int | None = None, roster: Sequence[int] | None = None) -> None:
        if n < 2:
            raise ValueError(f"a round needs at least 2 parties, got {n}")
        if roster is not None and len(roster) != n:
            raise ValueError(f"roster must name the {n} parties, got {len(roster)} node ids")
        self.n, self.T, self.d = n, iterations, d
        self.k = None if neighbors is None else min(check_int("neighbors", neighbors, 1), n - 1)
        self.roster = None if roster is None else [int(v) for v in roster]
        self.schedule, self.sigma_star, self.sigma_delta = schedule, sigma_star, sigma_delta
        self.payload_bytes = payload_size(d, precision)
        self.online: list[set[int]] = [set(range(n))] + [set() for _ in range(iterations)]  # O^(t)
        self.outbox: list[dict[tuple[int, int], Outgoing]] = [{} for _ in range(iterations + 1)]
        self.version = [-1] * n  # last computed iteration accepted from each party
        self.commit_version: list[dict[int, int]] = [{} for _ in range(n)]  # version sent at commit u
        self.restore_point: list[Outgoing | None] = [None] * n  # a payload of the party's last commit
        self.need_restore = [False] * n
        self.pending: list[int | None] = [0] * n  # everyone computes step 0
        self.awaiting: dict[Key, int] = {}  # refused payloads -> the last exchange to send them again in
        self.refusal: dict[Key, str] = {}  # why each refused payload was refused
        self.retransmitted: set[Key] = set()  # sent again, not yet used by its receiver (refused: a dispute)
        self.finals: dict[int, tuple[np.ndarray, float]] = {}
        self.offenders: dict[int, str] = {}
        self.excluded: dict[int, str] = {}
        self.rejected_payloads = 0
        self.invalid_replies = 0
        self.disputes = 0
        self.restores = 0
        self.exchanges = 0

    def name(self, i: int) -> str:
        """Party ``i`` as logs name it: its node id when the roster is known."""
        return f"party {i}" if self.roster is None else f"node {self.roster[i]}"

    # ---------------------------------------------------------------------------- requests
    def _task_ready(self, i: int, t: int) -> bool:
        return not any(it == t and r == i for (it, _, r) in self.awaiting)

    def _owed_by(self, i: int) -> list[tuple[int, int]]:
        """(iteration, receiver) of the refused payloads party ``i`` must send again."""
        return sorted((u, r) for (u, s, r) in self.awaiting if s == i)

    def _checking(self, i: int) -> bool:
        """Whether party ``i`` has yet to use a payload sent to it again (to settle its refusal, even when
        its computation no longer matters to the round)."""
        return any(r == i for (_, _, r) in self.retransmitted)

    def _held(self, i: int) -> bool:
        """Whether party ``i`` has a refused payload not yet sent again, or sent again but not yet used by
        its receiver: until then no new message of it is accepted (a bad sender gets one iteration out)."""
        return any(s == i for (_, s, _) in self.awaiting) or any(s == i for (_, s, _) in self.retransmitted)

    def requests(self, commit: int) -> list[Request]:
        """Requests for the exchange that commits to iteration ``commit`` (T + 1: final reports)."""
        out = []
        final_round = commit > self.T
        routed: dict[int, tuple[dict[int, list[Outgoing]], dict[int, float]]] = {}
        for i in range(self.n):
            if i in self.excluded:
                continue
            owed = self._owed_by(i)
            done = i not in self.online[self.T] or i in self.finals
            if final_round and done and not owed and not self._checking(i):
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
            req.retransmit = [(u, r, self.commit_version[i][u]) for (u, r) in owed]
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
        """Apply the replies of one exchange; parties absent from ``replies`` failed it (a dropout).

        Every reply is validated in full first: an invalid one excludes its party (never the round).
        Then retransmissions, refusals (or the use of retransmitted payloads, which releases their
        senders), computations and commits."""
        self.exchanges += 1
        valid: list[tuple[Request, Reply]] = []
        for req in requests:
            rep = replies.get(req.party)
            if rep is None or req.party in self.excluded:
                continue
            why = self._invalid(commit, req, rep)
            if why:
                self.invalid_replies += 1
                self._exclude(req.party, f"invalid reply ({self._exchange(commit)}): {why}", commit)
            else:
                valid.append((req, rep))
        for step in (self._take_retransmissions, self._take_outcome, self._apply):
            for req, rep in valid:
                if req.party not in self.excluded:
                    step(commit, req, rep)
        for key, last in sorted(self.awaiting.items()):
            if key in self.awaiting and self.exchanges >= last:
                self._dispute(key, f"not sent again within {RETRANSMIT_EXCHANGES} exchanges", commit)

    def close(self) -> None:
        """End of the round: a refusal still unresolved (no exchange left to send the payload again in) is
        a dispute. :func:`collect_finals` calls it."""
        for key in sorted(self.awaiting):
            if key in self.awaiting:
                self._dispute(key, "the round ended before it was sent again", self.T + 1)

    def _exchange(self, commit: int) -> str:
        return f"committing to iteration {commit}" if commit <= self.T else "of the final report"

    def _take_retransmissions(self, commit: int, req: Request, rep: Reply) -> None:
        i = req.party
        for m in rep.retransmissions:
            key = (int(m.iteration), i, int(m.receiver))
            if key in self.awaiting:
                old = self.outbox[key[0]][(i, key[2])]
                self.outbox[key[0]][(i, key[2])] = Outgoing(i, key[2], old.weight, m.payload, key[0])
                del self.awaiting[key]
                self.retransmitted.add(key)

    def _take_outcome(self, commit: int, req: Request, rep: Reply) -> None:
        """The receiver's verdict on the payloads of its task: all used (computed), or some refused."""
        r, t = req.party, req.task
        if t >= 0 and rep.computed == t:
            self.retransmitted -= {key for key in self.retransmitted if key[0] == t and key[2] == r}
        for s, code in rep.rejected:
            self.rejected_payloads += 1
            key, why = (t, int(s), r), Rejection(code).describe()
            if s in self.excluded:
                self._exclude(r, f"cannot compute iteration {t}: the payload of {self.name(s)} {why}, and "
                                 f"{self.name(s)} was excluded", commit, offender=False)
            elif key in self.retransmitted:
                self.refusal[key] = why
                self._dispute(key, "refused again after a retransmission", commit)
            else:
                self.awaiting[key] = self.exchanges + RETRANSMIT_EXCHANGES
                self.refusal[key] = why
            if r in self.excluded:
                return

    def _apply(self, commit: int, req: Request, rep: Reply) -> None:
        """A valid reply's restore request, computation, commit or final."""
        i = req.party
        if rep.need_restore:
            self.need_restore[i] = True
            return
        if req.restore is not None:
            self.need_restore[i] = False
            self.restores += 1
        if rep.rejected:
            return  # no computation, hence no commit
        computed = req.task >= 0 and rep.computed == req.task
        if self.pending[i] is not None and not computed:
            return  # still has a pending computation: cannot commit
        if computed:
            self.version[i] = req.task
            self.pending[i] = None
        if commit <= self.T:
            if not self._held(i):  # a refused payload of it is unresolved: no new messages from it
                self._commit(commit, i, rep.outgoing)
        elif req.final and computed:
            self.finals[i] = (np.asarray(rep.final, dtype=np.float64), float(rep.final_omega))

    def _commit(self, u: int, i: int, outgoing: list[Outgoing]) -> None:
        for m in outgoing:
            self.outbox[u][(i, int(m.receiver))] = Outgoing(i, int(m.receiver), float(m.weight), m.payload, u)
        self.online[u].add(i)
        self.commit_version[i][u] = self.version[i]
        first = outgoing[0]
        self.restore_point[i] = Outgoing(i, int(first.receiver), float(first.weight), first.payload, u)
        self.pending[i] = u

    # ---------------------------------------------------------------------------- exclusion
    def _dispute(self, key: Key, what: str, commit: int) -> None:
        """Payload ``key`` was refused and not resolved: one of its two parties deviated; both go."""
        t, s, r = key
        self.awaiting.pop(key, None)
        self.retransmitted.discard(key)
        self.disputes += 1
        why = f"{self.refusal.get(key, 'refused')}; {what}"
        self._exclude(s, f"{self.name(r)} refused its payload of iteration {t}, which {why}", commit)
        self._exclude(r, f"refused the payload of iteration {t} from {self.name(s)}, which {why}", commit)

    def _exclude(self, i: int, reason: str, commit: int, offender: bool = True) -> None:
        """Party ``i`` is offline from iteration ``commit`` on (a dropout of Algorithm 2: what it was sent
        before stays delivered), its final (if any) unused, and nobody waits for it any more."""
        if offender:
            self.offenders.setdefault(i, reason)
        if i in self.excluded:
            return
        self.excluded[i] = reason
        for v in range(commit, self.T + 1):
            self.online[v].discard(i)
        self.finals.pop(i, None)
        self.pending[i] = None
        self.need_restore[i] = False
        for key in [k for k in self.awaiting if k[2] == i]:
            del self.awaiting[key]  # payloads owed to it: no longer needed
        self.retransmitted -= {k for k in self.retransmitted if k[2] == i}
        for key in [k for k in self.awaiting if k[1] == i]:  # payloads it owes: their receivers are stuck
            del self.awaiting[key]
            t, _, r = key
            self._exclude(r, f"cannot compute iteration {t}: the payload of {self.name(i)} "
                             f"{self.refusal[key]}, and {self.name(i)} was excluded", commit, offender=False)

    # ---------------------------------------------------------------------------- validation
    def _invalid(self, commit: int, req: Request, rep: Reply) -> str:
        """Why ``rep`` is not a reply an honest party can send to ``req`` ("" if it is)."""
        try:
            self._check_reply(commit, req, rep)
        except Exception as exc:  # noqa: BLE001 - what a reply holds is its sender's fault, not the round's
            return str(exc) or type(exc).__name__
        return ""

    def _check_reply(self, commit: int, req: Request, rep: Reply) -> None:
        i = req.party
        if rep.invalid:
            raise ValueError(rep.invalid)
        if rep.party != i:
            raise ValueError(f"a reply for party {rep.party} in place of party {i}")
        self._check_retransmissions(req, rep.retransmissions)
        if rep.need_restore:
            if self.restore_point[i] is None:
                raise ValueError("asked to be restored, but never committed a payload to restore it from")
            if rep.computed != -1 or rep.rejected or rep.outgoing or rep.final is not None:
                raise ValueError("a request to be restored carries no computation, refusal or message")
            return
        if rep.computed not in (-1, req.task):
            raise ValueError(f"reports computing iteration {rep.computed}, its task was {req.task}")
        if rep.rejected:
            self._check_refusals(req, rep.rejected)
            if rep.computed != -1 or rep.outgoing or rep.final is not None:
                raise ValueError("refused payloads, yet reports a computation, messages or a final message")
            return
        if rep.outgoing or (commit <= self.T and (self.pending[i] is None or rep.computed == req.task)):
            if commit > self.T:
                raise ValueError("sent peer messages after the last iteration")
            self._check_commit(commit, i, rep.outgoing)
        if rep.final is not None or rep.final_omega is not None:
            if not req.final:
                raise ValueError("sent a final message it was not asked for")
            self._check_final(rep)
        elif req.final and req.task == self.T and rep.computed == self.T:
            raise ValueError("computed the last iteration but sent no final message")

    def _check_retransmissions(self, req: Request, retransmissions: list[Outgoing]) -> None:
        """Only payloads the request asked for, each once, of the round's payload size."""
        asked = {(u, r) for (u, r, _) in req.retransmit}
        seen: set[tuple[int, int]] = set()
        for m in retransmissions:
            key = (m.iteration, m.receiver)
            if key not in asked:
                who = self.name(m.receiver) if _index(m.receiver, self.n) else f"party {m.receiver!r}"
                raise ValueError(f"retransmitted a payload of iteration {m.iteration!r} for {who} that was "
                                 "not asked for")
            if key in seen:
                raise ValueError(f"retransmitted its payload of iteration {m.iteration} for "
                                 f"{self.name(m.receiver)} twice")
            seen.add(key)
            self._check_payload(m.payload)

    def _check_refusals(self, req: Request, rejected: list[tuple[int, int]]) -> None:
        """Refusals name distinct senders of payloads the party was sent, with a known reason."""
        if req.task < 0:
            raise ValueError("refused payloads without a task")
        sent = {m.sender for m in req.incoming}
        seen: set[int] = set()
        for s, code in rejected:
            if s not in sent:
                raise ValueError(f"refused a payload from party {s!r} that it was not sent")
            if s in seen:
                raise ValueError(f"refused the payload of {self.name(s)} twice")
            seen.add(s)
            Rejection(code)  # ValueError: an unknown reason

    def _check_payload(self, payload: bytes) -> None:
        if not isinstance(payload, (bytes, bytearray)) or len(payload) != self.payload_bytes:
            size = len(payload) if isinstance(payload, (bytes, bytearray)) else type(payload).__name__
            raise ValueError(f"a payload of {size} bytes, the round's payloads have {self.payload_bytes}")

    def _check_final(self, rep: Reply) -> None:
        """A final message must be finite, of the round's dimension, with a weight omega in (0, n]: the
        weights of all messages add up to the injected shares, at most one per party (Eq. (9)), and a
        finalist's is positive. A zero or negative omega would silently shrink or flip the average."""
        y = None if rep.final is None else np.asarray(rep.final, dtype=np.float64)
        if y is None or y.shape != (self.d,) or not np.all(np.isfinite(y)):
            raise ValueError("missing or malformed final message")
        omega = rep.final_omega
        if not isinstance(omega, (int, float)) or not math.isfinite(omega) \
                or not 0.0 < omega <= self.n * (1 + 1e-9):
            raise ValueError(f"final message with weight omega = {omega}, outside (0, {self.n}]")

    def _check_commit(self, u: int, i: int, outgoing: list[Outgoing]) -> None:
        """A commit to ``u``: its own messages for ``u`` to distinct other parties, column stochastic, of
        the round's payload size; with ``neighbors`` known, exactly k of them, each of weight 1/(k+1)."""
        if not outgoing:
            raise ValueError("a commit must send at least one message")
        if any(m.iteration != u for m in outgoing):
            raise ValueError(f"a commit to iteration {u} holds messages for another iteration")
        msgs = Messages(np.array([m.sender for m in outgoing], dtype=np.int64),
                        np.array([m.receiver for m in outgoing], dtype=np.int64),
                        np.array([m.weight for m in outgoing], dtype=np.float64))
        if np.any(msgs.senders != i):
            raise ValueError("a party can only send its own messages")
        check_column_stochastic(msgs, self.n, where=f"its commit to iteration {u}")
        for m in outgoing:
            self._check_payload(m.payload)
        if self.k is not None:
            if len(outgoing) != self.k:
                raise ValueError(f"sent {len(outgoing)} messages at iteration {u}; every party sends k = "
                                 f"{self.k}")
            if np.any(np.abs(msgs.weights - 1.0 / (self.k + 1)) > 1e-12):
                raise ValueError(f"message weights other than 1/(k+1) = {1.0 / (self.k + 1):.6g} at "
                                 f"iteration {u}")

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



def _index(value: object, n: int) -> bool:
    """Whether ``value`` is a party index in [0, n)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and 0 <= value < n


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
    to ``final_retries`` more exchanges for final messages still missing; then :meth:`RoundRelay.close`."""
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
    relay.close()


def drive(relay: RoundRelay, exchange: Exchange, final_retries: int = 2,
          progress: Progress | None = None) -> None:
    """Run a round: :func:`run_iterations`, then :func:`collect_finals`."""
    run_iterations(relay, exchange, progress)
    collect_finals(relay, exchange, final_retries, progress)
