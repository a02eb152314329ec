"""Independent, deliberately naive reference implementations used by the tests.

Nothing here imports the engine's or the accountant's internals: the loops follow the paper's
Algorithm 2 and Eqs. (16)-(21) literally, one party and one iteration at a time, so that they can
catch errors in the vectorized code.
"""

from __future__ import annotations

import numpy as np


def party_rows(c: np.ndarray, Z: np.ndarray, online_i: list[bool]) -> tuple[list[float], list[np.ndarray]]:
    """D^O of one party, paper Sec. 3.2 (0-based reading): the r-th online step t < T uses row r of (c, Z); at T,
    if online, c_r and minus the sum of the Z-rows used so far; offline steps inject nothing."""
    T = len(online_i) - 1
    cs, zs = [], []
    r = 0
    used = np.zeros(Z.shape[1])
    for t in range(T + 1):
        if not online_i[t]:
            cs.append(0.0)
            zs.append(np.zeros(Z.shape[1]))
        elif t < T:
            cs.append(float(c[r]))
            zs.append(Z[r].copy())
            used = used + Z[r]
            r += 1
        else:
            cs.append(float(c[r]))
            zs.append(-used)
    return cs, zs


def algorithm2(x, c, Z, attempted, online, sigma_star, sigma_delta, eta_star, eta):
    """Literal Algorithm 2.

    Args:
        x: (n, d) values. c, Z: the schedule. attempted: list over t=1..T of dense (n, n) ``W_t``
        (column stochastic, ``W[i, j]``: i aggregates j). online: (T+1, n) bool.
        eta_star: (n, d) unit draws; eta: (n, T, d) unit draws (term k of party i is eta[i, k-1]).

    Returns ``(y_final (n, d), omega (n,))``.
    """
    n, d = x.shape
    T = len(attempted)
    rows = [party_rows(c, Z, [bool(online[t][i]) for t in range(T + 1)]) for i in range(n)]

    def z(i, t):
        ci, zi = rows[i]
        u = x[i] + sigma_star * eta_star[i]
        out = ci[t] * u
        for k in range(T):
            if zi[t][k] != 0:
                out = out + zi[t][k] * sigma_delta * eta[i, k]
        return out

    y = [z(i, 0) for i in range(n)]
    omega = [rows[i][0][0] for i in range(n)]
    for t in range(1, T + 1):
        W = attempted[t - 1]
        new_y, new_omega = [], []
        for i in range(n):
            if online[t][i]:
                acc = np.zeros(d)
                acc_w = 0.0
                for j in range(n):
                    if j == i:
                        # line 13: the sender keeps the weight of undelivered messages
                        wii = W[i, i] + sum(W[jj, i] for jj in range(n) if not online[t][jj])
                        acc = acc + wii * y[i]
                        acc_w += wii * omega[i]
                    elif online[t][j]:
                        acc = acc + W[i, j] * y[j]
                        acc_w += W[i, j] * omega[j]
                new_y.append(acc + z(i, t))
                new_omega.append(acc_w + rows[i][0][t])
            else:
                new_y.append(y[i])
                new_omega.append(omega[i])
        y, omega = new_y, new_omega
    return np.array(y), np.array(omega)


def delivered_matrices(trace) -> list[np.ndarray]:
    """Dense ``W^O_t`` from a trace, built one message at a time."""
    n = trace.parties
    mats = []
    for step in trace.steps:
        W = np.eye(n)
        online = set(int(i) for i in step.online)
        for i in online:
            W[i, i] = 1.0
        for s, r, w in zip(step.messages.senders, step.messages.receivers, step.messages.weights):
            W[int(r), int(s)] += w
            W[int(s), int(s)] -= w
        mats.append(W)
    return mats


def full_system(trace):
    """``B*`` (n(T+1), n) and ``A*`` (n(T+1), nT) of App. A.2 (Eq. (21)), rows ordered (t, i),
    noise column ``i*T + k-1``; built with explicit per-party loops."""
    n, T = trace.parties, trace.iterations
    online = trace.online_mask()
    c, Z = trace.schedule.c, trace.schedule.Z
    rows = [party_rows(c, Z, [bool(online[t][i]) for t in range(T + 1)]) for i in range(n)]
    Ws = delivered_matrices(trace)
    Dc = [np.diag([rows[i][0][t] for i in range(n)]) for t in range(T + 1)]
    zeta = []
    for t in range(T + 1):
        zt = np.zeros((n, n * T))
        for i in range(n):
            zt[i, i * T:(i + 1) * T] = rows[i][1][t]
        zeta.append(zt)
    B, A = Dc[0], zeta[0]
    Bs, As = [B], [A]
    for t in range(1, T + 1):
        B = Ws[t - 1] @ B + Dc[t]
        A = Ws[t - 1] @ A + zeta[t]
        Bs.append(B)
        As.append(A)
    return np.concatenate(Bs), np.concatenate(As)


def brute_force_mu(trace, corrupted, observed_mask, sigma_star, sigma_delta):
    """mu_i = || M^+ h_i || with ``M = [s* B_H, s_D A_H]`` over ALL observed rows (corrupted
    parties' rows included), corrupted columns moved to the known side; min-norm least squares."""
    n, T = trace.parties, trace.iterations
    Bstar, Astar = full_system(trace)
    honest = [i for i in range(n) if i not in set(corrupted)]
    obs_rows = [t * n + i for t in range(T + 1) for i in range(n) if observed_mask[t][i]]
    noise_cols = [i * T + k for i in honest for k in range(T)]
    Bv = Bstar[np.ix_(obs_rows, honest)]
    Av = Astar[np.ix_(obs_rows, noise_cols)]
    M = np.hstack([sigma_star * Bv, sigma_delta * Av])
    mus = {}
    for j, i in enumerate(honest):
        h = Bv[:, j]
        sol, *_ = np.linalg.lstsq(M, h, rcond=1e-12)
        if np.linalg.norm(M @ sol - h) > 1e-7 * max(np.linalg.norm(h), 1e-12):
            mus[i] = np.inf
        else:
            mus[i] = float(np.linalg.norm(sol))
    return mus


def all_messages(trace, values, noises):
    """Every message value ``y_i^(t)`` (and its omega) of a recorded execution, recomputed one party
    at a time with the party-side code: the plaintexts that must never appear at the relay."""
    from flwr_inca.protocol.party import Incoming, IncaParty

    n = trace.parties
    parties = [IncaParty(values[i], trace.schedule, trace.sigma_star, trace.sigma_delta, noises[i])
               for i in range(n)]
    states = [p.compute(p.initial_state(), 0, [], 0.0) for p in parties]
    out = [s.y.copy() for s in states]
    for t, step in enumerate(trace.steps, start=1):
        m = step.messages
        new = list(states)
        for i in step.online:
            inc = [Incoming(w, states[s].y, states[s].omega)
                   for s, r, w in zip(m.senders, m.receivers, m.weights) if r == i]
            new[i] = parties[i].compute(states[i], t, inc, float(m.weights[m.senders == i].sum()))
            out.append(new[i].y.copy())
        states = new
    return out
