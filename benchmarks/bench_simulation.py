"""Benchmarks of the simulator (flwr_inca.simulation), each part printing a table and writing JSON.

    python benchmarks/bench_simulation.py main      # 1000 clients, 40 rounds, floors side by side
    python benchmarks/bench_simulation.py flower --clients 100 --rounds 5   # vs the Flower route
    python benchmarks/bench_simulation.py simulator --clients 100 --rounds 4  # its simulator side alone
    python benchmarks/bench_simulation.py p2pfl --nodes 10 50               # vs p2pfl (own venv)
    python benchmarks/bench_simulation.py scaling --clients 100 1000 10000
    python benchmarks/bench_simulation.py actors    # 1 vs 2 Ray actors
    python benchmarks/bench_simulation.py shard     # IncA engine sharded by coordinates across actors?
    python benchmarks/bench_simulation.py certify --parties 1000 2000 4000  # exact certificate cost

MNIST comes from ``--data-dir`` or ``$FLWR_INCA_MNIST_DIR``. Timings depend on the machine's load: each
part prints ``uptime`` beside its figures, and ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "mnist_logreg"
MAIN = dict(
    max_epsilon=1.0,
    delta=1e-5,
    neighbors=1,
    collusion=0.1,
    privacy_unit="record",
    lr=6.0,
    clip_norm=1.0,
    batch_size=50,
    calibration_runs=10,
    threat_draws=1,
)


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def _median(values):
    return float(np.median(values)) if len(values) else math.nan


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _table(rows, header):
    cells = [header] + [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _data(args):
    from flwr_inca.simulation import load_mnist

    data = load_mnist(args.data_dir)
    if not data.name.startswith("MNIST"):
        print(f"warning: benchmarking on {data.name}, not MNIST", file=sys.stderr)
    return data


def _simulate(data, clients, config, progress=False, on_round=None):
    from flwr_inca.simulation import iid, simulate
    from flwr_inca.simulation.mnist import ModelFactory

    parts = iid(data.x_train, data.y_train, clients)
    return simulate(
        ModelFactory("logreg", data.features, data.classes),
        parts,
        (data.x_test, data.y_test),
        config,
        progress=progress,
        on_round=on_round,
        dataset=data.name,
    )


def _breakdown(hist, skip_first=False):
    rounds = [r for r in hist.rounds if not r.failed][1 if skip_first else 0 :]
    keys = ["seconds", "seconds_train_wait", "seconds_mix", "seconds_plan", "seconds_charge", "seconds_eval"]
    out = {k: _median([getattr(r, k) for r in rounds]) for k in keys + ["seconds_train"]}
    out["seconds_other"] = _median([r.seconds - sum(getattr(r, k) for k in keys[1:]) for r in rounds])
    return out


# -------------------------------------------------------------------------------------------- main
def part_main(args):
    """1000 clients, record-level eps = 1, IncA at the defaults (iterations chosen for ``--dropout``,
    the recommended schedule), k = 1, 40 rounds; then each floor alone."""
    from flwr_inca.privacy import certify, random_collusion
    from flwr_inca.protocol import replay
    from flwr_inca.simulation import SimulationConfig, iid
    from flwr_inca.simulation.backend import RayBackend, WorkPlanner
    from flwr_inca.simulation.mnist import ModelFactory

    start = time.perf_counter()
    data = _data(args)
    out_dir = tempfile.mkdtemp(prefix="bench-sim-")
    config = SimulationConfig(rounds=args.rounds, backend="ray", num_actors=args.actors, output_dir=out_dir,
                              dropout=_dropout(args), iterations=args.iterations, **MAIN)
    plans = {}
    hist = _simulate(
        data, args.clients, config, progress=True, on_round=lambda c: plans.__setitem__(c.round, c.plan)
    )
    total = time.perf_counter() - start
    per_round = _breakdown(hist)

    # the floors, alone, in the same process right after the run (Ray is still up)
    parts = iid(data.x_train, data.y_train, args.clients)
    kwargs = dict(unit="record", lr=6.0, clip_norm=1.0, batch_size=50, party_clip=hist.plan["party_clip"])
    backend = RayBackend(
        ModelFactory("logreg", data.features, data.classes),
        parts,
        kwargs,
        num_actors=args.actors,
        address=None,
    )
    planner = WorkPlanner(
        parts,
        backend.cohorts,
        unit="record",
        sample_rate=hist.plan["sample_rate"],
        batch_size=50,
        local_steps=None,
        local_epochs=None,
        seed=0,
    )
    everyone = np.arange(args.clients)
    params = hist.parameters
    train_t = []
    for r in range(1, args.repeats + 1):
        works = planner.plan(r, everyone)
        t = time.perf_counter()
        updates = backend.train(params, everyone, works)
        train_t.append(time.perf_counter() - t)
    backend.close()
    last = plans[max(plans)]
    trace = last.trace
    engine_t, cert_t = [], []
    for r in range(args.repeats):
        t = time.perf_counter()
        replay(trace, updates, seed=r)
        engine_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        certify(trace, random_collusion(trace, 0.1, [r, 1]), value_sensitivity=hist.plan["value_sensitivity"])
        cert_t.append(time.perf_counter() - t)
    floors = {"train": _median(train_t), "engine": _median(engine_t), "certify": _median(cert_t)}
    floor_sum = sum(floors.values())
    result = {
        "uptime": _uptime(),
        "clients": args.clients,
        "rounds_run": len(hist.rounds),
        "stopped": hist.stopped,
        "total_seconds": total,
        "accuracy": hist.accuracy,
        "epsilon": hist.epsilon,
        "per_round_median": per_round,
        "floors": floors,
        "floor_sum": floor_sum,
        "ratio_round_to_floors": per_round["seconds"] / floor_sum,
        "backend": hist.backend,
        "sigma_star": hist.rounds[0].noise.get("sigma_star"),
        "sigma_delta": hist.rounds[0].noise.get("sigma_delta"),
        "certified_rounds": sum(r.certified for r in hist.rounds),
        "setup_seconds": total - sum(r.seconds for r in hist.rounds),
    }
    print(
        f"\n{args.clients} clients, {len(hist.rounds)} rounds: total {total:.1f} s "
        f"(setup {result['setup_seconds']:.1f} s: data, Ray, calibration), "
        f"final accuracy {hist.accuracy:.4f}, epsilon {hist.epsilon:.4f}"
        f"{'; ' + hist.stopped if hist.stopped else ''}"
    )
    print(
        _table(
            [[k.replace("seconds_", "") if k != "seconds" else "round", v] for k, v in per_round.items()],
            ["per round (median)", "s"],
        )
    )
    print(
        _table(
            [[k, v] for k, v in floors.items()]
            + [["sum", floor_sum], ["round / sum of floors", per_round["seconds"] / floor_sum]],
            ["floor (alone)", "s"],
        )
    )
    return result


# -------------------------------------------------------------------------------------------- flower
def _dropout(args):
    """The expected within-round dropouts of ``--dropout`` (None for '')."""
    from flwr_inca.cli import parse_dropout

    return parse_dropout(args.dropout) if args.dropout else None


def _simulator_rounds(args, clients, rounds):
    """The simulator's side of ``flower``: ``args.seeds`` runs of ``rounds`` rounds at ``clients``."""
    from flwr_inca.simulation import SimulationConfig

    data = _data(args)
    sims = []
    for seed in range(args.seeds):
        config = SimulationConfig(rounds=rounds, budget_rounds=40, backend="ray", seed=seed,
                                  iterations=args.iterations, dropout=_dropout(args), **MAIN)
        hist = _simulate(data, clients, config)
        sims.append(
            {
                "per_round": _breakdown(hist, skip_first=False),
                "accuracy": hist.column("accuracy"),
                "epsilon": hist.epsilon,
            }
        )
    return sims


def part_simulator(args):
    """The simulator's side of ``flower`` alone (per-round breakdown, median of each seed's rounds):
    run it with ``PYTHONPATH`` at another checkout to compare two versions side by side."""
    import flwr_inca

    results = []
    for clients in args.clients:
        sims = _simulator_rounds(args, clients, args.rounds)
        per_round = [s["per_round"] for s in sims]
        row = {"clients": clients, "rounds": args.rounds, "package": str(Path(flwr_inca.__file__).parent),
               "uptime": _uptime(), "simulator": sims,
               "simulator_round_seconds": _median([p["seconds"] for p in per_round])}
        results.append(row)
        keys = ["seconds", "seconds_plan", "seconds_train", "seconds_train_wait", "seconds_charge",
                "seconds_mix", "seconds_eval"]
        print(f"flwr_inca from {row['package']}")
        print(_table([[clients, s] + [p[k] for k in keys] for s, p in enumerate(per_round)],
                     ["clients", "seed", "round", "certify", "train", "train wait", "ledger", "mix", "eval"]),
              flush=True)
    return results


def part_flower(args):
    """Per-round time and accuracy: the simulator vs IncaStrategy in Flower's simulation engine, the
    same model, data, split and privacy settings (budget planned for 40 rounds; a few are run)."""
    results = []
    for clients, rounds in zip(args.clients, args.rounds_per_size):
        child = [
            sys.executable,
            __file__,
            "_flower_child",
            "--clients",
            str(clients),
            "--rounds",
            str(rounds),
            "--data-dir",
            args.data_dir,
            "--iterations",
            str(args.iterations),
            "--dropout",
            args.dropout,
        ]
        t = time.perf_counter()
        proc = subprocess.run(child, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise RuntimeError(f"Flower route at {clients} clients failed")
        flower = json.loads(proc.stdout.split("RESULT", 1)[1])
        flower["wall"] = time.perf_counter() - t
        sims = _simulator_rounds(args, clients, rounds)
        sim_round = _median([s["per_round"]["seconds"] for s in sims])
        flower_round = _median(flower["round_seconds"][1:] or flower["round_seconds"])
        accs = np.array([s["accuracy"][-1] for s in sims])
        row = {
            "clients": clients,
            "rounds": rounds,
            "uptime": _uptime(),
            "flower": flower,
            "simulator": sims,
            "flower_round_seconds": flower_round,
            "simulator_round_seconds": sim_round,
            "speedup": flower_round / sim_round,
            "flower_accuracy": flower["accuracy"][-1],
            "simulator_accuracy_mean": float(accs.mean()),
            "simulator_accuracy_std": float(accs.std(ddof=1)) if len(accs) > 1 else 0.0,
        }
        results.append(row)
        print(
            _table(
                [
                    [
                        clients,
                        rounds,
                        flower_round,
                        sim_round,
                        row["speedup"],
                        row["flower_accuracy"],
                        f"{accs.mean():.4f} +- {row['simulator_accuracy_std']:.4f} ({len(accs)} seeds)",
                    ]
                ],
                [
                    "clients",
                    "rounds",
                    "Flower s/round",
                    "simulator s/round",
                    "speed-up",
                    "Flower acc",
                    "simulator acc",
                ],
            ),
            flush=True,
        )
    return results


def flower_child(args):
    """One Flower-route run, the MNIST example's client (Opacus per-example clipping, Poisson sampling
    with OS entropy), IncaStrategy with the simulator's settings; prints RESULT{json}."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    sys.path.insert(0, str(EXAMPLE))
    cfg = {
        "num-server-rounds": 40,
        "privacy-unit": "record",
        "epsilon": MAIN["max_epsilon"],
        "delta": MAIN["delta"],
        "neighbors": MAIN["neighbors"],
        "collusion": MAIN["collusion"],
        "lr": MAIN["lr"],
        "clip-norm": MAIN["clip_norm"],
        "batch-size": MAIN["batch_size"],
        "data-dir": args.data_dir,
    }
    os.environ["FLWR_INCA_EXAMPLE_CONFIG"] = json.dumps(cfg)  # read by the example's ClientApp
    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation
    from mnist_logreg import task
    from mnist_logreg.client_app import app as client_app

    from flwr_inca.flower import IncaStrategy

    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        data = task.load_data(args.data_dir)
        plan = task.privacy_plan(task.load_config(), len(data.y_train) // args.clients)
        strategy = IncaStrategy(
            fraction_train=1.0,
            min_train_nodes=args.clients,
            min_available_nodes=args.clients,
            fraction_evaluate=0.0,
            iterations=args.iterations,  # chosen for the expected dropouts, as the simulator does
            dropout=_dropout(args),
            neighbors=MAIN["neighbors"],
            round_epsilon=plan["epsilon_round"],
            delta=MAIN["delta"],
            max_epsilon=MAIN["max_epsilon"],
            clip_norm=plan["party_clip"],
            value_sensitivity=plan["value_sensitivity"],
            sample_rate=plan["sample_rate"],
            accountant="opacus-prv",
            collusion=MAIN["collusion"],
            threat_draws=MAIN["threat_draws"],
            calibration_runs=MAIN["calibration_runs"],
            ledger_path=None,
            seed=0,
            exchange_timeout=600,
        )
        model = task.make_model(data.features)
        stamps, accs = [], []

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
            stamps.append(time.perf_counter())
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = task.accuracy(model, data.x_test, data.y_test)
            accs.append(acc)
            return MetricRecord({"accuracy": acc})

        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=args.rounds,
            evaluate_fn=evaluate,
        )
        out.update(
            round_seconds=list(np.diff(stamps)),
            accuracy=accs,
            strategy_seconds=[strategy.rounds[r].seconds for r in sorted(strategy.rounds)],
            epsilon=strategy.ledger.epsilon(),
            sigma_star=strategy.rounds[1].trace.sigma_star,
            sigma_delta=strategy.rounds[1].trace.sigma_delta,
        )

    run_simulation(
        server_app=app,
        client_app=client_app,
        num_supernodes=args.clients,
        backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}},
    )
    print("RESULT" + json.dumps(out))


# -------------------------------------------------------------------------------------------- p2pfl
def part_p2pfl(args):
    """Time per round and accuracy after the same rounds: p2pfl (its own venv, benchmarks/bench_p2pfl.py)
    and the simulator on the same model, data and local training (non-private FedAvg, and IncA)."""
    from flwr_inca.simulation import SimulationConfig

    data = _data(args)
    results = []
    for nodes in args.nodes:
        row = {"nodes": nodes, "uptime": _uptime()}
        cmd = [
            args.p2pfl_python,
            str(ROOT / "benchmarks" / "bench_p2pfl.py"),
            "--nodes",
            str(nodes),
            "--rounds",
            str(args.rounds),
            "--data-dir",
            args.data_dir or os.environ.get("FLWR_INCA_MNIST_DIR", ""),
            "--timeout",
            str(args.p2pfl_timeout),
            "--converge-wait",
            str(args.converge_wait),
        ] + (["--ray"] if args.p2pfl_ray else [])
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.p2pfl_timeout + 120)
            text = proc.stdout
            if "RESULT" in text:
                row["p2pfl"] = json.loads(text.split("RESULT", 1)[1].strip().splitlines()[0])
            else:
                row["p2pfl"] = {"error": f"exit {proc.returncode}: " + (proc.stderr or text)[-1500:]}
        except subprocess.TimeoutExpired:
            row["p2pfl"] = {"error": f"timed out after {args.p2pfl_timeout + 120} s"}
        row["p2pfl_wall"] = time.perf_counter() - t
        # FedAvg: p2pfl's task exactly (no clipping in effect); IncA: the product's main setting,
        # record-level DP at epsilon = 1 over 40 planned rounds (one DP step per round), for its cost
        local = dict(privacy_unit="party", local_epochs=1, lr=0.1, batch_size=64, clip_norm=1e6)
        for mode, opts in (
            ("fedavg", dict(mode="fedavg", max_epsilon=None, **local)),
            ("inca", dict(budget_rounds=40, **MAIN)),
        ):
            hist = _simulate(data, nodes, SimulationConfig(rounds=args.rounds, backend="ray", **opts))
            row[f"simulator_{mode}"] = {
                "per_round": _breakdown(hist),
                "accuracy": hist.column("accuracy"),
                "epsilon": hist.epsilon,
            }
        results.append(row)
        p2 = row["p2pfl"]
        print(
            _table(
                [
                    [
                        nodes,
                        args.rounds,
                        p2.get("round_seconds_median", p2.get("error", "?"))[:60]
                        if isinstance(p2.get("round_seconds_median", p2.get("error")), str)
                        else p2.get("round_seconds_median"),
                        p2.get("accuracy_mean", "-"),
                        row["simulator_fedavg"]["per_round"]["seconds"],
                        row["simulator_fedavg"]["accuracy"][-1],
                        row["simulator_inca"]["per_round"]["seconds"],
                        row["simulator_inca"]["accuracy"][-1],
                    ]
                ],
                [
                    "nodes",
                    "rounds",
                    "p2pfl s/round",
                    "p2pfl acc",
                    "sim FedAvg s/round",
                    "sim FedAvg acc",
                    "sim IncA s/round",
                    "sim IncA acc",
                ],
            ),
            flush=True,
        )
    return results


# -------------------------------------------------------------------------------------------- scaling
def part_scaling(args):
    results = []
    for clients in args.clients:
        child = [
            sys.executable,
            __file__,
            "_scaling_child",
            "--clients",
            str(clients),
            "--data-dir",
            args.data_dir,
            "--rounds",
            str(args.rounds),
            "--fraction",
            str(args.fraction),
        ]
        if clients >= args.bound_above:
            child += ["--local-bound"]
        proc = subprocess.run(child, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            results.append({"clients": clients, "error": proc.stderr[-1000:]})
            continue
        res = json.loads(proc.stdout.split("RESULT", 1)[1])
        results.append(res)
        pr = res["per_round"]
        print(
            _table(
                [
                    [
                        clients,
                        res["participants"],
                        res["cost"],
                        pr["seconds"],
                        pr["seconds_train"],
                        pr["seconds_mix"],
                        pr["seconds_plan"],
                        pr["seconds_charge"],
                        res["driver_peak_mb"],
                        res["actor_peak_mb"],
                    ]
                ],
                [
                    "clients",
                    "per round",
                    "cost",
                    "s/round",
                    "train",
                    "mix",
                    "certify",
                    "ledger",
                    "driver peak MB",
                    "actors peak MB",
                ],
            ),
            flush=True,
        )
    return results


def scaling_child(args):
    from flwr_inca.simulation import SimulationConfig

    data = _data(args)
    extra = {}
    if args.local_bound:
        # no exact certificate at this size (see the 'certify' part): fixed noise (the calibration at
        # 1000 participants, sigma_star scaled by sqrt(1000 / n)), charged the local bound; RDP, since
        # PRV is slow for such weak rounds
        scale = math.sqrt(1000 / (args.clients * args.fraction))
        extra = dict(max_epsilon=None, sigma_star=args.sigma_star * scale, sigma_delta=args.sigma_delta,
                     certification="local-bound", accountant="opacus-rdp")
    config = SimulationConfig(rounds=args.rounds, backend="ray", fraction=args.fraction,
                              **{**MAIN, "calibration_runs": 3, **extra})
    hist = _simulate(data, args.clients, config)
    out = {
        "clients": args.clients,
        "participants": hist.rounds[0].participants,
        "rounds": len(hist.rounds),
        "per_round": _breakdown(hist, skip_first=True),
        "driver_peak_mb": hist.memory.get("driver_peak_mb"),
        "actor_peak_mb": hist.memory.get("actors_peak_mb"),
        "cost": hist.rounds[0].cost,
        "epsilon": hist.epsilon,
        "accuracy": hist.accuracy,
        "uptime": _uptime(),
        "backend": hist.backend,
    }
    print("RESULT" + json.dumps(out))


# -------------------------------------------------------------------------------------------- actors
def part_actors(args):
    from flwr_inca.simulation import SimulationConfig

    data = _data(args)
    rows, out = [], []
    for rep in range(args.repeats):  # interleaved
        for actors in (1, 2):
            hist = _simulate(
                data,
                args.clients[0],
                SimulationConfig(rounds=args.rounds, backend="ray", num_actors=actors, **MAIN),
            )
            b = _breakdown(hist, skip_first=True)
            out.append({"actors": actors, "repeat": rep, **b})
    for actors in (1, 2):
        sel = [o for o in out if o["actors"] == actors]
        rows.append(
            [actors, _median([o["seconds_train"] for o in sel]), _median([o["seconds"] for o in sel])]
        )
    print(_table(rows, ["actors", "train s/round", "round s"]))
    print(
        f"training speed-up 2 vs 1 actor: {rows[0][1] / rows[1][1]:.2f}x; "
        f"round: {rows[0][2] / rows[1][2]:.2f}x"
    )
    return {"uptime": _uptime(), "runs": out}


# -------------------------------------------------------------------------------------------- shard
def _replay_shard(trace, values, seed):
    from flwr_inca.protocol import replay

    return replay(trace, values, seed=seed).estimate


def part_shard(args):
    """Does sharding the IncA engine by coordinates across 2 Ray workers pay? One replay of the full
    (n, d) updates vs two tasks on half the coordinates each (data transfer included)."""
    import ray

    from flwr_inca.protocol import IncaConfig, replay, sample_trace
    from flwr_inca.simulation.backend import connect_ray

    connect_ray(None, 2)
    n, d = args.clients[0], 7850
    trace = sample_trace(n, IncaConfig(sigma_star=0.01, sigma_delta=1.0, iterations=10), seed=0)
    x = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    task = ray.remote(num_cpus=1)(_replay_shard)
    trace_ref = ray.put(trace)
    ray.get([task.remote(trace_ref, x[:, :8], 0) for _ in range(2)])  # warm the workers
    from flwr_inca.simulation.noise import NoiseAhead

    full_t, shard_t, ahead_t = [], [], []
    for r in range(args.repeats):
        t = time.perf_counter()
        replay(trace, x, seed=r)
        full_t.append(time.perf_counter() - t)
        # what the simulator's round waits for: the engine once its noise was drawn ahead
        ahead = NoiseAhead(r, trace, d, np.float32, max_bytes=2**34)
        ahead._thread.join()
        t = time.perf_counter()
        replay(trace, x, seed=r, noise=ahead)
        ahead_t.append(time.perf_counter() - t)
        ahead.close()
        t = time.perf_counter()
        halves = np.array_split(np.arange(d), 2)
        parts = ray.get(
            [task.remote(trace_ref, np.ascontiguousarray(x[:, h]), 10 * r + i) for i, h in enumerate(halves)]
        )
        np.concatenate(parts)
        shard_t.append(time.perf_counter() - t)
    res = {"uptime": _uptime(), "n": n, "d": d, "full": _median(full_t), "two_shards": _median(shard_t),
           "noise_ahead": _median(ahead_t)}
    print(
        _table(
            [[n, d, res["full"], res["two_shards"], res["full"] / res["two_shards"], res["noise_ahead"]]],
            ["n", "d", "one engine (s)", "2 shards on Ray (s)", "speed-up", "engine, noise drawn ahead (s)"],
        )
    )
    ray.shutdown()
    return res


# -------------------------------------------------------------------------------------------- certify
def part_certify(args):
    rows, out = [], []
    for n in args.parties:
        proc = subprocess.run(
            [sys.executable, __file__, "_certify_child", "--parties", str(n)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            out.append({"n": n, "error": proc.stderr[-500:]})
            continue
        res = json.loads(proc.stdout.split("RESULT", 1)[1])
        out.append(res)
        rows.append([n, res["seconds"], res["peak_mb"]])
    ok = [o for o in out if "error" not in o]
    fit = {}
    if len(ok) >= 2:
        ns = np.log([o["n"] for o in ok])
        fit["time_exponent"], b = np.polyfit(ns, np.log([o["seconds"] for o in ok]), 1)
        fit["memory_exponent"], bm = np.polyfit(ns, np.log([o["peak_mb"] for o in ok]), 1)
        fit["seconds_at_10000"] = float(np.exp(b) * 10_000 ** fit["time_exponent"])
        fit["peak_mb_at_10000"] = float(np.exp(bm) * 10_000 ** fit["memory_exponent"])
        rows.append(["10000 (fit)", fit["seconds_at_10000"], fit["peak_mb_at_10000"]])
    print(_table(rows, ["parties", "certificate (s)", "peak RSS (MB)"]))
    if fit:
        print(f"time ~ n^{fit['time_exponent']:.2f}, memory ~ n^{fit['memory_exponent']:.2f}")
    return {"uptime": _uptime(), "runs": out, "fit": fit}


def certify_child(args):
    from flwr_inca.privacy import certify, random_collusion
    from flwr_inca.protocol import IncaConfig, sample_trace

    trace = sample_trace(args.parties, IncaConfig(sigma_star=0.01, sigma_delta=1.0, iterations=10), seed=0)
    view = random_collusion(trace, 0.1, 1)
    t = time.perf_counter()
    certify(trace, view)
    print(
        "RESULT" + json.dumps({"n": args.parties, "seconds": time.perf_counter() - t, "peak_mb": _rss_mb()})
    )


# -------------------------------------------------------------------------------------------- cli
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "part",
        choices=[
            "main",
            "flower",
            "simulator",
            "p2pfl",
            "scaling",
            "actors",
            "shard",
            "certify",
            "_flower_child",
            "_scaling_child",
            "_certify_child",
        ],
    )
    p.add_argument("--data-dir", default=os.environ.get("FLWR_INCA_MNIST_DIR", ""))
    p.add_argument("--clients", type=int, nargs="+", default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument(
        "--rounds-per-size", type=int, nargs="+", default=None, help="flower: rounds per client count"
    )
    p.add_argument("--seeds", type=int, default=3, help="flower: simulator seeds for the accuracy spread")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 50])
    p.add_argument("--p2pfl-python", default="/work/venvs/p2pfl-w10/bin/python")
    p.add_argument("--p2pfl-timeout", type=int, default=420)
    p.add_argument("--p2pfl-ray", action="store_true", help="p2pfl trains in its Ray actor pool")
    p.add_argument("--converge-wait", type=float, default=60, help="p2pfl: seconds for its mesh to form")
    p.add_argument("--fraction", type=float, default=1.0)
    p.add_argument("--dropout", default="permanent:0.1",
                   help="main: the expected within-round dropouts ('' for none), as flwr-inca simulate --dropout")
    p.add_argument("--iterations", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="main: IncA's T (default auto, as the simulator)")
    p.add_argument("--local-bound", action="store_true")
    p.add_argument(
        "--bound-above", type=int, default=5000, help="scaling: charge the local bound from this size"
    )
    p.add_argument("--sigma-star", type=float, default=None, help="scaling: sigma_star at 1000 participants")
    p.add_argument("--sigma-delta", type=float, default=None)
    p.add_argument("--parties", type=int, nargs="+", default=[1000, 2000, 4000])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.part == "_flower_child":
        return flower_child(
            argparse.Namespace(clients=args.clients[0], rounds=args.rounds, data_dir=args.data_dir)
        )
    if args.part == "_scaling_child":
        return scaling_child(
            argparse.Namespace(
                clients=args.clients[0],
                rounds=args.rounds,
                data_dir=args.data_dir,
                fraction=args.fraction,
                local_bound=args.local_bound,
                sigma_star=args.sigma_star or 0.0021,
                sigma_delta=args.sigma_delta or 0.5,
            )
        )
    if args.part == "_certify_child":
        return certify_child(argparse.Namespace(parties=args.parties[0]))
    print(f"# {args.part} — {_uptime()}", flush=True)
    if args.part == "main":
        args.clients, args.rounds = (args.clients or [1000])[0], args.rounds or 40
        result = part_main(args)
    elif args.part == "flower":
        args.clients = args.clients or [100]
        args.rounds_per_size = args.rounds_per_size or [args.rounds or 5] * len(args.clients)
        result = part_flower(args)
    elif args.part == "simulator":
        args.clients, args.rounds = args.clients or [100], args.rounds or 4
        result = part_simulator(args)
    elif args.part == "p2pfl":
        args.rounds = args.rounds or 3
        result = part_p2pfl(args)
    elif args.part == "scaling":
        args.clients, args.rounds = args.clients or [100, 1000, 10000], args.rounds or 3
        result = part_scaling(args)
    elif args.part == "actors":
        args.clients, args.rounds = args.clients or [1000], args.rounds or 4
        result = part_actors(args)
    elif args.part == "shard":
        args.clients = args.clients or [1000]
        result = part_shard(args)
    else:
        result = part_certify(args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
