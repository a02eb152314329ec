"""Charge-aware calibration: a run's bound is tightened only above the level the runs before it charge
(bound_profile's ``charged_mu``, simulate_runs' ``quantile``, calibrate's ``tight_runs``). Every bound
stays >= exact; a charged run that sets sigma_delta (or cannot be made private) at the chosen sigma_star is
bounded again alone, and the calibrated noise is, on these executions, that of every run tightened alone."""

import math

import numpy as np
import pytest
from test_bound import _case

from flwr_inca import IncaConfig, PermanentDropout
from flwr_inca.privacy import calibrate, certify, profile, random_collusion
from flwr_inca.privacy import calibration as calibration_module
from flwr_inca.privacy.bound import bound_profile
from flwr_inca.privacy.calibration import CHARGED_MARGIN, simulate_runs
from flwr_inca.protocol import sample_trace

KW = {"iterations": 12, "neighbors": 1, "collusion": 0.1, "dropout": PermanentDropout(0.1), "seed": 3}


def _regenerate(parties: int, seeds: tuple[int, int]):
    config = IncaConfig(iterations=12, neighbors=1, sigma_star=1.0, sigma_delta=1.0, dropout=PermanentDropout(0.1))
    trace = sample_trace(parties, config, seeds[0])
    return trace, random_collusion(trace, 0.1, seeds[1])


@pytest.mark.parametrize("cascade", [True, False])
def test_a_charged_bound_is_never_below_exact_on_random_small_executions(cascade):
    # charged levels below, near and above the exact maximum: only effort changes, never soundness
    checked = 0
    for index in range(200):
        trace, view = _case(index, seed=5)
        exact = profile(trace, view, solver="exact")  # the pencil: exact at every pair of sigmas
        factor = (0.0, 0.5, 0.97, 1.2, 4.0, math.inf)[index % 6]
        top = float(exact.mu(trace.sigma_star, trace.sigma_delta).max())
        bound = bound_profile(trace, view, cascade=cascade, charged_mu=math.inf if factor == math.inf else factor * top)
        assert np.array_equal(bound.honest, exact.honest)
        # at the nominal pair and far from it: (X_i, E_i) hold for every pair
        for s_star, s_delta in ((trace.sigma_star, trace.sigma_delta), (0.3 * trace.sigma_star, 5 * trace.sigma_delta),
                                (4 * trace.sigma_star, 0.2 * trace.sigma_delta)):
            mu_e = exact.mu(s_star, s_delta)
            mu_b = bound.mu(s_star, s_delta)
            assert np.all(np.isfinite(mu_b)), index  # exact mu <= 1 / sigma_star is always finite
            assert np.all(mu_b >= mu_e * (1 - 1e-9) - 1e-12 / s_star), index
            checked += mu_e.size
    assert checked > 2400


def _setting():
    trace = sample_trace(200, IncaConfig(iterations=20, neighbors=1, sigma_star=0.25, sigma_delta=3.0,
                                         dropout=PermanentDropout(0.1)), seed=3)
    return trace, random_collusion(trace, 0.1, seed=3)


def test_a_charged_level_below_the_maximum_leaves_it_as_tight_with_fewer_global_solves():
    trace, view = _setting()
    alone = bound_profile(trace, view, cascade=True)
    top = float(alone.mu(0.25, 3.0).max())
    charged = bound_profile(trace, view, cascade=True, charged_mu=0.9 * top)
    assert charged.mu(0.25, 3.0).max() == pytest.approx(top, rel=1e-6)
    assert 0 < (charged.iterations > 0).sum() < (alone.iterations > 0).sum()


def test_a_charged_level_above_every_bound_needs_no_global_solve():
    trace, view = _setting()
    exact = certify(trace, view, solver="exact")
    mu_e = np.array([exact.mu[int(i)] for i in view.honest])
    loose = bound_profile(trace, view, cascade=True, charged_mu=10 * exact.max_mu)
    mu_l = loose.mu(0.25, 3.0)
    assert np.all(loose.iterations == 0)  # the local tier alone: sound ...
    assert np.all(mu_l >= mu_e * (1 - 1e-9))
    assert mu_l.max() > 1.01 * exact.max_mu  # ... and looser than when the maximum is charged here


@pytest.mark.parametrize("bad", [-1.0, math.nan, "0.5", True])
def test_charged_mu_must_be_a_mu(bad):
    trace, view = _case(0, seed=5)
    with pytest.raises(ValueError, match="charged_mu must be >= 0, got"):
        bound_profile(trace, view, cascade=True, charged_mu=bad)


def test_simulate_runs_charges_margin_times_the_kth_largest_maximum_of_the_runs_before():
    runs, quantile = 6, 0.5  # k = 6 - 3 + 1 = 4: runs 4 and 5 are charged the 4th largest of those before
    seeds = np.random.SeedSequence(7).generate_state(2 * runs, dtype=np.uint64).reshape(runs, 2)
    base = IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=12, neighbors=1, dropout=PermanentDropout(0.1))
    nominal = (0.2, 2.0)
    passed = []  # what reached the bound: a spy on profile
    real = calibration_module.profile

    def spy(*args, charged_mu=None, **kwargs):
        passed.append(charged_mu)
        return real(*args, charged_mu=charged_mu, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration_module, "profile", spy)
        sims = simulate_runs(60, base, seeds, rho=0.1, observed_fraction=None, solver="cascade", nominal=nominal,
                             quantile=quantile)
    maxima = [float(s.profile.mu(*nominal).max()) for s in sims]
    for r, s in enumerate(sims):
        expected = CHARGED_MARGIN * sorted(maxima[:r])[-4] if r >= 4 else None
        assert s.charged == expected == passed[r], (r, s.charged, expected, passed[r])
    plain = simulate_runs(60, base, seeds, rho=0.1, observed_fraction=None, solver="cascade", nominal=nominal)
    assert all(s.charged is None for s in plain)
    with pytest.raises(ValueError, match="quantile must be"):
        simulate_runs(60, base, seeds[:1], rho=0.1, observed_fraction=None, nominal=nominal, quantile=0.0)


def test_charged_calibration_needs_the_noise_of_tight_runs_and_every_run_is_private():
    kw = dict(KW, runs=6)
    tight = calibrate(0.5, 1e-5, 100, solver="cascade", tight_runs=True, **kw)
    charged = calibrate(0.5, 1e-5, 100, solver="cascade", **kw)
    assert not any("bounded only above" in note for note in tight.notes)
    assert any("5 of 6 runs bounded only above" in note for note in charged.notes)
    assert charged.sigma_star == pytest.approx(tight.sigma_star)
    assert charged.sigma_delta == pytest.approx(tight.sigma_delta, rel=0.01)
    assert charged.predicted_mse <= 1.01 * tight.predicted_mse
    for seeds in charged.run_seeds:  # the guarantee itself, certified exactly at the calibrated sigmas
        trace, view = _regenerate(100, seeds)
        cert = certify(trace, view, sigma_star=charged.sigma_star, sigma_delta=charged.sigma_delta, solver="exact")
        assert cert.max_mu <= charged.mu_target * (1 + 1e-9)


def _rebounded(cal) -> int:
    note = next(note for note in cal.notes if "bounded only above" in note)
    return int(note.split("; ")[1].split(" of them")[0])


def test_a_loose_run_that_sets_sigma_delta_is_bounded_again_alone(monkeypatch):
    # a margin of 50: every run after the first is left at its local bound, and the loosest sets sigma_delta
    monkeypatch.setattr(calibration_module, "CHARGED_MARGIN", 50.0)
    kw = dict(KW, runs=4)
    repaired = calibrate(0.5, 1e-5, 100, solver="cascade", **kw)
    assert _rebounded(repaired) >= 1
    monkeypatch.setattr(calibration_module, "_loose_and_binding", lambda *args: [])  # no repair
    loose = calibrate(0.5, 1e-5, 100, solver="cascade", **kw)
    assert loose.predicted_mse > repaired.predicted_mse
    tight = calibrate(0.5, 1e-5, 100, solver="cascade", tight_runs=True, **kw)
    assert repaired.predicted_mse <= 1.01 * tight.predicted_mse


def test_the_paper_procedure_bounds_again_runs_infeasible_only_as_charged():
    # every run after the first is charged at the first's (infeasible) level and left loose: without bounding
    # them again the paper's alpha would find no feasible run and raise (found by review)
    kw = {"iterations": 2, "neighbors": 1, "collusion": 0.35, "procedure": "paper", "solver": "cascade",
          "runs": 5, "seed": 1}
    tight = calibrate(0.5, 1e-5, 40, tight_runs=True, **kw)
    charged = calibrate(0.5, 1e-5, 40, **kw)
    assert (charged.sigma_star, charged.success_fraction) == (tight.sigma_star, tight.success_fraction)
    assert charged.sigma_delta == pytest.approx(tight.sigma_delta, rel=1e-9)
    assert _rebounded(charged) >= 1


def test_two_bound_passes_charge_nothing():
    cal = calibrate(0.5, 1e-5, 100, solver="cascade", bound_passes=2, **dict(KW, runs=3))
    assert not any("bounded only above" in note for note in cal.notes)


def test_tight_runs_must_be_a_bool():
    with pytest.raises(ValueError, match="tight_runs must be True or False"):
        calibrate(0.5, 1e-5, 30, runs=1, tight_runs="yes")


def test_with_a_target_success_below_one_only_runs_after_the_kth_are_charged():
    # target_success 0.5 of 6 runs: sigma_delta is the 4th largest need, so runs 4 and 5 are charged
    kw = dict(KW, runs=6, target_success=0.5)
    tight = calibrate(0.5, 1e-5, 100, solver="cascade", tight_runs=True, **kw)
    charged = calibrate(0.5, 1e-5, 100, solver="cascade", **kw)
    assert any(note.startswith("2 of 6 runs bounded only above") for note in charged.notes)
    assert charged.success_fraction >= 0.5 and tight.success_fraction >= 0.5
    assert charged.sigma_delta == pytest.approx(tight.sigma_delta, rel=0.01)
    assert charged.predicted_mse <= 1.01 * tight.predicted_mse
