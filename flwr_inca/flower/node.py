"""A party's side of one relay exchange: open payloads, compute, store, seal and send.

A party keeps its round data in node-local storage (:class:`NodeStore`): its value, written once
when it joins the round, and every state it computes, as an immutable version per iteration. The relay
tells it which version to build on, so retries and stragglers are harmless; if the version is gone
(storage lost), the relay sends back one of the party's own committed payloads, which it can decrypt.
"""

from __future__ import annotations

import hashlib
import os
import secrets as _secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from .._io import atomic_write_bytes
from ..protocol.party import Incoming, IncaParty, PartyNoise, PartyState
from ..protocol.schedules import InjectionSchedule
from .crypto import KeyPair, PayloadRejected, associated_data, open_sealed, pair_key, seal
from .relay import Outgoing, Reply, Request

__all__ = ["RoundSecrets", "RoundParams", "NodeStore", "MemoryStore", "DirectoryStore", "handle_exchange"]


@dataclass(frozen=True)
class RoundSecrets:
    """What a party keeps secret for one round (written once, when it joins the round)."""

    round: int
    noise_secret: bytes  # seeds eta* and the cancelling terms
    private_key: bytes  # X25519

    @classmethod
    def generate(cls, round: int, fixed_seed: int | None = None, node: int = 0) -> RoundSecrets:
        """Fresh secrets from the OS CSPRNG; ``fixed_seed`` makes them reproducible (tests only)."""
        if fixed_seed is None:
            return cls(round, _secrets.token_bytes(32), KeyPair().private_bytes())

        def derive(tag: bytes) -> bytes:
            return hashlib.sha256(struct.pack("<qqQ", fixed_seed, round, node) + tag).digest()

        return cls(round, derive(b"noise"), derive(b"x25519"))

    @property
    def public_key(self) -> bytes:
        return KeyPair(self.private_key).public


@dataclass(frozen=True)
class RoundParams:
    """Protocol parameters of a round, sent by the relay."""

    round: int
    iterations: int
    neighbors: int
    sigma_star: float
    sigma_delta: float
    schedule: InjectionSchedule
    roster: list[int]  # node ids; the party index is the position
    public_keys: list[bytes]
    precision: str = "float64"  # of messages and states: "float32" or "float64"


class NodeStore(Protocol):
    """Node-local storage of a party's round data (every item is immutable once written).

    ``save_value`` starts a round: it drops all round data kept so far, of any round, including an
    earlier instance of the same round number (a restarted strategy numbers rounds from 1 again, and
    its secrets are fresh: nothing cached for the old instance may be used). ``save_blob``/``load_blob``
    keep small named items of the round (the roster, caches).
    """

    def save_value(self, round: int, value: np.ndarray) -> None: ...
    def load_value(self, round: int) -> np.ndarray | None: ...
    def save_state(self, round: int, version: int, data: bytes) -> None: ...
    def load_state(self, round: int, version: int) -> bytes | None: ...
    def save_blob(self, round: int, name: str, data: bytes) -> None: ...
    def load_blob(self, round: int, name: str) -> bytes | None: ...


class MemoryStore:
    """In-process store (tests, single-process simulations)."""

    def __init__(self) -> None:
        self.values: dict[int, np.ndarray] = {}
        self.states: dict[tuple[int, int], bytes] = {}
        self.blobs: dict[tuple[int, str], bytes] = {}

    def save_value(self, round: int, value: np.ndarray) -> None:
        self.values.clear()
        self.states.clear()
        self.blobs.clear()
        self.values[round] = np.array(value, dtype=np.float64)

    def load_value(self, round: int) -> np.ndarray | None:
        return self.values.get(round)

    def save_state(self, round: int, version: int, data: bytes) -> None:
        self.states[(round, version)] = data

    def load_state(self, round: int, version: int) -> bytes | None:
        return self.states.get((round, version))

    def save_blob(self, round: int, name: str, data: bytes) -> None:
        self.blobs[(round, name)] = data

    def load_blob(self, round: int, name: str) -> bytes | None:
        return self.blobs.get((round, name))


class DirectoryStore:
    """Files under ``root`` (private to the node: mode 0700); every write is atomic.

    Layout: ``round-<r>/value.f64`` and ``round-<r>/state-<version>.bin``. Joining a round removes
    all earlier round data. States are not fsynced: a state lost in a crash is restored through the relay.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _dir(self, round: int) -> Path:
        return self.root / f"round-{round}"

    def save_value(self, round: int, value: np.ndarray) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)  # also when it existed: the round data is the node's secret
        for old in self.root.glob("round-*"):  # every earlier round, this number included
            for f in old.iterdir():
                f.unlink(missing_ok=True)
            old.rmdir()
        atomic_write_bytes(self._dir(round) / "value.f64", np.ascontiguousarray(value, dtype=np.float64).tobytes())

    def load_value(self, round: int) -> np.ndarray | None:
        try:
            return np.frombuffer((self._dir(round) / "value.f64").read_bytes(), dtype=np.float64).copy()
        except FileNotFoundError:
            return None

    def save_state(self, round: int, version: int, data: bytes) -> None:
        self.save_blob(round, f"state-{version}", data)

    def load_state(self, round: int, version: int) -> bytes | None:
        return self.load_blob(round, f"state-{version}")

    def save_blob(self, round: int, name: str, data: bytes) -> None:
        # atomic, not durable: what a crash loses is restored through the relay
        atomic_write_bytes(self._dir(round) / f"{name}.bin", data, durable=False)

    def load_blob(self, round: int, name: str) -> bytes | None:
        try:
            return (self._dir(round) / f"{name}.bin").read_bytes()
        except FileNotFoundError:
            return None


def handle_exchange(request: Request, params: RoundParams, me: int, secrets: RoundSecrets,
                    store: NodeStore) -> Reply:
    """Process one request for party index ``me``, whose round data is in ``store``."""
    if not (0 <= me < len(params.roster)):
        raise ValueError("party is not in the roster")
    if secrets.round != params.round:
        raise ValueError(f"this party joined round {secrets.round}, the request is for round {params.round}")
    noise = PartyNoise(secrets.noise_secret, params.round)
    cache = f"xtilde-{params.sigma_star!r}"  # x + eta*: drawn once per round
    cached = store.load_blob(params.round, cache)
    value = None
    x_tilde = np.frombuffer(cached, dtype=np.float64).copy() if cached is not None else None
    if x_tilde is None:
        value = store.load_value(params.round)
        if value is None:
            raise RuntimeError(f"the node has no value for round {params.round} (storage lost)")
    precision = np.dtype(params.precision)
    keys = KeyPair(secrets.private_key)
    if keys.public != params.public_keys[me]:
        raise ValueError("the roster does not hold this party's public key")
    party = IncaParty(value, params.schedule, params.sigma_star, params.sigma_delta, noise, precision, x_tilde)
    if x_tilde is None:
        store.save_blob(params.round, cache, party.x_tilde.tobytes())
    node, d = params.roster[me], party.d
    pair_keys: dict[int, bytes] = {}

    def key_with(j: int) -> bytes:
        if j not in pair_keys:
            pair_keys[j] = pair_key(keys, params.public_keys[j], params.round)
        return pair_keys[j]

    def message_ad(sender: int, receiver: int, iteration: int) -> bytes:
        return associated_data(params.roster[sender], params.roster[receiver], params.round, iteration)

    def load(version: int) -> PartyState | None:
        if version < 0:
            return party.initial_state()
        data = store.load_state(params.round, version)
        try:
            return None if data is None else PartyState.from_bytes(data)
        except ValueError:  # damaged: as good as lost, the relay can restore it
            return None

    if request.restore is not None:  # our own committed payload: we can open it (pair keys are symmetric)
        m = request.restore
        old = PartyState.from_bytes(open_sealed(key_with(m.receiver), m.payload,
                                                message_ad(me, m.receiver, m.iteration)))
        store.save_state(params.round, old.last, old.to_bytes(precision))
    state = load(request.version)
    if state is None:
        return Reply(me, need_restore=True)
    if state.y.size != d or state.last != max(request.version, -1):
        raise ValueError("stored state does not match the relay's record")
    reply = Reply(me)
    for iteration, receiver, version in request.retransmit:
        old = load(version)
        if old is not None:
            payload = seal(key_with(receiver), old.to_bytes(precision), message_ad(me, receiver, iteration))
            reply.retransmissions.append(Outgoing(me, receiver, 0.0, payload, iteration))
    if request.task >= 0:
        incoming = []
        for m in request.incoming:
            try:
                sent = PartyState.from_bytes(open_sealed(key_with(m.sender), m.payload,
                                                         message_ad(m.sender, me, request.task)))
                if sent.y.size != d:
                    raise PayloadRejected("payload has the wrong dimension")
            except (PayloadRejected, ValueError):
                reply.rejected.append(m.sender)
                continue
            incoming.append(Incoming(m.weight, sent.y, sent.omega))
        if reply.rejected:
            return reply
        state = party.compute(state, request.task, incoming, request.delivered_weight)
        store.save_state(params.round, request.task, state.to_bytes(precision))  # before anyone sees it
        reply.computed = request.task
    T = params.iterations
    if request.commit <= T:
        n = len(params.roster)
        k = min(params.neighbors, n - 1)
        digest = hashlib.sha256(secrets.noise_secret + struct.pack("<qq", params.round, request.commit) + b"peers")
        rng = np.random.default_rng(np.frombuffer(digest.digest()[:16], dtype=np.uint64))
        others = np.array([j for j in range(n) if j != me])
        plaintext = state.to_bytes(precision)
        for r in rng.choice(others, size=k, replace=False).tolist():
            payload = seal(key_with(r), plaintext, message_ad(me, r, request.commit))
            reply.outgoing.append(Outgoing(me, int(r), 1.0 / (k + 1), payload, request.commit))
    elif request.final and state.last == T:
        reply.final = state.y
        reply.final_omega = state.omega
    return reply
