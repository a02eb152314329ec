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

import numpy as np

from .schedules import adapted_rows
from .trace import ExecutionTrace

__all__ = ["output_coefficients", "expected_mse"]


def output_coefficients(trace: ExecutionTrace) -> tuple[np.ndarray, np.ndarray]:
    """``(b, a)``: coefficients of ``x_i + eta*_i`` (n,) and of each noise term ``eta_{i,k}`` (n, T)
    in the sum of the final messages of the parties online at T."""
    n, T = trace.parties, trace.iterations
    c_o, Z_o = adapted_rows(trace.schedule, trace.online_mask())
    u = np.zeros(n)
    u[trace.steps[-1].online] = 1.0
    b = np.zeros(n)
    a = np.zeros((n, T))
    for t in range(T, -1, -1):
        b += u * c_o[t]
        a += u[:, None] * Z_o[t]
        if t > 0:
            u = trace.steps[t - 1].matrix(n).T @ u
    return b, a


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
    s_star = trace.sigma_star if sigma_star is None else float(sigma_star)
    s_delta = trace.sigma_delta if sigma_delta is None else float(sigma_delta)
    b, a = output_coefficients(trace)
    total = b.sum()
    if total <= 0:
        return float("inf")
    n = trace.parties
    lost = value_variance * float(np.sum((b / total - 1.0 / n) ** 2))
    noise = (s_star**2 * float(b @ b) + s_delta**2 * float(np.sum(a * a))) / total**2
    return lost + noise
