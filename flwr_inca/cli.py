"""The ``flwr-inca`` command: ``mean`` (demo), ``calibrate``, ``audit``, ``simulate``, ``reproduce``, ``study``.

Each subcommand parses its arguments, calls the library and prints the result (a table, or JSON with
``--json``); the work is done in ``flwr_inca.privacy``, ``flwr_inca.simulation`` and ``flwr_inca.reproduce``.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from ._checks import check_int, check_real
from ._json import dumps
from ._progress import ProgressBar, format_duration
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


def _progress(label: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback drawing the package's progress bar (elapsed time, ETA), timed from
    its creation (the first report comes after the first step's work, which the elapsed time must include)."""
    bar: ProgressBar | None = None
    start = time.perf_counter()

    def report(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = ProgressBar(total, label)
            bar.start = start
        bar.advance(done - bar.done)
        if done >= total:
            bar.close()

    return report


def _status(label: str, every: float = 10.0) -> Callable[[str], None]:
    """A ``progress(line)`` callback printing a long computation's phases on stderr with the elapsed time;
    counting lines (``... 1000 / 90000 ...``) at most once every ``every`` seconds."""
    start, last = time.perf_counter(), -math.inf

    def report(line: str) -> None:
        nonlocal last
        now = time.perf_counter() - start
        if " / " in line and now - last < every:
            return
        last = now
        print(f"{label} [{format_duration(now)}] {line}", file=sys.stderr, flush=True)

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
    """An aligned text table: numbers right-aligned (4 significant digits), text left-aligned."""
    numeric = [all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(header))]
    cells = [header] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join((c.rjust(w) if num else c.ljust(w)) for c, w, num in zip(r, widths, numeric)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- mean
def cmd_mean(args: argparse.Namespace) -> int:
    from .privacy import calibrate, certify, mu_for_epsilon, random_collusion

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
        ["IncA (this run)", "none", mse, cert.epsilon],
        ["central DP", "a curator sees every value", central, args.epsilon],
        ["local DP", "none", central * n, args.epsilon],
    ], ["mechanism", "trusted party", "MSE per coordinate", f"epsilon (delta = {args.delta:g})"]))
    print(f"IncA's epsilon is certified for this execution against {view.describe()}; the references "
          f"are calibrated for the target epsilon = {args.epsilon:g}.")
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
    from .privacy import (
        adversarial_collusion,
        analyze_structure,
        certify,
        collusion_view,
        random_collusion,
        random_eavesdrop,
        recorded_finals,
        with_finals,
    )
    from .protocol import ExecutionTrace

    try:
        trace = ExecutionTrace.load(args.trace)
    except OSError as exc:
        print(f"error: cannot read trace {args.trace}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except (ValueError, MemoryError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else "too large for this machine's memory"
        print(f"error: cannot read trace {args.trace}: {why}", file=sys.stderr)
        return 2
    try:  # certify what was observed: the finals the relay recorded as arrived (all, if it did not say)
        finals = recorded_finals(trace)
    except ValueError as exc:
        print(f"error: cannot read trace {args.trace}: {exc}", file=sys.stderr)
        return 2
    kw = {"value_sensitivity": args.value_sensitivity, "delta": args.delta}
    progress = None if args.json else _status("audit")  # a bound at n = 100,000 takes minutes
    if args.adversarial is not None:
        res = adversarial_collusion(trace, args.adversarial, seed=args.seed, finals=finals, **kw)
        cert = res.certificate
    elif args.corrupted is not None:
        try:
            corrupted = [int(v) for v in args.corrupted.split(",") if v.strip()]
        except ValueError:
            print(f"error: --corrupted must be comma-separated party indices, e.g. 3,7,9, got "
                  f"{args.corrupted!r}", file=sys.stderr)
            return 2
        try:
            view = with_finals(collusion_view(trace, corrupted), trace, finals)
        except ValueError as exc:
            print(f"error: --corrupted: {exc}", file=sys.stderr)
            return 2
        cert = certify(trace, view, progress=progress, **kw)
    elif args.observed_fraction is not None:
        cert = certify(trace, random_eavesdrop(trace, args.observed_fraction, args.seed, finals=finals),
                       progress=progress, **kw)
    else:
        cert = certify(trace, random_collusion(trace, args.collusion, args.seed, finals=finals),
                       progress=progress, **kw)
    online = trace.steps[-1].online.tolist()
    counted = online if finals is None else finals.tolist()
    if args.json:
        print(dumps({
            "method": cert.method,
            "mu": {str(i): m for i, m in sorted(cert.mu.items())},
            "max_mu": cert.max_mu,
            "epsilon": cert.epsilon,
            "delta": args.delta,
            "threat": cert.view.threat,
            "corrupted": [int(c) for c in cert.view.corrupted],
            "finals": [int(i) for i in counted],
            "finals_recorded": finals is not None,
        }))
        return 0
    structure = analyze_structure(trace, cert.view)
    print(f"trace: {trace.parties} parties, {trace.iterations} iterations, schedule "
          f"{trace.schedule.name}, sigma_star = {trace.sigma_star:.4g}, sigma_delta = {trace.sigma_delta:.4g}")
    print(f"adversary: {cert.view.describe()}")
    print(f"final messages counted: {_finals_line(counted, online, finals is not None, trace.meta)}")
    print(structure.summary())
    print(f"weakest honest party: mu = {cert.max_mu:.4g} -> epsilon = {cert.epsilon:.4g} at delta = "
          f"{args.delta:g} (value sensitivity {args.value_sensitivity:g}; method: {cert.method})")
    rows = [[i, cert.mu[i], cert.party_epsilon(i), structure.exposure[i].explain(trace.iterations)]
            for i in cert.weakest[: args.top]]
    print(_table(rows, ["party", "mu", "epsilon", "why"]))
    return 0


def _finals_line(counted: list[int], online: list[int], recorded: bool, meta: dict) -> str:
    """Which final messages the audit counted as observed, and where that came from."""
    if not recorded:
        return (f"all {len(online)} of the parties online at the last iteration (the trace does not record "
                "which finals arrived)")
    if not counted:
        why = "the round was stopped before them" if meta.get("finals-collected") is False else "none arrived"
        return f"none of {len(online)} ({why}, as recorded in the trace)"
    shown = ", ".join(map(str, counted[:20])) + (", ..." if len(counted) > 20 else "")
    return f"{len(counted)} of {len(online)} recorded as arrived: parties {shown}"


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
        "dataset": history.dataset, "rounds": len(rounds), "rounds_trained": history.rounds_trained,
        "rounds_refused": history.rounds_refused, "accuracy": history.accuracy,
        "epsilon": history.epsilon, "delta": args.delta,
        "certified_rounds": sum(r.certified for r in rounds),
        "seconds_per_round": (sum(r.seconds for r in trained) / len(trained)) if trained else None,
        "stopped": history.stopped, "output_dir": out,
        "notes": list(history.notes),  # e.g. actors replaced, a resumed ledger, chance-level accuracy
    }
    # a script must be able to tell a completed training from one the budget stopped (the MNIST example's rule)
    status = 1 if history.stopped else 0
    if args.json:
        print(dumps(summary, indent=1))
        return status
    eps = "not private" if not math.isfinite(history.epsilon) else f"{history.epsilon:.4g} at delta = {args.delta:g}"
    acc = "n/a" if history.accuracy is None else f"{history.accuracy:.4f}"
    skipped = (f" ({history.rounds_trained} trained, {history.rounds_refused} skipped: refused by the budget)"
               if history.rounds_refused else "")
    print(f"{history.dataset}: {len(rounds)} round(s) of {args.mode} with {args.clients} clients{skipped}; "
          f"accuracy {acc}, epsilon {eps}")
    uncertified = len(rounds) - summary["certified_rounds"]
    if uncertified and args.mode == "inca":
        print(f"note: {uncertified} round(s) were charged a prediction or bound, not an exact certificate "
              "(see 'cost' in history.csv)")
    for note in history.notes:  # e.g. actors replaced, a resumed ledger, chance-level accuracy
        print(f"note: {note}")
    if history.stopped:
        print(history.stopped)
    written = [name for name in ("history.json", "history.csv", "ledger.json", "accuracy_epsilon.png", "traces")
               if (Path(out) / name).exists()]  # e.g. no ledger when nothing was charged
    print(f"results in {out}/ ({', '.join(n + '/' if n == 'traces' else n for n in written) or 'nothing written'})")
    return status


# ---------------------------------------------------------------------------------------- reproduce
def _non_negative_int(v: str) -> int:
    i = int(v)
    if i < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return i


def cmd_reproduce(args: argparse.Namespace) -> int:
    from .reproduce import reproduce

    try:
        settings = {"parties": args.parties, "epsilons": args.epsilons, "gammas": args.gammas,
                    "iterations": args.iterations, "neighbors": args.neighbors}
        reproduce([args.figure], runs=args.runs, out=args.out, seed=args.seed, progress=not args.no_progress,
                  settings=settings)
    except OSError as exc:  # e.g. the disk filled up while writing a figure
        print(f"error: --out {args.out}: cannot write the results: {exc}", file=sys.stderr)
        return 2
    return 0


def add_reproduce_parser(sub: argparse._SubParsersAction) -> None:
    from .reproduce import DEFAULT_RUNS

    r = sub.add_parser(
        "reproduce", help="re-measure the paper's figures: CSV, PNG and a table per figure",
        description="Re-measure a figure of the paper (or all): <out>/<figure>.csv (every number "
                    "plotted), .png and .txt (the paper's statements next to what was measured).",
        epilog="example:\n  flwr-inca reproduce fig3b --runs 20 --out outputs/reproduce",
        formatter_class=_HelpFormatter)
    r.add_argument("figure", choices=[*DEFAULT_RUNS, "all"],
                   help="which figure (all: the paper's figures, in order; frontier: IncA's "
                        "communication-accuracy frontier under dropouts, hours at its full grid)")
    r.add_argument("--runs", type=_positive_int, default=None,
                   help="simulated runs per point (per figure if not given: "
                        + ", ".join(f"{k} {v}" for k, v in DEFAULT_RUNS.items())
                        + "; the paper: 1000, Fig. 2 1e5, Fig. 5 100)")
    r.add_argument("--out", default="outputs/reproduce", help="directory for the CSV, PNG and text files")
    r.add_argument("--seed", type=_non_negative_int, default=0, help="seed of every simulated run")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    frontier = r.add_argument_group("frontier only (default: its whole grid)")
    frontier.add_argument("--parties", type=int, nargs="+", default=None, metavar="N", help="n values")
    frontier.add_argument("--epsilons", type=float, nargs="+", default=None, metavar="EPS",
                          help="epsilon values")
    frontier.add_argument("--gammas", type=float, nargs="+", default=None, metavar="GAMMA",
                          help="dropout fractions")
    frontier.add_argument("--iterations", type=int, nargs="+", default=None, metavar="T",
                          help="IncA's T values")
    frontier.add_argument("--neighbors", type=int, nargs="+", default=None, metavar="K",
                          help="IncA's k values")
    r.set_defaults(func=cmd_reproduce)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help (except flags and "not given", which the help explains);
    paragraphs of the description re-wrapped, the example lines of the epilog kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.lstrip().startswith("example"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return "\n\n".join(textwrap.fill(par, width, initial_indent=indent, subsequent_indent=indent)
                           for par in text.split("\n\n"))


def _version() -> str:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    try:
        flwr = f", Flower {version('flwr')}"
    except PackageNotFoundError:  # Flower is an extra
        flwr = ""
    return f"flwr-inca {__version__} (Python {platform.python_version()}{flwr})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flwr-inca", formatter_class=_HelpFormatter,
        description="IncA: differentially private, dropout-robust averaging without a trusted aggregator."
                    "\n\nRun 'flwr-inca <command> --help' for a command's options and an example.",
        epilog="examples:\n"
               "  flwr-inca mean                                   # the demo: 100 parties, epsilon = 1\n"
               "  flwr-inca calibrate -n 200 --epsilon 0.5 --runs 100\n"
               "  flwr-inca audit trace.json --collusion 0.1\n"
               "  flwr-inca simulate --clients 100 --rounds 10\n"
               "  flwr-inca reproduce fig3b --runs 20")
    p.add_argument("--version", action="version", version=_version(), help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="<command>", title="commands")

    def protocol_args(sp: argparse.ArgumentParser, parties: int) -> None:
        sp.add_argument("--parties", "-n", type=_positive_int, default=parties, help="number of parties n")
        sp.add_argument("--iterations", "-T", type=_positive_int, default=20, help="mixing iterations T")
        sp.add_argument("--neighbors", "-k", type=_positive_int, default=1,
                        help="out-neighbours each party sends to per iteration")
        sp.add_argument("--epsilon", type=float, default=1.0, help="target epsilon of the (epsilon, delta)-DP "
                        "guarantee, > 0")
        sp.add_argument("--delta", type=float, default=1e-5, help="target delta, in (0, 1)")
        sp.add_argument("--collusion", type=float, default=0.1,
                        help="fraction rho of colluding (corrupted) parties the guarantee holds against, in [0, 1)")
        sp.add_argument("--dropout", type=parse_dropout, default="permanent:0.1",
                        help="parties going offline during mixing: none | permanent:<gamma> | temporary:<p> | "
                             "markov:<rate>[,<corr>]")
        sp.add_argument("--runs", type=_positive_int, default=20,
                        help="simulated runs the calibration takes the worst case over")
        sp.add_argument("--seed", type=_seed, default=0, help="seed of the data, the runs and the adversary draw")
        sp.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")

    m = sub.add_parser(
        "mean", help="privately average random vectors among simulated parties (demo)",
        description="Demo: n simulated parties hold random vectors in the L2 ball of radius --clip and "
                    "average them with IncA, noise calibrated for (--epsilon, --delta)-DP against "
                    "--collusion colluders with --dropout; prints the error next to central DP (a "
                    "trusted curator) and local DP, and the epsilon certified for the run.",
        epilog="examples:\n  flwr-inca mean\n"
               "  flwr-inca mean --parties 1000 --dim 100 --epsilon 0.5 --dropout temporary:0.2",
        formatter_class=_HelpFormatter)
    protocol_args(m, 100)
    m.add_argument("--dim", "-d", type=_positive_int, default=10, help="dimension of each party's vector")
    m.add_argument("--clip", type=float, default=1.0, help="L2 norm bound C of the vectors (sensitivity 2C)")
    m.add_argument("--sigma-star", type=float, default=None,
                   help="skip calibration: std of each party's independent noise (give with --sigma-delta; default: calibrated)")
    m.add_argument("--sigma-delta", type=float, default=None,
                   help="skip calibration: std of the cancelling noise (give with --sigma-star; default: calibrated)")
    m.set_defaults(func=cmd_mean)

    c = sub.add_parser(
        "calibrate", help="noise levels for a target (epsilon, delta)",
        description="Choose sigma_star and sigma_delta so that every simulated run meets (--epsilon, "
                    "--delta)-DP against the threat: the paper's procedure (alpha = 1.3, classic Gaussian "
                    "bound, needs epsilon < 1) and the exact one (exact certificate, tight conversion).",
        epilog="example:\n  flwr-inca calibrate --parties 200 --epsilon 0.2 --collusion 0.1 "
               "--dropout permanent:0.1 --runs 100",
        formatter_class=_HelpFormatter)
    protocol_args(c, 200)
    c.add_argument("--observed-fraction", type=float, default=None,
                   help="Eavesdrop DP: fraction of messages intercepted, in [0, 1] (replaces --collusion; default: not used)")
    c.add_argument("--procedure", choices=["exact", "paper", "both"], default="both",
                   help="calibration procedure(s) to run")
    c.add_argument("--value-sensitivity", type=float, default=1.0,
                   help="size of a change of one value (1 for [0,1]; 2C for an L2 ball of radius C)")
    c.add_argument("--target-success", type=float, default=1.0,
                   help="share of simulated runs that must meet the target (exact procedure), in (0, 1]")
    c.set_defaults(func=cmd_calibrate)

    a = sub.add_parser(
        "audit", help="certify a recorded execution trace",
        description="Certify an execution that happened (an inca-trace/1 file, e.g. from "
                    "IncaStrategy(trace_dir=...)): each honest party's mu and epsilon against the given "
                    "adversary, the weakest parties and why.",
        epilog="examples:\n  flwr-inca audit trace.json --collusion 0.1 --seed 4\n"
               "  flwr-inca audit trace.json --corrupted 3,7,9 --json",
        formatter_class=_HelpFormatter)
    a.add_argument("trace", help="inca-trace/1 JSON file")
    g = a.add_mutually_exclusive_group()
    g.add_argument("--corrupted", help="comma-separated corrupted parties, e.g. 3,7,9 (default: a random set, --collusion)")
    g.add_argument("--collusion", type=float, default=0.1, help="random corrupted fraction, in [0, 1)")
    g.add_argument("--observed-fraction", type=float,
                   help="Eavesdrop DP: fraction of intercepted messages, in [0, 1] (instead of --collusion)")
    g.add_argument("--adversarial", type=float, metavar="FRACTION",
                   help="search for the corrupted set (of this fraction) that hurts the weakest party (instead of --collusion)")
    a.add_argument("--seed", type=_seed, default=0, help="seed of the random corrupted set or intercepted messages")
    a.add_argument("--delta", type=float, default=1e-5, help="delta at which epsilon is reported, in (0, 1)")
    a.add_argument("--value-sensitivity", type=float, default=1.0,
                   help="size of a change of one party's value, in the trace's value units")
    a.add_argument("--top", type=_positive_int, default=5, help="weakest parties to list (>= 1)")
    a.add_argument("--json", action="store_true",
                   help='print {"mu": {party: mu}, "max_mu", "epsilon", "delta", "threat", "corrupted", '
                        '"finals", "finals_recorded"}')
    a.set_defaults(func=cmd_audit)

    s = sub.add_parser(
        "simulate", help="simulate decentralized training on MNIST (Ray, thousands of clients)",
        description="Train a model on MNIST among --clients simulated clients with IncA (or a trusted "
                    "reference), certifying and charging every round; writes history.json/.csv, the "
                    "ledger and a plot to --out.",
        epilog="examples:\n  flwr-inca simulate --clients 100 --rounds 10 --backend inline\n"
               "  flwr-inca simulate --clients 1000 --rounds 40 --epsilon 1 --data-dir /path/to/mnist "
               "--out sim-1000\n\n"
               "exit status: 0 when every round ran; 1 when training stopped early because the privacy "
               "budget did not allow the next round (the results so far are written; the message says why); "
               "2 on bad arguments",
        formatter_class=_HelpFormatter)
    s.add_argument("--clients", "-n", type=_positive_int, default=100, help="number of clients")
    s.add_argument("--rounds", "-R", type=_positive_int, default=40, help="training rounds")
    s.add_argument("--mode", default="inca", help="inca | fedavg (trusted, no noise) | central-dp (trusted, noised) | local-dp | dp-gossip | "
                                                   "muffliato | gopa (the baselines as mixers)")
    s.add_argument("--model", choices=["logreg", "mlp"], default="logreg", help="model trained by the clients")
    s.add_argument("--partition", default="iid", help="iid | dirichlet:<alpha>")
    s.add_argument("--data-dir", default="", help="MNIST IDX directory (else $FLWR_INCA_MNIST_DIR, Hugging Face, "
                                                   "or scikit-learn's digits offline)")
    s.add_argument("--fraction", type=float, default=1.0, help="share of available clients per round")
    s.add_argument("--min-clients", type=int, default=2, help="fewest clients sampled in a round")
    s.add_argument("--availability", default="none", help="none | markov:<p_off>,<p_on> (across rounds)")
    s.add_argument("--dropout", type=parse_dropout, default=None,
                   help="within a round's mixing: none | permanent:<gamma> | temporary:<p> | markov:<rate>[,<corr>] "
                        "(default: none)")
    s.add_argument("--privacy-unit", choices=["record", "party"], default="record",
                   help="what is protected: one training example, or a client's whole data")
    s.add_argument("--lr", type=float, default=None, help="learning rate (default: 6.0 at record level, 0.05 at party level)")
    s.add_argument("--clip-norm", type=float, default=1.0,
                   help="record level: per-example gradient clip; party level: clip of a client's update")
    s.add_argument("--batch-size", type=int, default=50, help="record level: expected Poisson batch per client")
    s.add_argument("--local-steps", type=int, default=None, help="party level: local SGD steps (default: --local-epochs)")
    s.add_argument("--local-epochs", type=int, default=None, help="party level: local epochs (default: 1, or --local-steps)")
    s.add_argument("--epsilon", type=_optional_epsilon, default=1.0, help="total budget over the rounds, or 'none'")
    s.add_argument("--delta", type=float, default=1e-5, help="delta of the budget, in (0, 1)")
    s.add_argument("--accountant", choices=["exact", "opacus-prv", "opacus-rdp", "prv", "rdp", "gdp"],
                   default=None, help="composition over rounds (default: opacus-prv at record level, exact at "
                                      "party level; prv, rdp, gdp: deprecated old names)")
    s.add_argument("--iterations", "-T", type=_positive_int, default=10, help="IncA mixing iterations per round")
    s.add_argument("--neighbors", "-k", type=_positive_int, default=1, help="peers per mixing iteration")
    s.add_argument("--topology", default="random", help="topology of the mixing (as IncaConfig's topology=)")
    s.add_argument("--collusion", type=float, default=0.1, help="fraction of colluding clients certified against")
    s.add_argument("--observed-fraction", type=float, default=None, help="Eavesdrop DP: fraction of messages intercepted, instead of --collusion (default: not used)")
    s.add_argument("--threat-draws", type=_positive_int, default=1,
                   help="random colluding sets certified per round (the worst counts)")
    s.add_argument("--sigma-star", type=float, default=None, help="fixed sigma_star (default: calibrated for the budget)")
    s.add_argument("--sigma-delta", type=float, default=None, help="fixed sigma_delta (default: calibrated for the budget)")
    s.add_argument("--calibration-runs", type=_positive_int, default=10, help="simulated runs of the calibration")
    s.add_argument("--certification", choices=["exact", "local-bound"], default="exact",
                   help="per-round certificate: exact, or a cheaper local upper bound")
    s.add_argument("--certify-every", type=_positive_int, default=1,
                   help="exact certificate every r rounds (a prediction, marked, in between)")
    s.add_argument("--noise-multiplier", type=float, default=None, help="central-dp without a budget: noise std / sensitivity (default: from --epsilon)")
    s.add_argument("--backend", choices=["ray", "inline"], default="ray",
                   help="ray: training in Ray actors; inline: in this process")
    s.add_argument("--num-actors", type=int, default=None, help="Ray actors (default: one per CPU)")
    s.add_argument("--ray-address", default=None, help="'auto' or host:port of a Ray cluster (default: a local Ray)")
    s.add_argument("--precision", choices=["float32", "float64"], default="float32", help="training precision")
    s.add_argument("--eval-every", type=_positive_int, default=1, help="evaluate the model every r rounds")
    s.add_argument("--seed", type=int, default=0, help="seed of the partition, sampling and mixing")
    s.add_argument("--out", default=None, help="output directory (default: a new simulation-<mode>-<clients>c-<time> directory)")
    s.add_argument("--save-traces", action="store_true", help="also write each round's execution trace")
    s.add_argument("--json", action="store_true", help="print a JSON summary instead of progress")
    s.set_defaults(func=cmd_simulate)
    add_reproduce_parser(sub)
    add_study_parser(sub, formatter_class=_HelpFormatter)
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
