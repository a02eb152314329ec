"""A round's exact certificate (one adversary view, factorized once for every prefix and finals subset):
the previous implementation against the current one, side by side in one process.

What a simulated round pays before its update is released: ``PrefixProfile.build`` of each certification
adversary (``RoundPrefix``), then ``with_finals`` / ``through`` read from it. The previous implementation
(kept below as ``previous_profile``, for this comparison only) formed the two (m, m) Grams
``G_B = B_V B_V^T`` and ``G_A`` (the structured builder), then ``Sigma = sigma_star^2 G_B + sigma_delta^2
G_A``, a dense Cholesky of a copy and a triangular solve. The current one propagates the covariance of the
state ``(y, e, x~)`` straight into the lower triangle of Sigma (no Gram of ``B_V``) and factorizes it in
place (``observed_covariance`` + ``whiten_lower``).

Setting: D_Inc, k = 1, 10% colluders (one view of ``certification_views``), 10% permanent dropouts,
sigma* = 0.05, sigma_Delta = 1, sensitivity 0.12; BLAS on one thread (the simulator's driver), repeats
interleaved, best reported. At n = 1000 and T = 80 a view has about 8,900 observed messages, above
``EXACT_MAX_ROWS``: a round then certifies with the bound, not this exact path; the row is timed with
the limit lifted, for comparison (``--bound`` also times what such a round uses today).

    python benchmarks/bench_round_certificate.py                     # n = 300, 1000; T = 10, 20, 40, 80
    python benchmarks/bench_round_certificate.py --nodes 1000 --iterations 40 --repeats 3
    python benchmarks/bench_round_certificate.py --verify 200        # agreement only, random executions

``--verify N``: N random executions (n from 10 to 1000, T from 2 to 80, both schedules, collusion and
eavesdrop views, with and without dropouts), the previous and the current profile compared on every
prefix, the full view and random subsets of finals: prints the largest relative difference of mu (a
party's mu below 1e-6 of the view's largest is compared against that floor: it cannot be charged, and a
party the view does not reach has mu = 0 up to round-off) and that of the largest mu, what is charged.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import numpy as np
import scipy.linalg as la
from threadpoolctl import threadpool_limits

from flwr_inca import IncaConfig, PermanentDropout, TemporaryDropout
from flwr_inca.privacy import certify, random_collusion, random_eavesdrop
from flwr_inca.privacy import certificate as certificate_module
from flwr_inca.privacy.linear_system import _b_rows, dense_system
from flwr_inca.privacy.prefix import PrefixProfile
from flwr_inca.privacy.rounds import certification_seeds, certification_views
from flwr_inca.protocol import sample_trace
from flwr_inca.protocol.schedules import adapted_rows

S_STAR, S_DELTA, SENSITIVITY, COLLUSION = 0.05, 1.0, 0.12, 0.1


# ---------------------------------------------------------------------------------------------------------
# the previous implementation, verbatim but for names (for this comparison only)


def _previous_gram(M):
    G = M @ M.T
    return (G + G.T) / 2


def _previous_gram_a(trace, view, per_t):  # noqa: PLR0915 - kept as it was
    n, T = trace.parties, trace.iterations
    online = trace.online_mask()
    is_h = np.zeros(n)
    is_h[view.honest] = 1.0
    sizes = [p.size for p in per_t]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    m = int(offsets[-1])
    G = np.zeros((m, m))
    Cy = np.zeros((m, n))
    Ce = np.zeros((m, n))
    state = {"Pyy": np.zeros((n, n)), "Pye": np.zeros((n, n)), "pee": np.zeros(n)}

    def add_fresh(mask):
        i = np.flatnonzero(mask)
        state["Pyy"][i, i] += mask[i]
        state["Pye"][i, i] += mask[i]
        state["pee"][i] += mask[i]

    add_fresh(is_h)

    def observe(t):
        idx = per_t[t]
        if idx.size == 0:
            return
        a, b = int(offsets[t]), int(offsets[t + 1])
        Cy[a:b] = state["Pyy"][idx]
        Ce[a:b] = state["Pye"][idx]
        block = Cy[:b, idx].T
        G[a:b, :b] = block
        G[:a, a:b] = block[:, :a].T

    observe(0)
    for t in range(1, T + 1):
        on = online[t].astype(float)
        W = trace.steps[t - 1].matrix(n).tocsr()
        WPye = W @ state["Pye"]
        cross = WPye * on[None, :]
        Pyy_new = W @ np.ascontiguousarray((W @ state["Pyy"]).T)
        Pyy_new -= cross
        Pyy_new -= cross.T
        Pyy_new[np.diag_indices(n)] += on * state["pee"]
        state["Pyy"] = Pyy_new
        state["Pye"] = WPye * (1.0 - on)[None, :]
        state["pee"] = state["pee"] * (1.0 - on)
        if t < T:
            add_fresh(on * is_h)
        k = int(offsets[t])
        if k:
            Cy[:k] = Cy[:k] @ W.T.tocsc() - Ce[:k] * on[None, :]
            Ce[:k] *= (1.0 - on)[None, :]
        observe(t)
    return (G + G.T) / 2


def _previous_whiten_at(H, G_B, G_A, sigma_star, sigma_delta, rcond=1e-10):
    Sigma = sigma_star**2 * G_B
    Sigma += sigma_delta**2 * G_A
    norm1 = float(np.abs(Sigma).sum(axis=0).max())
    try:
        L = la.cholesky(Sigma, lower=True, check_finite=False, overwrite_a=True)
    except la.LinAlgError:
        return None
    if not la.lapack.dpocon(L.T, norm1)[0] > rcond:
        return None
    return L, la.blas.dtrsm(1.0, L, H, lower=1)


def previous_profile(trace, view, value_sensitivity=1.0):
    """The previous ``PrefixProfile.build`` (without its size limit): ``(honest, cumulative,
    final_parties, last_factor, last_whitened)`` or None."""
    obs = view.honest_observed()
    per_t = [np.flatnonzero(obs[t]) for t in range(obs.shape[0])]
    rows = np.concatenate([np.stack([p, np.full(p.size, t)], 1) for t, p in enumerate(per_t)])
    rows = rows.astype(np.int64)
    if trace.schedule.is_incremental_pattern:
        c_o, _ = adapted_rows(trace.schedule, trace.online_mask())
        H = _b_rows(trace, view.honest, per_t, c_o)  # unchanged between the two
        G_B, G_A = _previous_gram(H), _previous_gram_a(trace, view, per_t)
    else:
        H, A_V, _ = dense_system(trace, view)
        G_B, G_A = _previous_gram(H), _previous_gram(A_V)
    T = trace.iterations
    offsets = np.searchsorted(rows[:, 1], np.arange(T + 2), side="left")
    nH, m = view.honest.size, rows.shape[0]
    if m == 0:
        return view.honest, np.zeros((T + 2, nH)), np.zeros(0, np.int64), np.zeros((0, 0)), np.zeros((0, nH))
    factor = _previous_whiten_at(H, G_B, G_A, trace.sigma_star, trace.sigma_delta)
    if factor is None:
        return None
    L, W = factor
    csum = np.zeros((m + 1, nH))
    np.cumsum(W * W, axis=0, out=csum[1:])
    a = int(offsets[T])
    return view.honest, csum[offsets], rows[a:, 0].copy(), np.ascontiguousarray(L[a:, a:]), W[a:].copy()


def previous_mu_with_finals(parts, finals):
    """The previous ``PrefixProfile.mu_with_finals`` (sensitivity 1) on ``previous_profile``'s parts."""
    _, cumulative, final_parties, L22, W2 = parts
    T = cumulative.shape[0] - 2
    if finals is None:
        return np.sqrt(cumulative[T + 1])
    kept = np.isin(final_parties, np.asarray(list(finals), dtype=np.int64))
    keep = np.flatnonzero(kept)
    if keep.size == 0 or keep.size == kept.size:
        return np.sqrt(cumulative[T if keep.size == 0 else T + 1])
    L_F = L22[keep]
    z = la.solve_triangular(la.cholesky(L_F @ L_F.T, lower=True), L_F @ W2, lower=True)
    return np.sqrt(cumulative[T] + np.einsum("ij,ij->j", z, z))


# ---------------------------------------------------------------------------------------------------------
def round_view(n, T, seed=1):
    config = IncaConfig(iterations=T, sigma_star=S_STAR, sigma_delta=S_DELTA, dropout=PermanentDropout(0.1))
    trace = sample_trace(n, config, seed=seed)
    view = next(iter(certification_views(trace, certification_seeds(1, 1), 1, collusion=COLLUSION)))
    return trace, view


def _timed(f, *args):
    """``(result, wall seconds, CPU seconds of this process)``: on a shared machine the CPU time is the less
    noisy of the two (it leaves out time-slicing, not cache contention)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = f(*args)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def time_case(n, T, repeats, with_bound, limit):
    """Best over ``repeats`` (interleaved) of the previous and current profile, wall and CPU seconds; the
    current profile's partial-finals and every-prefix reads; the bound where a round would use it."""
    trace, view = round_view(n, T)
    m = int(view.honest_observed().sum())
    times = {key: [] for key in ("old", "old_cpu", "new", "new_cpu", "finals", "through", "bound")}
    online = trace.steps[-1].online
    partial = online[: int(online.size * 0.9)]  # 10% of the finals lost
    for _ in range(repeats):
        old, wall, cpu = _timed(previous_profile, trace, view)
        times["old"].append(wall)
        times["old_cpu"].append(cpu)
        del old
        new, wall, cpu = _timed(lambda: PrefixProfile.build(trace, view, value_sensitivity=SENSITIVITY))
        times["new"].append(wall)
        times["new_cpu"].append(cpu)
        got, wall, _ = _timed(new.mu_with_finals, partial)
        times["finals"].append(wall)
        _, wall, _ = _timed(lambda: [new.mu_through(t) for t in range(T + 1)])
        times["through"].append(wall)
    ref = previous_mu_with_finals(previous_profile(trace, view), partial) * SENSITIVITY
    diff = float(np.max(np.abs(got - ref) / np.maximum(ref, 1e-300)))
    if with_bound and m > limit:
        times["bound"].append(_timed(lambda: certify(trace, view, value_sensitivity=SENSITIVITY))[1])
    return m, {key: min(v) if v else float("nan") for key, v in times.items()}, diff


def _uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run_timing(args):
    print(f"uptime: {_uptime()}")
    print(f"{'n':>5} {'T':>3} {'rows m':>7} {'previous (s)':>12} {'current (s)':>11} {'speed-up':>8} "
          f"{'previous CPU':>12} {'current CPU':>11} {'CPU speed-up':>12} {'partial finals (s)':>18} "
          f"{'all through(t) (s)':>18} {'bound today (s)':>15} {'rel diff':>9}")
    for n in args.nodes:
        for T in args.iterations:
            m, t, diff = time_case(n, T, args.repeats, args.bound, args.limit)
            print(f"{n:>5} {T:>3} {m:>7} {t['old']:>12.3f} {t['new']:>11.3f} {t['old'] / t['new']:>7.2f}x "
                  f"{t['old_cpu']:>12.3f} {t['new_cpu']:>11.3f} {t['old_cpu'] / t['new_cpu']:>11.2f}x "
                  f"{t['finals']:>18.4f} {t['through']:>18.5f} {t['bound']:>15.2f} {diff:>9.1e}", flush=True)
            print(f"       uptime: {_uptime()}", flush=True)


# ---------------------------------------------------------------------------------------------------------
def random_case(index):
    """A random execution and view: n 10..1000, T 2..80 (n T at most 40,000: about 4,000 observed rows), both
    schedules, both threats, no / permanent / temporary dropouts."""
    rng = np.random.default_rng(index)
    n = int(rng.choice([int(rng.integers(10, 60)), int(rng.integers(60, 300)), int(rng.integers(300, 1001))]))
    T = int(rng.integers(2, 81))
    while n * T > 40000 and T > 2:  # about 0.1 n observed rows per iteration at 10% colluders
        T = max(2, T // 2)
    schedule = ("incremental", "early")[index % 2]
    if schedule == "early":
        n, T = min(n, 120), min(T, 12)  # the dense system has n_H * T noise columns
    dropout = [None, PermanentDropout(0.1), TemporaryDropout(0.2)][index % 3]
    config = IncaConfig(iterations=T, neighbors=int(rng.integers(1, 3)), schedule=schedule, dropout=dropout,
                        sigma_star=float(rng.uniform(0.02, 2)), sigma_delta=float(rng.uniform(0.5, 30)))
    trace = sample_trace(n, config, seed=index)
    if index % 4 < 2:
        view = random_collusion(trace, float(rng.uniform(0.05, 0.3)), index)
    else:
        view = random_eavesdrop(trace, float(rng.uniform(0.05, 0.5)), index)
    return trace, view, rng


def _rel(got, ref):
    """Largest relative difference of each party's mu, a mu below 1e-6 of the view's largest compared against
    that floor: such a mu cannot be what is charged, and a party the view does not reach has mu = 0 up to
    round-off (1.7e-19 against 1.2e-19 where the largest is 0.04)."""
    floor = max(1e-6 * float(np.max(np.abs(ref), initial=0.0)), 1e-300)
    return float(np.max(np.abs(got - ref) / np.maximum(np.abs(ref), floor), initial=0.0))


def compare_case(index):
    """Largest relative difference of mu (previous vs current) over every prefix, the full view and up to
    five random subsets of finals; None when the case has no prefix structure (both say None)."""
    trace, view, rng = random_case(index)
    old = previous_profile(trace, view)
    new = PrefixProfile.build(trace, view)
    if old is None or new is None:
        assert old is None and new is None, index
        return trace, view, None
    T = trace.iterations
    pairs = [(new.mu_through(t), np.sqrt(old[1][t])) for t in range(1, T + 2)]
    online = trace.steps[-1].online
    for _ in range(5):
        finals = online[rng.random(online.size) < rng.uniform(0.1, 1.0)]
        pairs.append((new.mu_with_finals(finals), previous_mu_with_finals(old, finals)))
    each = max(_rel(got, ref) for got, ref in pairs)
    largest = max(_rel(np.max(got, initial=0.0), np.max(ref, initial=0.0)) for got, ref in pairs)
    return trace, view, (each, largest)


def run_verify(count):
    worst, worst_largest, used = 0.0, 0.0, 0
    for index in range(count):
        trace, view, diff = compare_case(index)
        if diff is None:
            continue
        used += 1
        worst, worst_largest = max(worst, diff[0]), max(worst_largest, diff[1])
        if diff[0] > 1e-11:
            print(f"case {index}: n = {trace.parties}, T = {trace.iterations}, {trace.schedule.name}, "
                  f"{view.threat}: relative difference {diff[0]:.2e}", flush=True)
    print(f"{used} of {count} random executions factorized; largest relative difference of a party's mu: "
          f"{worst:.2e}, of the largest mu: {worst_largest:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[300, 1000])
    parser.add_argument("--iterations", type=int, nargs="+", default=[10, 20, 40, 80])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bound", action="store_true",
                        help="also time certify() where the view is too large for the exact path")
    parser.add_argument("--verify", type=int, default=0, metavar="N", help="compare on N random executions")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    limit = certificate_module.EXACT_MAX_ROWS
    certificate_module.EXACT_MAX_ROWS = 10**9  # the exact path at every size (see the module docstring)
    with threadpool_limits(1):
        if args.verify:
            run_verify(args.verify)
        else:
            args.limit = limit
            run_timing(args)


if __name__ == "__main__":
    main()
