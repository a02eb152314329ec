"""End-to-end: IncaStrategy and IncaClient through Flower's simulation engine (Ray backend).

Two simulations, each a module fixture: ``faulty_run`` (3 rounds with injected errors, lost replies,
a lost final and a tampered payload) and ``scenarios`` (one ServerApp running several strategies in a
row: a restart, a round with too few finals, budget exhaustion and a resumed ledger, FedAvg's
``fraction_train = 0``). Every fault is injected at a fixed (party, round, exchange), so the
outcome does not depend on timing: a node that "times out" is one whose request the grid drops.
"""

import json
import logging
import math
import os

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")

import flower_apps  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.exception import PrivacyBudgetExhausted  # noqa: E402
from noise_reference import brute_noise_std  # noqa: E402

from flwr_inca import replay  # noqa: E402
from flwr_inca.flower import IncaBudgetExhausted, IncaStrategy  # noqa: E402
from flwr_inca.flower.node import RoundSecrets  # noqa: E402
from flwr_inca.flower.shared import INCA_KEY, clip, flatten_arrays  # noqa: E402
from flwr_inca.flower.storage import SCAN_MARK  # noqa: E402
from flwr_inca.flower.wire import FIELD, peek_request  # noqa: E402
from flwr_inca.privacy import RoundCost  # noqa: E402
from flwr_inca.protocol.party import PartyNoise  # noqa: E402

pytestmark = pytest.mark.flower

NODES, ROUNDS, T = 10, 3, 5
INITIAL = [np.zeros((3, 4), dtype=np.float32), np.zeros(5, dtype=np.float32)]
# (party, round, commit) of the mixing exchanges in which a node raises (an error reply) ...
ERRORS = [(1, 1, 2), (6, 1, 4), (3, 3, 3)]
LOST_FINAL = (8, 3)  # ... in every final exchange (T + 1 and both retries) of a round: its final is lost
# ... or whose request the grid drops (the node never answers: a timeout, without waiting for one)
DROPS = [(2, 1, 3), (4, 3, 5)]
TAMPER = (2, 2)  # round, iteration: one bit of the first payload of that iteration is flipped


class RecordingGrid:
    """Passes everything through, keeps a copy of all the ServerApp sees and sends, and drops the
    mixing requests ``drop(round, commit, party)`` selects."""

    def __init__(self, grid: Grid, drop=None) -> None:
        self.grid, self.drop = grid, drop
        self.seen: list[bytes] = []
        self.pushed = 0

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

    def _dropped(self, msg) -> bool:
        record = msg.content.config_records.get(INCA_KEY)
        return (self.drop is not None and record is not None and FIELD in record
                and self.drop(*peek_request(record[FIELD])))

    def push_messages(self, messages):
        messages = [m for m in messages if not self._dropped(m)]
        for m in messages:
            self._keep(m)
        self.pushed += len(messages)
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(self.grid.pull_messages(message_ids))
        for r in replies:
            self._keep(r)
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        for m in messages:
            self._keep(m)
        self.pushed += len(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for r in replies:
            self._keep(r)
        return replies


class TamperingStrategy(IncaStrategy):
    """Flips one bit of the first payload the relay forwards for iteration ``TAMPER[1]`` of round
    ``TAMPER[0]`` (to its receiver, in the exchange that computes that iteration)."""

    tampered: list[tuple[int, int]] = []

    def relay_payload(self, server_round, sender, receiver, iteration, payload):
        if (server_round, iteration) == TAMPER and not self.tampered:
            self.tampered.append((sender, receiver))
            return payload[:-1] + bytes([payload[-1] ^ 1])
        return payload


class LogLines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _simulate(server_app, client_app, ray_address, nodes=NODES):
    from flwr.simulation import run_simulation

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=nodes,
                   backend_config=flower_apps.on_the_session_cluster(ray_address))


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory, ray_cluster):
    tmp = tmp_path_factory.mktemp("e2e")
    client_faults = ERRORS + [(LOST_FINAL[0], LOST_FINAL[1], T + 1)]
    os.environ[flower_apps.FAULTS_ENV] = ";".join(f"{p}:{r}:{c}" for p, r, c in client_faults)
    out: dict = {}
    app = ServerApp()
    log = LogLines()
    logging.getLogger("flwr").addHandler(log)

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        recording = RecordingGrid(grid, drop=lambda rnd, commit, party: (party, rnd, commit) in DROPS)
        strategy = TamperingStrategy(iterations=T, schedule="incremental", sigma_star=0.2, sigma_delta=3.0,
                                     clip_norm=1.0, precision="float64", exchange_timeout=120,
                                     ledger_path=tmp / "ledger.json",
                                     max_noise_inflation=float("inf"),  # keep rounds with lost finals
                                     trace_dir=tmp / "traces", forward_client_metrics=True, seed=3,
                                     fraction_evaluate=0.5, min_available_nodes=NODES, min_train_nodes=NODES)
        globals_ = {}

        def evaluate_fn(rnd, arrays):
            globals_[rnd] = [a.copy() for a in arrays.to_numpy_ndarrays()]
            return None

        result = strategy.start(grid=recording, initial_arrays=ArrayRecord(INITIAL), num_rounds=ROUNDS,
                                evaluate_fn=evaluate_fn)
        out.update(strategy=strategy, result=result, globals=globals_, seen=recording.seen)

    try:
        _simulate(app, flower_apps.client, ray_cluster[0])
    finally:
        os.environ.pop(flower_apps.FAULTS_ENV, None)
        logging.getLogger("flwr").removeHandler(log)
    assert "strategy" in out, "the ServerApp failed: see the log above"
    out.update(tmp=tmp, log=log.lines)
    return out


def test_training_completes_with_failures(faulty_run):
    result, strategy = faulty_run["result"], faulty_run["strategy"]
    server = strategy.train_metrics_serverapp
    assert sorted(server) == sorted(result.train_metrics_clientapp) == [1, 2, 3]
    for rnd, metrics in server.items():
        assert metrics["inca-round-failed"] == 0 and metrics["inca-parties"] == NODES
        online_T = set(strategy.rounds[rnd].trace.steps[-1].online.tolist())
        lost = {LOST_FINAL[0]} if rnd == LOST_FINAL[1] else set()
        assert strategy.rounds[rnd].finalists == sorted(online_T - lost)
        assert metrics["inca-finalists"] == len(online_T - lost) >= NODES - 2
        assert metrics["inca-epsilon"] > 0 and metrics["inca-malformed-replies"] == 0
        assert metrics["inca-invalid-replies"] == 0
        # every injected fault was counted, and nothing else failed
        errors = sum(r == rnd for _, r, _ in ERRORS) + (3 if rnd == LOST_FINAL[1] else 0)
        assert metrics["inca-errors"] == errors
        assert metrics["inca-timeouts"] == sum(r == rnd for _, r, _ in DROPS)
        # the noise of the update, against a brute-force replay of the round's trace
        record = strategy.rounds[rnd]
        brute = brute_noise_std(record.trace, record.finalists)
        assert metrics["inca-noise-std"] == pytest.approx(brute, rel=1e-9)
        assert record.client_metrics and all(m["tagged"] == 1 for m in record.client_metrics.values())
    eps = [server[r]["inca-epsilon"] for r in (1, 2, 3)]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(strategy.ledger.epsilon())
    spent = strategy.privacy_spent()
    assert spent.epsilon == pytest.approx(eps[-1]) and spent.num_releases == 3
    assert sorted(p.name for p in (faulty_run["tmp"] / "traces").iterdir()) == [
        "round-0001.json", "round-0002.json", "round-0003.json"]
    assert len(result.evaluate_metrics_clientapp) == ROUNDS  # FedAvg's evaluation still runs
    assert "Global evaluation" in faulty_run["log"] and "Final results:" in faulty_run["log"]  # Flower's
    # Flower's Result gets the nodes' forwarded metrics; IncA's own are the strategy's (one line per round)
    assert "inca-epsilon" not in result.train_metrics_clientapp[1] and "loss" not in server[1]
    assert sum("IncA round 1:" in line for line in faulty_run["log"]) == 1


def test_faults_make_exactly_the_expected_parties_offline(faulty_run):
    strategy = faulty_run["strategy"]
    for rnd in (1, 3):
        online = strategy.rounds[rnd].trace.online_mask()
        # a party that fails (or never answers) the exchange committing to u is offline at u
        for party, r, commit in ERRORS + DROPS:
            if r == rnd:
                assert not online[commit, party]
        assert online[1:].sum() < NODES * T
    record = strategy.rounds[LOST_FINAL[1]]
    assert record.trace.online_mask()[T, LOST_FINAL[0]] and LOST_FINAL[0] not in record.finalists


def test_tampered_payload_rejected_and_round_still_consistent(faulty_run):
    strategy, metrics = faulty_run["strategy"], faulty_run["strategy"].train_metrics_serverapp
    rnd, iteration = TAMPER
    assert len(TamperingStrategy.tampered) == 1
    sender, receiver = TamperingStrategy.tampered[0]
    assert metrics[rnd]["inca-rejected-payloads"] == 1
    assert sum(m["inca-rejected-payloads"] for m in metrics.values()) == 1
    record = strategy.rounds[rnd]
    # the receiver rejects in the exchange committing to iteration + 1, the sender re-seals in the next,
    # the receiver computes in the one after: it cannot commit to iteration + 1 and + 2 meanwhile, and
    # the sender is held (no new message accepted) until its payload was used; nothing else failed in
    # this round, so everybody else is online throughout and both recover
    expected = np.ones((T + 1, NODES), dtype=bool)
    expected[iteration + 1: iteration + 3, [receiver, sender]] = False
    assert np.array_equal(record.trace.online_mask(), expected)
    assert record.finalists == list(range(NODES)) and metrics[rnd]["inca-errors"] == 0
    # and the relay's record is what the nodes computed: the trace replays to the applied update
    values, noises = _round_inputs(record, faulty_run["globals"][rnd - 1], rnd)
    res = replay(record.trace, values, seed=0, noise=PartyNoise.explicit(noises, values.shape[1], T),
                 finalists=record.finalists)
    assert np.allclose(res.estimate, record.update, atol=1e-12, rtol=1e-12)
    # with every final delivered the noise cancels: the update is the injected-weight mean of the values
    # plus eta*; the receiver injected 4 of T + 1 shares (D_Inc)
    assert res.injected[receiver] == pytest.approx((T + 1 - 2) / (T + 1))


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


# ------------------------------------------------------------------------------ one ServerApp, several runs
BUDGET = 9.0


def _run(out: dict, name: str, fn) -> None:
    """Run one scenario; keep its outcome (or its exception) for its own test."""
    try:
        out[name] = fn()
    except Exception as exc:  # noqa: BLE001 - reported by the scenario's test
        out[name] = exc


# how nodes misbehave in the "hostile" scenario (flower_apps.hostile; partitions 0-4 never join)
HOSTILE = {"join": {"0": "no-key", "1": "str-key", "2": "long-key", "3": "wrong-dim"}, "nan": [4],
           "final": {"2:5": "huge", "3:6": "negative-omega"}}
OMIT_NUM_EXAMPLES = 7  # the partition whose train metrics lack "num-examples" in the "post_charge" scenario


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory, ray_cluster):
    tmp = tmp_path_factory.mktemp("scenarios")
    out: dict = {}
    app = ServerApp()
    plan = tmp / "hostile.json"
    plan.write_text("{}")
    os.environ[flower_apps.HOSTILE_ENV] = str(plan)
    node_state = tmp / "node-state"
    before = os.environ.get("FLWR_INCA_STATE_DIR")
    os.environ["FLWR_INCA_STATE_DIR"] = str(node_state)
    common = {"fraction_evaluate": 0.0, "min_available_nodes": NODES, "min_train_nodes": NODES,
              "exchange_timeout": 120}

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        def started_twice():
            # the second start numbers its rounds from 1 again; the nodes' secrets are fresh (CSPRNG) and
            # nothing of the first instance's round 1 (roster, public keys, cached values) may be used
            arrays, runs = ArrayRecord(INITIAL), []
            for _ in range(2):
                strategy = IncaStrategy(iterations=3, sigma_star=0.0, sigma_delta=3.0, clip_norm=100.0,
                                        precision="float64", ledger_path=None, forward_client_metrics=True,
                                        **common)
                new = strategy.start(grid=grid, initial_arrays=arrays, num_rounds=1).arrays
                runs.append((strategy, arrays, new))
                arrays = new
            return runs

        def too_few_finals():
            # six of ten nodes stop answering after committing to iteration 2
            dropping = RecordingGrid(grid, drop=lambda rnd, commit, party: party < 6 and commit >= 3)
            strategy = IncaStrategy(iterations=T, sigma_star=0.2, sigma_delta=3.0, min_finalists=6, seed=2,
                                    ledger_path=tmp / "few.json", **common)
            return strategy, strategy.start(grid=dropping, initial_arrays=ArrayRecord(INITIAL), num_rounds=1)

        def budget(name):
            recording = RecordingGrid(grid)
            strategy = IncaStrategy(iterations=4, sigma_star=1.0, sigma_delta=5.0, max_epsilon=BUDGET, seed=1,
                                    ledger_path=tmp / "budget.json", **common)
            models = {}

            def keep(rnd, arrays):
                models[rnd] = arrays
                return None

            try:
                strategy.start(grid=recording, initial_arrays=ArrayRecord(INITIAL), num_rounds=10,
                               train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=keep)
            except PrivacyBudgetExhausted as stop:  # Flower's exception, as its DP strategies raise
                return strategy, stop, models, recording.pushed
            raise AssertionError(f"{name}: training did not stop at the budget")

        def no_training():
            recording = RecordingGrid(grid)
            strategy = IncaStrategy(sigma_star=1.0, sigma_delta=5.0, ledger_path=None, fraction_train=0.0,
                                    **common)
            result = strategy.start(grid=recording, initial_arrays=ArrayRecord(INITIAL), num_rounds=2)
            return strategy, result, recording

        def keeping(models):
            def keep(rnd, arrays):
                models[rnd] = arrays
            return keep

        def hostile():
            plan.write_text(json.dumps(HOSTILE))
            try:
                strategy = IncaStrategy(iterations=3, sigma_star=0.2, sigma_delta=1.0, precision="float64",
                                        ledger_path=tmp / "hostile-ledger.json", forward_client_metrics=True,
                                        max_noise_inflation=float("inf"), seed=5, **common)
                models: dict = {}
                result = strategy.start(grid=grid, initial_arrays=ArrayRecord(INITIAL), num_rounds=3,
                                        evaluate_fn=keeping(models))
                return strategy, result, models
            finally:
                plan.write_text("{}")

        def post_charge():
            # after each round is charged: its trace cannot be saved (a directory under a file) and the
            # nodes' train metrics cannot be aggregated (one lacks "num-examples")
            blocker = tmp / "a-file"
            blocker.write_text("")
            strategy = IncaStrategy(iterations=3, sigma_star=0.2, sigma_delta=1.0, precision="float64",
                                    ledger_path=tmp / "post-ledger.json", trace_dir=blocker / "traces",
                                    forward_client_metrics=True, seed=6, **common)
            models: dict = {}
            result = strategy.start(grid=grid, initial_arrays=ArrayRecord(INITIAL), num_rounds=2,
                                    train_config=ConfigRecord({"omit-num-examples": OMIT_NUM_EXAMPLES}),
                                    evaluate_fn=keeping(models))
            return strategy, result, models

        _run(out, "hostile", hostile)
        _run(out, "post_charge", post_charge)
        _run(out, "started_twice", started_twice)
        _run(out, "too_few_finals", too_few_finals)
        _run(out, "budget", lambda: budget("first run"))
        _run(out, "restart", lambda: budget("restart"))  # a new ServerApp on the same ledger file
        _run(out, "no_training", no_training)

    try:
        _simulate(app, flower_apps.secure_client, ray_cluster[0])
    finally:
        os.environ.pop(flower_apps.HOSTILE_ENV, None)
        if before is None:
            os.environ.pop("FLWR_INCA_STATE_DIR", None)
        else:
            os.environ["FLWR_INCA_STATE_DIR"] = before
    # the root keeps only the zero-byte mark of the last stale-run scan (storage.SCAN_MARK)
    out["scan_mark"] = (node_state / SCAN_MARK).stat().st_size if (node_state / SCAN_MARK).exists() else None
    out["node_files"] = sorted(str(p.relative_to(node_state)) for p in node_state.rglob("*")
                               if p.is_file() and p.name != SCAN_MARK)
    out["node_dirs"] = sorted(str(p.relative_to(node_state)) for p in node_state.rglob("*") if p.is_dir())
    return out


def _outcome(scenarios, name):
    outcome = scenarios.get(name)
    if isinstance(outcome, Exception):
        raise outcome
    assert outcome is not None, f"scenario {name} did not run: see the ServerApp's log"
    return outcome


def test_strategy_started_twice_in_one_run_starts_each_round_afresh(scenarios):
    for strategy, old, new in _outcome(scenarios, "started_twice"):
        record = strategy.rounds[1]
        assert not record.failed and len(record.finalists) == NODES
        # sigma_star = 0, no dropouts: the round's update is exactly the mean of the local updates
        updates = []
        for node in record.roster:
            pid = int(record.client_metrics[node]["partition-id"])
            local = flower_apps.local_update(old.to_numpy_ndarrays(), pid, 1)
            updates.append(flatten_arrays(ArrayRecord(local))[0] - flatten_arrays(old)[0])
        assert np.allclose(record.update, np.mean(updates, axis=0), atol=1e-9)
        expected = (flatten_arrays(old)[0] + record.update).astype(np.float32)
        assert np.allclose(flatten_arrays(new)[0], expected)


def test_round_with_too_few_finals_fails_and_keeps_the_model(scenarios):
    strategy, result = _outcome(scenarios, "too_few_finals")
    metrics = strategy.train_metrics_serverapp[1]
    assert metrics["inca-round-failed"] == 1 and metrics["inca-finalists"] == NODES - 6
    assert metrics["inca-timeouts"] == 6 * (T - 2)  # commits 3..T; offline at T, they get no final request
    assert "final message" in strategy.rounds[1].failed
    # the model was never replaced: Result carries the initial model (Flower's own start leaves it empty)
    assert np.array_equal(flatten_arrays(result.arrays)[0], flatten_arrays(ArrayRecord(INITIAL))[0])
    assert strategy.ledger.rounds == 1 and metrics["inca-epsilon"] > 0  # the messages were exchanged


@pytest.mark.parametrize("resume", [False, True])
def test_budget_exhaustion_stops_cleanly_and_restart_resumes(scenarios, resume):
    strategy, stop, models, pushed = _outcome(scenarios, "budget")
    ledger, predicted = strategy.ledger, strategy.session.charged(strategy.inca.predicted_mu(NODES))
    costs = ledger.costs()
    assert isinstance(stop, IncaBudgetExhausted)
    if not resume:
        done = sorted(strategy.rounds)
        assert 1 <= len(done) < 10 and done == list(range(1, len(done) + 1))
        assert stop.round == len(done) + 1
        assert [e.round for e in ledger.entries] == done and not ledger.reservations()
        # every round started only when predicted affordable, then was charged its certified cost
        for r in done:
            assert ledger.accountant.epsilon(costs[:r - 1] + [RoundCost(predicted)], ledger.delta) <= BUDGET
            assert ledger.entries[r - 1].mu == strategy.rounds[r].mu
        assert ledger.epsilon() <= BUDGET  # never exceeded
        # and it stopped for a reason: the next round did not fit
        after = ledger.accountant.epsilon(costs + [RoundCost(predicted)], ledger.delta)
        assert stop.predicted_epsilon == pytest.approx(after) and after > BUDGET
        assert stop.epsilon == pytest.approx(ledger.epsilon())
        assert stop.epsilon == pytest.approx(strategy.privacy_spent().epsilon)
        # the exception hands over the global model of the last round
        last = flatten_arrays(models[len(done)])[0]
        assert np.array_equal(flatten_arrays(stop.arrays)[0], last) and np.any(last != 0)
    else:  # the restarted ServerApp found the spent budget and contacted no node
        again, restart_stop, _, restart_pushed = _outcome(scenarios, "restart")
        assert isinstance(restart_stop, IncaBudgetExhausted) and restart_stop.round == 1
        assert restart_pushed == 0 and again.rounds == {}
        assert again.ledger.rounds == ledger.rounds
        assert again.ledger.epsilon() == pytest.approx(ledger.epsilon())
        assert restart_stop.epsilon == pytest.approx(ledger.epsilon())


def test_fraction_train_zero_skips_training_as_fedavg_does(scenarios):
    strategy, result, recording = _outcome(scenarios, "no_training")
    assert result.train_metrics_clientapp == {} and strategy.rounds == {} and recording.pushed == 0


def _partitions(record):
    return sorted(int(m["partition-id"]) for m in record.client_metrics.values())


def test_hostile_nodes_are_excluded_and_never_stop_training_or_poison_the_model(scenarios):
    strategy, result, models = _outcome(scenarios, "hostile")
    assert sorted(strategy.rounds) == [1, 2, 3]
    for rnd, record in strategy.rounds.items():
        # the four bad join replies and the NaN model: excluded, named, every round; the others go on
        assert _partitions(record) == [5, 6, 7, 8, 9] and len(record.excluded) == 5
        reasons = sorted(record.excluded.values())
        for words in ("no public key", "must be bytes, got str", "32 bytes (X25519), got 33",
                      "dimension 18, the model has 17", "NaN or infinite values"):
            assert sum(words in r for r in reasons) == 1, (words, reasons)
        assert strategy.train_metrics_serverapp[rnd]["inca-excluded-nodes"] == 5
    # round 2: a final message times 1e300 (finite): the guard fails the round, the model is kept, the
    # round is charged
    two = strategy.rounds[2]
    assert "max_update_norm" in two.failed and strategy.train_metrics_serverapp[2]["inca-round-failed"] == 1
    assert np.array_equal(flatten_arrays(models[2])[0], flatten_arrays(models[1])[0])
    # round 3: a final message with a negative weight is refused by the relay: left out of the average
    three = strategy.rounds[3]
    sender = next(i for i, node in enumerate(three.roster)
                  if three.client_metrics[node]["partition-id"] == 6)
    assert not three.failed and sender not in three.finalists and len(three.finalists) == 4
    # refused at the final report; an invalid reply excludes its node from the rest of the round
    assert strategy.train_metrics_serverapp[3]["inca-invalid-replies"] == 1
    assert list(three.offenders) == [three.roster[sender]]
    assert strategy.ledger.rounds == 3 and all(e.mu > 0 for e in strategy.ledger.entries)
    final = flatten_arrays(result.arrays)[0]
    assert np.all(np.isfinite(final)) and np.linalg.norm(final - flatten_arrays(models[2])[0]) < 2.0


def test_failures_after_the_charge_lose_neither_the_charge_nor_the_model(scenarios):
    strategy, result, models = _outcome(scenarios, "post_charge")
    assert sorted(strategy.rounds) == [1, 2] and strategy.ledger.rounds == 2  # training went on
    previous = flatten_arrays(ArrayRecord(INITIAL))[0]
    for rnd, record in strategy.rounds.items():
        assert not record.failed and strategy.ledger.entries[rnd - 1].mu == record.mu > 0
        errors = record.post_charge_errors
        assert len(errors) == 2 and strategy.train_metrics_serverapp[rnd]["inca-post-charge-errors"] == 2
        assert "saving the trace failed: NotADirectoryError" in errors[0]
        assert "aggregating the nodes' train metrics failed: KeyError" in errors[1]
        # the round's model was applied: previous global model + the averaged update
        current = flatten_arrays(models[rnd])[0]
        assert np.allclose(current, (previous + record.update).astype(np.float32))
        previous = current
    assert np.array_equal(flatten_arrays(result.arrays)[0], previous)
    assert math.isfinite(strategy.ledger.epsilon())


def test_nodes_remove_their_run_data_when_the_run_is_over(scenarios):
    # every strategy.start ended by telling its nodes; they removed their data of the run (the value,
    # the noise drawn ahead, the states), and the last one the run's directory
    assert scenarios["node_files"] == [] and scenarios["node_dirs"] == [] and scenarios["scan_mark"] == 0
