"""Time and memory of the audit by attack (``flwr_inca.privacy.attack``), per party count.

For each n: an execution like a training round (T = 10, k = 1, 5% permanent dropouts, sigma* = 0.02,
sigma_Delta = 3: a calibrated round's order of magnitude), a random 10% coalition, the exact certificate,
then ``attack_audit`` on the default targets (the weakest and a median party) with ``--runs`` fresh-noise
runs. Each n runs in a fresh subprocess, so its peak memory (max RSS) is its own. Printed per n: the
observed messages m, the attacker's covariance rank, the seconds of the certificate and of the attack
(split into the attacker's structure, from the engine's unit responses, and the runs), the peak memory,
and each target's ratio with its interval.

    python benchmarks/bench_attack.py                         # n = 100 and 1000, 40,000 runs
    python benchmarks/bench_attack.py --nodes 1000 --runs 40000
    python benchmarks/bench_attack.py --trace path/to/round-1.json --runs 40000   # a saved trace instead
    python benchmarks/bench_attack.py --baselines --nodes 100  # GOPA, CorDP-DME and local DP instead

``--baselines``: GOPA (k_PR = 10, 10% dropouts, 2.5% of them during the roll-back), CorDP-DME (10%
dropouts) and local DP, sigma* = 0.1 and sigma_Delta = 1 (local DP: sigma* = 2), 10% colluders,
value sensitivity 1, audited by ``attack_baseline`` against their exact certificates.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import time


def _one(n: int, runs: int, trace_path: str | None, queue) -> None:
    from flwr_inca import IncaConfig, PermanentDropout
    from flwr_inca.privacy import attack_audit, certify, random_collusion
    from flwr_inca.protocol import ExecutionTrace, sample_trace

    if trace_path:
        trace = ExecutionTrace.load(trace_path)
    else:
        config = IncaConfig(sigma_star=0.02, sigma_delta=3.0, iterations=10, dropout=PermanentDropout(0.05))
        trace = sample_trace(n, config, seed=1)
    view = random_collusion(trace, 0.1, seed=0)
    start = time.perf_counter()
    cert = certify(trace, view, delta=1e-5)
    certify_s = time.perf_counter() - start
    audit = attack_audit(trace, view, runs=runs, certificate=cert, seed=1)
    queue.put({
        "parties": trace.parties, "messages": audit.messages, "kept": audit.kept_messages,
        "certify_s": certify_s, "attack_s": audit.seconds, "structure_s": audit.structure_seconds,
        "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "targets": [{"party": t.party, "mu": t.mu, "ratio": t.ratio, "interval": t.ratio_interval,
                     "mu_interval": t.mu_interval, "epsilon": t.epsilon,
                     "epsilon_interval": t.epsilon_interval}
                    for t in audit.targets],
    })


def _baselines(n: int, runs: int) -> None:
    from flwr_inca.baselines import GOPA, CorDPDME, LocalDP, random_corrupted
    from flwr_inca.privacy import attack_baseline

    for baseline in (GOPA(sigma_star=0.1, sigma_delta=1.0, neighbors=10, gamma=0.1, gamma_rollback=0.025),
                     CorDPDME(sigma_star=0.1, sigma_delta=1.0, gamma=0.1), LocalDP(sigma_star=2.0)):
        execution = baseline.sample_execution(n, seed=1)
        audit = attack_baseline(baseline, execution, random_corrupted(n, 0.1, 0), runs=runs, seed=1)
        print(f"{audit.mechanism}, n = {n}, {audit.adversary}: {audit.messages} observed values per run, "
              f"{audit.seconds:.1f} s", flush=True)
        for t in audit.targets:
            print(f"  party {t.party}: mu {t.mu:.4g}, error std x mu / sensitivity {t.ratio:.4f} "
                  f"[{t.ratio_interval[0]:.4f}, {t.ratio_interval[1]:.4f}], attack mu in "
                  f"[{t.mu_interval[0]:.3g}, {t.mu_interval[1]:.3g}], {'BEATEN' if t.beaten else 'holds'}",
                  flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--runs", type=int, default=40_000)
    p.add_argument("--trace", default=None, help="audit this saved trace instead of sampled executions")
    p.add_argument("--baselines", action="store_true", help="audit GOPA, CorDP-DME and local DP instead")
    args = p.parse_args()
    if args.baselines:
        for n in args.nodes:
            _baselines(n, args.runs)
        return
    ctx = mp.get_context("spawn")
    for n in [0] if args.trace else args.nodes:
        queue = ctx.Queue()
        proc = ctx.Process(target=_one, args=(n, args.runs, args.trace, queue))
        proc.start()
        r = queue.get()
        proc.join()
        print(f"n = {r['parties']}: {r['messages']} observed messages per run ({r['kept']} independent); "
              f"certificate {r['certify_s']:.1f} s; attack {r['attack_s']:.1f} s for {args.runs} runs "
              f"(attacker's structure {r['structure_s']:.1f} s); "
              f"peak memory {r['max_rss_gb']:.2f} GB", flush=True)
        for t in r["targets"]:
            print(f"  party {t['party']}: mu {t['mu']:.4g}, error std x mu / sensitivity {t['ratio']:.4f} "
                  f"[{t['interval'][0]:.4f}, {t['interval'][1]:.4f}], attack mu in "
                  f"[{t['mu_interval'][0]:.3g}, {t['mu_interval'][1]:.3g}], certified epsilon "
                  f"{t['epsilon']:.3g}, attack epsilon in [{t['epsilon_interval'][0]:.3g}, "
                  f"{t['epsilon_interval'][1]:.3g}]", flush=True)
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
