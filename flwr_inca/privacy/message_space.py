"""The adversary's view parametrized by the messages it does not see (paper Sec. 4.1, Lemma 4.4).

Theorem 4.1's sensitivity of honest party i is a distance (Koskela & Kulkarni's projected Gaussian
mechanism): with the noise ``v = (eta*, eta)`` of the honest parties and ``Sigma_eta`` its covariance,

    mu_i^2 = min { ||e_i - v||^2_{Sigma_eta^{-1}} : v leaves every observed message unchanged },

where ``e_i`` changes ``x_i + eta*_i`` by one. Any admissible ``v`` gives an upper bound. Lemma 4.4's
observation makes the admissible set easy to walk in: choose a change ``dy`` of every *unseen* honest
message (observed ones stay 0); the change each honest party must then inject at its online steps is
``dz = Dz dy`` (its message minus what it received), and the noise change that injects it solves party
j's own small system ``R_j u_j = dz_j`` (its rows of the dropout-adapted schedule, Eq. (9)). Every
``dy`` is admissible by construction -- no constraint has to hold numerically -- and every admissible
``v`` arises this way (the honest messages determine the honest noise, ``[c | Z]`` being invertible).

So mu_i^2 is an unconstrained sparse least-squares problem in ``dy`` (dimension: the unseen honest
messages, about 17 n at T = 20, k = 1, 10% colluders), and any ``dy`` -- an iterate of an iterative
solver, a construction -- yields a sound upper bound once its cost is evaluated. This module builds
the operator; :mod:`flwr_inca.privacy.bound` uses it.

Conventions: injections are padded to ``T+1`` rows per honest party (an offline step is a zero row),
grouped by online pattern (see ``MessageSpace.rowid``). For a party
with fewer online steps than unknowns (a permanent dropout) ``u_j`` is the ``Sigma_eta``-weighted
least-norm solution at nominal sigmas, a fixed right inverse ``P_j`` of ``R_j``: the cost of a ``dy`` is
then ``X / sigma_star^2 + E / sigma_delta^2`` for every pair of sigmas, with X and E computed once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from ..protocol.schedules import adapted_rows
from ..protocol.trace import ExecutionTrace
from .views import AdversaryView

__all__ = ["MessageSpace"]

_RANK_TOL = 1e-10


@dataclass
class _Group:
    """Honest parties sharing one online pattern, hence one ``R`` and one right inverse ``P``.

    Members occupy the contiguous internal slots ``[start, stop)`` (see ``MessageSpace.parties``).
    """

    start: int
    stop: int
    R: np.ndarray  # (T+1, T+1): row t = [c_t, Z_t] of the adapted schedule (0 when offline)
    P: np.ndarray  # (T+1, T+1): u = P dz; columns of offline steps are 0
    defect: float  # bound on ||P_exact - P||_2 from the computed residual ||I - R P|| (rounding)
    blocked: bool  # R rank deficient: the party's rows are pinned to 0 (a sound restriction)


class MessageSpace:
    """The linear map ``dy -> (u_j)_j`` of one execution and one view, for batches of ``dy``.

    Internally the honest parties are ordered by online pattern (``parties[q]`` is the party in slot
    q) and injection rows are grouped by pattern, so that one matrix product applies a whole group's
    right inverse.

    Args:
        trace: the recorded execution.
        view: the adversary's observations.
        sigma_star, sigma_delta: nominal sigmas, used only to pick the right inverse of the parties
            with fewer online steps than unknowns (permanent dropouts); the map is sound for all.
    """

    def __init__(self, trace: ExecutionTrace, view: AdversaryView, sigma_star: float = 1.0,
                 sigma_delta: float = 1.0) -> None:
        if view.parties != trace.parties or view.observed.shape[0] != trace.iterations + 1:
            raise ValueError("adversary view does not match the trace (parties or iterations differ)")
        n, T = trace.parties, trace.iterations
        self.trace, self.view = trace, view
        self.n, self.T = n, T
        self.honest = view.honest
        self.nH = int(self.honest.size)
        self.online = trace.online_mask()
        self.c_o, Z_o = adapted_rows(trace.schedule, self.online)
        self.steps = [trace.steps[t].matrix(n) for t in range(T)]
        self._build_groups(Z_o, float(sigma_star), float(sigma_delta))
        self._build_variables()

    # ------------------------------------------------------------------ structure
    def _build_groups(self, Z_o: np.ndarray, s_star: float, s_delta: float) -> None:
        T = self.T
        lam = np.concatenate([[max(s_star, 1e-300) ** 2], np.full(T, max(s_delta, 1e-300) ** 2)])
        patterns = self.online[:, self.honest].T  # (nH, T+1)
        _, inverse = np.unique(np.packbits(patterns, axis=1), axis=0, return_inverse=True)
        inverse = inverse.ravel()
        perm = np.argsort(inverse, kind="stable")
        self.parties = self.honest[perm]  # party of internal slot q
        self.natural = np.empty(self.nH, dtype=np.int64)  # slot of honest[k]
        self.natural[perm] = np.arange(self.nH)
        slot = np.full(self.n, -1, dtype=np.int64)
        slot[self.parties] = np.arange(self.nH)
        self.slot = slot
        self.groups: list[_Group] = []
        self.group_of = np.empty(self.nH, dtype=np.int64)
        bounds = np.flatnonzero(np.diff(np.concatenate([[-1], inverse[perm], [-2]])))
        for g, (a, b) in enumerate(itertools.pairwise(bounds)):
            self.group_of[a:b] = g
            j = int(self.parties[a])
            act = self.online[:, j]
            R = np.zeros((T + 1, T + 1))
            R[act, 0] = self.c_o[act, j]
            R[act, 1:] = Z_o[act, j, :]
            Ra = R[act]
            P = np.zeros((T + 1, T + 1))
            s = np.linalg.svd(Ra, compute_uv=False)
            blocked = bool(s.size == 0 or s.min() <= _RANK_TOL * s.max())
            defect = 0.0
            if not blocked:
                if Ra.shape[0] == T + 1:
                    Pa = np.linalg.inv(Ra)
                else:  # weighted least-norm right inverse at the nominal sigmas
                    Pa = (lam[:, None] * Ra.T) @ np.linalg.inv((Ra * lam) @ Ra.T)
                P[:, act] = Pa
                res = np.linalg.norm(np.eye(Ra.shape[0]) - Ra @ Pa)
                # P_exact = P (R P)^{-1}, so ||P_exact - P|| <= ||P|| res / (1 - res)
                defect = float(np.linalg.norm(Pa, 2) * res / (1.0 - res)) if res < 0.5 else np.inf
            self.groups.append(_Group(int(a), int(b), R, P, defect, blocked))
        self.blocked = np.zeros(self.nH, dtype=bool)
        for grp in self.groups:
            if grp.blocked:
                self.blocked[grp.start:grp.stop] = True
        # rows are group-major, then step, then party: each group's injections form one contiguous
        # (T+1, members) block, so a single matrix product applies its right inverse
        T1 = T + 1
        sizes = np.array([g.stop - g.start for g in self.groups], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes * T1)])
        self.R = int(self.offsets[-1])
        q = np.arange(self.nH)
        g = self.group_of
        starts = np.array([gr.start for gr in self.groups], dtype=np.int64)
        self._row0 = self.offsets[g] + (q - starts[g])  # row of (t=0, q); step t adds t * size
        self._size = sizes[g]
        self.row_t = np.empty(self.R, dtype=np.int64)
        self.row_q = np.empty(self.R, dtype=np.int64)
        tt, qq = np.meshgrid(np.arange(T1), q, indexing="ij")
        rows = self.rowid(tt, qq)
        self.row_t[rows.ravel()] = tt.ravel()
        self.row_q[rows.ravel()] = qq.ravel()

    def rowid(self, t: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Row of step t of the party in slot q."""
        q = np.asarray(q)
        return self._row0[q] + np.asarray(t) * self._size[q]

    def _build_variables(self) -> None:
        n, T = self.n, self.T
        online, slot = self.online, self.slot
        observed = self.view.observed
        latest = np.zeros((T + 1, n), dtype=np.int64)
        for t in range(1, T + 1):
            latest[t] = np.where(online[t], t, latest[t - 1])
        self.latest = latest
        # the state a party holds from step t until its next online step is seen if any copy is
        state_seen = np.zeros((T + 1, n), dtype=bool)
        cols = np.arange(n)
        for t in range(T + 1):
            state_seen[latest[t], cols] |= observed[t]
        # a message delivered to a corrupted party is seen, whatever the view says (a corrupted
        # party's inputs are known, so nothing it receives may change)
        for t in range(1, T + 1):
            m = self.trace.steps[t - 1].messages
            to_corrupted = m.senders[slot[m.receivers] < 0]
            state_seen[latest[t - 1, to_corrupted], to_corrupted] = True
        is_h = slot >= 0
        free = online & ~state_seen & is_h[None, :]
        var = np.full((T + 1, n), -1, dtype=np.int64)
        var[free] = np.arange(int(free.sum()))
        rows_i, rows_j, vals = [], [], []
        t_idx, j_idx = np.nonzero(free)
        rows_i.append(self.rowid(t_idx, slot[j_idx]))
        rows_j.append(var[t_idx, j_idx])
        vals.append(np.ones(t_idx.size))
        for t in range(1, T + 1):
            W = self.steps[t - 1].tocoo()
            r, c, w = W.row, W.col, W.data
            keep = online[t, r] & is_h[r]
            r, c, w = r[keep], c[keep], w[keep]
            src = var[latest[t - 1, c], c]
            ok = src >= 0
            rows_i.append(self.rowid(t, slot[r[ok]]))
            rows_j.append(src[ok])
            vals.append(-w[ok])
        Dz = sp.csr_matrix((np.concatenate(vals), (np.concatenate(rows_i), np.concatenate(rows_j))),
                           shape=(self.R, int(free.sum())))
        if self.blocked.any():  # pin every message that reaches a blocked party's rows
            brow = self.blocked[self.row_q]
            touched = np.unique(Dz[np.flatnonzero(brow)].indices)
            keepc = np.ones(Dz.shape[1], dtype=bool)
            keepc[touched] = False
            remap = np.full(Dz.shape[1], -1, dtype=np.int64)
            remap[keepc] = np.arange(int(keepc.sum()))
            Dz = Dz[:, np.flatnonzero(keepc)].tocsr()
            fv = var >= 0
            var[fv] = remap[var[fv]]
        Dz.sum_duplicates()
        self.var = var
        self.Dz = Dz
        self.DzT = Dz.T.tocsr()
        self.U = int(Dz.shape[1])
        self.absDz = abs(Dz).tocsr()

    # ------------------------------------------------------------------ the map
    def apply_P(self, dz: np.ndarray, transpose: bool = False, absolute: bool = False) -> np.ndarray:
        """``u_j = P_j dz_j`` for every party (``P_j^T`` or ``|P_j|`` on request); ``dz``: (R, B) rows.

        Works in the dtype of ``dz`` (float32 inside the iterative solver, float64 for evaluation).
        """
        out = np.empty_like(dz)
        T1 = self.T + 1
        for k, g in enumerate(self.groups):
            a, b = self.offsets[k], self.offsets[k + 1]
            if g.blocked:
                out[a:b] = 0.0
                continue
            M = self._P_cache(g, dz.dtype, transpose, absolute)
            np.matmul(M, dz[a:b].reshape(T1, -1), out=out[a:b].reshape(T1, -1))
        return out

    def _P_cache(self, g: _Group, dtype: np.dtype, transpose: bool, absolute: bool) -> np.ndarray:
        key = (id(g), np.dtype(dtype).str, transpose, absolute)
        cache = self.__dict__.setdefault("_pc", {})
        if key not in cache:
            M = np.abs(g.P) if absolute else g.P
            cache[key] = np.ascontiguousarray(M.T if transpose else M, dtype=dtype)
        return cache[key]

    def sparse(self, dtype: np.dtype) -> tuple[sp.csr_matrix, sp.csr_matrix]:
        """``(Dz, Dz^T)`` in ``dtype`` (cached)."""
        cache = self.__dict__.setdefault("_sc", {})
        key = np.dtype(dtype).str
        if key not in cache:
            cache[key] = (self.Dz.astype(dtype), self.DzT.astype(dtype))
        return cache[key]

    def dz(self, dy: np.ndarray) -> np.ndarray:
        """(U, B) message changes -> (R, B) injections (in the dtype of ``dy``)."""
        Dz, _ = self.sparse(dy.dtype)
        return Dz @ dy

    def dz_t(self, dzv: np.ndarray) -> np.ndarray:
        _, DzT = self.sparse(dzv.dtype)
        return DzT @ dzv

    def target(self, slots: np.ndarray) -> np.ndarray:
        """(R, B) the injection of a unit change of ``x~`` of the party in each requested slot."""
        slots = np.asarray(slots, dtype=np.int64)
        t = np.zeros((self.R, slots.size))
        hon = self.parties[slots]
        steps = np.arange(self.T + 1)[:, None]
        rows = self.rowid(steps, slots[None, :])  # (T+1, B)
        t[rows, np.arange(slots.size)[None, :]] = np.where(self.online[:, hon], self.c_o[:, hon], 0.0)
        return t

    def baseline(self, d: np.ndarray) -> np.ndarray:
        """``dy`` of the x~-change ``d`` (n, B) made with no noise change: every message changes by
        ``B d`` (the protocol's own mixing); observed ones are then forced to 0 (not free)."""
        d = np.asarray(d, dtype=float)
        if d.ndim == 1:
            d = d[:, None]
        out = np.zeros((self.U, d.shape[1]))
        y = self.c_o[0][:, None] * d
        for t in range(self.T + 1):
            if t:
                y = self.steps[t - 1] @ y + self.c_o[t][:, None] * d
            js = np.flatnonzero(self.var[t] >= 0)
            out[self.var[t, js]] = y[js]
        return out


def pair_weights(ms: MessageSpace, weights_of_group: list[np.ndarray]) -> np.ndarray:
    """``sum_j || M_j Dz_j[:, u] ||^2`` for every variable u, where ``M_j^T M_j = weights_of_group[g(j)]``.

    A variable reaches at most two rows of one party (its own step t and t+1, or one row of a
    receiver), so the quadratic form is evaluated on the (row, row) pairs of each (party, variable).
    """
    coo = ms.Dz.tocoo()
    party = ms.row_q[coo.row]
    slot = ms.row_t[coo.row]
    order = np.lexsort((coo.row, party, coo.col))
    u, p, s, v = coo.col[order], party[order], slot[order], coo.data[order]
    g = ms.group_of[p]
    out = np.zeros(ms.U)
    Gs = np.stack(weights_of_group)  # (groups, T+1, T+1)
    np.add.at(out, u, v * v * Gs[g, s, s])
    same = (u[1:] == u[:-1]) & (p[1:] == p[:-1])
    k = np.flatnonzero(same)
    np.add.at(out, u[k], 2 * v[k] * v[k + 1] * Gs[g[k], s[k], s[k + 1]])
    return out
