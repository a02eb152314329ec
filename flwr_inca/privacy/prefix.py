"""Every prefix of a view from one factorization: what a round costs if it is stopped early.

A view's observed honest messages are the rows of a linear Gaussian system (paper Sec. 4.1, Eq. (10))
with covariance ``Sigma = sigma_star^2 G_B + sigma_delta^2 G_A`` and mean ``H x~`` (see
:mod:`flwr_inca.privacy.linear_system`); at fixed sigmas party i's sensitivity is
``mu_i^2 = h_i^T Sigma^+ h_i`` (Thm 4.1). The rows come ordered by iteration, and a message of
iteration t depends only on what happened up to t (the recursion ``B_t = W^O_t B_{t-1} + D_c^(t)`` and
the dropout-adapted schedule look only back). So the system of the adversary that has observed the
messages up to some iteration is the *leading block* of the full one, and a Cholesky factor is causal:

    Sigma = L L^T  =>  the factor of Sigma's leading block is L's leading block, and with
    W = L^{-1} H,  mu_i^2(prefix) = sum of W[r, i]^2 over the prefix's rows r.

One factorization therefore gives the cost of every prefix view ``V_t`` (the messages of iterations
1..t, i.e. ``y^(0..t-1)``, observed; ``V_T`` is the view without finals, ``V_{T+1}`` the pre-final
view). A view that sees only some finals differs from ``V_{T+1}`` only in its last block: with
``L = [[L_11, 0], [L_21, L_22]]`` the last block's Schur complement is ``S = L_22 L_22^T`` and the
residual of its mean ``R = L_22 W_2``, so for the finals ``F``:

    mu_i^2(V_T + finals F) = mu_i^2(V_T) + R_F,i^T (S_FF)^{-1} R_F,i,

a solve of the size of F only (``S_FF`` is a principal block of a positive definite matrix). When only
a few finals M are lost, it is cheaper still to remove their information from the full view: with
``X = L_22^{-1} E_M`` (E_M: the columns of the identity at M), ``P = X^T X`` (the M block of S^{-1}) and
``Q = X^T W_2`` (the M rows of S^{-1} R),

    mu_i^2(V_T + finals F) = mu_i^2(V_{T+1}) - Q_i^T P^{-1} Q_i,

a solve of the size of M (the block inverse: what observing M adds to F is that Schur complement). It
is used when the subtraction leaves at least 1e-4 of every party's mu^2 (at most four digits cancel);
otherwise the solve of the size of F is.

Where this does not apply, :class:`RoundPrefix` certifies the restricted view separately with
:func:`~flwr_inca.privacy.certificate.certify`: a singular or ill-conditioned ``Sigma`` (then the
pseudo-inverse is needed, e.g. ``sigma_star = 0``), and views too large for the exact method (the
bound solver has no prefix structure).

Rounding: the factorized values agree with :func:`certify` to about 1e-12 relative on well-conditioned
views; what is charged is rounded *up* by :data:`ROUND_UP` (1e-9 relative), so floating point can
never make a charge smaller than the exact cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy.linalg as la

from ..protocol.schedules import InjectionSchedule
from ..protocol.topology import Messages
from ..protocol.trace import ExecutionTrace, TraceStep
from .certificate import certify, exact_affordable, lower_solve, whiten_lower
from .linear_system import observed_covariance
from .rounds import RoundCertificate, certification_views, worst_mu
from .views import AdversaryView, with_finals

__all__ = ["ROUND_UP", "PrefixProfile", "RoundPrefix", "prefix_ceilings", "prefix_view"]

ROUND_UP = 1e-9  # relative: every mu computed here is charged at most this much above its exact value


def prefix_view(view: AdversaryView, through: int) -> AdversaryView:
    """``view`` restricted to the messages of iterations 1..``through`` (``y^(0..through-1)``): what the
    adversary has seen once iteration ``through``'s messages were delivered. ``through = T`` is the view
    without finals; 0 observes nothing (the corrupted parties' own messages are known, not observed)."""
    observed = view.observed.copy()
    observed[max(int(through), 0):, :] = False
    observed[:, view.corrupted] = view.observed[:, view.corrupted]
    return AdversaryView(view.threat, view.corrupted, observed)


@dataclass(frozen=True)
class PrefixProfile:
    """Every prefix cost of one view at fixed sigmas, from one Cholesky factorization.

    Attributes:
        honest: (n_H,) honest parties.
        cumulative: (T+2, n_H) ``mu_i^2`` of ``V_t`` (messages of iterations 1..t observed), t = 0..T+1;
            row T+1 is the whole view (with its finals).
        final_parties: (m_T,) the party of each observed honest final message.
        last_factor: (m_T, m_T) ``L_22``, the Cholesky factor of the finals' Schur complement ``S``.
        last_whitened: (m_T, n_H) ``W_2``, the finals' rows of ``W`` (``R = L_22 W_2``).
        value_sensitivity: the change of a value the mu cover.
    """

    honest: np.ndarray
    cumulative: np.ndarray
    final_parties: np.ndarray
    last_factor: np.ndarray
    last_whitened: np.ndarray
    value_sensitivity: float

    @classmethod
    def build(cls, trace: ExecutionTrace, view: AdversaryView, *, sigma_star: float | None = None,
              sigma_delta: float | None = None, value_sensitivity: float = 1.0) -> PrefixProfile | None:
        """The profile of ``view`` on ``trace``, or None where the prefix structure does not apply (a view
        too large for the exact method, or a singular / ill-conditioned covariance)."""
        if not exact_affordable(trace, view):
            return None
        s_star = trace.sigma_star if sigma_star is None else float(sigma_star)
        s_delta = trace.sigma_delta if sigma_delta is None else float(sigma_delta)
        cov = observed_covariance(trace, view, s_star, s_delta)
        T = trace.iterations
        row_t = cov.rows[:, 1]
        # offsets[t]: rows of iterations < t, i.e. the rows of V_t (rows come ordered by t)
        offsets = np.searchsorted(row_t, np.arange(T + 2), side="left")
        nH, m = cov.honest.size, row_t.size
        if m == 0:
            empty = np.zeros((0, 0))
            return cls(cov.honest, np.zeros((T + 2, nH)), np.zeros(0, np.int64), empty,
                       np.zeros((0, nH)), float(value_sensitivity))
        factor = whiten_lower(cov.lower, cov.norm1, cov.H, overwrite=True)  # in place: no (m, m) copy
        if factor is None:
            return None
        L, W = factor
        # mu^2 of V_t: the squared rows of W up to offsets[t], summed per iteration then accumulated
        blocks = [W[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        per_iteration = np.stack([np.einsum("ij,ij->j", block, block) for block in blocks])
        cumulative = np.zeros((T + 2, nH))
        np.cumsum(per_iteration, axis=0, out=cumulative[1:])
        a = int(offsets[T])
        return cls(cov.honest, cumulative, cov.rows[a:, 0].copy(), np.tril(L[a:, a:]), W[a:].copy(),
                   float(value_sensitivity))

    def mu_through(self, through: int) -> np.ndarray:
        """(n_H,) mu of ``V_through``: the messages of iterations 1..``through`` observed (0..T+1)."""
        return np.sqrt(self.cumulative[int(through)]) * self.value_sensitivity

    def mu_with_finals(self, finals: Iterable[int] | None = None) -> np.ndarray:
        """(n_H,) mu of the view observing every message before the finals and the finals of ``finals``
        (None: all the view observes)."""
        T = self.cumulative.shape[0] - 2
        if finals is None:
            return self.mu_through(T + 1)
        kept = np.isin(self.final_parties, np.asarray(list(finals), dtype=np.int64))
        keep, lost = np.flatnonzero(kept), np.flatnonzero(~kept)
        if lost.size == 0:
            return self.mu_through(T + 1)
        if keep.size == 0:
            return self.mu_through(T)
        before, full = self.cumulative[T], self.cumulative[T + 1]
        if 2 * lost.size <= kept.size:  # remove the lost finals' information from the full view
            E = np.zeros((kept.size, lost.size))
            E[lost, np.arange(lost.size)] = 1.0
            X = lower_solve(self.last_factor, E)
            z = lower_solve(la.cholesky(X.T @ X, lower=True, check_finite=False), X.T @ self.last_whitened)
            removed = np.einsum("ij,ij->j", z, z)
            if np.all(full - removed >= 1e-4 * full):  # at most 4 digits cancel (error ~1e-12 relative)
                return np.sqrt(np.maximum(full - removed, before)) * self.value_sensitivity
        # the finals that arrived, conditioned on everything before them: S_FF = L_F L_F^T, R_F = L_F W_2
        L_F = self.last_factor[keep]
        z = lower_solve(la.cholesky(L_F @ L_F.T, lower=True, check_finite=False), L_F @ self.last_whitened)
        return np.sqrt(before + np.einsum("ij,ij->j", z, z)) * self.value_sensitivity


class RoundPrefix:
    """A round's certification adversaries (:func:`~flwr_inca.privacy.rounds.certification_views`, the
    same draws as :func:`~flwr_inca.privacy.rounds.certify_round`), each factorized once: the round's
    cost with any subset of its finals, and the cost of every prefix of it.

    Views without the prefix structure (see the module docstring) are certified separately, on
    demand, with :func:`~flwr_inca.privacy.certificate.certify`. Every mu returned is the worst over the
    adversaries, rounded up by :data:`ROUND_UP`.
    """

    def __init__(self, trace: ExecutionTrace, seeds: np.random.SeedSequence, draws: int, *,
                 collusion: float = 0.0, observed_fraction: float | None = None,
                 value_sensitivity: float = 1.0) -> None:
        self.trace, self.value_sensitivity = trace, float(value_sensitivity)
        self.views: list[AdversaryView] = list(certification_views(
            trace, seeds, draws, collusion=collusion, observed_fraction=observed_fraction))
        self.profiles: list[PrefixProfile | None] = [
            PrefixProfile.build(trace, v, value_sensitivity=value_sensitivity) for v in self.views]

    @property
    def iterations(self) -> int:
        return self.trace.iterations

    def _each(self, from_profile: Callable[[PrefixProfile], np.ndarray],
              restrict: Callable[[AdversaryView], AdversaryView]) -> RoundCertificate:
        mus, methods = [], []
        for view, prof in zip(self.views, self.profiles):
            if prof is not None:
                mu = from_profile(prof)
                mus.append(float(mu.max(initial=0.0)))
                methods.append("exact")
            else:
                cert = certify(self.trace, restrict(view), value_sensitivity=self.value_sensitivity)
                mus.append(float(cert.max_mu))
                methods.append(cert.method)
        return RoundCertificate(worst_mu(mus) * (1.0 + ROUND_UP), tuple(methods))

    def with_finals(self, finals: Iterable[int] | None = None) -> RoundCertificate:
        """The round's cost observing the finals of ``finals`` (None: every party online at T, the
        pre-final certificate; ``[]``: stopped before its finals, the same as :meth:`through` (T))."""
        chosen = None if finals is None else sorted(int(i) for i in finals)
        return self._each(lambda p: p.mu_with_finals(chosen), lambda v: with_finals(v, self.trace, chosen))

    def through(self, iterations: int) -> RoundCertificate:
        """The cost of what the adversaries observed once the messages of iterations 1..``iterations``
        (0..T) were delivered, without finals."""
        t = int(iterations)
        if not 0 <= t <= self.iterations:
            raise ValueError(f"iterations must be in [0, {self.iterations}], got {iterations!r}")
        return self._each(lambda p: p.mu_through(t), lambda v: prefix_view(v, t))

    def largest_affordable(self, fits: Callable[[float], bool]) -> tuple[int, RoundCertificate]:
        """The most iterations t (0..T) whose messages may be delivered without finals, i.e. whose
        :meth:`through` cost ``fits``, and that cost. The cost is non-decreasing in t (more observed
        messages), so this is a binary search: with every view factorized it costs nothing; otherwise
        about log2(T) certifications. t = 0 costs 0 (nothing observed) and always fits."""
        lo, hi = 0, self.iterations  # through(lo) fits
        best = RoundCertificate(0.0, ())
        if fits((top := self.through(hi)).mu):
            return hi, top
        while hi - lo > 1:
            mid = (lo + hi) // 2
            cert = self.through(mid)
            if fits(cert.mu):
                lo, best = mid, cert
            else:
                hi = mid
        return lo, best


def padded_trace(n: int, steps: Sequence[TraceStep], iterations: int, schedule: InjectionSchedule,
                 sigma_star: float, sigma_delta: float) -> ExecutionTrace:
    """A trace of ``iterations`` steps whose first ``len(steps)`` are ``steps`` and whose others exchange
    nothing (the last online set kept). The messages of iterations 1..len(steps) depend only on those
    steps, so prefix certificates of this trace are those of any execution that continues ``steps``."""
    nothing = Messages(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))
    last = steps[-1].online if steps else np.arange(n, dtype=np.int64)
    padded = list(steps) + [TraceStep(last, nothing) for _ in range(iterations - len(steps))]
    return ExecutionTrace(n, iterations, schedule, float(sigma_star), float(sigma_delta), padded)


def prefix_ceilings(schedule: InjectionSchedule, sigma_star: float, sigma_delta: float,
                    value_sensitivity: float = 1.0) -> np.ndarray:
    """(T+1,) the most ``V_t`` (messages of iterations 1..t observed, no finals) can cost any party on
    any execution, t = 0..T; entry T is :func:`~flwr_inca.privacy.prefinal.no_finals_bound`.

    Observing every message of iterations 1..t is equivalent to observing each party's injections at
    steps 0..t-1, which are at most rows 0..t-1 of the schedule (paper Sec. 3.2, Algorithm 2): the same
    argument as :func:`~flwr_inca.privacy.prefinal.no_finals_bound`, at every t. All T+1 values come
    from one :class:`PrefixProfile` of two parties that exchange nothing (one factorization)."""
    T = schedule.iterations
    trace = padded_trace(2, [], T, schedule, sigma_star, sigma_delta)
    observed = np.ones((T + 1, 2), dtype=bool)
    observed[T] = False
    view = AdversaryView("eavesdrop", np.zeros(0, dtype=np.int64), observed)
    prof = PrefixProfile.build(trace, view, value_sensitivity=value_sensitivity)
    if prof is None:  # e.g. sigma_star = 0: certify each prefix on its own
        return np.array([certify(trace, prefix_view(view, t), value_sensitivity=value_sensitivity).max_mu
                         for t in range(T + 1)]) * (1.0 + ROUND_UP)
    return np.array([prof.mu_through(t).max() for t in range(T + 1)]) * (1.0 + ROUND_UP)
