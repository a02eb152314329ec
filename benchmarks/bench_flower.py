"""IncA mixing iterations vs Flower's own FedAvg exchange, paired, in one simulation (Ray backend).

For each number of nodes, one simulation runs two parts:

* **Paired iterations.** IncA rounds with T = 10 where, right before every mixing exchange, the same
  nodes do two FedAvg train exchanges (the global model of d = 7850 float32 parameters out, the
  "trained" model back): one through Flower's own ``Grid.send_and_receive`` (the floor named by the
  issue; it polls for replies every 0.1 s) and one through the push/pull loop IncaStrategy uses
  (polls every 10 ms at first, then every tenth of the exchange's age: a stricter floor; "10ms" in
  the tables). Each mixing exchange is compared with the FedAvg exchanges made just before it, so a change in the machine's load hits both sides of a ratio. Reported: the
  exchange (push to last reply, as for FedAvg) and the whole iteration on the server's clock (from
  one mixing exchange to the next, less the inserted FedAvg exchanges: relay bookkeeping, encoding
  and decoding included). Iterations 2..T are paired; the first exchange (roster, initialization)
  and the final report are per-round costs, covered by the second part.
* **Rounds of T = 2, 5 and 10 iterations**, interleaved, timed whole: a least-squares line
  round(T) = a + b T, its largest relative residual (how linear the round time is in T), and the
  slope b (the cost of one more iteration) over the median FedAvg exchange.

The ClientApp's "training" is a no-op perturbation, so both sides measure the protocol, not learning.

``--ablation`` instead runs only paired rounds, alternating node-side variants (noise drawn ahead
while joining, or during mixing) round by round, to show what it saves in the same simulation.
``--call-times`` also prints, per message type, the median time of one call as the simulation
engine sees it (submit to result, on the server) and the median time and CPU time of the ClientApp
handling it (on the node): where an exchange's time goes.

Flower's simulation engine hands pushed messages to the ClientApps in sweeps every 0.1 s, so an
exchange first waits 0 to 0.1 s for the next sweep, depending on when it is pushed. Left alone, that
wait depends on the server's work between exchanges, which differs between the two sides; so every
timed exchange (FedAvg and IncA) is pushed after a random pause of 0 to 0.1 s (not timed), making the
wait uniformly random on both sides, and the ratios compare means over many pairs.

    python benchmarks/bench_flower.py                     # 10, 50 and 100 nodes, 3 repeats
    python benchmarks/bench_flower.py --nodes 10 --repeats 1
    python benchmarks/bench_flower.py --nodes 100 --repeats 4 --ablation
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from flwr_inca.flower import IncaClient, IncaStrategy  # noqa: E402
from flwr_inca.flower.transport import send_and_receive  # noqa: E402

D = 7850  # MNIST logistic regression: 784 * 10 weights + 10 biases
PAIRED_T = 10
ROUND_TS = (2, 5, 10)
SWEEP = 0.1  # seconds between the simulation engine's sweeps for pushed messages
VARIANTS = {  # IncaClient settings compared by --ablation
    "default": {"noise_ahead_bytes": 64 * 2**20},
    "no noise ahead": {"noise_ahead_bytes": 0},
}

CALL_TIMES = "FLWR_INCA_BENCH_CALL_TIMES"  # directory where call times are appended, if set


def call_timer(msg: Message, context: Context, call_next):
    """Client mod: appends (message type, wall s, CPU s) of each call when CALL_TIMES is set."""
    where = os.environ.get(CALL_TIMES)
    if not where:
        return call_next(msg, context)
    wall, cpu = time.perf_counter(), time.thread_time()
    out = call_next(msg, context)
    with open(os.path.join(where, f"node-side-{os.getpid()}.txt"), "a") as fh:
        fh.write(f"{call_kind(msg)} {time.perf_counter() - wall} {time.thread_time() - cpu}\n")
    return out


def call_kind(msg: Message) -> str:
    kind = msg.metadata.message_type
    if kind == MessageType.TRAIN and "inca" in msg.content.config_records:
        return "train(IncA-join)"  # an IncA round's local training, not a FedAvg exchange
    return kind


client = ClientApp(mods=[call_timer])
inca = IncaClient(client)


@inca.train()
def train(msg: Message, context: Context) -> Message:
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    new = [a + np.float32(1e-3) for a in arrays]
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 1})}),
                   reply_to=msg)


def random_phase(rng: np.random.Generator) -> float:
    """Pause 0 to SWEEP seconds, so that the next push meets the engine's sweep at a random phase."""
    pause = rng.uniform(0.0, SWEEP)
    time.sleep(pause)
    return pause


class TimedIncaStrategy(IncaStrategy):
    """Times each mixing exchange (push to last reply) and each mixing iteration (one exchange to the
    next on the server's clock). Before every mixing exchange, ``floor()`` (if set) runs, then a
    random pause (:func:`random_phase`); both are left out of the iteration times."""

    def __init__(self, *, rng: np.random.Generator, floor: Callable[[], None] | None = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.floor, self.rng = floor, rng
        self.set_aside = 0.0  # seconds of floors and pauses within this strategy's rounds
        self.exchange_s: list[float] = []  # per mixing exchange, commit 1..T+1
        self.iteration_s: list[float] = []  # from exchange u to exchange u + 1, u = 1..T
        self._mark: float | None = None

    def start(self, *args, **kwargs):
        """``IncaStrategy.start`` with every mixing exchange of its rounds timed (the relay's
        ``MixingExchange`` calls, wrapped for the duration)."""
        from flwr_inca.flower import transport

        original = transport.MixingExchange.__call__

        def timed(exchange, commit, requests):
            if self._mark is not None:
                self.iteration_s.append(time.perf_counter() - self._mark)
            start = time.perf_counter()
            if self.floor is not None:
                self.floor()
            random_phase(self.rng)
            self._mark = time.perf_counter()
            self.set_aside += self._mark - start
            replies = original(exchange, commit, requests)
            self.exchange_s.append(time.perf_counter() - self._mark)
            return replies

        transport.MixingExchange.__call__ = timed
        try:
            return super().start(*args, **kwargs)
        finally:
            transport.MixingExchange.__call__ = original


def make_server(nodes: int, repeats: int, results: dict, ablation: bool = False,
                round_ts: tuple[int, ...] = ROUND_TS) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        while len(list(grid.get_node_ids())) < nodes:
            time.sleep(0.05)
        ids = sorted(grid.get_node_ids())
        model = ArrayRecord([np.zeros((10, 784), dtype=np.float32), np.zeros(10, dtype=np.float32)])
        poller = IncaStrategy(sigma_star=1.0, sigma_delta=1.0, ledger_path=None)  # its exchange loop
        flower_s: list[float] = []
        fast_s: list[float] = []
        rng = np.random.default_rng(nodes)

        def fedavg_exchange(fast: bool) -> float:
            content = RecordDict({"arrays": model, "config": ConfigRecord({"server-round": 1})})
            msgs = [Message(content, dst_node_id=int(i), message_type=MessageType.TRAIN) for i in ids]
            random_phase(rng)
            start = time.perf_counter()
            replies = (send_and_receive(grid, msgs, 600, poller.relay.poll_interval, poller.relay.max_poll_interval)
                       if fast
                       else list(grid.send_and_receive(msgs, timeout=600)))
            assert len(replies) == nodes and not any(r.has_error() for r in replies)
            return time.perf_counter() - start

        def floor() -> None:
            flower_s.append(fedavg_exchange(False))
            fast_s.append(fedavg_exchange(True))

        def inca_round(T: int, seed: int, paired: bool) -> TimedIncaStrategy:
            strategy = TimedIncaStrategy(rng=rng, floor=floor if paired else None, iterations=T,
                                         sigma_star=0.1,
                                         sigma_delta=1.0, min_available_nodes=nodes, min_train_nodes=nodes,
                                         fraction_evaluate=0.0, ledger_path=None, seed=seed)
            start = time.perf_counter()
            strategy.start(grid=grid, initial_arrays=model, num_rounds=1)
            strategy.round_s = time.perf_counter() - start - strategy.set_aside
            return strategy

        def paired_round(seed: int) -> list[tuple[float, float, float, float]]:
            flower_s.clear()
            fast_s.clear()
            s = inca_round(PAIRED_T, seed, paired=True)
            # floors run before exchanges 1..T+1; iteration u (u = 2..T) spans exchange u to u + 1
            return [(s.exchange_s[u - 1], s.iteration_s[u - 1], flower_s[u - 1], fast_s[u - 1])
                    for u in range(2, PAIRED_T + 1)]

        floor()  # warm up the actors
        if ablation:
            # the ClientApp (and its IncaClient) travels to the actors with every call, so settings
            # changed here apply from the next call on
            by_variant: dict[str, list] = {v: [] for v in VARIANTS}
            for rep in range(repeats):
                for name, settings in VARIANTS.items():
                    for key, value in settings.items():
                        setattr(inca, key, value)
                    by_variant[name] += paired_round(10 * rep + len(by_variant[name]))
                print(f"  {nodes} nodes: repeat {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
            for key, value in VARIANTS["default"].items():
                setattr(inca, key, value)
            results.update(variants=by_variant)
            return
        pairs, rounds = [], {T: [] for T in round_ts}
        for rep in range(repeats):
            pairs += paired_round(rep)
            for T in round_ts:
                rounds[T].append(inca_round(T, 1000 + rep, paired=False).round_s)
            print(f"  {nodes} nodes: repeat {rep + 1}/{repeats} done", file=sys.stderr, flush=True)
        results.update(pairs=pairs, rounds=rounds)

    return app


def ratio_of_means(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """mean(a) / mean(b) over pairs, with a 95% bootstrap interval (pairs resampled together)."""
    idx = rng.integers(0, len(a), size=(2000, len(a)))
    boot = a[idx].mean(axis=1) / b[idx].mean(axis=1)
    return float(a.mean() / b.mean()), float(np.quantile(boot, 0.025)), float(np.quantile(boot, 0.975))


def summarize_ablation(nodes: int, results: dict) -> str:
    rng = np.random.default_rng(0)
    lines = []
    for name, pairs in results["variants"].items():
        ex, it, flw, fast = (np.array(col) for col in zip(*pairs))
        cells = []
        for a in (ex, it):
            for b in (flw, fast):
                m, lo, hi = ratio_of_means(a, b, rng)
                cells.append(f"{m:>5.2f} [{lo:.2f}-{hi:.2f}]")
        lines.append(f"{nodes:>5} {name:<15} {ex.mean():>7.3f} {it.mean():>7.3f} " + " ".join(cells))
    return "\n".join(lines)


def summarize(nodes: int, results: dict) -> str:
    ex, it, flw, fast = (np.array(col) for col in zip(*results["pairs"]))
    rng = np.random.default_rng(0)
    med = {T: statistics.median(v) for T, v in results["rounds"].items()}
    Ts = np.array(sorted(med), dtype=float)
    times = np.array([med[int(T)] for T in Ts])
    slope, intercept = np.polyfit(Ts, times, 1)
    residual = np.max(np.abs(intercept + slope * Ts - times) / times)

    def r(a, b):
        m, lo, hi = ratio_of_means(a, b, rng)
        return f"{m:>5.2f} [{lo:.2f}-{hi:.2f}]"

    return (f"{nodes:>5} {flw.mean():>7.3f} {fast.mean():>7.3f} {ex.mean():>7.3f} {r(ex, flw)} {r(ex, fast)} "
            f"{it.mean():>7.3f} {r(it, flw)} {r(it, fast)} "
            + " ".join(f"{med[T]:>6.2f}" for T in sorted(med))
            + f" {slope:>6.3f} {slope / flw.mean():>5.2f} {intercept:>5.2f} {residual:>5.1%}")


@contextlib.contextmanager
def time_calls(where: str | None):
    """Record call times into ``where`` (None: do nothing): the server side by wrapping the Ray
    backend's ``process_message``, the node side through :func:`call_timer` (workers inherit the
    environment variable when the simulation starts Ray)."""
    if where is None:
        yield
        return
    from flwr.server.superlink.fleet.vce.backend import raybackend

    original = raybackend.RayBackend.process_message

    def process_message(self, message, context):
        start = time.perf_counter()
        out = original(self, message, context)
        with open(os.path.join(where, "server-side.txt"), "a") as fh:
            fh.write(f"{call_kind(message)} {time.perf_counter() - start} 0\n")
        return out

    raybackend.RayBackend.process_message = process_message
    os.environ[CALL_TIMES] = where
    try:
        yield
    finally:
        raybackend.RayBackend.process_message = original
        del os.environ[CALL_TIMES]


def summarize_calls(where: str) -> str:
    """Median per call and message type, in ms: server side (submit to result) and node side."""
    rows: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for name in os.listdir(where):
        side = "server" if name.startswith("server") else "node"
        with open(os.path.join(where, name)) as fh:
            for line in fh:
                kind, wall, cpu = line.split()
                rows.setdefault((kind, side), []).append((float(wall), float(cpu)))
    out = [f"      {'message type':<16} {'calls':>6} {'engine, submit to result':>25} "
           f"{'ClientApp wall':>15} {'ClientApp CPU':>14}   (medians, ms)"]
    for kind in sorted({k for k, _ in rows}):
        server = np.array(rows.get((kind, "server"), [(np.nan, 0.0)]))
        node = np.array(rows.get((kind, "node"), [(np.nan, np.nan)]))
        out.append(f"      {kind:<16} {len(server):>6} {1e3 * np.median(server[:, 0]):>25.2f} "
                   f"{1e3 * np.median(node[:, 0]):>15.2f} {1e3 * np.median(node[:, 1]):>14.2f}")
    return "\n".join(out)


def main() -> None:
    import logging

    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.WARNING)  # one line per node count, not per exchange
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 50, 100])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ablation", action="store_true", help="compare node-side variants (paired rounds only)")
    p.add_argument("--call-times", action="store_true", help="also print where a call's time goes")
    p.add_argument("--round-iterations", type=int, nargs="+", default=list(ROUND_TS),
                   help="T of the rounds timed whole (default 2 5 10; 40 is what iterations='auto' picks under "
                        "10%% expected dropouts)")
    args = p.parse_args()
    if args.repeats < 1 or min(args.nodes) < 2:
        p.error("--repeats must be >= 1 and every --nodes value >= 2")
    if len(set(args.round_iterations)) < 2 or min(args.round_iterations) < 1:
        p.error("--round-iterations must give at least two different T >= 1")
    if args.ablation:
        print(f"d = {D}, k = 1, float32 messages. Paired rounds of T = {PAIRED_T}, {args.repeats} per "
              "variant, "
              "variants interleaved; ratio of means [95% bootstrap interval] over iterations 2..T.\n")
        header = (f"{'nodes':>5} {'variant':<15} {'exch. s':>7} {'iter. s':>7} {'exchange/Flower':^19} "
                  f"{'exchange/10ms':^19} {'iteration/Flower':^19} {'iteration/10ms':^19}")
        print(header)
        print("-" * len(header))
    else:
        print(f"d = {D}, k = 1, float32 messages. Paired: {args.repeats} IncA round(s) of T = {PAIRED_T}, "
              f"iterations 2..{PAIRED_T} each against the FedAvg exchanges made just before them (means, "
              "seconds; ratio of "
              f"means [95% bootstrap interval]). Rounds of T = {tuple(args.round_iterations)} timed whole ({args.repeats} each, "
              "median), fit round(T) = a + b T.\n")
        print(f"{'':5} {'FedAvg exchange':^15} {'':7} {'IncA mixing exchange / FedAvg':^39} {'':7} "
              f"{'IncA mixing iteration / FedAvg':^39} {'round time by T':^20} {'fit a + b T':^25}")
        header = (f"{'nodes':>5} {'Flower':>7} {'10ms':>7} {'IncA':>7} {'Flower':^19} {'10ms':^19} "
                  f"{'IncA':>7} {'Flower':^19} {'10ms':^19} "
                  + " ".join(f"{'T=' + str(T):>6}" for T in sorted(args.round_iterations))
                  + f" {'b':>6} {'b/FA':>5} {'a':>5} {'resid':>5}")
        print(header)
        print("-" * len(header))
    for nodes in args.nodes:
        results: dict = {}
        with tempfile.TemporaryDirectory() as where, time_calls(where if args.call_times else None):
            server = make_server(nodes, args.repeats, results, args.ablation, tuple(sorted(set(args.round_iterations))))
            run_simulation(server_app=server, client_app=client, num_supernodes=nodes,
                           backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
            print((summarize_ablation if args.ablation else summarize)(nodes, results), flush=True)
            if args.call_times:
                print(summarize_calls(where), flush=True)


if __name__ == "__main__":
    main()
