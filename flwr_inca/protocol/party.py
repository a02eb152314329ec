"""One party's side of Algorithm 2, for deployments where every party runs on its own machine.

The engine simulates all parties at once; this module is what a single party computes: its noise,
its injections ``z_{i,t}`` under the dropout-adapted schedule D^O, and its mixing step
``y_i^(t) = W^O[i,i] y_i^(t-1) + sum_j W^O[i,j] y_j^(t-1) + z_{i,t}`` with weight tracking.

Computation is a pure function of the party's secret, its value and the tasks it is given, so a
step can be retried after a crash and gives the same result (idempotent), and a recorded execution
can be replayed in the engine with :meth:`PartyNoise.explicit`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .noise import ExplicitNoise
from .schedules import InjectionSchedule

__all__ = ["PartyNoise", "PartyState", "IncaParty", "Incoming"]

_STAR, _TERM = 0, 1


class TermCache(Protocol):
    """Where :class:`PartyNoise` may keep its unit draws: ``(0, d)`` for ``eta*``, ``(k, d)`` for ``eta_k``."""

    def get(self, key: tuple[int, int]) -> np.ndarray | None: ...
    def __setitem__(self, key: tuple[int, int], draw: np.ndarray) -> None: ...


class PartyNoise:
    """Unit Gaussian draws of one party for one round, derived from a secret.

    ``eta*`` and every cancelling term ``eta_k`` come from independent Philox streams keyed by
    SHA-256(secret, round, kind, index), so any draw can be regenerated on demand (memory O(d), and
    retries are deterministic). Seed the secret from a CSPRNG (``secrets.token_bytes(32)``); a fixed
    secret is for tests only.

    ``cache`` (optional, anything with ``get(key)`` and ``cache[key] = draw``; key ``(0, d)`` is
    ``eta*``, ``(k, d)`` the term ``eta_k``) keeps what was drawn, and may hold draws made ahead: under
    D_Inc a party cancels at each step the term it drew at the step before, so a cache halves its
    draws. Cached draws are the same numbers, only not drawn again.
    """

    def __init__(self, secret: bytes, round: int = 0, cache: TermCache | None = None) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise ValueError("secret must be at least 16 bytes")
        self.secret = bytes(secret)
        self.round = int(round)
        self.cache = cache

    def _rng(self, kind: int, index: int) -> np.random.Generator:
        digest = hashlib.sha256(self.secret + struct.pack("<qqq", self.round, kind, index)).digest()
        key = np.frombuffer(digest[:16], dtype=np.uint64)
        return np.random.Generator(np.random.Philox(key=key))

    def star(self, d: int) -> np.ndarray:
        """Unit draws of ``eta*``, shape (d,) (cache key ``(0, d)``)."""
        return self._draw(_STAR, 0, d)

    def term(self, k: int, d: int) -> np.ndarray:
        """Unit draws of the cancelling term ``eta_k`` (k = 1..T), shape (d,) (cache key ``(k, d)``)."""
        return self._draw(_TERM, k, d)

    def _draw(self, kind: int, k: int, d: int) -> np.ndarray:
        if self.cache is None:
            return self._rng(kind, k).standard_normal(d)
        draw = self.cache.get((k, d))
        if draw is None:
            draw = self._rng(kind, k).standard_normal(d)
            self.cache[(k, d)] = draw
        return draw

    @staticmethod
    def explicit(noises: list[PartyNoise], d: int, iterations: int) -> ExplicitNoise:
        """The draws of several parties as an ``ExplicitNoise`` for the engine (for replay)."""
        star = np.stack([p.star(d) for p in noises])
        eta = np.stack([np.stack([p.term(k, d) for k in range(1, iterations + 1)]) for p in noises])
        return ExplicitNoise(star, eta)


@dataclass(frozen=True)
class PartyState:
    """A party's mutable state within a round.

    ``y`` is its current message (d,), ``omega`` the share of injected values it carries, ``last`` the
    last iteration it computed (-1 before initialization), ``slot`` the number of online steps used
    (the row of (c, Z) to use next).
    """

    y: np.ndarray
    omega: float
    last: int
    slot: int

    def to_bytes(self, dtype: np.dtype | type = np.float64) -> bytes:
        """``omega, last, slot, d, itemsize`` then ``y`` in ``dtype`` (float32 or float64)."""
        dt = np.dtype(dtype)
        if dt not in (np.float32, np.float64):
            raise ValueError(f"party state: dtype must be float32 or float64, got {dt}")
        y = np.ascontiguousarray(self.y, dtype=dt)
        return struct.pack(_HEAD, self.omega, self.last, self.slot, y.size, dt.itemsize) + y.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> PartyState:
        head = struct.calcsize(_HEAD)
        if len(data) < head:
            raise ValueError("party state: truncated")
        omega, last, slot, d, itemsize = struct.unpack_from(_HEAD, data)
        if itemsize not in (4, 8) or len(data) != head + itemsize * d:
            raise ValueError("party state: wrong length")
        dt = np.float32 if itemsize == 4 else np.float64
        return cls(np.frombuffer(data, dtype=dt, offset=head).astype(np.float64), omega, last, slot)

    @staticmethod
    def size(d: int, dtype: np.dtype | type = np.float64) -> int:
        return struct.calcsize(_HEAD) + np.dtype(dtype).itemsize * d


_HEAD = "<dqqqB"


@dataclass(frozen=True)
class Incoming:
    """A delivered message: the sender's ``y^(t-1)`` and ``omega^(t-1)``, aggregated with ``weight``."""

    weight: float
    y: np.ndarray
    omega: float


class IncaParty:
    """The computations of one party (value ``x`` of shape (d,)) in one round.

    Only ``x + eta*`` enters the protocol; a caller that kept it for this noise and ``sigma_star``
    may pass ``x_tilde`` instead of ``x`` (``x=None``).
    """

    def __init__(
        self,
        x: np.ndarray | None,
        schedule: InjectionSchedule,
        sigma_star: float,
        sigma_delta: float,
        noise: PartyNoise,
        precision: np.dtype | type = np.float64,
        x_tilde: np.ndarray | None = None,
    ) -> None:
        self.precision = np.dtype(precision)
        if self.precision not in (np.float32, np.float64):
            raise ValueError(f"precision must be float32 or float64, got {self.precision}")
        self.schedule = schedule
        self.sigma_star = float(sigma_star)
        self.sigma_delta = float(sigma_delta)
        self.noise = noise
        if x_tilde is not None:
            self.x_tilde = np.asarray(x_tilde, dtype=np.float64).reshape(-1)
        elif x is not None:
            x = np.asarray(x, dtype=np.float64).reshape(-1)
            self.x_tilde = x + self.sigma_star * noise.star(x.size)  # x + eta*
        else:
            raise ValueError("give the party's value x (or x + eta*)")
        if not np.all(np.isfinite(self.x_tilde)):
            raise ValueError("party value must be finite")
        self.d = self.x_tilde.size

    @property
    def iterations(self) -> int:
        return self.schedule.iterations

    def initial_state(self) -> PartyState:
        return PartyState(np.zeros(self.d), 0.0, -1, 0)

    def injection(self, slot: int, final: bool) -> tuple[np.ndarray, float]:
        """``z`` and its share of ``x + eta*`` at the party's ``slot``-th online step (D^O, paper Sec. 3.2)."""
        c, Z = self.schedule.c, self.schedule.Z
        if final:  # cancel every term injected so far
            coef = -Z[:slot].sum(axis=0)
        else:
            coef = Z[slot]
        z = c[slot] * self.x_tilde
        for k in np.flatnonzero(coef) + 1:
            z = z + (self.sigma_delta * coef[k - 1]) * self.noise.term(int(k), self.d)
        return z, float(c[slot])

    def compute(
        self, state: PartyState, t: int, incoming: list[Incoming], delivered_weight: float
    ) -> PartyState:
        """The party's step at iteration ``t`` when it is online at t.

        Args:
            state: its state (``state.last < t``; iterations in between it was offline).
            incoming: messages delivered to it at t (t = 0: none).
            delivered_weight: total weight of its own messages delivered at t; it keeps the rest
                (Algorithm 2, line 13).

        Already computed iterations (``t <= state.last``) return ``state`` unchanged (idempotent).
        The result is rounded to the party's ``precision``: what it keeps is exactly what it sends,
        so the weight it gives away and the weight it keeps still sum to its message.
        """
        if t <= state.last:
            return state
        T = self.iterations
        if not (0 <= t <= T):
            raise ValueError(f"iteration must be in [0, {T}], got {t}")
        if t == 0:
            if incoming or delivered_weight:
                raise ValueError("nothing is exchanged at initialization (t = 0)")
            z, share = self.injection(0, final=False)
            return PartyState(self._round(z), share, 0, 1)
        if state.last < 0:
            raise ValueError("the party must be initialized (t = 0) before mixing")
        keep = 1.0 - float(delivered_weight)
        if keep < -1e-9:
            raise ValueError(f"delivered weight {delivered_weight} exceeds 1")
        keep = max(keep, 0.0)
        y = keep * state.y
        omega = keep * state.omega
        for msg in incoming:
            y = y + msg.weight * msg.y
            omega += msg.weight * msg.omega
        final = t == T
        z, share = self.injection(state.slot, final)
        return PartyState(self._round(y + z), omega + share, t, state.slot + (0 if final else 1))

    def _round(self, y: np.ndarray) -> np.ndarray:
        return y if self.precision == np.float64 else y.astype(self.precision).astype(np.float64)
