"""A party's side of one relay exchange: open payloads, compute, store, seal and send.

A party keeps its round data in node-local storage (:mod:`.storage`): its value, written once when it
joins the round, and every state it computes, as an immutable version per iteration. The relay tells it
which version to build on, so retries and stragglers are harmless; if the version is gone (storage
lost), the relay sends back one of the party's own committed payloads, which it can decrypt.

A party draws its round's unit noise into storage when it joins (:func:`draw_noise_ahead`, beside
local training), so that a mixing step reads the two rows it needs instead of drawing them.

A party checks every payload it is sent before using it: it must decrypt (which binds sender, receiver,
round and iteration), be a state of the round's dimension, and hold finite values of a magnitude whose
sums cannot overflow (:func:`state_limit`) with a weight omega in ``[0, n]``. A payload that fails is
refused, naming its sender and why (:class:`~flwr_inca.flower.relay.Rejection`), and nothing is computed:
the relay sorts it out (see :mod:`.relay`). A party never sends a state that is not finite.
"""

from __future__ import annotations

import hashlib
import math
import secrets as _secrets
import struct
from dataclasses import dataclass

import numpy as np

from ..protocol.party import IncaParty, Incoming, PartyNoise, PartyState
from .crypto import KeyPair, PayloadRejected, associated_data, open_sealed, pair_key, seal
from .relay import Outgoing, Rejection, Reply, Request
from .shared import RoundParams
from .storage import NodeStore, StoredNoise

__all__ = ["RoundSecrets", "draw_noise_ahead", "handle_exchange", "choose_neighbors", "state_limit"]


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


def draw_noise_ahead(store: NodeStore, secrets: RoundSecrets, iterations: int, d: int) -> None:
    """Draw the party's unit noise of the round (row 0: ``eta*``, row k: ``eta_k``, k = 1..T) into the
    ``noise`` item of ``store`` now, beside local training. Same numbers as drawn on demand."""
    noise = PartyNoise(secrets.noise_secret, secrets.round)
    rows = [noise.star(d)] + [noise.term(k, d) for k in range(1, iterations + 1)]
    store.save_blob(secrets.round, "noise", np.concatenate(rows).tobytes())


def handle_exchange(request: Request, params: RoundParams, me: int, secrets: RoundSecrets,
                    store: NodeStore) -> Reply:
    """Process one request for party index ``me``, whose round data is in ``store``: restore what the
    relay sent back (if anything), load the state the relay accepted, re-seal payloads a receiver
    rejected, compute the requested iteration, then commit to the next one (or report the final)."""
    party = _PartySession(params, me, secrets, store)
    if request.restore is not None:
        party.restore(request.restore)
    state = party.load(request.version)
    if state is None:
        return Reply(me, need_restore=True)
    if state.y.size != party.d or state.last != max(request.version, -1):
        raise ValueError("stored state does not match the relay's record")
    reply = Reply(me)
    reply.retransmissions = party.retransmit(request.retransmit)
    encoded = None
    if request.task >= 0:
        incoming, reply.rejected = party.open_incoming(request)
        if reply.rejected:
            return reply  # no computation, hence no commit: the senders re-seal first
        state = party.mixer.compute(state, request.task, incoming, request.delivered_weight)
        if not np.all(np.isfinite(state.y)):  # cannot happen from checked inputs; never send it
            raise RuntimeError(f"party {me} computed a state that is not finite at iteration {request.task}")
        encoded = state.to_bytes(party.precision)
        store.save_state(params.round, request.task, encoded)  # before anyone sees it
        reply.computed = request.task
    if request.commit <= params.iterations:
        reply.outgoing = party.commit(request.commit, encoded or state.to_bytes(party.precision))
    elif request.final and state.last == params.iterations:
        reply.final, reply.final_omega = state.y, state.omega
    return reply


class _PartySession:
    """Party ``me``'s keys, computations and storage for one request (pairwise keys cached)."""

    def __init__(self, params: RoundParams, me: int, secrets: RoundSecrets, store: NodeStore) -> None:
        if not (0 <= me < len(params.roster)):
            raise ValueError("party is not in the roster")
        if secrets.round != params.round:
            raise ValueError(f"this party joined round {secrets.round}, the request is for round "
                             f"{params.round}")
        self.keys = KeyPair(secrets.private_key)
        if self.keys.public != params.public_keys[me]:
            raise ValueError("the roster does not hold this party's public key")
        self.params, self.me, self.secrets, self.store = params, me, secrets, store
        self.precision = np.dtype(params.precision)
        noise = PartyNoise(secrets.noise_secret, params.round, StoredNoise(store, params.round))
        self.mixer = _party(params, noise, self.precision, store)
        self.d = self.mixer.d
        self._pair_keys: dict[int, bytes] = {}

    def key_with(self, j: int) -> bytes:
        """The pairwise key with party j (the same in both directions)."""
        if j not in self._pair_keys:
            self._pair_keys[j] = pair_key(self.keys, self.params.public_keys[j], self.params.round)
        return self._pair_keys[j]

    def associated_data(self, sender: int, receiver: int, iteration: int) -> bytes:
        roster = self.params.roster
        return associated_data(roster[sender], roster[receiver], self.params.round, iteration)

    def load(self, version: int) -> PartyState | None:
        """The state computed at iteration ``version`` (-1: the initial one); None if lost or damaged."""
        if version < 0:
            return self.mixer.initial_state()
        data = self.store.load_state(self.params.round, version)
        try:
            return None if data is None else PartyState.from_bytes(data)
        except ValueError:  # damaged: as good as lost, the relay can restore it
            return None

    def restore(self, own: Outgoing) -> None:
        """Store the state sealed in one of our own committed payloads (pair keys are symmetric)."""
        sealed = open_sealed(self.key_with(own.receiver), own.payload,
                             self.associated_data(self.me, own.receiver, own.iteration))
        old = PartyState.from_bytes(sealed)
        self.store.save_state(self.params.round, old.last, old.to_bytes(self.precision))

    def retransmit(self, due: list[tuple[int, int, int]]) -> list[Outgoing]:
        """Re-seal (iteration, receiver, version) payloads that their receiver rejected."""
        out = []
        for iteration, receiver, version in due:
            old = self.load(version)
            if old is not None:
                payload = seal(self.key_with(receiver), old.to_bytes(self.precision),
                               self.associated_data(self.me, receiver, iteration))
                out.append(Outgoing(self.me, receiver, 0.0, payload, iteration))
        return out

    def open_incoming(self, request: Request) -> tuple[list[Incoming], list[tuple[int, int]]]:
        """The delivered messages for ``request.task``, and (sender, :class:`Rejection`) of those refused."""
        incoming, rejected = [], []
        for m in request.incoming:
            try:
                incoming.append(self.open_payload(m, request.task))
            except _Refused as refused:
                rejected.append((m.sender, int(refused.reason)))
        return incoming, rejected

    def open_payload(self, m: Outgoing, task: int) -> Incoming:
        """The state sealed in ``m`` for iteration ``task``; :class:`_Refused` if it is not one an honest
        sender can send: not authentic, not a state of the round's dimension, or not finite, of a
        magnitude above :func:`state_limit`, or with a weight omega outside [0, n]."""
        try:
            ad = self.associated_data(m.sender, self.me, task)
            plain = open_sealed(self.key_with(m.sender), m.payload, ad)
        except PayloadRejected:
            raise _Refused(Rejection.AUTHENTICATION) from None
        try:
            sent = PartyState.from_bytes(plain)
        except ValueError:
            raise _Refused(Rejection.MALFORMED) from None
        if sent.y.size != self.d:
            raise _Refused(Rejection.MALFORMED)
        n = len(self.params.roster)
        with np.errstate(invalid="ignore"):
            within = bool(np.all(np.abs(sent.y) <= state_limit(self.precision)))  # False for NaN
        if not (within and math.isfinite(sent.omega) and 0.0 <= sent.omega <= n * (1 + 1e-9)):
            raise _Refused(Rejection.INVALID_VALUE)
        return Incoming(m.weight, sent.y, sent.omega)

    def commit(self, iteration: int, plaintext: bytes) -> list[Outgoing]:
        """Our message for ``iteration``, sealed for the out-neighbours we choose ourselves."""
        n = len(self.params.roster)
        k = min(self.params.neighbors, n - 1)
        out = []
        for r in choose_neighbors(self.secrets.noise_secret, self.params.round, iteration, self.me, n, k):
            payload = seal(self.key_with(r), plaintext, self.associated_data(self.me, r, iteration))
            out.append(Outgoing(self.me, r, 1.0 / (k + 1), payload, iteration))
        return out


class _Refused(Exception):
    """A payload a party refuses, and why."""

    def __init__(self, reason: Rejection) -> None:
        super().__init__(reason.describe())
        self.reason = reason


def state_limit(precision: np.dtype | type) -> float:
    """The largest magnitude a party accepts in a state it is sent: 1e-9 of the largest ``precision`` value.

    Honest states are sums of clipped values and noise, far below it. Mixing never adds magnitude (the
    weights given away by each sender sum to at most 1), so a deviating sender can bring in at most this
    much per message: a billion such messages still cannot overflow a sum to inf and make an honest party
    send a state that its receivers must refuse.
    """
    return float(np.finfo(np.dtype(precision)).max) * 1e-9


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
