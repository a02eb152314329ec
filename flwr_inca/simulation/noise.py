"""The engine's noise drawn ahead: the same numbers as ``SeededNoise``, drawn while clients train.

An IncA round's noise does not depend on any value, and its execution trace is known before local
training ends, so its Gaussian draws (``(T + 1) n d`` of them, most of the engine's time) can be made
in a background thread while the actors train and the driver certifies. :class:`NoiseAhead` asks a
``SeededNoise`` for exactly the draws the engine will ask for (``eta*``, then the fresh terms of the
parties online at each iteration), in order, and hands them over when the engine asks: the run is
bit-for-bit the one with ``SeededNoise``. NumPy's generators release the GIL while they fill
arrays, so the thread runs beside the certificate and the engine. At most ``max_bytes`` of draws are
held at once; the thread waits for the engine beyond that.
"""

from __future__ import annotations

import threading

import numpy as np

from ..protocol.noise import NoiseSource, SeededNoise
from ..protocol.trace import ExecutionTrace

__all__ = ["NoiseAhead"]


class NoiseAhead(NoiseSource):
    """``SeededNoise(seed)``'s draws for a run of ``trace`` on (n, d) values of ``dtype``, drawn ahead."""

    def __init__(
        self, seed: int, trace: ExecutionTrace, d: int, dtype: np.dtype | type, max_bytes: int = 512 * 2**20
    ) -> None:
        self._base = SeededNoise(seed)
        self.n, self.d, self.dtype = trace.parties, int(d), np.dtype(dtype)
        self.incremental = trace.schedule.is_incremental_pattern
        # fresh terms are drawn at t = 0 (everybody) and t = 1..T-1 (the parties online at t)
        self._counts = [self.n] + [int(step.online.size) for step in trace.steps[:-1]]
        self._ready: dict[object, np.ndarray] = {}
        self._cond = threading.Condition()
        self._held = 0
        self._max = int(max_bytes)
        self._closed = False
        self._thread = threading.Thread(target=self._produce, name="inca-noise-ahead", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer
    def _put(self, key: object, draw: np.ndarray) -> bool:
        with self._cond:
            self._ready[key] = draw
            self._held += draw.nbytes
            self._cond.notify_all()
            return not self._closed

    def _room(self, size: int) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._closed or self._held == 0 or self._held + size <= self._max)
            return not self._closed

    def _produce(self) -> None:
        item = self.dtype.itemsize * self.d
        if not self._room(self.n * item) or not self._put(
            "star", self._base.star(self.n, self.d, self.dtype)
        ):
            return
        if not self.incremental:  # general schedules use term(), regenerated on demand
            return
        for t, count in enumerate(self._counts):
            if not self._room(count * item):
                return
            draw = self._base.fresh(np.arange(count), None, t, self.d, self.dtype)
            if not self._put(t, draw):
                return

    def _take(self, key: object) -> np.ndarray:
        with self._cond:
            self._cond.wait_for(lambda: key in self._ready)
            draw = self._ready.pop(key)
            self._held -= draw.nbytes
            self._cond.notify_all()
            return draw

    def close(self) -> None:
        """Stop drawing (a round that is not run) and drop what was drawn."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._held = 0
            self._cond.notify_all()

    # ------------------------------------------------------------------ NoiseSource
    def star(self, n: int, d: int, dtype: np.dtype) -> np.ndarray:
        if (n, d, np.dtype(dtype)) != (self.n, self.d, self.dtype) or self._closed:
            return self._base.star(n, d, dtype)
        return self._take("star")

    def fresh(self, parties, k, t, d, dtype, out=None):
        usable = (
            self.incremental
            and not self._closed
            and d == self.d
            and np.dtype(dtype) == self.dtype
            and 0 <= t < len(self._counts)
            and len(parties) == self._counts[t]
        )
        if not usable:
            return self._base.fresh(parties, k, t, d, dtype, out=out)
        draw = self._take(t)
        if out is not None:
            out[...] = draw
            return out
        return draw

    def term(self, parties, k, n, d, dtype):
        return self._base.term(parties, k, n, d, dtype)
