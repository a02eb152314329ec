"""End-to-end encryption of the peer messages the ServerApp relays.

Each party makes a fresh X25519 key pair per round (:class:`KeyPair`). Two parties derive a pairwise
key with HKDF-SHA256 over their shared secret, salted with the round and both public keys, so the key
is the same in both directions and different in every round (:func:`pair_key`, :func:`hkdf_sha256`).
Payloads are sealed with ChaCha20-Poly1305 (:func:`seal`, :func:`open_sealed`); the associated data
binds ``(sender, receiver, round, iteration)`` (:func:`associated_data`), so a payload that is
replayed, re-routed to another party or iteration, or tampered with fails authentication at the
receiver (:class:`PayloadRejected`).

A party never hands the relay its state to keep: its states live in node-local storage
(:mod:`.storage`). If that storage is lost, the relay sends back one of the party's own committed
payloads, which the party can open because pairwise keys are symmetric.
"""

from __future__ import annotations

import hmac
import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

__all__ = ["KeyPair", "PayloadRejected", "associated_data", "check_public_key", "seal", "open_sealed", "pair_key",
           "hkdf_sha256"]

NONCE = 12
_INFO = b"flwr-inca/pairwise/1"


class PayloadRejected(ValueError):
    """A sealed payload failed authentication (tampered, replayed or re-routed)."""


class KeyPair:
    """An X25519 key pair; ``public`` is the 32 raw bytes to publish."""

    def __init__(self, private: bytes | None = None) -> None:
        self._sk = X25519PrivateKey.from_private_bytes(private) if private else X25519PrivateKey.generate()
        self.public = self._sk.public_key().public_bytes_raw()

    def private_bytes(self) -> bytes:
        return self._sk.private_bytes_raw()

    def shared(self, peer_public: bytes) -> bytes:
        if len(peer_public) != 32:
            raise PayloadRejected("peer public key must be 32 bytes")
        return self._sk.exchange(X25519PublicKey.from_public_bytes(peer_public))


def check_public_key(key: object) -> bytes:
    """``key`` if it is a usable X25519 public key (32 bytes, not a low-order point, with which every
    shared secret would be zero); ``ValueError`` saying what is wrong otherwise."""
    if not isinstance(key, bytes):
        raise ValueError(f"public key must be bytes, got {type(key).__name__}")
    if len(key) != 32:
        raise ValueError(f"public key must be 32 bytes (X25519), got {len(key)}")
    try:  # OpenSSL refuses the exchange with a low-order point
        X25519PrivateKey.generate().exchange(X25519PublicKey.from_public_bytes(key))
    except ValueError:
        raise ValueError("public key is not a valid X25519 key (low-order point)") from None
    return key


def pair_key(keys: KeyPair, peer_public: bytes, round: int) -> bytes:
    """Symmetric key shared by this party and the owner of ``peer_public`` for ``round``."""
    lo, hi = sorted([keys.public, peer_public])
    salt = struct.pack("<q", round) + lo + hi
    return hkdf_sha256(keys.shared(peer_public), salt, _INFO)


def hkdf_sha256(secret: bytes, salt: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) for one 32-byte key: extract, then the first block of expand.

    Two HMACs from the standard library: the same bytes as ``cryptography``'s ``HKDF`` at a tenth of
    its set-up cost, which a node pays for every peer it talks to.
    """
    prk = hmac.digest(salt, secret, "sha256")
    return hmac.digest(prk, info + b"\x01", "sha256")


def associated_data(sender: int, receiver: int, round: int, iteration: int, kind: bytes = b"msg") -> bytes:
    """What a payload is bound to; node ids are unsigned 64-bit."""
    return kind + struct.pack("<QQqq", sender, receiver, round, iteration)


def seal(key: bytes, plaintext: bytes, ad: bytes) -> bytes:
    nonce = os.urandom(NONCE)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, ad)


def open_sealed(key: bytes, payload: bytes, ad: bytes) -> bytes:
    if len(payload) < NONCE + 16:
        raise PayloadRejected("payload too short")
    try:
        return ChaCha20Poly1305(key).decrypt(payload[:NONCE], payload[NONCE:], ad)
    except InvalidTag:
        raise PayloadRejected("payload failed authentication") from None
