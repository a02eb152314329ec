"""A party's side of one relay exchange: open payloads, compute, seal and send.

Stateless apart from write-once round secrets: the party's mutable state arrives sealed in the
request and leaves sealed in the reply, so retries and stragglers are harmless.
"""

from __future__ import annotations

import hashlib
import secrets as _secrets
import struct
from dataclasses import dataclass

import numpy as np

from ..protocol.party import Incoming, IncaParty, PartyNoise, PartyState
from ..protocol.schedules import InjectionSchedule
from .crypto import KeyPair, PayloadRejected, associated_data, open_sealed, pair_key, seal
from .relay import Outgoing, Reply, Request

__all__ = ["RoundSecrets", "RoundParams", "handle_exchange", "encode_message", "decode_message"]


@dataclass(frozen=True)
class RoundSecrets:
    """What a party keeps for one round (written once, when it joins the round)."""

    round: int
    noise_secret: bytes  # seeds eta* and the cancelling terms
    state_key: bytes  # seals the party's own state
    private_key: bytes  # X25519

    @classmethod
    def generate(cls, round: int, fixed_seed: int | None = None, node: int = 0) -> RoundSecrets:
        """Fresh secrets from the OS CSPRNG; ``fixed_seed`` makes them reproducible (tests only)."""
        if fixed_seed is None:
            return cls(round, _secrets.token_bytes(32), _secrets.token_bytes(32),
                       KeyPair().private_bytes())

        def derive(tag: bytes) -> bytes:
            return hashlib.sha256(struct.pack("<qqQ", fixed_seed, round, node) + tag).digest()

        return cls(round, derive(b"noise"), derive(b"state"), derive(b"x25519"))

    @property
    def public_key(self) -> bytes:
        return KeyPair(self.private_key).public


@dataclass(frozen=True)
class RoundParams:
    """Protocol parameters of a round, sent by the relay with every request."""

    round: int
    iterations: int
    neighbors: int
    sigma_star: float
    sigma_delta: float
    schedule: InjectionSchedule
    roster: list[int]  # node ids; the party index is the position
    public_keys: list[bytes]


def encode_message(y: np.ndarray, omega: float) -> bytes:
    return struct.pack("<d", omega) + np.ascontiguousarray(y, dtype=np.float64).tobytes()


def decode_message(data: bytes, d: int) -> tuple[np.ndarray, float]:
    if len(data) != 8 + 8 * d:
        raise PayloadRejected("payload has the wrong size")
    (omega,) = struct.unpack_from("<d", data)
    return np.frombuffer(data, dtype=np.float64, offset=8).copy(), omega


def _state_ad(node: int, round: int) -> bytes:
    return associated_data(node, node, round, 0, kind=b"state")


def handle_exchange(request: Request, params: RoundParams, me: int, secrets: RoundSecrets,
                    value: np.ndarray) -> Reply:
    """Process one request for party index ``me`` holding ``value`` (its clipped update, shape (d,))."""
    if not (0 <= me < len(params.roster)):
        raise ValueError("party is not in the roster")
    if secrets.round != params.round:
        raise ValueError(f"this party joined round {secrets.round}, the request is for round {params.round}")
    node = params.roster[me]
    d = int(np.asarray(value).size)
    keys = KeyPair(secrets.private_key)
    if keys.public != params.public_keys[me]:
        raise ValueError("the roster does not hold this party's public key")
    party = IncaParty(value, params.schedule, params.sigma_star, params.sigma_delta,
                      PartyNoise(secrets.noise_secret, params.round))
    pair_keys: dict[int, bytes] = {}

    def key_with(j: int) -> bytes:
        if j not in pair_keys:
            pair_keys[j] = pair_key(keys, params.public_keys[j], params.round)
        return pair_keys[j]

    def open_state(blob: bytes) -> PartyState:
        return PartyState.from_bytes(open_sealed(secrets.state_key, blob, _state_ad(node, params.round)))

    state = open_state(request.state) if request.state else party.initial_state()
    if state.y.size != d and request.state:
        raise ValueError("sealed state does not match the value's dimension")
    reply = Reply(me)
    for iteration, receiver, blob in request.retransmit:
        old = open_state(blob)
        payload = seal(key_with(receiver), encode_message(old.y, old.omega),
                       associated_data(node, params.roster[receiver], params.round, iteration))
        reply.retransmissions.append(Outgoing(me, receiver, 0.0, payload, iteration))
    if request.task >= 0:
        incoming = []
        for m in request.incoming:
            ad = associated_data(params.roster[m.sender], node, params.round, request.task)
            try:
                y, omega = decode_message(open_sealed(key_with(m.sender), m.payload, ad), d)
            except PayloadRejected:
                reply.rejected.append(m.sender)
                continue
            incoming.append(Incoming(m.weight, y, omega))
        if reply.rejected:
            return reply
        state = party.compute(state, request.task, incoming, request.delivered_weight)
        reply.computed = request.task
        reply.state = seal(secrets.state_key, state.to_bytes(), _state_ad(node, params.round))
    elif not request.state:
        raise ValueError("the party must be initialized before it can commit")
    T = params.iterations
    if request.commit <= T:
        n = len(params.roster)
        k = min(params.neighbors, n - 1)
        digest = hashlib.sha256(secrets.noise_secret + struct.pack("<qq", params.round, request.commit) + b"peers")
        rng = np.random.default_rng(np.frombuffer(digest.digest()[:16], dtype=np.uint64))
        others = np.array([j for j in range(n) if j != me])
        for r in rng.choice(others, size=k, replace=False).tolist():
            payload = seal(key_with(r), encode_message(state.y, state.omega),
                           associated_data(node, params.roster[r], params.round, request.commit))
            reply.outgoing.append(Outgoing(me, int(r), 1.0 / (k + 1), payload, request.commit))
    elif request.final and state.last == T:
        reply.final = state.y
        reply.final_omega = state.omega
    return reply
