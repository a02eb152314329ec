"""GOPA as a training mixer (flwr_inca.simulation.baseline_mixers.GOPAMixer): its estimate against the
closed form (cancellation without dropouts, the uncancelled terms with them), each round's certificate
against an independent brute-force computation on the same view, its charge through the round session
(released; refused before its roll-back, charged the published view; nothing published when the publish
ceiling does not fit), the ledger's charges in a run, the pre-round check, bad arguments, and the MNIST
study's tiny grid with gopa."""

import dataclasses
import functools
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from synthetic import CLASSES, FEATURES, linear_task

from flwr_inca.baselines import GOPA, Threat, random_corrupted
from flwr_inca.baselines.calibration import sample_views
from flwr_inca.privacy import PrivacyLedger
from flwr_inca.privacy.session import RoundSession, charge_resolution
from flwr_inca.protocol.dropout import MarkovDropout, PermanentDropout
from flwr_inca.simulation import MixContext, SimulationConfig, create_mixer, iid, seeding, simulate
from flwr_inca.simulation.baseline_mixers import GOPAMixer


def _mixer(n, d, *, mu_round=None, sensitivity=0.2, seed=7, **kw):
    mixer = GOPAMixer(**kw)
    mixer.prepare(MixContext(sensitivity, mu_round, 1e-5, n, d, seed, "float64"))
    return mixer


def _coalitions(seed, rnd, n, collusion, draws=1):
    """The round's corrupted sets, drawn from the certification seeds IncA uses (paper Sec. 4.1)."""
    root = np.random.SeedSequence(seeding.seed_of(seed, seeding.THREAT), spawn_key=(0, rnd))
    return [random_corrupted(n, collusion, int(d.generate_state(1, np.uint64)[0])) for d in root.spawn(draws)]


def _brute_mu(execution, corrupted, sigma_star, sigma_delta, sensitivity):
    """Max over honest parties of ``S sqrt(e_i^T Sigma^-1 e_i)``, the view built edge by edge from the protocol's
    description (not from pairwise_model): each published honest party's masked value, in which the
    pairwise terms shared with corrupted parties and those rolled back are known to the adversary."""
    n = execution.parties
    bad = {int(c) for c in corrupted}
    pub = ~execution.dropped_before
    observed = [i for i in range(n) if i not in bad and pub[i]]
    row = {i: r for r, i in enumerate(observed)}
    unknown = []
    for i, j in execution.edges.tolist():
        if i in bad or j in bad or not (pub[i] or pub[j]):
            continue
        if pub[i] != pub[j]:  # one end published: rolled back (revealed) unless that end dropped during it
            keeper = i if pub[i] else j
            if execution.rollback and not execution.dropped_rollback[keeper]:
                continue
        unknown.append((i, j))
    A = np.zeros((len(observed), len(unknown)))
    for c, (i, j) in enumerate(unknown):
        if pub[i]:
            A[row[i], c] -= 1.0  # i subtracts p_ij
        if pub[j]:
            A[row[j], c] += 1.0  # j adds it
    sigma = sigma_star**2 * np.eye(len(observed)) + sigma_delta**2 * A @ A.T
    inv = np.linalg.inv(sigma)
    return sensitivity * math.sqrt(max(np.diag(inv).max(initial=0.0), 0.0))


# ------------------------------------------------------------------------------------------ estimate
def test_without_dropouts_the_pairwise_terms_cancel_and_the_noise_is_sigma_star_over_sqrt_n():
    n, d, s_star, s_delta = 40, 20_000, 0.5, 30.0
    fast = _mixer(n, d, sigma_star=s_star, sigma_delta=s_delta, neighbors=5)
    full = _mixer(n, d, sigma_star=s_star, sigma_delta=s_delta, neighbors=5, draw="all")
    plan = fast.plan(1, n)
    assert plan.info["uncancelled_terms"] == 0 and plan.info["edges"] >= n * 5 // 2
    x = np.random.default_rng(0).uniform(-1, 1, (n, d))
    est_fast, est_full = fast.mix(x, plan), full.mix(x, full.plan(1, n))
    # the protocol's own arithmetic (every term added by one end and subtracted by the other) gives the
    # same estimate: the terms, each of std 30, cancel to rounding
    np.testing.assert_allclose(est_full, est_fast, rtol=0, atol=1e-9)
    noise = est_fast - x.mean(axis=0)
    assert np.var(noise) == pytest.approx(s_star**2 / n, rel=0.03)  # closed form: sigma_star^2 / n
    execution = plan.info["execution"]
    closed = GOPA(s_star, s_delta, neighbors=5).output_weights(execution).noise_variance(s_star, s_delta)
    assert closed == pytest.approx(s_star**2 / n)


def test_dropouts_leave_exactly_the_terms_not_rolled_back_in_the_estimate():
    n, d, s_star, s_delta = 60, 20_000, 0.4, 2.0
    kw = {"sigma_star": s_star, "sigma_delta": s_delta, "neighbors": 5, "gamma": 0.3, "gamma_rollback": 0.15}
    fast, full = _mixer(n, d, **kw), _mixer(n, d, draw="all", **kw)
    plan = fast.plan(3, n)
    ex = plan.info["execution"]
    assert ex.dropped_before.sum() == 9 and ex.dropped_rollback.sum() == 9  # round(0.15 n) each
    pub = ~ex.dropped_before
    # independently: a term stays when exactly one end published and that end dropped during the roll-back
    i, j = ex.edges[:, 0], ex.edges[:, 1]
    keeper = np.where(pub[i], i, j)
    stay = (pub[i] != pub[j]) & ex.dropped_rollback[keeper]
    assert plan.info["uncancelled_terms"] == stay.sum() > 0
    drawn = []
    original = fast._terms
    fast._terms = lambda rnd, index, dim: drawn.append(len(index)) or original(rnd, index, dim)
    x = np.full((n, d), 0.25)
    x[ex.dropped_before] = 1e6  # values of parties that never published cannot reach the estimate
    est = fast.mix(x, plan)
    assert drawn == [stay.sum()]  # only the uncancelled terms are drawn, O((n + U) d)
    np.testing.assert_allclose(full.mix(x, full.plan(3, n)), est, rtol=0, atol=1e-8)
    n_pub = pub.sum()
    expected = (n_pub * s_star**2 + stay.sum() * s_delta**2) / n_pub**2
    assert np.mean(est) == pytest.approx(0.25, abs=5 * math.sqrt(expected / d))
    assert np.var(est) == pytest.approx(expected, rel=0.03)
    assert GOPA(s_star, s_delta).output_weights(ex).noise_variance(s_star, s_delta) == pytest.approx(expected)
    # without the roll-back (CorDP-DME's rule) every dangling term would stay: far more noise
    assert (pub[i] != pub[j]).sum() > 2 * stay.sum()


def test_a_round_where_nobody_publishes_releases_nothing():
    mixer = _mixer(4, 3, sigma_star=1.0, sigma_delta=1.0, neighbors=2, gamma=0.9, gamma_rollback=0.0)
    plan = mixer.plan(1, 4)
    assert plan.info["published"] == 0 and plan.mu == 0.0
    assert np.isnan(mixer.mix(np.zeros((4, 3)), plan)).all()


# ------------------------------------------------------------------------------------------ certificate
@pytest.mark.parametrize("gamma, rollback", [(0.0, 0.0), (0.2, 0.05), (0.3, 0.3)])
def test_each_round_is_certified_exactly_on_its_view_as_the_baselines_certify_gopa(gamma, rollback):
    n, S, s_star, s_delta = 50, 0.3, 0.6, 1.5
    mixer = _mixer(n, 10, sensitivity=S, sigma_star=s_star, sigma_delta=s_delta, neighbors=4, gamma=gamma,
                   gamma_rollback=rollback, collusion=0.2, threat_draws=2)
    for rnd in (1, 2):
        plan = mixer.plan(rnd, n)
        assert plan.certified and plan.info["method"] == "exact"
        # the baselines' GOPA: the same execution from the same seed ...
        gopa = GOPA(s_star, s_delta, gamma, neighbors=4, gamma_rollback=rollback)
        ex = gopa.sample_execution(n, seeding.seed_of(7, seeding.TRACE, rnd))
        assert np.array_equal(ex.edges, plan.info["execution"].edges)
        assert np.array_equal(ex.dropped_before, plan.info["execution"].dropped_before)
        # ... certified by brute force on each coalition, the worst one charged
        brute = max(_brute_mu(ex, c, s_star, s_delta, S) for c in _coalitions(7, rnd, n, 0.2, draws=2))
        assert plan.mu == pytest.approx(brute, rel=1e-7)
        assert 0 < plan.mu <= S / s_star  # never above the local bound
    # the same coalitions as IncA's round (same seeds): the baselines' adversary for that key
    corrupted = _coalitions(7, 2, n, 0.2)[0]
    assert len(corrupted) == math.ceil(0.2 * n)


def test_calibrated_noise_meets_the_round_target_on_the_calibration_views():
    n, S, mu_round = 60, 0.2, 0.3
    mixer = _mixer(n, 10, mu_round=mu_round, sensitivity=S, neighbors=5, gamma=0.1, calibration_runs=6)
    cal = mixer.calibration
    assert cal.success_fraction == 1.0 and cal.runs == 6
    s_star, s_delta = mixer.sigmas(n)
    assert (s_star, s_delta) == (cal.sigma_star, cal.sigma_delta)
    target = mu_round * (1 - mixer.calibration_margin)
    gopa = GOPA(1.0, 1.0, 0.1, neighbors=5, gamma_rollback=0.025)
    views = sample_views(gopa, n, Threat.collusion(0.1), 6, seeding.seed_of(7, seeding.CALIBRATION))
    worst = max(float(v.profile.mu(s_star, s_delta).max()) for v in views) * S
    assert target * 0.9 < worst <= target * (1 + 1e-6)
    assert mixer.sigmas(n // 2)[0] == pytest.approx(s_star * math.sqrt(2))  # fewer participants: more eta*


# ------------------------------------------------------------------------------------------ ledger
X, Y = linear_task(960)
XT, YT = linear_task(300, seed=1)
MODEL = functools.partial(torch.nn.Linear, FEATURES, CLASSES)
PARTS = iid(X, Y, 24)
OPTIONS = {"neighbors": 4, "gamma": 0.25, "gamma_rollback": 0.125}
D = FEATURES * CLASSES + CLASSES


def _config(out, **kw):
    return SimulationConfig(**{"rounds": 40, "mode": "gopa", "max_epsilon": 2.0, "sigma_star": 3.0,
                               "sigma_delta": 8.0, "backend": "inline", "privacy_unit": "party",
                               "output_dir": str(out), "mixer_options": OPTIONS, **kw})


def _execution(config, rnd, n=24):
    mix = config.mixing
    gopa = GOPA(mix.sigma_star, mix.sigma_delta, OPTIONS["gamma"], neighbors=OPTIONS["neighbors"],
                gamma_rollback=OPTIONS["gamma_rollback"])
    return gopa.sample_execution(n, seeding.seed_of(config.seed, seeding.TRACE, rnd))


def _epsilon(*mus):
    """The ledger's epsilon after rounds charged ``mus`` (exact accountant, delta 1e-5)."""
    ledger = PrivacyLedger(None, delta=1e-5, accountant="exact")
    for mu in mus[:-1]:
        ledger.spend(mu)
    return ledger.epsilon_after(mus[-1])


def test_the_ledger_charges_each_round_its_certificate_and_a_refused_round_what_it_published(tmp_path,
                                                                                            monkeypatch):
    """Rounds predicted free (all admitted) until the budget runs out: each released round is charged its
    exact certificate (brute force on its execution); a round whose whole certificate no longer fits once
    its masked updates are published is stopped before its roll-back, skipped and charged exactly what was
    published (brute force on the view without the roll-back); training stops after three such refusals
    in a row, or at a round of which nothing could be published (nothing charged: this run's end); the
    ledger never exceeds the budget."""
    monkeypatch.setattr(GOPAMixer, "predicted_cost", lambda self, participants, runs: 0.0)
    config = _config(tmp_path)
    hist = simulate(MODEL, PARTS, (XT, YT), config, progress=False)
    S, resolution = hist.plan["value_sensitivity"], config.privacy.mu_resolution
    collusion = config.privacy.collusion
    assert S == 2.0 and hist.stopped
    ledger = PrivacyLedger(tmp_path / "inca_ledger.json", delta=1e-5, accountant="exact")
    trained = [r for r in hist.rounds if not r.failed]
    refused = [r for r in hist.rounds if r.refused]
    assert len(trained) >= 3 and hist.rounds_trained == len(trained) and refused
    assert refused[0].round == len(trained) + 1 and hist.rounds_refused == len(refused)
    charged = [r for r in hist.rounds if r.charged_mu > 0]
    assert ledger.rounds == len(charged) and all(e.epsilon <= 2.0 for e in ledger.entries)
    for record, entry in zip(charged, ledger.entries):
        corrupted = _coalitions(config.seed, record.round, 24, collusion)[0]
        ex = _execution(config, record.round)
        assert entry.mu == record.charged_mu and entry.method == "exact"
        if not record.refused:
            assert record.mu == pytest.approx(_brute_mu(ex, corrupted, 3.0, 8.0, S), rel=1e-7)
            assert entry.certified_mu == record.mu and entry.mu == charge_resolution(record.mu, resolution)
            continue
        assert record.failed.startswith("skipped, refused by the budget: stopped before its final messages")
        published = _brute_mu(dataclasses.replace(ex, rollback=False), corrupted, 3.0, 8.0, S)
        assert 0 < published <= record.mu
        assert entry.mu == pytest.approx(charge_resolution(published, resolution), rel=1e-7)
    assert ("Training stops: 3 round(s) in a row were refused by the budget" in hist.stopped
            or hist.stopped.endswith("Training stops: nothing of it could be delivered: the budget left does "
                                     "not afford the first step of a round"))
    assert hist.epsilon == pytest.approx(ledger.epsilon()) and ledger.epsilon() <= 2.0


def test_gopa_stops_before_a_round_it_cannot_afford_with_nothing_spent(tmp_path):
    """The pre-round check: a budget a third of the predicted cost stops the run before round 1."""
    mixer = GOPAMixer(sigma_star=3.0, sigma_delta=8.0, **OPTIONS)
    mixer.prepare(MixContext(2.0, None, 1e-5, 24, D, 0))
    predicted = mixer.predicted_cost(24, 10)
    assert predicted == mixer.predicted_cost(24, 10) > 0
    hist = simulate(MODEL, PARTS, (XT, YT), _config(tmp_path, rounds=5, max_epsilon=_epsilon(predicted / 3)),
                    progress=False)
    assert hist.rounds == []
    assert hist.stopped.startswith("stopping before round 1: it would bring epsilon from 0")
    assert not (tmp_path / "inca_ledger.json").exists()


def _gopa_round(budget):
    """Round 2 of a GOPA mixer (40 parties, a 30% first-phase dropout) charged through a session whose budget
    is ``budget``: (the charge, the plan, the ledger, the published view's certificate by brute force)."""
    n, S = 40, 0.5
    mixer = _mixer(n, 10, sensitivity=S, sigma_star=0.8, sigma_delta=2.0, neighbors=6, gamma=0.3,
                   gamma_rollback=0.05)
    plan = mixer.plan(2, n)
    ledger = PrivacyLedger(None, delta=1e-5, max_epsilon=budget, accountant="exact")
    charge = mixer.charge(RoundSession(ledger, resolution=0.0), plan)
    ex = plan.info["execution"]
    published = _brute_mu(dataclasses.replace(ex, rollback=False), _coalitions(7, 2, n, 0.1)[0], 0.8, 2.0, S)
    return charge, plan, ledger, published


CEILING = 0.5 / 0.8  # the publish ceiling S / sigma_star of _gopa_round


@pytest.fixture(scope="module")
def gopa_costs():
    """(published view's certificate, whole round's certificate) of _gopa_round's round."""
    _, plan, _, published = _gopa_round(None)
    assert 0 < published < plan.mu <= CEILING  # the roll-back reveals terms; never above the local bound
    return published, plan.mu


@pytest.mark.parametrize("room", ["all", "below the ceiling"])
def test_a_round_that_fits_is_released_and_charged_its_certificate(gopa_costs, room):
    """The round's certificate fits: it is released and charged exactly that, also when the publish ceiling
    does not fit (then the masked values are published after their exact certificate was reserved)."""
    _, whole = gopa_costs
    budget = 50.0 if room == "all" else (_epsilon(whole) + _epsilon(CEILING)) / 2
    charge, plan, ledger, _ = _gopa_round(budget)
    assert charge.outcome == "released" and charge.released and charge.mu == plan.mu == whole
    assert ledger.entries[0].mu == whole and ledger.entries[0].method == "exact"
    assert "stopped" not in plan.info


def test_a_round_refused_before_its_roll_back_is_charged_the_published_view(gopa_costs):
    """What is published fits, the whole round does not: the round is stopped before its roll-back and
    charged exactly the certificate of the published masked values (brute force); training goes on."""
    published, whole = gopa_costs
    charge, plan, ledger, brute = _gopa_round((_epsilon(published) + _epsilon(whole)) / 2)
    assert charge.outcome == "refused" and not charge.released and charge.delivered == 1 and not charge.stop
    assert plan.info["stopped"] == "before its roll-back"
    assert charge.mu == pytest.approx(brute, rel=1e-7) and ledger.entries[0].mu == charge.mu
    assert ledger.entries[0].status == "charged"


def test_a_round_whose_published_view_does_not_fit_publishes_nothing_and_stops_training(gopa_costs):
    """Neither the publish ceiling nor the exact certificate of the masked values fits: nothing is
    published, nothing charged, and training stops."""
    published, _ = gopa_costs
    charge, plan, ledger, _ = _gopa_round(_epsilon(published) * 0.99)
    assert charge.outcome == "refused" and charge.delivered == 0 and charge.mu == 0 and charge.entry is None
    assert plan.info["stopped"] == "before publishing" and "nothing of it could be delivered" in charge.stop
    assert ledger.rounds == 0


# ------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize("kwargs, words", [
    ({"neighbors": 0}, "neighbors (k_PR)"),
    ({"gamma": 1.0}, "gamma (share of the participants"),
    ({"gamma": 0.1, "gamma_rollback": 0.2}, "gamma_rollback (gamma_2) must be in [0, gamma]"),
    ({"collusion": 1.0}, "collusion"),
    ({"threat_draws": 0}, "threat_draws"),
    ({"sigma_star": 1.0}, "give both sigma_star and sigma_delta"),
    ({"sigma_star": -1.0, "sigma_delta": 1.0}, "sigma_star"),
    ({"calibration_runs": 0}, "calibration_runs"),
    ({"calibration_success": 0.0}, "calibration_success"),
    ({"draw": "some"}, "draw must be 'uncancelled' or 'all'"),
])
def test_bad_arguments_name_the_parameter(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        GOPAMixer(**kwargs)


def test_bad_configurations_and_inputs_are_refused_clearly():
    with pytest.raises(ValueError, match="mixer_options for mode 'gopa'"):
        SimulationConfig(mode="gopa", max_epsilon=1.0, mixer_options={"neighbours": 3})
    with pytest.raises(ValueError, match="gopa takes PermanentDropout"):
        create_mixer(SimulationConfig(mode="gopa", max_epsilon=1.0, dropout=MarkovDropout(0.1, 0.5)))
    with pytest.raises(ValueError, match="disagree"):
        create_mixer(SimulationConfig(mode="gopa", max_epsilon=1.0, dropout=PermanentDropout(0.1),
                                      mixer_options={"gamma": 0.2}))
    config = SimulationConfig(mode="gopa", max_epsilon=1.0, dropout=PermanentDropout(0.2))
    assert create_mixer(config).gamma == 0.2
    with pytest.raises(ValueError, match="or a budget"):
        _mixer(10, 5)
    mixer = _mixer(10, 5, sigma_star=1.0, sigma_delta=1.0)
    with pytest.raises(ValueError, match="participants"):
        mixer.plan(1, 1)
    with pytest.raises(ValueError, match="updates has 9 rows but the round's plan has 10 participants"):
        mixer.mix(np.zeros((9, 5)), mixer.plan(1, 10))


# ------------------------------------------------------------------------------------------ study
def test_the_study_runs_gopa_on_its_tiny_grid_within_the_budget(tmp_path):
    from flwr_inca.simulation.data import Dataset
    from flwr_inca.study import TINY_GRID, run_study

    rng = np.random.default_rng(4)
    centers = rng.standard_normal((10, 784)).astype(np.float32)
    y = rng.integers(0, 10, 1400)
    x = (centers[y] + rng.standard_normal((1400, 784))).astype(np.float32)
    data = Dataset(x[:1100], y[:1100].astype(np.int64), x[1100:], y[1100:].astype(np.int64), "blobs")
    grid = dataclasses.replace(TINY_GRID, methods=("gopa", "central-dp"), epsilons=(1.0,), gammas=(0.0, 0.25),
                               validation=200, train_examples=None, test_examples=None)
    summary = run_study(data, grid, tmp_path, log=lambda s: None)
    rows = {(r["method"], r["gamma"]): r for r in summary["table"]}
    for gamma in (0.0, 0.25):
        gopa = rows[("gopa", gamma)]
        assert gopa["label"].startswith("GOPA") and gopa["accuracy"] > 0.3, gopa  # ten classes: chance 0.1
        assert 0 < gopa["epsilon_spent"] <= 1.0 + 1e-9
    assert "| GOPA (k_PR = 20, roll-back) |" in (tmp_path / "table.md").read_text()
