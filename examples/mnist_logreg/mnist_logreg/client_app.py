"""ClientApp: your usual Flower training code; IncaClient keeps the update on the node."""

from __future__ import annotations

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flwr_inca.flower import IncaClient

from .task import (
    accuracy,
    dp_step_record_level,
    load_config,
    load_data,
    make_model,
    partition,
    train_party_level,
)

app = ClientApp()
inca = IncaClient(app)  # <- IncA: registers the relayed mixing


@inca.train()  # <- IncA: instead of @app.train(); the function itself is unchanged
def train(msg: Message, context: Context) -> Message:
    cfg = load_config(context.run_config)
    data = load_data(cfg["data-dir"])
    x, y = partition(data, int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    model = make_model(data.features)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    if cfg["privacy-unit"] == "record":
        # the Poisson sample must stay secret: fresh OS entropy, never a fixed seed
        dp_step_record_level(model, x, y, float(cfg["lr"]), float(cfg["clip-norm"]), int(cfg["batch-size"]),
                             np.random.default_rng())
    else:
        round_ = int(msg.content["config"]["server-round"])
        train_party_level(model, x, y, cfg["local-epochs"], float(cfg["party-lr"]), seed=round_)
    return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                               "metrics": MetricRecord({"num-examples": len(y)})}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """The global model on this node's share of the test set."""
    cfg = load_config(context.run_config)
    data = load_data(cfg["data-dir"])
    pid, parts = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    share = np.array_split(np.arange(len(data.y_test)), parts)[pid]
    model = make_model(data.features)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loss, acc = accuracy(model, data.x_test[share], data.y_test[share])
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": len(share), "loss": loss, "accuracy": acc})}),
                   reply_to=msg)
