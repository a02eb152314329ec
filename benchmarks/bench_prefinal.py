"""The pre-final rule's certification cost per round, against one mixing iteration's time.

Per node count, side by side in one process:

* **one mixing iteration**: a relayed round (IncaStrategy's relay, the real party code, wire encoding
  and decoding, in-memory node storage; d = 7850 float32 parameters, T = 10, k = 1) run in process,
  every node's call one after the other. An iteration is one exchange: the relay's requests, every
  node's call (decode, ``handle_exchange``, encode) and the relay's ingest. Median over iterations
  2..T. Serial in-process execution is the cheapest an iteration gets on this machine (a Flower
  exchange adds the engine's ~5 ms per call), so the comparison is strict.
* what IncaStrategy certifies with ``threat_draws=3``, each the worst of 3 random coalitions of 10%
  (its own ``_certify``), on a round of the same n with 5% permanent dropouts (sigma* = 1,
  sigma_Delta = 20, sensitivity 2):

  - ``pre-final``: every final counted as observed, each adversary factorized once
    (``RoundPrefix``). Before this rule it ran after the finals; it now runs before them: the same
    work, moved, **not extra**;
  - ``one final lost``: the extra certificate a round needs when some final does not arrive, from the
    pre-final factorization (a solve the size of the finals); ``lost (separate)``: the same certificate
    computed anew, as before the prefix factorization (for comparison);
  - ``stopped``: the extra certificate of a round stopped before its finals (at most once per training);
  - ``guard check``: a guarded round (the no-finals ceiling did not fit) certifies, before delivering
    iteration t's messages, the view of iterations 1..t on the trace known so far: the mean over
    t = 1..T and the largest (t = T) are reported, each check made anew (worst case: every iteration
    checked; in a run, iterations whose ceiling still fits are not);
  - ``no_finals_bound`` and ``prefix_ceilings``: once per training and number of parties (cached).

Ratios to the mixing iteration are per round. Repeats interleave the parts; the median is reported.

    python benchmarks/bench_prefinal.py                       # n = 100 and 1000, 3 repeats
    python benchmarks/bench_prefinal.py --nodes 100 --repeats 1
    python benchmarks/bench_prefinal.py --guard-check ... # also the guarded iteration checks (slow)
    python benchmarks/bench_prefinal.py --ceiling             # the no-finals ceiling vs a round's cost

``--ceiling`` (no timing): with the noise calibrated for (1, 1e-5)-DP per round against 10% colluders
(n = 100, T = 10, k = 1, sensitivity 2, 10 calibration runs), the strategy's predicted round cost (worst
of 10 simulated executions with their finals), the ceiling of a round stopped before its finals
(``no_finals_bound``) and the certified cost of such rounds without their finals (10 executions).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.flower import IncaStrategy
from flwr_inca.flower.node import RoundSecrets, handle_exchange
from flwr_inca.flower.shared import RoundParams
from flwr_inca.flower.storage import MemoryStore
from flwr_inca.flower.relay import RoundRelay, collect_finals, run_iterations
from flwr_inca.flower.wire import decode_reply, decode_request, encode_reply, encode_request
from flwr_inca.privacy.prefix import padded_trace, prefix_ceilings
from flwr_inca.privacy.rounds import certification_seeds, certify_round
from flwr_inca.protocol import sample_trace
from flwr_inca.protocol.schedules import InjectionSchedule

D, T, K = 7850, 10, 1
S_STAR, S_DELTA = 1.0, 20.0


def mixing_iteration(n: int, seed: int) -> float:
    """Median seconds of one mixing iteration (exchanges 2..T) of an in-process relayed round."""
    schedule = InjectionSchedule.incremental(T)
    roster = [1000 + i for i in range(n)]
    secrets = [RoundSecrets.generate(seed, fixed_seed=seed, node=node) for node in roster]
    stores = [MemoryStore() for _ in range(n)]
    values = np.random.default_rng(seed).normal(size=(n, D))
    for i in range(n):
        stores[i].save_value(seed, values[i])
    keys = [s.public_key for s in secrets]
    params = RoundParams(seed, T, K, S_STAR, S_DELTA, schedule, roster, keys, "float32")
    relay = RoundRelay(n, T, D, schedule, S_STAR, S_DELTA, "float32")
    times: list[float] = []

    def exchange(commit, requests):
        wire = [encode_request(req, params, with_roster=commit == 1) for req in requests]
        answers = {}
        for req, data in zip(requests, wire):
            request, p = decode_request(data, (params.roster, params.public_keys))
            answers[req.party] = encode_reply(handle_exchange(request, p, req.party, secrets[req.party],
                                                              stores[req.party]), has_roster=True)
        return {i: decode_reply(data, i)[0] for i, data in answers.items()}

    started = [time.perf_counter()]

    def progress(done, total):  # called after each exchange's ingest: one iteration ends here
        now = time.perf_counter()
        if done >= 2:
            times.append(now - started[0])
        started[0] = now

    run_iterations(relay, exchange, progress)
    collect_finals(relay, exchange)
    if len(relay.finals) != n:
        raise RuntimeError(f"{len(relay.finals)} of {n} finals")
    return statistics.median(times)


def certification(n: int, seed: int, guard: bool) -> dict[str, float]:
    """Seconds of each certificate the rule computes, on one round of n parties."""
    strategy = IncaStrategy(sigma_star=S_STAR, sigma_delta=S_DELTA, iterations=T, ledger_path=None, seed=seed,
                            threat_draws=3)
    config = IncaConfig(iterations=T, neighbors=K, sigma_star=S_STAR, sigma_delta=S_DELTA,
                        dropout=PermanentDropout(0.05))
    trace = sample_trace(n, config, seed=seed)
    seeds = certification_seeds(strategy.inca.seed, 1)  # round 1's adversaries, as IncaRounds.prefix draws them
    online = trace.steps[-1].online.tolist()
    lost = [i for i in online if i != online[len(online) // 2]]  # one final (of an honest party, likely) lost
    out, mu = {}, {}
    start = time.perf_counter()
    prefix = strategy.inca.prefix(trace, 1)  # what the round keeps for its charges
    mu["pre-final"] = prefix.with_finals(None).mu
    out["pre-final"] = time.perf_counter() - start
    for name, finals in (("one final lost", lost), ("stopped", [])):
        start = time.perf_counter()
        mu[name] = prefix.with_finals(finals).mu
        out[name] = time.perf_counter() - start
    priv = strategy.privacy
    start = time.perf_counter()
    mu["lost (separate)"] = certify_round(trace, seeds, priv.threat_draws, collusion=priv.collusion,
                                          finals=lost, value_sensitivity=priv.sensitivity).mu
    out["lost (separate)"] = time.perf_counter() - start
    if not mu["lost (separate)"] <= mu["one final lost"] <= mu["lost (separate)"] * (1 + 2e-9):
        raise RuntimeError(f"the kept factorization and a separate certificate disagree: {mu}")
    if guard:
        checks = []
        for t in range(1, T + 1):  # as IncaStrategy._guard: the trace known so far, padded
            start = time.perf_counter()
            known = padded_trace(n, trace.steps[:t], T, trace.schedule, trace.sigma_star, trace.sigma_delta)
            cert = strategy.inca.prefix(known, 1).through(t)
            checks.append(time.perf_counter() - start)
            if abs(cert.mu - prefix.through(t).mu) > 1e-9 * max(cert.mu, 1e-300):
                raise RuntimeError(f"guard check at t = {t} disagrees with the round's prefix")
        out["guard check (mean)"], out["guard check (t = T)"] = statistics.mean(checks), checks[-1]
        mu["guard check (mean)"] = mu["guard check (t = T)"] = prefix.through(T).mu
    start = time.perf_counter()
    mu["no_finals_bound"] = float(strategy.inca.ceilings(n)[-1])
    out["no_finals_bound"] = time.perf_counter() - start
    start = time.perf_counter()
    mu["prefix_ceilings"] = float(prefix_ceilings(trace.schedule, S_STAR, S_DELTA, priv.sensitivity)[-1])
    out["prefix_ceilings"] = time.perf_counter() - start
    if not mu["stopped"] <= mu["one final lost"] <= mu["pre-final"] * (1 + 1e-9):
        raise RuntimeError(f"certificates not ordered: {mu}")
    if not mu["stopped"] <= mu["no_finals_bound"] * (1 + 1e-9):
        raise RuntimeError(f"no-finals certificate above its bound: {mu}")
    out.update({f"mu {k}": v for k, v in mu.items()})
    return out


def ceiling() -> None:
    from flwr_inca.privacy import certify, random_collusion

    n = 100
    strategy = IncaStrategy(round_epsilon=1.0, delta=1e-5, iterations=T, neighbors=K, collusion=0.1,
                            ledger_path=None, seed=0, calibration_runs=10, budget_check_runs=10)
    s_star, s_delta = strategy.inca.sigmas(n)
    config = IncaConfig(iterations=T, neighbors=K, sigma_star=s_star, sigma_delta=s_delta)
    without = [certify(trace, random_collusion(trace, 0.1, seed, finals=()), value_sensitivity=2.0).max_mu
               for seed, trace in ((s, sample_trace(n, config, seed=100 + s)) for s in range(10))]
    print(f"n = {n}, (1, 1e-5)-DP per round, 10% colluders, T = {T}: sigma* = {s_star:.4g}, "
          f"sigma_Delta = {s_delta:.4g}")
    print(f"predicted round cost with its finals (mu): {strategy.inca.predicted_mu(n):.4g}")
    print(f"no_finals_bound (mu): {float(strategy.inca.ceilings(n)[-1]):.4g}")
    print(f"rounds without their finals (mu): median {statistics.median(without):.4g}, "
          f"max {max(without):.4g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ceiling", action="store_true",
                   help="the no-finals ceiling vs a round's cost (no timing)")
    p.add_argument("--guard-check", action="store_true",
                   help="also time the guarded iteration checks (each of t = 1..T certified anew)")
    args = p.parse_args()
    if args.ceiling:
        ceiling()
        return
    if min(args.nodes) < 2 or args.repeats < 1:
        p.error("--nodes must be >= 2 and --repeats >= 1")
    parts = ("pre-final", "one final lost", "lost (separate)", "stopped", "no_finals_bound", "prefix_ceilings")
    if args.guard_check:
        parts += ("guard check (mean)", "guard check (t = T)")
    print(f"d = {D}, T = {T}, k = {K}, sigma* = {S_STAR}, sigma_Delta = {S_DELTA}, 3 threat draws of 10% "
          f"colluders, 5% permanent dropouts; medians over {args.repeats} repeats\n")
    for n in args.nodes:
        iters, certs = [], []
        for r in range(args.repeats):
            iters.append(mixing_iteration(n, seed=1 + r))
            certs.append(certification(n, seed=1 + r, guard=args.guard_check))
        it = statistics.median(iters)
        print(f"n = {n}: one mixing iteration {it:.4f} s")
        for part in parts:
            c = statistics.median(x[part] for x in certs)
            print(f"  {part:<22} {c:>9.4f} s  {c / it:>8.3f} x iteration")
        mus = {k: statistics.median(x[f"mu {k}"] for x in certs) for k in parts}
        print(f"{'':>5} mu: " + ", ".join(f"{k} {v:.4g}" for k, v in mus.items()))


if __name__ == "__main__":
    main()
