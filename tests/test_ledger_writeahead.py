"""The ledger's write-ahead reservations, their recovery after a crash, full disks, and edited files."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import resource
import signal
import subprocess
import sys
import textwrap

import pytest

from flwr_inca.privacy import BudgetExceededError, PrivacyLedger, epsilon_for_delta
from flwr_inca.privacy.ledger import LEDGER_FORMAT

DELTA = 1e-5


def _eps(*mus):
    return epsilon_for_delta(math.sqrt(sum(m * m for m in mus)), DELTA)


def test_a_reservation_counts_in_every_epsilon_until_it_is_settled_lower(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(path, delta=DELTA)
    ledger.spend(0.3)
    entry = ledger.reserve(0.8, note="round 2")
    assert ledger.epsilon() == pytest.approx(_eps(0.3, 0.8), rel=1e-12)
    # what another process reads counts it too
    reader = PrivacyLedger(path, delta=DELTA)
    assert reader.epsilon() == pytest.approx(_eps(0.3, 0.8), rel=1e-12)
    assert [e.status for e in reader.entries] == ["charged", "reserved"]
    ledger.raise_reservation(entry, 0.9)
    ledger.raise_reservation(entry, 0.5)  # never lowered by a raise
    assert ledger.entries[1].mu == 0.9
    ledger.settle(entry, 0.4, method="exact", note="round 2")
    assert ledger.epsilon() == pytest.approx(_eps(0.3, 0.4), rel=1e-12)
    reader.refresh()
    assert reader.entries[1].status == "charged" and reader.entries[1].mu == 0.4
    with pytest.raises(ValueError, match="already settled"):
        ledger.settle(entry, 0.1)


def test_reservations_are_checked_against_the_budget_and_refused_ones_change_nothing(tmp_path):
    budget = _eps(0.5, 0.5)
    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA, max_epsilon=budget)
    entry = ledger.reserve(0.5)
    with pytest.raises(BudgetExceededError):
        ledger.reserve(0.6)
    second = ledger.reserve(0.5)
    with pytest.raises(BudgetExceededError):
        ledger.raise_reservation(entry, 0.51)
    assert [e.mu for e in ledger.entries] == [0.5, 0.5]
    # a reserved budget is unavailable to everybody else until settled lower
    other = PrivacyLedger(tmp_path / "l.json", delta=DELTA, max_epsilon=budget)
    with pytest.raises(BudgetExceededError):
        other.spend(0.01)
    ledger.settle(second, 0.1)
    other.spend(0.01)
    assert other.epsilon() <= budget


_CRASHER = """
import os, sys
from flwr_inca.privacy import PrivacyLedger
ledger = PrivacyLedger(sys.argv[1], delta=1e-5)
ledger.spend(0.2, note="round 1")
ledger.reserve(0.7, note="round 2")
print("reserved", flush=True)
os.kill(os.getpid(), 9)
"""


def test_a_reservation_left_by_a_killed_run_is_charged_at_its_value_on_the_next_open(tmp_path, caplog):
    path = tmp_path / "ledger.json"
    out = subprocess.run([sys.executable, "-c", _CRASHER, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL and "reserved" in out.stdout
    with caplog.at_level("WARNING", logger="flwr_inca"):
        ledger = PrivacyLedger(path, delta=DELTA)
    assert [e.status for e in ledger.entries] == ["charged", "charged"]
    assert ledger.entries[1].mu == 0.7 and "never settled" in ledger.entries[1].note
    assert ledger.epsilon() == pytest.approx(_eps(0.2, 0.7), rel=1e-12)
    assert len(ledger.recovered) == 1
    lines = [r.getMessage() for r in caplog.records if "never settled" in r.getMessage()]
    assert len(lines) == 1 and "round 2" in lines[0] and "0.7" in lines[0]
    # the recovery is durable: a third reader finds it charged, says nothing more
    assert not PrivacyLedger(path, delta=DELTA).recovered


def test_a_live_runs_reservation_is_not_taken_for_a_crash(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(path, delta=DELTA)
    ledger.reserve(0.7)
    again = PrivacyLedger(path, delta=DELTA)  # this process is alive: its reservation stays a reservation
    assert again.entries[0].reserved and not again.recovered
    assert again.live_runs() == [ledger.run]


def _write_fails(path, limit):
    """Run in a child whose file-size limit makes writing the ledger fail (EFBIG), as a full disk does."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    ledger = PrivacyLedger(path, delta=DELTA)
    outcome = []
    try:
        ledger.reserve(0.5, note="round 2")
        outcome.append("reserved")
    except OSError as exc:
        outcome.append(f"OSError {exc.errno}")
    outcome.append(ledger.rounds)
    return outcome


def test_a_ledger_that_cannot_be_written_records_nothing_and_says_so(tmp_path):
    path = tmp_path / "ledger.json"
    PrivacyLedger(path, delta=DELTA).spend(0.3)
    size = path.stat().st_size
    with mp.get_context("spawn").Pool(1) as pool:
        outcome = pool.apply(_write_fails, (str(path), size + 10))
    assert outcome[0].startswith("OSError") and outcome[1] == 1  # nothing reserved, in memory either
    ledger = PrivacyLedger(path, delta=DELTA)
    assert ledger.rounds == 1 and ledger.epsilon() == pytest.approx(_eps(0.3), rel=1e-12)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize("edit, where", [
    (lambda d: d["rounds"][0].update(mu=0.0), "round 1"),
    (lambda d: d["rounds"][1].update(mu=0.0), "round 2"),
    (lambda d: d["rounds"].pop(1) and [r.update(round=k + 1) for k, r in enumerate(d["rounds"])], "round 2"),
    (lambda d: d["rounds"][1].update(status="reserved"), "round 2"),
    (lambda d: d["rounds"][2].update(note="edited"), "round 3"),
])
def test_an_edited_ledger_is_refused_naming_the_file_and_the_first_bad_entry(tmp_path, edit, where):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(path, delta=DELTA)
    for mu in (0.3, 0.4, 0.5):
        ledger.spend(mu, note="round")
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        PrivacyLedger(path, delta=DELTA)
    message = str(err.value)
    assert str(path) in message and where in message and "\n" not in message
    assert "checksum" in message or "missing" in message


def test_a_nan_mu_is_named_with_the_file_and_round(tmp_path):
    path = tmp_path / "ledger.json"
    PrivacyLedger(path, delta=DELTA).spend(0.3)
    data = json.loads(path.read_text())
    data["rounds"][0]["mu"] = "nan"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"{path}: round 1: mu"):
        PrivacyLedger(path, delta=DELTA)


def test_a_file_of_another_format_is_refused_in_one_line(tmp_path):
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"format": "inca-ledger/1", "delta": DELTA, "accountant": "exact", "rounds": []}))
    with pytest.raises(ValueError, match=f"format must be '{LEDGER_FORMAT}'"):
        PrivacyLedger(path, delta=DELTA)


_RESERVER = textwrap.dedent("""
    import sys
    from flwr_inca.privacy import BudgetExceededError, PrivacyLedger
    path, budget, start = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    ledger = PrivacyLedger(path, delta=1e-5, max_epsilon=budget)
    import os, time
    while not os.path.exists(start):
        time.sleep(0.001)
    done = 0
    for k in range(20):
        try:
            entry = ledger.reserve(0.2)
        except BudgetExceededError:
            continue
        ledger.settle(entry, 0.1)
        done += 1
    print(done)
""")


def test_two_runs_reserving_on_one_ledger_never_exceed_the_budget_together(tmp_path):
    path, start = tmp_path / "ledger.json", tmp_path / "go"
    budget = _eps(*([0.1] * 25 + [0.2]))  # 25 settled rounds and one reservation fit; no more
    procs = [subprocess.Popen([sys.executable, "-c", _RESERVER, str(path), repr(budget), str(start)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    start.touch()
    done = [int(p.communicate(timeout=120)[0]) for p in procs]
    ledger = PrivacyLedger(path, delta=DELTA)
    assert sum(done) == ledger.rounds and ledger.epsilon() <= budget
    assert not ledger.reservations()
    assert len({e.run["token"] for e in ledger.entries}) == 2  # each entry says which run wrote it


def test_the_budget_is_kept_exactly_not_approximately(tmp_path):
    """A round 0.3% over the budget is refused: no tolerance (a checker that allowed 0.5% would pass it)."""
    budget = _eps(0.5, 0.5)
    ledger = PrivacyLedger(tmp_path / "l.json", delta=DELTA, max_epsilon=budget)
    ledger.spend(0.5)
    over = 0.5 * 1.003
    assert _eps(0.5, over) < budget * 1.005
    with pytest.raises(BudgetExceededError):
        ledger.reserve(over)
    with pytest.raises(BudgetExceededError):
        ledger.spend(over)
    entry = ledger.reserve(0.5)
    with pytest.raises(BudgetExceededError):
        ledger.raise_reservation(entry, over)
    assert ledger.epsilon() <= budget
