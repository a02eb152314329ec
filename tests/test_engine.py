import json
import tracemalloc

import numpy as np
import pytest
from reference import algorithm2, delivered_matrices
from scipy import stats

from flwr_inca import (
    EdgeSchedule,
    ExecutionTrace,
    IncaConfig,
    InjectionSchedule,
    MarkovDropout,
    PermanentDropout,
    ScheduledDropout,
    StaticTopology,
    TemporaryDropout,
    replay,
    run_inca,
)
from flwr_inca.protocol import ExplicitNoise, PushSumGossip, sample_trace
from flwr_inca.protocol.topology import RandomNeighbors, Topology

CUSTOM = InjectionSchedule.custom(
    [0.1, 0.2, 0.3, 0.4],
    [[1.0, 0.5, 0.0], [-0.5, 1.0, 1.0], [0.0, -2.0, 0.5], [-0.5, 0.5, -1.5]],
)
SCHEDULES = ["incremental", "early", CUSTOM]
TOPOLOGIES = ["random", "random-fresh", "ring", "complete", "erdos-renyi:0.4", "hypercube"]
TEMPORARY = [None, TemporaryDropout(0.3), MarkovDropout(0.2, 0.5, recover_by_end=True),
             ScheduledDropout({1: [0, 1], 2: [2]})]


def _weighted_mean(result, x):
    w = result.injected
    return (w[:, None] * x).sum(axis=0) / w.sum()


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["inc", "early", "custom"])
@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("dropout", TEMPORARY, ids=["none", "temporary", "markov", "scheduled"])
def test_exact_cancellation_without_permanent_dropouts(schedule, topology, dropout, rng):
    n, d = 16, 5
    T = 3 if schedule is CUSTOM else 6
    x = rng.random((n, d))
    config = IncaConfig(iterations=T, neighbors=2, sigma_star=0.0, sigma_delta=1e3, schedule=schedule,
                        topology=topology, dropout=dropout)
    result = run_inca(x, config, seed=7)
    assert result.finalists.size == n
    # the injected weights differ only with temporary dropouts; the noise cancels exactly either way
    assert np.max(np.abs(result.estimate - _weighted_mean(result, x))) < 1e-9
    if dropout is None:
        assert np.max(np.abs(result.estimate - x.mean(axis=0))) < 1e-9


def test_every_mixing_matrix_is_column_stochastic_under_random_dropouts(rng):
    for seed, dropout in enumerate([PermanentDropout(0.3), TemporaryDropout(0.4), MarkovDropout(0.3, 0.7)]):
        trace = sample_trace(40, IncaConfig(iterations=10, neighbors=3, sigma_star=1, sigma_delta=1,
                                            dropout=dropout), seed=seed)
        online = trace.online_mask()
        for t, W in enumerate(delivered_matrices(trace), start=1):
            assert np.allclose(W.sum(axis=0), 1.0, atol=1e-12)
            assert np.all(W >= -1e-15)
            off = np.flatnonzero(~online[t])
            assert np.allclose(W[:, off], np.eye(40)[:, off])  # offline parties keep their message
            sparse = trace.steps[t - 1].matrix(40).toarray()
            assert np.allclose(sparse, W)


def test_unbiased_with_variance_sigma_star_squared_over_n():
    # coordinates are independent replicates: d = 4000 estimates of one run
    n, d, s_star = 50, 4000, 0.8
    x = np.random.default_rng(1).random((n, d))
    result = run_inca(x, IncaConfig(iterations=8, sigma_star=s_star, sigma_delta=5.0), seed=3)
    err = result.estimate - x.mean(axis=0)
    var = s_star**2 / n
    assert abs(err.mean()) < 4 * np.sqrt(var / d)
    # chi-square bounds on the sample variance (two-sided, 1e-4 level)
    chi2 = (d - 1) * err.var(ddof=1) / var
    assert stats.chi2.ppf(5e-5, d - 1) < chi2 < stats.chi2.ppf(1 - 5e-5, d - 1)


def test_expected_mse_matches_monte_carlo_with_permanent_dropouts():
    from flwr_inca.protocol.utility import expected_mse

    n, d = 30, 6000
    config = IncaConfig(iterations=6, sigma_star=0.3, sigma_delta=2.0, dropout=PermanentDropout(0.2))
    trace = sample_trace(n, config, seed=11)
    x = np.random.default_rng(5).random((n, d))  # U[0,1]: variance 1/12
    result = replay(trace, x, seed=4)
    err2 = (result.estimate - x.mean(axis=0)) ** 2
    predicted = expected_mse(trace)
    # mean of d i.i.d. squared errors; generous 5-sigma band from the sample's own spread
    assert abs(err2.mean() - predicted) < 5 * err2.std() / np.sqrt(d)
    assert predicted > expected_mse(trace, sigma_delta=0.0)  # uncancelled noise costs accuracy


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtypes_are_kept(dtype, rng):
    x = rng.random((20, 7)).astype(dtype)
    result = run_inca(x, IncaConfig(iterations=5, sigma_star=0.01, sigma_delta=1.0), seed=0)
    assert result.estimate.dtype == dtype and result.final_messages.dtype == dtype
    tol = 1e-3 if dtype == np.float32 else 1e-12
    exact = run_inca(x.astype(np.float64), IncaConfig(iterations=5, sigma_star=0.0, sigma_delta=1.0), seed=0)
    assert np.max(np.abs(exact.estimate - x.astype(np.float64).mean(axis=0))) < tol


def test_scalar_values_give_scalar_estimate(rng):
    x = rng.random(12)
    result = run_inca(x, IncaConfig(iterations=4, sigma_star=0.0, sigma_delta=3.0), seed=0)
    assert result.estimate.shape == ()
    assert abs(float(result.estimate) - x.mean()) < 1e-12


def test_torch_tensors_accepted():
    torch = pytest.importorskip("torch")
    x = torch.rand(10, 3, dtype=torch.float64)
    result = run_inca(x, IncaConfig(iterations=3, sigma_star=0.0, sigma_delta=1.0), seed=0)
    assert np.allclose(result.estimate, x.numpy().mean(axis=0))


def test_deterministic_for_a_seed(rng):
    x = rng.random((25, 4))
    config = IncaConfig(iterations=6, sigma_star=0.5, sigma_delta=2.0, dropout=MarkovDropout(0.2, 0.3))
    a, b = run_inca(x, config, seed=42), run_inca(x, config, seed=42)
    assert np.array_equal(a.estimate, b.estimate) and a.trace == b.trace
    c = run_inca(x, config, seed=43)
    assert not np.array_equal(a.estimate, c.estimate)


@pytest.mark.parametrize("dissemination", ["exact", "gossip:15"])
@pytest.mark.parametrize("dropout", [None, PermanentDropout(0.25), TemporaryDropout(0.3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_trace_round_trip_and_bit_exact_replay(tmp_path, dissemination, dropout, dtype, rng):
    x = rng.random((30, 6)).astype(dtype)
    config = IncaConfig(iterations=7, neighbors=2, sigma_star=0.3, sigma_delta=4.0, dropout=dropout,
                        dissemination=dissemination)
    result = run_inca(x, config, seed=99)
    path = tmp_path / "trace.json"
    result.trace.save(path)
    loaded = ExecutionTrace.load(path)
    assert loaded == result.trace
    again = replay(loaded, x, seed=99, dissemination=dissemination)
    assert np.array_equal(again.estimate, result.estimate)
    assert np.array_equal(again.final_messages, result.final_messages)
    assert np.array_equal(again.weights, result.weights)


def test_trace_json_format(rng):
    result = run_inca(rng.random((5, 2)), IncaConfig(iterations=2, sigma_star=1.0, sigma_delta=2.0), seed=0)
    data = json.loads(result.trace.to_json())
    assert data["format"] == "inca-trace/1" and data["parties"] == 5 and data["iterations"] == 2
    assert data["schedule"] == "incremental" and data["sigma_star"] == 1.0 and data["sigma_delta"] == 2.0
    assert len(data["steps"]) == 2
    for step in data["steps"]:
        assert step["online"] == [0, 1, 2, 3, 4]
        for s, r, w in step["messages"]:
            assert s != r and w == 0.5
    custom = run_inca(rng.random((5, 2)), IncaConfig(iterations=3, sigma_star=1, sigma_delta=1, schedule=CUSTOM),
                      seed=0)
    assert set(json.loads(custom.trace.to_json())["schedule"]) == {"c", "Z"}


def _random_case(rng, schedule):
    n = int(rng.integers(3, 8))
    T = schedule.iterations if isinstance(schedule, InjectionSchedule) else int(rng.integers(1, 6))
    d = int(rng.integers(1, 4))
    k = int(rng.integers(1, n))
    dropout = [None, PermanentDropout(0.3), TemporaryDropout(0.3), MarkovDropout(0.3, 0.5),
               ScheduledDropout({1: [0]})][int(rng.integers(0, 5))]
    return n, T, d, k, dropout


class RecordingTopology(Topology):
    """Random k-out neighbours that keep a copy of every iteration's attempted messages."""

    def __init__(self, k):
        self.inner, self.attempted = RandomNeighbors(k), []

    def check(self, n, iterations=None):
        self.inner.check(n, iterations)

    def iterate(self, n, iterations, rng):
        for messages in self.inner.iterate(n, iterations, rng):
            self.attempted.append(messages)
            yield messages


def _attempted_matrices(topology, n):
    """The dense attempted W_t (before dropouts) of the messages a run's topology produced."""
    mats = []
    for msgs in topology.attempted:
        W = np.zeros((n, n))
        W[msgs.receivers, msgs.senders] = msgs.weights
        W[np.arange(n), np.arange(n)] = 1 - W.sum(axis=0)
        mats.append(W)
    return mats


@pytest.mark.parametrize("schedule", SCHEDULES, ids=["inc", "early", "custom"])
def test_engine_agrees_with_loop_over_parties_reference(schedule, rng):
    for trial in range(25):
        n, T, d, k, dropout = _random_case(rng, schedule)
        x = rng.random((n, d))
        eta_star = rng.standard_normal((n, d))
        eta = rng.standard_normal((n, T, d))
        topology = RecordingTopology(k)
        config = IncaConfig(iterations=T, neighbors=k, sigma_star=0.7, sigma_delta=3.0, schedule=schedule,
                            topology=topology, dropout=dropout)
        result = run_inca(x, config, seed=trial, noise=ExplicitNoise(eta_star, eta))
        trace = result.trace
        sched = trace.schedule
        # the reference applies Algorithm 2 to the *attempted* W_t and the online sets itself
        y_ref, omega_ref = algorithm2(x, sched.c, sched.Z, _attempted_matrices(topology, n),
                                      trace.online_mask(), 0.7, 3.0, eta_star, eta)
        assert np.allclose(result.final_messages, y_ref, atol=1e-10, rtol=1e-10), f"trial {trial}"
        assert np.allclose(result.weights, omega_ref, atol=1e-12)
        finals = trace.steps[-1].online
        if finals.size:
            est = y_ref[finals].sum(axis=0) / omega_ref[finals].sum()
            assert np.allclose(result.estimate, est, atol=1e-10)


@pytest.mark.parametrize("kernel", ["scipy-private", "public-fallback"])
def test_fast_incremental_path_agrees_with_the_reference(kernel, rng, monkeypatch):
    # D_Inc with everybody online takes the fast path at every iteration; it adds W y into the next
    # messages with SciPy's private kernel when available, else with the public W @ y
    from flwr_inca.protocol import engine

    if kernel == "public-fallback":
        monkeypatch.setattr(engine, "_private_csr_matvecs", lambda: None)
    else:  # this SciPy has the kernel (and it passed its self-check)
        assert engine._private_csr_matvecs() is not None
    fast_steps = []
    original = engine._Mixing._fast_incremental_step
    monkeypatch.setattr(engine._Mixing, "_fast_incremental_step",
                        lambda self, t, W: (fast_steps.append(t), original(self, t, W)))
    n, T, d, k = 12, 5, 3, 2
    x = rng.random((n, d))
    eta_star, eta = rng.standard_normal((n, d)), rng.standard_normal((n, T, d))
    for dtype in (np.float64, np.float32):
        fast_steps.clear()
        topology = RecordingTopology(k)
        config = IncaConfig(iterations=T, neighbors=k, sigma_star=0.4, sigma_delta=2.0, topology=topology)
        result = run_inca(x.astype(dtype), config, seed=2, noise=ExplicitNoise(eta_star, eta))
        assert fast_steps == list(range(1, T + 1))
        sched = result.trace.schedule
        y_ref, omega_ref = algorithm2(x, sched.c, sched.Z, _attempted_matrices(topology, n),
                                      result.trace.online_mask(), 0.4, 2.0, eta_star, eta)
        tol = 1e-10 if dtype == np.float64 else 1e-4
        assert result.final_messages.dtype == dtype
        assert np.allclose(result.final_messages, y_ref, atol=tol, rtol=tol)
        assert np.allclose(result.weights, omega_ref, atol=1e-12)


def test_explicit_edge_schedule_and_static_topology(rng):
    n = 4
    edges = [[(0, 1), (1, 2), (2, 3), (3, 0)], [(0, 2, 0.5), (2, 0, 0.25)]]
    x = rng.random((n, 2))
    result = run_inca(x, IncaConfig(iterations=2, sigma_star=0.0, sigma_delta=10.0,
                                    topology=EdgeSchedule(edges, n=n)), seed=0)
    assert np.allclose(result.estimate, x.mean(axis=0))
    assert [len(s.messages) for s in result.trace.steps] == [4, 2]
    result = run_inca(x, IncaConfig(iterations=3, sigma_star=0.0, sigma_delta=10.0,
                                    topology=StaticTopology([(0, 1), (1, 0), (2, 3), (3, 2)], n=4)), seed=0)
    assert np.allclose(result.estimate, x.mean(axis=0))


def test_push_sum_gossip_converges(rng):
    x = rng.random((40, 3))
    config = IncaConfig(iterations=5, sigma_star=0.0, sigma_delta=1.0, dissemination=PushSumGossip(80))
    result = run_inca(x, config, seed=1)
    assert result.party_estimates.shape == (40, 3)
    assert np.max(np.abs(result.party_estimates - x.mean(axis=0))) < 1e-6
    short = run_inca(x, IncaConfig(iterations=5, sigma_star=0.0, sigma_delta=1.0, dissemination="gossip:2"), seed=1)
    assert np.max(np.abs(short.party_estimates - x.mean(axis=0))) > 1e-3  # gossip error is visible


def test_everyone_dropping_out_gives_nan_with_warning(rng):
    x = rng.random((4, 2))
    mask = np.ones((3, 4), dtype=bool)
    mask[2] = False
    with pytest.warns(UserWarning, match="dropped out"):
        result = run_inca(x, IncaConfig(iterations=2, sigma_star=1, sigma_delta=1,
                                        dropout=ScheduledDropout(mask)), seed=0)
    assert np.all(np.isnan(result.estimate))


def test_memory_does_not_grow_with_iterations(rng):
    n, d = 200, 2000  # one (n, d) float64 array is 3.2 MB
    x = rng.random((n, d))

    def peak(T):
        tracemalloc.start()
        run_inca(x, IncaConfig(iterations=T, sigma_star=0.1, sigma_delta=1.0), seed=0)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    assert peak(40) < 1.3 * peak(5)
    assert peak(40) < 12 * x.nbytes  # O(n d): a handful of (n, d) arrays, never O(n d T)


# --------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"iterations": 0}, r"iterations must be an integer in \[1, 1000\], got 0"),
        ({"neighbors": 0}, r"neighbors must be an integer in \[1, 9999999\], got 0"),
        ({"sigma_star": -1.0}, r"sigma_star must be in \[0, 1e\+100\]"),
        ({"sigma_delta": float("nan")}, r"sigma_delta must be in \[0, 1e\+100\]"),
        ({"sigma_delta": float("inf")}, r"sigma_delta must be in \[0, 1e\+100\]"),
        ({"schedule": "sometimes"}, "schedule"),
        ({"dissemination": "carrier-pigeon"}, "dissemination"),
    ],
)
def test_bad_config_rejected(kwargs, match):
    base = {"sigma_star": 1.0, "sigma_delta": 1.0}
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        IncaConfig(**base)


def test_bad_values_rejected(rng):
    config = IncaConfig(iterations=2, neighbors=2, sigma_star=1.0, sigma_delta=1.0)
    with pytest.raises(ValueError, match="n >= 2"):
        run_inca(rng.random((1, 3)), config)
    with pytest.raises(ValueError, match=r"neighbors must be in \[1, n-1\] = \[1, 1\]"):
        run_inca(rng.random((2, 3)), config)
    with pytest.raises(ValueError, match="shape"):
        run_inca(rng.random((4, 3, 2)), config)
    bad = rng.random((5, 3))
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"x\[2, 1\]"):
        run_inca(bad, config)
    bad[2, 1] = np.inf
    with pytest.raises(ValueError, match="finite"):
        run_inca(bad, config)
    with pytest.raises(ValueError, match="real numbers"):
        run_inca(np.array([["a", "b"], ["c", "d"]]), config)
    with pytest.raises(ValueError, match="IncaConfig"):
        run_inca(rng.random((5, 3)), {"iterations": 2})


def _valid_trace_dict():
    result = run_inca(np.random.default_rng(0).random((4, 1)),
                      IncaConfig(iterations=2, sigma_star=1.0, sigma_delta=1.0), seed=0)
    return result.trace.to_dict()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.update(format="inca-trace/9"), "format"),
        (lambda d: d.pop("steps"), "missing"),
        (lambda d: d.update(parties=1), r"parties must be an integer in \[2, 10000000\]"),
        (lambda d: d.update(iterations=0), r"iterations must be an integer in \[1, 1000\]"),
        (lambda d: d.update(sigma_star=-2), "sigma_star"),
        (lambda d: d["steps"].pop(), "expected 2 steps"),
        (lambda d: d["steps"][0]["messages"].append([0, 3, 0.9]), "not column stochastic|duplicate"),
        (lambda d: d["steps"][0]["messages"].append([0, 0, 0.1]), "itself"),
        (lambda d: d["steps"][1].update(online=[0, 1, 2]), "offline party"),
        (lambda d: d["steps"][0].update(online=[0, 1, 2, 9]), r"in \[0, 3\]"),
        (lambda d: d["steps"][0].update(messages=[[0, 1]]), "sender, receiver, weight"),
        (lambda d: d.update(schedule="sometimes"), "schedule"),
    ],
)
def test_malformed_traces_rejected(mutate, match):
    data = _valid_trace_dict()
    mutate(data)
    with pytest.raises(ValueError, match=match):
        ExecutionTrace.from_dict(data)


def test_trace_not_json_and_nothing_half_written(tmp_path):
    with pytest.raises(ValueError, match="not valid JSON"):
        ExecutionTrace.from_json("{oops")
    result = run_inca(np.random.default_rng(0).random((4, 1)),
                      IncaConfig(iterations=2, sigma_star=1.0, sigma_delta=1.0), seed=0)
    path = tmp_path / "t.json"
    result.trace.save(path)
    before = path.read_bytes()
    result.trace.sigma_star = -1.0  # corrupt the in-memory trace
    with pytest.raises(ValueError):
        result.trace.save(path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]


def test_replay_rejects_mismatched_values(rng):
    result = run_inca(rng.random((6, 2)), IncaConfig(iterations=2, sigma_star=1.0, sigma_delta=1.0), seed=0)
    with pytest.raises(ValueError, match="6 parties"):
        replay(result.trace, rng.random((5, 2)), seed=0)


@pytest.mark.parametrize("schedule", ["incremental", "early"])
def test_noise_std_matches_the_replayed_noise_with_lost_finals(schedule):
    # brute force by linearity: one coordinate per noise draw (unit impulse, zero values), so the
    # replayed estimate's coordinates are exactly the draws' coefficients in the estimate
    from flwr_inca.protocol.noise import ExplicitNoise
    from flwr_inca.protocol.utility import noise_std

    n, T = 7, 4
    config = IncaConfig(iterations=T, neighbors=2, sigma_star=0.7, sigma_delta=3.0, schedule=schedule,
                        dropout=TemporaryDropout(0.3))
    for seed in range(4):
        trace = sample_trace(n, config, seed=seed)
        online_T = trace.steps[-1].online
        D = n + n * T
        star, eta = np.zeros((n, D)), np.zeros((n, T, D))
        for i in range(n):
            star[i, i] = 1.0
            for k in range(T):
                eta[i, k, n + i * T + k] = 1.0
        for finalists in (online_T, online_T[1:]):
            if finalists.size == 0:
                continue
            est = replay(trace, np.zeros((n, D)), seed=0, noise=ExplicitNoise(star, eta),
                         finalists=finalists).estimate
            assert noise_std(trace, finalists) == pytest.approx(float(np.sqrt(np.sum(est**2))), rel=1e-9)
    with pytest.raises(ValueError, match="finalists"):
        noise_std(trace, [i for i in range(n) if i not in set(online_T.tolist())][:1] or [n + 5])


@pytest.mark.parametrize("x, words", [
    (np.zeros(0), "x is empty"),
    (np.zeros((0, 3)), "x is empty"),
    (np.zeros((5, 0)), "d >= 1 columns"),
    ([], "x is empty"),
    (np.full((4, 2), 1e308), r"overflow.*float64"),
    (np.full((40, 2), 1e37, dtype=np.float32), r"overflow.*float32"),
    (np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.complex128), "real numbers"),
])
def test_empty_huge_and_complex_values_get_clear_errors(x, words):
    config = IncaConfig(iterations=2, sigma_star=1.0, sigma_delta=1.0)
    with pytest.raises(ValueError, match=words):
        run_inca(x, config, seed=0)


def test_torch_bfloat16_and_half_values_are_accepted_as_float32():
    torch = pytest.importorskip("torch")
    x = torch.arange(12, dtype=torch.bfloat16).reshape(6, 2)
    config = IncaConfig(iterations=3, sigma_star=0.0, sigma_delta=1.0)
    result = run_inca(x, config, seed=0)
    assert result.estimate.dtype == np.float32
    assert np.allclose(result.estimate, x.float().numpy().mean(axis=0), atol=1e-4)
    assert run_inca(x.half(), config, seed=0).estimate.dtype == np.float32
