"""A persistent privacy-budget ledger for multi-round training.

Each round adds its certified cost ``RoundCost(mu, sample_rate)``; the ledger composes them with a
round accountant and reports epsilon at a fixed delta. With a file path, every change is written
atomically (temp file, fsync, rename) before it is acknowledged, so a crash or restart never forgets
spent budget; a restarted process resumes from the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._checks import check_real
from .._io import atomic_write_text
from .._json import dumps, float_from_json
from .accountants import RoundAccountant, RoundCost, create_accountant, resolve_accountant_name

__all__ = ["LEDGER_FORMAT", "BudgetExceededError", "LedgerEntry", "PrivacyLedger"]

LEDGER_FORMAT = "inca-ledger/1"


class BudgetExceededError(RuntimeError):
    """A round would take the composed epsilon past the ledger's ``max_epsilon``."""


@dataclass(frozen=True)
class LedgerEntry:
    round: int
    mu: float
    sample_rate: float
    epsilon: float  # composed epsilon after this round
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"round": self.round, "mu": self.mu, "sample_rate": self.sample_rate,
                "epsilon": self.epsilon, "note": self.note}


class PrivacyLedger:
    """Composed privacy spent so far, optionally persisted at ``path``.

    Args:
        path: JSON file; loaded if it exists (its delta and accountant must match), else created on
            the first spend. None keeps the ledger in memory.
        delta: the delta at which epsilon is reported, in (0, 1).
        max_epsilon: budget; :meth:`spend` refuses a round that would exceed it. None = unlimited.
        accountant: ``"exact"`` (no subsampling), ``"opacus-prv"`` or ``"opacus-rdp"`` (Poisson
            subsampling), or a :class:`RoundAccountant`. A file kept under a name before 0.2
            (``"gdp"``, ``"prv"``, ``"rdp"``) loads as the accountant now called so.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        delta: float,
        max_epsilon: float | None = None,
        accountant: str | RoundAccountant = "exact",
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.delta = check_real("delta", delta, 0.0, 1.0, low_open=True, high_open=True)
        self.max_epsilon = None if max_epsilon is None else check_real(
            "max_epsilon (or None)", max_epsilon, 0.0, low_open=True, finite=False)
        self.accountant = create_accountant(accountant) if isinstance(accountant, str) else accountant
        self._entries: list[LedgerEntry] = []
        if self.path is not None and self.path.exists():
            self._load()

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
        return self.max_epsilon is None or self.epsilon_after(mu, sample_rate) <= self.max_epsilon

    # ------------------------------------------------------------------ updates
    def spend(self, mu: float, sample_rate: float = 1.0, *, force: bool = False, note: str = "") -> float:
        """Record one round; return the composed epsilon.

        Raises :class:`BudgetExceededError` (recording nothing) if the round would exceed
        ``max_epsilon``, unless ``force=True``: a round whose messages were already exchanged has
        spent its budget whether or not we like it, and must be recorded.
        """
        mu = _check_mu(mu)
        sample_rate = _check_rate(sample_rate)
        eps = self.epsilon_after(mu, sample_rate)
        if not force and self.max_epsilon is not None and eps > self.max_epsilon:
            raise BudgetExceededError(
                f"round {self.rounds + 1} (mu = {mu:.4g}, sample_rate = {sample_rate:.4g}) would bring "
                f"epsilon to {eps:.4g} > max_epsilon = {self.max_epsilon:.4g} at delta = {self.delta:g} "
                f"(spent so far: {self.epsilon():.4g} over {self.rounds} round(s))"
            )
        entry = LedgerEntry(self.rounds + 1, mu, sample_rate, eps, note)
        self._entries.append(entry)
        try:
            self._save()
        except BaseException:
            self._entries.pop()
            raise
        return eps

    # ------------------------------------------------------------------ persistence
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT,
            "delta": self.delta,
            "max_epsilon": self.max_epsilon,
            "accountant": self.accountant.name,
            "rounds": [e.to_dict() for e in self._entries],
        }

    def _save(self) -> None:
        if self.path is not None:
            atomic_write_text(self.path, dumps(self.to_dict(), indent=1))

    def _load(self) -> None:
        assert self.path is not None
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"ledger {self.path}: not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT:
            raise ValueError(f"ledger {self.path}: format must be {LEDGER_FORMAT!r}")
        if float(data.get("delta", -1)) != self.delta:
            raise ValueError(
                f"ledger {self.path} was kept at delta = {data.get('delta')}, not {self.delta}; "
                "refusing to mix guarantees"
            )
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
            entries.append(LedgerEntry(k, mu, rate, eps, str(r.get("note", ""))))
        self._entries = entries

    def __repr__(self) -> str:
        budget = "unlimited" if self.max_epsilon is None else f"{self.max_epsilon:g}"
        return (f"PrivacyLedger(rounds={self.rounds}, epsilon={self.epsilon():.4g}, delta={self.delta:g}, "
                f"max_epsilon={budget}, accountant={self.accountant.name!r})")


def _check_mu(mu: float) -> float:
    return check_real("mu", mu, 0.0, finite=False)


def _check_rate(q: float) -> float:
    return check_real("sample_rate", q, 0.0, 1.0, low_open=True)
