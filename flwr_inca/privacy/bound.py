"""Sound upper bounds on every honest party's sensitivity, for executions too large to solve exactly.

mu_i^2 is the squared distance from a unit change of party i's value to the noise changes that leave
the adversary's view unchanged (paper Thm 4.1; Koskela & Kulkarni's projected Gaussian mechanism).
:class:`~flwr_inca.privacy.message_space.MessageSpace` writes every such noise change as a change ``dy``
of the unseen honest messages (Lemma 4.4), so mu_i^2 is the minimum of the least-squares cost

    f_i(dy) = X_i(dy) / sigma_star^2 + E_i(dy) / sigma_delta^2

over all ``dy``, and f_i at ANY ``dy`` is an upper bound. This module minimizes f_i approximately and
evaluates it exactly at the point it stops:

* start: the protocol's own mixing of ``e_i - u`` (``MessageSpace.baseline``): the change of the
  honest values that Thm 4.5 spreads over everybody, made with no noise change, observed messages
  forced to 0 -- it already carries the central-DP floor;
* conjugate gradients on the normal equations, preconditioned by the exact party-level balance of the
  value changes (Woodbury: ``(X^T X + diag(H^T H))^{-1}`` through the party graph ``K = I + X D^{-1}
  X^T``), which converges in a handful of iterations; CG decreases f_i monotonically;
* the parties whose bound is near the largest get more iterations (the largest is what is charged);
* every party's final ``dy`` is evaluated once more with a rigorous rounding margin, and the bound is
  stored as ``(X_i, E_i)``: a valid bound for every pair of sigmas, tightest near the nominal pair.

The charge-aware cascade (``cascade=True``, ``method="cascade"``) first gives every party a cheap local
bound (:mod:`~flwr_inca.privacy.local_bound`), then runs the global solve above only for the parties
whose local bound is above the largest refined one (in descending order), and keeps the smaller bound of
each party: the charged maximum is the global bound's, at a fraction of the global solves at scale.

See docs/privacy.md ("Bound") for the proof of soundness.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import scipy.linalg as la
import scipy.sparse as sp
from threadpoolctl import threadpool_limits

from .._checks import check_int, check_real
from ..protocol.trace import ExecutionTrace
from .local_bound import LocalTier
from .message_space import MessageSpace, pair_weights
from .views import AdversaryView

__all__ = ["BoundSettings", "SensitivityBound", "bound_bytes", "bound_profile"]

_EPS = np.finfo(float).eps / 2  # unit roundoff
# upper ends of BoundSettings' counts: far above the defaults (4 - 60 iterations, batches of 16 - 32, a dense
# party graph up to 3000), far below what would run for days or fill the memory
_MAX_SETTING_ITERATIONS = 100_000
_MAX_BATCH = 4096
_MAX_DENSE_LIMIT = 50_000


@dataclass(frozen=True)
class BoundSettings:
    """Work budget of :func:`bound_profile` (iteration counts, so results are reproducible).

    Attributes:
        iterations: CG iterations every party gets.
        refine_iterations: further iterations, in rounds, for the parties whose bound is within
            ``refine_band`` of the largest, until their bound moves by less than ``tolerance``.
        max_iterations: cap on a party's total iterations.
        batch: parties solved together (memory: about ``12 * batch`` vectors of the unseen messages).
        inner_iterations: iterations of the party-level balance solve inside the preconditioner
            (only when the party graph is too large for a dense factorization). 6: a calibration run at
            n = 10,000 is 8% faster than with 12, with the same sigmas (the flexible outer CG absorbs the
            looser inner solve; at n = 4000 the global bound's maximum moved by 1.5e-4 relative).
        dense_limit: largest number of honest parties for a dense factorization of the party graph.
        blas_threads: BLAS threads while solving (None: leave as configured). The products are thin
            (T+1 rows) and memory-bound; one thread avoids oversubscription next to other work (on
            a 2-core machine two threads were 2x slower when another process was busy).
        global_iterations: cascade only: CG iterations of the shared global ``dy`` of the local tier.
        local_iterations: cascade only: iterations of each party's local search (CGLS, or CG on its
            normal equations when compiled). 40: at calibration's sigma_delta / sigma_star = 10 and
            n = 10,000, 16% fewer parties then need the global solve than with 20 (80: no fewer).
        local_batch: cascade only: local problems solved side by side.
        local_engine: cascade only: ``"auto"`` (the compiled local tier when numba imports, else NumPy),
            ``"compiled"`` or ``"numpy"`` (:class:`~flwr_inca.privacy.local_bound.LocalTier`). Both are
            rigorous; the compiled one is several times faster.
        threads: batches solved side by side (None: every CPU this process may use; never more than
            those CPUs): the global solves' batches, and the compiled local tier's (its kernels release
            the GIL; the NumPy local tier always uses one thread). Each thread keeps ``blas_threads``;
            memory grows with the batches in flight. Results do not depend on timing; the cascade's may differ slightly with the number of
            threads (its global solves take one batch per thread at a time), every one of them sound.
        local_start: cascade only: a party's global solve starts from its own local ``dy`` (kept from the
            local tier) instead of the protocol's mixing: about one CG iteration from it goes as far as
            three from the mixing.
        cascade_tolerance: cascade only: ``tolerance`` of its refinement (which touches only the parties
            near the maximum once the others stopped early, so a tighter one is cheap).
        stop_factor: cascade only: a party's first global solve stops once the search's own estimate of
            its bound is below ``stop_factor`` times the largest refined bound (0: never early). Only the
            charged maximum must be tight; a stopped party is still evaluated rigorously, and one that ends
            up near the maximum is refined like any other.
    """

    iterations: int = 4
    refine_iterations: int = 4
    max_iterations: int = 40
    tolerance: float = 2e-3
    refine_band: float = 0.97
    batch: int = 32
    inner_iterations: int = 6
    dense_limit: int = 3000
    blas_threads: int | None = 1
    global_iterations: int = 60
    local_iterations: int = 40
    local_batch: int = 16
    local_engine: str = "auto"
    threads: int | None = None
    local_start: bool = True
    cascade_tolerance: float = 1e-3
    stop_factor: float = 0.99

    def __post_init__(self) -> None:
        if self.local_engine not in ("auto", "compiled", "numpy"):
            raise ValueError(f"local_engine must be 'auto', 'compiled' or 'numpy', got {self.local_engine!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or isinstance(self.threads, bool)
                                         or self.threads < 1):
            raise ValueError(f"threads must be None or an integer >= 1, got {self.threads!r}")
        # iteration counts: the work is linear in them (a bad count must not run for days); batches: memory
        for name in ("iterations", "refine_iterations", "global_iterations", "local_iterations",
                     "inner_iterations"):
            check_int(f"BoundSettings.{name}", getattr(self, name), 0, _MAX_SETTING_ITERATIONS)
        check_int("BoundSettings.max_iterations", self.max_iterations, 1, _MAX_SETTING_ITERATIONS)
        for name in ("batch", "local_batch"):
            check_int(f"BoundSettings.{name}", getattr(self, name), 1, _MAX_BATCH)
        check_int("BoundSettings.dense_limit", self.dense_limit, 0, _MAX_DENSE_LIMIT)
        if self.blas_threads is not None:
            check_int("BoundSettings.blas_threads", self.blas_threads, 1)
        check_real("BoundSettings.tolerance", self.tolerance, 0.0, 1.0)
        check_real("BoundSettings.cascade_tolerance", self.cascade_tolerance, 0.0, 1.0)
        check_real("BoundSettings.refine_band", self.refine_band, 0.0, 1.0)
        check_real("BoundSettings.stop_factor", self.stop_factor, 0.0, 1.0)


@dataclass(frozen=True)
class SensitivityBound:
    """Upper bounds ``mu_i(sigma_star, sigma_delta) = sqrt(X_i / sigma_star^2 + E_i / sigma_delta^2)``.

    Same interface as :class:`~flwr_inca.privacy.certificate.SensitivityProfile` (``mu``, ``mu_limit``,
    ``min_sigma_delta``), for the same honest parties; every value is >= the exact one.
    """

    honest: np.ndarray  # (n_H,)
    X: np.ndarray  # (n_H,) bound on the squared value change left to party i's own noise, over sigma*^2
    E: np.ndarray  # (n_H,) bound on the squared cancelling-noise change, over sigma_delta^2
    nominal: tuple[float, float]
    iterations: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    method: str = "bound"

    def mu(self, sigma_star: float, sigma_delta: float) -> np.ndarray:
        # (1 + 8u) covers the rounding of these few operations (X and E are already rounded up)
        return np.sqrt(_ratio(self.X, sigma_star) + _ratio(self.E, sigma_delta)) * (1 + 8 * _EPS)

    def mu_limit(self, sigma_star: float) -> np.ndarray:
        """The bound as sigma_delta -> infinity."""
        return np.sqrt(_ratio(self.X, sigma_star)) * (1 + 8 * _EPS)

    def min_sigma_delta(self, sigma_star: float, mu_target: float, rel_tol: float = 1e-6) -> float:
        """Smallest sigma_delta with every bound ``<= mu_target`` (inf if none; closed form)."""
        room = (mu_target / (1 + 8 * _EPS)) ** 2 - _ratio(self.X, sigma_star)
        if np.any(room < 0) or np.any(~np.isfinite(room)):
            return math.inf
        need = np.where(self.E > 0, np.sqrt(np.divide(self.E, room, out=np.full_like(room, np.inf),
                                                       where=room > 0)), 0.0)
        s = float(need.max(initial=0.0))
        return s * (1 + rel_tol) if math.isfinite(s) else math.inf


def _ratio(v: np.ndarray, sigma: float) -> np.ndarray:
    if sigma > 0:
        return v / sigma**2
    return np.where(v > 0, np.inf, 0.0)


class _Operator:
    """Whitened ``L = W P Dz`` of one MessageSpace at nominal sigmas, and its preconditioner.

    Iterates are float32: the solver only has to find a good ``dy``; its cost is evaluated afterwards
    in float64 with a rigorous margin (:func:`_evaluate`), so the precision of the search does not
    matter for soundness.
    """

    dtype = np.float32

    def __init__(self, ms: MessageSpace, s_star: float, s_delta: float, settings: BoundSettings) -> None:
        self.ms = ms
        f = self.dtype
        self.w = np.where(ms.row_t == 0, 1.0 / s_star, 1.0 / s_delta)[:, None].astype(f)
        Gh = [g.P[1:].T @ g.P[1:] / s_delta**2 for g in ms.groups]
        Dh = pair_weights(ms, Gh)
        Dh = np.maximum(Dh, 1e-12 * max(float(Dh.max(initial=0.0)), 1e-300))
        coo = ms.Dz.tocoo()
        party = ms.row_q[coo.row]
        p0 = np.stack([g.P[0] for g in ms.groups])[ms.group_of[party], ms.row_t[coo.row]]
        X = sp.csr_matrix((coo.data * p0 / s_star, (party, coo.col)), shape=(ms.nH, ms.U))
        K = (sp.identity(ms.nH, format="csr") + X @ sp.diags(1.0 / Dh) @ X.T).tocsr()
        self.invDh = (1.0 / Dh).astype(f)[:, None]
        self.X = X.astype(f)
        self.XT = X.T.tocsr().astype(f)
        self.inner = settings.inner_iterations
        self.chol = None
        if ms.nH <= settings.dense_limit:
            self.chol = la.cho_factor(K.toarray(), lower=True, check_finite=False)
        else:
            self.K = K.astype(f)
            self.Kdiag = K.diagonal().astype(f)[:, None]
            z = np.ones(ms.nH) / math.sqrt(ms.nH)
            self.z = z.astype(f)
            self.zKz = float(z @ (K @ z))

    def L(self, dy: np.ndarray) -> np.ndarray:
        return self.w * self.ms.apply_P(self.ms.dz(dy))

    def LT(self, r: np.ndarray) -> np.ndarray:
        return self.ms.dz_t(self.ms.apply_P(self.w * r, transpose=True))

    def _solve_K(self, v: np.ndarray) -> np.ndarray:
        if self.chol is not None:
            return la.cho_solve(self.chol, v.astype(float), check_finite=False).astype(self.dtype)
        # Jacobi CG from the coarse (constant-vector) solution; any fixed effort is fine: the outer
        # iteration is flexible and only its speed depends on this solve.
        x = np.outer(self.z, (self.z @ v) / self.zKz).astype(self.dtype)
        r = v - self.K @ x
        z = r / self.Kdiag
        p = z.copy()
        rz = np.sum(r * z, axis=0)
        for _ in range(self.inner):
            Kp = self.K @ p
            a = rz / np.maximum(np.sum(p * Kp, axis=0), 1e-30)
            x += a * p
            r -= a * Kp
            z = r / self.Kdiag
            rz_new = np.sum(r * z, axis=0)
            p = z + (rz_new / np.maximum(rz, 1e-30)) * p
            rz = rz_new
        return x

    def precondition(self, r: np.ndarray) -> np.ndarray:
        y = r * self.invDh
        return y - (self.XT @ self._solve_K(self.X @ y)) * self.invDh


def _cg(op: _Operator, b: np.ndarray, x: np.ndarray, iterations: int,
        stop_below: np.ndarray | None = None) -> np.ndarray:
    """Flexible preconditioned CG on ``L^T L x = L^T b`` for a batch; returns the new x.

    A column stops (keeps its last iterate) once its residual is negligible or anything stops being
    finite, so no NaN or overflow ever reaches the evaluation; with ``stop_below`` (one value per column)
    also once the search's float32 estimate of its cost ``||b - L x||^2`` is below that value (the charge-
    aware early stop: the cost is evaluated rigorously afterwards, so the estimate only decides effort).
    The columns still running are compacted once at most half of them are left (columns never interact).
    """
    if iterations <= 0:
        return x
    out = x.astype(op.dtype)  # a copy: the caller's x is never modified
    cols = np.arange(out.shape[1])
    s = b.astype(op.dtype) - op.L(out)  # the residual b - L x, kept up to date for the early stop
    if stop_below is not None:
        running = np.sum(s * s, axis=0, dtype=np.float64) > stop_below
        if not running.any():
            return out
        if not running.all():
            cols = np.flatnonzero(running)
            s, stop_below = s[:, cols], stop_below[cols]
    x = out if cols.size == out.shape[1] else out[:, cols]
    r = op.LT(s)
    if stop_below is None:
        del s
    z = op.precondition(r)
    p = z.copy()
    rz = np.sum(r * z, axis=0, dtype=np.float64)
    stop = rz * 1e-12
    active = np.isfinite(rz) & (rz > 0)
    for it in range(iterations):
        if not active.any():
            break
        if 2 * active.sum() <= active.size:  # compact: drop the columns that stopped
            if x is not out:
                out[:, cols] = x
            keep = np.flatnonzero(active)
            cols, x, r, z, p = cols[keep], x[:, keep], r[:, keep], z[:, keep], p[:, keep]
            rz, stop, active = rz[keep], stop[keep], active[keep]
            if stop_below is not None:
                s, stop_below = s[:, keep], stop_below[keep]
        Lp = op.L(p)
        Ap = op.LT(Lp)
        pAp = np.sum(p * Ap, axis=0, dtype=np.float64)
        ok = active & np.isfinite(pAp) & (pAp > 0)
        a = np.where(ok, rz / np.where(ok, pAp, 1.0), 0.0).astype(op.dtype)
        x_new = x + a * p
        finite = np.all(np.isfinite(x_new), axis=0)
        if not finite.all():  # those columns keep their last iterate
            x_new[:, ~finite] = x[:, ~finite]
            ok &= finite
            a = np.where(ok, a, 0.0).astype(op.dtype)
        x = x_new
        r -= a * Ap
        if stop_below is not None:
            s -= a * Lp
            ok &= np.sum(s * s, axis=0, dtype=np.float64) > stop_below
        del Lp, Ap
        if it == iterations - 1 or not ok.any():
            break  # the next direction would not be used
        z_new = op.precondition(r)
        rz_new = np.sum(r * z_new, axis=0, dtype=np.float64)
        beta = np.sum(r * (z_new - z), axis=0, dtype=np.float64) / np.where(rz > 0, rz, 1.0)
        beta = np.where(ok & np.isfinite(beta), np.maximum(beta, 0.0), 0.0).astype(op.dtype)
        p = z_new + beta * p
        z = z_new
        rz = rz_new
        active = ok & np.isfinite(rz) & (rz > stop)
    if x is not out:
        out[:, cols] = x
    return out


_EVAL_CHUNK = 16  # columns evaluated together: (R, 16) float64 arrays stay near the cache (2-3x faster than 64)


def _evaluate(ms: MessageSpace, dy: np.ndarray, parties: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rigorous ``(X, E)`` upper bounds of the cost of ``dy`` for each column (see docs/privacy.md).

    The computed residual differs from the exact one by the rounding of two short sums (at most
    ``N = T + 1 + max row length of Dz + 4`` terms each), so each component is enlarged by
    ``gamma_N * (|P| (|Dz| |dy| + |t|))``; the error of the computed right inverses P (their defect)
    is added in norm; the final sums of squares get a relative ``(1 + 4 N' u)``. Columns are
    independent; they are evaluated ``_EVAL_CHUNK`` at a time.
    """
    parties = np.asarray(parties)
    if dy.shape[1] <= _EVAL_CHUNK:
        return _evaluate_chunk(ms, dy, parties)
    out = [_evaluate_chunk(ms, dy[:, k: k + _EVAL_CHUNK], parties[k: k + _EVAL_CHUNK])
           for k in range(0, dy.shape[1], _EVAL_CHUNK)]
    return np.concatenate([o[0] for o in out]), np.concatenate([o[1] for o in out])


def _evaluate_chunk(ms: MessageSpace, dy: np.ndarray, parties: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    dy = np.asarray(dy, dtype=float)
    bad = ~np.all(np.isfinite(dy), axis=0)
    if bad.any():  # never happens in practice; dy = 0 (no noise change) is always admissible
        dy = np.where(bad[None, :], 0.0, dy)
    t = ms.target(parties)
    dz = ms.dz(dy)
    dz -= t
    res = ms.apply_P(dz)
    absdz = ms.absDz @ np.abs(dy)
    absdz += np.abs(t)
    absres = ms.apply_P(absdz, absolute=True)
    defect = np.array([g.defect for g in ms.groups])[ms.group_of]  # (nH,)
    row_len = int(np.diff(ms.Dz.indptr).max(initial=0))
    N = ms.T + 1 + row_len + 4
    gamma = N * _EPS / (1 - N * _EPS)
    up2 = np.abs(res, out=res)  # in place: |res| + gamma |P| (|Dz| |dy| + |t|), then squared
    absres *= gamma
    up2 += absres
    up2 *= up2
    dz *= dz
    # rows are group-major, then step, then party (MessageSpace): each group's block is (T+1, size, B),
    # its step-0 rows are the value parts X, the others the noise parts E
    B = dy.shape[1]
    per_party = np.zeros((ms.nH, B))
    sx, se = np.zeros(B), np.zeros(B)
    for k, g in enumerate(ms.groups):
        a, b = ms.offsets[k], ms.offsets[k + 1]
        size = g.stop - g.start
        blk = up2[a:b].reshape(ms.T + 1, size, B)
        sx += blk[0].sum(axis=0)
        se += blk[1:].sum(axis=(0, 1))
        per_party[g.start:g.stop] = dz[a:b].reshape(ms.T + 1, size, B).sum(axis=0)
    extra = np.sqrt(np.sum(defect[:, None] ** 2 * per_party, axis=0))  # (B,)
    rel = 1 + 4 * ms.R * _EPS
    X = (np.sqrt(sx) + extra) ** 2 * rel
    E = (np.sqrt(se) + extra) ** 2 * rel
    # a party whose rows are pinned (rank-deficient adapted schedule) keeps u = 0, so its own unit
    # change stays unexplained: residual -e, cost 1 / sigma_star^2 (local DP)
    own_blocked = ms.blocked[np.asarray(parties)]
    X = np.where(own_blocked, np.maximum(X, 1.0) * rel, X)
    return X, E


def bound_profile(
    trace: ExecutionTrace,
    view: AdversaryView,
    *,
    sigma_star: float | None = None,
    sigma_delta: float | None = None,
    settings: BoundSettings | None = None,
    progress: Callable[[str], None] | None = None,
    cascade: bool = False,
    charged_mu: float | None = None,
) -> SensitivityBound:
    """Upper bounds on every honest party's mu (see the module docstring).

    Args:
        trace, view: the execution and the adversary's observations.
        sigma_star, sigma_delta: nominal sigmas (default: the trace's) -- the bound is valid for all,
            tightest near these.
        settings: the work budget (:class:`BoundSettings`).
        progress: called with a short status line after each phase.
        cascade: the charge-aware cascade (``method="cascade"``): a cheap local bound for every party
            (:mod:`~flwr_inca.privacy.local_bound`), the global one only for the parties whose local
            bound is above the largest refined bound; the maximum is as tight as the global bound's.
        charged_mu: a mu (at the nominal sigmas) that the caller charges whatever this execution gives,
            e.g. calibration's running maximum over the runs already bounded: no effort is spent below
            it. The cascade solves globally only the parties whose local bound is above it, stops their
            first solve once below it, and refines only above it. Every bound stays sound; the ones at
            most ``charged_mu`` may be looser than without it, the maximum is as tight when it is above.
    """
    st = settings or BoundSettings()
    if charged_mu is not None:  # inf: no global solve at all (every bound still sound)
        charged_mu = check_real("charged_mu", charged_mu, 0.0, finite=False)
    s_star = trace.sigma_star if sigma_star is None else float(sigma_star)
    s_delta = trace.sigma_delta if sigma_delta is None else float(sigma_delta)
    if not (s_star > 0 and s_delta > 0 and math.isfinite(s_star) and math.isfinite(s_delta)):
        # the map is sigma-free; only the optimization needs a finite positive nominal pair
        s_star, s_delta = 1.0, 1.0
    ms = MessageSpace(trace, view, s_star, s_delta)
    nH = ms.nH
    X = np.zeros(nH)
    E = np.zeros(nH)
    its = np.zeros(nH, dtype=np.int64)
    method = "cascade" if cascade else "bound"
    if nH == 0:
        return SensitivityBound(ms.honest, X, E, (s_star, s_delta), its, method)
    if ms.U == 0:  # nothing unseen: the view is the whole input (local DP)
        X, E = _evaluate(ms, np.zeros((0, nH)), np.arange(nH))
        return SensitivityBound(ms.honest, X[ms.natural], E[ms.natural], (s_star, s_delta), its, method)
    limits = threadpool_limits(st.blas_threads, user_api="blas") if st.blas_threads else nullcontext()
    with limits:
        return _solve(ms, st, s_star, s_delta, progress, cascade, charged_mu)


def _solve(ms: MessageSpace, st: BoundSettings, s_star: float, s_delta: float,
           progress: Callable[[str], None] | None, cascade: bool = False,
           charged_mu: float | None = None) -> SensitivityBound:
    """The global bound for every party, or (``cascade``) the local bound for every party and the global
    one only for the parties whose local bound is above the charged maximum (see the module docstring)."""
    threads = _threads(st)
    with ThreadPoolExecutor(threads) if threads > 1 else nullcontext() as pool:
        return _solve_in(ms, st, s_star, s_delta, progress, cascade, pool, threads, charged_mu)


def _solve_in(ms: MessageSpace, st: BoundSettings, s_star: float, s_delta: float,
              progress: Callable[[str], None] | None, cascade: bool, pool: ThreadPoolExecutor | None,
              threads: int, charged_mu: float | None = None) -> SensitivityBound:
    solver = _BoundSolver(ms, st, s_star, s_delta, progress, cascade, pool, charged_mu)
    everyone = np.arange(ms.nH)
    if not cascade:
        solver.run(everyone, st.iterations)
        if progress:
            progress(f"bound: {ms.nH} parties x {st.iterations} iterations; max mu "
                     f"{math.sqrt(solver.current().max()):.5g}")
    else:
        solver.cascade(threads)
    solver.refine(refined_only=False)
    return solver.result()


class _BoundSolver:
    """The state of one bound: each honest party's global bound ``(X, E)`` (inf: not computed), its local
    bound ``(Xc, Ec)`` (the cascade's; inf: none), the search iterations spent on it, and the iterates kept
    to continue from. Its steps: :meth:`run` (global solves of some parties), :meth:`cascade` (local bounds
    of everyone, then global solves down from the largest), :meth:`refine` (more iterations near the top)."""

    def __init__(self, ms: MessageSpace, st: BoundSettings, s_star: float, s_delta: float,
                 progress: Callable[[str], None] | None, cascade: bool, pool: ThreadPoolExecutor | None,
                 charged_mu: float | None) -> None:
        nH = ms.nH
        self.ms, self.st, self.s_star, self.s_delta = ms, st, s_star, s_delta
        self.progress, self.is_cascade, self.pool = progress, cascade, pool
        # mu^2 charged anyway (0: none): no party is tightened below it
        self.charged = 0.0 if charged_mu is None else float(charged_mu) ** 2
        self.X, self.E = np.full(nH, np.inf), np.full(nH, np.inf)
        self.Xc, self.Ec = np.full(nH, np.inf), np.full(nH, np.inf)
        self.its = np.zeros(nH, dtype=np.int64)
        self.op = _Operator(ms, s_star, s_delta, st)
        self.states: dict[int, np.ndarray] = {}
        # iterates kept for refinement: about 1 GB of float32 (at least 256 parties, at most 2048)
        self.keep = int(np.clip(2.5e8 / max(ms.U, 1), max(4 * st.batch, 256), 2048))
        self.local_dy: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}  # cascade: (support, u, a) per party
        self.tier: LocalTier | None = None
        self.change = np.full(nH, np.inf)  # relative decrease of each party's bound at its last refinement
        self.tolerance = st.cascade_tolerance if cascade else st.tolerance

    def current(self) -> np.ndarray:
        """The best bound of each party at the nominal sigmas."""
        s2, d2 = self.s_star**2, self.s_delta**2
        return np.minimum(self.X / s2 + self.E / d2, self.Xc / s2 + self.Ec / d2)

    def _start(self, part: np.ndarray) -> np.ndarray:
        if self.tier is not None and self.st.local_start:
            return _local_start(self.tier.G, self.local_dy, part)
        return _warm_start(self.ms, part)

    def _batches(self, parties: np.ndarray) -> list[np.ndarray]:
        """Batches that either continue from kept iterates or restart (from the warm start, ordered by the
        iterations already done), never a mix: a mixed batch would redo the continuing ones."""
        kept = np.array([int(p) in self.states for p in parties], dtype=bool)
        fresh = parties[~kept]
        parties = np.concatenate([parties[kept], fresh[np.argsort(self.its[fresh], kind="stable")]])
        n_kept, batch = int(kept.sum()), self.st.batch
        cuts = sorted({*range(0, n_kept, batch), *range(n_kept, parties.size, batch)})
        return [parties[k: stop] for k, stop in zip(cuts, [*cuts[1:], parties.size])]

    def run(self, parties: np.ndarray, iterations: int, early: bool = False) -> None:
        """``iterations`` more search iterations for ``parties``, in batches on the pool."""
        # the charge-aware early stop: a party's first global solve ends once its estimated bound is
        # below stop_factor x the largest refined bound (parties already refined get every iteration)
        aim = max(float(self.current()[self.its > 0].max(initial=0.0)), self.charged)
        stop_at = self.st.stop_factor**2 * aim if early and aim > 0 else None

        def prepare(part: np.ndarray) -> tuple:  # in this thread: which kept iterates a batch starts from
            if all(int(p) in self.states for p in part):
                return part, [self.states[int(p)] for p in part], iterations
            return part, None, int(self.its[part].max()) + iterations

        def solve(job: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
            part, kept_x, todo = job
            x0 = np.column_stack(kept_x) if kept_x is not None else self._start(part)
            b = self.op.w * self.ms.apply_P(self.ms.target(part))
            below = None if stop_at is None else np.where(self.its[part] == 0, stop_at, -np.inf)
            x = _cg(self.op, b, x0, todo, below)
            Xb, Eb = _evaluate(self.ms, x, part)
            return part, x, Xb, Eb

        # every batch prepared here first, then solved on the threads as they free up, the results taken
        # in order: the same for any timing (a batch continuing from kept iterates holds them until solved)
        prepared = [prepare(part) for part in self._batches(parties)]
        pool = self.pool
        results = pool.map(solve, prepared) if pool is not None and len(prepared) > 1 else map(solve, prepared)
        for part, x, Xb, Eb in results:
            self.X[part], self.E[part] = Xb, Eb
            self.its[part] = np.maximum(self.its[part], 0) + iterations
            for j, p in enumerate(part):
                self.states[int(p)] = x[:, j]
            if len(self.states) > self.keep:  # keep the iterates of the parties with the largest bounds
                f = self.current()
                for p in sorted(self.states, key=lambda q: f[q])[: len(self.states) - self.keep]:
                    del self.states[p]

    def refine(self, refined_only: bool) -> None:
        """More iterations for the parties within refine_band of the largest bound, until they settle."""
        st, its = self.st, self.its
        while True:
            f = self.current()
            refined = its > 0
            top = f[refined].max(initial=0.0) if refined_only else f.max()
            band = ((f >= st.refine_band**2 * top) & (f > self.charged) & (its < st.max_iterations)
                    & (self.change > self.tolerance))
            if self.is_cascade:  # refine the parties near the top; a local-only party only once it is above them
                band &= refined if refined_only else refined | (f > f[refined].max(initial=0.0))
            pick = np.flatnonzero(band)
            if pick.size == 0:
                break
            before = f[pick].copy()
            self.run(pick, st.refine_iterations)
            after = self.current()[pick]
            self.change[pick] = (before - after) / np.maximum(before, 1e-300) / 2  # of mu, not mu^2
            if self.progress:
                refined_top = float(self.current()[its > 0].max(initial=0.0))  # the local-only parties aside
                self.progress(f"bound: refined {pick.size} part{'y' if pick.size == 1 else 'ies'}; largest "
                              f"refined mu {math.sqrt(refined_top):.5g}")

    def cascade(self, threads: int) -> None:
        """Local bounds for every party, then global solves in descending order of the local bound, until
        the next local bound is at most the largest refined one: every party left then has min(local,
        global) below the charged maximum."""
        self._local_bounds()
        st, nH, progress = self.st, self.ms.nH, self.progress
        # the first chunk is refined at once, so that the early stop of the others aims at (nearly) the
        # final maximum, not at a first, higher estimate of it
        fc = self.Xc / self.s_star**2 + self.Ec / self.s_delta**2
        order = np.argsort(-fc, kind="stable")
        top, pos = (self.charged if self.charged > 0 else -np.inf), 0
        while pos < nH:
            # the first batch alone (it sets the maximum the others stop early at), then one per thread
            width = st.batch if pos == 0 else st.batch * threads
            chunk = order[pos: pos + width]
            chunk = chunk[fc[chunk] > top]
            if chunk.size == 0:
                break
            self.run(chunk, st.iterations, early=st.stop_factor > 0)
            if pos == 0:
                self.refine(refined_only=True)
                if progress:
                    progress(f"cascade: the {chunk.size} largest local bounds refined globally; their max mu "
                             f"{math.sqrt(float(self.current()[self.its > 0].max())):.5g}")
            top = max(top, float(self.current()[self.its > 0].max()))
            pos += width
        if progress:
            progress(f"cascade: local bound for {nH} parties, global bound for {int((self.its > 0).sum())}; "
                     f"max mu {math.sqrt(self.current().max()):.5g}")

    def _local_bounds(self) -> None:
        ms, st, progress, nH = self.ms, self.st, self.progress, self.ms.nH
        self.tier = tier = _local_tier(ms, self.op, st, self.s_star, self.s_delta)
        step = max(st.local_batch, 1)
        parts = [np.arange(nH)[k: k + step] for k in range(0, nH, step)]
        # the compiled kernels release the GIL: batches run side by side, results come back in order
        side_by_side = self.pool is not None and tier.engine == "compiled"
        results = self.pool.map(tier.bounds_and_dy, parts) if side_by_side else map(tier.bounds_and_dy, parts)
        for index, (part, (Xb, Eb, dys)) in enumerate(zip(parts, results)):
            self.Xc[part], self.Ec[part] = Xb, Eb
            if st.local_start:
                self.local_dy.update(zip(part.tolist(), dys))
            if progress and (index + 1) % max(1000 // step, 1) == 0:
                progress(f"cascade: local bounds of {part[-1] + 1} / {nH} parties")
        if progress:
            progress(f"cascade: local bounds done; max local mu {math.sqrt(float(self.current().max())):.5g}")

    def result(self) -> SensitivityBound:
        """Each party keeps the smaller of its two bounds at the nominal sigmas (both are sound for all)."""
        s2, d2 = self.s_star**2, self.s_delta**2
        use_local = self.Xc / s2 + self.Ec / d2 < self.X / s2 + self.E / d2
        Xo, Eo = np.where(use_local, self.Xc, self.X), np.where(use_local, self.Ec, self.E)
        k = self.ms.natural
        return SensitivityBound(self.ms.honest, Xo[k], Eo[k], (self.s_star, self.s_delta), self.its[k],
                                method="cascade" if self.is_cascade else "bound")


def bound_bytes(parties: int, iterations: int, settings: BoundSettings | None = None) -> float:
    """The bytes the bound needs at least on ``parties`` parties over ``iterations`` iterations: the (T+1, n,
    T) dropout-adapted schedule and one batch of ``12 * batch`` vectors of the (at most (T+1) n) unseen
    messages (float64). Measured peaks are 1.2 - 3x this (more batches in flight with more threads: 8.2 GB
    at n = 100,000, T = 20 against 6.8 GB here), so a size refused for it would certainly not fit."""
    st = settings or BoundSettings()
    n, T = float(parties), float(iterations)
    return 8.0 * n * (T + 1) * (T + 2 + 12 * st.batch)


def _threads(st: BoundSettings) -> int:
    """``st.threads``, at most the CPUs this process may use (more threads would only hold more batches in
    memory: about ``12 * batch`` vectors of the unseen messages each); None: all of them."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    cpus = max(cpus, 1)
    return cpus if st.threads is None else min(st.threads, cpus)


def _local_tier(ms: MessageSpace, op: _Operator, st: BoundSettings, s_star: float, s_delta: float) -> LocalTier:
    """The cascade's cheap tier, with its shared global ``dy``: CG on the mean right-hand side."""
    t_sum = np.zeros((ms.R, 1))  # the sum of every party's target, without R x n_H floats
    slots = np.arange(ms.nH)
    rows = ms.rowid(np.arange(ms.T + 1)[:, None], slots[None, :])
    hon = ms.parties[slots]
    t_sum[rows.ravel(), 0] = np.where(ms.online[:, hon], ms.c_o[:, hon], 0.0).ravel()
    b = op.w * ms.apply_P(t_sum) / ms.nH
    G = _cg(op, b, np.zeros((ms.U, 1)), st.global_iterations).astype(float)[:, 0]
    return LocalTier(ms, G, s_star, s_delta, st.local_iterations, engine=st.local_engine)


def _local_start(G: np.ndarray, local_dy: dict[int, tuple[np.ndarray, np.ndarray, float]],
                 parties: np.ndarray) -> np.ndarray:
    """Each party's own local ``dy = a G + u`` (kept from the local tier), as float32 columns."""
    dys = [local_dy[int(q)] for q in parties]
    x0 = np.outer(G.astype(np.float32), np.array([a for _, _, a in dys], dtype=np.float32))
    rows = np.concatenate([S for S, _, _ in dys])
    cols = np.repeat(np.arange(parties.size), [S.size for S, _, _ in dys])
    x0[rows, cols] += np.concatenate([u for _, u, _ in dys])  # (row, col) pairs are distinct
    return x0


def _warm_start(ms: MessageSpace, parties: np.ndarray) -> np.ndarray:
    """The protocol's mixing of ``e_i - u`` over the honest parties (Thm 4.5's spread), as ``dy``."""
    d = np.zeros((ms.n, parties.size))
    d[ms.honest, :] = -1.0 / ms.nH
    d[ms.parties[parties], np.arange(parties.size)] += 1.0
    return ms.baseline(d)

