"""``flwr-inca study mnist``: the command line of the MNIST study (:func:`~flwr_inca.study.mnist.run_study`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from .._argtypes import (
    comma_separated,
    dropout_rate,
    epsilon,
    int_in,
    iterations,
    iterations_or_auto,
    real_in,
)
from .grid import DEFAULT_GRID, FULL_GRID, METHODS, TINY_GRID
from .report import markdown_table
from .runs import StudyOutputExists, check_output

__all__ = ["add_study_parser"]


_floats = comma_separated(real_in(None))
_ints = comma_separated(int_in(None))


def add_study_parser(sub: Any, **parser_options: Any) -> None:
    """Register ``flwr-inca study mnist``; ``parser_options`` go to ``add_parser`` (e.g. the CLI's help
    formatter)."""
    s = sub.add_parser(
        "study", help="side-by-side learning study: IncA vs central/local DP, DP gossip, Muffliato, GOPA",
        description="Train MNIST logistic regression with every method (FedAvg without noise, central DP, "
                    "IncA with both calibrations, local DP, DP gossip, Muffliato, GOPA) at each epsilon, n and "
                    "dropout rate of the grid, tuning each method on a validation split with the same budget; "
                    "writes runs.csv, table.csv/.md, results.json and the plots to --out.",
        epilog="examples:\n  flwr-inca study mnist --data-dir /path/to/mnist\n"
               "  flwr-inca study mnist --grid tiny --out study-smoke",
        **parser_options)
    s.add_argument("dataset", choices=["mnist"], help="the study to run")
    s.add_argument("--grid", choices=["default", "full", "tiny"], default="default",
                   help="default: the reduced grid (n = 1000, IID, 1 seed; about 25 minutes on 2 CPU cores); "
                        "full: the whole grid (n in {100, 1000}, IID and Dirichlet(0.5), every epsilon x gamma, "
                        "3 seeds, 27 tuning settings; many hours); tiny: a seconds-long smoke test")
    s.add_argument("--data-dir", default=None, help="directory of the MNIST IDX files (else FLWR_INCA_MNIST_DIR)")
    s.add_argument("--out", default="study-mnist", help="output directory")
    s.add_argument("--clients", type=_ints, help="override the grid's n values, e.g. 100,1000")
    s.add_argument("--partitions", type=lambda t: tuple(v for v in t.split(",") if v),
                   help="override the grid's partitions, e.g. iid,dirichlet:0.5")
    s.add_argument("--epsilons", type=_floats, help="override the grid's epsilons")
    s.add_argument("--gammas", type=_floats, help="override the grid's gammas")
    s.add_argument("--seeds", type=_ints, help="override the grid's seeds, e.g. 0,1,2")
    s.add_argument("--methods", type=lambda t: tuple(v for v in t.split(",") if v),
                   help=f"subset of {','.join(METHODS)}")
    s.add_argument("--iterations", type=iterations_or_auto, help="IncA's T: auto (default: the fewest of 10, 20, 40 "
                   "leaving at most a quarter of the central noise uncancelled by the run's dropouts) or a number")
    s.add_argument("--max-iterations", type=iterations,
                   help="the largest T iterations='auto' may choose (default 40)")
    s.add_argument("--schedule", help="IncA's injection schedule: auto (default: the value-free tail) | "
                   "incremental | incremental:tail=<L> | early")
    s.add_argument("--tune-lr", type=_floats, help="override the tuning grid's learning rates, e.g. 1,3,8")
    s.add_argument("--tune-clip", type=_floats, help="override the tuning grid's clip norms, e.g. 0.5,1,2")
    s.add_argument("--tune-rounds", type=_ints, help="override the tuning grid's round counts, e.g. 10,25,50")
    s.add_argument("--tune-epsilon", type=epsilon,
                   help="the budget every method is tuned at (default 1)")
    s.add_argument("--tune-gamma", type=dropout_rate,
                   help="the dropout rate every method is tuned at (default 0.1)")
    s.add_argument("--resume", action="store_true", help="reuse the runs already in OUT (runs.csv, and runs.csv.partial of an interrupted study); "
                   "without it, a folder holding runs is refused")
    s.add_argument("--replot", action="store_true",
                   help="only redraw the plots of the study in OUT from its results.json (runs nothing)")
    s.set_defaults(func=_cmd_study)


def _cmd_study(args: Any) -> int:
    from ..simulation.data import load_mnist
    from .mnist import run_study

    if args.replot:
        return _replot(args.out)
    grid = {"default": DEFAULT_GRID, "full": FULL_GRID, "tiny": TINY_GRID}[args.grid]
    overridable = ("clients", "partitions", "epsilons", "gammas", "seeds", "methods", "iterations", "max_iterations",
                   "schedule", "tune_lr", "tune_clip", "tune_rounds", "tune_epsilon", "tune_gamma")
    changes = {k: getattr(args, k) for k in overridable if getattr(args, k, None) is not None}
    try:
        grid = replace(grid, **changes)
    except ValueError as exc:
        print(f"flwr-inca study: {exc}", file=sys.stderr)
        return 2
    try:
        check_output(args.out, args.resume)  # before loading anything
    except StudyOutputExists as exc:
        print(f"flwr-inca study: {exc}", file=sys.stderr)
        return 2
    dataset = load_mnist(args.data_dir)
    if dataset.features != 784:
        print(f"flwr-inca study: MNIST not found (give --data-dir or FLWR_INCA_MNIST_DIR); got "
              f"{getattr(dataset, 'name', '?')} with {dataset.features} features, which the study's 784 -> 10 model "
              "cannot take", file=sys.stderr)
        return 2
    summary = run_study(dataset, grid, args.out, resume=args.resume)
    print(markdown_table(summary["table"]))
    return 0


def _replot(out: str) -> int:
    from .report import replot

    try:
        written = replot(out)
    except ValueError as exc:
        print(f"flwr-inca study: --replot: {exc}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
