"""ClientApps and helpers for the end-to-end tests (importable by Ray workers)."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_inca.flower import IncaClient
from flwr_inca.flower.shared import INCA_KEY, MIX_ACTION
from flwr_inca.flower.wire import FIELD, decode_reply, encode_reply, peek_request

FIXED_SEED = 11
FAULTS_ENV = "INCA_TEST_FAULTS"  # "party:round:commit;..." mixing exchanges at which a node raises
# a JSON file (written by the test's ServerApp, read at every message) of how nodes misbehave:
# {"join": {"<partition>": kind}, "nan": [partitions], "final": {"<round>:<partition>": kind}}
HOSTILE_ENV = "INCA_TEST_HOSTILE"


def on_the_session_cluster(ray_address: str) -> dict:
    """Joins this process to the test session's Ray cluster (conftest's ``ray_cluster``, 2 CPUs) and returns
    the ``backend_config`` of a ``run_simulation`` that uses it: Flower's Ray backend then runs its actors
    there (one per CPU) instead of starting and stopping a Ray of its own, and disconnects at the end. The
    cluster's workers were not started from this process, so the job passes them what they would otherwise
    inherit: ``sys.path`` (these apps) and the nodes' settings (``INCA_TEST_*``, ``FLWR_INCA_*``)."""
    import ray

    from flwr_inca.simulation.backend import connect_ray

    env = {k: v for k, v in os.environ.items() if k.startswith(("INCA_TEST_", "FLWR_INCA_"))}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if ray.is_initialized():  # left connected by a test that failed: its job's settings are not this run's
        ray.shutdown()
    connect_ray(ray_address, env_vars=env)
    return {"client_resources": {"num_cpus": 1}}


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


def _plan() -> dict:
    path = os.environ.get(HOSTILE_ENV)
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def hostile(msg: Message, context: Context, call_next):
    """App-level mod: the node's replies misbehave as the plan in ``INCA_TEST_HOSTILE`` says. Join replies:
    ``no-key``, ``str-key``, ``long-key`` (33 bytes), ``wrong-dim``; final messages: ``huge`` (times
    1e300, finite), ``negative-omega``."""
    plan = _plan()
    reply = call_next(msg, context)
    if not plan or reply.has_error() or INCA_KEY not in reply.content.config_records:
        return reply
    pid, record = str(context.node_config["partition-id"]), reply.content.config_records[INCA_KEY]
    if msg.metadata.message_type == f"train.{MIX_ACTION}" and FIELD in record:
        rnd, _, party = peek_request(msg.content.config_records[INCA_KEY][FIELD])
        kind = plan.get("final", {}).get(f"{rnd}:{pid}")
        rep, keeps = decode_reply(record[FIELD], party)
        if kind and rep.final is not None:
            if kind == "huge":
                rep.final = rep.final * 1e300
            elif kind == "negative-omega":
                rep.final_omega = -rep.final_omega
            record[FIELD] = encode_reply(rep, keeps)
    elif "public-key" in record:
        kind = plan.get("join", {}).get(pid)
        if kind == "no-key":
            del record["public-key"]
        elif kind == "str-key":
            record["public-key"] = "a public key"
        elif kind == "long-key":
            record["public-key"] = record["public-key"] + b"\x00"
        elif kind == "wrong-dim":
            record["dim"] = int(record["dim"]) + 1
    return reply


def tag(msg: Message, context: Context, call_next):
    """Function-level mod of the train function: marks its reply (forwarded metrics show it ran)."""
    reply = call_next(msg, context)
    for rec in reply.content.metric_records.values():
        rec["tagged"] = 1
    return reply


client = ClientApp(mods=[faults])
inca = IncaClient(client, insecure_fixed_seed=FIXED_SEED)


secure_client = ClientApp(mods=[hostile])  # secrets from the OS CSPRNG, as in a deployment
secure_inca = IncaClient(secure_client)


@secure_inca.train()
@inca.train(mods=[tag])
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    config = msg.content["config"]
    rnd = int(config["server-round"])
    new = local_update(msg.content["arrays"].to_numpy_ndarrays(), pid, rnd)
    if pid in _plan().get("nan", []):
        new = [np.full_like(a, np.nan) for a in new]
    metrics = MetricRecord({"num-examples": 1, "partition-id": pid})
    if int(config.get("omit-num-examples", -1)) == pid:  # metrics that FedAvg's aggregation cannot weigh
        del metrics["num-examples"]
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": metrics}), reply_to=msg)


@client.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 1, "score": 1.0})}), reply_to=msg)
