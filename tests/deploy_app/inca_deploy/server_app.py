"""ServerApp: IncaStrategy for a few rounds; writes what happened to ``<out-dir>/run-<run id>.json``."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Error, Message
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy

app = ServerApp()
DEAD_MARKER = "dead-node-"  # <out-dir>/dead-node-<node id>: the test killed that node's SuperNode


class DeadNodesAnswered(Grid):
    """The deployment's grid, except that a message to a node the test has killed (and reaped) is answered
    at once with the error Flower's SuperLink itself returns once the node's heartbeats have lapsed
    (``NODE_UNAVAILABLE``), instead of after those 30-60 s: the killed node drops out on that event, and
    the exchanges can wait for the live nodes as long as a loaded machine needs."""

    def __init__(self, grid: Grid, out: Path, release_log: str = "") -> None:
        self.grid, self.out, self.release_log = grid, out, release_log
        self.sent: dict[str, Message] = {}

    @property
    def run(self):
        return self.grid.run

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    def create_message(self, content, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        if self.release_log:  # the crash tests: what is about to leave, written durably first
            log_release(self.release_log, messages)
        ids = list(self.grid.push_messages(messages))
        self.sent.update(zip(ids, messages))
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        message_ids = list(message_ids)
        replies = list(self.grid.pull_messages(message_ids))
        answered = {r.metadata.reply_to_message_id for r in replies}
        dead = {int(p.name[len(DEAD_MARKER):]) for p in self.out.glob(f"{DEAD_MARKER}*")}
        for mid in message_ids:
            sent = self.sent.get(mid)
            if mid not in answered and sent is not None and sent.metadata.dst_node_id in dead:
                replies.append(Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="the test killed it"),
                                       reply_to=sent))
        return replies

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        pending = set(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending and (deadline is None or time.monotonic() < deadline):
            got = list(self.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(r.metadata.reply_to_message_id for r in got)
            if pending:
                time.sleep(0.05)
        return replies


def log_release(path: str, messages: list[Message]) -> None:
    """Append ``round commit`` of every mixing request in ``messages`` to ``path``, fsynced (the crash tests'
    release log, tests/crash_app.py, uses it too)."""
    from flwr_inca.flower.shared import INCA_KEY
    from flwr_inca.flower.wire import FIELD, peek_request

    lines = set()
    for msg in messages:
        record = msg.content.config_records.get(INCA_KEY) if msg.has_content() else None
        if record is not None and FIELD in record:
            rnd, commit, _ = peek_request(record[FIELD])
            lines.add(f"{rnd} {commit}\n")
    if lines:
        with open(path, "a", encoding="utf-8") as fh:
            fh.writelines(sorted(lines))
            fh.flush()
            os.fsync(fh.fileno())


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    nodes, out = int(cfg["nodes"]), Path(str(cfg["out-dir"]))
    handler = logging.FileHandler(out / f"server-{context.run_id}.log")  # the ServerApp's log, for the test
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logging.getLogger("flwr").addHandler(handler)
    deadline = time.monotonic() + float(cfg["join-timeout"])
    while len(list(grid.get_node_ids())) < nodes and time.monotonic() < deadline:  # until they connect
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
        arrays = strategy.start(grid=DeadNodesAnswered(grid, out, str(cfg.get("release-log", ""))), initial_arrays=initial,
                                num_rounds=int(cfg["num-server-rounds"]),
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
