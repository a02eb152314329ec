"""Closed-form accuracy of a recorded execution.

The sum of the final messages is linear in the values and the noise:
``sum_{i in O^(T)} y_i^(T) = b . (x + eta*) + a . eta`` with ``b`` (n,) and ``a`` (n, T) found by
propagating the finalists' indicator backward through the ``W^O_t`` (``u_{t-1} = W_t^T u_t``). The
estimate is that sum over ``sum(b)`` (= the finalists' tracked weight), so for values drawn i.i.d. with
variance ``V`` per coordinate its mean squared error against the plain mean of the n values is

    MSE = V ||b / sum(b) - 1/n||^2 + (sigma_star^2 ||b||^2 + sigma_delta^2 ||a||^2) / sum(b)^2

per coordinate: the first term is the value lost with dropped messages, the second the noise that did
not cancel (only ``eta*`` without permanent dropouts, since then ``a = 0``).
"""

from __future__ import annotations

import math

import numpy as np

from .._checks import MAX_SCALE, check_bytes, check_real, check_scale
from .schedules import adapted_rows
from .trace import ExecutionTrace

__all__ = ["output_coefficients", "noise_std", "expected_mse"]


def output_coefficients(trace: ExecutionTrace, finalists=None) -> tuple[np.ndarray, np.ndarray]:
    """``(b, a)``: coefficients of ``x_i + eta*_i`` (n,) and of each noise term ``eta_{i,k}`` (n, T)
    in the sum of the final messages of the parties online at T (or of ``finalists``, a subset of
    them, when some final messages were lost: their share of the noise then no longer cancels)."""
    n, T = trace.parties, trace.iterations
    # the (T+1, n, T) dropout-adapted schedule, the (n, T) noise coefficients and the (T+1, n) rows, float64
    check_bytes(f"the output coefficients of {n} parties over {T} iterations", 8.0 * n * (T + 1) * (T + 3))
    c_o, Z_o = adapted_rows(trace.schedule, trace.online_mask())
    online_T = trace.steps[-1].online
    if finalists is None:
        finalists = online_T
    finalists = np.asarray(finalists, dtype=np.int64).reshape(-1)
    if not np.isin(finalists, online_T).all():
        raise ValueError("finalists must be parties online at the last iteration")
    u = np.zeros(n)
    u[finalists] = 1.0
    b = np.zeros(n)
    a = np.zeros((n, T))
    for t in range(T, -1, -1):
        b += u * c_o[t]
        a += u[:, None] * Z_o[t]
        if t > 0:
            u = trace.steps[t - 1].matrix(n).T @ u
    return b, a


def noise_std(trace: ExecutionTrace, finalists=None) -> float:
    """Standard deviation, per coordinate, of the noise in the estimate ``sum(y) / sum(omega)`` over
    ``finalists`` (default: every party online at T): ``sqrt(s*^2 |b|^2 + sD^2 |a|^2) / sum(b)``.
    ``inf`` when the finalists carry no value."""
    b, a = output_coefficients(trace, finalists)
    return math.sqrt(_noise_variance(b, a, trace.sigma_star, trace.sigma_delta))


def _noise_variance(b: np.ndarray, a: np.ndarray, sigma_star: float, sigma_delta: float) -> float:
    """Per-coordinate variance of the noise in ``(b . (x + eta*) + a . eta) / sum(b)``."""
    total = b.sum()
    if total <= 0:
        return float("inf")
    return (sigma_star**2 * float(b @ b) + sigma_delta**2 * float(np.sum(a * a))) / total**2


def expected_mse(
    trace: ExecutionTrace,
    sigma_star: float | None = None,
    sigma_delta: float | None = None,
    value_variance: float = 1.0 / 12.0,
) -> float:
    """Expected per-coordinate squared error of the exact-dissemination estimate (see module doc).

    ``value_variance`` is the variance of one coordinate of the values (1/12 for U[0, 1], the
    paper's experiments). Sigmas default to the trace's. ``inf`` if every party dropped out.
    """
    s_star = check_scale("sigma_star", trace.sigma_star if sigma_star is None else sigma_star)
    s_delta = check_scale("sigma_delta", trace.sigma_delta if sigma_delta is None else sigma_delta)
    value_variance = check_real("value_variance", value_variance, 0.0, MAX_SCALE)
    b, a = output_coefficients(trace)
    total = b.sum()
    if total <= 0:
        return float("inf")
    n = trace.parties
    lost = value_variance * float(np.sum((b / total - 1.0 / n) ** 2))
    return lost + _noise_variance(b, a, s_star, s_delta)
