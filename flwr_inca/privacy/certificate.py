"""Per-execution privacy certificates (paper Sec. 4.2, Thm 4.1): exact, or a sound bound at scale.

For honest party i, the adversary's view is exactly a Gaussian mechanism whose sensitivity, in units
of the noise, is

    mu_i^2 = min { t^T Sigma_eta^{-1} t : (B, A) t = h_i } = h_i^T Sigma^+ h_i,
    Sigma = sigma_star^2 G_B + sigma_delta^2 G_A,

for a unit change of ``x_i`` (the projected Gaussian mechanism of Koskela & Kulkarni). So party i is
mu_i-GDP and the tight (epsilon, delta) is the analytic Gaussian mechanism's.

To evaluate mu for many (sigma_star, sigma_delta) pairs from one factorization, the pencil
``(G_B, G_A)`` is diagonalized once (:class:`SensitivityProfile`): with ``K = G_A + tau G_B`` and
``F^T K F = I`` on the range of K, ``F^T (tau G_B) F = Q diag(beta) Q^T`` with beta in [0, 1], and

    mu_i^2 = sum_j g_ij^2 / (sigma_star^2 beta_j / tau + sigma_delta^2 (1 - beta_j)),
    g = Q^T F^T h.

Every term is non-increasing in sigma_delta, so the sigma_delta meeting a target is found by bisection,
and the sigma_delta -> infinity limit keeps only the beta_j = 1 directions (the noise-free sums the
adversary learns, e.g. the sum of the finals). Eigenvalues within ``1e-9`` of 0 or 1 are snapped to
it, so that exactly noise-free directions are recognised as such; this moves each variance by at most
1e-9 of the larger sigma^2, i.e. mu by at most about 1e-9 relative.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg as la
from scipy.linalg.blas import dtrsm
from scipy.linalg.lapack import dpocon, dpotrf

from .._checks import check_bytes, check_delta, check_scale, memory_limit
from .._json import jsonable
from ..protocol.trace import ExecutionTrace
from .bound import BoundSettings, SensitivityBound, bound_bytes, bound_profile
from .conversions import epsilon_for_delta
from .linear_system import ObservationModel, build_model, lower_norm1
from .methods import (
    CASCADE_MAX_STEPS,
    CASCADE_MIN_ROWS,
    EXACT_LONG_MAX_ROWS,
    EXACT_LONG_MIN_ITERATIONS,
    EXACT_MAX_PARTIES,
    EXACT_MAX_ROWS,
    SOLVERS,
)
from .views import AdversaryView

__all__ = [
    "CASCADE_MAX_STEPS",
    "CASCADE_MIN_ROWS",
    "EXACT_LONG_MAX_ROWS",
    "EXACT_LONG_MIN_ITERATIONS",
    "EXACT_MAX_PARTIES",
    "EXACT_MAX_ROWS",
    "SOLVERS",
    "Certificate",
    "SensitivityProfile",
    "certify",
    "auto_solver",
    "choose_solver",
    "exact_affordable",
    "neighbors_of",
    "profile",
]

_SNAP = 1e-9
# the exact method refuses views whose dense matrices would not fit: it peaks at about 44 bytes per
# squared observed message (4.2 GB at 9732 messages)
EXACT_HARD_ROWS = 16000
_EXACT_BYTES_PER_ROW2 = 44
# a Certificate's {party: mu} dict: about 100 bytes of Python objects per party, with room
_CERTIFICATE_BYTES_PER_PARTY = 200


@dataclass(frozen=True)
class SensitivityProfile:
    """Spectral form of one view: mu_i(sigma_star, sigma_delta) for all honest i in O(r n_H)."""

    honest: np.ndarray  # (n_H,)
    g2: np.ndarray  # (r, n_H) squared coordinates of each h_i in the joint eigenbasis
    beta: np.ndarray  # (r,) in [0, 1]: share of tau*G_B in each direction
    tau: float
    lost: np.ndarray  # (n_H,) bool: h_i not representable (numerically) -> mu = inf
    method: str = "exact"

    @classmethod
    def from_model(cls, model: ObservationModel) -> SensitivityProfile:
        H, G_B, G_A = model.H, model.G_B, model.G_A
        nH = model.honest.size
        if H.shape[0] == 0:
            return cls(model.honest, np.zeros((0, nH)), np.zeros(0), 1.0, np.zeros(nH, dtype=bool))
        tr_b, tr_a = float(np.trace(G_B)), float(np.trace(G_A))
        tau = tr_a / tr_b if tr_b > 0 and tr_a > 0 else 1.0
        K = G_A + tau * G_B
        # Whiten with K: J = F^T sqrt(tau) H where F^T K F = I on range(K). G_B = H H^T, so
        # F^T tau G_B F = J J^T, whose nonzero eigenvalues are those of the smaller J^T J = V S^2 V^T:
        # beta = S^2 and g_ij = S_j V_ij / sqrt(tau), i.e. g2 = beta V^2 / tau. The eigenvectors V come
        # from J^T J (several times cheaper than an SVD of J); S_j^2 = ||J v_j||^2 is then recomputed
        # from J, so that directions J does not reach get beta ~ 1e-32, not the ~1e-16 of the Gram.
        J, lost = _whiten(K, np.sqrt(tau) * H)
        C = J.T @ J
        _, V = la.eigh((C + C.T) / 2, check_finite=False, driver="evd")
        JV = J @ V
        beta = np.clip(np.einsum("ij,ij->j", JV, JV), 0.0, 1.0)
        g2 = (V * V).T * (beta[:, None] / tau)
        beta[beta < _SNAP] = 0.0
        beta[beta > 1 - _SNAP] = 1.0
        return cls(model.honest, g2, beta, tau, lost)

    def variances(self, sigma_star: float, sigma_delta: float) -> np.ndarray:
        return sigma_star**2 * self.beta / self.tau + sigma_delta**2 * (1.0 - self.beta)

    def mu(self, sigma_star: float, sigma_delta: float) -> np.ndarray:
        """(n_H,) sensitivity of each honest party for a unit change of its value."""
        v = self.variances(sigma_star, sigma_delta)
        return self._mu_from_variances(v)

    def mu_limit(self, sigma_star: float) -> np.ndarray:
        """mu as sigma_delta -> infinity: only the noise-free (beta = 1) directions remain."""
        v = np.where(self.beta == 1.0, sigma_star**2 / self.tau, np.inf)
        return self._mu_from_variances(v)

    def _mu_from_variances(self, v: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            inv = np.where(v > 0, 1.0 / v, np.inf)
            contrib = np.where(self.g2 > 0, self.g2 * inv[:, None], 0.0)
        mu2 = contrib.sum(axis=0)
        mu2[self.lost] = np.inf
        return np.sqrt(mu2)

    def min_sigma_delta(self, sigma_star: float, mu_target: float, rel_tol: float = 1e-6) -> float:
        """Smallest sigma_delta with ``max_i mu_i <= mu_target`` (inf if no sigma_delta suffices)."""
        if not np.all(np.isfinite(self.mu_limit(sigma_star))) or self.mu_limit(sigma_star).max(initial=0) > mu_target:
            return math.inf
        if self.mu(sigma_star, 0.0).max(initial=0) <= mu_target:
            return 0.0
        lo, hi = 0.0, 1.0
        while self.mu(sigma_star, hi).max() > mu_target:
            lo, hi = hi, hi * 4
            if hi > 1e300:
                return math.inf
        while hi - lo > rel_tol * hi:
            mid = (lo + hi) / 2
            if self.mu(sigma_star, mid).max() > mu_target:
                lo = mid
            else:
                hi = mid
        return hi


@dataclass
class Certificate:
    """Per-party guarantee of one execution against one adversary view.

    ``mu[i]`` is the GDP parameter of honest party i for a change of its value of size
    ``value_sensitivity`` (1 for values in [0, 1]; 2C for vectors clipped to L2 norm C under
    replace-one; C under zero-out).
    """

    mu: dict[int, float]
    sigma_star: float
    sigma_delta: float
    value_sensitivity: float
    view: AdversaryView
    delta: float | None = None
    notes: list[str] = field(default_factory=list)
    # "exact" (Thm 4.1 solved exactly), "bound" (a sound upper bound: the global CG bound of every party)
    # or "cascade" (a sound upper bound: local bounds, the global one for the parties near the maximum)
    method: str = "exact"

    @property
    def max_mu(self) -> float:
        return max(self.mu.values()) if self.mu else 0.0

    @property
    def weakest(self) -> list[int]:
        """Honest parties sorted from the least to the most protected."""
        return sorted(self.mu, key=lambda i: -self.mu[i])

    @property
    def epsilon(self) -> float | None:
        """Tight epsilon of the weakest honest party at ``delta`` (None when no delta was given)."""
        return None if self.delta is None else epsilon_for_delta(self.max_mu, self.delta)

    def party_epsilon(self, party: int, delta: float | None = None) -> float:
        d = self.delta if delta is None else delta
        if d is None:
            raise ValueError("give delta to convert mu to epsilon")
        return epsilon_for_delta(self.mu[party], d)

    def to_dict(self) -> dict:
        """JSON-ready record (``flwr_inca._json``: an unbounded mu is written ``"inf"``)."""
        out = {
            "method": self.method,
            "mu": {str(i): v for i, v in sorted(self.mu.items())},
            "max_mu": self.max_mu,
            "sigma_star": self.sigma_star,
            "sigma_delta": self.sigma_delta,
            "value_sensitivity": self.value_sensitivity,
            "threat": self.view.threat,
            "corrupted": [int(c) for c in self.view.corrupted],
        }
        if self.delta is not None:
            out["delta"] = self.delta
            out["epsilon"] = self.epsilon
        return jsonable(out)


def _whiten(K: np.ndarray, X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(F^T X, lost)`` with ``F^T K F = I`` on the range of the PSD matrix K.

    Cholesky when K is well conditioned (the usual case); otherwise an eigendecomposition that drops
    K's null space. ``lost[j]`` flags a column of X with a component outside range(K) (then the
    corresponding h is not a valid mean shift of the view and no guarantee is given).
    """
    lost = np.zeros(X.shape[1], dtype=bool)
    try:
        L = la.cholesky(K, lower=True, check_finite=False)
        rcond = la.lapack.dpocon(L.T, np.abs(K).sum(axis=0).max())[0]
        if rcond > 1e-10:
            return la.solve_triangular(L, X, lower=True, check_finite=False), lost
    except la.LinAlgError:
        pass
    kappa, U = la.eigh(K, check_finite=False)
    keep = kappa > max(kappa.max(), 0.0) * K.shape[0] * np.finfo(float).eps * 16
    U, kappa = U[:, keep], kappa[keep]
    coords = U.T @ X
    resid = np.linalg.norm(X - U @ coords, axis=0)
    lost = resid > 1e-8 * np.maximum(np.linalg.norm(X, axis=0), 1e-300)
    return coords / np.sqrt(kappa)[:, None], lost


def lower_solve(L: np.ndarray, B: np.ndarray) -> np.ndarray:
    """``L^{-1} B`` for lower triangular L (only its lower triangle is read), by BLAS ``dtrsm``
    (``scipy.linalg.solve_triangular`` adds about 10 ms per call on a 2-core machine, which dominates small
    solves). A C-ordered L is passed as its Fortran-ordered transpose, not copied."""
    if B.size == 0:
        return np.zeros(B.shape)
    if L.flags.c_contiguous and not L.flags.f_contiguous:
        # X = L^{-1} B  <=>  X^T L^T = B^T: a right-sided solve with the upper triangular L^T, whose
        # Fortran-ordered storage is L's own; B^T of a C-ordered B is Fortran-ordered too
        return dtrsm(1.0, L.T, np.asarray(B).T, side=1, lower=0).T
    return dtrsm(1.0, L, B, lower=1)


def whiten_lower(lower: np.ndarray, norm1: float, H: np.ndarray, rcond: float = 1e-10, *,
                 overwrite: bool = False, clean: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """``(L, L^{-1} H)`` with ``L L^T = Sigma``, Sigma the symmetric matrix whose lower triangle is
    ``lower``'s ((m, m), C-ordered; its upper triangle is not read), or None when Sigma is not positive
    definite or its reciprocal condition (LAPACK ``dpocon``, from ``norm1 = ||Sigma||_1``) is at most
    ``rcond``.

    ``overwrite``: factorize ``lower`` in place (it then holds L on and below the diagonal) and overwrite
    ``H`` (C-ordered, (m, n_H)) with ``L^{-1} H``; no (m, m) copy is made. ``clean``: zero L's upper
    triangle (else it keeps whatever ``lower`` held there). L is C-ordered, ``L^{-1} H`` too.
    """
    as_c = np.asarray if overwrite else np.array  # np.array copies, np.asarray only where it must
    lower = as_c(lower, dtype=np.float64, order="C")
    H = as_c(H, dtype=np.float64, order="C")
    # LAPACK works on Fortran order: lower.T is the same memory, and its upper triangle is Sigma's lower one;
    # the factor U of U^T U = Sigma it computes there is L^T
    U, info = dpotrf(lower.T, lower=0, clean=int(clean), overwrite_a=1)
    if info != 0:
        return None
    if not dpocon(U, norm1, uplo="U")[0] > rcond:
        return None
    # W = L^{-1} H  <=>  W^T U = H^T: a right-sided solve on the Fortran-ordered H^T, in place
    Wt = dtrsm(1.0, U, H.T, side=1, lower=0, overwrite_b=1)
    return U.T, Wt.T


def whiten_at(model: ObservationModel, sigma_star: float, sigma_delta: float,
              rcond: float = 1e-10) -> tuple[np.ndarray, np.ndarray] | None:
    """``(L, L^{-1} H)`` with ``L L^T = Sigma = sigma_star^2 G_B + sigma_delta^2 G_A`` (Thm 4.1:
    ``mu_i = ||L^{-1} h_i||``), or None when Sigma is singular or its reciprocal condition is at most
    ``rcond`` (the pencil method then handles the null space). L is lower triangular (zeros above)."""
    Sigma = sigma_star**2 * model.G_B
    Sigma += sigma_delta**2 * model.G_A
    return whiten_lower(Sigma, lower_norm1(Sigma), model.H.copy(), rcond, overwrite=True, clean=True)


@dataclass(frozen=True)
class _FixedSigmas:
    """Exact mu of every honest party at one pair of sigmas: ``mu_i = ||C^{-1} h_i||`` with
    ``C C^T = Sigma = sigma_star^2 G_B + sigma_delta^2 G_A`` (Thm 4.1, Sigma invertible).

    What :func:`certify` needs (one pair): about half the work of :class:`SensitivityProfile`, which
    also diagonalizes the pencil to serve every pair."""

    honest: np.ndarray
    mu_at: np.ndarray  # (n_H,)
    sigmas: tuple[float, float]
    method: str = "exact"

    @classmethod
    def from_model(cls, model: ObservationModel, sigma_star: float, sigma_delta: float) -> _FixedSigmas | None:
        """None when Sigma is singular or ill conditioned (reciprocal condition <= 1e-10): the pencil
        method then handles its null space (noise-free sums, mu = inf for unrepresentable h)."""
        if not (sigma_star > 0 and sigma_delta > 0):
            return None
        if model.H.shape[0] == 0:
            return cls(model.honest, np.zeros(model.honest.size), (sigma_star, sigma_delta))
        factor = whiten_at(model, sigma_star, sigma_delta)
        if factor is None:
            return None
        Y = factor[1]
        return cls(model.honest, np.sqrt(np.einsum("ij,ij->j", Y, Y)), (sigma_star, sigma_delta))

    def mu(self, sigma_star: float, sigma_delta: float) -> np.ndarray:
        if (sigma_star, sigma_delta) != self.sigmas:
            raise ValueError("this profile holds mu at one pair of sigmas only")
        return self.mu_at


def _unobserved(view: AdversaryView) -> SensitivityProfile:
    """The exact profile of a view that observes no honest message: the adversary's view does not depend on
    any honest value, so mu = 0 for every honest party (what the exact method gives for m = 0, without its
    (n, n_H) and (n, n) matrices)."""
    nH = view.honest.size
    return SensitivityProfile(view.honest, np.zeros((0, nH)), np.zeros(0), 1.0, np.zeros(nH, dtype=bool))


def _check_types(trace: ExecutionTrace, view: AdversaryView) -> None:
    if not isinstance(trace, ExecutionTrace):
        raise ValueError(f"trace must be an ExecutionTrace, got {type(trace).__name__}")  # noqa: TRY004 - one error type for bad arguments
    if not isinstance(view, AdversaryView):
        raise ValueError(f"view must be an AdversaryView, got {type(view).__name__}")  # noqa: TRY004 - one error type for bad arguments


def _check_view(trace: ExecutionTrace, view: AdversaryView) -> None:
    _check_types(trace, view)
    if view.parties != trace.parties or view.observed.shape[0] != trace.iterations + 1:
        raise ValueError("adversary view does not match the trace (parties or iterations differ)")
    if view.honest.size == 0:
        raise ValueError("the adversary view has no honest party: nothing to certify")


def exact_bytes(parties: int, honest: int, rows: int, iterations: int) -> float:
    """Estimated peak bytes of the exact method on ``parties`` parties of which ``honest`` are honest, with
    ``rows`` observed honest messages over ``iterations`` iterations: the (m, m) Grams, factor and
    whitened targets, the (m, n) and (n, n) covariances of the structured builder, the (n, n_H) recursion
    of B_V and the (T+1, n, T) dropout-adapted schedule (float64)."""
    n, nH, m, T = float(parties), float(honest), float(rows), float(iterations)
    return 8.0 * (3 * m * m + 2 * m * nH + 2 * m * n + 7 * n * n + 2 * n * nH + (T + 1) * n * (T + 2))


def neighbors_of(trace: ExecutionTrace) -> int:
    """The most messages one party sent in one iteration: the topology's k (0 without any message)."""
    return max((int(np.bincount(step.messages.senders).max()) for step in trace.steps
                if step.messages.senders.size), default=0)


def auto_solver(parties: int, iterations: int, neighbors: int, rows: int, exact_fits: bool = True) -> str:
    """The method auto takes for a view of ``rows`` observed honest messages: ``"exact"``, where its
    matrices fit in memory (``exact_fits``), up to :data:`EXACT_MAX_ROWS` (up to :data:`EXACT_LONG_MAX_ROWS`
    with one neighbour and at least :data:`EXACT_LONG_MIN_ITERATIONS` iterations) on at most
    :data:`EXACT_MAX_PARTIES` parties; else the global ``"bound"`` up to :data:`CASCADE_MIN_ROWS` messages,
    or where ``iterations * neighbors`` exceeds :data:`CASCADE_MAX_STEPS` on at most
    :data:`EXACT_MAX_PARTIES` parties; else the ``"cascade"``. In each region, the method measured fastest
    (benchmarks/RESULTS.md, "Which method auto takes")."""
    long_run = neighbors <= 1 and iterations >= EXACT_LONG_MIN_ITERATIONS
    exact_rows = EXACT_LONG_MAX_ROWS if long_run else EXACT_MAX_ROWS
    if exact_fits and parties <= EXACT_MAX_PARTIES and rows <= exact_rows:
        return "exact"
    wide = iterations * neighbors > CASCADE_MAX_STEPS and parties <= EXACT_MAX_PARTIES
    return "bound" if rows <= CASCADE_MIN_ROWS or wide else "cascade"


def exact_affordable(trace: ExecutionTrace, view: AdversaryView) -> bool:
    """Whether auto certifies ``view`` exactly: :func:`auto_solver` says exact for its size, and the exact
    method's matrices fit within :func:`~flwr_inca._checks.memory_limit` (on a smaller machine the sound
    bound instead of a refusal)."""
    return _auto_solver_for(trace, view, int(view.honest_observed().sum())) == "exact"


def _auto_solver_for(trace: ExecutionTrace, view: AdversaryView, rows: int) -> str:
    """:func:`auto_solver` for ``view`` (``rows``: its observed honest messages), against the memory limit."""
    n = trace.parties
    fits = exact_bytes(n, int(view.honest.size), rows, trace.iterations) <= memory_limit()
    return auto_solver(n, trace.iterations, neighbors_of(trace), rows, exact_fits=fits)


def choose_solver(trace: ExecutionTrace, view: AdversaryView, solver: str = "auto", *,
                  bound_settings: BoundSettings | None = None) -> str:
    """``"exact"``, ``"bound"`` or ``"cascade"``: the request, or for ``"auto"`` what :func:`auto_solver`
    says for the view's size and the memory limit. Raises ``ValueError`` naming the
    limit, before anything is allocated, if the chosen method would not fit in memory
    (:func:`~flwr_inca._checks.memory_limit`; the bound's batches are ``bound_settings``'), or if ``"exact"``
    is forced on a view too large for it."""
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    _check_view(trace, view)
    rows = int(view.honest_observed().sum())
    n, nH = trace.parties, int(view.honest.size)
    check_bytes(f"a certificate of {nH} honest parties", _CERTIFICATE_BYTES_PER_PARTY * nH)
    if rows == 0 and solver in ("auto", "exact"):
        return "exact"  # the adversary observes no honest message: mu = 0, nothing to solve (_unobserved)
    if solver == "auto":
        solver = _auto_solver_for(trace, view, rows)
    elif solver == "exact" and rows > EXACT_HARD_ROWS:
        gb = _EXACT_BYTES_PER_ROW2 * rows * rows / 2**30
        raise ValueError(
            f"trace too large for the exact method: {rows} observed honest messages need about {gb:.0f} GiB "
            f"of dense matrices (limit {EXACT_HARD_ROWS} messages); use solver='bound' (or 'auto'), a sound "
            "upper bound"
        )
    if solver == "exact":
        check_bytes(f"the exact certificate of {n} parties with {rows} observed honest messages",
                    exact_bytes(n, nH, rows, trace.iterations),
                    "use solver='bound' (or 'auto'), a sound upper bound")
    else:
        check_bytes(f"the bound on the certificate of {n} parties over {trace.iterations} iterations",
                    bound_bytes(n, trace.iterations, bound_settings))
    return solver


def profile(
    trace: ExecutionTrace,
    view: AdversaryView,
    method: str = "auto",
    *,
    solver: str = "auto",
    sigma_star: float | None = None,
    sigma_delta: float | None = None,
    bound_settings: BoundSettings | None = None,
    charged_mu: float | None = None,
) -> SensitivityProfile | SensitivityBound:
    """mu of every honest party of ``view`` on ``trace`` as a function of the sigmas.

    ``solver="exact"`` gives a :class:`SensitivityProfile` (one factorization, exact for any sigmas);
    ``"bound"`` or ``"cascade"`` a :class:`~flwr_inca.privacy.bound.SensitivityBound` (valid for any
    sigmas, tightest near ``sigma_star``/``sigma_delta``, default the trace's); ``"auto"`` picks by size
    (:func:`choose_solver`). Both have ``mu``, ``mu_limit``, ``min_sigma_delta`` and ``method``.
    ``method`` selects the exact method's linear-system builder (:func:`build_model`). ``charged_mu``: a
    bound need not be tightened below this mu at the nominal sigmas (:func:`bound_profile`; exact ignores it).
    """
    choice = choose_solver(trace, view, solver, bound_settings=bound_settings)
    if choice == "exact" and not view.honest_observed().any():
        return _unobserved(view)
    if choice == "exact":
        return SensitivityProfile.from_model(build_model(trace, view, method))
    return bound_profile(trace, view, sigma_star=sigma_star, sigma_delta=sigma_delta, settings=bound_settings,
                         cascade=choice == "cascade", charged_mu=charged_mu)


def certify(
    trace: ExecutionTrace,
    view: AdversaryView,
    *,
    sigma_star: float | None = None,
    sigma_delta: float | None = None,
    value_sensitivity: float = 1.0,
    delta: float | None = None,
    method: str = "auto",
    solver: str = "auto",
    bound_settings: BoundSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> Certificate:
    """The guarantee of every honest party in the recorded execution ``trace`` against ``view``.

    Args:
        trace: the execution (its sigmas are used unless overridden).
        view: the adversary's observations (``collusion_view``, ``random_collusion``, ...).
        sigma_star, sigma_delta: override the trace's noise levels (what-if analysis).
        value_sensitivity: size of the change of one value the guarantee covers.
        delta: if given, ``Certificate.epsilon`` converts the weakest mu with the analytic Gaussian.
        method: the exact method's linear-system builder, see :func:`build_model`.
        solver: ``"auto"`` (exact when affordable, else a bound), ``"exact"``, ``"bound"`` (the global
            bound of every party) or ``"cascade"`` (local bounds, the global one near the maximum: the
            same maximum, faster at scale); ``Certificate.method`` says which one was used. A bound is
            never below the exact mu.
        bound_settings: work budget of the bound (:class:`~flwr_inca.privacy.bound.BoundSettings`).
        progress: a bound calls it with a short status line after each phase (minutes at n = 100,000);
            the exact method does not.
    """
    _check_types(trace, view)
    s_star = trace.sigma_star if sigma_star is None else sigma_star
    s_delta = trace.sigma_delta if sigma_delta is None else sigma_delta
    s_star = check_scale("sigma_star", s_star)
    s_delta = check_scale("sigma_delta", s_delta)
    value_sensitivity = check_scale("value_sensitivity", value_sensitivity, zero=False)
    if delta is not None:
        delta = check_delta("delta", delta)
    prof: SensitivityProfile | SensitivityBound | _FixedSigmas
    choice = choose_solver(trace, view, solver, bound_settings=bound_settings)
    if choice == "exact" and not view.honest_observed().any():
        prof = _unobserved(view)
    elif choice == "exact":
        model = build_model(trace, view, method)
        # one pair of sigmas is certified: a Cholesky factor of the covariance, no pencil eigenbasis
        prof = _FixedSigmas.from_model(model, s_star, s_delta) or SensitivityProfile.from_model(model)
    else:
        prof = bound_profile(trace, view, sigma_star=s_star, sigma_delta=s_delta, settings=bound_settings,
                             cascade=choice == "cascade", progress=progress)
    mu = prof.mu(s_star, s_delta) * value_sensitivity
    cert = Certificate({int(i): float(m) for i, m in zip(prof.honest, mu)}, s_star, s_delta,
                       float(value_sensitivity), view, delta, method=prof.method)
    if s_star == 0:
        cert.notes.append("sigma_star = 0: the noise-free sums of the output reveal the values (mu = inf)")
    if prof.method in ("bound", "cascade"):
        why = "the execution is too large for the exact method" if solver == "auto" else f"solver={solver!r}"
        cert.notes.append(f"mu is a sound upper bound ({why}): the true guarantee is at least as strong")
    return cert
