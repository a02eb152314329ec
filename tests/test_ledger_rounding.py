"""A round charged its cost rounded up: the ledger keeps both, never charges less than the cost, and its
PRV composition is Opacus's to the last bit however the queries are memoized."""

import json
import math
import warnings

import numpy as np
import pytest

from flwr_inca.privacy import PrivacyLedger
from flwr_inca.privacy.accountants import RoundCost, create_accountant
from flwr_inca.privacy.accountants.base import grouped
from flwr_inca.privacy.ledger import BudgetExceededError


def test_the_ledger_keeps_the_cost_beside_the_rounded_charge(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(path, delta=1e-5)
    ledger.spend(0.3015, note="round 1", method="exact", certified_mu=0.3)
    ledger.spend(0.2, note="round 2", method="exact", certified_mu=0.2)  # not rounded: nothing extra
    ledger.spend(0.25)  # a caller of the old signature
    entries = PrivacyLedger(path, delta=1e-5).entries
    assert [(e.mu, e.certified_mu, e.method) for e in entries] == [
        (0.3015, 0.3, "exact"), (0.2, None, "exact"), (0.25, None, None)]
    on_disk = json.loads(path.read_text())["rounds"]
    assert on_disk[0]["certified_mu"] == 0.3 and "certified_mu" not in on_disk[1]
    # what is composed is what was charged (the rounded mu)
    assert ledger.epsilon() == create_accountant("exact").epsilon(
        [RoundCost(0.3015), RoundCost(0.2), RoundCost(0.25)], 1e-5)


def test_a_charge_below_its_cost_is_refused_and_a_file_claiming_one_is_rejected(tmp_path):
    ledger = PrivacyLedger(tmp_path / "ledger.json", delta=1e-5)
    with pytest.raises(ValueError, match=r"certified_mu = 0.31 exceeds the charged mu = 0.3"):
        ledger.spend(0.3, certified_mu=0.31)
    assert ledger.rounds == 0  # nothing recorded
    with pytest.raises(ValueError, match="certified_mu must be"):
        ledger.spend(0.3, certified_mu=-1.0)
    ledger.spend(0.3, certified_mu=0.29)
    data = json.loads((tmp_path / "ledger.json").read_text())
    data["rounds"][0]["certified_mu"] = 0.5  # edited by hand: a charge below the recorded cost
    (tmp_path / "ledger.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"round 1: certified_mu = 0.5 exceeds the charged mu = 0.3"):
        PrivacyLedger(tmp_path / "ledger.json", delta=1e-5)


def test_the_budget_check_uses_the_charged_mu():
    ledger = PrivacyLedger(None, delta=1e-5, max_epsilon=1.0)
    budget_mu = 0.2635  # epsilon(0.2635) = 0.981 at delta 1e-5 (exact accountant), epsilon(0.27) = 1.008
    eps = ledger.epsilon_after(budget_mu)
    assert eps <= 1.0 < ledger.epsilon_after(0.27)
    with pytest.raises(BudgetExceededError):  # the cost fits, its rounded charge does not: refused
        ledger.spend(0.27, certified_mu=budget_mu)
    assert ledger.spend(budget_mu, certified_mu=budget_mu * 0.999) == eps


@pytest.mark.parametrize("eps_error", [0.01, 0.05])
def test_prv_epsilon_is_opacus_prv_accountant_bit_for_bit(eps_error):
    from opacus.accountants import PRVAccountant

    accountant = create_accountant("opacus-prv")
    accountant.eps_error = eps_error
    rng = np.random.default_rng(3)
    history: list[RoundCost] = []
    for r in range(8):  # a growing ledger on a 0.5% grid, with a what-if query after each charge
        history.append(RoundCost(0.21 * 1.005 ** int(rng.integers(0, 3)), float(rng.choice([0.05, 1 / 12]))))
        for rounds in (history, history + [RoundCost(0.33, 1 / 12)], history):
            ref = PRVAccountant()
            ref.history = grouped(rounds)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = ref.get_epsilon(delta=1e-5, eps_error=eps_error)
            assert accountant.epsilon(rounds, 1e-5) == theirs
    assert math.isinf(accountant.epsilon(history + [RoundCost(math.inf, 0.1)], 1e-5))
    assert accountant.epsilon([], 1e-5) == 0.0


def test_rdp_epsilon_is_opacus_compute_rdp():
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    accountant = create_accountant("opacus-rdp")
    rounds = [RoundCost(0.3, 0.1)] * 5 + [RoundCost(0.4, 0.05)] * 3
    rdp = compute_rdp(q=0.1, noise_multiplier=1 / 0.3, steps=5, orders=accountant.orders) + compute_rdp(
        q=0.05, noise_multiplier=1 / 0.4, steps=3, orders=accountant.orders)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = float(get_privacy_spent(orders=accountant.orders, rdp=rdp, delta=1e-5)[0])
        assert accountant.epsilon(rounds, 1e-5) == theirs
        assert accountant.epsilon(rounds, 1e-5) == theirs  # again, from the memoized per-step curves


def test_both_opacus_accountants_are_opacus_to_the_bit_from_the_orders_that_can_be_the_minimum():
    """Random histories (one to three kinds of round; strong, weak and subsampled rounds; many deltas):
    epsilon is Opacus's own (PRVAccountant; compute_rdp + get_privacy_spent over every order) to the
    bit, while the curves computed only some of the orders (the others cannot be the minimum)."""
    from opacus.accountants import PRVAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    from flwr_inca.privacy.accountants import OpacusPrvAccountant, OpacusRdpAccountant
    from flwr_inca.privacy.accountants.base import RdpCurve, rdp_curve

    rng = np.random.default_rng(11)
    prv, rdp_accountant = OpacusPrvAccountant(shared_memo=False), OpacusRdpAccountant()
    partial = 0
    for case in range(8):
        rounds = []
        for _ in range(int(rng.integers(1, 4))):
            mu, q = float(10 ** rng.uniform(-2, 0.5)), float(rng.choice([1.0, 10 ** rng.uniform(-3, -0.3)]))
            rounds += [RoundCost(mu, q)] * int(10 ** rng.uniform(0, 2.5))
        delta = float(10 ** rng.uniform(-8, -4))
        groups = grouped(rounds)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = PRVAccountant()
            ref.history = groups
            assert prv.epsilon(rounds, delta) == ref.get_epsilon(delta=delta, eps_error=0.01), (case, groups)
            orders = rdp_accountant.orders
            full = sum(compute_rdp(q=q, noise_multiplier=z, steps=c, orders=orders) for z, q, c in groups)
            theirs = float(get_privacy_spent(orders=orders, rdp=full, delta=delta)[0])
            assert rdp_accountant.epsilon(rounds, delta) == theirs, (case, groups)
        for z, q, _ in groups:
            curve = rdp_curve(q, z, tuple(orders))
            assert isinstance(curve, RdpCurve)
            partial += not curve.known().all()
    assert partial > 0  # the search skipped orders
