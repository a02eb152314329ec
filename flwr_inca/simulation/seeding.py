"""Independent random streams of a simulation, keyed by purpose, round and client.

Every stream comes from NumPy's ``SeedSequence`` hashing of ``(seed, purpose, round[, client])``, never
from seed arithmetic, so streams do not overlap and a client's draws in a round are the same whichever
actor trains it and however many actors there are.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "AVAILABILITY",
    "SAMPLING",
    "TRAINING",
    "TRACE",
    "NOISE",
    "THREAT",
    "CALIBRATION",
    "MODEL",
    "stream",
    "seed_of",
]

# purposes (never reorder: they key the streams of recorded simulations)
AVAILABILITY, SAMPLING, TRAINING, TRACE, NOISE, THREAT, CALIBRATION, MODEL = range(1, 9)


def stream(seed: int, purpose: int, *key: int) -> np.random.Generator:
    """The generator of ``(seed, purpose, *key)``."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), purpose, *map(int, key)]))


def seed_of(seed: int, purpose: int, *key: int) -> int:
    """A non-negative 63-bit integer seed for ``(seed, purpose, *key)`` (for APIs that take an int)."""
    state = np.random.SeedSequence([int(seed), purpose, *map(int, key)]).generate_state(1, np.uint64)
    return int(state[0] >> np.uint64(1))
