"""A persistent privacy-budget ledger for multi-round training.

Each round adds its certified cost ``RoundCost(mu, sample_rate)``; the ledger composes them with a
round accountant and reports epsilon at a fixed delta. With a file path, every change is written
atomically (temp file, fsync, rename) before it is acknowledged, so a crash or restart never forgets
spent budget; a restarted process resumes from the file.

Several processes may spend on one file: each spend holds an OS lock (``flock`` on ``<file>.lock``),
re-reads the file under it and checks the budget against the re-read total, so no spend is lost and
the budget is never exceeded in total. A file belongs to one *owner* (the training it accounts for):
opening it for another owner fails unless sharing is asked for (``shared=True``), so two trainings
never charge one budget by accident.
"""

from __future__ import annotations

import errno
import os
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._checks import check_real
from .._io import atomic_write_text, file_lock, remove_temp_files
from .._json import dumps, float_from_json, loads
from .accountants import RoundAccountant, RoundCost, create_accountant, resolve_accountant_name

__all__ = ["LEDGER_FORMAT", "BudgetExceededError", "LedgerEntry", "LedgerOwnerError", "PrivacyLedger"]

LEDGER_FORMAT = "inca-ledger/1"


class BudgetExceededError(RuntimeError):
    """A round would take the composed epsilon past the ledger's ``max_epsilon``."""


class LedgerOwnerError(ValueError):
    """The ledger file belongs to another owner (another training), and sharing it was not asked for."""


@dataclass(frozen=True)
class LedgerEntry:
    round: int
    mu: float
    sample_rate: float
    epsilon: float  # composed epsilon after this round
    note: str = ""
    owner: str | None = None  # who spent it (differs from the file's owner only in a shared ledger)
    method: str | None = None  # the certificate that gave mu: "exact", "bound", ... (None: not recorded)
    # the round's cost as certified (or bounded, or predicted: see method) when mu, what was charged and
    # composed, is that cost rounded up; never above mu (None: mu is the cost itself)
    certified_mu: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"round": self.round, "mu": self.mu, "sample_rate": self.sample_rate,
                               "epsilon": self.epsilon, "note": self.note}
        if self.owner is not None:
            out["owner"] = self.owner
        if self.method is not None:
            out["method"] = self.method
        if self.certified_mu is not None:
            out["certified_mu"] = self.certified_mu
        return out


class PrivacyLedger:
    """Composed privacy spent so far, optionally persisted at ``path``.

    Args:
        path: JSON file; loaded if it exists (its delta and accountant must match), else created on
            the first spend (or claim). None keeps the ledger in memory. Temporary files that a writer
            killed mid-write left beside it are removed when it is opened.
        delta: the delta at which epsilon is reported, in (0, 1).
        max_epsilon: budget; :meth:`spend` refuses a round that would exceed it. None = unlimited.
        accountant: ``"exact"`` (no subsampling), ``"opacus-prv"`` or ``"opacus-rdp"`` (Poisson
            subsampling), or a :class:`RoundAccountant`. A file kept under a name before 0.2
            (``"gdp"``, ``"prv"``, ``"rdp"``) loads as the accountant now called so.
        owner: the training this ledger accounts for (any non-empty name); see :meth:`claim`. None: claim
            nothing (read a ledger, or spend on it as whoever owns it).
        shared: with ``owner``, accept a file that belongs to another owner: both trainings then charge
            one budget, on purpose (each entry records who spent it).

    Queries (``epsilon()``, ``rounds``, ...) answer from the state read at the last open, spend, claim or
    :meth:`refresh`; :meth:`spend` always re-reads the file first.
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
        return len(self._entries)

    def costs(self) -> list[RoundCost]:
        return [RoundCost(e.mu, e.sample_rate) for e in self._entries]

    def epsilon(self) -> float:
        """Composed epsilon of every recorded round at the ledger's delta."""
        return self.accountant.epsilon(self.costs(), self.delta)

    def epsilon_after(self, mu: float, sample_rate: float = 1.0, rounds: int = 1) -> float:
        """What epsilon would be after ``rounds`` more rounds costing ``mu`` each (what-if)."""
        extra = [RoundCost(_check_mu(mu), _check_rate(sample_rate))] * rounds
        return self.accountant.epsilon(self.costs() + extra, self.delta)

    def can_afford(self, mu: float, sample_rate: float = 1.0) -> bool:
        eps = self.epsilon_after(mu, sample_rate)  # validates the arguments also without a budget
        return self.max_epsilon is None or eps <= self.max_epsilon

    # ------------------------------------------------------------------ updates
    def spend(self, mu: float, sample_rate: float = 1.0, *, force: bool = False, note: str = "",
              method: str | None = None, certified_mu: float | None = None) -> float:
        """Record one round; return the composed epsilon. ``method``: the certificate that gave ``mu``
        (:attr:`~flwr_inca.privacy.Certificate.method`, e.g. ``"exact"`` or ``"bound"``), kept in the entry.
        ``certified_mu``: when ``mu`` is a round's cost rounded up (so that the accountant composes few
        distinct rounds), that cost, kept beside it; it must not exceed ``mu`` (``ValueError``): what is
        charged and composed is ``mu``, and charging less than the cost would under-count the privacy spent.

        Under the file's lock, the file is re-read first (other processes may have spent meanwhile) and
        the budget is checked against that total. Raises :class:`BudgetExceededError` (recording
        nothing) if the round would exceed ``max_epsilon``, unless ``force=True``: a round whose messages
        were already exchanged has spent its budget whether or not we like it, and must be recorded.
        """
        mu = _check_mu(mu)
        sample_rate = _check_rate(sample_rate)
        note = str(note)
        method = None if method is None else str(method)
        certified_mu = _check_certified(certified_mu, mu, "certified_mu")
        with self._lock():
            self._reload()
            self._check_owner()
            eps = self.epsilon_after(mu, sample_rate)
            if not force and self.max_epsilon is not None and eps > self.max_epsilon:
                raise BudgetExceededError(
                    f"round {self.rounds + 1} (mu = {mu:.4g}, sample_rate = {sample_rate:.4g}) would bring "
                    f"epsilon to {eps:.4g} > max_epsilon = {self.max_epsilon:.4g} at delta = {self.delta:g} "
                    f"(spent so far: {self.epsilon():.4g} over {self.rounds} round(s))"
                )
            entry = LedgerEntry(self.rounds + 1, mu, sample_rate, eps, note, self.owner, method, certified_mu)
            self._entries.append(entry)
            try:
                self._save()
            except BaseException:
                self._entries.pop()
                raise
        return eps

    def claim(self, owner: str, *, shared: bool = False) -> None:
        """Bind the ledger to ``owner``, the training it accounts for (e.g. the Flower app's name).

        A file without an owner (new, or written before owners existed) is claimed: the owner is written
        to it now. A file that belongs to another owner raises :class:`LedgerOwnerError` (a one-line
        message naming both) unless ``shared=True``; each later :meth:`spend` checks again.
        """
        if not isinstance(owner, str) or not owner.strip():
            raise ValueError(f"ledger owner must be a non-empty string, got {owner!r}")
        previous = self.owner, self.shared
        self.owner, self.shared = owner, bool(shared)
        try:
            with self._lock():
                self._reload()
                self._check_owner()
                self._claim_unowned(owner)
        except BaseException:
            self.owner, self.shared = previous
            raise

    def _claim_unowned(self, owner: str) -> None:
        if self.file_owner is None:
            self.file_owner = owner
            try:
                self._save()
            except BaseException:
                self.file_owner = None
                raise

    def refresh(self) -> None:
        """Re-read the file (other processes sharing it may have spent since)."""
        with self._lock():
            self._reload()

    # ------------------------------------------------------------------ persistence
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
        """Load the file if it exists, removing what killed writers left (under the lock, where no writer
        can be active); without write access to the directory, load it unlocked (a reader only: renames
        are atomic, so an unlocked read still sees a whole file)."""
        assert self.path is not None
        if not self.path.parent.is_dir():
            return  # nothing to read or clean: the file (and its directory) are created by the first spend
        try:
            with file_lock(self.path):
                remove_temp_files(self.path)
                self._reload()
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
            raise ValueError(f"ledger {self.path}: format must be {LEDGER_FORMAT!r}")
        kept_delta = data.get("delta")
        if isinstance(kept_delta, bool) or not isinstance(kept_delta, (int, float)):
            raise ValueError(f"ledger {self.path}: delta must be a number, got {kept_delta!r}")
        if float(kept_delta) != self.delta:
            raise ValueError(
                f"ledger {self.path} was kept at delta = {data.get('delta')}, not {self.delta}; "
                "refusing to mix guarantees"
            )
        file_owner = data.get("owner")
        if file_owner is not None and (not isinstance(file_owner, str) or not file_owner):
            raise ValueError(f"ledger {self.path}: owner must be a non-empty string or null, got {file_owner!r}")
        kept = data.get("accountant")
        try:  # a file of an earlier release names its accountant as it was called then
            kept = resolve_accountant_name(kept, warn=False) if isinstance(kept, str) else kept
        except ValueError:
            pass
        if kept != self.accountant.name:
            raise ValueError(
                f"ledger {self.path} was kept with the {data.get('accountant')!r} accountant, not "
                f"{self.accountant.name!r}"
            )
        rounds = data.get("rounds")
        if not isinstance(rounds, list):
            raise ValueError(f"ledger {self.path}: 'rounds' must be a list")
        entries = []
        for k, r in enumerate(rounds, start=1):
            if not isinstance(r, dict) or r.get("round") != k:
                raise ValueError(f"ledger {self.path}: round {k} is missing or out of order")
            where = f"ledger {self.path}: round {k}:"
            mu = _check_mu(float_from_json(r.get("mu"), f"{where} mu"))
            rate = _check_rate(float_from_json(r.get("sample_rate", 1.0), f"{where} sample_rate"))
            eps = float_from_json(r.get("epsilon"), f"{where} epsilon")
            spender, method = r.get("owner"), r.get("method")  # absent from older files, as certified_mu
            certified = r.get("certified_mu")
            if certified is not None:
                certified = _check_certified(float_from_json(certified, f"{where} certified_mu"), mu,
                                             f"{where} certified_mu")
            entries.append(LedgerEntry(k, mu, rate, eps, str(r.get("note", "")),
                                       spender if isinstance(spender, str) else None,
                                       method if isinstance(method, str) else None, certified))
        if len(entries) < len(self._entries):  # rewritten behind our back with fewer rounds
            raise ValueError(f"ledger {self.path} now holds {len(entries)} round(s), fewer than the "
                             f"{len(self._entries)} read before: refusing to forget spent budget")
        self._entries = entries
        self.file_owner = file_owner

    def __repr__(self) -> str:
        budget = "unlimited" if self.max_epsilon is None else f"{self.max_epsilon:g}"
        return (f"PrivacyLedger(rounds={self.rounds}, epsilon={self.epsilon():.4g}, delta={self.delta:g}, "
                f"max_epsilon={budget}, accountant={self.accountant.name!r})")


def _check_mu(mu: float) -> float:
    return check_real("mu", mu, 0.0, finite=False)


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
