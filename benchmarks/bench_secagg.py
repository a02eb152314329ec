"""Why not Flower's own SecAgg+? IncA (IncaStrategy) vs SecAgg+ with Gaussian noise, side by side.

The paper's Fig. 4 compares IncA's cost with secure aggregation in a network simulator. In Flower the
alternative is in the box: ``SecAggPlusWorkflow`` (legacy ServerApp workflow API) with each node adding
Gaussian noise to its clipped update, so that the sum of the noise shares is the central-DP noise
(distributed DP, what users build today). Both run here in one Flower simulation per node count, rounds
interleaved (SecAgg+, IncA, then IncA, SecAgg+, ...), on the same nodes and the same "trained" updates:

* time per round on the server's clock (SecAgg+: its four stages, unmasking and aggregation; IncA:
  ``IncaStrategy.start(num_rounds=1)``: joining, T + 1 relayed mixing exchanges, the final report and
  the round's exact certificate);
* bytes of every message through the server (the serialized Flower message), per node (sent +
  received) and in total;
* a fraction of the nodes failing mid-round (SecAgg+: after sharing keys, before sending the masked
  vector, so their masks must be recovered; IncA: from the middle of the mixing on);
* the error of the new model against the plain mean of the surviving nodes' updates, and what each
  guarantees against a curious server with 10% of the nodes colluding.

Both sides target (epsilon, delta) = (1, 1e-5) per round for updates clipped to C = 1 (replace-one,
sensitivity 2C), planning for 10% colluders and 10% failures: SecAgg+'s nodes each add
``N(0, sigma^2 / n_O)`` with ``sigma = 2C / mu(epsilon, delta)`` and n_O = n (1 - 0.1 - 0.1) honest
survivors; IncA's sigmas come from ``flwr_inca.privacy.calibrate`` for the same threat and failures.

    python benchmarks/bench_secagg.py                         # n = 20, 50, 100; 0% and 10% failing
    python benchmarks/bench_secagg.py --nodes 20 --repeats 1
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

import flwr.compat.common.recorddict_compat as compat
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.serde import message_to_proto, recorddict_to_proto
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_PARAMS_RECORD
from flwr.serverapp import Grid, ServerApp
from scipy.stats import hypergeom

from flwr_inca.flower import IncaClient, IncaStrategy
from flwr_inca.privacy import calibrate, epsilon_for_delta, mu_for_epsilon
from flwr_inca.privacy.views import coalition_size
from flwr_inca.protocol import PermanentDropout

D = 7850  # MNIST logistic regression: 784 * 10 weights + 10 biases
CLIP, EPSILON, DELTA = 1.0, 1.0, 1e-5
RHO, GAMMA = 0.1, 0.1  # planned colluders and failures
ITERATIONS = 20
SHARES, THRESHOLD = 15, 8  # SecAgg+: each node's secrets shared with 14 ring neighbours, 8 to recover
UPDATE_NORM = 0.5


def update_of(pid: int) -> np.ndarray:
    """The deterministic 'training' of node ``pid``: an update of norm 0.5 (below the clip)."""
    u = np.random.default_rng([pid, 7]).standard_normal(D)
    return UPDATE_NORM * u / np.linalg.norm(u)


def _fail_ids(content: RecordDict, key: str) -> set[int]:
    raw = str(content.config_records[key].get("fail-ids", "")) if key in content.config_records else ""
    return {int(v) for v in raw.split(",") if v}


def failures(msg: Message, ctxt: Context, call_next):
    """Client mod: nodes listed in the round's ``fail-ids`` fail mid-round (see the module docstring)."""
    pid = int(ctxt.node_config["partition-id"])
    content, kind = msg.content, msg.metadata.message_type
    if kind == MessageType.TRAIN and RECORD_KEY_CONFIGS in content.config_records:
        stage = content.config_records[RECORD_KEY_CONFIGS].get(Key.STAGE)
        if stage == Stage.COLLECT_MASKED_VECTORS and pid in _fail_ids(content, "fitins.config"):
            raise RuntimeError("injected failure: before sending the masked vector")
    elif kind == MessageType.TRAIN and "inca" in content.config_records:  # joining an IncA round
        ctxt.state["bench-fail"] = ConfigRecord({"fail": int(pid in _fail_ids(content, "config")), "mixes": 0})
    elif kind.endswith(".inca_mix") and "bench-fail" in ctxt.state.config_records:
        state = ctxt.state.config_records["bench-fail"]
        state["mixes"] = int(state["mixes"]) + 1
        if state["fail"] and state["mixes"] > ITERATIONS // 2:
            raise RuntimeError("injected failure: from the middle of the mixing on")
    return call_next(msg, ctxt)


def secagg_only(msg: Message, ctxt: Context, call_next):
    """Route SecAgg+ messages through Flower's ``secaggplus_mod``; IncA's go straight to the app."""
    if msg.metadata.message_type == MessageType.TRAIN and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, ctxt, call_next)
    return call_next(msg, ctxt)


client = ClientApp(mods=[failures, secagg_only])
inca = IncaClient(client)


@inca.train()
def train(msg: Message, context: Context) -> Message:
    pid = int(context.node_config["partition-id"])
    if "fitins.parameters" in msg.content.array_records:  # SecAgg+ (legacy FitIns): clip, add noise
        fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
        params = parameters_to_ndarrays(fitins.parameters)
        noise = float(fitins.config["noise-std"]) * np.random.default_rng().standard_normal(D)
        flat = np.concatenate([p.reshape(-1) for p in params]) + update_of(pid) + noise
        new = [flat[:7840].reshape(10, 784).astype(np.float32), flat[7840:].astype(np.float32)]
        res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(new), 1, {})
        return Message(compat.fitres_to_recorddict(res, keep_input=True), reply_to=msg)
    arrays = msg.content["arrays"].to_numpy_ndarrays()  # IncA: the new model; the node clips and mixes
    u = update_of(pid)
    new = [arrays[0] + u[:7840].reshape(10, 784).astype(np.float32), arrays[1] + u[7840:].astype(np.float32)]
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 1})}),
                   reply_to=msg)


def message_bytes(msg: Message) -> int:
    try:
        return message_to_proto(msg).ByteSize()
    except (AttributeError, TypeError, ValueError):  # a message without full metadata: its content
        return recorddict_to_proto(msg.content).ByteSize()


class CountingGrid(Grid):
    """Delegates to Flower's grid and counts the bytes of every message through the server."""

    def __init__(self, inner: Grid) -> None:
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.down: dict[int, int] = defaultdict(int)  # server -> node
        self.up: dict[int, int] = defaultdict(int)  # node -> server

    def _out(self, messages: Iterable[Message]) -> list[Message]:
        messages = list(messages)
        for m in messages:
            self.down[int(m.metadata.dst_node_id)] += message_bytes(m)
        return messages

    def _in(self, replies: Iterable[Message]) -> list[Message]:
        replies = list(replies)
        for m in replies:
            self.up[int(m.metadata.src_node_id)] += message_bytes(m)
        return replies

    def set_run(self, run):
        self.inner.set_run(run)

    @property
    def run(self):
        return self.inner.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return self.inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def push_messages(self, messages):
        return self.inner.push_messages(self._out(messages))

    def pull_messages(self, message_ids):
        return self._in(self.inner.pull_messages(message_ids))

    def send_and_receive(self, messages, *, timeout=None):
        return self._in(self.inner.send_and_receive(self._out(messages), timeout=timeout))


class TimedSecAggPlus(SecAggPlusWorkflow):
    def __call__(self, grid, context) -> None:
        start = time.perf_counter()
        super().__call__(grid, context)
        self.seconds = time.perf_counter() - start


def secagg_noise_std(n: int) -> float:
    """Each node's noise: the honest survivors' shares add up to the central-DP noise of the sum."""
    n_o = n * (1 - GAMMA - RHO)
    return 2 * CLIP / mu_for_epsilon(EPSILON, DELTA) / math.sqrt(n_o)


def secagg_guarantee(n: int, failed: int) -> tuple[float, float]:
    """(epsilon of the aggregate against the server + ceil(0.1 n) colluders who know their own noise,
    probability per round (union bound over the honest nodes) that some honest node's secrets are
    recoverable by the colluders, exposing its update with only its own noise share). Colluders among
    the survivors, in expectation."""
    n_c = coalition_size(RHO, n)
    honest_survivors = (n - failed) * (n - n_c) / n
    mu = 2 * CLIP / (math.sqrt(honest_survivors) * secagg_noise_std(n))
    k = min(SHARES, n) - 1  # the other holders of a node's shares
    per_node = hypergeom(n - 1, n_c, k).sf(THRESHOLD - 1)  # >= THRESHOLD colluders among them
    return epsilon_for_delta(mu, DELTA), min(1.0, (n - n_c) * per_node)


def make_server(nodes: int, repeats: int, fail_fractions: list[float], sigmas: tuple[float, float],
                results: list) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(list(grid.get_node_ids())) < nodes:
            time.sleep(0.05)
        counting = CountingGrid(grid)
        zeros = [np.zeros((10, 784), dtype=np.float32), np.zeros(10, dtype=np.float32)]
        rng = np.random.default_rng(nodes)
        pids = list(range(nodes))

        def truth(fail: set[int]) -> np.ndarray:
            return np.mean([update_of(p) for p in pids if p not in fail], axis=0)

        def secagg_round(fail: set[int]) -> dict:
            fail_s = ",".join(map(str, sorted(fail)))
            strategy = LegacyFedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=nodes,
                                    min_available_clients=nodes, initial_parameters=ndarrays_to_parameters(zeros),
                                    on_fit_config_fn=lambda rnd: {"fail-ids": fail_s,
                                                                  "noise-std": secagg_noise_std(nodes)})
            legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=1), strategy=strategy)
            sa = TimedSecAggPlus(num_shares=min(SHARES, nodes), reconstruction_threshold=THRESHOLD,
                                 clipping_range=CLIP + 8 * secagg_noise_std(nodes), timeout=120)
            counting.reset()
            DefaultWorkflow(fit_workflow=sa)(counting, legacy)
            new = compat.arrayrecord_to_parameters(legacy.state.array_records[MAIN_PARAMS_RECORD], keep_input=True)
            flat = np.concatenate([a.reshape(-1) for a in parameters_to_ndarrays(new)])
            eps, exposure = secagg_guarantee(nodes, len(fail))
            return {"protocol": "SecAgg+", "seconds": sa.seconds, "rmse": float(np.sqrt(np.mean((flat - truth(fail)) ** 2))),
                    "noise_std": secagg_noise_std(nodes) / math.sqrt(nodes - len(fail)), "epsilon": eps,
                    "exposure": exposure, **_bytes(counting)}

        def inca_round(fail: set[int], seed: int) -> dict:
            strategy = IncaStrategy(iterations=ITERATIONS, neighbors=1, sigma_star=sigmas[0], sigma_delta=sigmas[1],
                                    delta=DELTA, clip_norm=CLIP, collusion=RHO, min_available_nodes=nodes,
                                    min_train_nodes=nodes, fraction_evaluate=0.0, ledger_path=None, seed=seed,
                                    exchange_timeout=120)
            counting.reset()
            start = time.perf_counter()
            res = strategy.start(grid=counting, initial_arrays=ArrayRecord(zeros), num_rounds=1,
                                 train_config=ConfigRecord({"fail-ids": ",".join(map(str, sorted(fail)))}))
            seconds = time.perf_counter() - start
            m = res.train_metrics_clientapp[1]
            flat = np.concatenate([a.reshape(-1) for a in res.arrays.to_numpy_ndarrays()])
            return {"protocol": "IncA", "seconds": seconds, "rmse": float(np.sqrt(np.mean((flat - truth(fail)) ** 2))),
                    "noise_std": float(m["inca-noise-std"]), "epsilon": float(m["inca-epsilon"]), "exposure": 0.0,
                    "finalists": int(m["inca-finalists"]), **_bytes(counting)}

        secagg_round(set())  # warm up the actors and both code paths (not timed)
        inca_round(set(), 999)
        for rep in range(repeats):
            for frac in fail_fractions:
                fail = set(rng.choice(pids, size=round(frac * nodes), replace=False).tolist())
                order = (secagg_round, inca_round) if rep % 2 == 0 else (inca_round, secagg_round)
                for fn in order:
                    row = fn(fail) if fn is secagg_round else fn(fail, 100 * rep + int(100 * frac))
                    results.append({"nodes": nodes, "failing": frac, "rep": rep, **row})
            print(f"  {nodes} nodes: repeat {rep + 1}/{repeats} done", file=sys.stderr, flush=True)

    return app


def _bytes(counting: CountingGrid) -> dict:
    per_node = [counting.down[k] + counting.up[k] for k in set(counting.down) | set(counting.up)]
    return {"node_mb": float(np.mean(per_node)) / 1e6, "node_mb_max": float(np.max(per_node)) / 1e6,
            "server_mb": float(sum(per_node)) / 1e6}


def summarize(rows: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["nodes"], r["failing"], r["protocol"])].append(r)
    header = (f"{'nodes':>5} {'failing':>7} {'protocol':>8} {'s/round':>8} {'MB/node':>8} {'MB server':>9} "
              f"{'rmse':>8} {'noise std':>9} {'epsilon':>8} {'P(exposed)':>10}")
    lines = [header, "-" * len(header)]
    for (n, f, p), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] != "SecAgg+")):
        med = {k: statistics.median(r[k] for r in rs) for k in ("seconds", "node_mb", "server_mb", "rmse",
                                                                   "noise_std", "epsilon", "exposure")}
        lines.append(f"{n:>5} {f:>7.0%} {p:>8} {med['seconds']:>8.2f} {med['node_mb']:>8.3f} {med['server_mb']:>9.2f} "
                     f"{med['rmse']:>8.4f} {med['noise_std']:>9.4f} {med['epsilon']:>8.3f} {med['exposure']:>10.2g}")
    by = {(r["nodes"], r["failing"]): {} for r in rows}
    for (n, f, p), rs in groups.items():
        by[(n, f)][p] = statistics.median(r["seconds"] for r in rs)
    lines.append("")
    lines.append("time ratio IncA / SecAgg+ (medians): " + ", ".join(
        f"n={n} {f:.0%}: {v['IncA'] / v['SecAgg+']:.2f}" for (n, f), v in sorted(by.items())))
    return "\n".join(lines)


def main() -> None:
    import logging

    from flwr.simulation import run_simulation

    p_args = sys.argv[1:]
    # the injected failures make Flower log a traceback each; --verbose shows them
    logging.getLogger("flwr").setLevel(logging.WARNING if "--verbose" in p_args else logging.CRITICAL)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[20, 50, 100])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--failing", type=float, nargs="+", default=[0.0, 0.1])
    p.add_argument("--calibration-runs", type=int, default=30)
    p.add_argument("--verbose", action="store_true", help="show Flower's logs (a traceback per injected failure)")
    args = p.parse_args()
    if args.repeats < 1 or min(args.nodes) < SHARES or not all(0 <= f < 0.5 for f in args.failing):
        p.error(f"--repeats must be >= 1, every --nodes value >= {SHARES} (SecAgg+ shares), --failing in [0, 0.5)")
    print(f"d = {D}, clip C = {CLIP}, target ({EPSILON}, {DELTA:g}) per round against {RHO:.0%} colluders and "
          f"{GAMMA:.0%} planned failures; IncA k = 1, T = {ITERATIONS}; SecAgg+ {SHARES} shares, threshold "
          f"{THRESHOLD}; {args.repeats} round(s) per cell, interleaved; medians.\n")
    rows: list[dict] = []
    for nodes in args.nodes:
        cal = calibrate(EPSILON, DELTA, nodes, iterations=ITERATIONS, neighbors=1, collusion=RHO,
                        dropout=PermanentDropout(GAMMA), value_sensitivity=2 * CLIP, runs=args.calibration_runs,
                        seed=nodes)
        server = make_server(nodes, args.repeats, args.failing, (cal.sigma_star, cal.sigma_delta), rows)
        run_simulation(server_app=server, client_app=client, num_supernodes=nodes,
                       backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    print(summarize(rows), flush=True)


if __name__ == "__main__":
    main()
