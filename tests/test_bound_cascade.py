"""The charge-aware cascade (bound_profile(cascade=True), certify(solver="cascade")): a local bound for
every party, rigorously evaluated without forming its dy, and the global bound only near the maximum.
Never below the exact mu; its maximum as tight as the global bound's."""

import math
import re

import numpy as np
import pytest
from test_bound import _case

from flwr_inca import IncaConfig, PermanentDropout, TemporaryDropout
from flwr_inca.privacy import certificate as certificate_module
from flwr_inca.privacy import certify, choose_solver, random_collusion, random_eavesdrop
from flwr_inca.privacy.bound import BoundSettings, _cg, _evaluate, _Operator, bound_profile
from flwr_inca.privacy.local_bound import LocalTier
from flwr_inca.privacy.message_space import MessageSpace
from flwr_inca.privacy.rounds import RoundCertificate
from flwr_inca.protocol import sample_trace


def _check_cascade(cases: int, seed: int, settings: BoundSettings | None = None, tight: bool = False) -> int:
    """Cascade >= exact (1e-9 relative) and finite for every party; with ``tight``, its maximum (what is
    charged) also no looser than the global bound's with the same settings."""
    checked = 0
    for index in range(cases):
        trace, view = _case(index, seed)
        exact = certify(trace, view, solver="exact")
        cascade = certify(trace, view, solver="cascade", bound_settings=settings)
        assert cascade.method == "cascade"
        if tight:
            bound = certify(trace, view, solver="bound", bound_settings=settings)
            assert cascade.max_mu <= bound.max_mu * (1 + 1e-4), (index, cascade.max_mu, bound.max_mu)
        scale = 1.0 / trace.sigma_star
        for i, mu in exact.mu.items():
            b = cascade.mu[i]
            assert math.isfinite(b), (index, i, mu, b)  # exact mu <= 1 / sigma_star is always finite
            assert b >= mu * (1 - 1e-9) - 1e-12 * scale, (index, i, mu, b)
            checked += 1
    return checked


def test_cascade_is_never_below_exact_on_200_random_small_executions():
    # both schedules and two custom ones, all dropout models, collusion and eavesdropping, 4 sigma pairs
    # (every combination 10 times); a small work budget: soundness must not depend on how far either tier got
    settings = BoundSettings(iterations=2, max_iterations=4, local_iterations=2, global_iterations=3)
    assert _check_cascade(200, seed=0, settings=settings) > 800


def test_cascade_is_never_below_exact_and_as_tight_as_the_bound_with_the_default_budget():
    assert _check_cascade(200, seed=1, tight=True) > 800


@pytest.mark.slow
def test_cascade_is_never_below_exact_on_3000_more_executions():
    assert _check_cascade(3000, seed=2) > 12000


@pytest.mark.slow
def test_cascade_is_as_tight_as_the_bound_on_1000_more_executions():
    assert _check_cascade(1000, seed=4, tight=True) > 4000


def _local_setting(n: int, seed: int, T: int = 10):
    trace = sample_trace(n, IncaConfig(iterations=T, neighbors=1, sigma_star=0.3, sigma_delta=3.0,
                                       dropout=PermanentDropout(0.1)), seed=seed)
    return trace, random_collusion(trace, 0.1, seed=seed)


def _tier(trace, view, iterations: int = 20) -> tuple[MessageSpace, LocalTier]:
    ms = MessageSpace(trace, view, 0.3, 3.0)
    op = _Operator(ms, 0.3, 3.0, BoundSettings())
    b = op.w * ms.apply_P(ms.target(np.arange(ms.nH)).sum(axis=1, keepdims=True)) / ms.nH
    G = _cg(op, b, np.zeros((ms.U, 1)), 30).astype(float)[:, 0]
    return ms, LocalTier(ms, G, 0.3, 3.0, iterations)


def _ld_cost(ms: MessageSpace, tier: LocalTier, q: int, S: np.ndarray, u: np.ndarray, a: float,
             Dz: np.ndarray | None = None) -> tuple[np.longdouble, np.longdouble]:
    """(X, E) of dy = a G + u (u on the columns S) for party q over every party, in 80-bit precision, from
    the dense Dz and each group's P (independent of both evaluations)."""
    Dz = ms.Dz.toarray().astype(np.longdouble) if Dz is None else Dz
    dy = a * tier.G.astype(np.longdouble)
    dy[S] += u
    dz = Dz @ dy - ms.target(np.array([q]))[:, 0].astype(np.longdouble)
    x_ld = e_ld = np.longdouble(0)
    for k, g in enumerate(ms.groups):
        rows = slice(ms.offsets[k], ms.offsets[k + 1])
        uu = g.P.astype(np.longdouble) @ dz[rows].reshape(ms.T + 1, -1)
        x_ld += np.sum(uu[0] ** 2)
        e_ld += np.sum(uu[1:] ** 2)
    return x_ld, e_ld


def test_local_evaluation_covers_an_extended_precision_evaluation_of_the_whole_dy():
    # the local evaluation never forms dy = a G + u; here it is formed and its cost computed over every
    # party in 80-bit precision, independently of both evaluations
    trace, view = _local_setting(120, seed=2)
    ms, tier = _tier(trace, view)
    Dz = ms.Dz.toarray().astype(np.longdouble)
    rng = np.random.default_rng(0)
    far = 0
    for q in rng.choice(ms.nH, 6, replace=False):
        S = tier.support(q)
        u, a = tier.solve(q, S)
        a *= 1 + 1e-3  # off the optimum too: any (u, a) must be bounded
        X, E = tier.evaluate(q, S, u, a)
        x_ld, e_ld = _ld_cost(ms, tier, int(q), S, u, a, Dz)
        assert X >= x_ld and E >= e_ld, (q, X, x_ld, E, e_ld)
        assert X <= x_ld * (1 + 1e-8) and E <= e_ld * (1 + 1e-8)
        # and it agrees with the global rigorous evaluation of the same dy
        dy = a * tier.G
        dy[S] += u
        Xg, Eg = _evaluate(ms, dy[:, None], np.array([q]))
        assert X == pytest.approx(Xg[0], rel=1e-9) and E == pytest.approx(Eg[0], rel=1e-9)
        touched = np.unique(ms.row_q[tier.DzC[:, S].indices])
        far += ms.nH - touched.size
    assert far > 0  # the parties the local columns do not touch were bounded through G's residual


def test_local_bound_of_every_party_is_sound_against_exact():
    trace, view = _local_setting(120, seed=3)
    ms, tier = _tier(trace, view, iterations=5)
    exact = certify(trace, view, solver="exact")
    for q in range(ms.nH):
        X, E = tier.bound(q)
        mu = exact.mu[int(ms.parties[q])]
        assert math.sqrt(X / 0.3**2 + E / 3.0**2) >= mu * (1 - 1e-9)


@pytest.mark.parametrize("n, gamma", [(200, 0.1), (300, 0.2)])
def test_cascade_maximum_is_as_tight_as_the_global_bound_with_fewer_global_solves(n, gamma):
    trace = sample_trace(n, IncaConfig(iterations=20, neighbors=1, sigma_star=0.25, sigma_delta=3.0,
                                       dropout=PermanentDropout(gamma)), seed=3)
    view = random_collusion(trace, 0.1, seed=3)
    exact = certify(trace, view, solver="exact")
    bound = bound_profile(trace, view)
    cascade = bound_profile(trace, view, cascade=True)
    assert cascade.method == "cascade" and bound.method == "bound"
    mu_e = np.array([exact.mu[int(i)] for i in cascade.honest])
    mu_c = cascade.mu(0.25, 3.0)
    assert np.all(mu_c >= mu_e * (1 - 1e-9))
    # the charged maximum: within 1% of exact (5% is the goal) and no looser than the global bound
    assert mu_c.max() <= 1.01 * mu_e.max()
    assert mu_c.max() <= bound.mu(0.25, 3.0).max() * (1 + 1e-4)
    # only the parties near the maximum were solved globally; every other one is below the maximum
    refined = cascade.iterations > 0
    assert 0 < refined.sum() < 0.6 * refined.size
    assert np.all(mu_c[~refined] <= mu_c.max())


def test_cascade_without_its_refinement_is_not_tight():
    # the local tier alone (what a cascade that skipped the global refinement would print) is sound but
    # far from the exact maximum: the refinement is what makes the charged maximum tight
    trace = sample_trace(200, IncaConfig(iterations=20, neighbors=1, sigma_star=0.25, sigma_delta=3.0,
                                         dropout=PermanentDropout(0.1)), seed=3)
    view = random_collusion(trace, 0.1, seed=3)
    exact = certify(trace, view, solver="exact")
    ms = MessageSpace(trace, view, 0.25, 3.0)
    op = _Operator(ms, 0.25, 3.0, BoundSettings())
    from flwr_inca.privacy.bound import _local_tier

    tier = _local_tier(ms, op, BoundSettings(), 0.25, 3.0)
    local = np.array([math.sqrt(x / 0.25**2 + e / 3.0**2) for x, e in map(tier.bound, range(ms.nH))])
    assert local.max() > 1.01 * exact.max_mu


def test_auto_picks_the_cascade_beyond_its_threshold_and_says_so(monkeypatch, tmp_path, capsys):
    from flwr_inca.cli import main

    trace = sample_trace(40, IncaConfig(iterations=6, neighbors=1, sigma_star=0.3, sigma_delta=3.0,
                                        dropout=TemporaryDropout(0.1)), seed=0)
    view = random_eavesdrop(trace, 0.3, seed=0)
    rows = int(view.honest_observed().sum())
    monkeypatch.setattr(certificate_module, "EXACT_MAX_ROWS", rows - 2)
    monkeypatch.setattr(certificate_module, "CASCADE_MIN_ROWS", rows - 1)
    assert choose_solver(trace, view) == "cascade"
    cert = certify(trace, view, delta=1e-5)
    assert cert.method == "cascade" and cert.to_dict()["method"] == "cascade"
    assert any("upper bound" in note for note in cert.notes)
    exact = certify(trace, view, solver="exact")
    assert all(cert.mu[i] >= exact.mu[i] * (1 - 1e-9) for i in exact.mu)
    monkeypatch.setattr(certificate_module, "CASCADE_MIN_ROWS", rows)
    assert choose_solver(trace, view) == "bound"
    assert RoundCertificate(0.1, ("exact", "cascade")).method == "exact+cascade"
    path = tmp_path / "trace.json"
    trace.save(path)
    monkeypatch.setattr(certificate_module, "EXACT_MAX_ROWS", 0)  # as if the trace were huge
    monkeypatch.setattr(certificate_module, "CASCADE_MIN_ROWS", 0)
    assert main(["audit", str(path)]) == 0
    out = capsys.readouterr()
    assert "method: cascade" in out.out
    # a bound at scale takes minutes: the audit reports its phases on stderr, with the elapsed time
    assert re.search(r"^audit \[\d+s\] cascade: local bounds done", out.err, re.M)
    assert re.search(r"^audit \[\d+s\] cascade: local bound for", out.err, re.M)
    assert main(["audit", str(path), "--json"]) == 0
    assert capsys.readouterr().err == ""  # JSON output: nothing but the result
