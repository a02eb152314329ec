"""Plain Python entry point (no Flower CLI, works offline): ``python -m mnist_logreg.run --help``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .task import DEFAULTS, ENV_CONFIG


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="IncA on MNIST through Flower's simulation engine")
    parser.add_argument("--num-supernodes", type=int, default=DEFAULTS["num-partitions"])
    for key, value in DEFAULTS.items():
        if key != "num-partitions":
            parser.add_argument(f"--{key}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    nodes = args.pop("num_supernodes")
    if nodes < 2:
        parser.error("--num-supernodes must be >= 2")
    config = {k.replace("_", "-"): v for k, v in args.items()}
    os.environ[ENV_CONFIG] = json.dumps(config)  # read by the apps (also in Ray workers)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    from flwr.simulation import run_simulation

    from .client_app import app as client_app
    from .server_app import app as server_app

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": os.cpu_count() or 2}})


if __name__ == "__main__":
    sys.exit(main())
