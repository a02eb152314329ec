"""The engine's noise drawn ahead: the same numbers as ``SeededNoise``, drawn while clients train.

An IncA round's noise does not depend on any value, and its execution trace is known before local
training ends, so its Gaussian draws (``(T + 1) n d`` of them, most of the engine's time) can be made
in background threads while the actors train and the driver certifies. :class:`NoiseAhead` asks a
``SeededNoise`` for exactly the draws the engine will ask for (``eta*``, then the fresh terms of the
parties online at each iteration), in order, and hands them over when the engine asks: the run is
bit-for-bit the one with ``SeededNoise``. Each draw has its own stream, so two threads
(``workers``) draw different iterations' terms at once and the numbers stay the same; NumPy's generators
release the GIL while they fill arrays, so the threads run beside the certificate and the engine. At
most ``max_bytes`` of draws are held at once (claimed in the engine's order, so the draw it waits for
always fits); the threads wait for the engine beyond that.
"""

from __future__ import annotations

import threading

import numpy as np

from ..protocol.noise import NoiseSource, SeededNoise
from ..protocol.trace import ExecutionTrace

__all__ = ["NoiseAhead"]


class NoiseAhead(NoiseSource):
    """``SeededNoise(seed)``'s draws for a run of ``trace`` on (n, d) values of ``dtype``, drawn ahead by
    ``workers`` threads (each draw has its own stream, so the numbers do not depend on who draws them)."""

    def __init__(
        self,
        seed: int,
        trace: ExecutionTrace,
        d: int,
        dtype: np.dtype | type,
        max_bytes: int = 512 * 2**20,
        workers: int = 2,
    ) -> None:
        self._base = SeededNoise(seed)
        self.n, self.d, self.dtype = trace.parties, int(d), np.dtype(dtype)
        self.incremental = trace.schedule.is_incremental_pattern
        # fresh terms are drawn at t = 0 (everybody) and t = 1..T-1 (the parties online at t)
        self._counts = [self.n] + [int(step.online.size) for step in trace.steps[:-1]]
        # what is drawn, in the order the engine asks for it (general schedules use term(), on demand)
        self._todo: list[tuple[object, int]] = [("star", self.n)]
        if self.incremental:
            self._todo += list(enumerate(self._counts))
        self._next = 0
        self._ready: dict[object, np.ndarray] = {}
        self._cond = threading.Condition()
        self._held = 0  # bytes drawn or being drawn and not yet taken
        self._max = int(max_bytes)
        self._closed = False
        self._threads = [
            threading.Thread(target=self._produce, name=f"inca-noise-ahead-{i}", daemon=True)
            for i in range(max(1, min(int(workers), len(self._todo))))
        ]
        for thread in self._threads:
            thread.start()

    @property
    def _thread(self) -> threading.Thread:  # the first worker (tests join it)
        return self._threads[0]

    # ------------------------------------------------------------------ producers
    def _claim(self) -> tuple[object, int] | None:
        """The next draw to make, its bytes reserved; None when there is none or the run was closed.
        Draws are claimed in the engine's order, so the one it waits for always has its room."""
        item = self.dtype.itemsize * self.d
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or self._next >= len(self._todo) or self._held == 0
                or self._held + self._todo[self._next][1] * item <= self._max
            )
            if self._closed or self._next >= len(self._todo):
                return None
            key, count = self._todo[self._next]
            self._next += 1
            self._held += count * item
            return key, count

    def _produce(self) -> None:
        while (job := self._claim()) is not None:
            key, count = job
            if key == "star":
                draw = self._base.star(self.n, self.d, self.dtype)
            else:
                draw = self._base.fresh(np.arange(count), None, key, self.d, self.dtype)
            with self._cond:
                if self._closed:
                    return
                self._ready[key] = draw
                self._cond.notify_all()

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
