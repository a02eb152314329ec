"""flwr_inca leaves the root logger to the application: Opacus's import-time ``logging.basicConfig``
installs no handler (every Flower line would be printed twice), and a handler the user set stays."""

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("opacus")


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_opacus_through_flwr_inca_adds_no_root_handler():
    # everything that imports Opacus in a round: the privacy plan, the PRV/RDP accountants, per-example grads
    out = _run("""
        import logging
        import flwr_inca
        from flwr_inca.privacy import PrivacyLedger
        from flwr_inca.privacy.plan import privacy_plan

        privacy_plan("record", epsilon=1.0, delta=1e-5, rounds=5, clip_norm=1.0, lr=1.0, batch_size=10,
                     local_size=100)
        for name in ("opacus-prv", "opacus-rdp"):
            ledger = PrivacyLedger(None, delta=1e-5, accountant=name)
            ledger.spend(0.5, sample_rate=0.1)
        from opacus import GradSampleModule
        import opacus.utils.module_utils
        logging.getLogger("flwr").info("one line")
        print(len(logging.getLogger().handlers), "opacus.utils.module_utils" in __import__("sys").modules)
    """)
    assert out == "0 True"


def test_the_users_logging_configuration_is_left_alone():
    out = _run("""
        import logging
        logging.basicConfig(level=logging.INFO, format="mine %(message)s")
        import flwr_inca, opacus
        root = logging.getLogger()
        print(len(root.handlers), root.handlers[0].formatter._fmt, root.level == logging.INFO)
    """)
    assert out == "1 mine %(message)s True"


def test_without_the_guard_opacus_does_install_a_root_handler():
    # the control: what the guard prevents really happens (if Opacus stops doing it, drop the guard)
    out = _run("""
        import logging
        import opacus
        print(len(logging.getLogger().handlers))
    """)
    assert out == "1"


def test_the_prv_ledger_emits_no_notice_the_user_cannot_act_on():
    # Opacus's PRV accountant sizes its domain with RDP and warned "Optimal order is the largest alpha"
    # on every round of the example (20 nodes, q = 0.7)
    import warnings

    from flwr_inca.privacy import PrivacyLedger

    ledger = PrivacyLedger(None, delta=1e-5, accountant="opacus-prv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(40):
            ledger.spend(0.06, sample_rate=0.7)
        assert 0.9 < ledger.epsilon() < ledger.epsilon_after(0.06, 0.7) < 1.1
