"""Brute-force noise of a round's output, independent of ``flwr_inca.protocol.utility``."""

import numpy as np
from reference import algorithm2, delivered_matrices


def brute_noise_std(trace, finalists) -> float:
    """Std per coordinate of the noise in ``sum(y) / sum(omega)`` over ``finalists``, by linearity:
    the literal Algorithm 2 (tests/reference.py) on zero values with one unit impulse per noise draw
    (``eta*_i`` and every ``eta_{i,k}``, scaled by the trace's sigmas), so that each coordinate of the
    output is one draw's coefficient, and the std is the root sum of their squares."""
    n, T = trace.parties, trace.iterations
    width = n + n * T
    eta_star, eta = np.zeros((n, width)), np.zeros((n, T, width))
    for i in range(n):
        eta_star[i, i] = 1.0
        for k in range(T):
            eta[i, k, n + i * T + k] = 1.0
    y, omega = algorithm2(np.zeros((n, width)), trace.schedule.c, trace.schedule.Z, delivered_matrices(trace),
                          trace.online_mask(), trace.sigma_star, trace.sigma_delta, eta_star, eta)
    chosen = list(finalists)
    estimate = y[chosen].sum(axis=0) / omega[chosen].sum()
    return float(np.sqrt(np.sum(estimate**2)))
