"""A party's side of one relay exchange: open payloads, compute, store, seal and send.

A party keeps its round data in node-local storage (:class:`NodeStore`): its value, written once
when it joins the round, and every state it computes, as an immutable version per iteration. The relay
tells it which version to build on, so retries and stragglers are harmless; if the version is gone
(storage lost), the relay sends back one of the party's own committed payloads, which it can decrypt.

A party draws its round's unit noise into storage when it joins (:func:`draw_noise_ahead`, beside
local training), so that a mixing step reads the two rows it needs instead of drawing them.
"""

from __future__ import annotations

import hashlib
import os
import secrets as _secrets
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from .._io import atomic_write_bytes
from ..protocol.party import Incoming, IncaParty, PartyNoise, PartyState
from ..protocol.schedules import InjectionSchedule
from .crypto import KeyPair, PayloadRejected, associated_data, open_sealed, pair_key, seal
from .relay import Outgoing, Reply, Request

__all__ = ["RoundSecrets", "RoundParams", "NodeStore", "MemoryStore", "DirectoryStore", "StoredNoise",
           "draw_noise_ahead", "handle_exchange", "choose_neighbors"]


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
    keep named items of the round (the roster, caches); ``load_blob_range`` reads ``size`` bytes of one
    from ``offset`` (None if the item is missing or shorter).
    """

    def save_value(self, round: int, value: np.ndarray) -> None: ...
    def load_value(self, round: int) -> np.ndarray | None: ...
    def save_state(self, round: int, version: int, data: bytes) -> None: ...
    def load_state(self, round: int, version: int) -> bytes | None: ...
    def save_blob(self, round: int, name: str, data: bytes) -> None: ...
    def load_blob(self, round: int, name: str) -> bytes | None: ...
    def load_blob_range(self, round: int, name: str, offset: int, size: int) -> bytes | None: ...


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

    def load_blob_range(self, round: int, name: str, offset: int, size: int) -> bytes | None:
        blob = self.blobs.get((round, name))
        return None if blob is None or len(blob) < offset + size else blob[offset:offset + size]


class DirectoryStore:
    """Files under ``root`` (private to the node: mode 0700).

    Layout: ``round-<r>/value.f64``, ``round-<r>/states.bin`` and other named items (``<name>.bin``;
    ``noise.bin`` holds the unit noise drawn ahead, as secret as the value). Joining a round removes
    all earlier round data. Named items are replaced atomically. The states of a round (all of one
    size) share one file of checksummed slots, one per version, written in place: a mixing step then
    creates no file, which costs more than the rest of its storage I/O. A slot that a crash left torn
    fails its checksum and reads as missing. Nothing is fsynced: what a crash loses is restored
    through the relay.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = os.fspath(root)  # plain strings on the hot path: pathlib costs more than the I/O

    @property
    def root(self) -> Path:
        return Path(self._root)

    def _file(self, round: int, name: str) -> str:
        return os.path.join(self._root, f"round-{round}", name)

    def save_value(self, round: int, value: np.ndarray) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)  # also when it existed: the round data is the node's secret
        for old in self.root.glob("round-*"):  # every earlier round, this number included
            for f in old.iterdir():
                f.unlink(missing_ok=True)
            old.rmdir()
        value = np.ascontiguousarray(value, dtype=np.float64)
        atomic_write_bytes(self._file(round, "value.f64"), value.tobytes())

    def load_value(self, round: int) -> np.ndarray | None:
        data = self._read(self._file(round, "value.f64"))
        return None if data is None else np.frombuffer(data, dtype=np.float64).copy()

    # states.bin: a header (u64 slot size), then at 8 + version * slot a slot holding
    # (u32 CRC-32 of the state, u32 its length, the state)
    _SLOT_HEAD = struct.Struct("<II")

    def save_state(self, round: int, version: int, data: bytes) -> None:
        if version < 0:
            raise ValueError(f"state version must be >= 0, got {version}")
        path = self._file(round, "states.bin")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except FileNotFoundError:  # the round's directory does not exist yet
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            slot = self._SLOT_HEAD.size + len(data)
            head = os.pread(fd, 8, 0)
            if len(head) < 8:  # a new file (concurrent creators write the same header)
                os.pwrite(fd, struct.pack("<Q", slot), 0)
            elif struct.unpack("<Q", head)[0] != slot:
                raise ValueError("states of one round must all have the same size")
            os.pwrite(fd, self._SLOT_HEAD.pack(zlib.crc32(data), len(data)) + data, 8 + version * slot)
        finally:
            os.close(fd)

    def load_state(self, round: int, version: int) -> bytes | None:
        try:
            fd = os.open(self._file(round, "states.bin"), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            head = os.pread(fd, 8, 0)
            if len(head) < 8 or version < 0:
                return None
            (slot,) = struct.unpack("<Q", head)
            record = os.pread(fd, slot, 8 + version * slot)
        finally:
            os.close(fd)
        if len(record) != slot:
            return None
        crc, size = self._SLOT_HEAD.unpack_from(record)
        data = record[self._SLOT_HEAD.size:]
        return data if size == len(data) and zlib.crc32(data) == crc else None  # never written, or torn

    def save_blob(self, round: int, name: str, data: bytes) -> None:
        # atomic, not durable: what a crash loses is restored through the relay
        atomic_write_bytes(self._file(round, f"{name}.bin"), data, durable=False)

    def load_blob(self, round: int, name: str) -> bytes | None:
        return self._read(self._file(round, f"{name}.bin"))

    def load_blob_range(self, round: int, name: str, offset: int, size: int) -> bytes | None:
        try:
            fd = os.open(self._file(round, f"{name}.bin"), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        return data if len(data) == size else None

    @staticmethod
    def _read(path: str) -> bytes | None:
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None


class StoredNoise:
    """:class:`PartyNoise`'s cache for one party, round and mixing step: unit draws made ahead into node
    storage (:func:`draw_noise_ahead`), read by row; a missing row is drawn on demand.

    Reading row k also reads row k + 1, which D_Inc's next request asks for (it cancels eta_k and
    injects eta_(k+1) in the same step): one read per step.
    """

    def __init__(self, store: NodeStore, round: int) -> None:
        self.store, self.round = store, round
        self.rows: dict[tuple[int, int], np.ndarray] = {}
        self.absent = False  # nothing drawn ahead: draw on demand without asking storage again

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        if key in self.rows:
            return self.rows[key]
        if self.absent:
            return None
        k, d = key
        row = 8 * d
        data = self.store.load_blob_range(self.round, "noise", k * row, 2 * row)
        if data is None:  # the last row, or nothing drawn ahead
            data = self.store.load_blob_range(self.round, "noise", k * row, row)
        if data is None:
            self.absent = True
            return None
        draws = np.frombuffer(data, dtype=np.float64)
        for j in range(len(draws) // d):
            self.rows[(k + j, d)] = draws[j * d:(j + 1) * d]
        return self.rows[key]

    def __setitem__(self, key: tuple[int, int], draw: np.ndarray) -> None:
        self.rows[key] = draw


def draw_noise_ahead(store: NodeStore, secrets: RoundSecrets, iterations: int, d: int) -> None:
    """Draw the party's unit noise of the round (row 0: ``eta*``, row k: ``eta_k``, k = 1..T) into the
    ``noise`` item of ``store`` now, beside local training. Same numbers as drawn on demand."""
    noise = PartyNoise(secrets.noise_secret, secrets.round)
    rows = [noise.star(d)] + [noise.term(k, d) for k in range(1, iterations + 1)]
    store.save_blob(secrets.round, "noise", np.concatenate(rows).tobytes())


def handle_exchange(request: Request, params: RoundParams, me: int, secrets: RoundSecrets,
                    store: NodeStore) -> Reply:
    """Process one request for party index ``me``, whose round data is in ``store``."""
    if not (0 <= me < len(params.roster)):
        raise ValueError("party is not in the roster")
    if secrets.round != params.round:
        raise ValueError(f"this party joined round {secrets.round}, the request is for round {params.round}")
    noise = PartyNoise(secrets.noise_secret, params.round, StoredNoise(store, params.round))
    precision = np.dtype(params.precision)
    keys = KeyPair(secrets.private_key)
    if keys.public != params.public_keys[me]:
        raise ValueError("the roster does not hold this party's public key")
    party = _party(params, noise, precision, store)
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
        encoded = state.to_bytes(precision)
        store.save_state(params.round, request.task, encoded)  # before anyone sees it
        reply.computed = request.task
    T = params.iterations
    if request.commit <= T:
        plaintext = encoded if reply.computed >= 0 else state.to_bytes(precision)
        n = len(params.roster)
        k = min(params.neighbors, n - 1)
        for r in choose_neighbors(secrets.noise_secret, params.round, request.commit, me, n, k):
            payload = seal(key_with(r), plaintext, message_ad(me, r, request.commit))
            reply.outgoing.append(Outgoing(me, r, 1.0 / (k + 1), payload, request.commit))
    elif request.final and state.last == T:
        reply.final = state.y
        reply.final_omega = state.omega
    return reply


def choose_neighbors(noise_secret: bytes, round: int, iteration: int, me: int, n: int, k: int) -> list[int]:
    """The ``k`` out-neighbours party ``me`` picks among the other ``n - 1`` for ``iteration``.

    Uniform without replacement (Floyd's algorithm), driven by SHA-256 of the party's own secret in
    counter mode (bias at most n / 2**64), so the relay has no say and a retry picks the same peers.
    """
    if not (0 <= k <= n - 1):
        raise ValueError(f"neighbors must be in [0, n - 1] = [0, {n - 1}], got {k}")
    head = noise_secret + struct.pack("<qq", round, iteration) + b"peers"
    picks: list[int] = []
    taken: set[int] = set()
    for j, top in enumerate(range(n - 1 - k, n - 1)):  # Floyd: a uniform k-subset of range(n - 1)
        draw = int.from_bytes(hashlib.sha256(head + struct.pack("<q", j)).digest()[:8], "little") % (top + 1)
        pick = top if draw in taken else draw
        taken.add(pick)
        picks.append(pick)
    return [p + (p >= me) for p in picks]  # skip ``me`` itself


def _party(params: RoundParams, noise: PartyNoise, precision: np.dtype, store: NodeStore) -> IncaParty:
    """The party's computations, with ``x + eta*`` computed once per round and kept in ``store``."""
    name = f"xtilde-{params.sigma_star!r}"
    cached = store.load_blob(params.round, name)
    sigmas = (params.sigma_star, params.sigma_delta)
    if cached is not None:
        x_tilde = np.frombuffer(cached, dtype=np.float64)
        return IncaParty(None, params.schedule, *sigmas, noise, precision, x_tilde)
    value = store.load_value(params.round)
    if value is None:
        raise RuntimeError(f"the node has no value for round {params.round} (storage lost)")
    party = IncaParty(value, params.schedule, *sigmas, noise, precision)
    store.save_blob(params.round, name, party.x_tilde.tobytes())
    return party
