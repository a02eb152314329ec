"""Accountant names: the current ones, the names before 0.2 (deprecated aliases), ledgers written
under the old names, and Opacus as an optional dependency."""

import json
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


@pytest.mark.parametrize("old, new", [("gdp", "exact"), ("prv", "opacus-prv"), ("rdp", "opacus-rdp")])
def test_old_names_still_work_and_warn(old, new):
    with pytest.warns(DeprecationWarning, match=f"'{old}' is now called '{new}'"):
        assert create_accountant(old).name == new
    with pytest.warns(DeprecationWarning):
        assert PrivacyLedger(None, delta=1e-5, accountant=old).accountant.name == new


@pytest.mark.parametrize("old, new", [("GdpAccountant", ExactAccountant),
                                      ("PrvAccountant", OpacusPrvAccountant),
                                      ("RdpAccountant", OpacusRdpAccountant)])
def test_old_class_names_still_import_and_warn(old, new):
    import flwr_inca.privacy as privacy
    import flwr_inca.privacy.accountants as accountants

    for module in (privacy, accountants):
        with pytest.warns(DeprecationWarning, match=f"{old} is now called {new.__name__}"):
            assert getattr(module, old) is new
    with pytest.raises(AttributeError):
        privacy.NoSuchAccountant  # noqa: B018


def test_a_ledger_written_under_an_old_name_loads_and_is_rewritten_with_the_new_one(tmp_path):
    path = tmp_path / "ledger.json"
    rounds = [{"round": 1, "mu": 0.5, "sample_rate": 1.0, "epsilon": 1.0, "note": ""},
              {"round": 2, "mu": "inf", "sample_rate": 1.0, "epsilon": "inf"}]
    path.write_text(json.dumps({"format": "inca-ledger/1", "delta": 1e-5, "max_epsilon": None,
                                "accountant": "gdp", "rounds": rounds}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reading a file is no use of a deprecated name by the caller
        ledger = PrivacyLedger(path, delta=1e-5)
    assert ledger.rounds == 2 and ledger.accountant.name == "exact" and math.isinf(ledger.epsilon())
    with pytest.raises(ValueError, match="'gdp' accountant, not 'opacus-prv'"):
        PrivacyLedger(path, delta=1e-5, accountant="opacus-prv")
    ledger.spend(0.1)
    data = json.loads(path.read_text())
    assert data["accountant"] == "exact"
    assert data["rounds"][1]["mu"] == "inf" and data["rounds"][2]["mu"] == 0.1


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
