"""Accountant names, and Opacus as an optional dependency."""

import math
import sys
import warnings

import pytest

from flwr_inca.privacy import (
    ACCOUNTANTS,
    ExactAccountant,
    OpacusPrvAccountant,
    OpacusRdpAccountant,
    PrivacyLedger,
    RoundCost,
    create_accountant,
    epsilon_for_delta,
)


def test_current_names_and_classes():
    assert ACCOUNTANTS == ("exact", "opacus-prv", "opacus-rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(create_accountant("exact")) is ExactAccountant
        assert type(create_accountant("opacus-prv")) is OpacusPrvAccountant
        assert type(create_accountant("opacus-rdp")) is OpacusRdpAccountant
    with pytest.raises(ValueError, match=r"must be one of \['exact', 'opacus-prv', 'opacus-rdp'\]"):
        create_accountant("moments")


def test_no_name_collides_with_flower_or_means_something_else_than_in_opacus():
    flwr = pytest.importorskip("flwr.serverapp")
    assert "gdp" not in ACCOUNTANTS  # Opacus's "gdp" is a CLT approximation of subsampled rounds
    import flwr_inca.privacy as privacy

    assert not set(privacy.__all__) & set(flwr.__all__)  # e.g. flwr.serverapp.RdpAccountant


@pytest.mark.parametrize("name", ["gdp", "prv", "rdp", "PrvAccountant"])
def test_names_that_are_not_accountants_are_refused_naming_the_choices(name):
    with pytest.raises(ValueError, match=r"accountant must be one of \['exact', 'opacus-prv', 'opacus-rdp'\]"):
        create_accountant(name)
    with pytest.raises(ValueError, match="accountant must be one of"):
        PrivacyLedger(None, delta=1e-5, accountant=name)


def test_opacus_accountants_name_the_extra_to_install_when_opacus_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)
    for name in ("opacus-prv", "opacus-rdp"):
        with pytest.raises(ImportError, match=r'pip install "flwr-inca\[opacus\]"'):
            create_accountant(name)
    # the exact accountant needs nothing
    assert create_accountant("exact").epsilon([RoundCost(0.5)], 1e-5) == epsilon_for_delta(0.5, 1e-5)


def test_the_package_imports_without_opacus_and_torch():
    import subprocess

    code = ("import sys; sys.modules['opacus'] = None; sys.modules['torch'] = None\n"
            "import flwr_inca, flwr_inca.privacy, flwr_inca.cli\n"
            "from flwr_inca.privacy import PrivacyLedger\n"
            "led = PrivacyLedger(None, delta=1e-5); led.spend(0.3)\n"
            "try:\n    PrivacyLedger(None, delta=1e-5, accountant='opacus-prv')\n"
            "except ImportError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: the 'opacus-prv' accountant needs Opacus" in out.stdout


def test_a_rounds_rdp_curve_is_computed_once_per_process_unless_the_accountant_keeps_its_own(monkeypatch):
    """Opacus's per-step curve of a round (up to seconds) is remembered for the process: another ledger's
    accountant composing the same round asks Opacus for nothing and gives the same epsilon to the bit; an
    accountant with ``shared_memo=False`` computes its own."""
    pytest.importorskip("opacus")
    import opacus.accountants.analysis.rdp as opacus_rdp

    from flwr_inca.privacy.accountants import OpacusPrvAccountant, OpacusRdpAccountant, RoundCost

    rounds = [RoundCost(0.37123, 0.0185)] * 3 + [RoundCost(0.41, 0.0185)]
    first = {a.name: a.epsilon(rounds, 1e-5) for a in (OpacusPrvAccountant(), OpacusRdpAccountant())}

    def not_again(**_):
        raise AssertionError("Opacus's compute_rdp called again for a curve already computed")

    monkeypatch.setattr(opacus_rdp, "compute_rdp", not_again)
    for accountant in (OpacusPrvAccountant(), OpacusRdpAccountant()):  # new accountants, as a new ledger has
        assert accountant.epsilon(rounds, 1e-5) == first[accountant.name]
    with pytest.raises(AssertionError, match="called again"):
        OpacusPrvAccountant(shared_memo=False).epsilon(rounds, 1e-5)


def test_a_plans_noise_search_runs_once_per_process_and_a_refusal_is_not_remembered(monkeypatch):
    """The noise-multiplier search is a pure function of the budget: the example's plan, its strategy's
    per-round target and the check before Flower starts ask it the same question, and get the first answer
    again, to the bit, without a second search. A budget that no noise reaches is refused every time."""
    pytest.importorskip("opacus")
    from flwr_inca.privacy import plan as plan_module
    from flwr_inca.privacy.plan import privacy_plan, round_mu

    real = plan_module.noise_multiplier
    searches = []
    monkeypatch.setattr(plan_module, "noise_multiplier", lambda *a: searches.append(a) or real(*a))
    args = dict(epsilon=1.7321, delta=1e-5, rounds=3, clip_norm=1.0, lr=1.0, batch_size=10, local_size=10)
    plan = privacy_plan("record", accountant="opacus-rdp", **args)
    assert searches == [(1.7321, 1e-5, 1.0, 3, "opacus-rdp")]
    assert privacy_plan("record", accountant="opacus-rdp", **args).mu_round == plan.mu_round
    assert round_mu(1.7321, 1e-5, 3, 1.0, "opacus-rdp") == plan.mu_round
    assert len(searches) == 1
    assert round_mu(1.7321, 1e-5, 4, 1.0, "opacus-rdp") < plan.mu_round  # another question is searched
    assert len(searches) == 2
    for _ in range(2):
        with pytest.raises(ValueError, match="too low"):
            round_mu(1e-2, 1e-5, 3, 1.0, "opacus-rdp")
    assert len(searches) == 4


def test_a_sample_rate_so_small_that_no_noise_is_needed_is_refused_by_name():
    """Below q x rounds = delta a record is in no round's sample except with probability below delta: the
    PRV accountant's search drives the noise to 0, where Opacus cannot compute an epsilon (a bare
    RuntimeError, after seconds); the plan says at once which sample rate, why, and what to change. At
    q x rounds = delta, and with the RDP accountant, a noise multiplier comes out."""
    pytest.importorskip("opacus")
    from flwr_inca.privacy.plan import noise_multiplier, privacy_plan

    record = dict(epsilon=1.0, delta=1e-5, clip_norm=1.0, lr=0.1, batch_size=10, local_size=1e7)  # q = 1e-6
    for rounds in (1, 4):
        with pytest.raises(ValueError, match=r"sample rate q = 1e-06 over \d round\(s\) at delta = 1e-05: q x rounds = "
                                             r"[14]e-06 is below delta.*opacus-rdp"):
            privacy_plan("record", rounds=rounds, **record)
    assert 0 < noise_multiplier(1.0, 1e-5, 1e-6, 10, "opacus-prv") < 1  # q x rounds = delta: little noise
    plan = privacy_plan("record", rounds=1, accountant="opacus-rdp", **record)
    assert math.isfinite(plan.mu_round) and plan.mu_round > 0


@pytest.mark.parametrize("accountant", ["opacus-prv", "opacus-rdp"])
def test_the_noise_search_is_opacus_get_noise_multiplier_to_the_bit(accountant):
    """Against Opacus's own search (its accountants from scratch, every order): the same noise multiplier
    for subsampled and full-batch rounds, and the same refusal of a budget no noise reaches."""
    pytest.importorskip("opacus")
    import warnings

    from opacus.accountants.utils import get_noise_multiplier

    from flwr_inca.privacy.plan import noise_multiplier

    name = accountant.removeprefix("opacus-")
    for epsilon, q, rounds in [(2.0, 0.1399, 5), (1.0, 10 / 540, 40), (8.0, 1.0, 2)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = get_noise_multiplier(target_epsilon=epsilon, target_delta=1e-5, sample_rate=q,
                                          steps=rounds, accountant=name, epsilon_tolerance=0.01)
        assert noise_multiplier(epsilon, 1e-5, q, rounds, accountant) == theirs, (epsilon, q, rounds)
    with pytest.raises(ValueError, match="The privacy budget is too low"):
        noise_multiplier(1e-3, 1e-5, 1.0, 3, accountant)
