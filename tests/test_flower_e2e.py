"""End-to-end: IncaStrategy and IncaClient through Flower's simulation engine (Ray backend)."""

import os

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

from flwr.app import ArrayRecord, ConfigRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

import flower_apps  # noqa: E402
from flwr_inca import replay  # noqa: E402
from flwr_inca.flower import IncaStrategy  # noqa: E402
from flwr_inca.flower.client import clip, flatten_arrays  # noqa: E402
from flwr_inca.flower.node import RoundSecrets  # noqa: E402
from flwr_inca.protocol.party import PartyNoise  # noqa: E402

pytestmark = pytest.mark.flower

NODES, ROUNDS, T = 10, 3, 5
INITIAL = [np.zeros((3, 4), dtype=np.float32), np.zeros(5, dtype=np.float32)]


class RecordingGrid:
    """Passes everything through and keeps a copy of all the ServerApp sees and sends."""

    def __init__(self, grid: Grid) -> None:
        self.grid = grid
        self.seen: list[bytes] = []

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def _keep(self, msg) -> None:
        if msg.has_content():
            for rec in msg.content.config_records.values():
                for v in rec.values():
                    for item in (v if isinstance(v, list) else [v]):
                        if isinstance(item, bytes):
                            self.seen.append(item)
            for rec in msg.content.array_records.values():
                for arr in rec.values():
                    self.seen.append(arr.numpy().tobytes())

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            self._keep(m)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for r in replies:
            self._keep(r)
        return replies


class TamperingStrategy(IncaStrategy):
    """Flips one bit in the first payload of the exchange that commits to iteration 3 of round 2."""

    tampered = 0

    def relay_payload(self, sender, receiver, iteration, payload):
        if self._current_round == 2 and iteration == 2 and not self.tampered:
            TamperingStrategy.tampered += 1
            return payload[:-1] + bytes([payload[-1] ^ 1])
        return payload

    def _train_round(self, server_round, *args, **kwargs):
        self._current_round = server_round
        return super()._train_round(server_round, *args, **kwargs)


def _simulate(server_app, nodes=NODES, client_app=None):
    from flwr.simulation import run_simulation

    run_simulation(server_app=server_app, client_app=client_app or flower_apps.client, num_supernodes=nodes,
                   backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    rng = np.random.default_rng(5)
    faults = []
    for kind in ["error"] * 4 + ["timeout"] * 2:  # failures at random nodes, rounds and iterations
        faults.append(f"{rng.integers(NODES)}:{rng.integers(1, ROUNDS + 1)}:{rng.integers(1, T + 2)}:{kind}")
    os.environ["INCA_TEST_FAULTS"] = ";".join(faults)
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        recording = RecordingGrid(grid)
        strategy = TamperingStrategy(iterations=T, sigma_star=0.2, sigma_delta=3.0, clip_norm=1.0, precision="float64",
                                     exchange_timeout=2.5, ledger_path=tmp / "ledger.json",
                                     max_noise_inflation=float("inf"),  # keep rounds with lost finals
                                     trace_dir=tmp / "traces", forward_client_metrics=True, seed=3,
                                     fraction_evaluate=0.5, min_available_nodes=NODES,
                                     min_train_nodes=NODES)
        globals_ = {}

        def evaluate_fn(rnd, arrays):
            globals_[rnd] = [a.copy() for a in arrays.to_numpy_ndarrays()]
            return None

        result = strategy.start(grid=recording, initial_arrays=ArrayRecord(INITIAL), num_rounds=ROUNDS,
                                evaluate_fn=evaluate_fn)
        out.update(strategy=strategy, result=result, globals=globals_, seen=recording.seen)

    try:
        _simulate(app)
    finally:
        os.environ.pop("INCA_TEST_FAULTS", None)
    out["faults"] = faults
    out["tmp"] = tmp
    return out


def test_training_completes_with_failures(faulty_run):
    result, strategy = faulty_run["result"], faulty_run["strategy"]
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    for rnd, metrics in result.train_metrics_clientapp.items():
        assert metrics["inca-round-failed"] == 0
        assert metrics["inca-parties"] == NODES and metrics["inca-finalists"] >= 8
        assert metrics["inca-epsilon"] > 0
    errors = sum(m["inca-errors"] for m in result.train_metrics_clientapp.values())
    timeouts = sum(m["inca-timeouts"] for m in result.train_metrics_clientapp.values())
    assert errors >= 1 and timeouts >= 1, faulty_run["faults"]
    eps = [result.train_metrics_clientapp[r]["inca-epsilon"] for r in (1, 2, 3)]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(strategy.ledger.epsilon())
    assert sorted(p.name for p in (faulty_run["tmp"] / "traces").iterdir()) == [
        "round-0001.json", "round-0002.json", "round-0003.json"]
    assert len(result.evaluate_metrics_clientapp) == ROUNDS  # FedAvg-style evaluation still runs
    # a node failed its final report (and the retries): with the default guard that round would fail,
    # since the lost final takes its share of the cancelling noise with it
    default = IncaStrategy(sigma_star=0.2, sigma_delta=3.0, ledger_path=None)
    lost = 0
    for rnd, record in strategy.rounds.items():
        online_T = record.trace.steps[-1].online.tolist()
        noise, why = default._noise_check(record.trace, record.finalists, record.roster)
        assert result.train_metrics_clientapp[rnd]["inca-noise-std"] == pytest.approx(noise)
        if record.finalists != online_T:
            lost += 1
            assert "were lost" in why
        else:
            assert why == ""
    assert lost >= 1, faulty_run["faults"]


def test_tampered_payload_rejected_and_round_still_consistent(faulty_run):
    metrics = faulty_run["result"].train_metrics_clientapp
    assert TamperingStrategy.tampered == 1
    assert metrics[2]["inca-rejected-payloads"] >= 1


def test_replay_in_core_engine_reproduces_the_global_model(faulty_run):
    strategy, globals_ = faulty_run["strategy"], faulty_run["globals"]
    for rnd, record in sorted(strategy.rounds.items()):
        old = globals_[rnd - 1]
        values, noises = _round_inputs(record, old, rnd)
        trace = record.trace
        d = values[0].size
        res = replay(trace, values, seed=0, noise=PartyNoise.explicit(noises, d, T),
                     finalists=record.finalists)
        assert np.allclose(res.estimate, record.update, atol=1e-12, rtol=1e-12)
        new_global = flatten_arrays(ArrayRecord(globals_[rnd]))[0]
        old_global = flatten_arrays(ArrayRecord(old))[0]
        assert np.allclose(new_global, (old_global + record.update).astype(np.float32), atol=1e-6)
    # the injected failures really made parties offline somewhere
    assert any(not rec.trace.online_mask().all() for rec in strategy.rounds.values())


def _round_inputs(record, old, rnd):
    values, noises = [], []
    for node in record.roster:
        pid = int(record.client_metrics[node]["partition-id"])
        new = flower_apps.local_update(old, pid, rnd)
        x = flatten_arrays(ArrayRecord(new))[0] - flatten_arrays(ArrayRecord(old))[0]
        values.append(clip(x, 1.0))
        secret = RoundSecrets.generate(rnd, flower_apps.FIXED_SEED, node=node)
        noises.append(PartyNoise(secret.noise_secret, rnd))
    return np.array(values), noises


def test_relay_view_contains_no_plaintext(faulty_run):
    from reference import all_messages

    strategy, globals_, seen = faulty_run["strategy"], faulty_run["globals"], faulty_run["seen"]
    blob = b"".join(seen)
    checked = 0
    for rnd, record in strategy.rounds.items():
        values, noises = _round_inputs(record, globals_[rnd - 1], rnd)
        # every message but the finals, which are public by design
        messages = all_messages(record.trace, values, noises)[: -len(record.trace.steps[-1].online)]
        for y in messages + list(values):
            chunk = y.astype(np.float64).tobytes()
            for j in range(0, len(chunk) - 16, 8):
                assert chunk[j:j + 16] not in blob, f"a plaintext message of round {rnd} reached the relay"
            checked += 1
    assert checked > NODES * ROUNDS * T


@pytest.mark.parametrize("resume", [False, True])
def test_budget_exhaustion_stops_cleanly_and_restart_resumes(tmp_path_factory, resume):
    tmp = tmp_path_factory.getbasetemp() / "budget"
    tmp.mkdir(exist_ok=True)
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = IncaStrategy(iterations=4, sigma_star=1.0, sigma_delta=5.0, max_epsilon=9.0,
                                ledger_path=tmp / "ledger.json", exchange_timeout=10, seed=1,
                                fraction_evaluate=0.0, min_available_nodes=10, min_train_nodes=10)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(INITIAL), num_rounds=10,
                                train_config=ConfigRecord({"lr": 0.1}))
        out.update(strategy=strategy, result=result)

    _simulate(app, nodes=10)
    strategy, result = out["strategy"], out["result"]
    ledger = strategy.ledger
    if not resume:
        done = sorted(result.train_metrics_clientapp)
        assert 1 <= len(done) < 10  # stopped before the budget ran out
        # every round started only when predicted affordable; the certified cost of the last one may
        # exceed the prediction (random topology): then it is recorded exactly and training stops
        assert all(e.epsilon <= 9.0 for e in ledger.entries[:-1])
        assert ledger.epsilon() <= 9.0 or ledger.rounds == len(done)
        if ledger.epsilon() <= 9.0:
            assert ledger.epsilon_after(strategy.predicted_mu(10)) > 9.0
        assert [e.round for e in ledger.entries] == done
    else:  # the restarted ServerApp found the spent budget and ran no further round
        assert result.train_metrics_clientapp == {}
        assert ledger.rounds >= 1
        assert ledger.epsilon_after(strategy.predicted_mu(10)) > 9.0


def test_round_with_too_few_finals_fails_and_keeps_the_model(tmp_path):
    # six of ten nodes stop answering after committing to iteration 2: too few finals
    faults = [f"{pid}:1:{commit}:error" for pid in range(6) for commit in range(3, T + 4)]
    os.environ["INCA_TEST_FAULTS"] = ";".join(faults)
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = IncaStrategy(iterations=T, sigma_star=0.2, sigma_delta=3.0, min_finalists=6,
                                ledger_path=tmp_path / "ledger.json", exchange_timeout=10, seed=2,
                                fraction_evaluate=0.0, min_available_nodes=NODES, min_train_nodes=NODES)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(INITIAL), num_rounds=1)
        out.update(strategy=strategy, result=result)

    try:
        _simulate(app)
    finally:
        os.environ.pop("INCA_TEST_FAULTS", None)
    strategy, result = out["strategy"], out["result"]
    metrics = result.train_metrics_clientapp[1]
    assert metrics["inca-round-failed"] == 1 and metrics["inca-finalists"] < 6
    assert "final message" in strategy.rounds[1].failed
    assert len(result.arrays) == 0  # the model was never replaced
    assert strategy.ledger.rounds == 1 and metrics["inca-epsilon"] > 0  # the messages were exchanged


def test_strategy_started_twice_in_one_run_starts_each_round_afresh(tmp_path):
    # the second start numbers its rounds from 1 again; the nodes' secrets are fresh (CSPRNG) and
    # nothing of the first instance's round 1 (roster, public keys, cached values) may be used
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        arrays, strategies = ArrayRecord(INITIAL), []
        for _ in range(2):
            strategy = IncaStrategy(iterations=3, sigma_star=0.0, sigma_delta=3.0, clip_norm=100.0,
                                    precision="float64", ledger_path=None, exchange_timeout=10,
                                    forward_client_metrics=True, fraction_evaluate=0.0,
                                    min_available_nodes=NODES, min_train_nodes=NODES)
            arrays = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1).arrays
            strategies.append((strategy, arrays))
        out["runs"] = strategies

    _simulate(app, client_app=flower_apps.secure_client)
    old = INITIAL
    for strategy, arrays in out["runs"]:
        record = strategy.rounds[1]
        assert not record.failed and len(record.finalists) == NODES
        # sigma_star = 0, no dropouts: the round's update is exactly the mean of the local updates
        updates = []
        for node in record.roster:
            pid = int(record.client_metrics[node]["partition-id"])
            new = flower_apps.local_update(old, pid, 1)
            updates.append(flatten_arrays(ArrayRecord(new))[0] - flatten_arrays(ArrayRecord(old))[0])
        assert np.allclose(record.update, np.mean(updates, axis=0), atol=1e-9)
        old = arrays.to_numpy_ndarrays()
