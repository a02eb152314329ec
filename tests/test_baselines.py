"""Baselines: each against a brute-force computation on small cases, each linear-Gaussian view against
an independent dense reference, and the shared calibration against privacy.calibrate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
from numpy.polynomial import chebyshev as cheb
from reference import brute_force_mu

from flwr_inca.baselines import (
    GOPA,
    CentralDP,
    CorDPDME,
    DPGossip,
    IncaBaseline,
    LocalDP,
    Muffliato,
    PairwiseExecution,
    Threat,
    calibrate_baseline,
    calibrate_samples,
    gossip,
    gossip_matrix,
    graph_adjacency,
    measure_mse,
    muffliato_iterations,
    muffliato_sigma,
    noisy_gossip_step,
    pairwise_model,
    pndp_mean_privacy_loss,
    random_corrupted,
    rdp_to_dp_epsilon,
    sample_views,
)
from flwr_inca.baselines.base import noise_rng
from flwr_inca.baselines.gossip import GossipView, gossip_polynomials, second_eigenvalue
from flwr_inca.baselines.pairwise import pairwise_estimate, pairwise_masked_values, uncancelled_estimate
from flwr_inca.privacy import calibrate, mu_for_epsilon, random_collusion
from flwr_inca.privacy.calibration import simulation_seeds
from flwr_inca.privacy.certificate import SensitivityProfile
from flwr_inca.privacy.conversions import classic_c
from flwr_inca.protocol import IncaConfig, PermanentDropout, run_inca, sample_trace


# ------------------------------------------------------------------------------------------ helpers
def min_norm_mu(M: np.ndarray, h: np.ndarray) -> float:
    """|| M^+ h || by least squares; inf when h is not in the range of M."""
    sol, *_ = np.linalg.lstsq(M, h, rcond=1e-12)
    if np.linalg.norm(M @ sol - h) > 1e-7 * max(np.linalg.norm(h), 1e-12):
        return math.inf
    return float(np.linalg.norm(sol))


def certificate_mu(model, s_star, s_delta) -> dict[int, float]:
    prof = SensitivityProfile.from_model(model)
    return dict(zip(prof.honest.tolist(), prof.mu(s_star, s_delta).tolist()))


def random_pairwise_execution(rng, n=9, rollback=True) -> PairwiseExecution:
    pairs = {(int(min(a, b)), int(max(a, b))) for a, b in rng.integers(0, n, size=(3 * n, 2)) if a != b}
    edges = np.array(sorted(pairs), dtype=np.int64)
    who = rng.permutation(n)
    before = np.zeros(n, dtype=bool)
    during = np.zeros(n, dtype=bool)
    before[who[:2]] = True
    if rollback:
        during[who[2:4]] = True
    return PairwiseExecution(n, edges, before, during, rollback)


def literal_algorithm4(x, eta, p: dict, execution: PairwiseExecution) -> np.ndarray:
    """Alg. 4 one party at a time, then GOPA's roll-back, from the paper's text."""
    n = x.shape[0]
    neighbours = {i: set() for i in range(n)}
    for i, j in p:
        neighbours[i].add(j)
        neighbours[j].add(i)
    masked = {}
    for i in range(n):
        v = x[i] + eta[i]
        for j in neighbours[i]:
            v = v + p[(j, i)] if j < i else v - p[(i, j)]
        masked[i] = v
    published = [i for i in range(n) if not execution.dropped_before[i]]
    total = sum(masked[i] for i in published)
    if execution.rollback:
        for i in published:
            if execution.dropped_rollback[i]:
                continue  # dropped during the roll-back: its terms with first-phase dropouts stay
            for j in neighbours[i]:
                if execution.dropped_before[j]:
                    total = total - p[(j, i)] if j < i else total + p[(i, j)]
    return total / len(published)


def brute_pairwise_mu(execution: PairwiseExecution, corrupted, s_star, s_delta) -> dict[int, float]:
    """Every variable and every observation (published values and rolled-back terms) written out;
    the corrupted parties' values and the terms they share are known and leave the system."""
    n = execution.parties
    edges = [tuple(map(int, e)) for e in execution.edges]
    C = {int(c) for c in corrupted}
    rows = []
    for k in range(n):
        if execution.dropped_before[k]:
            continue
        row = np.zeros(n + len(edges))
        row[k] = 1.0
        for e, (i, j) in enumerate(edges):
            if k == j:
                row[n + e] = 1.0
            elif k == i:
                row[n + e] = -1.0
        rows.append(row)
    if execution.rollback:
        for e, (i, j) in enumerate(edges):
            pi, pj = not execution.dropped_before[i], not execution.dropped_before[j]
            if pi != pj:
                keeper = i if pi else j
                if not execution.dropped_rollback[keeper]:
                    row = np.zeros(n + len(edges))
                    row[n + e] = 1.0  # the roll-back reveals p_e
                    rows.append(row)
    R = np.array(rows)
    honest = [k for k in range(n) if k not in C]
    unknown_p = [e for e, (i, j) in enumerate(edges) if i not in C and j not in C]
    B = R[:, honest]
    A = R[:, [n + e for e in unknown_p]]
    M = np.hstack([s_star * B, s_delta * A])
    return {h: min_norm_mu(M, B[:, col]) for col, h in enumerate(honest)}


# ------------------------------------------------------------------------------------------ central / local DP
def test_gaussian_references_match_the_papers_numbers():
    c2 = classic_c(1e-5) ** 2
    cdp = CentralDP(0.1, 1e-5, conversion="classic")
    assert cdp.expected_mse(1024) == pytest.approx(c2 / (0.01 * 1024**2))
    assert round(cdp.expected_mse(1024), 6) == 0.002238  # paper Fig. 1
    ldp = LocalDP.calibrated(0.1, 1e-5, conversion="classic")
    assert round(ldp.expected_mse(1024), 3) == 2.292
    tight = CentralDP(0.1, 1e-5)
    assert tight.noise_std(1024) == pytest.approx(1 / (1024 * mu_for_epsilon(0.1, 1e-5)))
    assert tight.expected_mse(1024) < cdp.expected_mse(1024)


def test_central_dp_run_has_the_stated_noise():
    cdp = CentralDP(1.0, 1e-5)
    x = np.random.default_rng(0).random((50, 400))
    errors = np.concatenate([cdp.run(x, seed=s).estimate - x.mean(axis=0) for s in range(20)])
    assert np.var(errors) == pytest.approx(cdp.expected_mse(50), rel=0.05)
    assert abs(errors.mean()) < 4 * cdp.noise_std(50) / math.sqrt(errors.size)


def test_local_dp_view_is_exactly_local_dp():
    ldp = LocalDP(2.0)
    execution = ldp.sample_execution(6)
    model = ldp.observation_model(execution, np.array([1]))
    mu = certificate_mu(model, 2.0, 0.0)
    assert set(mu) == {0, 2, 3, 4, 5}
    assert all(v == pytest.approx(0.5) for v in mu.values())


# ------------------------------------------------------------------------------------------ gossip
def test_graphs_and_gossip_matrices():
    A = graph_adjacency("random-regular:4", 20, seed=3)
    assert (A != A.T).nnz == 0 and A.diagonal().sum() == 0
    assert np.all(np.asarray(A.sum(axis=1)).ravel() == 4)
    W = gossip_matrix(graph_adjacency("erdos-renyi:0.3", 15, seed=1))
    assert np.allclose(W.sum(axis=0), 1) and np.allclose(W.sum(axis=1), 1) and (W != W.T).nnz == 0
    R = gossip_matrix(graph_adjacency("erdos-renyi:0.3", 15, seed=1), "row-normalised")
    assert np.allclose(R.sum(axis=1), 1)
    H = gossip_matrix(graph_adjacency("hypercube", 16))
    assert np.allclose(H.toarray(), (graph_adjacency("hypercube", 16).toarray() + np.eye(16)) / 5)
    with pytest.raises(ValueError, match="random-regular"):
        graph_adjacency("random-regular:3", 7)
    with pytest.raises(ValueError, match="graph must be"):
        graph_adjacency("star", 7)


def test_hypercube_numbers_of_appendix_b():
    W = gossip_matrix(graph_adjacency("hypercube", 1024))
    assert second_eigenvalue(W) == pytest.approx(9 / 11)
    assert muffliato_iterations(W, "paper") == 8
    assert muffliato_iterations(W, "spectral-gap") == 17


def test_muffliato_sigma_is_the_minimum_over_the_split():
    sigma, eps_bar, alpha = muffliato_sigma(0.1, 1e-5, 1024, 10, 8)
    grid = np.linspace(1e-5, 0.1 - 1e-5, 200_001)
    brute = np.min((math.log(1e5) / (0.1 - grid) + 1) * 10 * 8 / (2 * 1024 * grid))
    assert sigma**2 == pytest.approx(brute, rel=1e-6)
    assert 180 < sigma**2 < 181
    assert round(sigma**2 / 1024, 4) == 0.1764  # paper App. B
    assert alpha == pytest.approx(math.log(1e5) / (0.1 - eps_bar) + 1)
    # Eqs. (65)-(66): at that noise, the mean RDP loss of a degree-10 party converts back to epsilon
    assert pndp_mean_privacy_loss(sigma, alpha, 8, 10, 1024) == pytest.approx(eps_bar)
    assert rdp_to_dp_epsilon(eps_bar, alpha, 1e-5) == pytest.approx(0.1)
    m = Muffliato.pndp(0.1, 1e-5, 1024, reading="paper")
    assert m.iterations == 8 and m.sigma_star == pytest.approx(sigma)


def _chebyshev_reference(W: np.ndarray, lam: float, t: int) -> np.ndarray:
    ev, V = np.linalg.eigh(W)
    coef = np.zeros(t + 1)
    coef[t] = 1
    return V @ np.diag(cheb.chebval(ev / lam, coef) / cheb.chebval(1 / lam, coef)) @ V.T


def test_gossip_cores_against_explicit_polynomials(rng):
    W = gossip_matrix(graph_adjacency("ring", 12))
    x = rng.normal(size=(12, 3))
    plain = gossip(x, W, 7)
    assert np.allclose(plain, np.linalg.matrix_power(W.toarray(), 7) @ x)
    lam = 0.9
    fast, sent = gossip(x, W, 7, chebyshev=lam, record=True)
    assert np.allclose(fast, _chebyshev_reference(W.toarray(), lam, 7) @ x)
    assert np.allclose(sent[3], _chebyshev_reference(W.toarray(), lam, 3) @ x)
    assert np.allclose(fast.mean(axis=0), x.mean(axis=0))  # doubly stochastic: the mean is kept
    polys = gossip_polynomials(W, 7, lam)
    assert np.allclose(polys[7], _chebyshev_reference(W.toarray(), lam, 7))
    step = noisy_gossip_step(x, W, 0.5, np.random.default_rng(4))
    assert np.allclose(step, W @ (x + 0.5 * np.random.default_rng(4).standard_normal(x.shape)))


def test_dp_gossip_converges_to_the_degree_weighted_mean():
    dp = DPGossip(0.0, graph="erdos-renyi:0.4", iterations=200)
    execution = dp.sample_execution(20, seed=2)
    x = np.random.default_rng(1).random((20, 2))
    res = dp.execute(x, execution, seed=0)
    deg = np.asarray(execution.adjacency.sum(axis=1)).ravel() + 1
    assert np.allclose(res.party_estimates, (deg @ x) / deg.sum(), atol=1e-9)
    w = dp.output_weights(execution)
    assert np.allclose(res.estimate, w.b @ x / w.total)


def brute_gossip_mu(execution, view: GossipView, s_star) -> dict[int, float]:
    n = execution.parties
    W = execution.W.toarray()
    msgs = []
    for t in range(execution.iterations):
        P = (_chebyshev_reference(W, execution.chebyshev, t) if execution.chebyshev
             else np.linalg.matrix_power(W, t))
        msgs += [P[i] for i in range(n) if view.observed[t, i]]
    R = np.array(msgs)
    honest = [i for i in range(n) if i not in set(view.corrupted.tolist())]
    B = R[:, honest]
    return {h: min_norm_mu(s_star * B, B[:, c]) for c, h in enumerate(honest)}


@pytest.mark.parametrize("baseline", [Muffliato(0.7, "hypercube", iterations=4),
                                      DPGossip(0.7, graph="erdos-renyi:0.3", iterations=3)])
def test_gossip_views_against_brute_force_and_local_dp(baseline):
    execution = baseline.sample_execution(16, seed=5)
    for threat, seed in ((Threat.collusion(0.15), 1), (Threat.eavesdrop(0.2), 2)):
        view = baseline.adversary(execution, threat, seed)
        mu = certificate_mu(baseline.observation_model(execution, view), 0.7, 0.0)
        brute = brute_gossip_mu(execution, view, 0.7)
        assert mu.keys() == brute.keys()
        for i in mu:
            assert mu[i] == pytest.approx(brute[i], rel=1e-7, abs=1e-9)
        first_seen = [i for i in mu if view.observed[0, i]]
        assert first_seen and all(mu[i] == pytest.approx(1 / 0.7) for i in first_seen)  # = local DP
        assert max(mu.values()) <= 1 / 0.7 + 1e-9


def test_noisy_gossip_steps_are_the_noise_then_gossip():
    """One round of DP gossip with several steps (the dp-gossip mixer) and a whole Muffliato run are one core:
    the noise once, then plain or accelerated gossip."""
    x = np.random.default_rng(3).random((16, 3))
    W = gossip_matrix(graph_adjacency("erdos-renyi:0.4", 16, 2), "row-normalised")
    noise = 0.5 * np.random.default_rng(4).standard_normal(x.shape)
    got = noisy_gossip_step(x, W, 0.5, np.random.default_rng(4), steps=3)
    assert np.allclose(got, W @ (W @ (W @ (x + noise))))
    muffliato = Muffliato(0.5, "hypercube", iterations=4)
    execution = muffliato.sample_execution(16, seed=1)
    run = muffliato.execute(x, execution, seed=9).party_estimates
    again = noisy_gossip_step(x, execution.W, 0.5, noise_rng(9, 22), steps=4, chebyshev=execution.chebyshev)
    assert execution.chebyshev is not None and np.allclose(run, again)
    assert np.allclose(run, gossip(x + 0.5 * noise_rng(9, 22).standard_normal(x.shape), execution.W, 4,
                                   chebyshev=execution.chebyshev))


# ------------------------------------------------------------------------------------------ pairwise
def test_pairwise_aggregate_matches_literal_algorithm_4(rng):
    for rollback in (True, False):
        for _ in range(5):
            ex = random_pairwise_execution(rng, rollback=rollback)
            x = rng.random((ex.parties, 2))
            eta = rng.normal(size=x.shape)
            pair = rng.normal(size=(ex.edges.shape[0], 2)) * 3
            p = {tuple(map(int, e)): pair[k] for k, e in enumerate(ex.edges)}
            got = pairwise_estimate(pairwise_masked_values(x + eta, ex.edges, pair), ex, pair)
            assert np.allclose(got, literal_algorithm4(x, eta, p, ex))
            # from the published values and the uncancelled terms only (what a training round draws)
            _, uncancelled = ex.edge_status()
            assert np.allclose(uncancelled_estimate(x + eta, ex, pair[uncancelled] / 3, 3.0), got)


def test_pairwise_views_against_brute_force(rng):
    for rollback in (True, False):
        for trial in range(6):
            ex = random_pairwise_execution(rng, rollback=rollback)
            corrupted = rng.choice(ex.parties, size=trial % 3, replace=False)
            model = pairwise_model(ex, corrupted)
            for s_star, s_delta in ((0.5, 2.0), (1.3, 0.4)):
                mu = certificate_mu(model, s_star, s_delta)
                brute = brute_pairwise_mu(ex, corrupted, s_star, s_delta)
                assert mu.keys() == brute.keys()
                for i in mu:
                    assert mu[i] == pytest.approx(brute[i], rel=1e-7, abs=1e-10), (rollback, trial, i)
            assert all(mu[i] < 1e-12 for i in mu if ex.dropped_before[i])  # never published: invisible


def test_cordp_without_dropouts_has_the_closed_form_and_dropouts_only_help():
    n, s_star, s_delta = 12, 0.8, 1.7
    cordp = CorDPDME(s_star, s_delta)
    ex = cordp.sample_execution(n, seed=0)
    corrupted = np.array([3, 7])
    mu = certificate_mu(pairwise_model(ex, corrupted), s_star, s_delta)
    n_h = n - 2
    closed = math.sqrt(1 / (n_h * s_star**2) + (1 - 1 / n_h) / (s_star**2 + n_h * s_delta**2))
    assert all(v == pytest.approx(closed) for v in mu.values())
    dropped = CorDPDME(s_star, s_delta, gamma=0.25).sample_execution(n, seed=3)
    mu_d = certificate_mu(pairwise_model(dropped, corrupted), s_star, s_delta)
    assert all(v <= closed + 1e-12 for v in mu_d.values())  # the view with dropouts is a sub-view


def test_gopa_rollback_cancels_everything_when_nobody_drops_during_it():
    gopa = GOPA(0.0, 50.0, neighbors=4, gamma=0.2, gamma_rollback=0.0)
    x = np.random.default_rng(0).random((40, 3))
    res = gopa.run(x, seed=1)
    ex = gopa.sample_execution(40, seed=1)
    assert res.details["uncancelled_terms"] == 0 and res.details["revealed_terms"] > 0
    assert np.allclose(res.estimate, x[ex.published].mean(axis=0))
    late = GOPA(0.0, 50.0, neighbors=4, gamma=0.2, gamma_rollback=0.1).run(x, seed=1)
    assert late.details["uncancelled_terms"] > 0


@pytest.mark.parametrize("baseline", [GOPA(0.6, 1.5, neighbors=3, gamma=0.2, gamma_rollback=0.1),
                                      CorDPDME(0.6, 0.8, gamma=0.2)])
def test_pairwise_expected_mse_matches_simulation(baseline):
    n = 20
    ex = baseline.sample_execution(n, seed=4)
    w = baseline.output_weights(ex)
    rng = np.random.default_rng(0)
    errors = []
    for s in range(600):
        x = rng.random((n, 10))
        errors.append((baseline.execute(x, ex, seed=s).estimate - x.mean(axis=0)) ** 2)
    predicted = w.expected_mse(baseline.sigma_star, baseline.sigma_delta)
    assert np.mean(errors) == pytest.approx(predicted, rel=0.06)
    if isinstance(baseline, CorDPDME):
        assert w.noise_variance(0.6, 0.8) == pytest.approx(baseline.noise_lower_bound(n))


def test_run_is_execute_of_sample_execution():
    x = np.random.default_rng(2).random((30, 2))
    for b in (GOPA(0.3, 1.0, neighbors=3, gamma=0.1, gamma_rollback=0.05), CorDPDME(0.3, 1.0, gamma=0.1),
              Muffliato(0.3, "ring", iterations=5), LocalDP(0.3)):
        assert np.array_equal(b.run(x, 9).estimate, b.execute(x, b.sample_execution(30, 9), 9).estimate)
        assert not np.array_equal(b.run(x, 9).estimate, b.run(x, 10).estimate)


# ------------------------------------------------------------------------------------------ IncA and the shared calibration
def test_inca_baseline_is_run_inca_and_its_view_is_the_dense_reference():
    config = IncaConfig(sigma_star=0.4, sigma_delta=2.0, iterations=4, neighbors=1, dropout=PermanentDropout(0.2))
    inca = IncaBaseline(config)
    x = np.random.default_rng(1).random((10, 2))
    assert np.array_equal(inca.run(x, 3).estimate, run_inca(x, config, 3).estimate)
    assert np.array_equal(inca.execute(x, inca.sample_execution(10, 3), 3).estimate, run_inca(x, config, 3).estimate)
    trace = inca.sample_execution(10, seed=3)
    view = inca.adversary(trace, Threat.collusion(0.2), seed=4)
    mu = certificate_mu(inca.observation_model(trace, view), 0.4, 2.0)
    brute = brute_force_mu(trace, view.corrupted.tolist(), view.observed, 0.4, 2.0)
    for i in mu:
        assert mu[i] == pytest.approx(brute[i], rel=1e-7)


def test_shared_calibration_equals_privacy_calibrate_for_inca():
    kw = {"iterations": 6, "neighbors": 1, "dropout": PermanentDropout(0.1)}
    inca = IncaBaseline(IncaConfig(sigma_star=1.0, sigma_delta=1.0, **kw))
    ours = calibrate_baseline(inca, 30, 0.5, 1e-5, Threat.collusion(0.1), runs=6, seed=11)
    for procedure in ("paper", "exact"):
        ref = calibrate(0.5, 1e-5, 30, collusion=0.1, runs=6, seed=11, procedure=procedure, **kw)
        got = ours[procedure]
        for field in ("sigma_star", "alpha", "success_fraction", "mu_target"):
            assert getattr(got, field) == pytest.approx(getattr(ref, field), rel=1e-12), (procedure, field)
        # one selection (privacy.calibration.required_sigma_delta) on the same profiles: the same sigma_delta
        assert got.sigma_delta == pytest.approx(ref.sigma_delta, rel=1e-12), procedure
        assert [r["sigma_delta"] for r in got.alternatives] == pytest.approx(
            [r["sigma_delta"] for r in ref.alternatives], rel=1e-12), procedure
        assert got.predicted_mse == pytest.approx(ref.predicted_mse, rel=1e-9), procedure


def test_worst_case_search_equals_bisecting_every_run():
    gopa = GOPA(1.0, 1.0, neighbors=4, gamma=0.2, gamma_rollback=0.05)
    samples = sample_views(gopa, 40, Threat.collusion(0.3), 12, seed=4)
    for procedure in ("paper", "exact"):
        cal = calibrate_samples(samples, 0.5, 1e-5, procedure=procedure, paper_n_o=20)
        for row in cal.alternatives:
            s_star = row["sigma_star"]
            need = np.array([s.profile.min_sigma_delta(s_star, cal.mu_target) for s in samples])
            finite = need[np.isfinite(need)]
            if procedure == "exact" and finite.size < need.size:
                assert math.isinf(row["sigma_delta"]) and row["success_fraction"] == 0
                continue
            assert row["sigma_delta"] == pytest.approx(finite.max(), rel=1e-5)
            assert row["success_fraction"] == finite.size / need.size


def test_baselines_and_privacy_calibrate_share_one_alpha_selection(monkeypatch):
    """The baselines' calibration picks alpha with privacy.calibration's selection (evaluate_alpha, pick_alpha),
    not a copy of it: a spy on the privacy module's two functions sees the calls of both calibrations, and
    the baselines' choice is the brute-force one (the most accurate alpha whose sigma_delta covers every run,
    that sigma_delta from bisecting each run)."""
    from flwr_inca.privacy import calibration as privacy_calibration

    seen = []
    for name in ("evaluate_alpha", "pick_alpha"):
        real = getattr(privacy_calibration, name)
        monkeypatch.setattr(privacy_calibration, name,
                            lambda *a, _real=real, _name=name, **k: (seen.append(_name), _real(*a, **k))[1])
    gopa = GOPA(1.0, 1.0, neighbors=4, gamma=0.2, gamma_rollback=0.05)
    samples = sample_views(gopa, 40, Threat.collusion(0.2), 8, seed=6)
    cal = calibrate_samples(samples, 0.5, 1e-5, procedure="exact", value_sensitivity=0.5, baseline="GOPA")
    assert seen.count("pick_alpha") == 1 and seen.count("evaluate_alpha") == len(cal.alternatives) > 3
    seen.clear()
    calibrate(0.5, 1e-5, 20, iterations=4, runs=3, seed=1)
    assert seen.count("pick_alpha") == 1 and seen.count("evaluate_alpha") > 3
    # the choice, by brute force over the same alphas
    best = None
    for row in cal.alternatives:
        s_star = row["sigma_star"] / 0.5
        need = max(s.profile.min_sigma_delta(s_star, cal.mu_target) for s in samples)
        mse = np.mean([s.weights.expected_mse(0.5 * s_star, 0.5 * need, 1 / 12) for s in samples])
        assert row["sigma_delta"] == pytest.approx(0.5 * need, rel=1e-5)
        if math.isfinite(need) and (best is None or mse < best[0]):
            best = (mse, row["alpha"])
    assert cal.alpha == best[1] and cal.predicted_mse == pytest.approx(best[0], rel=1e-4)


def test_calibration_covers_every_simulated_gopa_run():
    gopa = GOPA(1.0, 1.0, neighbors=5, gamma=0.1, gamma_rollback=0.05)
    cal = calibrate_baseline(gopa, 40, 0.5, 1e-5, Threat.collusion(0.1), runs=5, seed=2)
    for procedure, c in cal.items():
        tuned = c.apply(gopa)
        assert c.success_fraction == 1.0
        for r, (s_exec, s_view) in enumerate(simulation_seeds(2, 5)):
            ex = tuned.sample_execution(40, int(s_exec))
            view = tuned.adversary(ex, Threat.collusion(0.1), int(s_view))
            mu = certificate_mu(tuned.observation_model(ex, view), tuned.sigma_star, tuned.sigma_delta)
            assert max(mu.values()) <= c.mu_target * (1 + 1e-5), (procedure, r)
    paper = cal["paper"]
    assert paper.alpha == 1.3 and paper.n_o == pytest.approx(40 * (1 - 0.1 - 0.1))


def test_measure_mse_is_reproducible_and_matches_the_closed_form():
    cdp = CentralDP(1.0, 1e-5)
    a = measure_mse(cdp, 40, runs=200, seed=3, dim=5)
    b = measure_mse(cdp, 40, runs=200, seed=3, dim=5)
    assert a.mse == b.mse
    assert a.mse == pytest.approx(cdp.expected_mse(40), rel=0.15)


def test_random_corrupted_matches_random_collusion():
    trace = sample_trace(50, IncaConfig(sigma_star=1.0, sigma_delta=1.0), seed=0)
    for seed in range(5):
        assert np.array_equal(random_corrupted(50, 0.23, seed), random_collusion(trace, 0.23, seed).corrupted)


# ------------------------------------------------------------------------------------------ bad input
def test_bad_arguments_name_the_parameter():
    with pytest.raises(ValueError, match="gamma_rollback"):
        GOPA(1.0, 1.0, gamma=0.1, gamma_rollback=0.2)
    with pytest.raises(ValueError, match="gamma"):
        CorDPDME(1.0, 1.0, gamma=1.0)
    with pytest.raises(ValueError, match="sigma_delta"):
        GOPA(1.0, -1.0)
    with pytest.raises(ValueError, match="k_PR"):
        GOPA(1.0, 1.0, neighbors=20).run(np.zeros((10, 1)), 0)
    with pytest.raises(ValueError, match="x must be finite"):
        GOPA(1.0, 1.0, neighbors=2).run(np.array([[0.0], [np.nan], [1.0]]), 0)
    with pytest.raises(ValueError, match="collusion fraction"):
        Threat.collusion(1.0)
    with pytest.raises(ValueError, match="threat kind"):
        Threat("spy", 0.1)
    with pytest.raises(ValueError, match="sigma_delta must be 0"):
        Muffliato(1.0, sigma_delta=1.0)
    with pytest.raises(ValueError, match="rows but the execution"):
        CorDPDME(1.0, 1.0).execute(np.zeros((5, 1)), CorDPDME(1.0, 1.0).sample_execution(6, 0))
    with pytest.raises(ValueError, match="conversion"):
        CentralDP(0.5, 1e-5, conversion="loose")
    with pytest.raises(ValueError, match="procedures"):
        calibrate_baseline(LocalDP(1.0), 5, 0.5, 1e-5, Threat.collusion(0.1), procedures=("best",))
    with pytest.raises(ValueError, match="edges"):
        PairwiseExecution(4, np.array([[2, 1]]), np.zeros(4, bool), np.zeros(4, bool), True)
    assert sp.issparse(graph_adjacency("complete", 4))


def test_baseline_inputs_are_checked_like_run_incas():
    import torch

    from flwr_inca.baselines.base import as_values
    from flwr_inca.protocol.engine import as_values as engine_values

    for bad in (np.zeros(0), np.zeros((1, 2)), np.array(["a", "b"]), np.zeros((2, 2, 2)),
                np.array([[0.0, np.inf], [1.0, 2.0]])):
        with pytest.raises(ValueError) as ours:
            as_values(bad)
        with pytest.raises(ValueError) as engine:
            engine_values(bad)
        assert str(ours.value) == str(engine.value)
    values, scalar = as_values(torch.tensor([0.5, 0.25, 1.0], dtype=torch.bfloat16))  # no NumPy dtype
    assert scalar and values.dtype == np.float64 and values[:, 0].tolist() == [0.5, 0.25, 1.0]
    values, scalar = as_values(np.ones((3, 2), dtype=np.float32))
    assert not scalar and values.dtype == np.float64 and values.flags.c_contiguous


MEMORY_CASES = {  # baseline, n, threat: views of every kind, rows ~ honest (pairwise, local DP) and rows >> honest
    "GOPA": (lambda: GOPA(1.0, 1.0, 0.1, neighbors=5), 400, Threat.collusion(0.1)),
    "CorDP-DME": (lambda: CorDPDME(1.0, 1.0, gamma=0.1), 400, Threat.collusion(0.1)),
    "local DP": (lambda: LocalDP(1.0), 400, Threat.collusion(0.1)),
    "DP gossip": (lambda: DPGossip(1.0, iterations=8), 120, Threat.collusion(0.1)),
    "Muffliato": (lambda: Muffliato(1.0, "hypercube", 6), 128, Threat.collusion(0.1)),
    "IncA": (lambda: IncaBaseline(IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=6, neighbors=2,
                                             dropout=PermanentDropout(0.1))), 150, Threat.collusion(0.1)),
    "IncA eavesdropped": (lambda: IncaBaseline(IncaConfig(sigma_star=1.0, sigma_delta=1.0, iterations=6)), 150,
                          Threat.eavesdrop(0.5)),
}


@pytest.mark.parametrize("name", list(MEMORY_CASES))
def test_the_memory_a_view_is_refused_at_bounds_what_its_certificate_allocates(name, monkeypatch):
    """The size check of ``observation_model`` (before anything is built) estimates at least the peak that
    building the view and its exact certificate allocates (NumPy's allocations, traced), and not more than
    twice it: too low would let a view that does not fit through, too high would refuse views that fit."""
    import tracemalloc

    from threadpoolctl import threadpool_limits

    make, n, threat = MEMORY_CASES[name]
    baseline = make()
    execution = baseline.sample_execution(n, 1)
    view = baseline.adversary(execution, threat, 2)
    with threadpool_limits(1):
        tracemalloc.start()
        try:
            SensitivityProfile.from_model(baseline.observation_model(execution, view))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    # the estimate is what the check compares with the limit: a limit just below it refuses the view
    estimate = _refused_above(baseline, execution, view, monkeypatch)
    assert peak <= estimate <= 2 * peak, (peak, estimate)


def _refused_above(baseline, execution, view, monkeypatch) -> float:
    """The smallest memory limit (bytes, to 1%) under which ``observation_model`` is not refused."""
    from flwr_inca._checks import MEMORY_ENV

    low, high = 1.0, 1e12
    while high > 1.01 * low:
        mid = math.sqrt(low * high)
        monkeypatch.setenv(MEMORY_ENV, str(int(mid)))
        try:
            baseline.observation_model(execution, view)
            high = mid
        except ValueError as exc:
            assert f"the exact certificate of one {baseline.name} run" in str(exc)
            low = mid
    return high
