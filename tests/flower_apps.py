"""ClientApps and helpers for the end-to-end tests (importable by Ray workers)."""

from __future__ import annotations

import os

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_inca.flower import IncaClient
from flwr_inca.flower.shared import INCA_KEY, MIX_ACTION
from flwr_inca.flower.wire import FIELD, peek_request

FIXED_SEED = 11
FAULTS_ENV = "INCA_TEST_FAULTS"  # "party:round:commit;..." mixing exchanges at which a node raises


def local_update(arrays: list[np.ndarray], pid: int, rnd: int) -> list[np.ndarray]:
    """The deterministic 'training' of partition ``pid`` in round ``rnd`` (float32, like a model)."""
    rng = np.random.default_rng([pid, rnd])
    return [(a + rng.normal(0.0, 0.3, a.shape)).astype(a.dtype) for a in arrays]


def faults(msg: Message, context: Context, call_next):
    """App-level mod: the node raises in the mixing exchanges listed in ``INCA_TEST_FAULTS``, by the
    party index the request is addressed to (the node's position in the round's roster)."""
    if msg.metadata.message_type == f"train.{MIX_ACTION}":
        key = peek_request(msg.content.config_records[INCA_KEY][FIELD])
        for item in filter(None, os.environ.get(FAULTS_ENV, "").split(";")):
            party, rnd, commit = (int(v) for v in item.split(":"))
            if (rnd, commit, party) == key:
                raise RuntimeError(f"injected failure at party {party}, round {rnd}, commit {commit}")
    return call_next(msg, context)


def tag(msg: Message, context: Context, call_next):
    """Function-level mod of the train function: marks its reply (forwarded metrics show it ran)."""
    reply = call_next(msg, context)
    for rec in reply.content.metric_records.values():
        rec["tagged"] = 1
    return reply


client = ClientApp(mods=[faults])
inca = IncaClient(client, insecure_fixed_seed=FIXED_SEED)


secure_client = ClientApp()  # secrets from the OS CSPRNG, as in a deployment
secure_inca = IncaClient(secure_client)


@secure_inca.train()
@inca.train(mods=[tag])
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    rnd = int(msg.content["config"]["server-round"])
    new = local_update(msg.content["arrays"].to_numpy_ndarrays(), pid, rnd)
    return Message(RecordDict({"arrays": ArrayRecord(new),
                               "metrics": MetricRecord({"num-examples": 1, "partition-id": pid})}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "score": 1.0})}), reply_to=msg)
