import json
import math
import zlib

import numpy as np
import pytest
from reference import algorithm2, brute_force_mu, delivered_matrices, party_rows

from flwr_inca import (
    ExecutionTrace,
    IncaConfig,
    InjectionSchedule,
    MarkovDropout,
    PermanentDropout,
    ScheduledDropout,
    TemporaryDropout,
    replay,
    run_inca,
)
from flwr_inca.privacy import certify, random_collusion, random_eavesdrop
from flwr_inca.protocol import ExplicitNoise, adapted_rows, sample_trace


@pytest.mark.parametrize("T", [1, 2, 5, 20])
@pytest.mark.parametrize("make", [InjectionSchedule.incremental, InjectionSchedule.early])
def test_builtin_schedules_are_valid(make, T):
    s = make(T)
    s.validate()
    assert s.c.shape == (T + 1,) and s.Z.shape == (T + 1, T)
    assert np.isclose(s.c.sum(), 1.0)
    assert np.allclose(s.Z.sum(axis=0), 0.0)


def test_incremental_matches_paper_example():
    s = InjectionSchedule.incremental(3)
    # v_0 = u/4 + eta_1 ; v_1 = u/4 - eta_1 + eta_2 ; v_3 = u/4 - eta_3
    assert np.allclose(s.c, 0.25)
    assert s.Z[0].tolist() == [1, 0, 0]
    assert s.Z[1].tolist() == [-1, 1, 0]
    assert s.Z[3].tolist() == [0, 0, -1]
    assert s.is_incremental_pattern
    assert not InjectionSchedule.early(3).is_incremental_pattern


def test_early_matches_paper_example():
    s = InjectionSchedule.early(3)
    assert s.c.tolist() == [1, 0, 0, 0]
    assert s.Z[0].tolist() == [1, 1, 1]
    assert s.Z[2].tolist() == [0, -1, 0]


@pytest.mark.parametrize(
    "c, Z, condition",
    [
        ([0.5, 0.4], [[1.0], [-1.0]], "condition (i): sum of c"),
        ([0.5, 0.5], [[1.0], [-0.5]], "condition (i): every column of Z"),
        # [c | Z] singular: c proportional to ... rows [0.5, 1] and [0.5, -1] are independent; make them dependent
        ([0.5, 0.5, 0.0], [[1.0, 1.0], [-1.0, -1.0], [0.0, 0.0]], "condition (ii)"),
        ([1.0, 0.0, 0.0], [[1.0, 0.0], [2.0, 0.0], [-3.0, 0.0]], "condition (ii)"),
    ],
)
def test_custom_schedule_names_failed_condition(c, Z, condition):
    with pytest.raises(ValueError, match=condition.replace("(", r"\(").replace(")", r"\)")):
        InjectionSchedule.custom(c, Z)


def test_singular_z_without_last_row_is_rejected(rng):
    # With condition (i) the last row of Z is minus the sum of the others, so a null vector of
    # Z[:-1] is one of Z too: whenever (iii) fails, (ii) fails as well and is reported first.
    T = 4
    for _ in range(20):
        top = rng.standard_normal((T, T))
        top[:, -1] = top[:, :-1] @ rng.standard_normal(T - 1)  # Z[:-1] singular
        Z = np.vstack([top, -top.sum(axis=0)])
        c = np.full(T + 1, 1.0 / (T + 1))
        with pytest.raises(ValueError, match=r"Valid condition \(ii\)"):
            InjectionSchedule.custom(c, Z)


def test_custom_schedule_shape_errors():
    with pytest.raises(ValueError, match="shape"):
        InjectionSchedule.custom([0.5, 0.5], [[1.0, 0.0], [-1.0, 0.0]])
    with pytest.raises(ValueError, match="finite"):
        InjectionSchedule.custom([0.5, np.nan], [[1.0], [-1.0]])
    with pytest.raises(ValueError, match="iterations"):
        InjectionSchedule.incremental(0)


def test_custom_valid_schedule_round_trips_json():
    c = np.array([0.2, 0.3, 0.5])
    Z = np.array([[1.0, 0.5], [-2.0, 1.0], [1.0, -1.5]])
    s = InjectionSchedule.custom(c, Z)
    back = InjectionSchedule.from_json(s.to_json(), 2)
    assert np.array_equal(back.c, c) and np.array_equal(back.Z, Z)
    assert InjectionSchedule.from_json("incremental", 4).name == "incremental"
    with pytest.raises(ValueError):
        InjectionSchedule.from_json({"c": [1.0]}, 2)


@pytest.mark.parametrize("make", [InjectionSchedule.incremental, InjectionSchedule.early])
def test_adapted_rows_match_reference_reading_of_spec(make, rng):
    T, n = 6, 9
    s = make(T)
    online = rng.random((T + 1, n)) > 0.35
    online[0] = True
    c_o, Z_o = adapted_rows(s, online)
    for i in range(n):
        cs, zs = party_rows(s.c, s.Z, online[:, i].tolist())
        assert np.allclose(c_o[:, i], cs)
        assert np.allclose(Z_o[:, i, :], np.array(zs))
        if online[T, i]:  # everything injected is cancelled
            assert np.allclose(Z_o[:, i, :].sum(axis=0), 0.0)


def test_incremental_dropout_injects_one_share_per_online_step(rng):
    T, n = 8, 5
    online = rng.random((T + 1, n)) > 0.4
    online[0] = True
    c_o, Z_o = adapted_rows(InjectionSchedule.incremental(T), online)
    assert np.allclose(c_o.sum(axis=0), online.sum(axis=0) / (T + 1))
    # at most one noise term outstanding after every step
    outstanding = np.cumsum(Z_o, axis=0)
    assert np.all((np.abs(outstanding) > 1e-12).sum(axis=2) <= 1)


# ---------------------------------------------------------------------------------------- value-free tail
# D_Inc with the value injected over steps 0..T-L and none at the last L steps (benchmarks/bench_schedules.py)
TAIL_CASES = [(1, 1), (4, 1), (6, 3), (6, 6), (10, 3)]


@pytest.mark.parametrize("T, L", TAIL_CASES)
def test_tail_schedule_is_valid_and_keeps_dinc_noise(T, L):
    s = InjectionSchedule.incremental(T, tail=L)
    s.validate()
    assert s.name == f"incremental:tail={L}" and s.tail == L
    assert np.isclose(s.c.sum(), 1.0)
    assert np.allclose(s.c[: T + 1 - L], 1.0 / (T + 1 - L)) and np.all(s.c[T + 1 - L:] == 0)
    assert np.array_equal(s.Z, InjectionSchedule.incremental(T).Z) and s.is_incremental_pattern
    assert InjectionSchedule.incremental(T, tail=0).name == "incremental"
    assert InjectionSchedule.incremental(T).tail == 0 and InjectionSchedule.early(T).tail is None


def test_tail_schedule_spec_and_errors():
    s = InjectionSchedule.resolve("incremental:tail=2", 5)
    assert s.name == "incremental:tail=2" and np.array_equal(s.c, InjectionSchedule.incremental(5, tail=2).c)
    with pytest.raises(ValueError, match=r"tail \(value-free last steps\) must be an integer in \[0, 5\], got 6"):
        InjectionSchedule.resolve("incremental:tail=6", 5)
    for bad in ("incremental:tail=", "incremental:tail=-1", "incremental:3", "tail=2"):
        with pytest.raises(ValueError, match="incremental:tail=L"):
            InjectionSchedule.resolve(bad, 5)
    with pytest.raises(ValueError, match="tail"):
        InjectionSchedule.incremental(5, tail=True)


def test_tail_schedule_json_is_c_and_z_and_is_recognized_again():
    s = InjectionSchedule.incremental(7, tail=2)
    obj = s.to_json()
    # written as {c, Z}: readers without the tail schedule load it as a custom schedule
    assert set(obj) == {"c", "Z"}
    back = InjectionSchedule.from_json(json.loads(json.dumps(obj)), 7)
    assert back.name == "incremental:tail=2" and np.array_equal(back.c, s.c) and np.array_equal(back.Z, s.Z)
    # a custom (c, Z) that is not exactly a tail schedule keeps its name
    c = s.c.copy()
    c[0] += 1e-3
    c[1] -= 1e-3
    assert InjectionSchedule.from_json({"c": c.tolist(), "Z": s.Z.tolist()}, 7).name == "custom"
    assert InjectionSchedule.from_json("incremental:tail=2", 7).name == "incremental:tail=2"


def test_tail_adapted_rows_inject_nothing_in_the_tail(rng):
    T, n, L = 8, 30, 3
    s = InjectionSchedule.incremental(T, tail=L)
    online = np.ones((T + 1, n), dtype=bool)
    when = rng.integers(1, T + 1, size=n)
    online[:, :] = np.arange(T + 1)[:, None] < when[None, :]
    online[:, : n // 2] = True  # half stay online
    c_o, Z_o = adapted_rows(s, online)
    for i in range(n):
        cs, zs = party_rows(s.c, s.Z, online[:, i].tolist())
        assert np.allclose(c_o[:, i], cs) and np.allclose(Z_o[:, i, :], np.array(zs))
    assert np.all(c_o[T + 1 - L:] == 0)
    # a party online through step T - L has injected its whole value, even if it drops out in the tail
    assert np.allclose(c_o.sum(axis=0)[when > T - L], 1.0)


TAIL_DROPOUTS = [None, PermanentDropout(0.3), TemporaryDropout(0.3), MarkovDropout(0.3, 0.5),
                 ScheduledDropout({1: [0, 2], 3: [1]})]
TAIL_DROPOUT_IDS = ["none", "permanent", "temporary", "markov", "scheduled"]


@pytest.mark.parametrize("dropout", [None, TemporaryDropout(0.3), MarkovDropout(0.2, 0.5, recover_by_end=True)],
                         ids=["none", "temporary", "markov"])
def test_tail_noise_cancels_exactly_without_permanent_dropouts(dropout, rng):
    n, d, T = 16, 4, 7
    x = rng.random((n, d))
    config = IncaConfig(iterations=T, neighbors=2, sigma_star=0.0, sigma_delta=1e3,
                        schedule=InjectionSchedule.incremental(T, tail=3), dropout=dropout)
    result = run_inca(x, config, seed=3)
    assert result.finalists.size == n
    weighted = (result.injected[:, None] * x).sum(axis=0) / result.injected.sum()
    assert np.max(np.abs(result.estimate - weighted)) < 1e-9
    if dropout is None:
        assert np.allclose(result.injected, 1.0) and np.max(np.abs(result.estimate - x.mean(axis=0))) < 1e-9


@pytest.mark.parametrize("dropout", TAIL_DROPOUTS, ids=TAIL_DROPOUT_IDS)
def test_tail_engine_agrees_with_algorithm2(dropout, rng, monkeypatch):
    from flwr_inca.protocol import engine

    fast = []
    original = engine._Mixing._fast_incremental_step
    monkeypatch.setattr(engine._Mixing, "_fast_incremental_step",
                        lambda self, t, W: (fast.append(t), original(self, t, W)))
    for trial in range(4):
        n, T, d, L = 10 + trial, 6, 3, 1 + trial % 3
        fast.clear()
        schedule = InjectionSchedule.incremental(T, tail=L)
        x = rng.random((n, d))
        eta_star, eta = rng.standard_normal((n, d)), rng.standard_normal((n, T, d))
        config = IncaConfig(iterations=T, neighbors=2, sigma_star=0.7, sigma_delta=3.0, schedule=schedule,
                            dropout=dropout)
        result = run_inca(x, config, seed=trial, noise=ExplicitNoise(eta_star, eta))
        trace = result.trace
        # the delivered W^O_t are valid "attempted" matrices: Algorithm 2 then changes nothing in them
        y_ref, omega_ref = algorithm2(x, schedule.c, schedule.Z, delivered_matrices(trace), trace.online_mask(),
                                      0.7, 3.0, eta_star, eta)
        assert np.allclose(result.final_messages, y_ref, atol=1e-10, rtol=1e-10)
        assert np.allclose(result.weights, omega_ref, atol=1e-12)
        # everybody online at every step: the fast D_Inc step although c is not constant
        online = trace.online_mask()
        first_off = int(np.argmin(online.all(axis=1))) if not online.all() else T + 1
        assert fast == list(range(1, first_off))


@pytest.mark.parametrize("dropout", [None, PermanentDropout(0.25), TemporaryDropout(0.3)],
                         ids=["none", "permanent", "temporary"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tail_trace_round_trip_and_bit_exact_replay(tmp_path, dropout, dtype, rng):
    x = rng.random((25, 5)).astype(dtype)
    config = IncaConfig(iterations=8, sigma_star=0.3, sigma_delta=4.0, dropout=dropout,
                        schedule="incremental:tail=3")
    result = run_inca(x, config, seed=11)
    path = tmp_path / "trace.json"
    result.trace.save(path)
    raw = json.loads(path.read_text())
    assert raw["format"] == "inca-trace/1" and set(raw["schedule"]) == {"c", "Z"}
    loaded = ExecutionTrace.load(path)
    assert loaded == result.trace and loaded.schedule.name == "incremental:tail=3"
    again = replay(loaded, x, seed=11)
    assert np.array_equal(again.estimate, result.estimate)
    assert np.array_equal(again.final_messages, result.final_messages)
    assert np.array_equal(again.weights, result.weights)


@pytest.mark.parametrize("dropout", TAIL_DROPOUTS, ids=TAIL_DROPOUT_IDS)
@pytest.mark.parametrize("threat", ["collusion", "eavesdrop"])
def test_tail_certificate_matches_brute_force(dropout, threat):
    # deterministic cases: the same in every process (str hashes are salted per process)
    rng = np.random.default_rng(zlib.crc32(f"{dropout!r}|{threat}".encode()))
    for trial in range(5):
        n = int(rng.integers(5, 9))
        T = int(rng.integers(3, 6))
        L = int(rng.integers(1, T + 1))
        s_star, s_delta = [(0.4, 2.0), (0.05, 40.0), (1.5, 0.2)][trial % 3]
        config = IncaConfig(iterations=T, neighbors=int(rng.integers(1, 3)), sigma_star=s_star, sigma_delta=s_delta,
                            schedule=InjectionSchedule.incremental(T, tail=L), dropout=dropout)
        trace = sample_trace(n, config, seed=trial)
        view = random_collusion(trace, 0.3, seed=trial) if threat == "collusion" else \
            random_eavesdrop(trace, 0.5, seed=trial)
        brute = brute_force_mu(trace, view.corrupted, view.observed, s_star, s_delta)
        for method in ("structured", "dense"):
            cert = certify(trace, view, method=method, solver="exact")
            assert set(cert.mu) == set(brute)
            for i, mu in cert.mu.items():
                if math.isinf(brute[i]):
                    assert math.isinf(mu), (method, i, mu)
                else:
                    assert mu == pytest.approx(brute[i], rel=1e-6, abs=1e-9), (method, i, mu, brute[i])
        bound = certify(trace, view, solver="bound")
        for i, mu in bound.mu.items():
            assert mu >= brute[i] * (1 - 1e-6) - 1e-9, (i, mu, brute[i])  # a sound bound: never below exact
