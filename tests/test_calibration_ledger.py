import json
import math
import os

import numpy as np
import pytest

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.privacy import (
    BudgetExceededError,
    PrivacyLedger,
    RoundCost,
    calibrate,
    certify,
    classic_mu,
    create_accountant,
    epsilon_for_delta,
    mu_for_epsilon,
    random_collusion,
)
from flwr_inca.protocol import sample_trace
from flwr_inca.protocol.utility import expected_mse

N, EPS, DELTA = 60, 0.5, 1e-5


@pytest.fixture(scope="module")
def calibrations():
    kw = {"iterations": 12, "neighbors": 1, "collusion": 0.1, "dropout": PermanentDropout(0.1), "runs": 12,
          "seed": 3}
    return {p: calibrate(EPS, DELTA, N, procedure=p, **kw) for p in ("paper", "exact")}


def _regenerate(cal, r):
    trace_seed, view_seed = cal.run_seeds[r]
    trace = sample_trace(N, IncaConfig(iterations=cal.iterations, neighbors=cal.neighbors, sigma_star=1,
                                       sigma_delta=1, dropout=PermanentDropout(0.1)), trace_seed)
    return trace, random_collusion(trace, 0.1, view_seed)


@pytest.mark.parametrize("procedure", ["paper", "exact"])
def test_calibrated_runs_are_certified_independently(calibrations, procedure):
    """Every run counted as a success meets the stated target under the (dense, independent) check."""
    cal = calibrations[procedure]
    successes = 0
    for r in range(cal.runs):
        trace, view = _regenerate(cal, r)
        cert = certify(trace, view, sigma_star=cal.sigma_star, sigma_delta=cal.sigma_delta, method="dense")
        ok = cert.max_mu <= cal.mu_target * (1 + 1e-9)
        successes += ok
    assert successes / cal.runs == pytest.approx(cal.success_fraction)
    assert cal.success_fraction == 1.0


def test_paper_procedure_follows_the_paper(calibrations):
    cal = calibrations["paper"]
    n_o = N * (1 - 0.1 - 0.1)
    assert cal.alpha == 1.3
    assert cal.mu_target == pytest.approx(classic_mu(EPS, DELTA))
    assert cal.sigma_star**2 == pytest.approx(1.3 * 2 * math.log(1.25 / DELTA) / (n_o * EPS**2), rel=1e-12)
    # worst case over runs: some run needs exactly this sigma_delta (up to bisection tolerance)
    needs = []
    for r in range(cal.runs):
        trace, view = _regenerate(cal, r)
        from flwr_inca.privacy import profile

        needs.append(profile(trace, view).min_sigma_delta(cal.sigma_star, cal.mu_target))
    assert cal.sigma_delta == pytest.approx(max(needs), rel=1e-9)


def test_exact_procedure_is_more_accurate_and_uses_tight_target(calibrations):
    exact, paper = calibrations["exact"], calibrations["paper"]
    assert exact.mu_target == pytest.approx(mu_for_epsilon(EPS, DELTA))
    assert exact.mu_target > paper.mu_target
    assert exact.predicted_mse < paper.predicted_mse
    assert exact.alpha >= 1.0  # default min_alpha: never relies on other parties dropping out
    best = min((row for row in exact.alternatives if row["success_fraction"] == 1.0),
               key=lambda row: row["predicted_mse"])
    assert best["alpha"] == exact.alpha


def test_predicted_mse_is_the_mean_of_closed_form_run_mse(calibrations):
    cal = calibrations["exact"]
    mses = [expected_mse(_regenerate(cal, r)[0], cal.sigma_star, cal.sigma_delta) for r in range(cal.runs)]
    assert cal.predicted_mse == pytest.approx(np.mean(mses), rel=1e-9)


def test_the_drivers_calibration_predicts_the_mse_of_its_own_sigmas_for_every_alpha():
    """NoiseCalibrator calibrates at a reference target and unit sensitivity and scales the sigmas; the
    predicted MSE of the chosen sigmas and of every alpha's row is the closed form's at the scaled sigmas on
    the same runs (not the reference's), the chosen row is still the most accurate that certifies, and at a
    nearby party count the extrapolated MSE is near the closed form's mean over executions of that count."""
    from flwr_inca.privacy.calibration import NoiseCalibrator

    calibrator = NoiseCalibrator(iterations=12, neighbors=1, collusion=0.1, dropout=PermanentDropout(0.1),
                                 runs=6, seed=3)
    mu, sensitivity = 0.4, 2.0  # far from the reference (0.05, unit sensitivity): sigmas scaled 0.25 x
    cal = calibrator.calibration(N, mu, DELTA, sensitivity)
    assert cal.mu_target == mu and cal.value_sensitivity == sensitivity and cal.parties == N
    assert cal.run_seeds == calibrate(EPS, DELTA, N, iterations=12, dropout=PermanentDropout(0.1), runs=6,
                                      seed=calibrator.seed_for(N)).run_seeds  # seed_for: the same executions
    runs = [_regenerate(cal, r) for r in range(cal.runs)]
    for row in [{"sigma_star": cal.sigma_star, "sigma_delta": cal.sigma_delta, "predicted_mse": cal.predicted_mse},
                *cal.alternatives]:
        brute = np.mean([expected_mse(trace, row["sigma_star"], row["sigma_delta"]) for trace, _ in runs])
        assert row["predicted_mse"] == pytest.approx(brute, rel=1e-9), row
        assert cal.mse_at(row["sigma_star"], row["sigma_delta"]) == pytest.approx(brute, rel=1e-9)
    assert len(cal.alternatives) > 3
    assert cal.predicted_mse == min(r["predicted_mse"] for r in cal.alternatives if r["success_fraction"] == 1)
    # the chosen sigmas certify what they say at the scaled target and sensitivity
    for trace, view in runs:
        cert = certify(trace, view, sigma_star=cal.sigma_star, sigma_delta=cal.sigma_delta,
                       value_sensitivity=sensitivity, method="dense")
        assert cert.max_mu <= mu * (1 + 1e-9)
    # a party count within reach reuses these runs; its predicted MSE is extrapolated (each term x 60/70),
    # nearer the closed form over fresh executions of 70 parties than the same terms not extrapolated
    near = calibrator.calibration(N + 10, mu, DELTA, sensitivity)
    assert near.run_seeds == cal.run_seeds and near.calibrated_parties == N and near.parties == N + 10
    assert any("scaled to 70" in note for note in near.notes)
    config = IncaConfig(iterations=12, neighbors=1, sigma_star=near.sigma_star, sigma_delta=near.sigma_delta,
                        dropout=PermanentDropout(0.1))
    fresh = np.mean([expected_mse(sample_trace(N + 10, config, seed)) for seed in range(100)])
    not_extrapolated = near.predicted_mse * (N + 10) / N
    assert abs(near.predicted_mse - fresh) < 0.5 * abs(not_extrapolated - fresh)
    assert near.predicted_mse == pytest.approx(fresh, rel=0.08)
    # without dropouts sigma_delta's term is 0: a huge sigma_delta adds nothing (not inf * 0 = nan)
    quiet = calibrate(EPS, DELTA, N, iterations=12, runs=3, seed=1)
    assert quiet.mse_terms["delta"] == 0 and quiet.mse_at(quiet.sigma_star, 1e300) == pytest.approx(quiet.predicted_mse, rel=1e-12)


def test_calibration_config_and_dict(calibrations):
    cal = calibrations["exact"]
    cfg = cal.config(dropout=PermanentDropout(0.1))
    assert cfg.sigma_star == cal.sigma_star and cfg.iterations == 12
    d = cal.to_dict()
    assert d["procedure"] == "exact" and len(d["run_seeds"]) == cal.runs
    json.dumps(d)


def test_value_sensitivity_scales_sigmas():
    kw = {"iterations": 8, "runs": 3, "seed": 0, "collusion": 0.1}
    a = calibrate(1.0, 1e-5, 30, **kw)
    b = calibrate(1.0, 1e-5, 30, value_sensitivity=2.5, **kw)
    assert b.sigma_star == pytest.approx(2.5 * a.sigma_star)
    assert b.sigma_delta == pytest.approx(2.5 * a.sigma_delta)


def test_eavesdrop_calibration_runs():
    cal = calibrate(1.0, 1e-5, 30, iterations=8, neighbors=2, observed_fraction=0.5, runs=3, seed=1)
    assert cal.threat.startswith("eavesdrop") and math.isfinite(cal.sigma_delta)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"delta": 1.0}, "delta"),
        ({"runs": 0}, "runs"),
        ({"collusion": 1.0}, "rho"),
        ({"procedure": "magic"}, "procedure"),
        ({"procedure": "paper", "epsilon": 2.0}, "epsilon < 1"),
        ({"neighbors": 30}, "neighbors"),
        ({"target_success": 0.0}, "target_success"),
        ({"runs": True}, r"runs must be an integer in \[1, 100000\], got True"),
        ({"value_sensitivity": -1.0}, r"value_sensitivity must be in \(0, 1e\+100\]"),
        ({"min_alpha": float("nan")}, "min_alpha"),
        ({"observed_fraction": 1.5, "collusion": None}, r"observed_fraction must be in \[0, 1\]"),
    ],
)
def test_calibration_bad_input(kwargs, match):
    args = {"epsilon": 0.5, "delta": 1e-5, "parties": 30, "runs": 2, "iterations": 4}
    args.update(kwargs)
    eps, delta, n = args.pop("epsilon"), args.pop("delta"), args.pop("parties")
    with pytest.raises(ValueError, match=match):
        calibrate(eps, delta, n, **args)


def test_impossible_target_is_reported_and_local_dp_level_is_flagged():
    # one iteration and half the parties corrupted: some honest party has every message observed
    kw = {"iterations": 1, "collusion": 0.5, "runs": 3, "seed": 0}
    with pytest.raises(ValueError, match="impossible target for the paper's procedure"):
        calibrate(0.5, 1e-5, 20, procedure="paper", **kw)
    cal = calibrate(0.5, 1e-5, 20, procedure="exact", **kw)
    assert cal.success_fraction == 1.0
    assert cal.sigma_star >= 0.5 / cal.mu_target and "local-DP level" in cal.notes[0]


# ------------------------------------------------------------------------------ accountants
def test_exact_composition_is_root_sum_of_squares():
    acc = create_accountant("exact")
    mus = [0.3, 0.4, 1.2]
    assert acc.epsilon([RoundCost(m) for m in mus], 1e-5) == pytest.approx(
        epsilon_for_delta(math.sqrt(sum(m * m for m in mus)), 1e-5))
    with pytest.raises(ValueError, match="subsampling"):
        acc.epsilon([RoundCost(0.3, 0.1)], 1e-5)


def test_opacus_accountants_bound_the_exact_value_without_subsampling():
    rounds = [RoundCost(0.5)] * 4 + [RoundCost(0.25)] * 2
    exact = create_accountant("exact").epsilon(rounds, 1e-5)
    rdp = create_accountant("opacus-rdp").epsilon(rounds, 1e-5)
    prv = create_accountant("opacus-prv").epsilon(rounds, 1e-5)
    assert exact <= prv <= exact + 0.011
    assert exact <= rdp <= 1.2 * exact


def test_opacus_accountants_with_subsampling_match_opacus_directly():
    from opacus.accountants import RDPAccountant

    rounds = [RoundCost(2.0, 0.05)] * 30
    ours = create_accountant("opacus-rdp").epsilon(rounds, 1e-5)
    theirs = RDPAccountant()
    theirs.history = [(0.5, 0.05, 30)]
    assert ours <= theirs.get_epsilon(1e-5) + 1e-9  # more orders can only tighten the bound
    assert ours == pytest.approx(theirs.get_epsilon(1e-5), rel=0.05)
    prv = create_accountant("opacus-prv").epsilon(rounds, 1e-5)
    assert prv < ours  # PRV is tighter than RDP
    # subsampling amplifies privacy
    assert prv < create_accountant("exact").epsilon([RoundCost(2.0)] * 30, 1e-5)


def test_rdp_extended_orders_avoid_the_opacus_floor():
    tiny = [RoundCost(0.001)]
    assert create_accountant("opacus-rdp").epsilon(tiny, 1e-5) < 0.02  # Opacus's default orders floor at ~0.1


# ------------------------------------------------------------------------------ ledger
def test_ledger_composes_persists_and_resumes(tmp_path):
    path = tmp_path / "ledger.json"
    led = PrivacyLedger(path, delta=1e-5, max_epsilon=3.0)
    eps = [led.spend(0.3) for _ in range(3)]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(epsilon_for_delta(math.sqrt(3) * 0.3, 1e-5))
    again = PrivacyLedger(path, delta=1e-5, max_epsilon=3.0)
    assert again.rounds == 3 and again.epsilon() == pytest.approx(led.epsilon())
    data = json.loads(path.read_text())
    assert data["format"] == "inca-ledger/2" and [r["round"] for r in data["rounds"]] == [1, 2, 3]


def test_ledger_refuses_a_round_over_budget_and_records_nothing(tmp_path):
    path = tmp_path / "ledger.json"
    led = PrivacyLedger(path, delta=1e-5, max_epsilon=1.0)
    led.spend(0.2)
    before = path.read_bytes()
    assert not led.can_afford(0.5)
    with pytest.raises(BudgetExceededError, match=r"max_epsilon = 1"):
        led.spend(0.5)
    assert led.rounds == 1 and path.read_bytes() == before
    led.spend(0.5, force=True, note="already exchanged")
    assert led.rounds == 2 and led.epsilon() > 1.0


def test_ledger_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ledger.json"
    led = PrivacyLedger(path, delta=1e-5)
    led.spend(0.1)
    before = path.read_bytes()

    def crash(*args, **kwargs):
        raise OSError("disk died")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        led.spend(0.1)
    assert path.read_bytes() == before and led.rounds == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.json", "ledger.json.lock"]  # no temp file


def test_ledger_rejects_mismatched_or_broken_files(tmp_path):
    path = tmp_path / "ledger.json"
    PrivacyLedger(path, delta=1e-5).spend(0.1)
    with pytest.raises(ValueError, match="delta"):
        PrivacyLedger(path, delta=1e-6)
    with pytest.raises(ValueError, match="accountant"):
        PrivacyLedger(path, delta=1e-5, accountant="opacus-rdp")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        PrivacyLedger(path, delta=1e-5)
    path.write_text(json.dumps({"format": "inca-ledger/2", "delta": 1e-5, "accountant": "exact",
                                "rounds": [{"round": 2, "mu": 0.1}]}))
    with pytest.raises(ValueError, match="out of order"):
        PrivacyLedger(path, delta=1e-5)
    with pytest.raises(ValueError, match="sample_rate"):
        PrivacyLedger(None, delta=1e-5).spend(0.1, sample_rate=0.0)
    with pytest.raises(ValueError, match="max_epsilon"):
        PrivacyLedger(None, delta=1e-5, max_epsilon=-1)


def test_ledger_with_subsampled_rounds(tmp_path):
    led = PrivacyLedger(tmp_path / "l.json", delta=1e-5, accountant="opacus-prv", max_epsilon=5.0)
    for _ in range(5):
        led.spend(1.0, sample_rate=0.02)
    assert 0 < led.epsilon() < epsilon_for_delta(math.sqrt(5), 1e-5)
    again = PrivacyLedger(tmp_path / "l.json", delta=1e-5, accountant="opacus-prv")
    assert again.epsilon() == pytest.approx(led.epsilon())


def test_min_alpha_above_the_grid_is_used():
    cal = calibrate(1.0, 1e-5, 10, iterations=5, runs=5, min_alpha=20)
    assert cal.alpha == 20 and [a["alpha"] for a in cal.alternatives] == [20]
    assert cal.success_fraction == 1.0


@pytest.mark.parametrize("procedure", ["paper", "exact"])
def test_running_maximum_equals_bisecting_every_run(calibrations, procedure):
    """The selection keeps a running maximum over the runs (one mu evaluation per run, bisecting only
    new records); it must give what bisecting every run gives, for every alpha tried."""
    from flwr_inca.privacy import profile

    cal = calibrations[procedure]
    profiles = [profile(*_regenerate(cal, r)) for r in range(cal.runs)]
    for row in cal.alternatives:
        need = np.array([p.min_sigma_delta(row["sigma_star"], cal.mu_target) for p in profiles])
        finite = need[np.isfinite(need)]
        if procedure == "exact" and finite.size < need.size:
            assert math.isinf(row["sigma_delta"]) and row["success_fraction"] == 0
            continue
        assert row["sigma_delta"] == pytest.approx(finite.max(), rel=1e-5)
        assert row["success_fraction"] == finite.size / need.size


def test_required_sigma_delta_quantile_and_infeasible_runs():
    from flwr_inca.privacy.calibration import required_sigma_delta

    class Fixed:  # a run that needs exactly `need` (inf: no sigma_delta suffices)
        def __init__(self, need):
            self.need = need

        def mu(self, s_star, s_delta):
            return np.array([2.0 if s_delta < self.need else 1.0])

        def mu_limit(self, s_star):
            return np.array([2.0 if math.isinf(self.need) else 1.0])

        def min_sigma_delta(self, s_star, mu_target):
            return self.need

    runs = [Fixed(v) for v in (3.0, 1.0, math.inf, 5.0, 2.0)]
    assert required_sigma_delta(runs, 1.0, 1.5) == (math.inf, 0.0)
    assert required_sigma_delta(runs, 1.0, 1.5, every_run=False) == (5.0, 0.8)
    assert required_sigma_delta(runs, 1.0, 1.5, quantile=0.6) == (3.0, 0.6)
    with pytest.raises(ValueError, match="at least one"):
        required_sigma_delta([], 1.0, 1.5)


def test_covered_runs_is_the_ceiling_of_the_share_without_rounding_up_by_a_hair():
    from flwr_inca.privacy.calibration import covered_runs

    # 0.07 * 100 is 7.000000000000001 in floating point: 7 runs, not 8; 0.99 of 25 runs is all 25
    assert [covered_runs(q, r) for q, r in ((0.07, 100), (0.99, 100), (0.99, 25), (0.99, 400), (0.5, 8), (1.0, 7))] \
        == [7, 99, 25, 396, 4, 7]


def test_a_run_cache_gives_the_same_calibration_at_any_target_without_simulating_again():
    """The runs a calibration certified exactly do not depend on the target: kept in ``run_cache``, a
    later call at another epsilon (or procedure) selects on them, the same calibration as a fresh one,
    without simulating a run; another protocol, seed or party count simulates its own."""
    from dataclasses import asdict

    kw = {"iterations": 12, "neighbors": 1, "collusion": 0.1, "dropout": PermanentDropout(0.1), "runs": 8,
          "seed": 3}
    cache, simulated = {}, []

    def progress(r, runs):
        simulated.append(r)

    def same(a, b):
        a, b = asdict(a), asdict(b)
        return {k: v for k, v in a.items() if k != "seconds"} == {k: v for k, v in b.items() if k != "seconds"}

    first = calibrate(0.5, DELTA, N, procedure="paper", run_cache=cache, progress=progress, **kw)
    assert len(simulated) == 8 and len(cache) == 1
    for eps, procedure in ((0.3, "paper"), (0.8, "paper"), (0.5, "exact")):
        simulated.clear()
        cached = calibrate(eps, DELTA, N, procedure=procedure, run_cache=cache, progress=progress, **kw)
        assert simulated == []  # selected on the kept runs
        assert same(cached, calibrate(eps, DELTA, N, procedure=procedure, **kw))
    assert same(first, calibrate(0.5, DELTA, N, procedure="paper", **kw))
    for other in ({"seed": 4}, {"iterations": 10}, {"dropout": PermanentDropout(0.2)}):
        simulated.clear()
        calibrate(0.5, DELTA, N, procedure="paper", run_cache=cache, progress=progress, **{**kw, **other})
        assert len(simulated) == 8
    assert len(cache) == 4


def test_the_papers_calibrator_at_a_new_target_and_a_nearby_party_count_simulates_nothing(monkeypatch):
    """The paper's procedure is calibrated per target: at a new one, a party count within reach of one
    already calibrated is calibrated again there on the runs kept (nothing simulated), then scaled as any
    nearby count is; a count out of reach simulates its own runs."""
    import flwr_inca.privacy.calibration as module

    def calibrator():
        return module.NoiseCalibrator(iterations=12, neighbors=1, collusion=0.1, dropout=PermanentDropout(0.1),
                                      runs=6, seed=3, procedure="paper")

    simulated, simulate = [], module.simulate_runs

    def counted(*args, **kwargs):
        simulated.append(args[0])
        return simulate(*args, **kwargs)

    monkeypatch.setattr(module, "simulate_runs", counted)
    moving = calibrator()
    moving.calibration(N, 0.05, DELTA, 1.0)
    assert simulated == [N]
    nearby = moving.calibration(N - 4, 0.08, DELTA, 1.0)  # another target, 4 parties fewer
    assert simulated == [N] and nearby.parties == N - 4 and nearby.calibrated_parties == N
    # the target the paper's procedure calibrates for is its classic mu at that epsilon
    assert nearby.epsilon == pytest.approx(epsilon_for_delta(0.08, DELTA), rel=1e-12)
    assert nearby.mu_target == pytest.approx(classic_mu(nearby.epsilon, DELTA), rel=1e-9) and nearby.mu_target < 0.08
    alone = calibrator().calibration(N, 0.08, DELTA, 1.0)  # calibrating N at 0.08 from scratch
    assert simulated == [N, N]
    assert nearby.sigma_delta == alone.sigma_delta
    assert nearby.sigma_star == pytest.approx(alone.sigma_star * math.sqrt(N / (N - 4)), rel=1e-12)
    far = moving.calibration(2 * N, 0.08, DELTA, 1.0)  # out of reach: its own runs
    assert simulated == [N, N, 2 * N] and far.parties == 2 * N
