"""``flwr-inca`` command line: ``mean`` (demo), ``calibrate``, ``audit``, ``simulate`` and ``reproduce``. Thin: parse, call,
print."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._checks import check_int, check_real
from ._json import dumps
from .protocol import (
    IncaConfig,
    MarkovDropout,
    NoDropout,
    PermanentDropout,
    TemporaryDropout,
    run_inca,
)
from .protocol.dropout import DropoutModel
from .study import add_study_parser


def parse_dropout(spec: str) -> DropoutModel:
    """``none``, ``permanent:<gamma>``, ``temporary:<p>``, ``markov:<rate>[,<correlation>]``."""
    kind, _, args = spec.partition(":")
    try:
        values = [float(v) for v in args.split(",")] if args else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad dropout spec {spec!r}") from None
    try:
        if kind == "none" and not values:
            return NoDropout()
        if kind == "permanent" and len(values) == 1:
            return PermanentDropout(values[0])
        if kind == "temporary" and len(values) == 1:
            return TemporaryDropout(values[0])
        if kind == "markov" and len(values) in (1, 2):
            return MarkovDropout(*values)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    raise argparse.ArgumentTypeError(
        f"dropout must be none, permanent:<gamma>, temporary:<p> or markov:<rate>[,<corr>], got {spec!r}"
    )


def _progress(label: str):
    """A progress callback printing to stderr at most ~20 times."""
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 20) == 0:
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (total - done)
            print(f"\r{label}: {done}/{total} ({elapsed:.1f}s, ~{eta:.0f}s left)", end="", file=sys.stderr)
            if done == total:
                print(file=sys.stderr)

    return report


def _positive_int(v: str) -> int:
    try:
        return check_int("value", int(v))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {v}") from None


def _seed(v: str) -> int:
    try:
        return check_int("value", int(v), 0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}") from None


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- mean
def cmd_mean(args: argparse.Namespace) -> int:
    from .privacy import calibrate, certify, epsilon_for_delta, mu_for_epsilon, random_collusion

    n, d, C = args.parties, args.dim, args.clip
    rng = np.random.default_rng(args.seed)
    # random vectors in the L2 ball of radius C (the setting of clipped model updates)
    try:
        x = rng.standard_normal((n, d))
    except MemoryError:
        print(f"error: --parties x --dim = {n} x {d} values do not fit in memory", file=sys.stderr)
        return 2
    x *= (C * rng.random(n) ** (1.0 / d) / np.linalg.norm(x, axis=1))[:, None]
    sensitivity = 2 * C  # replace-one on an L2 ball of radius C
    if args.sigma_star is not None and args.sigma_delta is not None:
        s_star, s_delta, source = args.sigma_star, args.sigma_delta, "given"
    elif args.sigma_star is not None or args.sigma_delta is not None:
        print("error: give both --sigma-star and --sigma-delta, or neither to calibrate", file=sys.stderr)
        return 2
    else:
        cal = calibrate(args.epsilon, args.delta, n, iterations=args.iterations, neighbors=args.neighbors,
                        collusion=args.collusion, dropout=args.dropout, runs=args.runs, seed=args.seed,
                        value_sensitivity=sensitivity, progress=_progress("calibrating"))
        s_star, s_delta, source = cal.sigma_star, cal.sigma_delta, f"calibrated over {args.runs} runs"
        for note in cal.notes:
            print(f"note: {note}", file=sys.stderr)
    config = IncaConfig(iterations=args.iterations, neighbors=args.neighbors, sigma_star=s_star,
                        sigma_delta=s_delta, dropout=args.dropout)
    result = run_inca(x, config, seed=args.seed, progress=_progress("mixing") if n * d > 1e7 else None)
    mse = float(np.mean((result.estimate - x.mean(axis=0)) ** 2))
    view = random_collusion(result.trace, args.collusion, seed=args.seed + 1)
    cert = certify(result.trace, view, value_sensitivity=sensitivity, delta=args.delta)
    mu = mu_for_epsilon(args.epsilon, args.delta)
    central = (sensitivity / (n * mu)) ** 2  # Gaussian mechanism on the mean, tight calibration
    out = {
        "parties": n, "dim": d, "clip": C, "epsilon_target": args.epsilon, "delta": args.delta,
        "sigma_star": s_star, "sigma_delta": s_delta, "sigmas": source,
        "finalists": int(result.finalists.size), "mse_inca": mse,
        "mse_central_dp": central, "mse_local_dp": central * n,
        "certified_epsilon": cert.epsilon, "threat": view.describe(),
    }
    if args.json:
        print(dumps(out, indent=1))
        return 0
    print(f"IncA mean of {n} parties, {d}-dim values clipped to L2 norm {C}, {args.iterations} iterations, "
          f"k = {args.neighbors}, dropout: {args.dropout!r}")
    print(f"noise ({source}): sigma_star = {s_star:.4g}, sigma_delta = {s_delta:.4g}; "
          f"{result.finalists.size}/{n} parties finished")
    print(_table([
        ["IncA (this run)", mse, f"{cert.epsilon:.4g} certified ({view.describe()})"],
        ["central DP (trusted curator)", central, f"{args.epsilon:g}"],
        ["local DP", central * n, f"{args.epsilon:g}"],
    ], ["mechanism", "MSE per coordinate", f"epsilon at delta={args.delta:g}"]))
    return 0


# ---------------------------------------------------------------------------------------- calibrate
def cmd_calibrate(args: argparse.Namespace) -> int:
    from .privacy import calibrate

    procedures = ["paper", "exact"] if args.procedure == "both" else [args.procedure]
    if procedures == ["paper"] and args.epsilon >= 1:
        print(f"error: --procedure paper needs --epsilon < 1 (the paper's classic Gaussian bound), got "
              f"{args.epsilon:g}; use --procedure exact", file=sys.stderr)
        return 2
    results = []
    for proc in procedures:
        if proc == "paper" and args.epsilon >= 1:
            print("note: the paper's procedure needs epsilon < 1 (classic bound); skipped", file=sys.stderr)
            continue
        results.append(calibrate(
            args.epsilon, args.delta, args.parties, iterations=args.iterations, neighbors=args.neighbors,
            collusion=args.collusion, observed_fraction=args.observed_fraction, dropout=args.dropout,
            runs=args.runs, seed=args.seed, procedure=proc, value_sensitivity=args.value_sensitivity,
            target_success=args.target_success, progress=None if args.json else _progress(f"{proc} runs"),
        ))
    central = (args.value_sensitivity / (args.parties * results[-1].mu_target)) ** 2 if results else math.nan
    if args.json:
        print(dumps({"calibrations": [r.to_dict() for r in results], "mse_central_dp": central}, indent=1))
        return 0
    print(f"target ({args.epsilon:g}, {args.delta:g})-DP, n = {args.parties}, T = {args.iterations}, "
          f"k = {args.neighbors}, {results[0].threat if results else ''}, dropout: {args.dropout!r}, "
          f"{args.runs} simulated runs")
    print(_table([[r.procedure, r.alpha, r.sigma_star, r.sigma_delta, r.success_fraction, r.predicted_mse,
                   f"{r.seconds:.1f}s"] for r in results],
                 ["procedure", "alpha", "sigma_star", "sigma_delta", "success", "predicted MSE", "time"]))
    print(f"reference: central DP MSE {central:.4g}, local DP MSE {central * args.parties:.4g} (values of "
          f"variance 1/12)")
    for r in results:
        for note in r.notes:
            print(f"note ({r.procedure}): {note}")
    return 0


# ---------------------------------------------------------------------------------------- audit
def cmd_audit(args: argparse.Namespace) -> int:
    from .protocol import ExecutionTrace
    from .privacy import (
        adversarial_collusion,
        analyze_structure,
        certify,
        collusion_view,
        random_collusion,
        random_eavesdrop,
    )

    try:
        trace = ExecutionTrace.load(args.trace)
    except OSError as exc:
        print(f"error: cannot read trace {args.trace}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (ValueError, MemoryError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else "too large for this machine's memory"
        print(f"error: cannot read trace {args.trace}: {why}", file=sys.stderr)
        return 2
    kw = dict(value_sensitivity=args.value_sensitivity, delta=args.delta)
    if args.adversarial is not None:
        res = adversarial_collusion(trace, args.adversarial, seed=args.seed, **kw)
        cert = res.certificate
    elif args.corrupted is not None:
        try:
            corrupted = [int(v) for v in args.corrupted.split(",") if v.strip()]
        except ValueError:
            print(f"error: --corrupted must be comma-separated party indices, e.g. 3,7,9, got "
                  f"{args.corrupted!r}", file=sys.stderr)
            return 2
        try:
            view = collusion_view(trace, corrupted)
        except ValueError as exc:
            print(f"error: --corrupted: {exc}", file=sys.stderr)
            return 2
        cert = certify(trace, view, **kw)
    elif args.observed_fraction is not None:
        cert = certify(trace, random_eavesdrop(trace, args.observed_fraction, args.seed), **kw)
    else:
        cert = certify(trace, random_collusion(trace, args.collusion, args.seed), **kw)
    if args.json:
        print(dumps({
            "method": cert.method,
            "mu": {str(i): m for i, m in sorted(cert.mu.items())},
            "max_mu": cert.max_mu,
            "epsilon": cert.epsilon,
            "delta": args.delta,
            "threat": cert.view.threat,
            "corrupted": [int(c) for c in cert.view.corrupted],
        }))
        return 0
    structure = analyze_structure(trace, cert.view)
    print(f"trace: {trace.parties} parties, {trace.iterations} iterations, schedule "
          f"{trace.schedule.name}, sigma_star = {trace.sigma_star:.4g}, sigma_delta = {trace.sigma_delta:.4g}")
    print(f"adversary: {cert.view.describe()}")
    print(structure.summary())
    print(f"weakest honest party: mu = {cert.max_mu:.4g} -> epsilon = {cert.epsilon:.4g} at delta = "
          f"{args.delta:g} (value sensitivity {args.value_sensitivity:g}; method: {cert.method})")
    rows = [[i, cert.mu[i], cert.party_epsilon(i), structure.exposure[i].explain(trace.iterations)]
            for i in cert.weakest[: args.top]]
    print(_table(rows, ["party", "mu", "epsilon", "why"]))
    return 0


# ---------------------------------------------------------------------------------------- simulate
def _availability(spec: str):
    """``none`` or ``markov:<p_off>,<p_on>`` (clients available per round)."""
    from .simulation import MarkovAvailability

    kind, _, args = spec.partition(":")
    if kind == "none" and not args:
        return None
    try:
        values = [float(v) for v in args.split(",")] if kind == "markov" else []
        if len(values) == 2:
            return MarkovAvailability(*values)
    except ValueError as exc:
        raise ValueError(f"--availability: {exc}") from None
    raise ValueError(f"--availability must be none or markov:<p_off>,<p_on>, got {spec!r}")


def _optional_epsilon(v: str) -> float | None:
    return None if v.lower() == "none" else float(v)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .simulation import SimulationConfig
    from .simulation.mnist import simulate_mnist

    out = args.out or time.strftime(f"simulation-{args.mode}-{args.clients}c-%Y%m%d-%H%M%S")
    config = SimulationConfig(
        rounds=args.rounds, mode=args.mode, fraction=args.fraction, min_clients=args.min_clients,
        availability=_availability(args.availability), privacy_unit=args.privacy_unit, lr=args.lr,
        clip_norm=args.clip_norm, batch_size=args.batch_size, local_steps=args.local_steps,
        local_epochs=args.local_epochs, epsilon=args.epsilon, delta=args.delta, accountant=args.accountant,
        iterations=args.iterations, neighbors=args.neighbors, topology=args.topology, dropout=args.dropout,
        collusion=args.collusion, observed_fraction=args.observed_fraction, threat_draws=args.threat_draws,
        sigma_star=args.sigma_star, sigma_delta=args.sigma_delta, calibration_runs=args.calibration_runs,
        certification=args.certification, certify_every=args.certify_every,
        noise_multiplier=args.noise_multiplier, backend=args.backend, num_actors=args.num_actors,
        ray_address=args.ray_address, precision=args.precision, seed=args.seed, eval_every=args.eval_every,
        output_dir=out, save_traces=args.save_traces)
    history = simulate_mnist(config, clients=args.clients, partition=args.partition, model=args.model,
                             data_dir=args.data_dir, progress=not args.json)
    rounds = history.rounds
    trained = [r for r in rounds if not r.failed]
    summary = {
        "dataset": history.dataset, "rounds": len(rounds), "accuracy": history.accuracy,
        "epsilon": history.epsilon, "delta": args.delta,
        "certified_rounds": sum(r.certified for r in rounds),
        "seconds_per_round": (sum(r.seconds for r in trained) / len(trained)) if trained else None,
        "stopped": history.stopped, "output_dir": out,
    }
    if args.json:
        print(dumps(summary, indent=1))
        return 0
    eps = "not private" if not math.isfinite(history.epsilon) else f"{history.epsilon:.4g} at delta = {args.delta:g}"
    acc = "n/a" if history.accuracy is None else f"{history.accuracy:.4f}"
    print(f"{history.dataset}: {len(rounds)} round(s) of {args.mode} with {args.clients} clients; "
          f"accuracy {acc}, epsilon {eps}")
    uncertified = len(rounds) - summary["certified_rounds"]
    if uncertified and args.mode == "inca":
        print(f"note: {uncertified} round(s) were charged a prediction or bound, not an exact certificate "
              "(see 'cost' in history.csv)")
    if history.stopped:
        print(history.stopped)
    print(f"results in {out}/ (history.json, history.csv, ledger.json, accuracy_epsilon.png"
          f"{', traces/' if args.save_traces else ''})")
    return 0


# ---------------------------------------------------------------------------------------- reproduce
def _non_negative_int(v: str) -> int:
    i = int(v)
    if i < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return i


def cmd_reproduce(args: argparse.Namespace) -> int:
    from .reproduce import reproduce

    try:
        reproduce([args.figure], runs=args.runs, out=args.out, seed=args.seed, progress=not args.no_progress)
    except OSError as exc:  # e.g. the disk filled up while writing a figure
        print(f"error: --out {args.out}: cannot write the results: {exc}", file=sys.stderr)
        return 2
    return 0


def add_reproduce_parser(sub: argparse._SubParsersAction) -> None:
    from .reproduce import DEFAULT_RUNS

    r = sub.add_parser("reproduce", help="re-measure the paper's figures: CSV, PNG and a table per figure")
    r.add_argument("figure", choices=[*DEFAULT_RUNS, "all"], help="which figure (all: every one, in order)")
    r.add_argument("--runs", type=_positive_int, default=None,
                   help="simulated runs per point (default per figure: "
                        + ", ".join(f"{k} {v}" for k, v in DEFAULT_RUNS.items())
                        + "; the paper: 1000, Fig. 2 1e5, Fig. 5 100)")
    r.add_argument("--out", default="outputs/reproduce", help="directory for the CSV, PNG and text files")
    r.add_argument("--seed", type=_non_negative_int, default=0)
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.set_defaults(func=cmd_reproduce)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flwr-inca", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def protocol_args(sp: argparse.ArgumentParser, parties: int) -> None:
        sp.add_argument("--parties", "-n", type=_positive_int, default=parties, help="number of parties n")
        sp.add_argument("--iterations", "-T", type=_positive_int, default=20, help="mixing iterations T")
        sp.add_argument("--neighbors", "-k", type=_positive_int, default=1, help="out-neighbours per iteration")
        sp.add_argument("--epsilon", type=float, default=1.0)
        sp.add_argument("--delta", type=float, default=1e-5)
        sp.add_argument("--collusion", type=float, default=0.1, help="fraction rho of corrupted parties")
        sp.add_argument("--dropout", type=parse_dropout, default=PermanentDropout(0.1),
                        help="none | permanent:<gamma> | temporary:<p> | markov:<rate>[,<corr>] "
                             "(default permanent:0.1)")
        sp.add_argument("--runs", type=_positive_int, default=20, help="simulated runs for calibration")
        sp.add_argument("--seed", type=_seed, default=0)
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    m = sub.add_parser("mean", help="privately average random vectors among simulated parties (demo)")
    protocol_args(m, 100)
    m.add_argument("--dim", "-d", type=_positive_int, default=10, help="dimension of each value")
    m.add_argument("--clip", type=float, default=1.0, help="L2 norm bound C of the values")
    m.add_argument("--sigma-star", type=float, default=None, help="skip calibration: sigma_star")
    m.add_argument("--sigma-delta", type=float, default=None, help="skip calibration: sigma_delta")
    m.set_defaults(func=cmd_mean)

    c = sub.add_parser("calibrate", help="noise levels for a target (epsilon, delta)")
    protocol_args(c, 200)
    c.add_argument("--observed-fraction", type=float, default=None,
                   help="Eavesdrop DP: fraction of messages intercepted (instead of --collusion)")
    c.add_argument("--procedure", choices=["exact", "paper", "both"], default="both")
    c.add_argument("--value-sensitivity", type=float, default=1.0,
                   help="size of a change of one value (1 for [0,1]; 2C for an L2 ball of radius C)")
    c.add_argument("--target-success", type=float, default=1.0,
                   help="share of simulated runs that must meet the target (exact procedure)")
    c.set_defaults(func=cmd_calibrate)

    a = sub.add_parser("audit", help="certify a recorded execution trace")
    a.add_argument("trace", help="inca-trace/1 JSON file")
    g = a.add_mutually_exclusive_group()
    g.add_argument("--corrupted", help="comma-separated corrupted parties, e.g. 3,7,9")
    g.add_argument("--collusion", type=float, default=0.1, help="random corrupted fraction (default 0.1)")
    g.add_argument("--observed-fraction", type=float, help="Eavesdrop DP: fraction of intercepted messages")
    g.add_argument("--adversarial", type=float, metavar="FRACTION",
                   help="search for the corrupted set (of this fraction) that hurts the weakest party")
    a.add_argument("--seed", type=_seed, default=0)
    a.add_argument("--delta", type=float, default=1e-5)
    a.add_argument("--value-sensitivity", type=float, default=1.0)
    a.add_argument("--top", type=_positive_int, default=5, help="weakest parties to list (>= 1)")
    a.add_argument("--json", action="store_true")
    a.set_defaults(func=cmd_audit)

    s = sub.add_parser("simulate", help="simulate decentralized training on MNIST (Ray, thousands of clients)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--clients", "-n", type=_positive_int, default=100, help="number of clients")
    s.add_argument("--rounds", "-R", type=_positive_int, default=40)
    s.add_argument("--mode", default="inca", help="inca | fedavg (trusted, no noise) | central-dp (trusted, noised)")
    s.add_argument("--model", choices=["logreg", "mlp"], default="logreg")
    s.add_argument("--partition", default="iid", help="iid | dirichlet:<alpha>")
    s.add_argument("--data-dir", default="", help="MNIST IDX directory (else $FLWR_INCA_MNIST_DIR, Hugging Face, "
                                                   "or scikit-learn's digits offline)")
    s.add_argument("--fraction", type=float, default=1.0, help="share of available clients per round")
    s.add_argument("--min-clients", type=int, default=2)
    s.add_argument("--availability", default="none", help="none | markov:<p_off>,<p_on> (across rounds)")
    s.add_argument("--dropout", type=parse_dropout, default=None,
                   help="within a round's mixing: none | permanent:<gamma> | temporary:<p> | markov:<rate>[,<corr>]")
    s.add_argument("--privacy-unit", choices=["record", "party"], default="record")
    s.add_argument("--lr", type=float, default=None, help="default 6.0 (record) or 0.05 (party)")
    s.add_argument("--clip-norm", type=float, default=1.0)
    s.add_argument("--batch-size", type=int, default=50)
    s.add_argument("--local-steps", type=int, default=None, help="party level: local SGD steps")
    s.add_argument("--local-epochs", type=int, default=None, help="party level: local epochs (default 1)")
    s.add_argument("--epsilon", type=_optional_epsilon, default=1.0, help="total budget, or 'none'")
    s.add_argument("--delta", type=float, default=1e-5)
    s.add_argument("--accountant", choices=["exact", "opacus-prv", "opacus-rdp", "prv", "rdp", "gdp"],
                   default=None,
                   help="default: opacus-prv (record level), exact (party level); prv, rdp, gdp: old names")
    s.add_argument("--iterations", "-T", type=_positive_int, default=10)
    s.add_argument("--neighbors", "-k", type=_positive_int, default=1)
    s.add_argument("--topology", default="random")
    s.add_argument("--collusion", type=float, default=0.1, help="fraction of colluding clients certified against")
    s.add_argument("--observed-fraction", type=float, default=None, help="Eavesdrop DP instead of collusion")
    s.add_argument("--threat-draws", type=_positive_int, default=1)
    s.add_argument("--sigma-star", type=float, default=None)
    s.add_argument("--sigma-delta", type=float, default=None)
    s.add_argument("--calibration-runs", type=_positive_int, default=10)
    s.add_argument("--certification", choices=["exact", "local-bound"], default="exact")
    s.add_argument("--certify-every", type=_positive_int, default=1,
                   help="exact certificate every r rounds (a prediction, marked, in between)")
    s.add_argument("--noise-multiplier", type=float, default=None, help="central-dp without a budget")
    s.add_argument("--backend", choices=["ray", "inline"], default="ray")
    s.add_argument("--num-actors", type=int, default=None)
    s.add_argument("--ray-address", default=None, help="'auto' or host:port of a Ray cluster (default: local)")
    s.add_argument("--precision", choices=["float32", "float64"], default="float32")
    s.add_argument("--eval-every", type=_positive_int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=None, help="output directory (default: a new simulation-... directory)")
    s.add_argument("--save-traces", action="store_true", help="also write each round's execution trace")
    s.add_argument("--json", action="store_true", help="print a JSON summary instead of progress")
    s.set_defaults(func=cmd_simulate)
    add_reproduce_parser(sub)
    add_study_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "epsilon", None) is not None:
            check_real("--epsilon", args.epsilon, 0.0, low_open=True)
        if getattr(args, "delta", None) is not None:
            check_real("--delta", args.delta, 0.0, 1.0, low_open=True, high_open=True)
        return int(args.func(args))
    except (ValueError, ConnectionError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
