"""The round session: how every training round is admitted, guarded and charged, for any driver.

``IncaStrategy`` (Flower) and the simulator both run their rounds through a :class:`RoundSession` on
one :class:`~flwr_inca.privacy.ledger.PrivacyLedger`. A round's privacy is spent as its messages
leave, so the session charges *before* anything is released (write-ahead) and asks, in order:

1. :meth:`RoundSession.admit`: may round r start? Not when training was stopped, when the budget is
   overrun, or when the round's predicted cost does not fit (:class:`BudgetExhausted`: nothing of the
   round is released or charged).
2. :meth:`RoundSession.open`: before the first message leaves, the ledger durably *reserves* the most
   the round can reveal before its release (``ceilings[-1]``: for IncA the no-finals bound over every
   execution). If that does not fit the budget left, the round runs *guarded*: nothing is reserved yet.
   A ledger that cannot be written raises here: the round does not start.
3. :meth:`OpenRound.may_deliver` before each step (IncA: the messages of iteration t): the reservation
   is raised, durably, to the step's ceiling if it fits, else to the exact certificate of what the
   adversaries will then have observed (``certify_through``) if that fits; otherwise the step is not
   delivered and the round is refused.
4. :meth:`OpenRound.may_release` before the release (IncA: asking for the final messages; the
   certificate with every final counted as revealed, an upper bound whatever then arrives): the
   reservation is raised to it if it fits; otherwise the release is withheld and the round refused.
5. The charge: :meth:`OpenRound.settle` (released: the exact cost of what was revealed, normally below
   the reservation), :meth:`OpenRound.refuse` (stopped by 3 or 4: what was delivered is charged and the
   round skipped; training stops after ``max_consecutive_refusals`` refusals in a row, or when nothing
   of the round could be delivered), or :meth:`OpenRound.fail` (an error: the reservation, a bound on
   what was revealed, is charged as it stands).

A process that dies mid-round leaves its reservation in the ledger, counted at its reserved value; the
next process to open the ledger charges it so (``PrivacyLedger``, "write-ahead"). The decisions depend
only on the ledger and on the round's execution (who was online, who sent what weight to whom), never
on the data: stopping reveals nothing about it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._checks import check_int, check_real
from .._search import last_fitting
from .ledger import BudgetExceededError, PrivacyLedger
from .rounds import RoundCertificate

__all__ = ["BudgetExhausted", "OpenRound", "RoundCharge", "RoundSession", "charge_resolution"]

Certifier = Callable[[int], RoundCertificate]


# a guarded step reserves its exact certificate times this when it fits (and stays below the step's
# ceiling): the following steps' certificates grow little, and those below it need no new ledger write
EXACT_HEADROOM = 1.25


def charge_resolution(mu: float, resolution: float) -> float:
    """``mu`` rounded *up* to the grid ``(1 + resolution)^k`` (unchanged for 0, inf or resolution 0), so
    that an accountant composes few distinct rounds; never below ``mu``."""
    if resolution <= 0 or mu <= 0 or not math.isfinite(mu):
        return float(mu)
    step = math.log1p(resolution)
    charged = math.exp(math.ceil(math.log(mu) / step - 1e-12) * step)
    while charged < mu:  # float safety: never charge less than the cost
        charged *= 1.0 + resolution
    return charged


class BudgetExhausted(BudgetExceededError):
    """Training stops: a round may not start, or a refused round ended training.

    Attributes:
        round: the round that did not start, or the refused round that ended training.
        epsilon: privacy spent, at ``delta`` (the refused round's charge included).
        predicted_epsilon: what it would have been after the round (a round that did not start: with its
            predicted cost, ``inf`` if the budget was already overrun; a refused round: NaN).
        max_epsilon, delta: the budget.
        started: the round ran (some of) its steps before it was refused.
        delivered: for such a round, the steps delivered (IncA: iterations) before it stopped.
    """

    def __init__(self, reason: str, *, round: int = 0, epsilon: float = math.nan,
                 predicted_epsilon: float = math.nan, max_epsilon: float | None = None, delta: float = math.nan,
                 started: bool = False, delivered: int | None = None) -> None:
        super().__init__(reason)
        self.round, self.epsilon, self.predicted_epsilon = round, epsilon, predicted_epsilon
        self.max_epsilon, self.delta = max_epsilon, delta
        self.started, self.delivered = started, delivered


@dataclass
class RoundCharge:
    """What the session charged for one round.

    Attributes:
        round: the round.
        outcome: ``"released"`` (settled), ``"refused"`` (stopped by the budget, skipped) or ``"failed"``.
        mu: GDP mu charged (rounded up to the session's resolution); ``certified_mu``: before rounding.
        method: what gave it (``"exact"``, ``"bound"``, ``"ceiling"``, ``"reserved"``, ...).
        epsilon: the ledger's epsilon after the charge.
        steps: the round's steps (IncA: T); ``delivered``: those delivered.
        released: whether the release happened (IncA: the finals were asked for).
        entry: the ledger entry (None: nothing was recorded, the round revealed nothing).
        note: the ledger note; ``stop``: why training stops after this round ("" if it goes on).
        unsettled: the charge could not be written; the reservation (at least the cost) stands.
    """

    round: int
    outcome: str
    mu: float
    certified_mu: float
    method: str
    epsilon: float
    steps: int
    delivered: int
    released: bool
    entry: int | None
    note: str
    stop: str = ""
    unsettled: str = ""

    @property
    def refused(self) -> bool:
        return self.outcome == "refused"


class RoundSession:
    """The privacy policy of a training: one per ledger and driver.

    Args:
        ledger: where rounds are reserved and charged (its ``max_epsilon`` is the budget).
        sample_rate: Poisson sampling rate of the protected unit per round (record-level DP).
        max_consecutive_refusals: training stops after this many rounds in a row refused by the budget.
        resolution: every charge is rounded up to the relative grid ``(1 + resolution)^k``
            (:func:`charge_resolution`; 0: charged exactly).
    """

    def __init__(self, ledger: PrivacyLedger, *, sample_rate: float = 1.0, max_consecutive_refusals: int = 3,
                 resolution: float = 0.0) -> None:
        if not isinstance(ledger, PrivacyLedger):
            raise ValueError(f"ledger must be a PrivacyLedger, got {type(ledger).__name__}")
        self.ledger = ledger
        self.sample_rate = check_real("sample_rate", sample_rate, 0.0, 1.0, low_open=True)
        self.max_consecutive_refusals = check_int(
            "max_consecutive_refusals (rounds refused by the budget in a row before training stops)",
            max_consecutive_refusals, 1)
        self.resolution = check_real("mu_resolution", resolution, 0.0, 1.0, high_open=True)
        self.refusals = 0  # rounds refused in a row
        self.stopped_round: int | None = None  # training stopped after this round
        self.stop_reason = ""
        self._unsettled: list[tuple[int, float, float, str, str]] = []  # charges that could not be written
        self.reach: int | None = None  # the furthest step the last guarded round reserved at its first, less 1

    # -------------------------------------------------------------------------- budget arithmetic
    def charged(self, mu: float) -> float:
        """What a cost ``mu`` is charged as (rounded up to the resolution)."""
        return charge_resolution(float(mu), self.resolution)

    def epsilon_after(self, mu: float) -> float:
        """The ledger's epsilon after one more round charged for a cost ``mu``."""
        return self.ledger.epsilon_after(self.charged(mu), self.sample_rate)

    def fits(self, mu: float) -> bool:
        """Whether one more round of cost ``mu`` fits the budget left (as the ledger reads now)."""
        budget = self.ledger.max_epsilon
        return budget is None or (not math.isnan(mu) and self.epsilon_after(mu) <= budget)

    # -------------------------------------------------------------------------- admission
    def admit(self, round: int, *, predicted_mu: Callable[[], float], known_mu: float | None = None,
              hint: Callable[[], str] | None = None) -> None:
        """Whether round ``round`` may start; raises :class:`BudgetExhausted` (nothing charged) if not.

        It may not after training stopped, when the budget is already overrun, or when one more round of
        its predicted cost (``predicted_mu()``, called only when needed: a prediction costs several
        certificates) does not fit. ``known_mu``: the round's own cost when the driver knows it before the
        round (a simulator samples the execution first): a round whose own cost fits always starts.
        ``hint()``: a sentence for the user appended to a refusal (what to change)."""
        ledger = self.ledger
        ledger.refresh()  # another process sharing the ledger may have spent
        budget, spent = ledger.max_epsilon, ledger.epsilon()
        if self.stopped_round is not None:
            raise self._exhausted(f"not starting round {round}: training stopped at round {self.stopped_round} "
                                  f"({self.stop_reason})", round, math.inf)
        if budget is None:
            return
        if spent > budget:
            raise self._exhausted(f"stopping before round {round}: the rounds so far brought epsilon to "
                                  f"{spent:.4g} > max_epsilon = {budget:.4g} (delta = {ledger.delta:.1e})",
                                  round, math.inf)
        if known_mu is not None and self.fits(known_mu):
            return
        predicted = float(predicted_mu())
        after = self.epsilon_after(predicted) if not math.isnan(predicted) else math.inf
        if after <= budget:
            return
        reason = (f"stopping before round {round}: it would bring epsilon from {spent:.4g} to about {after:.4g} > "
                  f"max_epsilon = {budget:.4g} (delta = {ledger.delta:.1e}); its predicted cost is mu = "
                  f"{predicted:.4g}; nothing of it was released or charged")
        extra = hint() if hint is not None else ""
        raise self._exhausted(f"{reason}. {extra}" if extra else reason, round, after)

    def open(self, round: int, *, ceilings: Sequence[float], certify_through: Certifier | None = None,
             note: str = "") -> OpenRound:
        """Start round ``round``: reserve, durably, before its first message leaves (see the module doc).

        ``ceilings[s - 1]``: the most the round can reveal once its steps 1..s are delivered, on any
        execution (non-decreasing; empty for a mechanism that reveals nothing before its release).
        ``certify_through(s)``: the exact cost once steps 1..s are delivered, computable before step s is
        (None: decisions use the ceilings only). Raises ``OSError`` if the ledger cannot be written:
        the round must not start."""
        self._retry_unsettled()
        opened = OpenRound(self, int(round), [float(c) for c in ceilings], certify_through, note or f"round {round}")
        if opened.steps:
            if self.reach is not None and self.reach < opened.steps - 1:
                # the last guarded round could not reserve its whole ceiling: this one, alike, is not tried
                # (a composition that fails, the costliest of a round: its mu is the largest); its first
                # step's search reserves as far as fits, the whole round if it does, before step 1 leaves
                opened.guarded = True
            elif not opened.reserve(opened.ceilings[-1], "ceiling"):
                opened.guarded = True
        return opened

    # -------------------------------------------------------------------------- internals
    def _exhausted(self, reason: str, round: int, predicted: float, started: bool = False,
                   delivered: int | None = None) -> BudgetExhausted:
        ledger = self.ledger
        return BudgetExhausted(reason, round=round, epsilon=ledger.epsilon(), predicted_epsilon=predicted,
                               max_epsilon=ledger.max_epsilon, delta=ledger.delta, started=started,
                               delivered=delivered)

    def retry_later(self, entry: int, mu: float, certified: float, method: str, note: str) -> None:
        """Settle ledger entry ``entry`` at ``mu`` when the ledger can next be written (its reservation, at
        least ``mu``, counts meanwhile)."""
        self._unsettled.append((entry, mu, certified, method, note))

    def _retry_unsettled(self) -> None:
        """Settle the charges an earlier write failure left as reservations (they count all the same)."""
        still = []
        for entry, mu, certified, method, note in self._unsettled:
            try:
                self.ledger.settle(entry, mu, method=method, certified_mu=certified, note=note)
            except OSError:
                still.append((entry, mu, certified, method, note))
        self._unsettled = still

    def stop(self, charge: RoundCharge) -> BudgetExhausted:
        """The error that ends training after ``charge`` (its ``stop`` must be set)."""
        return self._exhausted(f"{charge.note}: training stops: {charge.stop}", charge.round, math.nan,
                               started=True, delivered=charge.delivered)


class OpenRound:
    """A round the session opened: its reservation, the steps delivered, and its charge."""

    def __init__(self, session: RoundSession, round: int, ceilings: list[float],
                 certify_through: Certifier | None, note: str) -> None:
        self.session, self.round, self.ceilings = session, round, ceilings
        self.certify_through = certify_through
        self.note = note
        self.steps = len(ceilings)
        self.guarded = False  # the whole round's ceiling did not fit: each step is reserved before delivery
        self._ceilings_failed = False  # a step's ceiling did not fit: the later steps reserve certificates
        self.entry: int | None = None
        self.reserved = 0.0  # the reservation, as charged (rounded up)
        self.delivered = 0  # steps whose delivery was allowed
        self.revealed = RoundCertificate(0.0, ())  # a bound on what the delivered steps reveal
        self.blocked: RoundCertificate | None = None  # the cost that did not fit (a refused round)
        self.released = False
        self.charge: RoundCharge | None = None

    def reserve(self, mu: float, method: str) -> bool:
        """Raise the reservation to cover a cost ``mu`` if it fits (durably; True), or leave it (False).
        ``OSError`` when the ledger cannot be written: nothing may then be released."""
        session, ledger = self.session, self.session.ledger
        charged = session.charged(mu)
        if math.isnan(charged):
            return False
        if self.entry is not None and charged <= self.reserved:
            return True
        try:
            if self.entry is None:
                self.entry = ledger.reserve(charged, session.sample_rate, method=method,
                                            note=f"{self.note}: reserved while it runs")
            else:
                ledger.raise_reservation(self.entry, charged, method=method)
        except BudgetExceededError:
            return False
        self.reserved = charged
        return True

    def _excess(self, mu: float) -> float:
        """Whether a reservation of ``mu`` would fit the budget now (what-if, nothing written), as the sign
        of ``log(epsilon) - log(max_epsilon)``: at most 0 exactly when ``epsilon <= max_epsilon``."""
        ledger, charged = self.session.ledger, self.session.charged(mu)
        if ledger.max_epsilon is None or charged <= self.reserved:
            return -math.inf
        if self.entry is None:
            eps = ledger.epsilon_after(charged, self.session.sample_rate)
        else:
            eps = ledger.epsilon_if(self.entry, charged)
        excess = math.log(max(eps, 1e-300)) - math.log(ledger.max_epsilon)
        return min(excess, 0.0) if eps <= ledger.max_epsilon else max(excess, 5e-324)

    def _furthest_ceiling(self, step: int) -> float | None:
        """The ceiling of the furthest step from ``step`` on whose ceiling fits (None if that of ``step``
        does not): a guarded round then writes one reservation for the steps up to it, not one per step
        (each write composes the ledger, 0.1-0.5 s with Opacus's PRV). Reserving ahead only counts more.
        Searched by :func:`~flwr_inca._search.last_fitting`, a round's first step from as far as the
        session's last guarded round reached (rounds alike reach alike steps: two compositions then find
        it), a later step from its own ceiling (one composition when, as usual, it no longer fits)."""
        ceiling = self.ceilings[step - 1]
        if self.session.charged(ceiling) <= self.reserved:
            return ceiling
        low, high, reach = step - 1, self.steps - 1, self.session.reach
        if step > 1:  # a later step of a round that reserved ahead: its own ceiling usually no longer fits
            start, stride = low, 1
        elif reach is None:  # the session's first guarded round: from the middle, strides of a quarter
            start, stride = (low + high) // 2, max((high - low) // 4, 1)
        else:  # as far as the last guarded round reached
            start, stride = low + reach, 1
        found = last_fitting(lambda i: self._excess(self.ceilings[i]), start, low, high, stride=stride)
        if found is None:
            return None
        if step == 1:
            self.session.reach = found
        return self.ceilings[found]

    def may_deliver(self, step: int) -> bool:
        """Whether step ``step`` (1-based) may be delivered; when it may, what it reveals is reserved first.
        False: it must not be (nothing changed; call :meth:`refuse`)."""
        if self.charge is not None or not 1 <= step <= self.steps:
            raise ValueError(f"round {self.round}: no step {step} to deliver (it has {self.steps})")
        ceiling = self.ceilings[step - 1]
        if not self._ceilings_failed:
            furthest = self._furthest_ceiling(step)
            if furthest is not None and self.reserve(furthest, "ceiling"):
                self.delivered, self.revealed = step, RoundCertificate(ceiling, ("ceiling",))
                return True
            # the ledger only grows during a round and the ceilings do not decrease: no later one fits
            self._ceilings_failed = True
        if self.certify_through is not None:
            cert = self.certify_through(step)
            # with headroom first (the next steps' certificates, a little higher, then need no new write)
            if (self.session.charged(cert.mu) <= self.reserved
                    or (cert.mu * EXACT_HEADROOM <= ceiling and self.reserve(cert.mu * EXACT_HEADROOM, cert.method))
                    or self.reserve(cert.mu, cert.method)):
                self.delivered, self.revealed = step, cert
                return True
            self.blocked = cert
            if step > 1 and self.revealed.methods == ("ceiling",):
                exact = self.certify_through(step - 1)  # what was delivered, exactly, if below its ceiling
                if exact.mu < self.revealed.mu:
                    self.revealed = exact
        else:
            self.blocked = RoundCertificate(ceiling, ("ceiling",))
        return False

    def may_release(self, cost: RoundCertificate) -> bool:
        """Whether the release (IncA: the final messages) may happen; ``cost`` bounds the whole round with
        it (IncA: the certificate with every final revealed). When it may, ``cost`` is reserved first."""
        if self.charge is not None:
            raise ValueError(f"round {self.round} was already charged")
        if self.reserve(cost.mu, cost.method):
            self.released = True
            return True
        self.blocked = cost
        return False

    def settle(self, cost: RoundCertificate, *, note: str = "") -> RoundCharge:
        """The released round's charge: its exact cost ``cost`` (what was revealed, e.g. the finals that
        arrived). Normally within the reservation; never hidden when above it."""
        self.session.refusals = 0
        return self._charge("released", cost, note or self.note)

    def refuse(self, revealed: RoundCertificate | None = None) -> RoundCharge:
        """A round stopped by :meth:`may_deliver` or :meth:`may_release`: charged what its delivered steps
        revealed (``revealed`` if the driver certified it, e.g. IncA without its finals, or the bound the
        session kept, whichever is lower; both bound it), skipped; ``charge.stop`` says whether training
        stops."""
        session = self.session
        cost = self.revealed
        if revealed is not None and revealed.mu < cost.mu:
            cost = revealed
        if self.delivered == self.steps and self.steps:
            where = "before its final release"
        else:
            where = f"by the budget guard before delivering step {self.delivered + 1}"
        charge = self._charge("refused", cost, f"{self.note}: stopped {where}")
        session.refusals += 1
        budget = session.ledger.max_epsilon
        if self.delivered == 0:
            charge.stop = ("nothing of it could be delivered: the budget left does not afford the first step of "
                           "a round")
        elif session.refusals >= session.max_consecutive_refusals:
            charge.stop = (f"{session.refusals} round(s) in a row were refused by the budget "
                           f"(max_consecutive_refusals = {session.max_consecutive_refusals})")
        elif budget is not None and charge.epsilon > budget:  # only a cost above its own reservation
            charge.stop = f"epsilon {charge.epsilon:.4g} exceeds max_epsilon = {budget:.4g}"
        if charge.stop:
            session.stopped_round, session.stop_reason = self.round, charge.stop
        return charge

    def fail(self, why: str) -> RoundCharge:
        """A round that ended in an error: charged its reservation as it stands (a bound on everything it
        revealed; the release, if it happened, included), or, in a guarded round before any release (each of
        its steps was allowed by :meth:`may_deliver`), the bound on what its delivered steps revealed when
        that is lower (a reservation made ahead of them)."""
        self.session.refusals = 0
        cost = RoundCertificate(self.reserved, ("reserved",))
        if (self.guarded and not self.released and self.revealed.methods
                and self.session.charged(self.revealed.mu) < self.reserved):
            cost = self.revealed
        return self._charge("failed", cost, f"{self.note}: {why}")

    # -------------------------------------------------------------------------- internals
    def _charge(self, outcome: str, cost: RoundCertificate, note: str) -> RoundCharge:
        if self.charge is not None:
            raise ValueError(f"round {self.round} was already charged")
        session, ledger = self.session, self.session.ledger
        certified = float(cost.mu) if not math.isnan(cost.mu) else math.inf
        mu = session.charged(certified)
        method = cost.method if cost.methods else "none"
        unsettled = ""
        if self.entry is None:  # nothing was reserved: nothing left the process unless a cost says so
            if mu > 0:
                try:
                    self.entry = ledger.reserve(mu, session.sample_rate, method=method, note=note, force=True)
                    ledger.settle(self.entry, mu, method=method, certified_mu=certified, note=note)
                except OSError as exc:
                    unsettled = _why(exc)
            epsilon = ledger.epsilon()
        else:
            try:
                epsilon = ledger.settle(self.entry, mu, method=method, certified_mu=certified, note=note)
            except OSError as exc:  # the reservation stays, counted at least at the cost
                unsettled = _why(exc)
                if mu <= self.reserved:
                    session.retry_later(self.entry, mu, certified, method, note)
                epsilon = ledger.epsilon()
        self.charge = RoundCharge(self.round, outcome, mu, certified, method, epsilon, self.steps, self.delivered,
                                  self.released, self.entry, note, unsettled=unsettled)
        return self.charge


def _why(exc: OSError) -> str:
    return f"the ledger could not be written ({exc.strerror or exc})"
