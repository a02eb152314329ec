"""Plain Python entry point (no Flower CLI, works offline): ``python -m mnist_logreg.run --help``.

Exit status: 0 when every round ran, 1 when training stopped because the privacy budget in the
ledger is spent (the message names the ledger and how to start afresh; a ledger with no room for the
first round is refused before Flower and Ray start), 2 for a bad setting (the message names the key and
its allowed range), a ledger file that cannot be read (the message names it) or a ``RAY_ADDRESS`` at which
no Ray cluster answers; all checked before Flower's engine starts.

Flower's simulation engine runs on a local Ray, or on the Ray cluster that ``RAY_ADDRESS`` names
(``ray start --head`` on one machine, ``ray start --address ...`` on the others).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from .task import (DEFAULTS, ENV_CONFIG, HELP, ConfigError, iterations_option, load_config, load_data,
                   privacy_plan)

EXAMPLES = """examples:
  python -m mnist_logreg.run --num-supernodes 20 --data-dir /path/to/mnist
  python -m mnist_logreg.run --num-server-rounds 5 --epsilon 2 --output-dir /tmp/mnist-quick
  python -m mnist_logreg.run --privacy-unit party --epsilon 8 --num-server-rounds 20"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mnist_logreg.run", epilog=EXAMPLES,
        formatter_class=lambda prog: _Formatter(prog, max_help_position=30),
        description="Federated logistic regression on MNIST with IncA through Flower's simulation engine "
                    "(offline; the same ServerApp and ClientApp as `flwr run .`). Results go to a new "
                    "<output-dir>/mnist_logreg-<privacy-unit>/run-<time>/ folder; the privacy ledger beside "
                    "it is shared by every run with that output-dir. Exit status 1: the budget is spent; "
                    "2: a bad setting.")
    parser.add_argument("--num-supernodes", type=int, default=DEFAULTS["num-partitions"],
                        help=HELP["num-partitions"])
    for key, value in DEFAULTS.items():
        if key == "num-partitions":
            continue
        choices = ["record", "party"] if key == "privacy-unit" else None
        kind = iterations_option if key == "iterations" else type(value)
        parser.add_argument(f"--{key}", type=kind, default=value, choices=choices, help=HELP[key])
    return parser


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _fill_text(self, text: str, width: int, indent: str) -> str:  # wrap the description, keep examples
        if text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


class _HideRunSimulationDeprecation(logging.Filter):
    """Flower deprecates ``run_simulation`` in favour of ``flwr run`` (which the README shows first);
    it is still the only way to start Flower's simulation engine from Python, which is what this entry
    point is for, so its deprecation notice is not something its users can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`run_simulation` function is deprecated" not in record.getMessage()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    nodes = args.pop("num_supernodes")
    config = {k.replace("_", "-"): v for k, v in args.items()}
    try:  # every setting, the data and the privacy plan checked before Flower and Ray start
        if nodes < 2:
            raise ConfigError(f"num-supernodes must be an integer >= 2, got {nodes}")
        cfg = load_config(config)
        data = load_data(cfg["data-dir"])
        if len(data.y_train) // nodes < 1:
            raise ConfigError(f"num-supernodes must be at most {len(data.y_train)} (one example each), "
                              f"got {nodes}")
        plan = privacy_plan(cfg, len(data.y_train) // nodes)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from .server_app import check_ledger

    try:
        spent = check_ledger(cfg, plan, nodes)  # a spent ledger refuses the run before Flower and Ray start
    except (ValueError, OSError) as exc:  # a ledger file that cannot be read or was edited: named, one line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if spent is not None:
        print(f"error: {spent}", file=sys.stderr)
        return 1
    os.environ[ENV_CONFIG] = json.dumps(config)  # read by the apps (also in Ray workers)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr_inca.simulation.backend import connect_ray

    # the workers of a cluster do not inherit this process's environment: the job passes them the run's
    # settings (ENV_CONFIG, FLWR_INCA_MNIST_DIR, FLWR_INCA_STATE_DIR, ...) and this process's sys.path
    settings = {k: v for k, v in os.environ.items() if k.startswith("FLWR_INCA_")}
    settings[ENV_CONFIG] = os.environ[ENV_CONFIG]
    try:  # a local Ray, or the cluster RAY_ADDRESS names; Flower's engine then runs on it
        connect_ray(None, num_cpus=os.cpu_count() or 2,
                    env_vars={**settings, "PYTHONPATH": os.pathsep.join(sys.path)})
    except (ConnectionError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from flwr.simulation import run_simulation

    from .client_app import app as client_app
    from .server_app import BUDGET_STOPS
    from .server_app import app as server_app

    flwr_logger = logging.getLogger("flwr")
    quiet = _HideRunSimulationDeprecation()
    flwr_logger.addFilter(quiet)
    BUDGET_STOPS.clear()
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes,
                       backend_config={"client_resources": {"num_cpus": 1}})
    finally:
        flwr_logger.removeFilter(quiet)
    for message in BUDGET_STOPS:  # the budget stopped training early: a script can tell by the exit status
        print(f"error: {message}", file=sys.stderr)
    return 1 if BUDGET_STOPS else 0


if __name__ == "__main__":
    sys.exit(main())
