"""Execution traces (format ``inca-trace/1``): exactly what happened in a run, without any value.

A trace records, per mixing iteration t = 1..T, the parties online at t and the *delivered*
messages ``[sender, receiver, weight]`` (the receiver aggregates the sender's ``y^(t-1)`` with that
weight). An online sender keeps ``1 - (sum of its delivered weights)``; an offline party keeps its
message; every party is online at t = 0. This is all the adversary of the paper's threat model knows
besides the messages it observes, so the privacy accountant and external auditors read it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._checks import MAX_PARTIES, check_bytes, check_iterations, check_parties, check_scale
from .._io import atomic_write_text
from .._json import loads
from .schedules import InjectionSchedule
from .topology import Messages, check_column_stochastic

if TYPE_CHECKING:
    import scipy.sparse as sp

__all__ = ["TRACE_FORMAT", "MAX_TRACE_PARTIES", "TraceStep", "ExecutionTrace"]

TRACE_FORMAT = "inca-trace/1"
# a loaded trace's party count: checking a trace allocates O(parties) per step, so a crafted file must not
# claim more than any real execution (10^4 - 10^6 parties); its iterations are at most MAX_ITERATIONS
MAX_TRACE_PARTIES = MAX_PARTIES
# parsed JSON takes up to about this many bytes of memory per byte of file (lists of small numbers, measured
# 12 on a trace of 20,000 parties; empty lists or objects up to 21): a file is refused before it is read if
# that would not fit (flwr_inca._checks.memory_limit)
JSON_BYTES_PER_FILE_BYTE = 25


@dataclass(frozen=True)
class TraceStep:
    """One mixing iteration: sorted online parties and the delivered messages."""

    online: np.ndarray  # int64 (n_online,), sorted
    messages: Messages  # delivered only

    def self_weights(self, n: int) -> np.ndarray:
        """Weight each party gives its own previous message (1 for offline parties)."""
        keep = np.ones(n)
        out = np.bincount(self.messages.senders, weights=self.messages.weights, minlength=n)
        keep[self.online] = np.maximum(1.0 - out[self.online], 0.0)
        return keep

    def matrix(self, n: int, dtype: Any = np.float64) -> sp.csr_matrix:
        """``W^O_t`` as a sparse (n, n) matrix: ``y^(t) = W^O_t y^(t-1) + z_t``."""
        import scipy.sparse as sp  # here, not at import: a ClientApp process starts per message

        m = self.messages
        rows = np.concatenate([m.receivers, np.arange(n)])
        cols = np.concatenate([m.senders, np.arange(n)])
        vals = np.concatenate([m.weights, self.self_weights(n)]).astype(dtype)
        return sp.csr_matrix((vals, (rows, cols)), shape=(n, n))


@dataclass
class ExecutionTrace:
    """What happened in one IncA run (no private value): parties, schedule, sigmas, steps.

    ``steps[t-1]`` is mixing iteration t. Save with :meth:`save`, load with :meth:`load`.
    """

    parties: int
    iterations: int
    schedule: InjectionSchedule
    sigma_star: float
    sigma_delta: float
    steps: list[TraceStep] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ views
    def online_mask(self) -> np.ndarray:
        """Bool (T+1, n): ``online[t, i]``; row 0 (initialization) is all True."""
        mask = np.zeros((self.iterations + 1, self.parties), dtype=bool)
        mask[0] = True
        for t, step in enumerate(self.steps, start=1):
            mask[t, step.online] = True
        return mask

    def finalists(self) -> np.ndarray:
        """Parties online at T, whose final messages form the output."""
        return self.steps[-1].online.copy()

    def validate(self) -> None:
        """Raise ``ValueError`` if the trace is malformed or some ``W^O_t`` is not column stochastic."""
        check_parties("trace: parties", self.parties)
        check_iterations("trace: iterations", self.iterations)
        for name in ("sigma_star", "sigma_delta"):
            _check_sigma(name, getattr(self, name))
        if self.schedule.iterations != self.iterations:
            raise ValueError(
                f"trace: schedule is for {self.schedule.iterations} iterations, trace has {self.iterations}"
            )
        if len(self.steps) != self.iterations:
            raise ValueError(f"trace: expected {self.iterations} steps, got {len(self.steps)}")
        n = self.parties
        for t, step in enumerate(self.steps, start=1):
            on = step.online
            if on.size and (on.min() < 0 or on.max() >= n):
                raise ValueError(f"trace step {t}: online parties must be in [0, {n - 1}]")
            if np.unique(on).size != on.size:
                raise ValueError(f"trace step {t}: duplicate party in 'online'")
            m = step.messages
            check_column_stochastic(m, n, where=f"trace step {t}")
            is_on = np.zeros(n, dtype=bool)
            is_on[on] = True
            if m.senders.size and not (is_on[m.senders].all() and is_on[m.receivers].all()):
                raise ValueError(
                    f"trace step {t}: a delivered message involves an offline party"
                )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        steps = []
        for step in self.steps:
            m = step.messages
            msgs = [[int(s), int(r), float(w)] for s, r, w in zip(m.senders, m.receivers, m.weights)]
            steps.append({"online": [int(i) for i in step.online], "messages": msgs})
        out: dict[str, Any] = {
            "format": TRACE_FORMAT,
            "parties": int(self.parties),
            "iterations": int(self.iterations),
            "schedule": self.schedule.to_json(),
            "sigma_star": float(self.sigma_star),
            "sigma_delta": float(self.sigma_delta),
            "steps": steps,
        }
        if self.meta:
            out["meta"] = self.meta
        return out

    @classmethod
    def from_dict(cls, data: Any) -> ExecutionTrace:
        if not isinstance(data, dict):
            raise ValueError("trace: expected a JSON object")
        fmt = data.get("format")
        if fmt != TRACE_FORMAT:
            raise ValueError(f"trace: format must be {TRACE_FORMAT!r}, got {fmt!r}")
        missing = {"parties", "iterations", "schedule", "sigma_star", "sigma_delta", "steps"} - set(data)
        if missing:
            raise ValueError(f"trace: missing field(s) {sorted(missing)}")
        # sizes first, checked against what the file holds, before anything of that size is allocated
        n = check_parties("trace: parties", data["parties"])
        T = check_iterations("trace: iterations", data["iterations"])
        raw_steps = data["steps"]
        if not isinstance(raw_steps, list):
            raise ValueError("trace: 'steps' must be a list")
        if len(raw_steps) != T:
            raise ValueError(f"trace: expected {T} steps (iterations), got {len(raw_steps)}")
        schedule = InjectionSchedule.from_json(data["schedule"], T)
        steps = []
        for t, raw in enumerate(raw_steps, start=1):
            if not isinstance(raw, dict) or "online" not in raw or "messages" not in raw:
                raise ValueError(f"trace step {t}: expected {{'online': [...], 'messages': [...]}}")
            steps.append(TraceStep(_int_array(raw["online"], f"trace step {t}: online", n),
                                   _messages(raw["messages"], t, n)))
        meta = data.get("meta", {})
        trace = cls(n, T, schedule, _check_sigma("sigma_star", data["sigma_star"]),
                    _check_sigma("sigma_delta", data["sigma_delta"]), steps,
                    meta if isinstance(meta, dict) else {})
        trace.validate()
        return trace

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> ExecutionTrace:
        _check_json_size(len(text))
        return cls.from_dict(loads(text, "trace"))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace as JSON, atomically (validated first: nothing half-written on error)."""
        self.validate()
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ExecutionTrace:
        """Read a trace written by :meth:`save`; every malformed file raises a one-line ``ValueError``."""
        with open(path, "rb") as fh:
            _check_json_size(os.fstat(fh.fileno()).st_size)  # before reading it
            return cls.from_json(fh.read())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExecutionTrace):
            return NotImplemented
        return self.to_dict() == other.to_dict()


def _check_sigma(name: str, value: Any) -> float:
    return check_scale(f"trace: {name}", value)


def _check_json_size(nbytes: int) -> None:
    check_bytes(f"trace: a file of {nbytes} bytes", JSON_BYTES_PER_FILE_BYTE * nbytes)


def _party(v: Any, n: int) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and 0 <= v < n


def _int_array(values: Any, where: str, n: int) -> np.ndarray:
    if not isinstance(values, list) or not all(_party(v, n) for v in values):
        raise ValueError(f"{where} must be a list of party indices in [0, {n - 1}]")
    return np.sort(np.asarray(values, dtype=np.int64))


def _messages(raw: Any, t: int, n: int) -> Messages:
    where = f"trace step {t}: messages"
    if not isinstance(raw, list):
        raise ValueError(f"{where} must be a list of [sender, receiver, weight]")
    if not raw:
        return Messages(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    ok = all(
        isinstance(m, list) and len(m) == 3 and _party(m[0], n) and _party(m[1], n)
        and isinstance(m[2], (int, float)) and not isinstance(m[2], bool) and math.isfinite(m[2])
        for m in raw
    )
    if not ok:
        raise ValueError(f"{where} must be a list of [sender, receiver, weight]: party indices in "
                         f"[0, {n - 1}] and a finite weight")
    senders = np.array([m[0] for m in raw], dtype=np.int64)  # exact: no detour through float64
    receivers = np.array([m[1] for m in raw], dtype=np.int64)
    return Messages(senders, receivers, np.array([m[2] for m in raw], dtype=np.float64))
