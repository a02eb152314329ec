"""Sources of the standard-normal draws behind ``eta*`` and the cancelling noise terms ``eta_{i,k}``.

The engine scales unit draws by ``sigma_star`` / ``sigma_delta``. Two sources:

* :class:`SeededNoise` (default): vectorized, deterministic per seed. Fresh terms of D_Inc-like
  schedules are keyed by the iteration that first uses them; terms of general schedules are keyed by
  their index k and regenerated when reused, which keeps memory O(n d) instead of O(n d T).
* :class:`ExplicitNoise`: caller-supplied arrays, for reference implementations, audits and replaying
  noise that parties drew themselves (e.g. in a Flower deployment).

The seed of a run is secret (it determines all noise); it is never written to a trace.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .._checks import check_int

__all__ = ["NoiseSource", "SeededNoise", "ExplicitNoise", "resolve_seed"]

# the streams of one seed, by purpose (never reorder: they key recorded runs)
_TAG_STAR, _TAG_FRESH, _TAG_TERM, TAG_TOPOLOGY, TAG_DROPOUT, TAG_DISSEMINATION = range(6)


def resolve_seed(seed: int | None) -> int:
    """The run's seed: ``seed`` itself, or fresh OS entropy when ``None``."""
    if seed is None:
        return int(np.random.SeedSequence().entropy)
    return check_int("seed (or None)", seed, 0)


def stream(seed: int, tag: int, *key: int) -> np.random.Generator:
    """An independent generator for ``(seed, tag, *key)`` (NumPy SeedSequence hashing)."""
    return np.random.default_rng([seed, tag, *key])


class NoiseSource(ABC):
    """Unit Gaussian draws for one run of ``n`` parties with values of dimension ``d``."""

    @abstractmethod
    def star(self, n: int, d: int, dtype: np.dtype) -> np.ndarray:
        """``eta*`` of every party, unit variance, shape (n, d)."""

    @abstractmethod
    def fresh(
        self, parties: np.ndarray, k: np.ndarray, t: int, d: int, dtype: np.dtype,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Noise term ``k[j]`` of party ``parties[j]``, drawn once at iteration ``t``: (len(parties), d)."""

    @abstractmethod
    def term(self, parties: np.ndarray, k: int, n: int, d: int, dtype: np.dtype) -> np.ndarray:
        """Noise term ``k`` of the given parties, the same values on every call: (len(parties), d)."""


class SeededNoise(NoiseSource):
    """Deterministic vectorized noise derived from the run's seed."""

    def __init__(self, seed: int) -> None:
        self.seed = resolve_seed(seed)

    def star(self, n: int, d: int, dtype: np.dtype) -> np.ndarray:
        return stream(self.seed, _TAG_STAR).standard_normal((n, d), dtype=dtype)

    def fresh(self, parties, k, t, d, dtype, out=None):
        rng = stream(self.seed, _TAG_FRESH, t)
        if out is not None:
            return rng.standard_normal(out.shape, dtype=dtype, out=out)
        return rng.standard_normal((len(parties), d), dtype=dtype)

    def term(self, parties, k, n, d, dtype):
        return stream(self.seed, _TAG_TERM, k).standard_normal((n, d), dtype=dtype)[parties]


class ExplicitNoise(NoiseSource):
    """Given unit draws: ``eta_star`` (n, d) and ``eta`` (n, T, d), ``eta[i, k-1]`` = term k of party i."""

    def __init__(self, eta_star: np.ndarray, eta: np.ndarray) -> None:
        self.eta_star = np.asarray(eta_star)
        self.eta = np.asarray(eta)
        if self.eta_star.ndim != 2 or self.eta.ndim != 3 or self.eta.shape[0] != self.eta_star.shape[0] \
                or self.eta.shape[2] != self.eta_star.shape[1]:
            raise ValueError(
                "ExplicitNoise: eta_star must have shape (n, d) and eta shape (n, T, d), got "
                f"{self.eta_star.shape} and {self.eta.shape}"
            )

    def _check(self, n: int, d: int) -> None:
        if self.eta_star.shape != (n, d):
            raise ValueError(f"ExplicitNoise: built for values of shape {self.eta_star.shape}, got {(n, d)}")

    def star(self, n, d, dtype):
        self._check(n, d)
        return self.eta_star.astype(dtype, copy=True)

    def fresh(self, parties, k, t, d, dtype, out=None):
        draws = self.eta[parties, np.asarray(k) - 1].astype(dtype, copy=False)
        if out is not None:
            out[...] = draws
            return out
        return draws.copy()

    def term(self, parties, k, n, d, dtype):
        self._check(n, d)
        return self.eta[parties, k - 1].astype(dtype, copy=True)
