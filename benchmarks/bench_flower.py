"""IncA round vs Flower's own FedAvg exchange, side by side in one simulation (Ray backend).

For each number of nodes, one simulation runs, interleaved: FedAvg train exchanges (the global model
of d = 7850 float32 parameters out, the "trained" model back: Flower's own round trip, the floor) and
IncA rounds with T = 5 and T = 10 mixing iterations. The ClientApp's "training" is a no-op
perturbation, so both sides measure the protocol, not the learning. Reported: time per FedAvg
exchange (through Flower's ``send_and_receive``, which polls every 0.1 s, and through the same
push/pull loop polling every 10 ms that IncaStrategy uses), time per IncA mixing exchange (push to last
reply, as for FedAvg; the first exchange of a round, which also distributes the roster and initializes
the parties, is reported apart), the ratios, IncA's per-round time for each T and the marginal cost of
one more iteration, (round(T=10) - round(T=5)) / 5, with its ratio to a FedAvg exchange.

    python benchmarks/bench_flower.py                 # 10, 50 and 100 nodes
    python benchmarks/bench_flower.py --nodes 10 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from flwr_inca.flower import IncaClient, IncaStrategy  # noqa: E402

D = 7850  # MNIST logistic regression: 784 * 10 weights + 10 biases

client = ClientApp()
inca = IncaClient(client)


@inca.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    new = [a + np.float32(1e-3) for a in arrays]
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 1})}),
                   reply_to=msg)


class TimedIncaStrategy(IncaStrategy):
    """Times each mixing exchange exactly as FedAvg's is timed: push until the last reply."""

    exchange_seconds: list[float]

    def _send_and_receive(self, grid, messages, timeout):
        start = time.perf_counter()
        out = super()._send_and_receive(grid, messages, timeout)
        if messages and messages[0].metadata.message_type.endswith(".inca_mix"):
            self.exchange_seconds.append(time.perf_counter() - start)
        return out


def make_server(nodes: int, repeats: int, results: dict) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(list(grid.get_node_ids())) < nodes:
            time.sleep(0.05)
        ids = sorted(grid.get_node_ids())
        model = ArrayRecord([np.zeros((10, 784), dtype=np.float32), np.zeros(10, dtype=np.float32)])

        poller = IncaStrategy(sigma_star=1.0, sigma_delta=1.0, ledger_path=None)  # its fast exchange loop

        def fedavg_exchange(fast: bool) -> float:
            content = RecordDict({"arrays": model, "config": ConfigRecord({"server-round": 1})})
            msgs = [Message(content, dst_node_id=int(i), message_type=MessageType.TRAIN) for i in ids]
            start = time.perf_counter()
            if fast:
                replies = poller._send_and_receive(grid, msgs, 600)
            else:
                replies = list(grid.send_and_receive(msgs, timeout=600))
            assert len(replies) == nodes and not any(r.has_error() for r in replies)
            return time.perf_counter() - start

        fedavg_exchange(False)  # warm up the actors
        fed, fast, mix, first, rounds = [], [], [], [], {5: [], 10: []}
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(repeats):
                for T in (5, 10):
                    fed += [fedavg_exchange(False) for _ in range(3)]
                    fast += [fedavg_exchange(True) for _ in range(3)]
                    strategy = TimedIncaStrategy(iterations=T, sigma_star=0.1, sigma_delta=1.0,
                                                 min_available_nodes=nodes, min_train_nodes=nodes,
                                                 fraction_evaluate=0.0, ledger_path=None, seed=rep)
                    strategy.exchange_seconds = []
                    start = time.perf_counter()
                    strategy.start(grid=grid, initial_arrays=model, num_rounds=1)
                    rounds[T].append(time.perf_counter() - start)
                    first.append(strategy.exchange_seconds[0])  # carries the roster, initializes
                    mix += strategy.exchange_seconds[1:T]  # the other mixing exchanges (not the final report)
        results.update(fedavg=fed, fast=fast, mix=mix, first=first, rounds=rounds)

    return app


def main() -> None:
    import logging

    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.WARNING)  # one line per node count, not per exchange
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 50, 100])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print(f"d = {D}, k = 1, medians over interleaved repeats ({args.repeats} x 3 FedAvg exchanges, "
          f"{args.repeats} IncA rounds per T)\n")
    header = (f"{'nodes':>5} {'FedAvg exch. s':>15} {'same, 10ms poll':>16} {'IncA mix exch. s':>17} "
              f"{'ratio':>6} {'ratio (10ms)':>13} {'1st IncA exch. s':>17} {'round T=5 s':>12} "
              f"{'round T=10 s':>13} {'(T10-T5)/5 s':>13} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for nodes in args.nodes:
        results: dict = {}
        run_simulation(server_app=make_server(nodes, args.repeats, results), client_app=client,
                       num_supernodes=nodes,
                       backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
        fed, mix = statistics.median(results["fedavg"]), statistics.median(results["mix"])
        fast = statistics.median(results["fast"])
        r5, r10 = statistics.median(results["rounds"][5]), statistics.median(results["rounds"][10])
        first = statistics.median(results["first"])
        marginal = (r10 - r5) / 5
        print(f"{nodes:>5} {fed:>15.3f} {fast:>16.3f} {mix:>17.3f} {mix / fed:>6.2f} {mix / fast:>13.2f} "
              f"{first:>17.3f} {r5:>12.2f} {r10:>13.2f} {marginal:>13.3f} {marginal / fed:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
