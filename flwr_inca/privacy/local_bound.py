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

Two engines compute the same bounds: ``"numpy"`` (this module: CGLS on an explicit sparse system, then
:meth:`LocalTier.evaluate_batch`) and ``"compiled"`` (:mod:`~flwr_inca.privacy.local_compiled`, numba: the
supports, the search and the same rigorous evaluation as compiled loops, several times faster).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from . import local_compiled
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


def _ranges(indptr: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, lengths)``: the concatenated index ranges ``indptr[c] : indptr[c + 1]`` of ``cols``."""
    starts = indptr[cols]
    lens = indptr[cols + 1] - starts
    first = np.concatenate([[0], np.cumsum(lens)])
    return np.repeat(starts - first[:-1], lens) + np.arange(first[-1]), lens


class _Batch:
    """The local problems of several parties side by side (block b = the party in slot ``qs[b]``).

    ``S``: the support columns of every block, concatenated (``k[b]`` of them per block); ``J``: the
    parties those columns touch, plus the party itself, sorted by block then slot (``Jstart`` delimits the
    blocks); ``pos(b, slots)`` gives the position of a party of block b in ``J``. Block b's local rows are
    ``Jstart[b] * (T+1) ... Jstart[b+1] * (T+1)``: every row of its parties, party-major.
    """

    def __init__(self, tier: LocalTier, qs: np.ndarray) -> None:
        ms = tier.ms
        nH = ms.nH
        self.qs = qs = np.asarray(qs, dtype=np.int64)
        B = self.B = qs.size
        blocks = np.arange(B, dtype=np.int64)
        # the parties within one hop of each q, then the unseen messages touching any of them
        pos, lens = _ranges(tier.near.indptr, qs)
        near_keys = np.repeat(blocks, lens) * nH + tier.near.indices[pos]
        near_b, near_p = near_keys // nH, near_keys % nH
        pos, lens = _ranges(tier.touched_by.indptr, near_p)
        keys = np.unique(np.repeat(near_b, lens) * ms.U + tier.touched_by.indices[pos])
        self.S = keys % ms.U
        self.col_block = keys // ms.U
        self.k = np.bincount(self.col_block, minlength=B)
        self.Kstart = np.concatenate([[0], np.cumsum(self.k)])
        # the parties the support columns touch (and q itself), by block
        pos, lens = _ranges(tier.DzC.indptr, self.S)
        self.d_pos, self.d_block = pos, np.repeat(self.col_block, lens)
        self.d_col = np.repeat(np.arange(self.S.size), lens)  # support column of each Dz entry
        keys = np.unique(np.concatenate([self.d_block * nH + ms.row_q[tier.DzC.indices[pos]], blocks * nH + qs]))
        self.J = keys % nH
        self.J_block = keys // nH
        self.Jstart = np.searchsorted(self.J_block, np.arange(B + 1))
        self._map = np.empty(B * nH, dtype=np.int64)
        self._map[keys] = np.arange(keys.size)
        self.own = self._map[blocks * nH + qs]  # position of each q in J
        self.nH = nH

    def pos(self, block: np.ndarray, slots: np.ndarray) -> np.ndarray:
        return self._map[block * self.nH + slots]

    def supports(self) -> list[np.ndarray]:
        return [self.S[self.Kstart[b]: self.Kstart[b + 1]] for b in range(self.B)]


class LocalTier:
    """Local bounds ``(X_q, E_q)`` for the parties of one :class:`MessageSpace` (see the module docstring).

    Args:
        ms: the message space.
        G: (U,) the shared global ``dy`` (float64; any vector is sound, a good one is tight).
        s_star, s_delta: nominal sigmas of the local least-squares problems (the bound holds for all).
        iterations: CGLS iterations per party.
        dtype: precision of the NumPy search (CGLS); the evaluation is float64 with rounding margins
            whatever the search did, so float32 cannot make a bound unsound, only (slightly) less tight.
        engine: ``"compiled"`` (:mod:`~flwr_inca.privacy.local_compiled`: supports, a float64 search and
            the same rigorous evaluation, compiled by numba), ``"numpy"`` (CGLS on an explicit sparse system,
            in ``dtype``) or ``"auto"`` (compiled when numba imports). Every bound of either engine is
            rigorous; the compiled one is several times faster (benchmarks/RESULTS.md).
    """

    def __init__(self, ms: MessageSpace, G: np.ndarray, s_star: float, s_delta: float,
                 iterations: int = 20, dtype: type = np.float32, engine: str = "auto") -> None:
        if engine not in ("auto", "compiled", "numpy"):
            raise ValueError(f"engine must be 'auto', 'compiled' or 'numpy', got {engine!r}")
        if engine == "compiled" and not local_compiled.available():
            raise ValueError("engine='compiled' needs numba (pip install 'flwr-inca[scale]'); "
                             "use engine='numpy' or 'auto'")
        if engine == "auto":
            engine = "compiled" if local_compiled.available() else "numpy"
        self.engine = engine
        self.ms = ms
        self.iterations = int(iterations)
        self.dtype = np.dtype(dtype)
        T1 = ms.T + 1
        G = np.asarray(G, dtype=float).ravel()
        if G.size != ms.U or not np.all(np.isfinite(G)):
            G = np.zeros(ms.U)
        self.G = G
        # the whitened operator L = W P Dz is applied column by column from Dz's entries (never formed)
        self.w = np.where(ms.row_t == 0, 1.0 / s_star, 1.0 / s_delta)
        self.DzC = ms.Dz.tocsc()
        self.DzC.sort_indices()
        coo = ms.Dz.tocoo()
        touches = sp.csr_matrix((np.ones(coo.nnz), (coo.col, ms.row_q[coo.row])), shape=(ms.U, ms.nH))
        touches.sum_duplicates()
        self.touches = touches
        self.touched_by = touches.T.tocsr()
        self.touched_by.sort_indices()
        # parties within one hop (linked by an unseen message), each party included
        near = (self.touched_by @ touches + sp.identity(ms.nH, format="csr")).tocsr()
        near.sort_indices()
        self.near = near
        self.LG = self.w * ms.apply_P((ms.Dz @ G)[:, None])[:, 0]
        self.LG2 = float(self.LG @ self.LG)
        self.Pst = np.stack([g.P for g in ms.groups]) if ms.groups else np.zeros((0, T1, T1))
        self.absPst = np.abs(self.Pst)
        wv = np.where(np.arange(T1) == 0, 1.0 / s_star, 1.0 / s_delta)
        blocked_g = np.array([g.blocked for g in ms.groups], dtype=bool)
        WP = np.where(blocked_g[:, None, None], 0.0, wv[None, :, None] * self.Pst)  # W P_g, 0 if pinned
        self.WPcols = np.ascontiguousarray(np.swapaxes(WP, 1, 2))  # [g, t]: column t of W P_g
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
        # u_j = P_g v_j for the parties of each group g (one product per group; no per-party copy of P)
        gJ = ms.group_of[J]
        order = np.argsort(gJ, kind="stable")
        cuts = np.flatnonzero(np.diff(gJ[order])) + 1
        res = np.empty_like(v)
        absres = np.empty_like(v)
        vabs = np.abs(v) + av
        for sel in np.split(order, cuts):
            if sel.size == 0:
                continue
            g = int(gJ[sel[0]])
            res[sel] = v[sel] @ self.Pst[g].T
            absres[sel] = vabs[sel] @ self.absPst[g].T
        # |P (v_exact - v)| <= gamma_v |P| av and the rounding of P v is <= gamma_{T+1} |P| |v|: both are
        # covered by gamma_r |P| (|v| + av), gamma_r >= gamma_v + gamma_{T+1} (absres rounded up)
        absres *= 1 + _gamma(T1 + 4)
        up = np.abs(res) + self.gamma_r * absres
        # ||v_j|| of the exact v_j, for the defect of the computed right inverse (added per party)
        vn = np.sqrt(np.sum((np.abs(v) + self.gamma_v * av) ** 2, axis=1)) * (1 + _gamma(T1 + 4))
        extra = self.defect[J] * vn * (1 + 4 * _EPS)
        bx = (up[:, 0] + extra) * (1 + 4 * _EPS)
        be = (np.sqrt(np.sum(up[:, 1:] ** 2, axis=1)) * (1 + _gamma(T1 + 4)) + extra) * (1 + 4 * _EPS)
        return bx, be

    def evaluate(self, q: int, S: np.ndarray, u: np.ndarray, a: float) -> tuple[float, float]:
        """Rigorous ``(X, E)`` upper bounds of the cost of ``dy = a G + u`` (u on the columns S, which must
        be :meth:`support` ``(q)``) for the party in slot q (:meth:`evaluate_batch` for one party)."""
        batch = _Batch(self, np.array([q]))
        if not np.array_equal(batch.S, np.asarray(S)):
            raise ValueError("S must be the support of party q (LocalTier.support)")
        X, E = self.evaluate_batch(batch, np.asarray(u, dtype=float), np.array([a], dtype=float))
        return float(X[0]), float(E[0])

    def evaluate_batch(self, batch: _Batch, u: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rigorous ``(X, E)`` upper bounds of the cost of ``dy_b = a_b G + u_b`` for every block b of
        ``batch`` (``u``: the concatenated support values). Exact residual of party j in block b:
        ``u_j = P_exact_j (a_b (Dz G)_j + (Dz_S u_b)_j - t_j)``; for a party that neither S_b nor q_b
        touches it is ``a_b`` times G's, bounded by ``A_j`` (summed once for all parties)."""
        ms = self.ms
        T1 = ms.T + 1
        B = batch.B
        u = np.array(u, dtype=float)
        a = np.array(a, dtype=float)
        # a block whose search did not stay finite falls back to dy = 0 (always admissible)
        bad = ~np.isfinite(a) | (np.bincount(batch.col_block, weights=~np.isfinite(u), minlength=B) > 0)
        a[bad] = 0.0
        u[bad[batch.col_block]] = 0.0
        u[~np.isfinite(u)] = 0.0
        J, Jb = batch.J, batch.J_block
        rows = ms.rowid(np.arange(T1)[None, :], J[:, None])  # (|J|, T+1)
        v = a[Jb][:, None] * self.gz[rows]
        av = np.abs(a)[Jb][:, None] * self.agz[rows]
        D = self.DzC
        r = D.indices[batch.d_pos]
        loc = batch.pos(batch.d_block, ms.row_q[r]) * T1 + ms.row_t[r]
        cu = D.data[batch.d_pos] * np.repeat(u, np.diff(D.indptr)[batch.S])
        v = v.ravel()
        av = av.ravel()
        v += np.bincount(loc, weights=cu, minlength=v.size)
        av += np.bincount(loc, weights=np.abs(cu), minlength=v.size)
        v = v.reshape(J.size, T1)
        av = av.reshape(J.size, T1)
        t = self._own_targets(batch.qs)  # (B, T+1)
        v[batch.own] -= t
        av[batch.own] += np.abs(t)
        bx, be = self._party_bounds(J, v, av)
        sizes = np.diff(batch.Jstart)
        starts = batch.Jstart[:-1]
        up = 1 + np.array([_gamma(int(s) + 2) for s in sizes])
        down = 1 - (up - 1)

        def seg(x: np.ndarray) -> np.ndarray:  # per-block sums (every block holds at least q itself)
            return np.add.reduceat(x, starts)

        a2 = a * a * (1 + 2 * _EPS)
        rest_x = np.maximum(self.TX - seg(self.AX2[J]) * down, 0.0) * (1 + 2 * _EPS)
        rest_e = np.maximum(self.TE - seg(self.AE2[J]) * down, 0.0) * (1 + 2 * _EPS)
        rel = 1 + np.array([_gamma(int(s) * T1 + 8) for s in sizes])
        X = (seg(bx * bx * (1 + 2 * _EPS)) * up + a2 * rest_x * (1 + 2 * _EPS)) * rel
        E = (seg(be * be * (1 + 2 * _EPS)) * up + a2 * rest_e * (1 + 2 * _EPS)) * rel
        # pinned rows: the own unit change stays unexplained (as in bound._evaluate)
        blocked = ms.blocked[batch.qs]
        X = np.where(blocked, np.maximum(X, 1.0) * rel, X)
        return X, E

    # ------------------------------------------------------------------ the local problem
    def support(self, q: int) -> np.ndarray:
        """The unseen messages touching a party within one hop of slot q."""
        return _Batch(self, np.array([q])).S

    def solve(self, q: int, S: np.ndarray) -> tuple[np.ndarray, float]:
        """``(u, a)`` approximately minimizing ``||a LG + L_S u - b_q||`` (column-scaled CGLS); S must be
        :meth:`support` ``(q)``."""
        batch = _Batch(self, np.array([q]))
        if not np.array_equal(batch.S, np.asarray(S)):
            raise ValueError("S must be the support of party q (LocalTier.support)")
        u, a = self.solve_batch(batch)
        return u, float(a[0])

    def system(self, batch: _Batch) -> tuple[sp.csc_matrix, np.ndarray, np.ndarray]:
        """``(A, rhs, row_start)``: the local least-squares problems of ``batch`` as one block-diagonal
        float64 system ``min ||A [u; a] - rhs||`` (columns: the support columns of every block, then one
        a column per block). Block b's rows are ``row_start[b] : row_start[b+1]`` plus row ``M0 + b``
        (``M0 = row_start[-1]``), which holds ``c_b``, the norm of LG outside the block's rows (the rest of
        ``a_b``'s residual). Its cost at any ``(u_b, a_b)`` equals ``||a_b LG + L_{S_b} u_b - b_q||^2``.

        Column c of ``L = W P Dz`` on party j is ``sum_t Dz[(t, j), c] (W P_j)[:, t]``: it is built from
        Dz's few entries per column. A party of J that only ``m < T`` support columns touch (and not the
        party being bounded, whose rows hold the right-hand side) contributes ``||Y_j [a; u_cols]||^2``,
        ``Y_j = [LG_j, L_j,cols]`` ((T+1) x (m+1)); its T+1 rows are replaced by the m+1 rows of ``R_j``,
        ``R_j^T R_j = Y_j^T Y_j`` (the same cost). Most parties of a one-hop support are touched by one or
        two messages, so this shrinks the rows several-fold. It is the search's system only: the
        evaluation is on the original rows, so nothing here can affect soundness.
        """
        ms = self.ms
        T1 = ms.T + 1
        B = batch.B
        nJ = batch.J.size
        K = int(batch.Kstart[-1])
        D = self.DzC
        # every Dz entry of the support columns: its party (position in J), step, column and W P column
        dr = D.indices[batch.d_pos]
        d_unit = batch.pos(batch.d_block, ms.row_q[dr])
        d_val = D.data[batch.d_pos]
        e_vec = self.WPcols[ms.group_of[batch.J[d_unit]], ms.row_t[dr]] * d_val[:, None]  # (E, T+1)
        grow = ms.rowid(np.arange(T1)[None, :], batch.J[:, None])
        gl = self.LG[grow]  # (nJ, T+1)
        gl2 = np.add.reduceat(np.sum(gl * gl, axis=1), batch.Jstart[:-1])
        c = np.sqrt(np.maximum(self.LG2 - gl2, 0.0))
        # distinct (party, column) pairs
        keys = d_unit * K + batch.d_col
        pairs = np.unique(keys)
        p_unit = pairs // K
        count = np.bincount(p_unit, minlength=nJ)
        comp = (count + 1 < T1) & ~ms.blocked[batch.J]
        comp[batch.own] = False
        width = np.where(comp, count + 1, T1)  # rows of each party in the system
        start = np.concatenate([[0], np.cumsum(width)])
        a_col = K + batch.J_block
        # the parties kept whole: T+1 rows, every column's W P column, LG
        ku = np.flatnonzero(~comp)
        dk = ~comp[d_unit]
        rows = [(start[d_unit[dk]][:, None] + np.arange(T1)[None, :]).ravel(),
                (start[ku][:, None] + np.arange(T1)[None, :]).ravel()]
        cols = [np.repeat(batch.d_col[dk], T1), np.repeat(a_col[ku], T1)]
        vals = [e_vec[dk].ravel(), gl[ku].ravel()]
        # the compressed parties: Y packed by width (party k of width w at [off[k], off[k] + (T+1) w),
        # row-major (T+1, w)), filled by one bincount, then one Cholesky per width
        first = np.searchsorted(p_unit, np.arange(nJ))
        rank = np.arange(pairs.size) - first[p_unit]  # column slot of each pair within its party
        dc = ~dk
        e_unit, e_rank = d_unit[dc], rank[np.searchsorted(pairs, keys[dc])]
        cu = np.flatnonzero(comp)
        off = np.zeros(nJ, dtype=np.int64)
        by_width = cu[np.argsort(width[cu], kind="stable")]
        sizes = T1 * width[by_width]
        off[by_width] = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        idx = off[e_unit][:, None] + np.arange(T1)[None, :] * width[e_unit][:, None] + 1 + e_rank[:, None]
        flat = np.bincount(idx.ravel(), weights=e_vec[dc].ravel(), minlength=int(sizes.sum()))
        flat[(off[cu][:, None] + np.arange(T1)[None, :] * width[cu][:, None]).ravel()] = gl[cu].ravel()
        pair_col = pairs % K
        ws = width[by_width]
        for sel in np.split(by_width, np.flatnonzero(np.diff(ws)) + 1):
            if sel.size == 0:
                continue
            w = int(width[sel[0]])
            o = int(off[sel[0]])
            Yc = flat[o: o + sel.size * T1 * w].reshape(sel.size, T1, w)
            Gm = np.swapaxes(Yc, 1, 2) @ Yc  # (N, w, w) Gram matrices
            ridge = 1e-12 * np.trace(Gm, axis1=1, axis2=2) + 1e-300
            Rt = np.linalg.cholesky(Gm + ridge[:, None, None] * np.eye(w))  # lower: R^T
            # R[i, j] = Rt[j, i] for i <= j: row start + i, column j (0: a, j >= 1: the party's j-th pair)
            i, j = np.triu_indices(w)
            colmap = np.concatenate([a_col[sel][:, None], pair_col[first[sel][:, None] + np.arange(w - 1)]],
                                    axis=1)
            rows.append((start[sel][:, None] + i[None, :]).ravel())
            cols.append(colmap[:, j].ravel())
            vals.append(Rt[:, j, i].ravel())
        row_start = start[batch.Jstart]
        M0 = int(row_start[-1])
        rows.append(M0 + np.arange(B))
        cols.append(K + np.arange(B))
        vals.append(c)
        vals = np.concatenate(vals)
        nz = vals != 0
        A = sp.csc_matrix((vals[nz], (np.concatenate(rows)[nz], np.concatenate(cols)[nz])), shape=(M0 + B, K + B))
        # right-hand side: the party's own rows, w P t (0 for pinned rows)
        t = self._own_targets(batch.qs)  # (B, T+1)
        bt = np.einsum("bts,bs->bt", self.Pst[ms.group_of[batch.qs]], t)
        bt[ms.blocked[batch.qs]] = 0.0
        own_rows = ms.rowid(np.arange(T1)[None, :], batch.qs[:, None])
        rhs = np.zeros(M0 + B)
        rhs[(start[batch.own][:, None] + np.arange(T1)[None, :]).ravel()] = (self.w[own_rows] * bt).ravel()
        return A, rhs, row_start

    def solve_batch(self, batch: _Batch) -> tuple[np.ndarray, np.ndarray]:
        """``(u, a)`` for every block of ``batch`` at once (u concatenated by block), by the compiled
        search (:mod:`~flwr_inca.privacy.local_compiled`) or :meth:`solve_batch_numpy` (``engine``)."""
        if self.engine == "compiled":
            return self.solve_batch_compiled(batch)
        return self.solve_batch_numpy(batch)

    def _kernel_arrays(self) -> dict:
        """The arrays the compiled kernels read (int64 indices, float64 values), built on first use (the
        NumPy engine never needs them). The search's per-party data: ``GZ`` (n_H, T+1) ``gz_j``, ``Mg``
        (groups, T+1, T+1) ``M_g = (W P_g)^T W P_g``, ``MG`` ``M_j gz_j`` and ``gMg`` ``gz_j^T M_j gz_j``."""
        if not hasattr(self, "_k"):
            ms = self.ms
            T1 = ms.T + 1
            rows = ms.rowid(np.arange(T1)[None, :], np.arange(ms.nH)[:, None])
            i64 = (lambda x: np.ascontiguousarray(x, dtype=np.int64))
            GZ = np.ascontiguousarray(self.gz[rows])
            Mg = np.ascontiguousarray(self.WPcols @ np.swapaxes(self.WPcols, 1, 2))
            MG = np.empty_like(GZ)
            for g, grp in enumerate(ms.groups):  # slots of a group are contiguous; M_g is symmetric
                MG[grp.start: grp.stop] = GZ[grp.start: grp.stop] @ Mg[g]
            self._k = {
                "indptr": i64(self.DzC.indptr), "indices": i64(self.DzC.indices),
                "data": self.DzC.data.astype(float), "near_ptr": i64(self.near.indptr),
                "near_idx": i64(self.near.indices), "tb_ptr": i64(self.touched_by.indptr),
                "tb_idx": i64(self.touched_by.indices), "AGZ": np.ascontiguousarray(self.agz[rows]),
                "GZ": GZ, "Mg": Mg, "MG": MG, "gMg": np.einsum("jt,jt->j", GZ, MG)}
        return self._k

    def _own_targets(self, qs: np.ndarray) -> np.ndarray:
        """(B, T+1) each party's own unit change ``t_q`` (its injection rows)."""
        ms = self.ms
        hon = ms.parties[qs]
        return np.ascontiguousarray(np.where(ms.online[:, hon], ms.c_o[:, hon], 0.0).T, dtype=float)

    def solve_batch_compiled(self, batch: _Batch) -> tuple[np.ndarray, np.ndarray]:
        """Jacobi-preconditioned CG on each block's normal equations, compiled (float64)."""
        k = self._kernel_arrays()
        return self._search(batch.qs.astype(np.int64), batch.S.astype(np.int64), batch.Kstart.astype(np.int64), k)

    def _search(self, qs: np.ndarray, S: np.ndarray, Kstart: np.ndarray, k: dict) -> tuple[np.ndarray, np.ndarray]:
        ms = self.ms
        return local_compiled.solve_blocks(
            qs, S, Kstart, k["indptr"], k["indices"], k["data"], ms.row_q, ms.row_t, ms.group_of, k["Mg"],
            k["GZ"], k["MG"], k["gMg"], float(self.LG2), self._own_targets(qs), ms.blocked[qs], self.iterations)

    def _bounds_compiled(self, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                                          np.ndarray, np.ndarray]:
        """``(X, E, S, Kstart, u, a)`` of the parties in slots ``qs``: supports, search and rigorous
        evaluation, each compiled (the twins of ``_Batch``, :meth:`solve_batch_numpy` and
        :meth:`evaluate_batch`)."""
        ms = self.ms
        k = self._kernel_arrays()
        qs = np.ascontiguousarray(qs, dtype=np.int64)
        S, Kstart = local_compiled.supports(qs, k["near_ptr"], k["near_idx"], k["tb_ptr"], k["tb_idx"], ms.U)
        u, a = self._search(qs, S, Kstart, k)
        X, E = self.evaluate_compiled(qs, S, Kstart, u, a)
        return X, E, S, Kstart, u, a

    def evaluate_compiled(self, qs: np.ndarray, S: np.ndarray, Kstart: np.ndarray, u: np.ndarray,
                          a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`evaluate_batch`, compiled: rigorous ``(X, E)`` of ``dy_b = a_b G + u_b`` for the parties
        in slots ``qs`` (block b: support ``S[Kstart[b]:Kstart[b+1]]``, values ``u`` at the same places)."""
        ms = self.ms
        k = self._kernel_arrays()
        qs = np.ascontiguousarray(qs, dtype=np.int64)
        return local_compiled.evaluate_blocks(
            qs, np.ascontiguousarray(S, dtype=np.int64), np.ascontiguousarray(Kstart, dtype=np.int64),
            np.ascontiguousarray(u, dtype=float), np.ascontiguousarray(a, dtype=float), k["indptr"],
            k["indices"], k["data"], ms.row_q, ms.row_t, ms.group_of, self.Pst, self.absPst, self.defect,
            k["GZ"], k["AGZ"], self._own_targets(qs), ms.blocked[qs], self.AX2, self.AE2, float(self.TX),
            float(self.TE), float(self.gamma_v), float(self.gamma_r))

    def solve_batch_numpy(self, batch: _Batch) -> tuple[np.ndarray, np.ndarray]:
        """CGLS on :meth:`system` with its columns scaled to unit norm. Every CGLS scalar is per block, so
        the blocks do not interact: the same iterates as one party at a time, with one sparse product per
        iteration for all of them."""
        f = self.dtype
        B = batch.B
        K = int(batch.Kstart[-1])
        A, rhs, row_start = self.system(batch)
        M0 = int(row_start[-1])
        col_of = np.repeat(np.arange(K + B), np.diff(A.indptr))
        norm = np.sqrt(np.bincount(col_of, weights=A.data * A.data, minlength=K + B))
        norm = np.where(norm > 0, norm, 1.0)
        A.data /= norm[col_of]
        A = A.astype(f)
        rhs = rhs.astype(f)
        AT = A.T  # CSR view of the same arrays
        col_block = np.concatenate([batch.col_block, np.arange(B)])
        mrows = np.concatenate([np.diff(row_start), np.ones(B, dtype=np.int64)])
        rstarts = row_start[:-1]

        def rows_sum(x: np.ndarray) -> np.ndarray:  # per-block sums over the rows (M0 part, then extra)
            head = np.add.reduceat(x[:M0], rstarts) if M0 else np.zeros(B, dtype=x.dtype)
            return head + x[M0:]

        def rows_rep(s: np.ndarray) -> np.ndarray:
            return np.concatenate([np.repeat(s, mrows[:B]), s])

        def cols_sum(x: np.ndarray) -> np.ndarray:
            return np.bincount(col_block, weights=x, minlength=B)

        # each block's right-hand side scaled to unit norm (CGLS is linear in it): no overflow in float32
        scale = np.sqrt(rows_sum(rhs.astype(float) ** 2))
        scale = np.where((scale > 0) & np.isfinite(scale), scale, 1.0)
        res = rhs / rows_rep(scale).astype(f)
        z = np.zeros(K + B, dtype=f)
        s = AT @ res
        p = s.copy()
        gam = cols_sum(s * s)
        stop = gam * 1e-10  # a block stops once its normal-equations residual is negligible (float32)
        for _ in range(self.iterations):
            qv = A @ p
            qq = rows_sum(qv * qv)
            ok = (gam > stop) & (qq > 0) & np.isfinite(gam) & np.isfinite(qq)
            if not ok.any():
                break
            al = np.where(ok, gam / np.where(ok, qq, 1.0), 0.0).astype(f)
            z += al[col_block] * p
            res -= rows_rep(al) * qv
            s = AT @ res
            gn = cols_sum(s * s)
            ok &= np.isfinite(gn)
            be = np.where(ok, gn / np.where(ok, gam, 1.0), 0.0).astype(f)
            # a block that stopped keeps its iterate (its direction is zeroed, never inf or NaN)
            p = np.where(ok[col_block], s + be[col_block] * p, 0.0).astype(f)
            gam = np.where(ok, gn, 0.0)
        z = z.astype(float) * scale[col_block] / norm
        return z[:K], z[K:]

    def bound(self, q: int) -> tuple[float, float]:
        """Rigorous ``(X_q, E_q)`` of the local ``dy`` of the party in slot q."""
        X, E = self.bounds_array(np.array([q]))
        return float(X[0]), float(E[0])

    def bounds_array(self, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rigorous ``(X, E)`` arrays, one entry per party in slots ``qs``, of each party's local ``dy``
        (solved together)."""
        X, E, _ = self.bounds_and_dy(qs)
        return X, E

    def bounds_and_dy(self, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray, float]]]:
        """:meth:`bounds_array` and each party's local ``dy = a G + u`` as ``(support, u, a)`` (int32 support
        columns, float32 u: a start for the global solve, whose precision cannot affect soundness)."""
        qs = np.asarray(qs, dtype=np.int64)
        if self.engine == "compiled":
            X, E, S, ks, u, a = self._bounds_compiled(qs)
        else:
            batch = _Batch(self, qs)
            u, a = self.solve_batch_numpy(batch)
            X, E = self.evaluate_batch(batch, u, a)
            S, ks = batch.S, batch.Kstart
        dys = [(S[ks[b]: ks[b + 1]].astype(np.int32), u[ks[b]: ks[b + 1]].astype(np.float32), float(a[b]))
               for b in range(qs.size)]
        return X, E, dys
