"""Privacy plan of a training run: from a total (epsilon, delta) over the rounds to a per-round target.

Two protected units:

* ``"record"`` (one training example, DP-SGD-like): each round every client takes one local step of
  ``-lr * sum_i clip(g_i, C) / B`` over a Poisson sample of its examples (rate ``q``). Adding or
  removing one example changes a client's update by at most ``lr * C / B`` (the value sensitivity), so
  with Gaussian noise of std ``sigma`` on the average the round is a Poisson-subsampled Gaussian
  mechanism with noise multiplier ``z = sigma / (lr C / B)``, i.e. ``mu_round = 1 / z`` before
  subsampling. The rounds compose with Opacus's PRV (or RDP) accountant (``"opacus-prv"``,
  ``"opacus-rdp"``); the plan's ``mu_round`` is
  ``1 / z`` for the ``z`` Opacus finds for (epsilon, delta, q, rounds) (Abadi et al. 2016; Gopi et al.
  2021).
* ``"party"`` (a client's whole data): each client's update is clipped to L2 norm ``C``; replacing a
  client's data changes its update by at most ``2 C``. Rounds compose exactly as GDP (the ``"exact"``
  accountant: ``mu_total = sqrt(rounds) mu_round``, Dong et al. 2022).

IncA certifies each round's ``mu`` (in units of the value sensitivity) for the execution that
happened; the ledger then composes the certified values with the same accountant, so the plan is the
target the noise is calibrated for, and the ledger is what is spent.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .._checks import check_delta, check_epsilon, check_int, check_real, check_rounds
from .accountants import ACCOUNTANTS, resolve_accountant_name
from .accountants.base import Memo, rdp_curve, rdp_epsilon
from .accountants.prv import prv_epsilon
from .conversions import epsilon_for_delta, mu_for_epsilon

__all__ = ["PRIVACY_UNITS", "PrivacyPlan", "privacy_plan", "record_sample_rate", "round_mu"]

PRIVACY_UNITS = ("record", "party")
# a record-level client update is at most lr * C * (sampled batch) / B; clip it far above that, so the
# party-level clip is a guard against a broken local step, not part of the record-level analysis
RECORD_PARTY_CLIP_FACTOR = 4


@dataclass(frozen=True)
class PrivacyPlan:
    """What one round may cost, and how much one protected unit can move a client's update.

    Attributes:
        unit: ``"record"`` or ``"party"``.
        epsilon, delta: the total budget over ``rounds`` (epsilon None: no target, noise given
            explicitly; then ``mu_round`` and ``epsilon_round`` are None).
        rounds: rounds the budget is planned for.
        sample_rate: Poisson sampling rate of a record per round (1 for party level).
        mu_round: GDP parameter each round is calibrated for, per unit of value sensitivity.
        epsilon_round: ``mu_round`` as a per-round epsilon at ``delta`` (what ``calibrate`` takes).
        value_sensitivity: L2 change of one client's update when the protected unit changes.
        party_clip: L2 bound applied to each client's whole update.
        accountant: the round accountant that composes the rounds (``"exact"``, ``"opacus-prv"``,
            ``"opacus-rdp"``).
    """

    unit: str
    epsilon: float | None
    delta: float
    rounds: int
    sample_rate: float
    mu_round: float | None
    epsilon_round: float | None
    value_sensitivity: float
    party_clip: float
    accountant: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def record_sample_rate(batch_size: int, local_size: float) -> float:
    """Poisson rate ``q = min(1, B / N_local)`` that gives an expected batch of ``B`` examples."""
    if not (local_size > 0):
        raise ValueError(f"local_size (examples per client) must be > 0, got {local_size!r}")
    return min(1.0, int(batch_size) / float(local_size))


def privacy_plan(
    unit: str,
    *,
    epsilon: float | None,
    delta: float,
    rounds: int,
    clip_norm: float,
    lr: float | None = None,
    batch_size: int | None = None,
    local_size: float | None = None,
    accountant: str | None = None,
) -> PrivacyPlan:
    """The per-round target and sensitivities for a total (epsilon, delta) over ``rounds`` rounds.

    Args:
        unit: ``"record"`` or ``"party"``.
        epsilon: total budget (None: no target; the noise is then chosen by the caller).
        delta: in (0, 1).
        rounds: number of rounds the budget covers.
        clip_norm: record level: per-example gradient clip C; party level: clip of a client's update.
        lr, batch_size, local_size: record level only: learning rate, expected Poisson batch B and
            the number of examples per client (q = B / local_size).
        accountant: record level ``"opacus-prv"`` (default) or ``"opacus-rdp"``; party level
            ``"exact"`` (default), ``"opacus-prv"`` or ``"opacus-rdp"``.
    """
    if unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy_unit must be one of {PRIVACY_UNITS}, got {unit!r}")
    rounds = check_rounds("rounds", rounds)  # the PRV accountant's grid grows with sqrt(rounds)
    delta = check_delta("delta", delta)
    if epsilon is not None:
        epsilon = check_epsilon("epsilon (or None)", epsilon)
    clip_norm = check_real("clip_norm", clip_norm, 0.0, low_open=True)
    if accountant is not None:
        if not isinstance(accountant, str):
            raise ValueError(f"accountant must be one of {list(ACCOUNTANTS)} or None, got {accountant!r}")
        accountant = resolve_accountant_name(accountant)
    if unit == "record":
        lr = check_real("lr (for record-level DP)", lr, 0.0, low_open=True)
        batch_size = check_int("batch_size", batch_size)
        if local_size is None:
            raise ValueError("local_size (examples per client) is needed for record-level DP")
        q = record_sample_rate(batch_size, local_size)
        accountant = accountant or "opacus-prv"
        sensitivity = lr * clip_norm / batch_size
        party_clip = sensitivity * RECORD_PARTY_CLIP_FACTOR * batch_size
    else:
        q = 1.0
        accountant = accountant or "exact"
        sensitivity = 2.0 * clip_norm  # replace-one on the L2 ball of radius C
        party_clip = clip_norm
    if accountant == "exact" and q < 1:
        raise ValueError(
            "accountant: 'exact' cannot account Poisson-subsampled rounds (sample rate "
            f"{q:.4g} < 1); use 'opacus-prv' or 'opacus-rdp'"
        )
    mu_round = epsilon_round = None
    if epsilon is not None:
        mu_round = _mu_round(epsilon, delta, q, rounds, accountant)
        epsilon_round = epsilon_for_delta(mu_round, delta)
    return PrivacyPlan(
        unit,
        epsilon,
        delta,
        rounds,
        q,
        mu_round,
        epsilon_round,
        sensitivity,
        party_clip,
        accountant,
    )


def round_mu(epsilon: float, delta: float, rounds: int, sample_rate: float = 1.0,
             accountant: str = "exact") -> float:
    """The per-round GDP mu (per unit of value sensitivity) whose ``rounds`` rounds at Poisson rate
    ``sample_rate`` compose to (``epsilon``, ``delta``) under ``accountant``: ``mu / sqrt(rounds)`` for the
    exact composition of Gaussian rounds, else ``1 / z`` for the noise multiplier ``z`` Opacus finds."""
    return _mu_round(epsilon, delta, sample_rate, rounds, accountant)


# the noise-multiplier search costs up to seconds and is a pure function of its arguments; an app asks it
# the same question several times (its privacy plan, its strategy's per-round target, a check before Flower
# starts): answered once per process
ROUND_TARGETS = Memo(256)
# Opacus's get_noise_multiplier: the largest noise multiplier it tries before it gives up, and its tolerance
_MAX_NOISE_MULTIPLIER = 1e6
_EPSILON_TOLERANCE = 0.01


def _mu_round(epsilon: float, delta: float, q: float, rounds: int, accountant: str) -> float:
    if accountant == "exact":
        return mu_for_epsilon(epsilon, delta) / math.sqrt(rounds)
    key = (float(epsilon), float(delta), float(q), int(rounds), accountant)
    return ROUND_TARGETS.get(key, lambda: 1.0 / noise_multiplier(*key))


def noise_multiplier(epsilon: float, delta: float, q: float, rounds: int, accountant: str) -> float:
    """The noise multiplier Opacus's ``get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
    sample_rate=q, steps=rounds, accountant=..., epsilon_tolerance=0.01)`` returns, to the bit: its
    doubling from 20, then its bisection, on the epsilons of this package's Opacus accountants (Opacus's
    own, to the bit, from the Renyi orders that can be the minimum: several times faster).

    Raises ``ValueError`` ("The privacy budget is too low.", Opacus's words) when no noise multiplier up to
    10^6 reaches ``epsilon``, and one naming the sample rate when Opacus's PRV accountant cannot compute an
    epsilon: at once where ``q * rounds`` is below ``delta`` (no noise is needed; Opacus's search would bisect
    towards 0 and fail there), else where it fails on the way."""
    from opacus.accountants import RDPAccountant

    orders = tuple(RDPAccountant.DEFAULT_ALPHAS)  # what Opacus's RDPAccountant.get_epsilon uses

    def epsilon_at(sigma: float) -> float:
        if accountant == "opacus-prv":
            return prv_epsilon([(sigma, q, rounds)], delta)
        return rdp_epsilon([(rdp_curve(q, sigma, orders), rounds)], delta)

    where = f"sample rate q = {q:.3g} over {rounds} round(s) at delta = {delta:g}"
    if accountant == "opacus-prv" and q * rounds < delta * (1 - 1e-12):  # below by more than rounding
        # a record is in some round's sample with probability at most q * rounds < delta: (0, delta)-DP without
        # noise; the search drives the noise towards 0, where Opacus's PRV grid is degenerate and it raises a
        # bare "Cannot compute epsilon" (after seconds of bisection)
        raise ValueError(
            f"the opacus-prv accountant cannot calibrate {where}: q x rounds = {q * rounds:.3g} is below delta, so "
            "the budget holds without noise and there is nothing to calibrate; take delta below "
            "1 / (examples per client), or accountant 'opacus-rdp'")
    try:
        return _bisect(epsilon_at, epsilon)
    except RuntimeError as exc:  # Opacus's PRV: "Cannot compute epsilon", naming nothing
        raise ValueError(f"the {accountant} accountant cannot calibrate {where} ({exc}); use accountant "
                         "'opacus-rdp'") from None


def _bisect(epsilon_at: Callable[[float], float], epsilon: float) -> float:
    """Opacus's get_noise_multiplier search: double from 20 until ``epsilon_at`` is at most ``epsilon``,
    then bisect until it is within the tolerance below it; the upper end."""
    with warnings.catch_warnings():  # Opacus's RDP-order notice while it brackets the search
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", RuntimeWarning)  # log(1 - q) at q = 1 is harmless
        low, high, eps_high = 0, 10, math.inf
        while eps_high > epsilon:
            high = 2 * high
            eps_high = epsilon_at(high)
            if high > _MAX_NOISE_MULTIPLIER:
                raise ValueError("The privacy budget is too low.")
        while epsilon - eps_high > _EPSILON_TOLERANCE:
            middle = (low + high) / 2
            eps = epsilon_at(middle)
            if eps < epsilon:
                high, eps_high = middle, eps
            else:
                low = middle
    return high
