"""A persistent privacy-budget ledger for multi-round training, with write-ahead reservations.

Each round adds its cost ``RoundCost(mu, sample_rate)``; the ledger composes them with a round
accountant and reports epsilon at a fixed delta. With a file path, every change is written atomically
(temp file, fsync, rename) before it is acknowledged, so a crash or restart never forgets spent budget.

**Write-ahead.** A round that releases its messages over time is first *reserved*: before anything of it
leaves the process, :meth:`PrivacyLedger.reserve` durably records the most the round can reveal from then
on; the reservation may grow (:meth:`~PrivacyLedger.raise_reservation`, before each further step) and
is *settled* to the round's certified cost at its end (:meth:`~PrivacyLedger.settle`). An unsettled
reservation counts at its reserved value in every epsilon the ledger reports and in every budget check,
so what a user reads never under-counts what left the process, whatever happens to it. When a ledger is
opened, a reservation whose process has ended (a crash, ``kill -9``) is charged at its reserved value and
said so in one log line. :meth:`PrivacyLedger.spend` reserves and settles at once.

**Several processes** may spend on one file: each change holds an OS lock (``<file>.lock``), re-reads the
file under it and checks the budget against the re-read total (reservations of other live runs
included), so no spend is lost and the budget is never exceeded in total. A file belongs to one *owner*
(the training it accounts for): opening it for another owner fails unless sharing is asked for
(``shared=True``). Each entry records the run (process) that wrote it.

**Integrity.** Each entry carries a checksum chained over the entries before it; a file whose entries
were edited, reordered or removed in the middle is refused with one line naming the first bad entry.
The chain detects accidents and casual edits, not a determined editor (who can recompute it): the
ledger's integrity rests on the file's permissions, like any local file.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .._checks import check_real
from .._io import atomic_write_text, file_lock, remove_temp_files
from .._json import dumps, float_from_json, loads
from .accountants import RoundAccountant, RoundCost, create_accountant

__all__ = ["LEDGER_FORMAT", "BudgetExceededError", "LedgerEntry", "LedgerOwnerError", "PrivacyLedger",
           "run_identity"]

LEDGER_FORMAT = "inca-ledger/2"
RESERVED, CHARGED = "reserved", "charged"
_log = logging.getLogger("flwr_inca")


class BudgetExceededError(RuntimeError):
    """A round would take the composed epsilon past the ledger's ``max_epsilon``."""


class LedgerOwnerError(ValueError):
    """The ledger file belongs to another owner (another training), and sharing it was not asked for."""


def run_identity() -> dict[str, Any]:
    """This process as a ledger records it: host, pid, the process's start time (so that a reused pid is
    not mistaken for the same run) and a random token."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid()),
            "token": uuid.uuid4().hex[:12]}


def _process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (Linux), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode("ascii", "replace").rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (Linux), None where unknown."""
    stat = _process_stat(pid)
    try:
        return None if stat is None else int(stat[19])
    except (ValueError, IndexError):
        return None


def _run_ended(run: dict[str, Any] | None) -> bool:
    """Whether the run that wrote a reservation has certainly ended: it ran on this host and its process
    is gone (or the pid now belongs to a process started later). Runs on other hosts are never presumed
    ended: their reservations stay counted at their reserved value."""
    if not isinstance(run, dict) or run.get("host") != socket.gethostname():
        return False
    pid = run.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():  # this process: alive (unless the pid was reused after a reboot)
        return run.get("started") not in (None, _process_start(pid))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by someone else
        return False
    stat = _process_stat(pid)
    if stat is not None and stat[0] in ("Z", "X"):  # killed, not yet reaped by its parent: it ended
        return True
    started = run.get("started")
    return started is not None and _process_start(pid) not in (None, started)


@dataclass(frozen=True)
class LedgerEntry:
    """One round as the ledger records it.

    Attributes:
        round: the entry's number (1-based, in the order the rounds were reserved).
        mu: GDP mu charged (composed); for a reservation, the most the round can reveal.
        sample_rate: Poisson sampling rate of the protected unit in the round.
        epsilon: composed epsilon after this entry, when it was last written (informative).
        status: ``"charged"``, or ``"reserved"`` while its round runs (counted at ``mu`` all the same).
        note, owner, method: what the round was, who spent it, the certificate that gave ``mu``.
        certified_mu: the round's certified cost when ``mu`` is that cost rounded up (None: ``mu`` itself).
        run: the process that wrote it (host, pid, start time, token).
        chain: checksum over this entry and every entry before it.
    """

    round: int
    mu: float
    sample_rate: float
    epsilon: float
    note: str = ""
    owner: str | None = None
    method: str | None = None
    certified_mu: float | None = None
    status: str = CHARGED
    run: dict[str, Any] | None = None
    chain: str = ""

    @property
    def reserved(self) -> bool:
        return self.status == RESERVED

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"round": self.round, "mu": self.mu, "sample_rate": self.sample_rate,
                               "epsilon": self.epsilon, "status": self.status, "note": self.note}
        for key in ("owner", "method", "certified_mu", "run"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["chain"] = self.chain
        return out


def _chained(previous: str, entry: LedgerEntry) -> str:
    body = entry.to_dict()
    body.pop("chain")
    return hashlib.sha256((previous + dumps(body, sort_keys=True)).encode("utf-8")).hexdigest()


class PrivacyLedger:
    """Composed privacy spent so far, optionally persisted at ``path``.

    Args:
        path: JSON file; loaded if it exists (its delta and accountant must match), else created on
            the first spend (or claim). None keeps the ledger in memory. Temporary files that a writer
            killed mid-write left beside it are removed when it is opened, and reservations of runs that
            ended are charged at their reserved value.
        delta: the delta at which epsilon is reported, in (0, 1).
        max_epsilon: budget; :meth:`spend` and :meth:`reserve` refuse a round that would exceed it.
            None = unlimited.
        accountant: ``"exact"`` (no subsampling), ``"opacus-prv"`` or ``"opacus-rdp"`` (Poisson
            subsampling), or a :class:`RoundAccountant`.
        owner: the training this ledger accounts for (any non-empty name); see :meth:`claim`. None: claim
            nothing (read a ledger, or spend on it as whoever owns it).
        shared: with ``owner``, accept a file that belongs to another owner: both trainings then charge
            one budget, on purpose (each entry records who spent it).

    Queries (``epsilon()``, ``rounds``, ...) answer from the state read at the last open, change, claim
    or :meth:`refresh`; every change re-reads the file first.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        delta: float,
        max_epsilon: float | None = None,
        accountant: str | RoundAccountant = "exact",
        owner: str | None = None,
        shared: bool = False,
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.delta = check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
        self.max_epsilon = None if max_epsilon is None else check_real(
            "max_epsilon (or None)", max_epsilon, 0.0, low_open=True, finite=False)
        self.accountant = create_accountant(accountant) if isinstance(accountant, str) else accountant
        self.owner: str | None = None
        self.shared = False
        self.file_owner: str | None = None  # the owner recorded in the file
        self.run = run_identity()
        self.recovered: list[LedgerEntry] = []  # reservations of ended runs charged when this ledger opened
        self._entries: list[LedgerEntry] = []
        if self.path is not None:
            self._open()
        if owner is not None:
            self.claim(owner, shared=shared)
        elif shared:
            raise ValueError("shared=True needs an owner")

    # ------------------------------------------------------------------ queries
    @property
    def entries(self) -> list[LedgerEntry]:
        return list(self._entries)

    @property
    def rounds(self) -> int:
        """Entries recorded (charged or reserved)."""
        return len(self._entries)

    def reservations(self) -> list[LedgerEntry]:
        """The entries still reserved (their rounds running, or their runs on another host)."""
        return [e for e in self._entries if e.reserved]

    def costs(self) -> list[RoundCost]:
        return [RoundCost(e.mu, e.sample_rate) for e in self._entries]

    def epsilon(self) -> float:
        """Composed epsilon of every entry at the ledger's delta, reservations at their reserved value."""
        return self.accountant.epsilon(self.costs(), self.delta)

    def epsilon_after(self, mu: float, sample_rate: float = 1.0, rounds: int = 1) -> float:
        """What epsilon would be after ``rounds`` more rounds costing ``mu`` each (what-if)."""
        extra = [RoundCost(_check_mu(mu), _check_rate(sample_rate))] * rounds
        return self.accountant.epsilon(self.costs() + extra, self.delta)

    def epsilon_if(self, entry: int, mu: float) -> float:
        """What epsilon would be if entry ``entry`` (its 1-based number) were charged ``mu`` instead."""
        costs = self.costs()
        costs[self._index(entry)] = RoundCost(_check_mu(mu), costs[self._index(entry)].sample_rate)
        return self.accountant.epsilon(costs, self.delta)

    def can_afford(self, mu: float, sample_rate: float = 1.0) -> bool:
        eps = self.epsilon_after(mu, sample_rate)  # validates the arguments also without a budget
        return self.max_epsilon is None or eps <= self.max_epsilon

    # ------------------------------------------------------------------ updates
    def spend(self, mu: float, sample_rate: float = 1.0, *, force: bool = False, note: str = "",
              method: str | None = None, certified_mu: float | None = None) -> float:
        """Record one round at once (reserved and settled in one write); return the composed epsilon.

        ``method``: the certificate that gave ``mu`` (e.g. ``"exact"``, ``"bound"``). ``certified_mu``: when
        ``mu`` is a round's cost rounded up (so that the accountant composes few distinct rounds), that
        cost, kept beside it; it must not exceed ``mu`` (``ValueError``). Raises
        :class:`BudgetExceededError` (recording nothing) if the round would exceed ``max_epsilon``, unless
        ``force=True`` (a round already released has spent its budget and must be recorded). An
        ``OSError`` (the file cannot be written) records nothing either.
        """
        return self._append(mu, sample_rate, force, note, method, certified_mu, CHARGED)[1]

    def reserve(self, mu: float, sample_rate: float = 1.0, *, note: str = "", method: str | None = None,
                force: bool = False) -> int:
        """Durably reserve ``mu`` for a round about to release something (write-ahead); returns the entry's
        number for :meth:`raise_reservation` and :meth:`settle`. Raises :class:`BudgetExceededError`
        (nothing recorded) if it does not fit ``max_epsilon`` (unless ``force``), ``OSError`` if the file
        cannot be written (nothing recorded: the round must not start)."""
        return self._append(mu, sample_rate, force, note, method, None, RESERVED)[0]

    def raise_reservation(self, entry: int, mu: float, *, method: str | None = None,
                          force: bool = False) -> float:
        """Raise reservation ``entry`` to ``mu`` (a no-op if it already holds as much), durably; returns
        the composed epsilon. :class:`BudgetExceededError` (nothing changed) if that would exceed
        ``max_epsilon`` unless ``force``; ``OSError`` (nothing changed) if the file cannot be written."""
        mu = _check_mu(mu)
        with self._lock():
            k, old = self._reservation(entry)
            if mu <= old.mu:
                return self.epsilon()
            eps = self.epsilon_if(entry, mu)
            if not force and self.max_epsilon is not None and eps > self.max_epsilon:
                raise BudgetExceededError(
                    f"raising round {entry}'s reservation to mu = {mu:.4g} would bring epsilon to {eps:.4g} > "
                    f"max_epsilon = {self.max_epsilon:.4g} at delta = {self.delta:g}")
            self._rewrite(k, replace(old, mu=mu, epsilon=eps, method=method or old.method))
        return eps

    def settle(self, entry: int, mu: float, *, note: str | None = None, method: str | None = None,
               certified_mu: float | None = None) -> float:
        """Charge reservation ``entry`` its final cost ``mu`` (normally at most what was reserved; more is
        recorded too: a round's cost is never hidden); returns the composed epsilon. On ``OSError`` the
        reservation stays as it was, which still counts at least the round's cost."""
        mu = _check_mu(mu)
        certified_mu = _check_certified(certified_mu, mu, "certified_mu")
        with self._lock():
            k, old = self._reservation(entry)
            eps = self.epsilon_if(entry, mu)
            self._rewrite(k, replace(old, mu=mu, epsilon=eps, status=CHARGED, certified_mu=certified_mu,
                                     note=old.note if note is None else str(note), method=method))
        return eps

    def claim(self, owner: str, *, shared: bool = False) -> None:
        """Bind the ledger to ``owner``, the training it accounts for (e.g. the Flower app's name).

        A file without an owner (new) is claimed: the owner is written to it now. A file that belongs to
        another owner raises :class:`LedgerOwnerError` (a one-line message naming both) unless
        ``shared=True``; each later change checks again.
        """
        if not isinstance(owner, str) or not owner.strip():
            raise ValueError(f"ledger owner must be a non-empty string, got {owner!r}")
        previous = self.owner, self.shared
        self.owner, self.shared = owner, bool(shared)
        try:
            with self._lock():
                self._reload()
                self._check_owner()
                if self.file_owner is None:
                    self.file_owner = owner
                    try:
                        self._save()
                    except BaseException:
                        self.file_owner = None
                        raise
        except BaseException:
            self.owner, self.shared = previous
            raise

    def refresh(self) -> None:
        """Re-read the file (other processes sharing it may have spent since)."""
        with self._lock():
            self._reload()

    def live_runs(self) -> list[dict[str, Any]]:
        """Other runs that hold reservations in this ledger now (e.g. a second training on the same file)."""
        runs = {}
        for e in self._entries:
            if e.reserved and isinstance(e.run, dict) and e.run.get("token") != self.run["token"]:
                runs[e.run.get("token")] = e.run
        return list(runs.values())

    # ------------------------------------------------------------------ internals
    def _append(self, mu: float, sample_rate: float, force: bool, note: str, method: str | None,
                certified_mu: float | None, status: str) -> tuple[int, float]:
        mu = _check_mu(mu)
        sample_rate = _check_rate(sample_rate)
        certified_mu = _check_certified(certified_mu, mu, "certified_mu")
        with self._lock():
            self._reload()
            self._check_owner()
            eps = self.epsilon_after(mu, sample_rate)
            if not force and self.max_epsilon is not None and eps > self.max_epsilon:
                raise BudgetExceededError(
                    f"round {self.rounds + 1} (mu = {mu:.4g}, sample_rate = {sample_rate:.4g}) would bring "
                    f"epsilon to {eps:.4g} > max_epsilon = {self.max_epsilon:.4g} at delta = {self.delta:g} "
                    f"(spent so far: {self.epsilon():.4g} over {self.rounds} round(s))")
            entry = LedgerEntry(self.rounds + 1, mu, sample_rate, eps, str(note), self.owner,
                                None if method is None else str(method), certified_mu, status, self.run)
            self._rewrite(len(self._entries), entry)
        return entry.round, eps

    def _reservation(self, entry: int) -> tuple[int, LedgerEntry]:
        """Re-read the file (under the lock) and return the index and state of reservation ``entry``."""
        self._reload()
        k = self._index(entry)
        if not self._entries[k].reserved:
            raise ValueError(f"ledger entry {entry} is already settled")
        return k, self._entries[k]

    def _rewrite(self, k: int, entry: LedgerEntry) -> None:
        """Put ``entry`` at index ``k`` (k == len: append), re-chain from there and save; on any failure
        the in-memory entries are left exactly as they were."""
        before = list(self._entries)
        entries = before[:k] + [entry] + before[k + 1:]
        previous = entries[k - 1].chain if k else self._genesis()
        for j in range(k, len(entries)):
            entries[j] = replace(entries[j], chain=_chained(previous, entries[j]))
            previous = entries[j].chain
        self._entries = entries
        try:
            self._save()
        except BaseException:
            self._entries = before
            raise

    def _genesis(self) -> str:
        return hashlib.sha256(f"{LEDGER_FORMAT}|{self.delta!r}|{self.accountant.name}".encode()).hexdigest()

    def _index(self, entry: int) -> int:
        if isinstance(entry, bool) or not isinstance(entry, int) or not 1 <= entry <= len(self._entries):
            raise ValueError(f"ledger {self.path or '(in memory)'} has no entry {entry!r}")
        return entry - 1

    def _recover(self) -> None:
        """Charge at their reserved value the reservations of runs that ended (under the lock)."""
        for k, e in enumerate(self._entries):
            if e.reserved and _run_ended(e.run):
                note = (f"{e.note} (never settled: its run ended before the round did; charged at its "
                        "reserved value)")
                self._rewrite(k, replace(self._entries[k], status=CHARGED, note=note.strip()))
                self.recovered.append(self._entries[k])
                _log.warning("IncA ledger %s: round %d was reserved but never settled (its run ended mid-round): "
                             "charged at its reserved mu = %.4g", self.path, e.round, e.mu)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
            "delta": self.delta,
            "max_epsilon": self.max_epsilon,
            "accountant": self.accountant.name,
            "owner": self.file_owner,
            "rounds": [e.to_dict() for e in self._entries],
        }

    def _lock(self):
        return file_lock(self.path) if self.path is not None else nullcontext()

    def _open(self) -> None:
        """Load the file if it exists, removing what killed writers left and charging the reservations of
        ended runs (under the lock, where no writer can be active); without write access to the
        directory, load it unlocked (a reader only: renames are atomic, so an unlocked read still sees a
        whole file)."""
        assert self.path is not None
        if not self.path.parent.is_dir():
            return  # nothing to read or clean: the file (and its directory) are created by the first spend
        try:
            with file_lock(self.path):
                remove_temp_files(self.path)
                self._reload()
                self._recover()
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            self._reload()

    def _reload(self) -> None:
        """Re-read the file. If it vanished, keep what was read before: spent budget is never forgotten."""
        if self.path is not None and self.path.exists():
            self._load()

    def _check_owner(self) -> None:
        if self.owner is None or self.file_owner in (None, self.owner) or self.shared:
            return
        raise LedgerOwnerError(
            f"ledger {self.path} belongs to {self.file_owner!r}, not {self.owner!r}: to resume it pass owner "
            f"{self.file_owner!r}; to charge both trainings to one budget on purpose pass shared=True "
            "(IncaStrategy: ledger_owner=, share_ledger=True); otherwise use another ledger file")

    def _save(self) -> None:
        if self.path is not None:
            atomic_write_text(self.path, dumps(self.to_dict(), indent=1))

    def _load(self) -> None:
        assert self.path is not None
        try:
            text = self.path.read_bytes()
        except OSError as exc:
            raise ValueError(f"ledger {self.path}: cannot read it ({exc.strerror or exc})") from None
        data = loads(text, f"ledger {self.path}")
        if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise ValueError(f"ledger {self.path}: format must be {LEDGER_FORMAT!r}, got {found!r}")
        kept_delta = data.get("delta")
        if isinstance(kept_delta, bool) or not isinstance(kept_delta, (int, float)):
            raise ValueError(f"ledger {self.path}: delta must be a number, got {kept_delta!r}")
        if float(kept_delta) != self.delta:
            raise ValueError(f"ledger {self.path} was kept at delta = {data.get('delta')}, not {self.delta}; "
                             "refusing to mix guarantees")
        file_owner = data.get("owner")
        if file_owner is not None and (not isinstance(file_owner, str) or not file_owner):
            raise ValueError(f"ledger {self.path}: owner must be a non-empty string or null, got {file_owner!r}")
        kept = data.get("accountant")
        if kept != self.accountant.name:
            raise ValueError(f"ledger {self.path} was kept with the {data.get('accountant')!r} accountant, not "
                             f"{self.accountant.name!r}")
        rounds = data.get("rounds")
        if not isinstance(rounds, list):
            raise ValueError(f"ledger {self.path}: 'rounds' must be a list")
        entries = self._parse_entries(rounds)
        if len(entries) < len(self._entries):  # rewritten behind our back with fewer rounds
            raise ValueError(f"ledger {self.path} now holds {len(entries)} round(s), fewer than the "
                             f"{len(self._entries)} read before: refusing to forget spent budget")
        self._entries = entries
        self.file_owner = file_owner

    def _parse_entries(self, rounds: list[Any]) -> list[LedgerEntry]:
        """The entries of a file, each checked (values, order, checksum chain): one line naming the file and
        the first bad entry otherwise."""
        entries = []
        previous = self._genesis()
        for k, r in enumerate(rounds, start=1):
            where = f"ledger {self.path}: round {k}:"
            if not isinstance(r, dict) or r.get("round") != k:
                raise ValueError(f"ledger {self.path}: round {k} is missing or out of order")
            mu = _check_loaded(float_from_json(r.get("mu"), f"{where} mu"), f"{where} mu", _check_mu)
            rate = _check_loaded(float_from_json(r.get("sample_rate", 1.0), f"{where} sample_rate"),
                                 f"{where} sample_rate", _check_rate)
            eps = float_from_json(r.get("epsilon"), f"{where} epsilon")
            status = r.get("status")
            if status not in (RESERVED, CHARGED):
                raise ValueError(f"{where} status must be {RESERVED!r} or {CHARGED!r}, got {status!r}")
            certified = r.get("certified_mu")
            if certified is not None:
                certified = _check_certified(float_from_json(certified, f"{where} certified_mu"), mu,
                                             f"{where} certified_mu")
            spender, method, run = r.get("owner"), r.get("method"), r.get("run")
            entry = LedgerEntry(k, mu, rate, eps, str(r.get("note", "")),
                                spender if isinstance(spender, str) else None,
                                method if isinstance(method, str) else None, certified, status,
                                run if isinstance(run, dict) else None, str(r.get("chain", "")))
            if entry.chain != _chained(previous, entry):
                raise ValueError(f"{where} its checksum does not match: the file was edited outside flwr-inca "
                                 "(an entry changed, removed or reordered); refusing to trust its total")
            previous = entry.chain
            entries.append(entry)
        return entries

    def __repr__(self) -> str:
        budget = "unlimited" if self.max_epsilon is None else f"{self.max_epsilon:g}"
        return (f"PrivacyLedger(rounds={self.rounds}, epsilon={self.epsilon():.4g}, delta={self.delta:g}, "
                f"max_epsilon={budget}, accountant={self.accountant.name!r})")


def _check_mu(mu: float) -> float:
    return check_real("mu", mu, 0.0, finite=False)


def _check_loaded(value: float, where: str, check) -> float:
    """A value read from the file, checked; the error names the file and entry (``where``)."""
    try:
        return check(value)
    except ValueError as exc:
        raise ValueError(f"{where} {exc}") from None


def _check_certified(certified: float | None, mu: float, what: str) -> float | None:
    """The cost kept beside a charged ``mu``: None when it is ``mu`` itself; never above ``mu``."""
    if certified is None:
        return None
    certified = check_real(what, certified, 0.0, finite=False)
    if certified > mu:
        raise ValueError(f"{what} = {certified!r} exceeds the charged mu = {mu!r}: a round must be charged "
                         "at least its cost")
    return None if certified == mu else certified


def _check_rate(q: float) -> float:
    return check_real("sample_rate", q, 0.0, 1.0, low_open=True)
