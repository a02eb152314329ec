"""Privacy accountant: exact certificates vs the sound bound, tightness, calibration, scale.

Setting of the paper's Fig. 3 unless stated: k = 1, T = 20, collusion rho = 0.1, permanent dropouts
gamma = 0.1. Every timed figure is measured in a fresh subprocess (peak memory = its max RSS).

    python benchmarks/bench_accountant.py --scaling 500 1000 2000 4000   # exact vs bound, side by side
    python benchmarks/bench_accountant.py --scaling 1000 --iterations 80  # the same at T = 80 (--neighbors: k)
    python benchmarks/bench_accountant.py --scaling 1000 2000 --methods bound cascade --executions 5  # maxima
    python benchmarks/bench_accountant.py --tightness 200 500 1000 2000  # Fig. 3 settings, calibrated
    python benchmarks/bench_accountant.py --large 10000 100000           # bound at scale + Thm 4.5 check
    python benchmarks/bench_accountant.py --large 10000 --methods bound cascade  # old vs new
    python benchmarks/bench_accountant.py --structure 100000             # the Thm 4.5 / 4.9 check alone
    python benchmarks/bench_accountant.py --calibrate-large 10000 --runs 20
    python benchmarks/bench_accountant.py --calibrate-large 10000 --runs 20 --tight-runs no yes  # side by side
    python benchmarks/bench_accountant.py --cascade-split 10000 --ratios 6 10      # local tier vs global part
    python benchmarks/bench_accountant.py --tightness 2000 --gammas 0.1 --passes 1 2   # one vs two bound passes
    python benchmarks/bench_accountant.py --local-tier 10000 --sample 256 # the cascade's local tier alone
    python benchmarks/bench_accountant.py --screening 1000               # could a cheap pass screen parties?
    python benchmarks/bench_accountant.py --strategy 1000                # IncaStrategy's per-round cost
    python benchmarks/bench_accountant.py --locality 1000 --radius 1     # near/far split vs exact (ratios)
    python benchmarks/bench_accountant.py --charged 1000 4000            # cheap local bound vs the charged max
    python benchmarks/bench_accountant.py --baseline 200                 # vs a dense pseudo-inverse
    python benchmarks/bench_accountant.py --extrapolate 100000           # one batch of the bound, extrapolated
    python benchmarks/bench_accountant.py --full                         # the paper's 1000-run calibration
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import numpy as np

S_STAR, S_DELTA, MU_TARGET = 1.0, 6.0, 0.0625


def _setting(n: int, gamma: float = 0.1, seed: int = 1, s_star: float = S_STAR, s_delta: float = S_DELTA,
             iterations: int = 20, neighbors: int = 1):
    from flwr_inca import IncaConfig, PermanentDropout
    from flwr_inca.privacy import random_collusion
    from flwr_inca.protocol import sample_trace

    dropout = PermanentDropout(gamma) if gamma > 0 else None
    config = IncaConfig(iterations=iterations, neighbors=neighbors, sigma_star=s_star, sigma_delta=s_delta,
                        dropout=dropout)
    trace = sample_trace(n, config, seed=seed)
    return trace, random_collusion(trace, 0.1, seed=seed + 1)


# ------------------------------------------------------------------ one measurement per subprocess
def _job(kind: str, n: int, extra: dict) -> dict:
    """Run in a child process: one timed measurement; returns figures (and max RSS)."""
    from flwr_inca.privacy import calibrate, certify
    from flwr_inca.privacy.structure import analyze_structure

    out: dict = {"kind": kind, "n": n}
    if kind in ("exact", "bound", "cascade", "cascade-numpy"):
        from flwr_inca.privacy.bound import BoundSettings, bound_profile

        trace, view = _setting(n, seed=extra.get("seed", 1), iterations=extra.get("iterations", 20),
                               neighbors=extra.get("neighbors", 1))
        out["rows"] = int(view.honest_observed().sum())
        start = time.perf_counter()

        def mark(line: str) -> None:  # the cascade's progress lines, timed
            if "local bounds done" in line:
                out["local"] = time.perf_counter() - start

        if kind == "exact":
            cert = certify(trace, view, solver=kind)
            mu = np.array([cert.mu[int(i)] for i in view.honest])
        else:  # what certify(solver=...) computes, keeping the per-party iteration counts
            # cascade-numpy: the cascade with the NumPy local tier (what runs without numba); extra "ratio":
            # sigma_delta / sigma_star instead of the trace's (--cascade-split)
            settings = BoundSettings(local_engine="numpy" if kind == "cascade-numpy" else "auto",
                                     threads=extra.get("threads"))
            s_star = trace.sigma_star
            s_delta = s_star * extra["ratio"] if "ratio" in extra else trace.sigma_delta
            prof = bound_profile(trace, view, sigma_star=s_star, sigma_delta=s_delta, settings=settings,
                                 cascade=kind != "bound", progress=mark)
            mu = prof.mu(s_star, s_delta)
            # how many parties got the global solve (the cascade: only those near the maximum)
            out["refined"] = int((prof.iterations > 0).sum())
            out["parties"] = int(view.honest.size)
        out["seconds"] = time.perf_counter() - start
        out["max_mu"] = float(mu.max())
        out["mu"] = mu.tolist() if n <= 5000 else None
    elif kind == "per-party":
        from threadpoolctl import threadpool_limits

        from flwr_inca.privacy.bound import BoundSettings, _cg, _evaluate, _Operator, _warm_start
        from flwr_inca.privacy.message_space import MessageSpace

        trace, view = _setting(n)
        st = BoundSettings()
        start = time.perf_counter()
        with threadpool_limits(1, user_api="blas"):
            ms = MessageSpace(trace, view, S_STAR, S_DELTA)
            op = _Operator(ms, S_STAR, S_DELTA, st)
            setup = time.perf_counter() - start
            part = np.arange(min(st.batch, ms.nH))
            t0 = time.perf_counter()
            x = _cg(op, op.w * ms.apply_P(ms.target(part)), _warm_start(ms, part), st.iterations)
            _evaluate(ms, x, part)
            per = (time.perf_counter() - t0) / part.size
        out.update(setup=setup, per_party=per, parties=int(ms.nH), unknowns=int(ms.U))
    elif kind == "structure":
        trace, view = _setting(n)
        start = time.perf_counter()
        report = analyze_structure(trace, view)
        out["seconds"] = time.perf_counter() - start
        out["components"] = report.components
    elif kind == "calibrate":
        from flwr_inca import PermanentDropout
        from flwr_inca.privacy.bound import BoundSettings

        start = time.perf_counter()
        done: list[float] = []  # when each simulated run was certified
        cal = calibrate(extra.get("epsilon", 1.0), 1e-5, n, iterations=20, neighbors=1, collusion=0.1,
                        dropout=PermanentDropout(0.1), runs=extra["runs"], seed=0, solver=extra["solver"],
                        bound_passes=extra.get("passes", 1), tight_runs=extra.get("tight_runs", False),
                        bound_settings=BoundSettings(threads=extra.get("threads")),
                        progress=lambda r, total: done.append(time.perf_counter() - start))
        out["seconds"] = time.perf_counter() - start
        out["per_run"] = np.diff([0.0, *done]).tolist()
        out.update(sigma_star=cal.sigma_star, sigma_delta=cal.sigma_delta, mse=cal.predicted_mse,
                   success=cal.success_fraction, notes=cal.notes)
    out["max_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out


def run_job(kind: str, n: int, **extra) -> dict:
    cmd = [sys.executable, __file__, "--job", json.dumps({"kind": kind, "n": n, "extra": extra})]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{kind} at n = {n} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ sections
def scaling(ns: list[int], exact_max: int, methods: list[str] | None = None, executions: int = 1,
            iterations: int = 20, neighbors: int = 1) -> None:
    if executions > 1:
        return _maxima(ns, exact_max, methods or ["bound"], executions)
    shape = {"iterations": iterations, "neighbors": neighbors}
    if methods and methods != ["bound"]:
        return _scaling_methods(ns, exact_max, methods, shape)
    print(f"exact vs bound, T = {iterations}, k = {neighbors}, sigma_star = {S_STAR}, sigma_delta = {S_DELTA} "
          "(each in its own process)\n")
    header = (f"{'n':>6} {'rows m':>7} {'exact s':>9} {'exact GB':>9} {'bound s':>9} {'bound GB':>9} "
              f"{'bound/exact max mu':>19} {'min ratio':>10}")
    print(header)
    print("-" * len(header))
    for n in ns:
        b = run_job("bound", n, **shape)
        if n <= exact_max:
            e = run_job("exact", n, **shape)
            ratio = b["max_mu"] / e["max_mu"]
            r = np.array(b["mu"]) / np.maximum(np.array(e["mu"]), 1e-300)
            pos = np.array(e["mu"]) > 1e-9
            print(f"{n:>6} {b['rows']:>7} {e['seconds']:>9.2f} {e['max_rss_gb']:>9.2f} {b['seconds']:>9.2f} "
                  f"{b['max_rss_gb']:>9.2f} {ratio:>19.5f} {r[pos].min():>10.6f}", flush=True)
        else:
            print(f"{n:>6} {b['rows']:>7} {'-':>9} {'-':>9} {b['seconds']:>9.2f} {b['max_rss_gb']:>9.2f} "
                  f"{'-':>19} {'-':>10}", flush=True)


def _scaling_methods(ns: list[int], exact_max: int, methods: list[str], shape: dict) -> None:
    """The bound methods side by side (each in its own process, same execution of ``shape``'s T and k),
    against exact where affordable: seconds, peak memory and the maximum (what is charged)."""
    print(f"methods {methods} vs exact, T = {shape['iterations']}, k = {shape['neighbors']}, "
          f"sigma_star = {S_STAR}, sigma_delta = {S_DELTA}\n")
    for n in ns:
        e = run_job("exact", n, **shape) if n <= exact_max else None
        got = {m: run_job(m, n, **shape) for m in methods}
        line = f"n = {n}, {next(iter(got.values()))['rows']} observed messages:"
        if e:
            line += f" exact {e['seconds']:.2f} s / {e['max_rss_gb']:.2f} GB, max mu {e['max_mu']:.6g};"
        for m, b in got.items():
            ratio = f" ({b['max_mu'] / e['max_mu']:.5f} x exact)" if e else ""
            line += f" {m} {b['seconds']:.2f} s / {b['max_rss_gb']:.2f} GB, max mu {b['max_mu']:.6g}{ratio};"
        print(line, flush=True)


def _maxima(ns: list[int], exact_max: int, methods: list[str], executions: int) -> None:
    """The charged maximum of each bound method against the exact one (where affordable) and against the
    first method, on ``executions`` executions per n (seeds 1..executions), each in its own process."""
    print(f"maximum mu of {methods} vs exact over {executions} executions per n, sigma_star = {S_STAR}, "
          f"sigma_delta = {S_DELTA}\n")
    for n in ns:
        over: dict[str, list[float]] = {m: [] for m in methods}
        versus: dict[str, list[float]] = {m: [] for m in methods[1:]}
        for seed in range(1, executions + 1):
            e = run_job("exact", n, seed=seed) if n <= exact_max else None
            got = {m: run_job(m, n, seed=seed) for m in methods}
            line = f"n = {n}, execution {seed}:" + (f" exact {e['max_mu']:.7g} ({e['seconds']:.1f} s);" if e else "")
            for m, b in got.items():
                line += f" {m} {b['max_mu']:.7g} ({b['seconds']:.1f} s)"
                if e:
                    over[m].append(b["max_mu"] / e["max_mu"] - 1)
                    line += f" = exact + {100 * over[m][-1]:.3f}%"
                if m != methods[0]:
                    versus[m].append(b["max_mu"] / got[methods[0]]["max_mu"] - 1)
                    line += f", {methods[0]} {100 * versus[m][-1]:+.3f}%"
                line += ";"
            print(line, flush=True)
        for m, rel in over.items():
            if rel:
                print(f"n = {n}: {m} over exact {100 * min(rel):.3f}% to {100 * max(rel):.3f}%, above 0.2% in "
                      f"{sum(r > 0.002 for r in rel)} of {len(rel)} executions", flush=True)
        for m, rel in versus.items():
            print(f"n = {n}: {m} against {methods[0]} {100 * min(rel):+.3f}% to {100 * max(rel):+.3f}%, higher in "
                  f"{sum(r > 0 for r in rel)} of {len(rel)} executions", flush=True)


def tightness(ns: list[int], gammas: list[float], runs: int, epsilon: float, passes: tuple[int, ...] = (1,),
              tight: tuple[bool, ...] = (False,)) -> None:
    """Fig. 3 settings: calibrate with the exact method and with the bound (both forced), then compare
    the weakest party's bound with its exact mu at the exact calibration's sigmas, and the MSEs; every
    (bound_passes, tight_runs) requested is calibrated, the first one in the table."""
    from flwr_inca import PermanentDropout
    from flwr_inca.privacy import calibrate, certify

    print(f"Fig. 3 settings: epsilon = {epsilon}, delta = 1e-5, rho = 0.1, k = 1, T = 20; {runs} runs each\n")
    header = (f"{'n':>5} {'gamma':>6} {'weakest bound/exact (worst run)':>32} {'sigma_delta bound/exact':>24} "
              f"{'MSE bound/exact':>16} {'exact s':>8} {'bound s':>8}")
    print(header)
    print("-" * len(header))
    for n in ns:
        for gamma in gammas:
            kw = {"iterations": 20, "neighbors": 1, "collusion": 0.1, "runs": runs, "seed": 0,
                      "dropout": PermanentDropout(gamma) if gamma > 0 else None}
            t0 = time.perf_counter()
            ex = calibrate(epsilon, 1e-5, n, solver="exact", **kw)
            t1 = time.perf_counter()
            bds = {(k, t): calibrate(epsilon, 1e-5, n, solver="bound", bound_passes=k, tight_runs=t, **kw)
                   for k in passes for t in tight}
            bd = bds[passes[0], tight[0]]
            t2 = time.perf_counter()
            worst = 0.0
            for r, (ts, vs) in enumerate(ex.run_seeds):
                trace, view = _regenerate(n, gamma, ts, vs)
                a = certify(trace, view, sigma_star=ex.sigma_star, sigma_delta=ex.sigma_delta, solver="exact")
                b = certify(trace, view, sigma_star=ex.sigma_star, sigma_delta=ex.sigma_delta, solver="bound")
                worst = max(worst, b.max_mu / a.max_mu)
            print(f"{n:>5} {gamma:>6.2f} {worst:>32.4f} {bd.sigma_delta / ex.sigma_delta:>24.4f} "
                  f"{bd.predicted_mse / ex.predicted_mse:>16.4f} {t1 - t0:>8.1f} {t2 - t1:>8.1f}", flush=True)
            for (k, t), c in bds.items():  # every requested variant, against exact
                print(f"      bound_passes={k}, tight_runs={t}: sigma_star {c.sigma_star / ex.sigma_star:.4f}x, sigma_delta "
                      f"{c.sigma_delta / ex.sigma_delta:.4f}x, MSE {c.predicted_mse / ex.predicted_mse:.4f}x "
                      f"of the exact calibration ({c.seconds:.1f} s)", flush=True)


def _regenerate(n: int, gamma: float, trace_seed: int, view_seed: int):
    from flwr_inca import IncaConfig, PermanentDropout
    from flwr_inca.privacy import random_collusion
    from flwr_inca.protocol import sample_trace

    config = IncaConfig(iterations=20, neighbors=1, sigma_star=1, sigma_delta=1,
                        dropout=PermanentDropout(gamma) if gamma > 0 else None)
    trace = sample_trace(n, config, trace_seed)
    return trace, random_collusion(trace, 0.1, view_seed)


def structure(ns: list[int]) -> None:
    """The Thm 4.5 / 4.9 precondition check alone (union-find over the honest communication graph)."""
    for n in ns:
        s = run_job("structure", n)
        print(f"n = {n}: structure pre-check {s['seconds']:.2f} s ({s['components']} components), "
              f"peak {s['max_rss_gb']:.2f} GB", flush=True)


def large(ns: list[int], methods: list[str], threads: int | None = None) -> None:
    """The bound methods at scale (what certify(solver=method) computes), each in its own process, on
    the same execution."""
    print("the bound at scale (sigma_star = 1, sigma_delta = 6) and the Thm 4.5 / 4.9 pre-check\n")
    for n in ns:
        structure([n])
        for method in methods:
            b = run_job(method, n, threads=threads)
            refined = f", global solve for {b['refined']} of {b['parties']} parties" if b.get("refined") else ""
            if "local" in b:
                refined += f" (local tier {b['local']:.1f} s)"
            print(f"n = {n}: {method} certificate {b['seconds']:.1f} s, max mu {b['max_mu']:.6g}, "
                  f"{b['rows']} observed honest messages, peak {b['max_rss_gb']:.2f} GB{refined}", flush=True)


def extrapolate(ns: list[int]) -> None:
    """Time one batch of parties through the bound's first phase; extrapolate to every honest party."""
    for n in ns:
        r = run_job("per-party", n)
        total = r["setup"] + r["per_party"] * r["parties"]
        print(f"n = {n}: {r['unknowns']} unknowns; set-up {r['setup']:.1f} s; first phase "
              f"{r['per_party'] * 1e3:.0f} ms per party -> about {total:.0f} s for {r['parties']} parties "
              f"(before refinement); peak {r['max_rss_gb']:.2f} GB", flush=True)


def screening(ns: list[int], iterations: tuple[int, ...] = (0, 1, 2, 4, 8)) -> None:
    """Could a cheap first pass screen most parties out? The bound of every party after 0 (the warm
    start alone), 1, 2, 4 and 8 CG iterations, against the largest bound after 8."""
    from threadpoolctl import threadpool_limits

    from flwr_inca.privacy.bound import BoundSettings, _cg, _evaluate, _Operator, _warm_start
    from flwr_inca.privacy.message_space import MessageSpace

    for n in ns:
        trace, view = _setting(n)
        with threadpool_limits(1, user_api="blas"):
            ms = MessageSpace(trace, view, S_STAR, S_DELTA)
            op = _Operator(ms, S_STAR, S_DELTA, BoundSettings())
            mus: dict[int, list[np.ndarray]] = {k: [] for k in iterations}
            for a in range(0, ms.nH, 64):
                part = np.arange(a, min(a + 64, ms.nH))
                b = op.w * ms.apply_P(ms.target(part))
                x, done = _warm_start(ms, part), 0
                for k in iterations:
                    x = _cg(op, b, x, k - done)
                    done = k
                    X, E = _evaluate(ms, x, part)
                    mus[k].append(np.sqrt(X / S_STAR**2 + E / S_DELTA**2))
        final = np.concatenate(mus[iterations[-1]]).max()
        for k in iterations:
            m = np.concatenate(mus[k])
            print(f"n = {n}, {k} CG iterations: max bound / final max {m.max() / final:.3f}, median {np.median(m):.4g}, "
                  f"parties above the final max {(m > final).sum()} of {m.size}", flush=True)


def local_tier(ns: list[int], sample: int, batches: list[int]) -> None:
    """The cascade's local tier alone (``LocalTier.bounds_array``) on ``sample`` random parties: ms per
    party by batch size and search (compiled when numba imports, then NumPy), and where the time goes."""
    from threadpoolctl import threadpool_limits

    from flwr_inca.privacy import local_compiled
    from flwr_inca.privacy.bound import BoundSettings, _local_tier, _Operator
    from flwr_inca.privacy.local_bound import _Batch
    from flwr_inca.privacy.message_space import MessageSpace

    for n in ns:
        trace, view = _setting(n)
        with threadpool_limits(1, user_api="blas"):
            t0 = time.perf_counter()
            ms = MessageSpace(trace, view, S_STAR, S_DELTA)
            st = BoundSettings()
            tier = _local_tier(ms, _Operator(ms, S_STAR, S_DELTA, st), st, S_STAR, S_DELTA)
            print(f"n = {n}: set-up (message space, G, tier) {time.perf_counter() - t0:.1f} s", flush=True)
            qs = np.random.default_rng(0).choice(ms.nH, min(sample, ms.nH), replace=False)
            ref = None
            if local_compiled.available():  # compile (or load numba's cache) outside the timings
                tier.engine = "compiled"
                tier.bounds_and_dy(qs[:1])
            paths = ["compiled", "numpy"] if local_compiled.available() else ["numpy"]
            for path in paths:  # the NumPy search in its default precision (float32)
                tier.engine = path
                for b in batches:
                    parts = [qs[k: k + b] for k in range(0, qs.size, b)]
                    t = np.zeros(3)
                    mus = []
                    for part in parts:
                        c0 = time.perf_counter()
                        if path == "compiled":  # supports, search and evaluation, each compiled
                            X, E, _ = tier.bounds_and_dy(part)
                            c1 = c2 = c3 = time.perf_counter()
                        else:
                            batch = _Batch(tier, part)
                            c1 = time.perf_counter()
                            u, a = tier.solve_batch(batch)  # builds its sparse system here
                            c2 = time.perf_counter()
                            X, E = tier.evaluate_batch(batch, u, a)
                            c3 = time.perf_counter()
                        t += [c1 - c0, c2 - c1, c3 - c2]
                        mus.append(np.sqrt(X / S_STAR**2 + E / S_DELTA**2))
                    mu = np.concatenate(mus)
                    ref = mu if ref is None else ref
                    per = t / qs.size * 1e3
                    split = (f"supports {per[0]:.2f} ms + search {per[1]:.2f} ms + evaluation {per[2]:.2f} ms = "
                             if path == "numpy" else "")
                    # parties that dropped out before injecting have mu = 0: both engines give rounding-level
                    # bounds there (1e-16 against 2e-10), whose ratio says nothing; they are counted apart
                    live = ref > 1e-9 * ref.max()
                    ratio = mu[live] / ref[live]
                    print(f"  {path:>8}, batch {b:>3}: {split}{per.sum():.2f} ms per party; local bound / first "
                          f"row's: min {ratio.min():.5f}, max {ratio.max():.5f} ({int((~live).sum())} parties with "
                          f"mu ~ 0 left out: first row's max {ref[~live].max(initial=0):.2g}, this row's "
                          f"{mu[~live].max(initial=0):.2g})", flush=True)


def cascade_split(ns: list[int], ratios: list[float], threads: int | None = None) -> None:
    """The cascade at sigma_star = 1 and sigma_delta = ratio: its local tier (set-up, G and every party's local
    bound) and its global part (the global solves and the refinement), each n and ratio in its own process."""
    for n in ns:
        for ratio in ratios:
            r = run_job("cascade", n, ratio=ratio, threads=threads)
            print(f"n = {n}, sigma_delta / sigma_star = {ratio:g}: cascade {r['seconds']:.1f} s = local tier "
                  f"{r['local']:.1f} s + global part {r['seconds'] - r['local']:.1f} s; global solves "
                  f"{r['refined']} / {r['parties']}; max mu {r['max_mu']:.7g}; peak {r['max_rss_gb']:.2f} GB",
                  flush=True)


def calibrate_large(ns: list[int], runs: int, passes: int = 1, threads: int | None = None,
                    tight: tuple[bool, ...] = (False,)) -> None:
    """calibrate(solver="auto") at each n; ``tight``: the tight_runs settings, side by side."""
    for n in ns:
        for tight_runs in tight:
            c = run_job("calibrate", n, runs=runs, solver="auto", passes=passes, threads=threads,
                        tight_runs=tight_runs)
            print(f"calibrate(n = {n}, runs = {runs}, epsilon = 1, delta = 1e-5, tight_runs = {tight_runs}): "
                  f"{c['seconds']:.1f} s, sigma_star {c['sigma_star']:.4g}, sigma_delta {c['sigma_delta']:.4g}, "
                  f"predicted MSE {c['mse']:.4g}, success {c['success']:.2f}, peak {c['max_rss_gb']:.2f} GB",
                  flush=True)
            for note in c["notes"]:
                print(f"  note: {note}", flush=True)
            _per_run(c)


def _per_run(c: dict) -> None:
    per = np.array(c["per_run"])
    print(f"  per run (simulate and certify): {', '.join(f'{x:.1f}' for x in per)} s; median {np.median(per):.1f} s, "
          f"max {per.max():.1f} s; the rest (alpha grid, bisection, runs bounded again) "
          f"{c['seconds'] - per.sum():.1f} s", flush=True)


def strategy(ns: list[int], draws: int, repeats: int = 3) -> None:
    """What IncaStrategy pays per round: ``threat_draws`` certificates of the round's trace (auto), with
    certify's one-pair Cholesky path, against the pencil method (every pair; what certify used before),
    alternating, medians of ``repeats``; and where the time goes."""
    import cProfile
    import pstats

    from flwr_inca.privacy import certify, profile, random_collusion

    for n in ns:
        trace, _ = _setting(n)
        views = [random_collusion(trace, 0.1, [0, 1, draw]) for draw in range(draws)]
        fast, pencil, methods = [], [], set()
        for _ in range(repeats):
            t0 = time.perf_counter()
            for view in views:
                methods.add(certify(trace, view).method)
            t1 = time.perf_counter()
            for view in views:
                profile(trace, view).mu(trace.sigma_star, trace.sigma_delta)
            t2 = time.perf_counter()
            fast.append(t1 - t0)
            pencil.append(t2 - t1)
        print(f"n = {n}: per-round certification ({draws} threat draws, {sorted(methods)}): "
              f"{np.median(fast):.2f} s (pencil method {np.median(pencil):.2f} s, "
              f"ratio {np.median(fast) / np.median(pencil):.2f}; medians of {repeats})", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for view in views:
            certify(trace, view)
        prof.disable()
        stats = pstats.Stats(prof)
        total = sum(v[2] for v in stats.stats.values())
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:5]
        print("  where the time goes (tottime): " + "; ".join(
            f"{k[2]} {v[2]:.2f} s ({v[2] / total:.0%})" for k, v in top), flush=True)


class _Local:
    """The whitened least-squares operator ``L = W P Dz`` of one execution (``min_dy ||L dy - b_i||`` is
    mu_i^2) and what a near-field / far-field ``dy = a G + u`` needs: ``LG`` for the shared global
    ``G`` (60 CG iterations on the mean right-hand side) and the column / party incidence."""

    def __init__(self, n: int, g_iterations: int = 60) -> None:
        import scipy.sparse as sp

        from flwr_inca.privacy.bound import BoundSettings, _cg, _Operator
        from flwr_inca.privacy.local_bound import whitened_operator
        from flwr_inca.privacy.message_space import MessageSpace

        self.trace, self.view = _setting(n)
        ms = self.ms = MessageSpace(self.trace, self.view, S_STAR, S_DELTA)
        self.w, self.L = whitened_operator(ms, S_STAR, S_DELTA)
        self.L.sort_indices()
        coo = self.L.tocoo()
        self.touches = sp.csr_matrix((np.ones(coo.nnz), (coo.col, ms.row_q[coo.row])), shape=(ms.U, ms.nH))
        self.touched_by = self.touches.T.tocsr()
        self.op = _Operator(ms, S_STAR, S_DELTA, BoundSettings())
        t_sum = np.zeros((ms.R, 1))  # the sum of every party's target, without R x n_H floats
        slots = np.arange(ms.nH)
        rows = ms.rowid(np.arange(ms.T + 1)[:, None], slots[None, :])
        hon = ms.parties[slots]
        t_sum[rows.ravel(), 0] = np.where(ms.online[:, hon], ms.c_o[:, hon], 0.0).ravel()
        b_mean = self.w[:, None] * ms.apply_P(t_sum) / ms.nH
        self.G = _cg(self.op, b_mean, np.zeros((ms.U, 1)), g_iterations).astype(float)
        self.LG = (self.L @ self.G).ravel()
        self.LG2 = float(self.LG @ self.LG)

    def b(self, q: int) -> tuple[np.ndarray, np.ndarray]:
        """Whitened right-hand side of the party in slot q: (rows, values), its own T + 1 rows only."""
        ms = self.ms
        rows = ms.rowid(np.arange(ms.T + 1), q)
        g = ms.groups[int(ms.group_of[q])]
        j = int(ms.parties[q])
        t = np.where(ms.online[:, j], ms.c_o[:, j], 0.0)
        vals = np.zeros(ms.T + 1) if g.blocked else g.P @ t
        return rows, self.w[rows] * vals

    def b_dense(self, q: int) -> np.ndarray:
        out = np.zeros(self.ms.R)
        rows, vals = self.b(q)
        out[rows] = vals
        return out

    def support(self, q: int, radius: int) -> np.ndarray:
        """The unseen messages that touch a party within ``radius`` hops of slot q (party graph: parties
        linked by a message in any iteration)."""
        near = np.zeros(self.ms.nH, dtype=bool)
        near[q] = True
        for _ in range(radius):
            near[self.touches[np.unique(self.touched_by[np.flatnonzero(near)].indices)].indices] = True
        return np.unique(self.touched_by[np.flatnonzero(near)].indices)

    def hops(self, q: int, radius: int) -> int:
        near = np.zeros(self.ms.nH, dtype=bool)
        near[q] = True
        for _ in range(radius):
            near[self.touches[np.unique(self.touched_by[np.flatnonzero(near)].indices)].indices] = True
        return int(near.sum())

    def compact(self, S: np.ndarray, b_rows: np.ndarray):
        """``L[:, S]`` on the rows it (or b) touches: (A, rows). Outside them the residual of
        ``a G + u`` is ``a LG``, whose squared norm there is ``LG2 - ||LG[rows]||^2``."""
        import scipy.sparse as sp

        Lc = self.L
        starts, ends = Lc.indptr[S], Lc.indptr[S + 1]
        lens = ends - starts
        first = np.concatenate([[0], np.cumsum(lens)])
        idx = np.repeat(starts - first[:-1], lens) + np.arange(first[-1])
        rows, inv = np.unique(np.concatenate([Lc.indices[idx], b_rows]), return_inverse=True)
        return sp.csc_matrix((Lc.data[idx], inv[: idx.size], first), shape=(rows.size, S.size)), rows

    def _local(self, q: int, S: np.ndarray):
        b_rows, b_vals = self.b(q)
        A, rows = self.compact(S, b_rows)
        bN = np.zeros(rows.size)
        bN[np.searchsorted(rows, b_rows)] = b_vals
        return A, rows, bN

    def normal(self, q: int, S: np.ndarray, extra: np.ndarray | None = None) -> float:
        """min over (a, u on S) of ||a LG + L_S u - b_q|| by dense normal equations (a ratio tool)."""
        import scipy.linalg as la

        A, rows, bN = self._local(q, S)
        E = self.LG[rows][:, None] if extra is None else np.column_stack([self.LG[rows], extra[rows]])
        off = np.zeros(E.shape[1])
        out = np.ones(self.ms.R, dtype=bool)
        out[rows] = False
        Eo = (self.LG[out][:, None] if extra is None else np.column_stack([self.LG[out], extra[out]]))
        M = np.block([[(A.T @ A).toarray(), A.T @ E], [(A.T @ E).T, E.T @ E + Eo.T @ Eo]])
        rhs = np.concatenate([A.T @ bN, E.T @ bN + off])
        d = np.sqrt(np.maximum(np.diag(M), 1e-300))
        z = la.solve(M / d[:, None] / d[None, :] + 1e-10 * np.eye(d.size), rhs / d, assume_a="pos") / d
        r = A @ z[: S.size] + E @ z[S.size:] - bN
        return float(np.sqrt(r @ r + np.sum((Eo @ z[S.size:]) ** 2)))

    def cgls(self, q: int, S: np.ndarray, iterations: int) -> tuple[np.ndarray, list[float]]:
        """Jacobi-preconditioned CGLS on the same problem; (coefficients (u, a), residual norm after each
        iteration)."""
        A, rows, bN = self._local(q, S)
        AT = A.T.tocsr()
        g = self.LG[rows]
        c = math.sqrt(max(self.LG2 - float(g @ g), 0.0))
        d = np.concatenate([np.sqrt(np.asarray(A.multiply(A).sum(axis=0)).ravel()), [math.sqrt(self.LG2)]])
        d = np.where(d > 0, d, 1.0)

        def mv(z):
            u, a = z[:-1] / d[:-1], z[-1] / d[-1]
            return np.concatenate([A @ u + a * g, [a * c]])

        def mtv(r):
            return np.concatenate([AT @ r[:-1], [g @ r[:-1] + c * r[-1]]]) / d

        r = np.concatenate([bN, [0.0]])
        z = np.zeros(S.size + 1)
        s = mtv(r)
        p, gam, hist = s.copy(), float(s @ s), []
        for _ in range(iterations):
            qv = mv(p)
            al = gam / float(qv @ qv)
            z += al * p
            r -= al * qv
            s = mtv(r)
            gn = float(s @ s)
            p = s + (gn / gam) * p
            gam = gn
            hist.append(float(np.sqrt(r @ r)))
        return z / d, hist


    def greedy(self, q: int, step: int, max_columns: int, iterations: int = 80) -> list[tuple[int, float]]:
        """Grow the support from r = 1 by the columns of the 2-hop support with the largest
        ``(gradient / column norm)^2`` (what adding each alone would gain), ``step`` at a time;
        (columns, local optimum) after each growth."""
        b = self.b_dense(q)
        S = self.support(q, 1)
        pool = self.support(q, 2)
        Lp = self.L[:, pool]
        norms = np.sqrt(np.asarray(Lp.multiply(Lp).sum(axis=0)).ravel()) + 1e-300
        out = []
        while True:
            z, hist = self.cgls(q, S, iterations)
            out.append((int(S.size), hist[-1]))
            if S.size >= max_columns:
                return out
            u = np.zeros(self.ms.U)
            u[S] = z[:-1]
            score = ((Lp.T @ (self.L @ u + z[-1] * self.LG - b)) / norms) ** 2
            score[np.isin(pool, S)] = -1.0
            S = np.union1d(S, pool[np.argsort(-score)[:step]])

def locality(ns: list[int], radius: int = 1, parties: int = 8, deflate: int = 0) -> None:
    """Does a near-field / far-field split work? For the weakest parties and a few random ones: the
    least-squares optimum over ``dy = a G + u``, u on the columns touching the parties within
    ``radius`` hops of i in the party graph (parties linked by a message), G the optimal ``dy`` of the
    mean right-hand side (with ``deflate`` > 0: also the ``deflate`` eigenvectors of ``L^T L`` with the
    smallest eigenvalues, a coarse space), against the exact mu; and the size of the r-hop
    neighbourhoods (ratios, not timings)."""
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla

    from flwr_inca.privacy import certify

    for n in ns:
        loc = _Local(n)
        ms, L, LG = loc.ms, loc.L, loc.LG[:, None]
        if deflate:
            vals, vecs = spla.eigsh((L.T @ L).tocsc(), k=deflate, sigma=-1e-3, which="LM")
            print(f"n = {n}: the {deflate} smallest eigenvalues of L^T L: {vals.min():.3g} .. {vals.max():.3g}")
            LG = np.hstack([LG, L @ vecs])
        exact = certify(loc.trace, loc.view, solver="exact")
        mu = np.array([exact.mu[int(p)] for p in ms.parties])
        rng = np.random.default_rng(0)
        pick = list(np.argsort(-mu)[: parties // 2]) + list(rng.choice(ms.nH, parties - parties // 2, replace=False))
        print(f"n = {n}: {ms.U} unknowns, {ms.nH} honest parties; dy = a G + u(r-hop), r = {radius}")
        for q in pick:
            support = loc.support(q, radius)
            A = sp.hstack([L[:, support], sp.csc_matrix(LG)]).tocsc()
            b = loc.b_dense(q)
            x = spla.lsqr(A, b, atol=1e-12, btol=1e-12, iter_lim=3000)[0]
            local = float(np.sqrt(np.sum((A @ x - b) ** 2)))
            print(f"  party {ms.parties[q]:>6}: exact mu {mu[q]:.5f}, local+global {local:.5f} "
                  f"(ratio {local / mu[q]:.3f}; {support.size} columns); parties within 1, 2 hops: "
                  f"{loc.hops(q, 1)}, {loc.hops(q, 2)}", flush=True)


def charged(ns: list[int], sample: int, reference: dict[int, float], timed: int) -> None:
    """Only the charged maximum must be tight: how many parties would a cheap sound local bound (r = 1
    near field + the shared G) leave above the maximum, and what does each tier cost per party?

    For ``sample`` random honest parties: the r = 1 optimum (dense normal equations) against the
    largest exact mu (n <= 5000) or ``reference[n]`` (a sound bound's maximum, e.g. from ``--large``).
    Then, for ``timed`` random parties, the per-party time of r = 1 and r = 2 local solves (Jacobi
    CGLS; extraction of the local matrix included) and their sizes; for the 3 weakest parties (exact
    only) the greedy growth of the support from r = 1 toward r = 2."""
    import resource

    from threadpoolctl import threadpool_limits

    from flwr_inca.privacy import certify

    for n in ns:
        with threadpool_limits(1, user_api="blas"):
            t0 = time.perf_counter()
            compare = n <= 5000 or n in reference
            loc = _Local(n, g_iterations=60 if compare else 10)  # timings only: G's quality does not matter
            setup = time.perf_counter() - t0
            ms = loc.ms
            print(f"n = {n}: {ms.nH} honest parties, {ms.U} unknowns, L has {loc.L.nnz} non-zeros; set-up "
                  f"(message space, L, G by {60 if compare else 10} CG iterations) {setup:.1f} s", flush=True)
            rng = np.random.default_rng(0)
            mu = None
            if n <= 5000:
                t0 = time.perf_counter()
                exact = certify(loc.trace, loc.view, solver="exact")
                mu = np.array([exact.mu[int(p)] for p in ms.parties])
                top = float(mu.max())
                print(f"  exact certificate {time.perf_counter() - t0:.1f} s; exact mu / max: quantiles "
                      f"(50, 90, 99%) {np.round(np.quantile(mu / top, [0.5, 0.9, 0.99]), 3)}, parties above "
                      f"0.9x: {(mu > 0.9 * top).sum()}, 0.95x: {(mu > 0.95 * top).sum()}", flush=True)
            else:
                top = reference.get(n)
            if top:
                pick = rng.choice(ms.nH, min(sample, ms.nH), replace=False)
                v = np.array([loc.normal(q, loc.support(q, 1)) for q in pick])
                src = "exact" if mu is not None else "reference"
                fr = ", ".join(f"{f}x: {(v > f * top).mean():.1%}" for f in (1.0, 1.02, 1.05, 1.1, 1.2))
                print(f"  r = 1 bound / max mu ({src} {top:.5g}), {pick.size} random parties: median "
                      f"{np.median(v / top):.3f}, 90% {np.quantile(v / top, 0.9):.3f}; above {fr}", flush=True)
                if mu is not None:
                    own = v[mu[pick] > 0] / mu[pick][mu[pick] > 0]
                    print(f"  r = 1 bound / own exact mu: median {np.median(own):.3f}, min {own.min():.3f}",
                          flush=True)
            times: dict[str, list[float]] = {}
            sizes: dict[str, list[int]] = {}
            for q in rng.choice(ms.nH, timed, replace=False):
                for radius, its in ((1, 20), (1, 40), (2, 80)):
                    key = f"r = {radius}, {its} iterations"
                    t0 = time.perf_counter()
                    S = loc.support(q, radius)
                    loc.cgls(q, S, its)
                    times.setdefault(key, []).append(time.perf_counter() - t0)
                    if its != 20:
                        sizes.setdefault(f"r = {radius}", []).append(S.size)
                        sizes.setdefault(f"r = {radius} parties", []).append(loc.hops(q, radius))
                t0 = time.perf_counter()
                loc.normal(q, loc.support(q, 1))
                times.setdefault("r = 1, dense normal equations", []).append(time.perf_counter() - t0)
            for key, ts in times.items():
                print(f"  per party, {key}: {np.median(ts) * 1e3:.0f} ms (median of {len(ts)}) -> "
                      f"{np.median(ts) * ms.nH:.0f} s for all {ms.nH}", flush=True)
            print("  sizes (median): " + ", ".join(f"{k} {np.median(v):.0f}" for k, v in sizes.items())
                  + " (columns, or parties within r hops)", flush=True)
            if mu is not None:
                for q in np.argsort(-mu)[:3]:
                    t0 = time.perf_counter()
                    grow = loc.greedy(q, 500, 3000)
                    print(f"  weakest party {ms.parties[q]}: greedy support (columns: local / exact) "
                          + " ".join(f"{c}: {val / mu[q]:.3f}" for c, val in grow)
                          + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
        print(f"  peak memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB", flush=True)


def baseline(ns: list[int]) -> None:
    """The textbook computation, ``mu_i = ||M^+ h_i||`` with ``M = [s* B_V, s_D A_V]`` over all observed
    rows and ``np.linalg.pinv``, against certify in the same process."""
    from flwr_inca.privacy import certify
    from flwr_inca.privacy.linear_system import dense_system
    from flwr_inca.privacy.views import AdversaryView

    for n in ns:
        trace, view = _setting(n)
        full = AdversaryView(view.threat, np.zeros(0, dtype=np.int64), view.observed)
        B_all, A_all, _ = dense_system(trace, full)
        honest = view.honest
        cols_a = (np.arange(trace.iterations)[:, None] * trace.parties + honest[None, :]).reshape(-1)
        B, A = B_all[:, honest], A_all[:, cols_a]
        t0 = time.perf_counter()
        M = np.hstack([S_STAR * B, S_DELTA * A])
        base = np.linalg.norm(np.linalg.pinv(M, rcond=1e-12) @ B, axis=0)
        t1 = time.perf_counter()
        cert = certify(trace, view, solver="exact")
        t2 = time.perf_counter()
        ours = np.array([cert.mu[int(i)] for i in honest])
        print(f"n = {n}: pinv baseline {t1 - t0:.3f} s, certify {t2 - t1:.3f} s, "
              f"max|diff|/max mu {np.max(np.abs(ours - base)) / base.max():.1e}", flush=True)


def full() -> None:
    from flwr_inca import PermanentDropout
    from flwr_inca.privacy import calibrate

    start = time.perf_counter()
    cal = calibrate(0.2, 1e-5, 200, iterations=20, neighbors=1, collusion=0.1, dropout=PermanentDropout(0.1),
                    runs=1000, procedure="paper", seed=0)
    print(f"calibrate(procedure='paper', runs=1000, n=200): {time.perf_counter() - start:.1f} s "
          f"(sigma_star {cal.sigma_star:.4g}, sigma_delta {cal.sigma_delta:.4g}, "
          f"success {cal.success_fraction:.3f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", help=argparse.SUPPRESS)
    p.add_argument("--scaling", type=int, nargs="*")
    p.add_argument("--exact-max", type=int, default=4000, help="run the exact method up to this n")
    p.add_argument("--iterations", type=int, default=20, help="--scaling: T of the certified executions")
    p.add_argument("--neighbors", type=int, default=1, help="--scaling: k of the certified executions")
    p.add_argument("--executions", type=int, default=1,
                   help="--scaling: compare the methods' maxima with exact on this many executions per n")
    p.add_argument("--tightness", type=int, nargs="*")
    p.add_argument("--gammas", type=float, nargs="+", default=[0.05, 0.1, 0.2])
    p.add_argument("--epsilon", type=float, default=0.2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--tight-runs", nargs="+", default=["no"], choices=["no", "yes"],
                   help="--calibrate-large / --tightness: calibrate's tight_runs (each, side by side: --tight-runs no yes)")
    p.add_argument("--threads", type=int, default=None,
                   help="--large / --cascade-split / --calibrate-large: BoundSettings.threads (default: every CPU)")
    p.add_argument("--passes", type=int, nargs="+", default=[1], choices=[1, 2],
                   help="--tightness / --calibrate-large: calibrate's bound_passes (tightness: each, side by side)")
    p.add_argument("--large", type=int, nargs="*")
    p.add_argument("--methods", nargs="+", default=["bound"], choices=["bound", "cascade", "cascade-numpy"],
                   help="--large / --scaling: which bound methods (each in its own process)")
    p.add_argument("--structure", type=int, nargs="*", help="the Thm 4.5 / 4.9 pre-check alone")
    p.add_argument("--calibrate-large", type=int, nargs="*")
    p.add_argument("--cascade-split", type=int, nargs="*", help="the cascade's local tier vs its global part")
    p.add_argument("--ratios", type=float, nargs="+", default=[6.0, 10.0],
                   help="--cascade-split: sigma_delta / sigma_star (10: calibration's nominal pair)")
    p.add_argument("--screening", type=int, nargs="*", help="bounds after 0..8 CG iterations")
    p.add_argument("--strategy", type=int, nargs="*")
    p.add_argument("--draws", type=int, default=3)
    p.add_argument("--locality", type=int, nargs="*", help="near-field / far-field split vs exact (ratios)")
    p.add_argument("--radius", type=int, default=1)
    p.add_argument("--deflate", type=int, default=0, help="--locality: add this many eigenvectors of L^T L")
    p.add_argument("--charged", type=int, nargs="*", help="cheap local bound vs the charged maximum; tier costs")
    p.add_argument("--sample", type=int, default=300, help="--charged: random parties compared with the maximum")
    p.add_argument("--timed", type=int, default=5, help="--charged: random parties timed per tier")
    p.add_argument("--reference-max", nargs="*", default=[], metavar="N=MU",
                   help="--charged beyond the exact method: the maximum to compare with (a sound bound's)")
    p.add_argument("--local-tier", type=int, nargs="*", help="the cascade's local tier alone, per party")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64], help="--local-tier: batch sizes")
    p.add_argument("--baseline", type=int, nargs="*")
    p.add_argument("--extrapolate", type=int, nargs="*")
    p.add_argument("--full", action="store_true", help="calibrate(procedure='paper', runs=1000) at n = 200")
    args = p.parse_args()
    if args.job:
        spec = json.loads(args.job)
        print(json.dumps(_job(spec["kind"], spec["n"], spec["extra"])))
        return
    if args.scaling:
        scaling(args.scaling, args.exact_max, args.methods, args.executions, args.iterations, args.neighbors)
    if args.tightness:
        tightness(args.tightness, args.gammas, args.runs, args.epsilon, tuple(args.passes),
                  tuple(t == "yes" for t in args.tight_runs))
    if args.structure:
        structure(args.structure)
    if args.large:
        large(args.large, args.methods, args.threads)
    if args.screening:
        screening(args.screening)
    if args.local_tier:
        local_tier(args.local_tier, args.sample, args.batches)
    if args.cascade_split:
        cascade_split(args.cascade_split, args.ratios, args.threads)
    if args.calibrate_large:
        calibrate_large(args.calibrate_large, args.runs, args.passes[0], args.threads,
                        tuple(t == "yes" for t in args.tight_runs))
    if args.strategy:
        strategy(args.strategy, args.draws)
    if args.locality:
        locality(args.locality, args.radius, deflate=args.deflate)
    if args.charged:
        ref = {int(k): float(v) for k, v in (item.split("=") for item in args.reference_max)}
        charged(args.charged, args.sample, ref, args.timed)
    if args.baseline:
        baseline(args.baseline)
    if args.extrapolate:
        extrapolate(args.extrapolate)
    if args.full:
        full()
    if not any([args.scaling, args.tightness, args.large, args.calibrate_large, args.local_tier, args.strategy,
                args.baseline, args.structure, args.screening, args.full, args.extrapolate, args.locality,
                args.charged, args.cascade_split]):
        p.print_help()


if __name__ == "__main__":
    main()
