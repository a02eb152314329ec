"""The cheap tier of the charge-aware cascade: a sound local bound on every honest party's mu.

Any change ``dy`` of the unseen honest messages gives an upper bound on mu_i^2 (docs/privacy.md,
"Certificates at scale"). This tier uses, for the party in slot q,

    dy_q = a_q G + u_q,

with ``G`` one shared global ``dy`` (conjugate gradients on the mean right-hand side: it carries the
central-DP spread of a value change over every honest party) and ``u_q`` supported on the unseen
messages that touch the parties within one hop of q (parties linked by a message in any iteration).
``(a_q, u_q)`` is found by a few iterations of CGLS on the small local problem, and the cost of that
``dy`` is evaluated rigorously *without* forming it: outside the parties the local columns touch, the
residual is ``a_q`` times the residual of ``G``, whose per-party norms are bounded once for all parties.
The evaluation is in float64 with explicit rounding margins (:meth:`LocalTier.evaluate`), so the value
is a sound upper bound whatever the solver did. It is looser than the global bound for most parties
(1.2--1.8x their own mu) but far below the charged maximum for most of them; the cascade
(:mod:`flwr_inca.privacy.bound`) refines the rest with the global bound.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.sparse as sp

from .message_space import MessageSpace

__all__ = ["LocalTier"]

_EPS = np.finfo(float).eps / 2  # unit roundoff


def _gamma(n: int) -> float:
    return n * _EPS / (1 - n * _EPS)


def _sum_up(v: np.ndarray) -> float:
    """An upper bound of the exact sum of the non-negative floats ``v``."""
    return float(np.sum(v)) * (1 + _gamma(v.size + 2))


def _sum_down(v: np.ndarray) -> float:
    """A lower bound of the exact sum of the non-negative floats ``v``."""
    return float(np.sum(v)) * (1 - _gamma(v.size + 2))


def whitened_operator(ms: MessageSpace, s_star: float, s_delta: float) -> tuple[np.ndarray, sp.csc_matrix]:
    """``(w, L)``: the row weights ``w`` (1/sigma_star on the value rows, 1/sigma_delta on the others) and
    the explicit whitened least-squares operator ``L = diag(w) P Dz`` of ``ms`` (float64, by columns):
    ``min_dy ||L dy - b_i||^2`` is mu_i^2."""
    rows, cols, vals = [], [], []
    for g in ms.groups:
        if g.blocked:
            continue
        q = np.arange(g.start, g.stop)
        for t, s in zip(*np.nonzero(g.P)):
            rows.append(ms.rowid(t, q))
            cols.append(ms.rowid(s, q))
            vals.append(np.full(q.size, g.P[t, s]))
    cat = (lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dtype=dt))
    P = sp.csr_matrix((cat(vals, float), (cat(rows, np.int64), cat(cols, np.int64))), shape=(ms.R, ms.R))
    w = np.where(ms.row_t == 0, 1.0 / s_star, 1.0 / s_delta)
    return w, (sp.diags(w) @ P @ ms.Dz).tocsc()


class LocalTier:
    """Local bounds ``(X_q, E_q)`` for the parties of one :class:`MessageSpace` (see the module docstring).

    Args:
        ms: the message space.
        G: (U,) the shared global ``dy`` (float64; any vector is sound, a good one is tight).
        s_star, s_delta: nominal sigmas of the local least-squares problems (the bound holds for all).
        iterations: CGLS iterations per party.
    """

    def __init__(self, ms: MessageSpace, G: np.ndarray, s_star: float, s_delta: float,
                 iterations: int = 20) -> None:
        self.ms = ms
        self.iterations = int(iterations)
        T1 = ms.T + 1
        G = np.asarray(G, dtype=float).ravel()
        if G.size != ms.U or not np.all(np.isfinite(G)):
            G = np.zeros(ms.U)
        self.G = G
        # the explicit whitened operator L = W P Dz (float64, by columns) for the local solves
        self.w, self.L = whitened_operator(ms, s_star, s_delta)
        self.L.sort_indices()
        self._mark = np.zeros(ms.R, dtype=bool)  # scratch of solve()
        self._pos = np.zeros(ms.R, dtype=np.int64)
        self.DzC = ms.Dz.tocsc()
        self.absDzC = ms.absDz.tocsc()
        coo = ms.Dz.tocoo()
        touches = sp.csr_matrix((np.ones(coo.nnz), (coo.col, ms.row_q[coo.row])), shape=(ms.U, ms.nH))
        touches.sum_duplicates()
        self.touches = touches
        self.touched_by = touches.T.tocsr()
        self.LG = self.L @ G
        self.LG2 = float(self.LG @ self.LG)
        self.Pst = np.stack([g.P for g in ms.groups]) if ms.groups else np.zeros((0, T1, T1))
        self.absPst = np.abs(self.Pst)
        self.defect = np.array([g.defect for g in ms.groups], dtype=float)[ms.group_of] if ms.groups \
            else np.zeros(0)
        # rounding of every computed residual component: the sums of ``a (Dz G) + Dz_S u - t`` (at most
        # 2 * row length + 4 operations on any path) and then of ``P`` (T + 1 more terms)
        row_len = int(np.diff(ms.Dz.indptr).max(initial=0))
        self.gamma_v = _gamma(2 * row_len + 8)
        self.gamma_r = _gamma(2 * row_len + 8 + T1 + 4)
        # G's residual per party, bounded once: |(P_exact Dz G)_j| <= A_j (X part, E part)
        gz = ms.Dz @ G
        agz = ms.absDz @ np.abs(G)
        self.gz, self.agz = gz, agz
        AX, AE = self._party_bounds(np.arange(ms.nH), gz, agz)
        self.AX2 = AX * AX * (1 + 4 * _EPS)
        self.AE2 = AE * AE * (1 + 4 * _EPS)
        self.TX = _sum_up(self.AX2)
        self.TE = _sum_up(self.AE2)

    # ------------------------------------------------------------------ rigorous evaluation
    def _party_bounds(self, J: np.ndarray, v: np.ndarray, av: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For the parties in slots ``J`` and their injection change ``v`` (R rows, or (|J|, T+1)) computed
        with componentwise error at most ``gamma_v * av``: upper bounds on ``|u_j[0]|`` and ``||u_j[1:]||``
        of the exact ``u_j = P_exact_j v_j``."""
        ms = self.ms
        T1 = ms.T + 1
        if v.ndim == 1:
            rows = ms.rowid(np.arange(T1)[None, :], J[:, None])
            v, av = v[rows], av[rows]
        Pj, aPj = self.Pst[ms.group_of[J]], self.absPst[ms.group_of[J]]
        res = np.einsum("jts,js->jt", Pj, v)
        # |P (v_exact - v)| <= gamma_v |P| av and the rounding of P v is <= gamma_{T+1} |P| |v|: both are
        # covered by gamma_r |P| (|v| + av), gamma_r >= gamma_v + gamma_{T+1} (absres rounded up)
        absres = np.einsum("jts,js->jt", aPj, np.abs(v) + av) * (1 + _gamma(T1 + 4))
        up = np.abs(res) + self.gamma_r * absres
        # ||v_j|| of the exact v_j, for the defect of the computed right inverse (added per party)
        vn = np.sqrt(np.sum((np.abs(v) + self.gamma_v * av) ** 2, axis=1)) * (1 + _gamma(T1 + 4))
        extra = self.defect[J] * vn * (1 + 4 * _EPS)
        bx = (up[:, 0] + extra) * (1 + 4 * _EPS)
        be = (np.sqrt(np.sum(up[:, 1:] ** 2, axis=1)) * (1 + _gamma(T1 + 4)) + extra) * (1 + 4 * _EPS)
        return bx, be

    def evaluate(self, q: int, S: np.ndarray, u: np.ndarray, a: float) -> tuple[float, float]:
        """Rigorous ``(X, E)`` upper bounds of the cost of ``dy = a G + u`` (u on the columns S) for the
        party in slot q. Exact residual of party j: ``u_j = P_exact_j (a (Dz G)_j + (Dz_S u)_j - t_j)``;
        for a party that neither S nor q touches it is ``a`` times G's, bounded by ``A_j``."""
        ms = self.ms
        T1 = ms.T + 1
        if not (math.isfinite(a) and np.all(np.isfinite(u))):
            a, u = 0.0, np.zeros_like(u)
        D = self.DzC[:, S]
        J = np.unique(np.concatenate([ms.row_q[D.indices], [q]]))
        rows = ms.rowid(np.arange(T1)[None, :], J[:, None])  # (|J|, T+1)
        j = ms.parties[q]
        t = np.where(ms.online[:, j], ms.c_o[:, j], 0.0)
        own = int(np.searchsorted(J, q))
        v = a * self.gz[rows]
        av = abs(a) * self.agz[rows]
        loc = np.searchsorted(J, ms.row_q[D.indices]) * T1 + ms.row_t[D.indices]
        cu = np.repeat(u, np.diff(D.indptr))
        v = v.ravel()
        av = av.ravel()
        v += np.bincount(loc, weights=D.data * cu, minlength=v.size)
        av += np.bincount(loc, weights=np.abs(D.data * cu), minlength=v.size)
        v = v.reshape(J.size, T1)
        av = av.reshape(J.size, T1)
        v[own] -= t
        av[own] += np.abs(t)
        bx, be = self._party_bounds(J, v, av)
        a2 = a * a * (1 + 2 * _EPS)
        rest_x = max(self.TX - _sum_down(self.AX2[J]), 0.0) * (1 + 2 * _EPS)
        rest_e = max(self.TE - _sum_down(self.AE2[J]), 0.0) * (1 + 2 * _EPS)
        rel = 1 + _gamma(J.size * T1 + 8)
        X = (_sum_up(bx * bx * (1 + 2 * _EPS)) + a2 * rest_x * (1 + 2 * _EPS)) * rel
        E = (_sum_up(be * be * (1 + 2 * _EPS)) + a2 * rest_e * (1 + 2 * _EPS)) * rel
        if ms.blocked[q]:  # pinned rows: the own unit change stays unexplained (as in bound._evaluate)
            X = max(X, 1.0) * rel
        return X, E

    # ------------------------------------------------------------------ the local problem
    def support(self, q: int) -> np.ndarray:
        """The unseen messages touching a party within one hop of slot q."""
        near = self.touches[self.touched_by[q].indices].indices
        near = np.unique(np.concatenate([near, [q]]))
        return np.unique(self.touched_by[near].indices)

    def solve(self, q: int, S: np.ndarray) -> tuple[np.ndarray, float]:
        """``(u, a)`` approximately minimizing ``||a LG + L_S u - b_q||`` (Jacobi-preconditioned CGLS)."""
        return self.solve_batch([q], [S])[0]

    def solve_batch(self, qs: list[int], supports: list[np.ndarray]) -> list[tuple[np.ndarray, float]]:
        """:meth:`solve` for several parties at once: their local problems side by side (a block-diagonal
        matrix and segment sums), so that each CGLS iteration is a few array operations for all."""
        ms = self.ms
        T1 = ms.T + 1
        Lc = self.L
        B = len(qs)
        data, indices, ptr, gls, bNs = [], [], [np.zeros(1, dtype=np.int64)], [], []
        m = np.zeros(B, dtype=np.int64)  # local rows per party
        k = np.array([S.size for S in supports], dtype=np.int64)  # local columns per party
        c = np.zeros(B)
        nnz = 0
        for i, (q, S) in enumerate(zip(qs, supports)):
            b_rows = ms.rowid(np.arange(T1), q)
            g = ms.groups[int(ms.group_of[q])]
            j = int(ms.parties[q])
            t = np.where(ms.online[:, j], ms.c_o[:, j], 0.0)
            starts, ends = Lc.indptr[S], Lc.indptr[S + 1]
            lens = ends - starts
            first = np.concatenate([[0], np.cumsum(lens)])
            idx = np.repeat(starts - first[:-1], lens) + np.arange(first[-1])
            # the rows touched, in order, by a mask over all rows (cheaper than sorting the indices)
            touched = Lc.indices[idx]
            self._mark[touched] = True
            self._mark[b_rows] = True
            rows = np.flatnonzero(self._mark)
            self._mark[rows] = False
            self._pos[rows] = np.arange(rows.size)
            data.append(Lc.data[idx])
            indices.append(self._pos[touched] + int(m.sum()))
            ptr.append(first[1:] + nnz)
            nnz += idx.size
            m[i] = rows.size
            bN = np.zeros(rows.size)
            bN[self._pos[b_rows]] = self.w[b_rows] * (np.zeros(T1) if g.blocked else g.P @ t)
            bNs.append(bN)
            gl = self.LG[rows]
            gls.append(gl)
            c[i] = math.sqrt(max(self.LG2 - float(gl @ gl), 0.0))
        A = sp.csc_matrix((np.concatenate(data), np.concatenate(indices), np.concatenate(ptr)),
                          shape=(int(m.sum()), int(k.sum())))
        AT = A.T.tocsr()
        gl = np.concatenate(gls)
        row_of = np.repeat(np.arange(B), m)  # party of each local row / column
        col_of = np.repeat(np.arange(B), k)

        def seg(v: np.ndarray, of: np.ndarray) -> np.ndarray:
            return np.bincount(of, weights=v, minlength=B)

        du = np.sqrt(np.asarray(A.multiply(A).sum(axis=0)).ravel())
        du = np.where(du > 0, du, 1.0)
        da = math.sqrt(self.LG2) if self.LG2 > 0 else 1.0

        def mv(zu: np.ndarray, za: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            aa = za / da
            return A @ (zu / du) + aa[row_of] * gl, aa * c

        def mtv(r: np.ndarray, rc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            return (AT @ r) / du, (seg(gl * r, row_of) + c * rc) / da

        r, rc = np.concatenate(bNs), np.zeros(B)
        zu, za = np.zeros(A.shape[1]), np.zeros(B)
        su, sa = mtv(r, rc)
        pu, pa = su.copy(), sa.copy()
        gam = seg(su * su, col_of) + sa * sa
        for _ in range(self.iterations):
            qu, qa = mv(pu, pa)
            qq = seg(qu * qu, row_of) + qa * qa
            ok = (gam > 0) & (qq > 0) & np.isfinite(gam) & np.isfinite(qq)
            if not ok.any():
                break
            al = np.where(ok, gam / np.where(ok, qq, 1.0), 0.0)
            zu += al[col_of] * pu
            za += al * pa
            r -= al[row_of] * qu
            rc -= al * qa
            su, sa = mtv(r, rc)
            gn = seg(su * su, col_of) + sa * sa
            be = np.where(ok, gn / np.where(ok, gam, 1.0), 0.0)
            pu = su + be[col_of] * pu
            pa = sa + be * pa
            gam = np.where(ok, gn, 0.0)
        zu = zu / du
        za = za / da
        offs = np.concatenate([[0], np.cumsum(k)])
        return [(zu[offs[i]: offs[i + 1]], float(za[i])) for i in range(B)]

    def bound(self, q: int) -> tuple[float, float]:
        """Rigorous ``(X_q, E_q)`` of the local ``dy`` of the party in slot q."""
        return self.bounds(np.array([q]))[0]

    def bounds(self, qs: np.ndarray) -> list[tuple[float, float]]:
        """Rigorous ``(X_q, E_q)`` of the local ``dy`` of each party in slots ``qs`` (solved together)."""
        supports = [self.support(int(q)) for q in qs]
        sols = self.solve_batch([int(q) for q in qs], supports)
        return [self.evaluate(int(q), S, u, a) for q, S, (u, a) in zip(qs, supports, sols)]
