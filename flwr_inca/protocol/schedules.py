"""Injection schedules: how a party spreads ``x_i + eta*_i`` and its cancelling noise over T+1 steps.

A schedule is a (c, Z)-Gaussian (paper Def. 3.3): with ``eta_k ~ N(0, sigma_delta^2)``, k = 1..T,
the party injects at its t-th step ``v_t = c_t u + sum_k Z[t, k] eta_k`` where ``u = x_i + eta*_i``.
Rows are 0-based: row 0 is the initialization step, row T the last mixing iteration.

With dropouts every party follows the dropout-adapted schedule D^O (paper Sec. 3.2, Algorithm 2,
read 0-based: the printed indices are off by one): at its r-th online step t < T it uses row r of
(c, Z); at t = T, if online, it uses c_r and the negated sum of the Z-rows it has used, so that every
noise term it injected is cancelled.

``incremental(T, tail=L)`` is D_Inc with a *value-free tail*: the value is injected in equal parts at
steps 0..T-L and the last L steps inject none of it (they only carry D_Inc's noise chain on). The
final messages are public, and a party whose last messages reached no honest party (its receivers
dropped out or were corrupted) publishes in its final the value it injected since, almost unmixed;
with a tail that value is zero. At equal certified privacy this needs less sigma_delta, hence less
noise left uncancelled by dropouts (benchmarks/bench_schedules.py; docs/reproduction.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import re

import numpy as np

from .._checks import check_int

__all__ = ["RECOMMENDED_SCHEDULE", "InjectionSchedule", "adapted_rows", "recommended_tail"]

_TOL = 1e-9
_RANK_COND = 1e12
# The drivers' default (IncaStrategy, the simulator, the study, the CLI): "auto", the value-free tail of
# recommended_tail(T) steps. A tail of 3 needed 0.5-0.8 of D_Inc's mean squared error at equal messages and
# certified privacy under dropouts at T = 10..40 (`flwr-inca reproduce frontier`, bench_schedules.py
# tails); without dropouts both give the same error.
RECOMMENDED_SCHEDULE = "auto"


def recommended_tail(iterations: int) -> int:
    """L of the ``"auto"`` schedule: 3 from T = 9 on, T // 3 below (a tail never takes more than a third
    of the steps; T < 3: D_Inc)."""
    return min(3, check_int("iterations", iterations, 1) // 3)
_TAIL_SPEC = re.compile(r"incremental:tail=(\d+)")


@dataclass(frozen=True, eq=False)
class InjectionSchedule:
    """A (c, Z)-Gaussian injection schedule for T iterations.

    Attributes:
        c: shape (T+1,), fraction of ``x_i + eta*_i`` injected at each step; sums to 1.
        Z: shape (T+1, T), coefficient of noise term ``eta_k`` (column k-1) at each step;
            every column sums to 0 so that the noise cancels.
        name: ``"incremental"``, ``"incremental:tail=L"``, ``"early"`` or ``"custom"``.
    """

    c: np.ndarray
    Z: np.ndarray
    name: str = "custom"

    # ------------------------------------------------------------------ constructors
    @classmethod
    def incremental(cls, iterations: int, tail: int = 0) -> InjectionSchedule:
        """D_Inc (paper Ex. 3.2): one noise term outstanding; the value in equal parts.

        ``tail = 0``: 1/(T+1) of the value per step (the paper's D_Inc). ``tail = L`` (0 <= L <= T): the
        value in equal parts 1/(T+1-L) at steps 0..T-L and none at the last L steps; Z is D_Inc's, so
        the noise (and what dropouts leave uncancelled per unit sigma_delta) is unchanged.
        """
        T = _check_iterations(iterations)
        L = check_int("tail (value-free last steps)", tail, 0, T)
        c = np.zeros(T + 1)
        c[: T + 1 - L] = 1.0 / (T + 1 - L)
        Z = np.zeros((T + 1, T))
        idx = np.arange(T)
        Z[idx, idx] = 1.0  # row t adds eta_{t+1} (column t)
        Z[idx + 1, idx] = -1.0  # row t+1 cancels it
        return cls(c, Z, "incremental" if L == 0 else f"incremental:tail={L}")

    @classmethod
    def early(cls, iterations: int) -> InjectionSchedule:
        """D_EI (paper Ex. 3.1): inject the whole value and all noise first, cancel one term per step."""
        T = _check_iterations(iterations)
        c = np.zeros(T + 1)
        c[0] = 1.0
        Z = np.zeros((T + 1, T))
        Z[0, :] = 1.0
        idx = np.arange(T)
        Z[idx + 1, idx] = -1.0
        return cls(c, Z, "early")

    @classmethod
    def custom(cls, c: Any, Z: Any) -> InjectionSchedule:
        """A user-supplied (c, Z); raises ``ValueError`` naming the Valid condition that fails."""
        c_arr = np.asarray(c, dtype=np.float64)
        Z_arr = np.asarray(Z, dtype=np.float64)
        if c_arr.ndim != 1 or c_arr.shape[0] < 2:
            raise ValueError(f"schedule: c must be a vector of length T+1 >= 2, got shape {c_arr.shape}")
        T = c_arr.shape[0] - 1
        if Z_arr.shape != (T + 1, T):
            raise ValueError(
                f"schedule: Z must have shape (T+1, T) = ({T + 1}, {T}) to match c, got {Z_arr.shape}"
            )
        if not (np.all(np.isfinite(c_arr)) and np.all(np.isfinite(Z_arr))):
            raise ValueError("schedule: c and Z must be finite")
        schedule = cls(c_arr, Z_arr, "custom")
        schedule.validate()
        return schedule

    @classmethod
    def resolve(cls, schedule: str | InjectionSchedule, iterations: int) -> InjectionSchedule:
        """Turn ``"incremental"``/``"incremental:tail=L"``/``"early"``/``"auto"`` (the value-free tail of
        :func:`recommended_tail` steps)/an instance into a schedule for ``iterations``."""
        if isinstance(schedule, InjectionSchedule):
            if schedule.iterations != iterations:
                raise ValueError(
                    f"schedule: built for {schedule.iterations} iterations but iterations={iterations}"
                )
            return schedule
        if schedule == "incremental":
            return cls.incremental(iterations)
        if schedule == "early":
            return cls.early(iterations)
        if schedule == RECOMMENDED_SCHEDULE:
            return cls.incremental(iterations, tail=recommended_tail(iterations))
        tail = _TAIL_SPEC.fullmatch(schedule) if isinstance(schedule, str) else None
        if tail is not None:
            return cls.incremental(iterations, tail=int(tail.group(1)))
        raise ValueError(
            "schedule: expected 'auto', 'incremental', 'incremental:tail=L' (0 <= L <= iterations), 'early' or "
            f"an InjectionSchedule, got {schedule!r}"
        )

    # ------------------------------------------------------------------ properties
    @property
    def iterations(self) -> int:
        return int(self.c.shape[0] - 1)

    @property
    def tail(self) -> int | None:
        """L of ``incremental(T, tail=L)`` when this is such a schedule (0: D_Inc), else None."""
        match = _TAIL_SPEC.fullmatch(self.name)
        return int(match.group(1)) if match else 0 if self.name == "incremental" else None

    @property
    def is_incremental_pattern(self) -> bool:
        """True when Z is D_Inc's bidiagonal pattern (one outstanding noise term at a time)."""
        return bool(np.array_equal(self.Z, InjectionSchedule.incremental(self.iterations).Z))

    # ------------------------------------------------------------------ validity
    def validate(self) -> None:
        """Check the three Valid conditions of paper Def. 3.4; raise ``ValueError`` naming the failure.

        Given (i), (ii) implies (iii): the last row of Z is minus the sum of the others, so a null
        vector of Z without its last row is a null vector of Z. (iii) is still checked, last.
        """
        T = self.iterations
        if abs(float(self.c.sum()) - 1.0) > _TOL:
            raise ValueError(
                f"schedule violates Valid condition (i): sum of c must be 1, got {self.c.sum():.12g}"
            )
        col = np.abs(self.Z.sum(axis=0))
        if np.any(col > _TOL):
            k = int(np.argmax(col))
            raise ValueError(
                "schedule violates Valid condition (i): every column of Z must sum to 0, "
                f"column {k} (noise term eta_{k + 1}) sums to {self.Z[:, k].sum():.12g}"
            )
        cz = np.column_stack([self.c, self.Z])
        if not _invertible(cz):
            raise ValueError(
                f"schedule violates Valid condition (ii): [c | Z] ({T + 1}x{T + 1}) must be invertible"
            )
        if not _invertible(self.Z[:-1]):
            raise ValueError(
                f"schedule violates Valid condition (iii): Z without its last row ({T}x{T}) "
                "must be invertible"
            )

    # ------------------------------------------------------------------ serialization
    def to_json(self) -> str | dict[str, list]:
        """``"incremental"``/``"early"``, else ``{"c": [...], "Z": [[...]]}`` (a tail schedule too, so that
        readers without it load it as a custom schedule; :meth:`from_json` recognizes it again)."""
        if self.name in ("incremental", "early"):
            return self.name
        return {"c": self.c.tolist(), "Z": self.Z.tolist()}

    @classmethod
    def from_json(cls, obj: Any, iterations: int) -> InjectionSchedule:
        if isinstance(obj, str):
            return cls.resolve(obj, iterations)
        if isinstance(obj, dict) and set(obj) >= {"c", "Z"}:
            schedule = cls.custom(obj["c"], obj["Z"])
            if schedule.iterations != iterations:
                raise ValueError(
                    f"schedule: c has length {schedule.iterations + 1}, expected iterations+1 = "
                    f"{iterations + 1}"
                )
            return _recognize_tail(schedule)
        raise ValueError(
            "schedule: expected 'incremental', 'incremental:tail=L', 'early' or {\"c\": [...], \"Z\": [[...]]}, "
            f"got {obj!r:.80}"
        )

    def __repr__(self) -> str:
        return f"InjectionSchedule({self.name!r}, iterations={self.iterations})"


def adapted_rows(schedule: InjectionSchedule, online: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The dropout-adapted schedule D^O of every party (paper Sec. 3.2, Algorithm 2, read 0-based).

    Args:
        schedule: the (c, Z) schedule for T iterations.
        online: bool array (T+1, n); ``online[t, i]`` says party i is online at step t (row 0 all True).

    Returns:
        ``(c_o, Z_o)`` with shapes (T+1, n) and (T+1, n, T): the coefficient of ``x_i + eta*_i`` and
        of each noise term in party i's injection at step t (zero when offline).
    """
    T = schedule.iterations
    online = np.asarray(online, dtype=bool)
    n = online.shape[1]
    c_o = np.zeros((T + 1, n))
    Z_o = np.zeros((T + 1, n, T))
    slot = np.zeros(n, dtype=np.int64)
    used = np.zeros((n, T))
    for t in range(T + 1):
        on = np.flatnonzero(online[t])
        r = slot[on]
        c_o[t, on] = schedule.c[r]
        if t < T:
            rows = schedule.Z[r]
            Z_o[t, on] = rows
            used[on] += rows
            slot[on] += 1
        else:
            Z_o[t, on] = -used[on]
    return c_o, Z_o


def _recognize_tail(schedule: InjectionSchedule) -> InjectionSchedule:
    """``schedule`` itself, or the equal ``incremental(T, tail=L)`` (L >= 1) under its name."""
    T = schedule.iterations
    tail = T + 1 - int(np.count_nonzero(schedule.c))
    if tail >= 1 and schedule.is_incremental_pattern:
        named = InjectionSchedule.incremental(T, tail=tail)
        if np.array_equal(named.c, schedule.c):
            return named
    return schedule


def _check_iterations(iterations: int) -> int:
    return check_int("iterations", iterations)


def _invertible(matrix: np.ndarray) -> bool:
    if matrix.shape[0] != matrix.shape[1]:
        return False
    s = np.linalg.svd(matrix, compute_uv=False)
    return bool(s[-1] > 0 and s[0] / s[-1] < _RANK_COND)
