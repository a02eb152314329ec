"""Binary encoding of relay requests and replies (one ``bytes`` field of a Flower ``ConfigRecord``).

A compact, versioned format (little-endian ``struct``s and length-prefixed payloads) instead of one
record field per item: Flower converts each record field separately, which costs more than the
cryptography of an exchange. Parsing checks every length and raises ``ValueError`` on anything
malformed, so a broken message never becomes data; what a well-formed reply holds is validated by the
relay (:mod:`.relay`). Reading allocates no more than the message's own size.
"""

from __future__ import annotations

import struct
from functools import lru_cache
from typing import Any

import numpy as np

from ..protocol.schedules import InjectionSchedule
from .relay import Outgoing, Reply, Request
from .shared import RoundParams

__all__ = ["encode_request", "decode_request", "encode_reply", "decode_reply", "peek_request", "FIELD",
           "MissingRoster", "ROSTER_ENTRY_BYTES", "pack_roster", "unpack_roster"]

FIELD = "m"  # the ConfigRecord key holding the encoded message
_REQ, _REP = b"INQ1", b"INP2"  # INP2: refusals carry their reason
_SCHEDULES = {"incremental": 0, "early": 1, "custom": 2}
_TAIL_CODE = 3  # incremental(T, tail=L) travels as the code 3 + L (L <= 252): no dense (c, Z) per request
_PRECISIONS = {"float32": 4, "float64": 8}
_REQ_HEAD = "<4sqqqddBBqqBqqdIIBB"  # magic .. has_restore, has_roster
# magic, computed, need_restore, has_roster, n_rej, out_iter, n_out, n_rt, has_final; then the refused
# payloads' senders (i8) and reasons (u1, relay.Rejection)
_REP_HEAD = "<4sqBBIqIIB"


ROSTER_ENTRY_BYTES = 8 + 32  # per party: node id (u64) and X25519 public key


class MissingRoster(ValueError):
    """A request that leaves out the roster (the node said it keeps it) reached a node without one."""


def pack_roster(ids: list[int], public_keys: list[bytes]) -> bytes:
    """The roster as bytes: the node ids (u64), then the public keys (32 bytes each)."""
    if len(ids) != len(public_keys) or any(len(k) != 32 for k in public_keys):
        raise ValueError("a roster needs one 32-byte public key per node id")
    return np.asarray(ids, dtype="<u8").tobytes() + b"".join(public_keys)


def unpack_roster(blob: bytes) -> tuple[list[int], list[bytes]]:
    """Inverse of :func:`pack_roster`; ``ValueError`` if ``blob`` cannot be a roster."""
    n, rest = divmod(len(blob), ROSTER_ENTRY_BYTES)
    if rest or n == 0:
        raise ValueError(f"a roster has {ROSTER_ENTRY_BYTES} bytes per node, got {len(blob)} bytes")
    ids = np.frombuffer(blob[: 8 * n], dtype="<u8").tolist()
    keys = blob[8 * n:]
    return [int(v) for v in ids], [keys[32 * j: 32 * (j + 1)] for j in range(n)]


class _Reader:
    def __init__(self, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError("expected bytes")
        self.data, self.pos = bytes(data), 0

    def take(self, fmt: str) -> tuple[Any, ...]:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.data):
            raise ValueError("message truncated")
        out = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += size
        return out

    def blob(self) -> bytes:
        (size,) = self.take("<I")
        if self.pos + size > len(self.data):
            raise ValueError("message truncated")
        out = self.data[self.pos:self.pos + size]
        self.pos += size
        return out

    def raw(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise ValueError("message truncated")
        out = self.data[self.pos:self.pos + size]
        self.pos += size
        return out

    def done(self) -> None:
        if self.pos != len(self.data):
            raise ValueError("trailing bytes in message")


def _blob(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def encode_request(req: Request, params: RoundParams, with_roster: bool = True) -> bytes:
    """``with_roster=False`` leaves out the roster and public keys (O(n) per request), which a node
    keeps once it has acknowledged them."""
    code = schedule_code(params.schedule)
    parts = [struct.pack(
        _REQ_HEAD, _REQ, params.round, params.iterations, params.neighbors, params.sigma_star,
        params.sigma_delta, _PRECISIONS[params.precision], code, req.party, req.commit,
        int(req.final), req.version, req.task, req.delivered_weight, len(req.incoming), len(req.retransmit),
        int(req.restore is not None), int(with_roster))]
    if code == _SCHEDULES["custom"]:
        parts.append(np.ascontiguousarray(params.schedule.c, dtype="<f8").tobytes())
        parts.append(np.ascontiguousarray(params.schedule.Z, dtype="<f8").tobytes())
    if with_roster:
        parts.append(struct.pack("<I", len(params.roster)))
        parts.append(pack_roster(params.roster, params.public_keys))
    for m in req.incoming:
        parts.append(struct.pack("<qd", m.sender, m.weight) + _blob(m.payload))
    for u, r, v in req.retransmit:
        parts.append(struct.pack("<qqq", u, r, v))
    if req.restore is not None:
        own = req.restore
        parts.append(struct.pack("<qq", own.receiver, own.iteration) + _blob(own.payload))
    return b"".join(parts)


def peek_request(data: bytes) -> tuple[int, int, int]:
    """``(round, commit, party)`` of an encoded request, from its header only (e.g. for client mods)."""
    head = _Reader(data).take(_REQ_HEAD)
    if head[0] != _REQ:
        raise ValueError("not an IncA request")
    return int(head[1]), int(head[9]), int(head[8])


def decode_request(data: bytes, roster: tuple[list[int], list[bytes]] | None = None
                   ) -> tuple[Request, RoundParams]:
    """Parse a request; ``roster`` (ids, public keys) is used when the request carries none."""
    rd = _Reader(data)
    (magic, round_, T, k, s_star, s_delta, prec, kind, party, commit, final, version, task, dw, n_in,
     n_rt, has_restore, has_roster) = rd.take(_REQ_HEAD)
    if magic != _REQ:
        raise ValueError("not an IncA request")
    if T < 1 or T > 100_000 or prec not in (4, 8) or kind - _TAIL_CODE > T:
        raise ValueError("malformed request header")
    if kind == 2:
        c = np.frombuffer(rd.raw(8 * (T + 1)), dtype="<f8")
        Z = np.frombuffer(rd.raw(8 * (T + 1) * T), dtype="<f8").reshape(T + 1, T)
        schedule = InjectionSchedule.custom(c, Z)
    else:
        schedule = _named_schedule(kind, T)
    if has_roster:
        (n,) = rd.take("<I")
        roster = unpack_roster(rd.raw(ROSTER_ENTRY_BYTES * n))
    elif roster is None:
        raise MissingRoster("request without roster, and none given")
    incoming = []
    for _ in range(n_in):
        sender, weight = rd.take("<qd")
        incoming.append(Outgoing(sender, party, weight, rd.blob(), task))
    retransmit = [rd.take("<qqq") for _ in range(n_rt)]
    restore = None
    if has_restore:
        receiver, iteration = rd.take("<qq")
        restore = Outgoing(party, receiver, 0.0, rd.blob(), iteration)
    rd.done()
    params = RoundParams(round_, T, k, s_star, s_delta, schedule, list(roster[0]), list(roster[1]),
                         "float32" if prec == 4 else "float64")
    req = Request(party, commit, version, task, incoming, dw, [tuple(x) for x in retransmit], bool(final),
                  restore)
    return req, params


def schedule_code(schedule: InjectionSchedule) -> int:
    """The request header's schedule byte: 0 D_Inc, 1 D_EI, 3 + L the value-free tail L, 2 any other
    (its dense (c, Z) follow the header)."""
    if schedule.name in ("incremental", "early"):
        return _SCHEDULES[schedule.name]
    tail = schedule.tail
    if tail is not None and 1 <= tail <= 255 - _TAIL_CODE:
        return _TAIL_CODE + tail
    return _SCHEDULES["custom"]


@lru_cache(maxsize=64)
def _named_schedule(kind: int, iterations: int) -> InjectionSchedule:
    """Built once per (kind, T) in a process, not once per request; shared, hence read-only."""
    if kind >= _TAIL_CODE:
        schedule = InjectionSchedule.incremental(iterations, tail=kind - _TAIL_CODE)
    else:
        schedule = InjectionSchedule.resolve("incremental" if kind == 0 else "early", iterations)
    schedule.c.flags.writeable = False
    schedule.Z.flags.writeable = False
    return schedule


def encode_reply(rep: Reply, has_roster: bool = False) -> bytes:
    out_iteration = rep.outgoing[0].iteration if rep.outgoing else -1
    parts = [struct.pack(_REP_HEAD, _REP, rep.computed, int(rep.need_restore), int(has_roster),
                         len(rep.rejected), out_iteration, len(rep.outgoing), len(rep.retransmissions),
                         int(rep.final is not None))]
    parts.append(np.asarray([s for s, _ in rep.rejected], dtype="<i8").tobytes())
    parts.append(np.asarray([why for _, why in rep.rejected], dtype="u1").tobytes())
    for m in rep.outgoing:
        parts.append(struct.pack("<qd", m.receiver, m.weight) + _blob(m.payload))
    for m in rep.retransmissions:
        parts.append(struct.pack("<qq", m.iteration, m.receiver) + _blob(m.payload))
    if rep.final is not None:
        y = np.ascontiguousarray(rep.final, dtype="<f8")
        parts.append(struct.pack("<dI", float(rep.final_omega), y.size) + y.tobytes())
    return b"".join(parts)


def decode_reply(data: bytes, party: int) -> tuple[Reply, bool]:
    """Parse a reply of ``party``; returns it and whether the node keeps the roster."""
    rd = _Reader(data)
    magic, computed, need_restore, has_roster, n_rej, out_iter, n_out, n_rt, has_final = rd.take(_REP_HEAD)
    if magic != _REP:
        raise ValueError("not an IncA reply")
    senders = np.frombuffer(rd.raw(8 * n_rej), dtype="<i8").tolist()
    reasons = np.frombuffer(rd.raw(n_rej), dtype="u1").tolist()
    rep = Reply(party, computed=computed, rejected=[(int(s), int(why)) for s, why in zip(senders, reasons)],
                need_restore=bool(need_restore))
    for _ in range(n_out):
        receiver, weight = rd.take("<qd")
        rep.outgoing.append(Outgoing(party, receiver, weight, rd.blob(), out_iter))
    for _ in range(n_rt):
        iteration, receiver = rd.take("<qq")
        rep.retransmissions.append(Outgoing(party, receiver, 0.0, rd.blob(), iteration))
    if has_final:
        omega, d = rd.take("<dI")
        rep.final = np.frombuffer(rd.raw(8 * d), dtype="<f8").copy()
        rep.final_omega = omega
    rd.done()
    return rep, bool(has_roster)
