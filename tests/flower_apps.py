"""ClientApp and helpers for the end-to-end tests (importable by Ray workers)."""

from __future__ import annotations

import os
import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_inca.flower import IncaClient
from flwr_inca.flower.wire import FIELD, peek_request

FIXED_SEED = 11
SLEEP = 4.0  # seconds a "timed out" node stays silent (> the strategy's exchange_timeout)


def local_update(arrays: list[np.ndarray], pid: int, rnd: int) -> list[np.ndarray]:
    """The deterministic 'training' of partition ``pid`` in round ``rnd`` (float32, like a model)."""
    rng = np.random.default_rng([pid, rnd])
    return [(a + rng.normal(0.0, 0.3, a.shape)).astype(a.dtype) for a in arrays]


def faults(msg: Message, context: Context, call_next):
    """Client mod injecting failures listed in INCA_TEST_FAULTS="pid:round:commit:kind;...".

    kind = error (raise) or timeout (sleep past the exchange timeout) during a mixing exchange.
    """
    if msg.metadata.message_type == "train.inca_mix":
        rnd, commit, _ = peek_request(msg.content.config_records["inca"][FIELD])
        key = (int(context.node_config["partition-id"]), rnd, commit)
        for item in filter(None, os.environ.get("INCA_TEST_FAULTS", "").split(";")):
            pid, rnd, commit, kind = item.split(":")
            if (int(pid), int(rnd), int(commit)) == key:
                if kind == "error":
                    raise RuntimeError(f"injected failure at {key}")
                time.sleep(SLEEP)
    return call_next(msg, context)


client = ClientApp(mods=[faults])
inca = IncaClient(client, insecure_fixed_seed=FIXED_SEED)


secure_client = ClientApp()  # secrets from the OS CSPRNG, as in a deployment
secure_inca = IncaClient(secure_client)


@secure_inca.train()
@inca.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    new = local_update(msg.content["arrays"].to_numpy_ndarrays(), pid, rnd)
    return Message(RecordDict({"arrays": ArrayRecord(new),
                               "metrics": MetricRecord({"num-examples": 1, "partition-id": pid})}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "score": 1.0})}), reply_to=msg)
