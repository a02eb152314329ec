"""IncaStrategy and IncaClient without a simulation: settings, Flower's hooks, the round's privacy
bookkeeping, the exchange loop's deadline, and the client's mods."""

import math
import time
import warnings

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp import PrivacySpent  # noqa: E402
from flwr.serverapp.exception import PrivacyBudgetExhausted  # noqa: E402
from noise_reference import brute_noise_std  # noqa: E402

from flwr_inca import IncaConfig, TemporaryDropout  # noqa: E402
from flwr_inca.flower import (  # noqa: E402
    IncaBudgetExhausted,
    IncaStrategy,
    MixingConfig,
    PersistenceConfig,
    PrivacyTarget,
    RelayConfig,
)
from flwr_inca.privacy import BudgetExceededError, PrivacyLedger, RoundCost  # noqa: E402
from flwr_inca.protocol import sample_trace  # noqa: E402

SIGMAS = {"sigma_star": 1.0, "sigma_delta": 5.0, "ledger_path": None}


@pytest.mark.parametrize("kwargs, name", [
    ({"clip_norm": 0.0}, "clip_norm"),
    ({"sample_rate": 1.5}, "sample_rate"),
    ({"collusion": 1.0}, "collusion"),
    ({"observed_fraction": -0.1}, "observed_fraction"),
    ({"min_finalists": 0}, "min_finalists"),
    ({"exchange_timeout": 0}, "exchange_timeout"),
    ({"precision": "float16"}, "precision"),
    ({"threat_draws": 0}, "threat_draws"),
    ({"iterations": 0}, "iterations"),
    ({"sigma_star": -1.0}, "sigma_star"),
    ({"delta": 1.0}, "delta"),
    ({"max_noise_inflation": 0.5}, "max_noise_inflation"),
    ({"budget_check_runs": True}, "budget_check_runs"),
    ({"final_retries": -1}, "final_retries"),
    ({"poll_interval": 100.0}, "poll_interval"),
    ({"seed": -3}, "seed"),
])
def test_bad_parameters_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        IncaStrategy(**{**SIGMAS, **kwargs})


def test_settings_come_as_groups_or_as_flat_keywords():
    flat = IncaStrategy(iterations=7, epsilon=0.5, delta=1e-6, collusion=0.2, exchange_timeout=5.0,
                        ledger_path=None, precision="float64")
    grouped = IncaStrategy(mixing=MixingConfig(iterations=7, precision="float64"),
                           privacy=PrivacyTarget(epsilon=0.5, delta=1e-6, collusion=0.2),
                           relay=RelayConfig(exchange_timeout=5.0),
                           persistence=PersistenceConfig(ledger_path=None))
    for group in ("privacy", "mixing", "relay", "persistence"):
        assert getattr(flat, group) == getattr(grouped, group)
    assert flat.mixing.iterations == 7 and flat.privacy.sensitivity == 2.0  # 2 * clip_norm by default
    with pytest.raises(ValueError, match=r"\['iterations'\] either as keywords or in mixing="):
        IncaStrategy(mixing=MixingConfig(sigma_star=1.0, sigma_delta=1.0), iterations=3, ledger_path=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'iteratons'"):
        IncaStrategy(**SIGMAS, iteratons=3)
    with pytest.raises(ValueError, match="mixing must be a MixingConfig"):
        IncaStrategy(mixing={"iterations": 3}, **SIGMAS)
    with pytest.raises(AttributeError):  # frozen
        flat.mixing.iterations = 3
    with pytest.raises(ValueError, match="give both sigma_star and sigma_delta"):
        MixingConfig(sigma_star=1.0)
    with pytest.raises(ValueError, match="epsilon to calibrate"):
        IncaStrategy(ledger_path=None)


def test_accountant_that_cannot_handle_subsampling_is_refused_before_any_round():
    with pytest.raises(ValueError, match="sample_rate"):
        IncaStrategy(**SIGMAS, sample_rate=0.1, accountant="exact")
    assert IncaStrategy(**SIGMAS, sample_rate=0.1).ledger.accountant.name == "opacus-prv"
    assert IncaStrategy(**SIGMAS).ledger.accountant.name == "exact"
    with pytest.warns(DeprecationWarning, match="'gdp' is now called 'exact'"):
        assert IncaStrategy(**SIGMAS, accountant="gdp").ledger.accountant.name == "exact"


def test_budget_error_speaks_flowers_vocabulary():
    assert issubclass(IncaBudgetExhausted, PrivacyBudgetExhausted)
    assert issubclass(IncaBudgetExhausted, BudgetExceededError)


def _trace(n=8, T=4, seed=1, dropout=None):
    config = IncaConfig(iterations=T, neighbors=1, sigma_star=1.0, sigma_delta=5.0, dropout=dropout)
    return sample_trace(n, config, seed=seed)


def test_a_round_that_cannot_be_certified_is_recorded_as_unbounded(monkeypatch):
    strategy = IncaStrategy(**SIGMAS)

    def broken(trace, seeds):
        raise np.linalg.LinAlgError("SVD did not converge")

    monkeypatch.setattr(strategy, "_certify", broken)
    with pytest.raises(np.linalg.LinAlgError):
        strategy._certify_and_spend(_trace(), 1)
    assert strategy.ledger.rounds == 1 and math.isinf(strategy.ledger.epsilon())


def test_certified_round_is_spent_in_the_ledger_and_reported_as_flower_does():
    strategy = IncaStrategy(**SIGMAS, collusion=0.2, threat_draws=2)
    mu, eps = strategy._certify_and_spend(_trace(), 1)
    assert 0 < mu < math.inf and strategy.ledger.rounds == 1
    assert eps == pytest.approx(strategy.ledger.epsilon())
    spent = strategy.privacy_spent()
    assert isinstance(spent, PrivacySpent)
    assert (spent.epsilon, spent.delta) == (eps, 1e-5)
    assert (spent.num_releases, spent.accounting_method) == (1, "exact")


def test_certification_draws_are_seeded_per_round_and_reproducible():
    trace = _trace(n=12)
    a = IncaStrategy(**SIGMAS, seed=4, collusion=0.3, threat_draws=2)
    b = IncaStrategy(**SIGMAS, seed=4, collusion=0.3, threat_draws=2)
    forward = [a._certify_and_spend(trace, r)[0] for r in (1, 2, 3)]
    backward = [b._certify_and_spend(trace, r)[0] for r in (3, 2, 1)]
    assert forward == backward[::-1]  # a round's draws depend on the round, not on what came before
    assert a.predicted_mu(10) == b.predicted_mu(10) > 0


@pytest.mark.parametrize("schedule_seed", [1, 2, 3])
def test_lost_final_messages_fail_the_round_when_they_leave_noise_uncancelled(schedule_seed):
    # the decision is checked against a brute-force noise std (literal Algorithm 2 with unit impulses)
    trace = _trace(n=8, T=4, seed=schedule_seed, dropout=TemporaryDropout(0.2))
    online_T = trace.steps[-1].online.tolist()
    roster = [100 + i for i in range(8)]
    full = brute_noise_std(trace, online_T)
    strict = IncaStrategy(**SIGMAS, max_noise_inflation=2.0)
    noise, why = strict._noise_check(trace, online_T, roster)
    assert why == "" and noise == pytest.approx(full, rel=1e-9)
    for lost in online_T:
        finalists = [i for i in online_T if i != lost]
        brute = brute_noise_std(trace, finalists)
        noise, why = strict._noise_check(trace, finalists, roster)
        assert noise == pytest.approx(brute, rel=1e-9)
        if brute > 2.0 * full * (1 + 1e-9):
            assert f"[{roster[lost]}]" in why and "max_noise_inflation" in why
        elif brute < 2.0 * full * (1 - 1e-9):
            assert why == ""
        # a tolerant setting accepts the same round
        lenient = IncaStrategy(**SIGMAS, max_noise_inflation=brute / full * 1.01)
        assert lenient._noise_check(trace, finalists, roster)[1] == ""
    # with sigma_delta = 5 sigma_star a lost final leaves a large uncancelled share: some loss fails
    assert any(strict._noise_check(trace, [i for i in online_T if i != lost], roster)[1] for lost in online_T)


def test_integer_arrays_are_neither_clipped_nor_averaged():
    from flwr_inca.flower.shared import clip, flatten_arrays, unflatten_arrays

    old = ArrayRecord({"w": Array(np.zeros(4, dtype=np.float32)),
                       "count": Array(np.array(7, dtype=np.int64))})
    new = ArrayRecord({"w": Array(np.full(4, 0.05, dtype=np.float32)),
                       "count": Array(np.array(107, dtype=np.int64))})
    v_old, spec = flatten_arrays(old)
    v_new, _ = flatten_arrays(new)
    assert v_old.size == 4  # the counter is not part of the private vector
    update = clip(v_new - v_old, 1.0)
    assert np.allclose(update, 0.05, atol=1e-8)  # the counter's +100 does not eat the clipping norm
    out = unflatten_arrays(v_old + update, spec, keep=old)
    assert out["count"].numpy() == 7 and out["count"].numpy().dtype == np.int64
    assert np.allclose(out["w"].numpy(), 0.05)
    with pytest.raises(ValueError, match="count"):
        unflatten_arrays(v_old, spec)


def test_shared_names_are_still_importable_from_their_old_modules():
    from flwr_inca.flower import client, node, shared, storage

    for name in ("INCA_KEY", "MIX_ACTION", "flatten_arrays", "unflatten_arrays", "clip"):
        assert getattr(client, name) is getattr(shared, name)
    assert node.RoundParams is shared.RoundParams
    for name in ("NodeStore", "MemoryStore", "DirectoryStore", "StoredNoise"):
        assert getattr(node, name) is getattr(storage, name)


# ------------------------------------------------------------------------------ Flower's hooks
@pytest.fixture
def task_identity(monkeypatch):
    """Flower sets these in a running app; messages cannot be created without them."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 1), ("_node_id", 5), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


class FakeGrid:
    """Node ids and a push/pull mailbox; ``answer(msg, message_id)`` returns a reply, or None for a node
    that never answers."""

    def __init__(self, nodes=10, answer=None):
        self.nodes, self.answer, self.pushed, self.outbox = list(range(1, nodes + 1)), answer, [], {}

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            ids.append(f"m{len(self.pushed)}")
            self.pushed.append(msg)
            reply = self.answer(msg, ids[-1]) if self.answer else None
            if reply is not None:
                self.outbox[ids[-1]] = reply
        return ids

    def pull_messages(self, ids):
        return [self.outbox.pop(i) for i in list(ids) if i in self.outbox]


def test_fraction_train_zero_skips_training_as_fedavg_does(task_identity):
    strategy = IncaStrategy(**SIGMAS, fraction_train=0.0)
    grid = FakeGrid()
    assert list(strategy.configure_train(1, ArrayRecord([np.zeros(3)]), ConfigRecord(), grid)) == []
    assert strategy.aggregate_train(1, []) == (None, None)
    assert grid.pushed == [] and strategy.rounds == {} and strategy.ledger.rounds == 0
    with pytest.raises(ValueError, match="not configured"):
        strategy.aggregate_train(2, [object()])


def test_exhausted_budget_stops_before_any_node_is_contacted(tmp_path, task_identity):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(path, delta=1e-5, max_epsilon=4.0)
    strategy = IncaStrategy(sigma_star=1.0, sigma_delta=5.0, max_epsilon=4.0, ledger_path=path, seed=1,
                            min_available_nodes=10, min_train_nodes=10)
    mu = strategy.predicted_mu(10)
    while ledger.epsilon_after(mu) <= 4.0:  # spend up to, but not past, the point where one more round fits
        ledger.spend(mu)
    strategy = IncaStrategy(sigma_star=1.0, sigma_delta=5.0, max_epsilon=4.0, ledger_path=path, seed=1,
                            min_available_nodes=10, min_train_nodes=10)
    grid, model = FakeGrid(), ArrayRecord([np.ones(3)])
    with pytest.raises(IncaBudgetExhausted) as info:
        strategy.configure_train(ledger.rounds + 1, model, ConfigRecord(), grid)
    stop = info.value
    assert stop.server_round == ledger.rounds + 1 and stop.arrays is model
    assert stop.epsilon == pytest.approx(ledger.epsilon()) and stop.max_epsilon == 4.0
    assert stop.predicted_epsilon == pytest.approx(ledger.epsilon_after(mu)) and stop.predicted_epsilon > 4.0
    assert strategy.ledger.rounds == ledger.rounds and grid.pushed == []
    # one round less spent: the same strategy lets the round start
    ledger2 = PrivacyLedger(tmp_path / "l2.json", delta=1e-5, max_epsilon=4.0)
    for cost in ledger.costs()[:-1]:
        ledger2.spend(cost.mu)
    fresh = IncaStrategy(sigma_star=1.0, sigma_delta=5.0, max_epsilon=4.0, ledger_path=tmp_path / "l2.json",
                         seed=1, min_available_nodes=10, min_train_nodes=10)
    messages = list(fresh.configure_train(ledger2.rounds + 1, model, ConfigRecord(), grid))
    assert len(messages) == 10 and all("inca" in m.content.config_records for m in messages)


def test_overrun_budget_stops_the_next_round(tmp_path, task_identity):
    ledger = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5)
    ledger.spend(50.0)  # a round whose certified cost overran the prediction
    strategy = IncaStrategy(**{**SIGMAS, "ledger_path": tmp_path / "ledger.json"}, max_epsilon=3.0)
    with pytest.raises(IncaBudgetExhausted, match="brought epsilon to") as info:
        strategy.configure_train(2, ArrayRecord([np.ones(3)]), ConfigRecord(), FakeGrid())
    assert info.value.predicted_epsilon == math.inf


def test_server_metrics_in_train_metrics_are_deprecated():
    from flwr_inca.flower.strategy import _Joined

    strategy = IncaStrategy(**SIGMAS, forward_client_metrics=True)
    joined = _Joined(metrics={1: MetricRecord({"num-examples": 1, "loss": 2.0}),
                              2: MetricRecord({"num-examples": 1, "loss": 4.0})})
    record = strategy._train_metrics(MetricRecord({"inca-epsilon": 0.5}), joined)
    with pytest.warns(FutureWarning, match="train_metrics_serverapp"):
        assert record["inca-epsilon"] == 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert record["loss"] == 3.0 and "inca-epsilon" in record and repr(record)


def test_exchange_returns_at_the_deadline_without_the_silent_nodes(task_identity):
    # the relay's timeout path, deterministically: node 3 never answers
    from types import SimpleNamespace

    def reply(msg, message_id):
        metadata = SimpleNamespace(reply_to_message_id=message_id)
        return SimpleNamespace(node=msg.metadata.dst_node_id, metadata=metadata)

    def answer(msg, message_id):
        return None if msg.metadata.dst_node_id == 3 else reply(msg, message_id)

    strategy = IncaStrategy(**SIGMAS, exchange_timeout=0.2)
    grid = FakeGrid(answer=answer)
    messages = [Message(RecordDict(), dst_node_id=node, message_type="train") for node in (1, 2, 3)]
    start = time.monotonic()
    replies = strategy._send_and_receive(grid, messages, timeout=0.2)
    assert sorted(r.node for r in replies) == [1, 2]
    assert time.monotonic() - start >= 0.2  # it waited for node 3 until the deadline
    start = time.monotonic()  # when every node answers, it returns without waiting for the deadline
    assert len(strategy._send_and_receive(FakeGrid(answer=reply), messages, timeout=600.0)) == 3
    assert time.monotonic() - start < 300.0


# ------------------------------------------------------------------------------ client side
def _join_message(message_type="train"):
    inca = ConfigRecord({"round": 1, "clip-norm": 1.0, "iterations": 2, "arrays-key": "arrays",
                         "forward-metrics": True})
    content = RecordDict({"arrays": ArrayRecord([np.zeros(3, dtype=np.float32)]), "config": ConfigRecord(),
                          "inca": inca})
    msg = Message(content, dst_node_id=5, message_type=message_type)
    msg.metadata.__dict__["_message_id"] = "join-1"
    return msg


def _train(msg, context):
    """A train function that moves the model by (3, 0, 0): norm 3, clipped to 1 by IncA."""
    new = [a + np.array([3.0, 0.0, 0.0], dtype=a.dtype) for a in msg.content["arrays"].to_numpy_ndarrays()]
    return Message(RecordDict({"arrays": ArrayRecord(new), "metrics": MetricRecord({"num-examples": 1})}),
                   reply_to=msg)


def test_inca_train_forwards_action_and_mods(task_identity, tmp_path):
    from flwr.clientapp import ClientApp

    from flwr_inca.flower import IncaClient

    app = ClientApp()
    inca = IncaClient(app, state_dir=tmp_path)
    seen = []

    def mod(msg, context, call_next):  # a function-level mod sees the train function's own reply
        reply = call_next(msg, context)
        seen.append(sorted(reply.content.array_records))
        return reply

    registered = inca.train("finetune", mods=[mod])(_train)
    assert registered is _train  # registered unchanged, as @app.train does
    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    reply = app._registered_funcs["train.finetune"](_join_message("train.finetune"), context)
    assert seen == [["arrays"]]
    assert reply.content.array_records == {}
    assert set(reply.content.config_records["inca"]) == {"public-key", "dim"}
    assert reply.content.metric_records["metrics"]["num-examples"] == 1  # forward-metrics
    kept = inca.store(context).load_value(1)
    assert np.allclose(kept, [1.0, 0.0, 0.0])  # the clipped update stays on the node
    # a plain FedAvg message passes through the join unchanged
    plain = _join_message()
    del plain.content["inca"]
    assert sorted(app._registered_funcs["train.finetune"](plain, context).content.array_records) == ["arrays"]


@pytest.mark.parametrize("dp_mod", ["fixedclipping_mod", "LocalDpMod"])
def test_flowers_client_dp_mods_cannot_be_combined_with_inca(dp_mod, task_identity, tmp_path):
    # as documented in flwr_inca.flower.client: they read the legacy fit layout of the model
    from flwr.client import mod as flower_mods
    from flwr.clientapp import ClientApp

    from flwr_inca.flower import IncaClient

    if dp_mod == "fixedclipping_mod":
        mod = flower_mods.fixedclipping_mod
    else:
        mod = flower_mods.LocalDpMod(1.0, 1.0, 1.0, 1e-5)
    app = ClientApp()
    IncaClient(app, state_dir=tmp_path).train(mods=[mod])(_train)
    context = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(KeyError, match="fitins"):
        app._registered_funcs["train.default"](_join_message(), context)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_inca_client_rejects_a_bad_noise_ahead_budget(value):
    from flwr.clientapp import ClientApp

    from flwr_inca.flower import IncaClient

    with pytest.raises(ValueError, match="noise_ahead_bytes"):
        IncaClient(ClientApp(), noise_ahead_bytes=value)


def test_round_costs_compose_in_the_ledger_the_strategy_uses():
    strategy = IncaStrategy(**SIGMAS)
    costs = [strategy._certify_and_spend(_trace(seed=s), s)[0] for s in (1, 2)]
    assert strategy.ledger.costs() == [RoundCost(c) for c in costs]


def test_flowers_result_has_no_field_for_server_side_train_metrics():
    # why IncA's metrics live in IncaStrategy.train_metrics_serverapp: Flower's Result records only
    # aggregate_train's MetricRecord (train_metrics_clientapp). If this fails, Flower added a field:
    # move IncA's metrics there.
    from dataclasses import fields

    from flwr.serverapp.strategy import Result

    assert {f.name for f in fields(Result)} == {
        "arrays", "train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp"}


def test_start_returns_the_initial_model_when_no_round_changed_it(task_identity, caplog):
    class Grid(FakeGrid):
        def send_and_receive(self, messages, timeout=None):
            return []

    model = ArrayRecord([np.arange(3.0)])
    for rounds in (0, 2):  # no round at all; rounds that trained nobody (fraction_train=0)
        strategy = IncaStrategy(**SIGMAS, fraction_train=0.0, fraction_evaluate=0.0)
        result = strategy.start(grid=Grid(), initial_arrays=model, num_rounds=rounds)
        assert result.arrays is model
    assert "Result.arrays is the initial model" in caplog.text
