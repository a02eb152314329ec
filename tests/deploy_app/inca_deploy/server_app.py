"""ServerApp: IncaStrategy for a few rounds; writes what happened to ``<out-dir>/run-<run id>.json``."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    nodes, out = int(cfg["nodes"]), Path(str(cfg["out-dir"]))
    handler = logging.FileHandler(out / f"server-{context.run_id}.log")  # the ServerApp's log, for the test
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logging.getLogger("flwr").addHandler(handler)
    deadline = time.monotonic() + 120
    while len(list(grid.get_node_ids())) < nodes and time.monotonic() < deadline:
        time.sleep(0.2)
    strategy = IncaStrategy(iterations=int(cfg["iterations"]), sigma_star=0.5, sigma_delta=2.0, clip_norm=1.0,
                            precision="float64", ledger_path=str(cfg["ledger-path"]), forward_client_metrics=True,
                            exchange_timeout=float(cfg["exchange-timeout"]), max_noise_inflation=float("inf"),
                            min_available_nodes=nodes, min_train_nodes=nodes, fraction_evaluate=0.0, seed=1,
                            fraction_train=float(cfg["fraction-train"]),
                            max_epsilon=float(cfg["max-epsilon"]) if float(cfg["max-epsilon"]) > 0 else None)
    resumed = strategy.ledger.rounds
    initial = ArrayRecord([np.zeros(6, dtype=np.float32)])
    stopped = None
    try:
        arrays = strategy.start(grid=grid, initial_arrays=initial, num_rounds=int(cfg["num-server-rounds"]),
                                timeout=float(cfg["join-timeout"])).arrays
    except IncaBudgetExhausted as stop:
        arrays = stop.arrays
        stopped = {"round": stop.round, "epsilon": stop.epsilon, "predicted": stop.predicted_epsilon}
    rounds = {}
    for rnd, record in strategy.rounds.items():
        partition = {node: int(m["partition-id"]) for node, m in record.client_metrics.items()}
        rounds[rnd] = {
            "roster": [partition[node] for node in record.roster],
            "finalists": [partition[record.roster[i]] for i in record.finalists],
            "online": record.trace.online_mask().astype(int).tolist() if record.trace else None,
            "failed": record.failed, "mu": record.mu, "epsilon": record.epsilon,
            "metrics": dict(strategy.train_metrics_serverapp.get(rnd, {})),
        }
    model = arrays.to_numpy_ndarrays()[0].tolist() if len(arrays) else None
    summary = {"run": context.run_id, "resumed": resumed, "rounds": rounds, "model": model, "stopped": stopped,
               "ledger": [e.to_dict() for e in strategy.ledger.entries]}
    tmp = out / f".run-{context.run_id}.json"
    tmp.write_text(json.dumps(summary, default=str))
    tmp.replace(out / f"run-{context.run_id}.json")
