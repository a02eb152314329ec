"""A ServerApp run the crash tests kill, fill the disk under, or run twice at once (a script for a child
process: ``python crash_app.py <ledger> <log> <rounds> [max_epsilon] [engine]``).

Every mixing request is logged to ``<log>`` (``round commit`` per line, flushed and fsynced) *before* the
grid delivers it: what the log holds was released, or is about to be. ``engine`` is ``inprocess`` (the
real ClientApp in this process: tests/inprocess_grid.py) or ``simulation`` (Flower's simulation engine).
"""

from __future__ import annotations

import functools
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "deploy_app"))

N, T = 6, 3
SETTINGS = dict(iterations=T, sigma_star=0.5, sigma_delta=3.0, precision="float64", seed=7, fraction_evaluate=0.0,
                min_available_nodes=N, min_train_nodes=N, exchange_timeout=60.0)


def released_logger(path: str):
    """A grid hook that appends ``round commit`` of every mixing request about to leave, durably (the
    deployment test app's log, so that both crash tests read one format)."""
    from inca_deploy.server_app import log_release

    return functools.partial(log_release, path)


class LoggingGrid:
    """Wraps a Flower Grid: logs what is about to leave (see :func:`released_logger`), then delivers it."""

    def __init__(self, grid, log) -> None:
        self.grid, self.log = grid, log

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def push_messages(self, messages):
        messages = list(messages)
        self.log(messages)
        return self.grid.push_messages(messages)

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.log(messages)
        return self.grid.send_and_receive(messages, timeout=timeout)


def strategy(ledger: str | None, max_epsilon: float | None):
    from flwr_inca.flower import IncaStrategy

    return IncaStrategy(**SETTINGS, ledger_path=ledger, max_epsilon=max_epsilon,
                        trace_dir=os.environ.get("CRASH_TRACE_DIR"))


def main(argv: list[str]) -> int:
    from flwr.app import ArrayRecord

    from flwr_inca.flower import IncaBudgetExhausted

    ledger, log, rounds = argv[0], argv[1], int(argv[2])
    max_epsilon = float(argv[3]) if len(argv) > 3 and argv[3] != "none" else None
    engine = argv[4] if len(argv) > 4 else "inprocess"
    initial = ArrayRecord([np.zeros(4, dtype=np.float32)])
    if engine == "inprocess":
        from flwr.supercore.task_identity import TaskIdentity

        import flower_apps
        from inprocess_grid import InProcessGrid

        for name, value in (("_run_id", 1), ("_node_id", 5), ("_task_id", 1)):
            setattr(TaskIdentity, name, value)
        grid = InProcessGrid(flower_apps.client, N, before_push=released_logger(log))
        barrier = os.environ.get("CRASH_START_FILE")  # start together with another run
        if barrier:
            print("ready", flush=True)
        while barrier and not os.path.exists(barrier):
            time.sleep(0.01)
        print("started", flush=True)
        try:
            strategy(ledger, max_epsilon).start(grid, initial, num_rounds=rounds)
        except IncaBudgetExhausted as stop:
            print(f"stopped: {stop}", flush=True)
        print("finished", flush=True)
        return 0
    import flower_apps
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            strategy(ledger, max_epsilon).start(LoggingGrid(grid, released_logger(log)), initial, num_rounds=rounds)
        except IncaBudgetExhausted as stop:
            print(f"stopped: {stop}", flush=True)
        print("finished", flush=True)

    print("started", flush=True)
    run_simulation(server_app=app, client_app=flower_apps.client, num_supernodes=N,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
