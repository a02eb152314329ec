"""The privacy ledger with several writers, killed writers, several owners and bad arguments.

Real processes (``multiprocessing`` with the ``spawn`` start method and ``kill -9``), one ledger file.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from flwr_inca.privacy import BudgetExceededError, PrivacyLedger, epsilon_for_delta
from flwr_inca.privacy.ledger import LedgerOwnerError

WRITERS, SPENDS, MU = 4, 25, 0.01


def _spender(path: str, writer: int, spends: int, max_epsilon: float | None, start, results) -> None:
    ledger = PrivacyLedger(path, delta=1e-5, max_epsilon=max_epsilon)
    start.wait()
    done = refused = 0
    for k in range(spends):
        try:
            ledger.spend(MU, note=f"w{writer}-{k}")
            done += 1
        except BudgetExceededError:
            refused += 1
    results.put((writer, done, refused))


def _race(path, max_epsilon=None):
    ctx = mp.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_spender, args=(str(path), w, SPENDS, max_epsilon, start, results))
             for w in range(WRITERS)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.5)  # let every process open the ledger before anyone spends
        start.set()
        out = [results.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    return out


def test_every_concurrent_spend_is_recorded(tmp_path):
    path = tmp_path / "ledger.json"
    out = _race(path)
    assert sum(done for _, done, _ in out) == WRITERS * SPENDS
    data = json.loads(path.read_text())
    notes = sorted(r["note"] for r in data["rounds"])
    assert notes == sorted(f"w{w}-{k}" for w in range(WRITERS) for k in range(SPENDS))
    assert [r["round"] for r in data["rounds"]] == list(range(1, WRITERS * SPENDS + 1))
    total = PrivacyLedger(path, delta=1e-5).epsilon()
    assert total == pytest.approx(epsilon_for_delta(MU * math.sqrt(WRITERS * SPENDS), 1e-5), rel=1e-9)


def test_concurrent_spenders_never_exceed_the_budget_together(tmp_path):
    path = tmp_path / "ledger.json"
    budget = epsilon_for_delta(MU * math.sqrt(30.5), 1e-5)  # 30 spends fit, 31 do not
    out = _race(path, max_epsilon=budget)
    ledger = PrivacyLedger(path, delta=1e-5)
    assert sum(done for _, done, _ in out) == ledger.rounds == 30
    assert sum(refused for _, _, refused in out) == WRITERS * SPENDS - 30
    assert ledger.epsilon() <= budget


_KILLED_WRITER = """
import sys
from flwr_inca.privacy import PrivacyLedger
ledger = PrivacyLedger(sys.argv[1], delta=1e-5)
k = 0
while True:
    ledger.spend(0.001, note=f"k{k}")
    print(k, flush=True)  # acknowledged
    k += 1
"""


def test_kill_9_during_spends_never_undercounts_and_leftovers_are_cleaned(tmp_path):
    path = tmp_path / "ledger.json"
    trials, tmp_seen = 10, 0
    for trial in range(trials):
        before = PrivacyLedger(path, delta=1e-5).rounds
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdout=subprocess.PIPE,
                                text=True)
        try:
            acknowledged = 0
            for _ in range(5 + 3 * trial):  # a different moment in every trial
                line = proc.stdout.readline()
                assert line, "the writer died"
                acknowledged += 1
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
        acknowledged += sum(1 for _ in proc.stdout)  # lines printed before the kill
        proc.stdout.close()
        tmp_seen += len(list(tmp_path.glob(".ledger.json.*.tmp")))
        ledger = PrivacyLedger(path, delta=1e-5)  # valid JSON, and every acknowledged spend is there
        assert before + acknowledged <= ledger.rounds <= before + acknowledged + 1
        assert not list(tmp_path.glob(".ledger.json.*.tmp")), "opening the ledger cleans leftovers"


def test_a_leftover_temp_file_is_removed_on_open_and_other_files_are_not(tmp_path):
    path = tmp_path / "ledger.json"
    PrivacyLedger(path, delta=1e-5).spend(0.1)
    stale = tmp_path / ".ledger.json.k1x2y3z4.tmp"
    stale.write_text("{half")
    other = tmp_path / ".other.json.abcdefgh.tmp"
    other.write_text("not ours")
    assert PrivacyLedger(path, delta=1e-5).rounds == 1
    assert not stale.exists() and other.exists()


# ------------------------------------------------------------------------------ owners
def test_the_ledger_belongs_to_one_owner_unless_shared_on_purpose(tmp_path):
    path = tmp_path / "ledger.json"
    mine = PrivacyLedger(path, delta=1e-5, owner="mnist-a")
    mine.spend(0.1)
    assert json.loads(path.read_text())["owner"] == "mnist-a"
    assert PrivacyLedger(path, delta=1e-5, owner="mnist-a").rounds == 1  # a restart resumes it
    with pytest.raises(LedgerOwnerError, match=r"belongs to 'mnist-a', not 'other'") as info:
        PrivacyLedger(path, delta=1e-5, owner="other")
    assert "shared" in str(info.value) and "\n" not in str(info.value)
    shared = PrivacyLedger(path, delta=1e-5, owner="other", shared=True)
    shared.spend(0.2)
    data = json.loads(path.read_text())
    assert data["owner"] == "mnist-a" and [r.get("owner") for r in data["rounds"]] == ["mnist-a", "other"]
    assert PrivacyLedger(path, delta=1e-5).rounds == 2  # a reader that claims nothing


def test_claiming_after_opening_and_a_file_claimed_by_another_meanwhile(tmp_path):
    path = tmp_path / "ledger.json"
    a = PrivacyLedger(path, delta=1e-5)
    b = PrivacyLedger(path, delta=1e-5)
    a.claim("first")
    with pytest.raises(LedgerOwnerError, match="belongs to 'first'"):
        b.claim("second")
    b.spend(0.1)  # b claims nothing: it may still charge (its spends are recorded, never lost)
    with pytest.raises(LedgerOwnerError):
        PrivacyLedger(path, delta=1e-5, owner="second").spend(0.1)
    assert PrivacyLedger(path, delta=1e-5).rounds == 1


def test_a_ledger_file_without_owner_is_claimed_and_keeps_its_entries(tmp_path):
    path = tmp_path / "ledger.json"
    PrivacyLedger(path, delta=1e-5).spend(0.3, note="earlier")
    assert json.loads(path.read_text())["owner"] is None
    ledger = PrivacyLedger(path, delta=1e-5, owner="me")
    assert ledger.rounds == 1 and ledger.entries[0].note == "earlier"
    assert json.loads(path.read_text())["owner"] == "me"


# ------------------------------------------------------------------------------ bad arguments and files
@pytest.mark.parametrize("call", [
    lambda led: led.spend(True),
    lambda led: led.spend("0.5"),
    lambda led: led.spend(float("nan")),
    lambda led: led.spend(-0.1),
    lambda led: led.spend(0.1, sample_rate=True),
    lambda led: led.spend(0.1, sample_rate="1"),
    lambda led: led.epsilon_after(True),
    lambda led: led.can_afford("0.5"),
])
def test_spend_rejects_what_is_not_a_number(call, tmp_path):
    ledger = PrivacyLedger(tmp_path / "l.json", delta=1e-5)
    with pytest.raises(ValueError, match="mu|sample_rate"):
        call(ledger)
    assert ledger.rounds == 0 and not (tmp_path / "l.json").exists()


@pytest.mark.parametrize("text, match", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"format": "inca-ledger/2", "delta": 1e-5, "accountant": "exact", "rounds": ' + "[" * 50_000
     + "]" * 50_000 + "}", "nested too deeply"),
    ('{"format": "inca-ledger/2", "delta": 1e-5, "accountant": "exact", "owner": 3, "rounds": []}', "owner"),
    ('{"format": "inca-ledger/2", "delta": 1e-5, "accountant": "exact", "rounds": [{"round": 1, "mu": "x"}]}',
     "mu"),
    ('{"format": "inca-ledger/2", "delta": "1e-5", "accountant": "exact", "rounds": []}', "delta"),
])
def test_broken_ledger_files_give_one_line_errors(tmp_path, text, match):
    path = tmp_path / "ledger.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        PrivacyLedger(path, delta=1e-5)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
