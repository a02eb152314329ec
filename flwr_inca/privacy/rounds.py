"""The random adversaries a training round is certified against, drawn the same way everywhere.

``IncaStrategy`` and the simulator certify a round as the worst of ``draws`` random adversaries (a
random corrupted set, Collusion DP, or random intercepted messages, Eavesdrop DP; paper Sec. 4.1). Both
draw them from ``SeedSequence(seed, spawn_key=(CERTIFY_KEY, round))`` through :func:`certification_views`,
so a simulated round and a Flower round with the same seed are certified against the same adversaries.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from ..protocol.trace import ExecutionTrace
from .certificate import certify
from .views import AdversaryView, random_collusion, random_eavesdrop

__all__ = ["CERTIFY_KEY", "RoundCertificate", "certification_seeds", "certification_views", "certify_round",
           "worst_mu"]

CERTIFY_KEY = 0  # first spawn_key entry of the certification seeds (IncaStrategy's other keys follow it)


def certification_seeds(seed: int | None, round: int) -> np.random.SeedSequence:
    """The root of round ``round``'s adversaries for a training seeded with ``seed``."""
    return np.random.SeedSequence(seed, spawn_key=(CERTIFY_KEY, int(round)))


def certification_views(
    trace: ExecutionTrace,
    seeds: np.random.SeedSequence,
    draws: int,
    *,
    collusion: float = 0.0,
    observed_fraction: float | None = None,
    finals: Iterable[int] | None = None,
) -> Iterator[AdversaryView]:
    """``draws`` random adversaries from ``seeds``: corrupted sets of ``collusion * n`` parties, or (with
    ``observed_fraction``) that share of each iteration's messages intercepted. Each sees the final
    messages of ``finals`` (None: every party online at T); the same seeds draw the same adversaries
    whatever ``finals`` is, so fewer finals never certify a larger mu."""
    # spawn from a copy: spawning advances a SeedSequence, and each call must draw the same adversaries
    fresh = np.random.SeedSequence(seeds.entropy, spawn_key=seeds.spawn_key, pool_size=seeds.pool_size)
    finals = None if finals is None else list(finals)
    for draw in fresh.spawn(int(draws)):
        key = int(draw.generate_state(1, dtype=np.uint64)[0])
        if observed_fraction is not None:
            yield random_eavesdrop(trace, observed_fraction, key, finals=finals)
        else:
            yield random_collusion(trace, collusion, key, finals=finals)


@dataclass(frozen=True)
class RoundCertificate:
    """The worst mu over a round's adversaries, and the certificate methods (``"exact"`` or ``"bound"``,
    see :attr:`Certificate.method`) that produced it, one per adversary."""

    mu: float
    methods: tuple[str, ...]

    @property
    def method(self) -> str:
        """``"exact"``, ``"bound"``, or ``"exact+bound"`` when the adversaries needed both (another method,
        e.g. ``"ceiling"`` or ``"predicted"``, as given)."""
        known = [m for m in ("exact", "bound", "cascade") if m in self.methods]
        return "+".join(known or dict.fromkeys(self.methods)) or "none"


def certify_round(
    trace: ExecutionTrace,
    seeds: np.random.SeedSequence,
    draws: int,
    *,
    collusion: float = 0.0,
    observed_fraction: float | None = None,
    finals: Iterable[int] | None = None,
    value_sensitivity: float = 1.0,
) -> RoundCertificate:
    """The worst certified mu of the honest parties over :func:`certification_views`. A NaN (a numerical
    failure) is no bound at all: it counts as unbounded (inf), never as 0."""
    certs = [certify(trace, view, value_sensitivity=value_sensitivity)
             for view in certification_views(trace, seeds, draws, collusion=collusion,
                                             observed_fraction=observed_fraction, finals=finals)]
    return RoundCertificate(worst_mu(c.max_mu for c in certs), tuple(c.method for c in certs))


def worst_mu(mus: Iterable[float]) -> float:
    """The largest of ``mus`` (0 for none), a NaN (a numerical failure) counting as unbounded (inf),
    never as 0."""
    return max((math.inf if math.isnan(m) else float(m) for m in mus), default=0.0)
