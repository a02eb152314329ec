"""The sound bound (flwr_inca.privacy.bound): never below the exact mu, close to it, and chosen
automatically by certify(). The exact values come from the dense pencil method, itself checked against
the brute-force pseudo-inverse of tests/reference.py (test_certificate.py)."""

import math
import zlib

import numpy as np
import pytest
from reference import brute_force_mu

from flwr_inca import (
    IncaConfig,
    InjectionSchedule,
    MarkovDropout,
    PermanentDropout,
    ScheduledDropout,
    TemporaryDropout,
)
from flwr_inca.privacy import (
    AdversaryView,
    calibrate,
    certify,
    choose_solver,
    profile,
    random_collusion,
    random_eavesdrop,
)
from flwr_inca.privacy import certificate as certificate_module
from flwr_inca.privacy.bound import BoundSettings, _evaluate, bound_profile
from flwr_inca.privacy.certificate import (
    CASCADE_MAX_STEPS,
    CASCADE_MIN_ROWS,
    EXACT_LONG_MAX_ROWS,
    EXACT_LONG_MIN_ITERATIONS,
    EXACT_MAX_PARTIES,
    EXACT_MAX_ROWS,
    auto_solver,
    exact_affordable,
    exact_bytes,
    neighbors_of,
)
from flwr_inca.privacy.message_space import MessageSpace
from flwr_inca.protocol import sample_trace

CUSTOM = InjectionSchedule.custom(
    [0.1, 0.2, 0.3, 0.4],
    [[1.0, 0.5, 0.0], [-0.5, 1.0, 1.0], [0.0, -2.0, 0.5], [-0.5, 0.5, -1.5]],
)
# valid, but its adapted rows are dependent for a party offline at step 1 only (T = 2)
DEGENERATE = InjectionSchedule.custom([0.5, -0.5, 1.0], [[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])
SCHEDULES = ["incremental", "early", CUSTOM, DEGENERATE]
DROPOUTS = [None, PermanentDropout(0.3), TemporaryDropout(0.3), MarkovDropout(0.3, 0.5),
            ScheduledDropout({1: [0, 2]})]
SIGMAS = [(0.4, 2.0), (0.05, 40.0), (1.5, 0.2), (0.1, 1.0)]


def _case(index: int, seed: int):
    """Deterministic random small execution number ``index`` of stream ``seed``: every schedule,
    dropout model, threat and sigma pair comes round in turn."""
    rng = np.random.default_rng([seed, index])
    schedule = SCHEDULES[index % 4]
    dropout = DROPOUTS[index % 5]
    n = int(rng.integers(4, 10))
    T = {id(CUSTOM): 3, id(DEGENERATE): 2}.get(id(schedule), int(rng.integers(1, 5)))
    k = int(rng.integers(1, min(3, n - 1) + 1))
    s_star, s_delta = SIGMAS[index % 4]
    trace = sample_trace(n, IncaConfig(iterations=T, neighbors=k, sigma_star=s_star, sigma_delta=s_delta,
                                       schedule=schedule, dropout=dropout), seed=int(rng.integers(2**31)))
    if index % 2:
        view = random_collusion(trace, float(rng.choice([0.2, 0.3, 0.5])), seed=index)
    else:
        view = random_eavesdrop(trace, float(rng.choice([0.3, 0.5, 0.8])), seed=index)
    return trace, view


def _check_sound(cases: int, seed: int, settings: BoundSettings | None = None) -> int:
    checked = 0
    for index in range(cases):
        trace, view = _case(index, seed)
        exact = certify(trace, view, solver="exact")
        bound = certify(trace, view, solver="bound", bound_settings=settings)
        assert bound.method == "bound" and exact.method == "exact"
        scale = 1.0 / trace.sigma_star  # mu of a party whose every message is seen (local DP)
        for i, mu in exact.mu.items():
            b = bound.mu[i]
            assert not math.isnan(b), (index, i)
            assert math.isfinite(b), (index, i, mu, b)  # exact mu <= 1 / sigma_star is always finite
            # 1e-9 relative; an absolute 1e-12 of the local-DP scale for parties whose true mu is 0
            assert b >= mu * (1 - 1e-9) - 1e-12 * scale, (index, i, mu, b)
            checked += 1
    return checked


def test_bound_is_never_below_exact_on_200_random_small_executions():
    # both schedules and two custom ones, all dropout models, collusion and eavesdropping, 4 sigma pairs
    # (every combination 10 times: _case cycles through them every 20 executions); a small work budget:
    # soundness must not depend on how far the solver got. -m slow adds 3000 more
    assert _check_sound(200, seed=0, settings=BoundSettings(iterations=2, max_iterations=4)) > 800


def test_bound_is_never_below_exact_with_the_default_budget():
    assert _check_sound(60, seed=1) > 250


@pytest.mark.slow
def test_bound_is_never_below_exact_on_3000_more_executions():
    assert _check_sound(3000, seed=2) > 12000


@pytest.mark.parametrize("dropout", [None, PermanentDropout(0.2), TemporaryDropout(0.2)],
                         ids=["none", "permanent", "temporary"])
def test_bound_converges_to_the_brute_force_value(dropout):
    # with enough iterations the minimization reaches the exact minimum: the bound equals the brute-force
    # pseudo-inverse of tests/reference.py (an independent computation) to high accuracy
    trace = sample_trace(14, IncaConfig(iterations=5, neighbors=1, sigma_star=0.3, sigma_delta=3.0,
                                        dropout=dropout), seed=4)
    view = random_collusion(trace, 0.2, seed=1)
    brute = brute_force_mu(trace, view.corrupted, view.observed, 0.3, 3.0)
    prof = bound_profile(trace, view, settings=BoundSettings(iterations=150, refine_band=0.0))
    got = dict(zip(prof.honest.tolist(), prof.mu(0.3, 3.0)))
    for i, b in brute.items():
        assert got[i] >= b * (1 - 1e-9)
        assert got[i] == pytest.approx(b, rel=2e-4, abs=1e-6), (i, got[i], b)  # float32 search


def test_weakest_party_is_tight_with_the_default_budget():
    trace = sample_trace(150, IncaConfig(iterations=20, neighbors=1, sigma_star=0.25, sigma_delta=3.0,
                                         dropout=PermanentDropout(0.1)), seed=3)
    view = random_collusion(trace, 0.1, seed=3)
    exact = certify(trace, view, solver="exact")
    bound = certify(trace, view, solver="bound")
    assert exact.max_mu <= bound.max_mu <= 1.01 * exact.max_mu
    assert bound.weakest[0] == exact.weakest[0]


def test_bound_profile_is_valid_for_other_sigmas_and_min_sigma_delta_is_minimal():
    trace = sample_trace(40, IncaConfig(iterations=10, neighbors=1, sigma_star=0.3, sigma_delta=3.0,
                                        dropout=PermanentDropout(0.1)), seed=5)
    view = random_collusion(trace, 0.1, seed=0)
    exact = profile(trace, view, solver="exact")
    bound = profile(trace, view, solver="bound")
    assert bound.method == "bound" and exact.method == "exact"
    for s_star, s_delta in [(0.3, 3.0), (0.1, 30.0), (1.0, 0.5), (0.05, 1e3)]:
        assert np.all(bound.mu(s_star, s_delta) >= exact.mu(s_star, s_delta) * (1 - 1e-9))
    assert np.all(bound.mu_limit(0.3) >= exact.mu_limit(0.3) * (1 - 1e-9))
    target = float(exact.mu(0.3, 3.0).max()) * 1.2
    s = bound.min_sigma_delta(0.3, target)
    assert math.isfinite(s)
    assert bound.mu(0.3, s).max() <= target
    # minimal: found again by an independent bisection on mu() itself
    lo, hi = 0.0, s
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if bound.mu(0.3, mid).max() > target else (lo, mid)
    assert s == pytest.approx(hi, rel=1e-5)
    # and the exact profile needs no more noise than the bound
    assert exact.min_sigma_delta(0.3, target) <= s * (1 + 1e-6)
    assert bound.min_sigma_delta(0.3, 1e-6) == math.inf


def test_rounding_margin_covers_an_extended_precision_evaluation():
    trace = sample_trace(30, IncaConfig(iterations=8, neighbors=2, sigma_star=0.3, sigma_delta=3.0,
                                        dropout=TemporaryDropout(0.2)), seed=6)
    view = random_eavesdrop(trace, 0.5, seed=0)
    ms = MessageSpace(trace, view, 0.3, 3.0)
    rng = np.random.default_rng(0)
    slots = np.arange(min(ms.nH, 5))
    dy = rng.normal(size=(ms.U, slots.size)) * 10.0 ** rng.uniform(-3, 3, size=slots.size)
    X, E = _evaluate(ms, dy, slots)
    # the same cost in 80-bit extended precision, with the matrices built independently
    ld = np.longdouble
    dz = ms.Dz.toarray().astype(ld) @ dy.astype(ld) - ms.target(slots).astype(ld)
    for b in range(slots.size):
        x_ld = e_ld = ld(0)
        for k, g in enumerate(ms.groups):
            rows = slice(ms.offsets[k], ms.offsets[k + 1])
            u = g.P.astype(ld) @ dz[rows, b].reshape(ms.T + 1, -1)
            x_ld += np.sum(u[0] ** 2)
            e_ld += np.sum(u[1:] ** 2)
        assert X[b] >= x_ld and E[b] >= e_ld
        assert X[b] <= x_ld * (1 + 1e-6) + 1e-300 and E[b] <= e_ld * (1 + 1e-6) + 1e-300


def test_auto_picks_exact_when_small_and_bound_beyond_the_threshold(monkeypatch):
    trace = sample_trace(30, IncaConfig(iterations=6, neighbors=1, sigma_star=0.3, sigma_delta=3.0), seed=0)
    view = random_collusion(trace, 0.1, seed=0)
    cert = certify(trace, view, delta=1e-5)
    assert cert.method == "exact" and cert.to_dict()["method"] == "exact"
    rows = int(view.honest_observed().sum())
    monkeypatch.setattr(certificate_module, "EXACT_MAX_ROWS", rows - 1)
    assert choose_solver(trace, view) == "bound"
    cert = certify(trace, view, delta=1e-5)
    assert cert.method == "bound" and cert.to_dict()["method"] == "bound"
    assert any("upper bound" in note for note in cert.notes)
    assert certify(trace, view, solver="exact").method == "exact"  # forcing still works


@pytest.mark.parametrize("parties, iterations, neighbors, rows, expected", [
    # every setting of benchmarks/RESULTS.md, "Which method auto takes", and the method measured fastest there
    (1000, 40, 1, 4014, "exact"),     # exact 2.6x faster than the bound
    (1000, 80, 1, 7347, "exact"),     # 3.3x faster, 6% tighter
    (1000, 40, 2, 6973, "exact"),     # 1.6x faster
    (3000, 20, 1, 7262, "exact"),     # 2.1x faster
    (2000, 40, 1, 8261, "bound"),     # level with exact (24.1 s against 24.0 s)
    (3000, 26, 1, 8710, "bound"),     # 1.1x faster than exact
    (1300, 80, 1, 9256, "exact"),     # 2.5x faster than the bound
    (1500, 80, 1, 11037, "exact"),    # 2.2x faster than the bound, 3.7x than the cascade
    (2000, 60, 1, 11454, "exact"),    # 1.5x faster than either
    (2000, 80, 1, 14768, "exact"),    # 1.8x faster than either, 4-8% tighter
    (4000, 20, 1, 9732, "cascade"),   # the exact method 2x slower than the cascade
    (2500, 40, 1, 10446, "cascade"),  # cascade 26 s, bound 32 s, exact 41 s
    (4000, 30, 1, 12959, "cascade"),  # cascade 2.3x faster than the bound, 4.5x than exact
    (1500, 40, 2, 10590, "bound"),    # bound 3x faster than exact, 4.4x than the cascade
    (1000, 60, 2, 10039, "bound"),    # 1.2x to 1.9x faster than exact, 5.6x than the cascade
    (1000, 80, 2, 13159, "bound"),    # 1.1x to 1.9x faster than exact, 8.4x than the cascade
    (3000, 40, 2, 21124, "bound"),    # 1.9x faster than the cascade
    (5000, 40, 2, 34849, "bound"),    # level with the cascade (266 s against 261 s): auto's switch
])
def test_auto_takes_the_method_measured_fastest(monkeypatch, parties, iterations, neighbors, rows, expected):
    """Auto's choice on the benchmark's own executions (the same seeds: the same observed messages); with
    room for the exact method's matrices (16 GiB), so that the choice does not depend on this machine."""
    monkeypatch.setenv("FLWR_INCA_MAX_BYTES", str(16 * 2**30))
    config = IncaConfig(iterations=iterations, neighbors=neighbors, sigma_star=1.0, sigma_delta=6.0,
                        dropout=PermanentDropout(0.1))
    trace = sample_trace(parties, config, seed=1)
    view = random_collusion(trace, 0.1, seed=2)
    assert int(view.honest_observed().sum()) == rows and neighbors_of(trace) == neighbors
    assert choose_solver(trace, view) == expected
    assert exact_affordable(trace, view) == (expected == "exact")
    # where the exact method's matrices do not fit, auto takes what it would take beyond the exact range
    needed = exact_bytes(parties, int(view.honest.size), rows, iterations)
    monkeypatch.setenv("FLWR_INCA_MAX_BYTES", str(int(needed) - 1))
    beyond = "bound" if rows <= CASCADE_MIN_ROWS or iterations * neighbors > CASCADE_MAX_STEPS else "cascade"
    assert choose_solver(trace, view) == (beyond if expected == "exact" else expected)


def test_the_auto_rule_at_its_limits():
    """auto_solver, the rule alone (sizes only): each limit is where the method changes."""
    assert auto_solver(1000, 20, 1, EXACT_MAX_ROWS) == "exact"
    assert auto_solver(1000, 20, 1, EXACT_MAX_ROWS + 1) == "bound"
    assert auto_solver(1000, 20, 1, CASCADE_MIN_ROWS + 1) == "cascade"
    # one neighbour, many iterations: exact further, then the bound (T * k beyond the cascade's range)
    assert auto_solver(1000, EXACT_LONG_MIN_ITERATIONS, 1, EXACT_LONG_MAX_ROWS) == "exact"
    assert auto_solver(1000, EXACT_LONG_MIN_ITERATIONS - 1, 1, EXACT_MAX_ROWS + 1) == "bound"
    assert auto_solver(1000, EXACT_LONG_MIN_ITERATIONS, 2, EXACT_MAX_ROWS + 1) == "bound"
    assert auto_solver(1000, EXACT_LONG_MIN_ITERATIONS, 1, EXACT_LONG_MAX_ROWS + 1) == "bound"
    assert auto_solver(1000, EXACT_LONG_MIN_ITERATIONS, 1, EXACT_LONG_MAX_ROWS, exact_fits=False) == "bound"
    # the cascade only up to T * k = CASCADE_MAX_STEPS ... on the parties where that was measured
    assert auto_solver(3000, CASCADE_MAX_STEPS, 1, CASCADE_MIN_ROWS + 1) == "cascade"
    assert auto_solver(3000, CASCADE_MAX_STEPS // 2 + 1, 2, CASCADE_MIN_ROWS + 1) == "bound"
    assert auto_solver(EXACT_MAX_PARTIES + 1, 80, 2, CASCADE_MIN_ROWS + 1) == "cascade"
    assert auto_solver(EXACT_MAX_PARTIES + 1, 20, 1, 100) == "bound"  # never exact beyond EXACT_MAX_PARTIES


@pytest.mark.parametrize("k", [1, 2, 3])
def test_neighbors_of_a_trace_is_its_k_even_with_dropouts(k):
    for dropout in (None, PermanentDropout(0.3)):
        config = IncaConfig(iterations=8, neighbors=k, sigma_star=1.0, sigma_delta=6.0, dropout=dropout)
        assert neighbors_of(sample_trace(200, config, seed=k)) == k


def test_bad_solver_requests_are_rejected_clearly(monkeypatch):
    trace = sample_trace(30, IncaConfig(iterations=6, neighbors=1, sigma_star=0.3, sigma_delta=3.0), seed=0)
    view = random_collusion(trace, 0.1, seed=0)
    with pytest.raises(ValueError, match="solver must be one of"):
        certify(trace, view, solver="fast")
    monkeypatch.setattr(certificate_module, "EXACT_HARD_ROWS", 10)
    with pytest.raises(ValueError, match=r"too large for the exact method.*solver='bound'"):
        certify(trace, view, solver="exact")
    assert certify(trace, view).method == "exact"  # auto is not affected by the hard limit here
    nobody = AdversaryView("collusion", np.arange(30), np.ones((7, 30), dtype=bool))
    with pytest.raises(ValueError, match="no honest party"):
        certify(trace, nobody)
    with pytest.raises(ValueError, match="no honest party"):
        certify(trace, nobody, solver="bound")


@pytest.mark.parametrize("solver", ["bound", "cascade"])
def test_calibration_with_a_bound_needs_at_least_the_exact_noise(solver):
    kw = {"iterations": 12, "neighbors": 1, "collusion": 0.1, "dropout": PermanentDropout(0.1), "runs": 4, "seed": 1}
    exact = calibrate(0.5, 1e-5, 60, solver="exact", **kw)
    bound = calibrate(0.5, 1e-5, 60, solver=solver, **kw)
    assert bound.sigma_star == pytest.approx(exact.sigma_star)
    assert exact.sigma_delta <= bound.sigma_delta <= 1.1 * exact.sigma_delta
    assert bound.success_fraction == 1.0 and any("sound bound" in note for note in bound.notes)


def test_case_generator_is_deterministic():
    # the property tests above must test the same executions in every process (no salted hash)
    a, _ = _case(7, 0)
    b, _ = _case(7, 0)
    assert a == b and zlib.crc32(a.to_json().encode()) == zlib.crc32(b.to_json().encode())


def test_audit_shows_which_method_certified(tmp_path, capsys, monkeypatch):
    import json

    from flwr_inca.cli import main

    trace = sample_trace(30, IncaConfig(iterations=6, neighbors=1, sigma_star=0.3, sigma_delta=3.0), seed=0)
    path = tmp_path / "trace.json"
    trace.save(path)
    assert main(["audit", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "exact"
    monkeypatch.setattr(certificate_module, "EXACT_MAX_ROWS", 0)  # as if the trace were huge
    assert main(["audit", str(path)]) == 0
    assert "method: bound" in capsys.readouterr().out


def test_party_with_a_rank_deficient_schedule_is_still_bounded_soundly():
    # a valid custom schedule whose adapted rows become dependent for a party offline at step 1 only:
    # rows (0.5, 1, 0) at step 0 and (c_1, -Z_0) = (-0.5, -1, 0) at T = 2
    for seed in range(6):
        trace = sample_trace(8, IncaConfig(iterations=2, neighbors=1, sigma_star=0.4, sigma_delta=2.0,
                                           schedule=DEGENERATE, dropout=ScheduledDropout({1: [0, 3]})), seed=seed)
        view = random_eavesdrop(trace, 0.3, seed=seed)
        ms = MessageSpace(trace, view, 0.4, 2.0)
        assert ms.blocked[ms.slot[[0, 3]]].all()
        exact = certify(trace, view, solver="exact")
        bound = certify(trace, view, solver="bound")
        for i, mu in exact.mu.items():
            assert bound.mu[i] >= mu * (1 - 1e-9), (seed, i, mu, bound.mu[i])
        assert bound.mu[0] == pytest.approx(1 / 0.4, rel=1e-6)  # pinned: the local-DP bound
