"""ClientApp: a deterministic 'training' step, IncA's join and mixing, and a mod that tells the test
when a chosen node reaches a chosen mixing exchange (then blocks there until the test kills it)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_inca.flower import IncaClient
from flwr_inca.flower.shared import INCA_KEY, MIX_ACTION
from flwr_inca.flower.wire import FIELD, peek_request


def stop_here(msg: Message, context: Context, call_next):
    """In the mixing exchange of (kill-round, kill-commit), the node of partition kill-partition writes
    ``<out-dir>/reached-node-<node id>`` and blocks: the test SIGKILLs its SuperNode in the middle of
    mixing."""
    cfg = context.run_config
    if msg.metadata.message_type == f"train.{MIX_ACTION}" \
            and int(context.node_config["partition-id"]) == int(cfg["kill-partition"]):
        rnd, commit, _ = peek_request(msg.content.config_records[INCA_KEY][FIELD])
        if (rnd, commit) == (int(cfg["kill-round"]), int(cfg["kill-commit"])):
            marker = Path(str(cfg["out-dir"])) / f"reached-node-{context.node_id}"
            marker.write_text(f"{rnd} {commit} {os.getpid()}\n")
            threading.Event().wait()  # until the test kills this process
    return call_next(msg, context)


app = ClientApp(mods=[stop_here])
inca = IncaClient(app)


@inca.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    rng = np.random.default_rng([pid, rnd])
    new = [(a + rng.normal(0.0, 0.3, a.shape)).astype(a.dtype) for a in msg.content["arrays"].to_numpy_ndarrays()]
    return Message(RecordDict({"arrays": ArrayRecord(new),
                               "metrics": MetricRecord({"num-examples": 1, "partition-id": pid})}), reply_to=msg)
