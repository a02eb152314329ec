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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..protocol.schedules import adapted_rows
from ..protocol.trace import ExecutionTrace
from .views import AdversaryView

__all__ = ["ObservationModel", "build_model", "dense_system"]


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


def _structured_gram_a(trace: ExecutionTrace, view: AdversaryView, per_t: list[np.ndarray]) -> np.ndarray:
    """``G_A`` for D_Inc-like schedules via the covariance of the state ``(y^(t), e^(t))``.

    Noise part only, unit variance, honest terms only. With ``D`` the online parties at t and
    ``nu`` the fresh terms of online honest parties (t < T):
    ``y^(t) = W^O_t y^(t-1) - D e^(t-1) + nu`` and ``e^(t) = (I - D) e^(t-1) + nu``.
    The state covariance is kept in blocks (``Cov(e)`` is diagonal: one outstanding term per party), and
    the covariances of the current state with every message observed so far are propagated with the
    sparse step matrix; block row t of ``G_A`` is read from them when step t's messages are observed.
    """
    n, T = trace.parties, trace.iterations
    online = trace.online_mask()
    is_h = np.zeros(n)
    is_h[view.honest] = 1.0
    sizes = [p.size for p in per_t]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    m = int(offsets[-1])
    G = np.zeros((m, m))
    # Cy[k] = Cov(observed message k, y now), Ce[k] = Cov(observed message k, e now); stored with one row
    # per message so that propagating them is a dense-times-sparse product on contiguous rows
    Cy = np.zeros((m, n))
    Ce = np.zeros((m, n))
    # state covariance in blocks: Pyy = Cov(y), Pye = Cov(y, e), and Cov(e) = diag(pee) (each party has
    # one outstanding term, and distinct parties' terms are independent)
    Pyy = np.zeros((n, n))
    Pye = np.zeros((n, n))
    pee = np.zeros(n)

    def add_fresh(mask: np.ndarray) -> None:
        """Fresh terms enter both y_i and e_i: the 2x2 block [[1, 1], [1, 1]] on (y_i, e_i)."""
        i = np.flatnonzero(mask)
        Pyy[i, i] += mask[i]
        Pye[i, i] += mask[i]
        pee[i] += mask[i]

    add_fresh(is_h)  # y^(0) = e^(0) = eta_{.,1} of honest parties

    def observe(t: int) -> None:
        idx = per_t[t]
        if idx.size == 0:
            return
        a, b = int(offsets[t]), int(offsets[t + 1])
        Cy[a:b] = Pyy[idx]  # Cov(y_idx, y)
        Ce[a:b] = Pye[idx]  # Cov(y_idx, e)
        block = Cy[:b, idx].T  # Cov(y_obs(t), every message observed so far)
        G[a:b, :b] = block
        G[:a, a:b] = block[:, :a].T

    observe(0)
    for t in range(1, T + 1):
        on = online[t].astype(float)
        W = trace.steps[t - 1].matrix(n).tocsr()
        # y' = W y - D e, e' = (I - D) e with D = diag(on) (on is 0/1, so D (I - D) = 0):
        # Cov(y') = W Pyy W^T - W Pye D - D Pye^T W^T + D diag(pee) D, Cov(y', e') = W Pye (I - D)
        WPye = W @ Pye
        cross = WPye * on[None, :]
        Pyy_new = W @ np.ascontiguousarray((W @ Pyy).T)  # W Pyy W^T (Pyy symmetric)
        Pyy_new -= cross
        Pyy_new -= cross.T
        Pyy_new[np.diag_indices(n)] += on * pee
        Pyy = Pyy_new
        Pye = WPye * (1.0 - on)[None, :]
        pee = pee * (1.0 - on)
        if t < T:
            add_fresh(on * is_h)
        k = int(offsets[t])
        if k:
            # the same step on the covariances with the observed messages: Cov(obs, y') =
            # Cov(obs, y) W^T - Cov(obs, e) D, Cov(obs, e') = Cov(obs, e) (I - D)
            Cy[:k] = Cy[:k] @ W.T.tocsc() - Ce[:k] * on[None, :]
            Ce[:k] *= (1.0 - on)[None, :]
        observe(t)
    return (G + G.T) / 2


def build_model(trace: ExecutionTrace, view: AdversaryView, method: str = "auto") -> ObservationModel:
    """Build the :class:`ObservationModel` of ``view`` on ``trace``.

    ``method``: ``"structured"`` (D_Inc-like schedules only), ``"dense"``, or ``"auto"`` (structured
    when the schedule allows it).
    """
    if view.parties != trace.parties or view.observed.shape[0] != trace.iterations + 1:
        raise ValueError("adversary view does not match the trace (parties or iterations differ)")
    if method not in ("auto", "structured", "dense"):
        raise ValueError(f"method must be 'auto', 'structured' or 'dense', got {method!r}")
    incremental = trace.schedule.is_incremental_pattern
    if method == "structured" and not incremental:
        raise ValueError("the structured builder needs a D_Inc-like schedule (Z of D_Inc)")
    honest = view.honest
    per_t = _observed_rows(view)
    rows = np.concatenate([np.stack([p, np.full(p.size, t)], 1) for t, p in enumerate(per_t)]).astype(np.int64)
    if method == "dense" or (method == "auto" and not incremental):
        B_V, A_V, _ = dense_system(trace, view)
        return ObservationModel(honest, rows, B_V, _gram(B_V), _gram(A_V))
    c_o, _ = adapted_rows(trace.schedule, trace.online_mask())
    B_V = _b_rows(trace, honest, per_t, c_o)
    return ObservationModel(honest, rows, B_V, _gram(B_V), _structured_gram_a(trace, view, per_t))
