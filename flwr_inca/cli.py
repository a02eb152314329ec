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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import __version__
from ._argtypes import dropout_rate as _dropout_rate
from ._argtypes import epsilon as _epsilon
from ._argtypes import int_in, iterations_or_auto, real_in
from ._argtypes import iterations as _iterations
from ._checks import (
    MAX_BATCH_SIZE,
    MAX_EPSILON,
    MAX_ITERATIONS,
    MAX_LOCAL_STEPS,
    MAX_PARTIES,
    MAX_ROUNDS,
    MAX_RUNS,
    MAX_SCALE,
    MAX_WORKERS,
    MIN_EPSILON,
    check_bytes,
    check_int,
    check_real,
)
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
from .protocol.schedules import RECOMMENDED_SCHEDULE
from .study import add_study_parser

if TYPE_CHECKING:
    from .privacy.calibration import Calibration
    from .rounds import IterationChoice


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


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``flwr-inca mean: error: argument --epsilon: must be in
    [1e-06, 1e+06], got 0.0``), exit status 2, no usage block: the line names the option and its range."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


_positive_int = int_in(1)
_seed = int_in(0)
_parties = int_in(2, MAX_PARTIES)


def _schedule(text: str) -> str:
    """``--schedule``: 'auto', 'incremental', 'incremental:tail=L' or 'early' (checked against T later)."""
    from .protocol.schedules import InjectionSchedule

    try:
        InjectionSchedule.resolve(text, MAX_ITERATIONS)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("schedule: ")) from None
    return text
_neighbors = int_in(1, MAX_PARTIES - 1)
_runs = int_in(1, MAX_RUNS)
_rounds = int_in(1, MAX_ROUNDS)
_workers = int_in(1, MAX_WORKERS)
_delta = real_in(0.0, 1.0, low_open=True, high_open=True)
_fraction = real_in(0.0, 1.0)  # a share of messages, in [0, 1]
_collusion = real_in(0.0, 1.0, high_open=True)  # a share of parties that are corrupted, in [0, 1)
_scale = real_in(0.0, MAX_SCALE, low_open=True)  # a norm, sensitivity or learning rate, in (0, 1e100]
_sigma = real_in(0.0, MAX_SCALE)  # a noise std, in [0, 1e100]


def _table(rows: list[list[Any]], header: list[str]) -> str:
    """An aligned text table: numbers right-aligned (4 significant digits), text left-aligned."""
    numeric = [all(isinstance(r[i], (int, float)) for r in rows) for i in range(len(header))]
    cells = [header] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join((c.rjust(w) if num else c.ljust(w)) for c, w, num in zip(r, widths, numeric)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _check_protocol(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` if --parties, --iterations, --neighbors and --dropout cannot run together (e.g.
    --neighbors >= --parties, a trace too large for memory): before any note or progress is printed. With
    --iterations auto, the most it may choose is checked."""
    iterations = args.max_iterations if args.iterations == "auto" else args.iterations
    IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=iterations, neighbors=args.neighbors,
               dropout=args.dropout, schedule=args.schedule).check(args.parties)


def _resolve_iterations(args: argparse.Namespace, value_sensitivity: float, *,
                        noise_given: bool = False) -> IterationChoice | None:
    """``--iterations auto``: choose T by the rule every driver uses (:func:`flwr_inca.rounds.choose_iterations`,
    at the per-execution target --epsilon), note the choice on stderr and set ``args.iterations``; the choice
    (its ``calibrator`` holds the chosen T's calibration, when one was made), or None for a given T."""
    if args.iterations != "auto":
        return None
    from .privacy import mu_for_epsilon
    from .rounds import choose_iterations
    from .settings import MixingConfig, PrivacyTarget

    privacy = PrivacyTarget(round_epsilon=args.epsilon, delta=args.delta, collusion=args.collusion,
                            observed_fraction=getattr(args, "observed_fraction", None),
                            calibration_runs=args.runs, calibration_success=getattr(args, "target_success", 1.0))
    # given sigmas: more iterations would not lower the noise, and the rule takes the fewest
    sigmas = {"sigma_star": 1.0, "sigma_delta": 1.0} if noise_given else {}
    mixing = MixingConfig(iterations="auto", neighbors=args.neighbors, schedule=args.schedule,
                          dropout=args.dropout, max_iterations=args.max_iterations, **sigmas)
    choice = choose_iterations(privacy, mixing, args.parties, mu_target=mu_for_epsilon(args.epsilon, args.delta),
                               value_sensitivity=value_sensitivity, seed=args.seed,
                               log=None if args.json else _status("choosing T"))
    print(f"note: {choice.describe(args.neighbors)}", file=sys.stderr)
    args.iterations = choice.iterations
    return choice


def _chosen_calibration(choice: IterationChoice | None, args: argparse.Namespace,
                        value_sensitivity: float) -> Calibration | None:
    """The calibration ``--iterations auto`` made of the chosen T for ``--parties`` at ``--epsilon`` (the
    drivers' calibrator, exact procedure, scale-free: its runs serve any target and sensitivity), or None
    when the choice calibrated nothing (a given T, fixed noise, no dropouts expected)."""
    if choice is None or choice.calibrator is None:
        return None
    from .privacy import mu_for_epsilon

    cal = choice.calibrator.calibration(args.parties, mu_for_epsilon(args.epsilon, args.delta), args.delta,
                                        value_sensitivity)
    return replace(cal, epsilon=args.epsilon)  # not its round trip through mu


# ---------------------------------------------------------------------------------------- mean
def cmd_mean(args: argparse.Namespace) -> int:
    from .privacy import calibrate, certify, mu_for_epsilon, random_collusion

    _check_protocol(args)
    n, d, C = args.parties, args.dim, args.clip
    rng = np.random.default_rng(args.seed)
    # the values, the estimate and the protocol's state: about 8 (n, d) float64 arrays at once
    check_bytes(f"--parties x --dim = {n} x {d} values", 8.0 * 8 * n * d, "fewer --parties or a smaller --dim")
    # random vectors in the L2 ball of radius C (the setting of clipped model updates)
    x = rng.standard_normal((n, d))
    x *= (C * rng.random(n) ** (1.0 / d) / np.linalg.norm(x, axis=1))[:, None]
    sensitivity = 2 * C  # replace-one on an L2 ball of radius C
    noise_given = args.sigma_star is not None and args.sigma_delta is not None
    choice = _resolve_iterations(args, sensitivity, noise_given=noise_given)
    mu = mu_for_epsilon(args.epsilon, args.delta)  # the per-execution target, in GDP
    if noise_given:
        s_star, s_delta, source = args.sigma_star, args.sigma_delta, "given"
    elif args.sigma_star is not None or args.sigma_delta is not None:
        print("error: give both --sigma-star and --sigma-delta, or neither to calibrate", file=sys.stderr)
        return 2
    else:
        cal = _chosen_calibration(choice, args, sensitivity)
        if cal is not None:
            source = f"calibrated over {args.runs} runs to choose T"
        else:
            cal = calibrate(args.epsilon, args.delta, n, iterations=args.iterations, neighbors=args.neighbors,
                            collusion=args.collusion, dropout=args.dropout, schedule=args.schedule,
                            runs=args.runs, seed=args.seed, value_sensitivity=sensitivity,
                            progress=_progress("calibrating"))
            source = f"calibrated over {args.runs} runs"
        s_star, s_delta = cal.sigma_star, cal.sigma_delta
        for note in cal.notes:
            print(f"note: {note}", file=sys.stderr)
    config = IncaConfig(iterations=args.iterations, neighbors=args.neighbors, sigma_star=s_star,
                        sigma_delta=s_delta, dropout=args.dropout, schedule=args.schedule)
    result = run_inca(x, config, seed=args.seed, progress=_progress("mixing") if n * d > 1e7 else None)
    mse = float(np.mean((result.estimate - x.mean(axis=0)) ** 2))
    view = random_collusion(result.trace, args.collusion, seed=args.seed + 1)
    cert = certify(result.trace, view, value_sensitivity=sensitivity, delta=args.delta)
    central = (sensitivity / (n * mu)) ** 2  # Gaussian mechanism on the mean, tight calibration
    out = {
        "parties": n, "dim": d, "clip": C, "iterations": args.iterations, "neighbors": args.neighbors,
        "epsilon_target": args.epsilon, "delta": args.delta,
        "sigma_star": s_star, "sigma_delta": s_delta, "sigmas": source,
        "finalists": int(result.finalists.size), "mse_inca": mse,
        "mse_central_dp": central, "mse_local_dp": central * n,
        "certified_epsilon": cert.epsilon, "threat": view.describe(),
    }
    if args.json:
        print(dumps(out, indent=1))
        return 0
    print(f"IncA mean of {n} parties, {d}-dim values clipped to L2 norm {C}, {args.iterations} iterations, "
          f"k = {args.neighbors}, schedule {config.resolved_schedule().name}, dropout: {args.dropout!r}")
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

    _check_protocol(args)
    procedures = ["paper", "exact"] if args.procedure == "both" else [args.procedure]
    if procedures == ["paper"] and args.epsilon >= 1:
        print(f"error: --procedure paper needs --epsilon < 1 (the paper's classic Gaussian bound), got "
              f"{args.epsilon:g}; use --procedure exact", file=sys.stderr)
        return 2
    choice = _resolve_iterations(args, args.value_sensitivity)
    chosen = _chosen_calibration(choice, args, args.value_sensitivity)
    # the runs: those of the choice's calibration where it made one (the paper's procedure on the same
    # executions), else drawn from --seed
    seed = args.seed if chosen is None else choice.calibrator.seed_for(args.parties)
    results = []
    for proc in procedures:
        if proc == "paper" and args.epsilon >= 1:
            print("note: the paper's procedure needs epsilon < 1 (classic bound); skipped", file=sys.stderr)
            continue
        if proc == "exact" and chosen is not None:
            chosen.notes.append("the calibration made to choose T (its runs are not simulated again)")
            results.append(chosen)
            continue
        results.append(calibrate(
            args.epsilon, args.delta, args.parties, iterations=args.iterations, neighbors=args.neighbors,
            collusion=args.collusion, observed_fraction=args.observed_fraction, dropout=args.dropout,
            schedule=args.schedule, runs=args.runs, seed=seed, procedure=proc, value_sensitivity=args.value_sensitivity,
            target_success=args.target_success, progress=None if args.json else _progress(f"{proc} runs"),
        ))
    central = (args.value_sensitivity / (args.parties * results[-1].mu_target)) ** 2 if results else math.nan
    if args.json:
        print(dumps({"calibrations": [r.to_dict() for r in results], "mse_central_dp": central}, indent=1))
        return 0
    print(f"target ({args.epsilon:g}, {args.delta:g})-DP, n = {args.parties}, T = {args.iterations}, "
          f"k = {args.neighbors}, schedule {args.schedule}, {results[0].threat if results else ''}, dropout: {args.dropout!r}, "
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
    chosen = [args.corrupted, args.collusion, args.observed_fraction, args.adversarial, args.seed, args.delta,
              args.value_sensitivity]
    if isinstance(trace.meta.get("privacy"), dict) and all(v is None for v in chosen):
        return _audit_round(trace, args)  # a trace of a training: its round as it was certified and charged
    kw = {"value_sensitivity": 1.0 if args.value_sensitivity is None else args.value_sensitivity,
          "delta": 1e-5 if args.delta is None else args.delta}
    args.collusion = 0.1 if args.collusion is None else args.collusion
    args.seed = 0 if args.seed is None else args.seed
    args.delta, args.value_sensitivity = kw["delta"], kw["value_sensitivity"]
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
        outside = [c for c in corrupted if not 0 <= c < trace.parties]
        if outside:
            print(f"error: --corrupted: party indices must be in [0, {trace.parties - 1}], got {outside[0]}",
                  file=sys.stderr)
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


def _audit_round(trace, args: argparse.Namespace) -> int:
    """A training's round from its trace alone: its certificate and charge recomputed as training made them
    (same adversaries, finals and rounding), against what training recorded."""
    from .rounds import reproduce_charge

    again = reproduce_charge(trace)
    if args.json:
        print(dumps({"round": again.round, "certified_mu": again.certified_mu, "charged_mu": again.charged_mu,
                     "recorded_mu": again.recorded_mu, "agrees": again.agrees, "epsilon": again.epsilon_round,
                     "delta": again.delta, "accountant": again.accountant, "method": again.method,
                     "refused": again.refused, "delivered_iterations": again.delivered}))
    else:
        stopped = (f"; refused by the budget after {again.delivered} iteration(s), finals not collected"
                   if again.refused else "")
        print(f"round {again.round}, recomputed from the trace as training certified it{stopped}: mu = "
              f"{again.certified_mu:.6g} ({again.method}), charged {again.charged_mu:.6g} -> epsilon of this round "
              f"alone {again.epsilon_round:.6g} at delta = {again.delta:g} ({again.accountant} accountant)")
        if again.recorded_mu is not None:
            verdict = "the same" if again.agrees else "DIFFERENT: the trace or the package changed since"
            print(f"training charged mu = {again.recorded_mu:.6g}: {verdict}")
        print("(options such as --corrupted or --collusion audit the trace against another adversary)")
    if not again.agrees:
        print(f"error: {args.trace}: the recomputed charge {again.charged_mu!r} differs from the recorded "
              f"{again.recorded_mu!r}", file=sys.stderr)
        return 1
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


# ---------------------------------------------------------------------------------------- attack
def _read_trace(path: str):
    """The trace at ``path``, or None after printing one line saying why it cannot be read."""
    from .protocol import ExecutionTrace

    try:
        return ExecutionTrace.load(path)
    except OSError as exc:
        why = exc.strerror or str(exc)
    except (ValueError, MemoryError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else "too large for this machine's memory"
    print(f"error: cannot read trace {path}: {why}", file=sys.stderr)
    return None


def _party_list(option: str, text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{option} must be comma-separated party indices, e.g. 3,7,9, got {text!r}") from None


def _attack_privacy_meta(trace) -> dict:
    """``trace.meta["privacy"]`` (what training certified the round with), or {} when absent or not a dict."""
    meta = trace.meta.get("privacy")
    return meta if isinstance(meta, dict) else {}


def _attack_adversary(args: argparse.Namespace, trace, finals, meta: dict):
    """``(view, certificate or None, description)``: the flags' adversary, else the round's (the worst of the
    threat draws it was certified against, from ``trace.meta["privacy"]``), else a random 10% coalition."""
    from .privacy import (
        certification_seeds,
        certification_views,
        certify,
        collusion_view,
        random_collusion,
        random_eavesdrop,
        with_finals,
    )

    if args.corrupted is not None:
        corrupted = _party_list("--corrupted", args.corrupted)
        try:
            return with_finals(collusion_view(trace, corrupted), trace, finals), None, "given"
        except ValueError as exc:
            raise ValueError(f"--corrupted: {exc}") from None
    if args.observed_fraction is not None:
        return random_eavesdrop(trace, args.observed_fraction, args.seed, finals=finals), None, "random"
    if args.collusion is None and isinstance(meta.get("certification_seed"), int) and (
            meta.get("collusion") is not None or meta.get("observed_fraction") is not None):
        draws = check_int("trace meta privacy 'threat_draws'", meta.get("threat_draws", 1))
        seeds = certification_seeds(meta["certification_seed"], int(meta.get("round", trace.meta.get("round", 0))))
        observed = meta.get("observed_fraction")
        views = list(certification_views(trace, seeds, draws, collusion=float(meta.get("collusion") or 0.0),
                                         observed_fraction=None if observed is None else float(observed),
                                         finals=finals))
        certs = [certify(trace, v, value_sensitivity=args.value_sensitivity, delta=args.delta) for v in views]
        worst = max(range(len(certs)), key=lambda i: certs[i].max_mu)
        return views[worst], certs[worst], f"the round's (worst of its {draws} certification draw(s))"
    rho = 0.1 if args.collusion is None else args.collusion
    return random_collusion(trace, rho, args.seed, finals=finals), None, "random"


def _attack_defaults(args: argparse.Namespace, meta: dict) -> None:
    """Flags override ``trace.meta["privacy"]``, which overrides the built-in defaults (delta 1e-5,
    value sensitivity 1)."""
    for name, key, default in (("delta", "delta", 1e-5), ("value_sensitivity", "value_sensitivity", 1.0)):
        if getattr(args, name) is None:
            setattr(args, name, check_real(f"the trace's privacy record {key!r}", meta.get(key, default)))
    check_real("--delta", args.delta, 0.0, 1.0, low_open=True, high_open=True)
    check_real("--value-sensitivity", args.value_sensitivity, 0.0, low_open=True)
    check_real("--confidence", args.confidence, 0.0, 1.0, low_open=True, high_open=True)
    check_int("--runs", args.runs, 100)
    if args.collusion is not None:
        check_real("--collusion", args.collusion, 0.0, 1.0, high_open=True)
    if args.observed_fraction is not None:
        check_real("--observed-fraction", args.observed_fraction, 0.0, 1.0)


def cmd_attack(args: argparse.Namespace) -> int:
    from .privacy import certify, recorded_finals
    from .privacy.attack import attack_audit, check_attack_size, plot_attack

    trace = _read_trace(args.trace)
    if trace is None:
        return 2
    try:
        finals = recorded_finals(trace)
    except ValueError as exc:
        print(f"error: cannot read trace {args.trace}: {exc}", file=sys.stderr)
        return 2
    meta = _attack_privacy_meta(trace)
    _attack_defaults(args, meta)
    targets = None if args.targets is None else _party_list("--targets", args.targets)
    prefix = None if args.no_plot else args.plot or str(Path(args.trace).with_suffix("")) + "-attack"
    if prefix is not None and not Path(prefix).parent.is_dir():
        raise ValueError(f"--plot: directory {Path(prefix).parent} does not exist")
    view, cert, source = _attack_adversary(args, trace, finals, meta)
    show = not (args.json or args.no_progress)
    check_attack_size(int(view.observed.sum()), args.runs, 2 if targets is None else len(targets))
    if cert is None:
        cert = certify(trace, view, value_sensitivity=args.value_sensitivity, delta=args.delta,
                       progress=_status("attack") if show else None)
    for t in targets or []:
        if t not in cert.mu:
            raise ValueError(f"--targets: party {t} is not an honest party of this execution (parties are "
                             f"0..{trace.parties - 1}; the colluders cannot be targets)")
    audit = attack_audit(trace, view, targets, runs=args.runs, delta=args.delta, confidence=args.confidence,
                         certificate=cert, seed=args.attack_seed, progress=_progress("attack") if show else None)
    plots = []
    if prefix is not None:
        try:
            plots = plot_attack(audit, prefix)
        except ImportError:
            print("note: matplotlib is not installed (pip install matplotlib): no plot", file=sys.stderr)
        except OSError as exc:
            print(f"note: cannot write the plot {prefix}.png: {exc.strerror or exc}", file=sys.stderr)
    if args.json:
        print(dumps({**audit.to_dict(), "trace": args.trace, "adversary_source": source,
                     "plots": [str(p) for p in plots]}))
    else:
        _attack_report(trace, audit, source, plots)
    for t in audit.targets:
        for reason in t.reasons:
            print(f"CERTIFICATE BEATEN for party {t.party}: {reason}. The accountant's claim does not hold for "
                  "this execution: please report it with the trace and this command line.", file=sys.stderr)
    return 1 if audit.beaten else 0


def _attack_report(trace, audit, source: str, plots: list) -> None:
    """The audit as a table (``flwr-inca attack`` without ``--json``)."""
    print(f"trace: {trace.parties} parties, {trace.iterations} iterations, schedule {trace.schedule.name}, "
          f"sigma_star = {trace.sigma_star:.4g}, sigma_delta = {trace.sigma_delta:.4g}")
    print(f"adversary ({source}): {audit.adversary}; it observes {audit.messages} messages per run "
          f"({audit.kept_messages} linearly independent)")
    print(f"attack: {audit.runs} fresh-noise runs (--attack-seed {audit.seed}), {audit.seconds:.1f} s; "
          f"certificate: {audit.certificate_method}, value sensitivity {audit.value_sensitivity:g}, "
          f"delta = {audit.delta:g}; intervals simultaneous at {100 * audit.confidence:g}%")
    rows = []
    for t in audit.targets:
        rows.append([t.party, t.mu, t.epsilon, f"{t.ratio:.4f} [{t.ratio_interval[0]:.4f}, {t.ratio_interval[1]:.4f}]",
                     f"{t.mu_empirical:.3g} [{t.mu_interval[0]:.3g}, {t.mu_interval[1]:.3g}]",
                     f"{t.epsilon_empirical:.3g} [{t.epsilon_interval[0]:.3g}, {t.epsilon_interval[1]:.3g}]",
                     "BEATEN" if t.beaten else "holds"])
    print(_table(rows, ["party", "mu", "epsilon", "error std x mu / sens.", "attack mu", "attack epsilon",
                        "certificate"]))
    print("error std x mu / sens. >= 1 for every unbiased attacker if the certificate holds (1: the attack is "
          "optimal); attack mu and epsilon are lower bounds, at most the certified values if it holds")
    for note in audit.notes:
        print(f"note: {note}")
    for p in plots:
        print(f"plot: {p}")


def add_attack_parser(sub: argparse._SubParsersAction) -> None:
    """The ``attack`` subcommand: an empirical audit of a trace's certificate by the optimal attacker."""
    from .privacy.attack import DEFAULT_RUNS

    k = sub.add_parser(
        "attack", help="audit a recorded execution's certificate by attacking it",
        description="Replay a recorded execution (an inca-trace/1 file, e.g. from IncaStrategy(trace_dir=...) "
                    "or 'flwr-inca simulate --save-traces') with fresh noise --runs times, hand the adversary "
                    "exactly the messages it observes, and run the optimal attacks on target parties: the "
                    "best linear unbiased reconstruction of a target's value, and the likelihood-ratio test "
                    "between two neighbouring values of it. Compares the attacker's error and its empirical "
                    "mu and epsilon (with confidence intervals) with the certificate, and plots them."
                    "\n\nDefaults for --delta, --value-sensitivity and the adversary come from the trace's "
                    "privacy record when training wrote one (the round's own certification draws).",
        epilog="examples:\n  flwr-inca attack trace.json --corrupted 3,7,9 --targets 12,40\n"
               "  flwr-inca attack round-1.json --runs 100000 --json --no-plot\n\n"
               "exit status: 0 when every certificate holds against the attack; 1 when the attack beats one "
               "(printed on stderr: a bug to report); 2 on bad arguments or an unreadable trace",
        formatter_class=_HelpFormatter)
    k.add_argument("trace", help="inca-trace/1 JSON file")
    g = k.add_mutually_exclusive_group()
    g.add_argument("--corrupted", help="comma-separated colluding parties, e.g. 3,7,9 (default: the trace's "
                                       "certification adversary, else a random set, --collusion)")
    g.add_argument("--collusion", type=float, default=None,
                   help="random colluding fraction, in [0, 1) (default: 0.1 when the trace has no privacy record)")
    g.add_argument("--observed-fraction", type=float, default=None,
                   help="Eavesdrop DP: fraction of intercepted messages, in [0, 1] (instead of --collusion)")
    k.add_argument("--seed", type=_seed, default=0, help="seed of the random colluding set or intercepted messages")
    k.add_argument("--targets", help="comma-separated honest parties to attack (default: the weakest and a "
                                     "median one)")
    k.add_argument("--runs", type=_positive_int, default=DEFAULT_RUNS,
                   help="fresh-noise runs, >= 100 (at 40,000 the ratio's interval is about +-1.1%%, two targets at 99%%)")
    k.add_argument("--delta", type=float, default=None, help="delta of the epsilons, in (0, 1) (default: the "
                                                              "trace's, else 1e-5)")
    k.add_argument("--value-sensitivity", type=float, default=None,
                   help="change of one value the certificate covers, > 0 (default: the trace's, else 1)")
    k.add_argument("--confidence", type=float, default=0.99,
                   help="simultaneous confidence of the intervals over targets and checks, in (0, 1)")
    k.add_argument("--attack-seed", type=_seed, default=None,
                   help="seed of the runs' values and noise (default: fresh; the report prints it)")
    k.add_argument("--plot", default=None, metavar="PREFIX",
                   help="write PREFIX.png and PREFIX.svg (default: the trace's path without .json, plus -attack)")
    k.add_argument("--no-plot", action="store_true", help="no plot")
    k.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    k.add_argument("--json", action="store_true", help="print the audit as JSON (targets, intervals, verdict)")
    k.set_defaults(func=cmd_attack)


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
    return None if v.strip().lower() == "none" else _epsilon(v)


def _partition(spec: str) -> str:
    """``iid`` or ``dirichlet:<alpha>`` with alpha in (0, 1e100] (checked before the data are loaded)."""
    kind, _, arg = spec.partition(":")
    if kind == "iid" and not arg:
        return spec
    if kind == "dirichlet" and arg:
        try:
            _scale(arg)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"the Dirichlet alpha {exc}") from None
        return spec
    raise argparse.ArgumentTypeError(f"must be iid or dirichlet:<alpha>, got {spec!r}")


def cmd_simulate(args: argparse.Namespace) -> int:
    from .simulation import SimulationConfig
    from .simulation.mnist import simulate_mnist

    if args.resume and not args.out:
        raise ValueError("--resume needs --out (the directory of the run to continue)")
    out = args.out or time.strftime(f"simulation-{args.mode}-{args.clients}c-%Y%m%d-%H%M%S")
    config = SimulationConfig(
        rounds=args.rounds, mode=args.mode, fraction=args.fraction, min_clients=args.min_clients,
        availability=_availability(args.availability), privacy_unit=args.privacy_unit, lr=args.lr,
        clip_norm=args.clip_norm, batch_size=args.batch_size, local_steps=args.local_steps,
        local_epochs=args.local_epochs, max_epsilon=args.max_epsilon, delta=args.delta, accountant=args.accountant,
        iterations=args.iterations, max_iterations=args.max_iterations, schedule=args.schedule,
        neighbors=args.neighbors, topology=args.topology, dropout=args.dropout,
        collusion=args.collusion, observed_fraction=args.observed_fraction, threat_draws=args.threat_draws,
        sigma_star=args.sigma_star, sigma_delta=args.sigma_delta, calibration_runs=args.calibration_runs,
        certification=args.certification, certify_every=args.certify_every,
        noise_multiplier=args.noise_multiplier, backend=args.backend, num_actors=args.num_actors,
        ray_address=args.ray_address, precision=args.precision, seed=args.seed, eval_every=args.eval_every,
        output_dir=out, trace_dir="traces" if args.save_traces else None)
    history = simulate_mnist(config, clients=args.clients, partition=args.partition, model=args.model,
                             data_dir=args.data_dir, progress=not args.json, resume=args.resume)
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
    written = [name for name in ("history.json", "history.csv", "model.npy", "inca_ledger.json", "accuracy_epsilon.png",
                                 "traces")
               if (Path(out) / name).exists()]  # e.g. no ledger when nothing was charged
    print(f"results in {out}/ ({', '.join(n + '/' if n == 'traces' else n for n in written) or 'nothing written'})")
    return status


# ---------------------------------------------------------------------------------------- reproduce
def cmd_reproduce(args: argparse.Namespace) -> int:
    from .reproduce import reproduce

    try:
        settings = {"parties": args.parties, "epsilons": args.epsilons, "gammas": args.gammas,
                    "iterations": args.iterations, "neighbors": args.neighbors, "solver": args.solver,
                    "protocols": args.protocols, "target_success": args.target_success}
        reproduce([args.figure], runs=args.runs, out=args.out, seed=args.seed, progress=not args.no_progress,
                  settings=settings, merge=args.merge)
    except OSError as exc:  # e.g. the disk filled up while writing a figure
        print(f"error: --out {args.out}: cannot write the results: {exc}", file=sys.stderr)
        return 2
    return 0


def add_reproduce_parser(sub: argparse._SubParsersAction) -> None:
    from .privacy.methods import EXACT_LONG_MAX_ROWS, EXACT_LONG_MIN_ITERATIONS, EXACT_MAX_ROWS, SOLVERS
    from .reproduce import DEFAULT_RUNS, FRONTIER_PROTOCOLS

    r = sub.add_parser(
        "reproduce", help="re-measure the paper's figures: CSV, PNG and a table per figure",
        description="Re-measure a figure of the paper (or all): <out>/<figure>.csv (every number "
                    "plotted), .png and .txt (the paper's statements next to what was measured).",
        epilog="example:\n  flwr-inca reproduce fig3b --runs 20 --out outputs/reproduce",
        formatter_class=_HelpFormatter)
    r.add_argument("figure", choices=[*DEFAULT_RUNS, "all"],
                   help="which figure (all: the paper's figures, in order; frontier: IncA's "
                        "communication-accuracy frontier under dropouts, hours at its full grid)")
    r.add_argument("--runs", type=_runs, default=None,
                   help="simulated runs per point (per figure if not given: "
                        + ", ".join(f"{k} {v}" for k, v in DEFAULT_RUNS.items())
                        + "; the paper: 1000, Fig. 2 1e5, Fig. 5 100)")
    r.add_argument("--out", default="outputs/reproduce", help="directory for the CSV, PNG and text files")
    r.add_argument("--seed", type=_seed, default=0, help="seed of every simulated run")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    frontier = r.add_argument_group("frontier only (default: its whole grid)")
    frontier.add_argument("--parties", type=_parties, nargs="+", default=None, metavar="N", help="n values")
    frontier.add_argument("--epsilons", type=_epsilon, nargs="+", default=None, metavar="EPS",
                          help="epsilon values")
    frontier.add_argument("--gammas", type=_dropout_rate, nargs="+", default=None,
                          metavar="GAMMA", help="dropout fractions, in [0, 1)")
    frontier.add_argument("--iterations", type=_iterations, nargs="+", default=None, metavar="T",
                          help="IncA's T values")
    frontier.add_argument("--neighbors", type=_neighbors, nargs="+", default=None, metavar="K",
                          help="IncA's k values")
    frontier.add_argument("--solver", choices=SOLVERS, default=None,
                          help="how IncA's simulated executions are certified: auto (the default: exact up to "
                               f"{EXACT_MAX_ROWS} observed honest messages, {EXACT_LONG_MAX_ROWS} with k = 1 and T >= "
                               f"{EXACT_LONG_MIN_ITERATIONS}, where it fits in memory; else a sound bound), exact, "
                               "bound or cascade; GOPA's and CorDP-DME's are always exact")
    frontier.add_argument("--protocols", choices=FRONTIER_PROTOCOLS, nargs="+", default=None, metavar="NAME",
                          help=f"which protocols run ({', '.join(FRONTIER_PROTOCOLS)}): IncA with D_Inc, IncA with "
                               "the value-free tail, GOPA (every k_PR and gamma_2), CorDP-DME, the central-DP lines; "
                               "pieces of the grid run apart are joined by --merge")
    frontier.add_argument("--target-success", type=real_in(0.0, 1.0, low_open=True), default=None, metavar="Q",
                          help="the share of each point's simulated runs its noise must certify at the target, "
                               "for every protocol alike (default 1: all of them, the worst case over the runs, as "
                               "the paper; 0.99 is stable with fewer runs where the worst case keeps growing)")
    frontier.add_argument("--merge", nargs="+", default=None, metavar="CSV",
                          help="run nothing: join the frontier.csv files of earlier runs (pieces of the grid; a "
                               "point in several files is taken from the last) and write the frontier's CSV, "
                               "plots and tables for all their points to --out")
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
    p = _Parser(
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

    for add in (_add_mean_parser, _add_calibrate_parser, _add_audit_parser, _add_simulate_parser):
        add(sub)
    add_reproduce_parser(sub)
    add_attack_parser(sub)
    add_study_parser(sub, formatter_class=_HelpFormatter)
    return p


_ITERATIONS_HELP = (f"IncA mixing iterations per round, in [1, {MAX_ITERATIONS}], or auto: the fewest of 10, 20, 40, "
                    "80 (at most --max-iterations) whose noise left uncancelled by the expected --dropout is at "
                    "most a quarter of the central noise (10 without dropouts)")


def _iterations_args(parser: argparse.ArgumentParser, default: int | str) -> None:
    """--iterations (a T or auto) and --max-iterations, the same in every command that runs IncA."""
    parser.add_argument("--iterations", "-T", type=iterations_or_auto, default=default, help=_ITERATIONS_HELP)
    parser.add_argument("--max-iterations", type=_iterations, default=40, help="most iterations auto may choose")


def _protocol_args(sp: argparse.ArgumentParser, parties: int, iterations: int | str) -> None:
    sp.add_argument("--parties", "-n", type=_parties, default=parties,
                    help=f"number of parties n, in [2, {MAX_PARTIES:.0e}]")
    _iterations_args(sp, iterations)
    sp.add_argument("--neighbors", "-k", type=_neighbors, default=1,
                    help="out-neighbours each party sends to per iteration")
    sp.add_argument("--schedule", type=_schedule, default=RECOMMENDED_SCHEDULE,
                    help="injection schedule: auto (D_Inc with a value-free tail of 3 steps, fewer below T = 9) | "
                         "incremental (the paper's D_Inc) | incremental:tail=<L> | early")
    sp.add_argument("--epsilon", type=_epsilon, default=1.0, help="target epsilon of the (epsilon, delta)-DP "
                    f"guarantee, in [{MIN_EPSILON:g}, {MAX_EPSILON:g}]")
    sp.add_argument("--delta", type=_delta, default=1e-5, help="target delta, in (0, 1)")
    sp.add_argument("--collusion", type=_collusion, default=0.1,
                    help="fraction rho of colluding (corrupted) parties the guarantee holds against, in [0, 1)")
    sp.add_argument("--dropout", type=parse_dropout, default="permanent:0.1",
                    help="parties going offline during mixing: none | permanent:<gamma> | temporary:<p> | "
                         "markov:<rate>[,<corr>]")
    sp.add_argument("--runs", type=_runs, default=20,
                    help=f"simulated runs the calibration takes the worst case over, in [1, {MAX_RUNS:.0e}]")
    sp.add_argument("--seed", type=_seed, default=0, help="seed of the data, the runs and the adversary draw")
    sp.add_argument("--json", action="store_true", help="print machine-readable JSON instead of a table")


def _add_mean_parser(sub) -> None:
    m = sub.add_parser(
        "mean", help="privately average random vectors among simulated parties (demo)",
        description="Demo: n simulated parties hold random vectors in the L2 ball of radius --clip and "
                    "average them with IncA, noise calibrated for (--epsilon, --delta)-DP against "
                    "--collusion colluders with --dropout; prints the error next to central DP (a "
                    "trusted curator) and local DP, and the epsilon certified for the run.",
        epilog="examples:\n  flwr-inca mean\n"
               "  flwr-inca mean --parties 1000 --dim 100 --epsilon 0.5 --dropout temporary:0.2",
        formatter_class=_HelpFormatter)
    _protocol_args(m, 100, "auto")
    m.add_argument("--dim", "-d", type=_positive_int, default=10, help="dimension of each party's vector")
    m.add_argument("--clip", type=_scale, default=1.0, help="L2 norm bound C of the vectors (sensitivity 2C), > 0")
    m.add_argument("--sigma-star", type=_sigma, default=None,
                   help="skip calibration: std of each party's independent noise (give with --sigma-delta; default: calibrated)")
    m.add_argument("--sigma-delta", type=_sigma, default=None,
                   help="skip calibration: std of the cancelling noise (give with --sigma-star; default: calibrated)")
    m.set_defaults(func=cmd_mean)


def _add_calibrate_parser(sub) -> None:
    c = sub.add_parser(
        "calibrate", help="noise levels for a target (epsilon, delta)",
        description="Choose sigma_star and sigma_delta so that every simulated run meets (--epsilon, "
                    "--delta)-DP against the threat: the paper's procedure (alpha = 1.3, classic Gaussian "
                    "bound, needs epsilon < 1) and the exact one (exact certificate, tight conversion).",
        epilog="example:\n  flwr-inca calibrate --parties 200 --epsilon 0.2 --collusion 0.1 "
               "--dropout permanent:0.1 --runs 100",
        formatter_class=_HelpFormatter)
    _protocol_args(c, 200, 20)
    c.add_argument("--observed-fraction", type=_fraction, default=None,
                   help="Eavesdrop DP: fraction of messages intercepted, in [0, 1] (replaces --collusion; default: not used)")
    c.add_argument("--procedure", choices=["exact", "paper", "both"], default="both",
                   help="calibration procedure(s) to run")
    c.add_argument("--value-sensitivity", type=_scale, default=1.0,
                   help="size of a change of one value (1 for [0,1]; 2C for an L2 ball of radius C), > 0")
    c.add_argument("--target-success", type=real_in(0.0, 1.0, low_open=True), default=1.0,
                   help="share of simulated runs that must meet the target (exact procedure), in (0, 1]")
    c.set_defaults(func=cmd_calibrate)


def _add_audit_parser(sub) -> None:
    a = sub.add_parser(
        "audit", help="certify a recorded execution trace",
        description="Certify an execution that happened (an inca-trace/1 file, e.g. from "
                    "IncaStrategy(trace_dir=...) or flwr-inca simulate --save-traces). Without options, a "
                    "training's trace is certified as training certified it (its adversaries, sensitivity, "
                    "finals and rounding): the round's mu and epsilon, checked against what was charged. "
                    "With an adversary option: each honest party's mu and epsilon against it, the weakest "
                    "parties and why.",
        epilog="examples:\n  flwr-inca audit traces/round-0001.json            # as training charged it\n"
               "  flwr-inca audit trace.json --collusion 0.1 --seed 4\n"
               "  flwr-inca audit trace.json --corrupted 3,7,9 --json",
        formatter_class=_HelpFormatter)
    a.add_argument("trace", help="inca-trace/1 JSON file")
    g = a.add_mutually_exclusive_group()
    g.add_argument("--corrupted", help="comma-separated corrupted parties, e.g. 3,7,9 (default: a random set, --collusion)")
    g.add_argument("--collusion", type=_collusion, default=None,
                   help="random corrupted fraction, in [0, 1) (default 0.1; a training's trace: its own threat)")
    g.add_argument("--observed-fraction", type=_fraction,
                   help="Eavesdrop DP: fraction of intercepted messages, in [0, 1] (instead of --collusion)")
    g.add_argument("--adversarial", type=_collusion, metavar="FRACTION",
                   help="search for the corrupted set (of this fraction) that hurts the weakest party (instead of --collusion)")
    a.add_argument("--seed", type=_seed, default=None,
                   help="seed of the random corrupted set or intercepted messages (default 0)")
    a.add_argument("--delta", type=_delta, default=None,
                   help="delta at which epsilon is reported, in (0, 1) (default 1e-5; a training's trace: its own)")
    a.add_argument("--value-sensitivity", type=_scale, default=None,
                   help="size of a change of one party's value, in the trace's value units, > 0 (default 1; a "
                        "training's trace: its own)")
    a.add_argument("--top", type=_positive_int, default=5, help="weakest parties to list (>= 1)")
    a.add_argument("--json", action="store_true",
                   help='print {"mu": {party: mu}, "max_mu", "epsilon", "delta", "threat", "corrupted", '
                        '"finals", "finals_recorded"}')
    a.set_defaults(func=cmd_audit)


def _add_simulate_parser(sub) -> None:
    s = sub.add_parser(
        "simulate", help="simulate decentralized training on MNIST (Ray, thousands of clients)",
        description="Train a model on MNIST among --clients simulated clients with IncA (or a trusted "
                    "reference), certifying and charging every round; writes history.json/.csv, the "
                    "ledger and a plot to --out.",
        epilog="examples:\n  flwr-inca simulate --clients 100 --rounds 10 --backend inline\n"
               "  flwr-inca simulate --clients 1000 --rounds 40 --max-epsilon 1 --data-dir /path/to/mnist "
               "--out sim-1000\n\n"
               "exit status: 0 when every round ran; 1 when training stopped early because the privacy "
               "budget did not allow the next round (the results so far are written; the message says why); "
               "2 on bad arguments",
        formatter_class=_HelpFormatter)
    s.add_argument("--clients", "-n", type=_parties, default=100, help=f"number of clients, in [2, {MAX_PARTIES:.0e}]")
    s.add_argument("--rounds", "-R", type=_rounds, default=40, help=f"training rounds, in [1, {MAX_ROUNDS:.0e}]")
    s.add_argument("--mode", default="inca", help="inca | fedavg (trusted, no noise) | central-dp (trusted, noised) | local-dp | dp-gossip | "
                                                   "muffliato | gopa (the baselines as mixers)")
    s.add_argument("--model", choices=["logreg", "mlp"], default="logreg", help="model trained by the clients")
    s.add_argument("--partition", type=_partition, default="iid", help="iid | dirichlet:<alpha>")
    s.add_argument("--data-dir", default="", help="MNIST IDX directory (else $FLWR_INCA_MNIST_DIR, Hugging Face, "
                                                   "or scikit-learn's digits offline)")
    s.add_argument("--fraction", type=real_in(0.0, 1.0, low_open=True), default=1.0,
                   help="share of available clients per round, in (0, 1]")
    s.add_argument("--min-clients", type=_parties, default=2, help="fewest clients sampled in a round")
    s.add_argument("--availability", default="none", help="none | markov:<p_off>,<p_on> (across rounds)")
    s.add_argument("--dropout", type=parse_dropout, default=None,
                   help="within a round's mixing: none | permanent:<gamma> | temporary:<p> | markov:<rate>[,<corr>] "
                        "(default: none)")
    s.add_argument("--privacy-unit", choices=["record", "party"], default="record",
                   help="what is protected: one training example, or a client's whole data")
    s.add_argument("--lr", type=_scale, default=None, help="learning rate (default: 6.0 at record level, 0.05 at party level)")
    s.add_argument("--clip-norm", type=_scale, default=1.0,
                   help="record level: per-example gradient clip; party level: clip of a client's update")
    s.add_argument("--batch-size", type=int_in(1, MAX_BATCH_SIZE), default=50,
                   help="record level: expected Poisson batch per client")
    s.add_argument("--local-steps", type=int_in(1, MAX_LOCAL_STEPS), default=None,
                   help="party level: local SGD steps (default: --local-epochs)")
    s.add_argument("--local-epochs", type=int_in(1, MAX_LOCAL_STEPS), default=None,
                   help="party level: local epochs (default: 1, or --local-steps)")
    s.add_argument("--max-epsilon", type=_optional_epsilon, default=1.0,
                   help="total privacy budget over the rounds, or 'none'")
    s.add_argument("--delta", type=_delta, default=1e-5, help="delta of the budget, in (0, 1)")
    s.add_argument("--accountant", choices=["exact", "opacus-prv", "opacus-rdp"],
                   default=None, help="composition over rounds (default: opacus-prv at record level, exact at "
                                      "party level)")
    _iterations_args(s, "auto")
    s.add_argument("--neighbors", "-k", type=_neighbors, default=1, help="peers per mixing iteration")
    s.add_argument("--schedule", type=_schedule, default=RECOMMENDED_SCHEDULE,
                   help="injection schedule: auto (D_Inc with a value-free tail of 3 steps, fewer below T = 9) | "
                        "incremental (the paper's D_Inc) | incremental:tail=<L> | early")
    s.add_argument("--topology", default="random", help="topology of the mixing (as IncaConfig's topology=)")
    s.add_argument("--collusion", type=_collusion, default=0.1,
                   help="fraction of colluding clients certified against, in [0, 1)")
    s.add_argument("--observed-fraction", type=_fraction, default=None, help="Eavesdrop DP: fraction of messages intercepted, instead of --collusion (default: not used)")
    s.add_argument("--threat-draws", type=_workers, default=1,
                   help="random colluding sets certified per round (the worst counts)")
    s.add_argument("--sigma-star", type=_sigma, default=None, help="fixed sigma_star (default: calibrated for the budget)")
    s.add_argument("--sigma-delta", type=_sigma, default=None, help="fixed sigma_delta (default: calibrated for the budget)")
    s.add_argument("--calibration-runs", type=_runs, default=20, help="simulated runs of the calibration")
    s.add_argument("--certification", choices=["exact", "local-bound"], default="exact",
                   help="per-round certificate: exact, or a cheaper local upper bound")
    s.add_argument("--certify-every", type=_rounds, default=1,
                   help="exact certificate every r rounds (a prediction, marked, in between)")
    s.add_argument("--noise-multiplier", type=_scale, default=None, help="central-dp without a budget: noise std / sensitivity (default: from --max-epsilon)")
    s.add_argument("--backend", choices=["ray", "inline"], default="ray",
                   help="ray: training in Ray actors; inline: in this process")
    s.add_argument("--num-actors", type=_workers, default=None, help="Ray actors (default: one per CPU)")
    s.add_argument("--ray-address", default=None, help="'auto' or host:port of a Ray cluster (default: a local Ray)")
    s.add_argument("--precision", choices=["float32", "float64"], default="float32", help="training precision")
    s.add_argument("--eval-every", type=_rounds, default=1, help="evaluate the model every r rounds")
    s.add_argument("--seed", type=_seed, default=0, help="seed of the partition, sampling and mixing")
    s.add_argument("--out", default=None, help="output directory (default: a new simulation-<mode>-<clients>c-<time> directory)")
    s.add_argument("--save-traces", action="store_true", help="also write each round's execution trace (to traces/)")
    s.add_argument("--resume", action="store_true",
                   help="continue the run recorded in --out from its last recorded round (same settings; "
                        "--rounds may be larger); without it an --out that holds a run is refused")
    s.add_argument("--json", action="store_true", help="print a JSON summary instead of progress")
    s.set_defaults(func=cmd_simulate)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad argument: one line, exit status 2 (_Parser)
    try:
        return int(args.func(args))
    except (ValueError, ConnectionError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
