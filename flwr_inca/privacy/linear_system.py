"""The adversary's knowledge as a linear Gaussian system (paper Sec. 4.1, Eq. (10), App. A.2).

Every message is ``y^(t) = B_t x~ + A_t eta`` with ``x~ = x + eta*``, ``B_0 = D_c^(0)``,
``A_0 = zeta_0``, ``B_t = W^O_t B_{t-1} + D_c^(t)``, ``A_t = W^O_t A_{t-1} + zeta_t``. Keeping the
observed rows and moving the corrupted parties' (known) variables to the known side leaves
``y_V = B_V x~_H + A_V eta_H``. Messages of corrupted parties are linear combinations of messages
delivered to them plus known terms, so only observed rows of *honest* parties are kept.

What the accountant needs are three matrices over the m observed rows (for unit noise variances):
``H = B_V`` (m, n_H), ``G_B = B_V B_V^T`` and ``G_A = A_V A_V^T`` (m, m); the view's covariance is
``Sigma = sigma_star^2 G_B + sigma_delta^2 G_A``.

Two builders compute them:

* ``dense``: forms ``A_V`` explicitly (n_H * T noise columns, only the columns already injected are
  mixed). Works for every schedule.
* ``structured`` (D_Inc-like schedules): at any time each party has a single outstanding noise term,
  so the noise part is a linear state-space model with state ``(y^(t), e^(t))`` of size 2n. ``G_A``
  is the covariance of the observed outputs, propagated with the sparse ``W^O_t``; no noise column
  is ever formed. Cost O(T (k+3) n (n + m)) instead of O(m^2 n_H T).

At one pair of sigmas (a round's certificate) the two Grams are not needed, only ``Sigma`` and ``H``:
:func:`observed_covariance` propagates the covariance of the state ``(y^(t), e^(t), x~)`` (``x~``
enters through ``B_t``) straight into the lower triangle of one (m, m) matrix, which the accountant
then factorizes in place (:func:`~flwr_inca.privacy.certificate.whiten_lower`). For a round of 1000
parties that is one (m, m) matrix at the peak instead of about five, and no ``m^2 n_H`` Gram of ``B_V``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.linalg.blas import dsyrk

from ..protocol.schedules import adapted_rows
from ..protocol.trace import ExecutionTrace
from .views import AdversaryView

__all__ = ["ObservationModel", "ObservedCovariance", "build_model", "dense_system", "lower_norm1",
           "observed_covariance"]


@dataclass(frozen=True)
class ObservationModel:
    """The adversary's view of the honest parties, for unit noise variances.

    Attributes:
        honest: (n_H,) honest party indices; column j of ``H`` is party ``honest[j]``.
        rows: (m, 2) observed honest messages as ``[party, t]``.
        H: (m, n_H) ``B_V``: how each observed message depends on each honest ``x_i + eta*_i``.
        G_B: (m, m) ``B_V B_V^T``.
        G_A: (m, m) ``A_V A_V^T``.
    """

    honest: np.ndarray
    rows: np.ndarray
    H: np.ndarray
    G_B: np.ndarray
    G_A: np.ndarray

    def covariance(self, sigma_star: float, sigma_delta: float) -> np.ndarray:
        return sigma_star**2 * self.G_B + sigma_delta**2 * self.G_A


def _observed_rows(view: AdversaryView) -> list[np.ndarray]:
    obs = view.honest_observed()
    return [np.flatnonzero(obs[t]) for t in range(obs.shape[0])]


def _b_rows(trace: ExecutionTrace, honest: np.ndarray, per_t: list[np.ndarray], c_o: np.ndarray) -> np.ndarray:
    """``B_V`` by the recursion ``B_t = W^O_t B_{t-1} + D_c^(t)`` restricted to honest columns."""
    n = trace.parties
    cols = np.arange(honest.size)
    B = np.zeros((n, honest.size))
    B[honest, cols] = c_o[0, honest]
    out = [B[per_t[0]]]
    for t in range(1, trace.iterations + 1):
        B = trace.steps[t - 1].matrix(n) @ B
        B[honest, cols] += c_o[t, honest]
        out.append(B[per_t[t]])
    return np.concatenate(out, axis=0)


def _gram(M: np.ndarray) -> np.ndarray:
    G = M @ M.T
    return (G + G.T) / 2


def dense_system(trace: ExecutionTrace, view: AdversaryView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(B_V, A_V, rows)`` with ``A_V`` explicit: column ``(k-1) * n_H + j`` is term k of ``honest[j]``."""
    n, T = trace.parties, trace.iterations
    honest = view.honest
    nH = honest.size
    online = trace.online_mask()
    c_o, Z_o = adapted_rows(trace.schedule, online)
    per_t = _observed_rows(view)
    cols = np.arange(nH)
    # a noise term can only be present once some step has injected it: mix the active columns only
    used = np.any(Z_o[:, honest, :] != 0, axis=1)  # (T+1, T): term k touched at step t
    active = np.zeros(T + 1, dtype=np.int64)
    seen = np.zeros(T, dtype=bool)
    for t in range(T + 1):
        seen |= used[t]
        active[t] = (np.flatnonzero(seen).max() + 1) if seen.any() else 0
    A = np.zeros((n, T * nH))  # column (k-1)*nH + j

    def inject(t: int) -> None:
        Zt = Z_o[t, honest, :]  # (nH, T)
        for k in np.flatnonzero(np.any(Zt != 0, axis=0)):
            A[honest, k * nH + cols] += Zt[:, k]

    inject(0)
    rows_A = [A[per_t[0]]]
    for t in range(1, T + 1):
        a = active[t - 1] * nH
        if a:
            A[:, :a] = trace.steps[t - 1].matrix(n) @ A[:, :a]
        inject(t)
        rows_A.append(A[per_t[t]])
    A_V = np.concatenate(rows_A, axis=0)
    B_V = _b_rows(trace, honest, per_t, c_o)
    rows = np.concatenate([np.stack([p, np.full(p.size, t)], 1) for t, p in enumerate(per_t)])
    return B_V, A_V, rows.astype(np.int64)


def _diagonal(square: np.ndarray) -> np.ndarray:
    """A writable view of the diagonal of a C-contiguous square matrix (a reshape of any other would be a copy,
    and writes to it lost)."""
    if not square.flags.c_contiguous:
        raise RuntimeError("expected a C-contiguous matrix")
    return square.reshape(-1)[:: square.shape[0] + 1]


class _NoiseState:
    """Covariance of the noise state ``(y^(t), e^(t))`` of a D_Inc-like schedule, unit variance, honest
    terms only. With ``D`` the online parties at t and ``nu`` the fresh terms of online honest parties
    (t < T): ``y^(t) = W^O_t y^(t-1) - D e^(t-1) + nu`` and ``e^(t) = (I - D) e^(t-1) + nu``.

    Attributes (n = parties): ``Pyy`` (n, n) ``Cov(y)``; ``pee`` (n,) ``Cov(e)``, diagonal (each party
    has one outstanding term, and distinct parties' terms are independent). ``Cov(y, e)`` is kept by
    columns, most of which are trivial: a party that injected its term at the last step has
    ``Cov(y, e_j) = fresh[j] * (unit vector j)`` (the term has not been mixed yet); the others (offline
    since they injected it) have a dense column, ``stale`` (n, k) for the parties ``stale_parties`` (k,).
    """

    def __init__(self, is_honest: np.ndarray) -> None:
        n = is_honest.size
        self.Pyy, self.pee, self.fresh = np.zeros((n, n)), np.zeros(n), np.zeros(n)
        self.stale_parties, self.stale = np.zeros(0, dtype=np.int64), np.zeros((n, 0))
        self.add_fresh(is_honest)  # y^(0) = e^(0) = eta_{.,1} of honest parties

    def add_fresh(self, mask: np.ndarray) -> None:
        """Fresh terms enter both y_i and e_i: the 2x2 block [[1, 1], [1, 1]] on (y_i, e_i) (only for
        parties online at this step, whose column of ``Cov(y, e)`` the step has just cleared)."""
        i = np.flatnonzero(mask)
        _diagonal(self.Pyy)[i] += mask[i]
        self.fresh[i] += mask[i]
        self.pee[i] += mask[i]

    def cov_e_with(self, idx: np.ndarray) -> np.ndarray:
        """(n, a) ``Cov(e, y_idx)``, i.e. ``Cov(y, e)[idx]`` transposed."""
        out = np.zeros((self.pee.size, idx.size))
        out[idx, np.arange(idx.size)] = self.fresh[idx]
        out[self.stale_parties] += self.stale[idx].T
        return out

    def step(self, W: sp.csr_matrix, on: np.ndarray) -> None:
        """Advance by one mixing step (before its fresh terms) with step matrix ``W`` and 0/1 ``on``.

        ``y' = W y - D e``, ``e' = (I - D) e`` with ``D = diag(on)`` (``D (I - D) = 0``):
        ``Cov(y') = W Pyy W^T - X - X^T + D diag(pee) D`` with ``X = W Cov(y, e) D``, and
        ``Cov(y', e') = W Cov(y, e) (I - D)``. A fresh column j of ``Cov(y, e)`` makes ``X`` the column
        ``W[:, j] fresh[j]`` (sparse); only stale columns are multiplied densely.
        """
        n = on.size
        online = on > 0
        entries = W.tocoo()
        propagated = W @ self.stale  # W Cov(y, e) on the stale columns
        back = online[self.stale_parties]  # stale parties online again: their term is cancelled now
        Pyy = W @ np.ascontiguousarray((W @ self.Pyy).T)  # W Pyy W^T (Pyy symmetric)
        hit = online[entries.col] & (self.fresh[entries.col] != 0)
        rows, cols = entries.row[hit], entries.col[hit]
        cross = entries.data[hit] * self.fresh[cols]  # X's entries from the fresh columns (unique pairs)
        Pyy[rows, cols] -= cross
        Pyy[cols, rows] -= cross
        if back.any():
            parties, X = self.stale_parties[back], propagated[:, back]
            Pyy[:, parties] -= X
            Pyy[parties, :] -= X.T
        _diagonal(Pyy)[:] += on * self.pee
        self.Pyy = Pyy
        # the columns that survive (I - D): the stale ones of offline parties, and the fresh ones of
        # parties now offline
        newly = np.flatnonzero(~online & (self.fresh != 0))
        mixed = np.zeros((n, newly.size))  # their columns W[:, j] fresh[j]
        position = np.full(n, -1)
        position[newly] = np.arange(newly.size)
        taken = position[entries.col] >= 0
        col = entries.col[taken]
        mixed[entries.row[taken], position[col]] = entries.data[taken] * self.fresh[col]
        self.stale = np.hstack([propagated[:, ~back], mixed])
        self.stale_parties = np.concatenate([self.stale_parties[~back], newly])
        self.fresh = np.zeros(n)
        self.pee = self.pee * (1.0 - on)


class _ObservedBlock:
    """The covariances of the current state with the messages observed at some consecutive earlier
    iterations (the rows from ``offset`` on, ``a`` of them).

    Stored with one row per party (so that the sparse step is a product on contiguous rows, and a
    later iteration's observed parties are a gather of rows): ``cy`` (n, a) ``Cov(y^(t), o_s)``;
    ``ce`` (r, a) ``Cov(e^(t), o_s)`` on the parties ``ce_rows`` only (a party's outstanding term is
    independent of ``o_s`` once it has injected a fresh one, so ``ce`` loses the rows of every party
    online at a step); ``cx`` (n, a) ``Cov(x~, o_s)`` with a row per party (zero for corrupted), or
    None when ``x~`` is not part of the covariance.
    """

    def __init__(self, offset: int, cy: np.ndarray, ce_rows: np.ndarray, ce: np.ndarray,
                 cx: np.ndarray | None) -> None:
        self.offset, self.cy, self.ce_rows, self.ce, self.cx = offset, cy, ce_rows, ce, cx

    @classmethod
    def observed(cls, offset: int, cy: np.ndarray, ce: np.ndarray, cx: np.ndarray | None) -> _ObservedBlock:
        """A block of messages observed now; ``ce`` (n, a) with a row per party."""
        rows = np.flatnonzero(np.any(ce != 0, axis=1))
        return cls(offset, cy, rows, ce[rows], cx)

    @property
    def width(self) -> int:
        return int(self.cy.shape[1])

    def merged(self, later: _ObservedBlock) -> _ObservedBlock:
        """One block for this one and the ``later`` one that follows it (same state time). The sparse step
        computes each column on its own, so merging changes no value: it only makes fewer, larger
        products (fewer calls where iterations observe few messages)."""
        rows = np.union1d(self.ce_rows, later.ce_rows)
        ce = np.zeros((rows.size, self.width + later.width))
        ce[np.searchsorted(rows, self.ce_rows), : self.width] = self.ce
        ce[np.searchsorted(rows, later.ce_rows), self.width :] = later.ce
        cx = None if self.cx is None or later.cx is None else np.hstack([self.cx, later.cx])
        return _ObservedBlock(self.offset, np.hstack([self.cy, later.cy]), rows, ce, cx)

    def step(self, W: sp.csr_matrix, on: np.ndarray, injected: np.ndarray) -> None:
        """``Cov(y', o_s) = W Cov(y, o_s) - D Cov(e, o_s) + diag(injected) Cov(x~, o_s)`` and
        ``Cov(e', o_s) = (I - D) Cov(e, o_s)``; ``injected`` (n,): the share of ``x~_i`` party i
        injects at this step (``c_t`` of its adapted schedule, 0 for corrupted or offline parties)."""
        cy = W @ self.cy
        if self.ce_rows.size:
            hit = on[self.ce_rows] > 0
            if hit.any():
                cy[self.ce_rows[hit]] -= self.ce[hit]
                self.ce_rows, self.ce = self.ce_rows[~hit], self.ce[~hit]
        if self.cx is not None:
            cy += injected[:, None] * self.cx
        self.cy = cy


class _Propagation:
    """The covariances of the state ``(y^(t), e^(t), x~)`` of a D_Inc-like schedule with every message
    observed so far, in variance units (``var_star`` for ``x~ = x + eta*``, ``var_delta`` for the noise
    terms); see :func:`_observed_covariances`.

    Attributes: ``noise`` the noise state (unit variance); ``B`` (n, n_H) ``B_t`` on the honest columns
    (``y^(t) = B_t x~ + noise``, so ``Cov(y, x~) = var_star B_t``); ``blocks`` one per earlier iteration
    with observed messages, or with several consecutive ones (merged up to ``merge_width`` messages).
    """

    def __init__(self, trace: ExecutionTrace, honest: np.ndarray, var_star: float, var_delta: float) -> None:
        n = trace.parties
        self.trace, self.honest, self.var_star, self.var_delta = trace, honest, var_star, var_delta
        self.online = trace.online_mask()
        self.c_o, _ = adapted_rows(trace.schedule, self.online)
        self.is_h = np.zeros(n)
        self.is_h[honest] = 1.0
        self.noise = _NoiseState(self.is_h)
        self.B = np.zeros((n, honest.size))
        self.B[honest, np.arange(honest.size)] = self.c_o[0, honest]
        self.blocks: list[_ObservedBlock] = []
        # blocks grow (by whole iterations) to about 1 MiB of cy: a few sparse products per step, each on
        # data that fits a core's cache
        self.merge_width = max(1, 2**17 // n)

    def step(self, t: int) -> None:
        """Advance from iteration t-1 to t (1 <= t <= T)."""
        n = self.trace.parties
        on = self.online[t].astype(float)
        W = self.trace.steps[t - 1].matrix(n).tocsr()
        W.sum_duplicates()  # unique entries: the sparse updates of the noise state index by them
        injected = self.c_o[t] * self.is_h
        for block in self.blocks:
            block.step(W, on, injected)
        self.noise.step(W, on)
        if t < self.trace.iterations:
            self.noise.add_fresh(on * self.is_h)
        self.B = W @ self.B
        self.B[self.honest, np.arange(self.honest.size)] += self.c_o[t, self.honest]

    def observe(self, idx: np.ndarray, offset: int, *, keep: bool) -> tuple[np.ndarray, list]:
        """``(H_t, pieces)`` of the messages of parties ``idx`` now (rows from ``offset`` on), see
        :func:`_observed_covariances`; ``keep``: later messages are observed, so propagate these."""
        H_t = self.B[idx]
        pieces = [(block.offset, block.cy[idx]) for block in self.blocks]
        if not keep:  # only their own block is needed, not their covariance with the whole state
            same = self.var_delta * self.noise.Pyy[np.ix_(idx, idx)]
            if self.var_star:
                same += self.var_star * (H_t @ H_t.T)
            pieces.append((offset, (same + same.T) / 2))
            return H_t, pieces
        # Cov(y^(t), o_t) (n, a_t): the noise part, and the x~ part var_star B_t B_t[idx]^T
        cy = self.var_delta * self.noise.Pyy[:, idx]
        cx = None
        if self.var_star:
            cy += self.var_star * (self.B @ H_t.T)
            cx = np.zeros((self.trace.parties, idx.size))
            cx[self.honest] = self.var_star * H_t.T
        same = cy[idx]
        pieces.append((offset, (same + same.T) / 2))
        block = _ObservedBlock.observed(offset, cy, self.var_delta * self.noise.cov_e_with(idx), cx)
        if self.blocks and self.blocks[-1].width + block.width <= self.merge_width:
            block = self.blocks.pop().merged(block)
        self.blocks.append(block)
        return H_t, pieces


def _observed_covariances(trace: ExecutionTrace, view: AdversaryView, per_t: list[np.ndarray],
                          var_star: float, var_delta: float) -> Iterator[tuple[int, np.ndarray, list]]:
    """The observed messages' covariance ``var_star G_B + var_delta G_A`` of a D_Inc-like schedule, one
    block row per iteration, from the covariances of the state ``(y^(t), e^(t), x~)``.

    Yields ``(t, H_t, pieces)`` for each iteration t with observed messages: ``H_t`` (a_t, n_H) their
    rows of ``B_V``; ``pieces`` a list of ``(column offset, block)`` with ``block`` (a_t, a_s) the
    covariance of the messages of t with those of an iteration s <= t (the last one: s = t,
    symmetric). The covariances of the state with every message observed so far are propagated with the
    sparse step matrix, never a dense (m, m) product (no Gram of ``B_V``); ``x~`` enters through ``B_t``.
    Cost O(T m n) for the propagation plus O(m n_H n) for the new rows' ``x~`` part.
    """
    observed = [t for t, p in enumerate(per_t) if p.size]
    if not observed:
        return
    state = _Propagation(trace, view.honest, var_star, var_delta)
    offset = 0
    for t in range(observed[-1] + 1):  # nothing after the last observed messages matters
        if t:
            state.step(t)
        idx = per_t[t]
        if idx.size:
            H_t, pieces = state.observe(idx, offset, keep=t < observed[-1])
            yield t, H_t, pieces
            offset += idx.size


def _structured_gram_a(trace: ExecutionTrace, view: AdversaryView, per_t: list[np.ndarray]) -> np.ndarray:
    """(m, m) ``G_A`` for D_Inc-like schedules (noise part only, unit variance, honest terms only), by
    :func:`_observed_covariances`: block row t is read from the covariances of the state with every
    message observed so far when step t's messages are observed."""
    m = sum(p.size for p in per_t)
    G = np.zeros((m, m))
    a = 0
    for t, _, pieces in _observed_covariances(trace, view, per_t, 0.0, 1.0):
        b = a + per_t[t].size
        for col, block in pieces:
            G[a:b, col:col + block.shape[1]] = block
            G[col:col + block.shape[1], a:b] = block.T
        a = b
    return G


@dataclass(frozen=True)
class ObservedCovariance:
    """The adversary's view at one pair of sigmas, ready to factorize.

    Attributes:
        honest: (n_H,) honest party indices; column j of ``H`` is party ``honest[j]``.
        rows: (m, 2) observed honest messages as ``[party, t]``, ordered by t.
        H: (m, n_H) ``B_V`` (how each observed message depends on each honest ``x_i``).
        lower: (m, m) C-ordered; on and below its diagonal ``Sigma = sigma_star^2 G_B +
            sigma_delta^2 G_A`` (in squared value units); above it unspecified.
        norm1: ``||Sigma||_1`` (the largest absolute column sum).
    """

    honest: np.ndarray
    rows: np.ndarray
    H: np.ndarray
    lower: np.ndarray
    norm1: float


def lower_norm1(lower: np.ndarray, chunk: int = 256) -> float:
    """``||S||_1`` of the symmetric S whose lower triangle (diagonal included) is ``lower``'s, read in row
    chunks (no (m, m) temporary). Column j sums its entries on and below the diagonal and, by
    symmetry, the entries of row j left of it."""
    m = lower.shape[0]
    below = np.zeros(m)  # sum_{i >= j} |S_ij|
    left = np.zeros(m)  # sum_{i < j} |S_ij| = sum_{i < j} |S_ji|
    for a in range(0, m, chunk):
        b = min(a + chunk, m)
        part = np.abs(lower[a:b, :b])
        part[:, a:b] = np.tril(part[:, a:b])
        below[:b] += part.sum(axis=0)
        left[a:b] += part.sum(axis=1) - np.diagonal(part[:, a:b])
    return float((below + left).max(initial=0.0))


def _lower_from_products(H: np.ndarray, A_V: np.ndarray, var_star: float, var_delta: float) -> np.ndarray:
    """(m, m) C-ordered, its lower triangle ``var_star H H^T + var_delta A_V A_V^T`` (BLAS ``dsyrk`` on one
    buffer: half the products of a full Gram, no (m, m) temporary)."""
    m = H.shape[0]
    # the transposes are Fortran-ordered views: dsyrk writes their upper triangle, i.e. lower's lower one
    upper = np.zeros((m, m)).T
    for variance, M in ((var_star, H), (var_delta, A_V)):
        if m and M.shape[1]:  # (BLAS refuses empty operands)
            upper = dsyrk(variance, M.T, beta=1.0, c=upper, trans=1, lower=0, overwrite_c=1)
    return upper.T


def observed_covariance(trace: ExecutionTrace, view: AdversaryView, sigma_star: float,
                        sigma_delta: float) -> ObservedCovariance:
    """The :class:`ObservedCovariance` of ``view`` on ``trace`` at ``(sigma_star, sigma_delta)``.

    The same ``Sigma`` as :meth:`ObservationModel.covariance` of :func:`build_model` (up to rounding),
    without its two (m, m) Grams: for D_Inc-like schedules the covariance of the state ``(y, e, x~)``
    is propagated (:func:`_observed_covariances`), no Gram of ``B_V`` is formed; for the others the
    dense system's two products are accumulated into one triangle.
    """
    _check_match(trace, view)
    per_t = _observed_rows(view)
    rows = _rows(per_t)
    var_star, var_delta = float(sigma_star) ** 2, float(sigma_delta) ** 2
    m, nH = rows.shape[0], view.honest.size
    if not trace.schedule.is_incremental_pattern:
        B_V, A_V, _ = dense_system(trace, view)
        lower = _lower_from_products(B_V, A_V, var_star, var_delta)
        return ObservedCovariance(view.honest, rows, B_V, lower, lower_norm1(lower))
    lower = np.empty((m, m))  # every entry on and below the diagonal is written below
    H = np.empty((m, nH))
    a = 0
    for t, H_t, pieces in _observed_covariances(trace, view, per_t, var_star, var_delta):
        b = a + H_t.shape[0]
        H[a:b] = H_t
        for col, block in pieces:
            lower[a:b, col:col + block.shape[1]] = block
        a = b
    return ObservedCovariance(view.honest, rows, H, lower, lower_norm1(lower))


def _check_match(trace: ExecutionTrace, view: AdversaryView) -> None:
    if view.parties != trace.parties or view.observed.shape[0] != trace.iterations + 1:
        raise ValueError("adversary view does not match the trace (parties or iterations differ)")


def _rows(per_t: list[np.ndarray]) -> np.ndarray:
    rows = [np.stack([p, np.full(p.size, t)], 1) for t, p in enumerate(per_t)]
    return np.concatenate(rows).astype(np.int64)


def build_model(trace: ExecutionTrace, view: AdversaryView, method: str = "auto") -> ObservationModel:
    """Build the :class:`ObservationModel` of ``view`` on ``trace``.

    ``method``: ``"structured"`` (D_Inc-like schedules only), ``"dense"``, or ``"auto"`` (structured
    when the schedule allows it).
    """
    _check_match(trace, view)
    if method not in ("auto", "structured", "dense"):
        raise ValueError(f"method must be 'auto', 'structured' or 'dense', got {method!r}")
    incremental = trace.schedule.is_incremental_pattern
    if method == "structured" and not incremental:
        raise ValueError("the structured builder needs a D_Inc-like schedule (Z of D_Inc)")
    honest = view.honest
    per_t = _observed_rows(view)
    rows = _rows(per_t)
    if method == "dense" or (method == "auto" and not incremental):
        B_V, A_V, _ = dense_system(trace, view)
        return ObservationModel(honest, rows, B_V, _gram(B_V), _gram(A_V))
    c_o, _ = adapted_rows(trace.schedule, trace.online_mask())
    B_V = _b_rows(trace, honest, per_t, c_o)
    return ObservationModel(honest, rows, B_V, _gram(B_V), _structured_gram_a(trace, view, per_t))
