"""The cascade's local tier compiled (optional: needs ``numba``; ``pip install 'flwr-inca[scale]'``).

Three kernels, each the compiled twin of a NumPy step of :class:`~flwr_inca.privacy.local_bound.LocalTier`
(which keeps the NumPy path as the reference and the fallback without numba):

* :func:`supports` -- each party's one-hop support (``_Batch``);
* :func:`solve_blocks` -- the search for ``(u_q, a_q)`` (``LocalTier.solve_batch_numpy``);
* :func:`evaluate_blocks` -- the rigorous float64 evaluation (``LocalTier.evaluate_batch``), the same
  operations with the same rounding margins (each margin covers any order of its sums).

The search looks, for each party q, for ``(u_q, a_q)`` minimizing the cost of ``dy_q = a_q G + u_q`` (u_q on the one-hop support ``S_q``):

    sum_{j in J_q} || W P_j (a gz_j + (Dz_S u)_j - [j = q] t_q) ||^2 + a^2 c_q^2,

where ``J_q`` are the parties the support touches (and q), ``gz_j`` the injection change of G at party j,
``t_q`` party q's own unit change, and ``c_q^2`` the part of ``||LG||^2`` outside ``J_q``. In the variables
``x = (u, a)`` the normal equations are a sum of small per-party blocks: party j sees ``a`` and the
``m_j`` support columns that touch it, through ``Y_j = [gz_j, y_1 .. y_m]`` ((T+1) x (m_j + 1); the y are
Dz's one or two entries of a column at party j), and contributes ``Y_j^T M_j Y_j`` with
``M_j = (W P_j)^T W P_j``. Lightly touched parties (``m_j + 1 < T + 1``, most of them) keep that Gram
block; the others (the one-hop parties, and q) apply ``M_j`` to ``Y_j x`` each time. Jacobi-preconditioned
CG on these normal equations has, in exact arithmetic, the iterates of the NumPy path's column-scaled
CGLS; both are only a *search*: the float64 evaluation with rounding margins (:func:`evaluate_blocks`, or
:meth:`LocalTier.evaluate_batch`) makes any result a sound bound, so the search cannot affect soundness.

The NumPy path spends most of its time building each batch's sparse system (about 60% of the local tier
at n = 10,000); here one compiled loop per party builds the blocks and runs the iterations in place.
"""

from __future__ import annotations

import numpy as np

try:  # optional: the NumPy engine is used without it
    import numba
except ImportError:  # pragma: no cover - exercised where numba is absent
    numba = None

__all__ = ["available", "evaluate_blocks", "solve_blocks", "supports"]


def available() -> bool:
    """Whether the compiled kernels can be used (``numba`` imports)."""
    return numba is not None


def _njit(fn):
    """Compiled lazily, on first call (without numba the functions stay plain Python, which the public
    wrappers refuse to run: the NumPy engine is the fallback). The machine code is cached on disk where numba finds a writable place for it (next to
    this file or in the user's cache directory); elsewhere, e.g. a read-only install with no home
    directory, each process compiles again (about 18 s on a 2-core machine,
    benchmarks/bench_numba_compile.py) instead of failing at import."""
    if numba is None:
        return fn
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return numba.njit(cache=False, nogil=True)(fn)


@_njit
def _solve_blocks_py(qs, S, Kstart, indptr, indices, data, row_q, row_t, group_of, Mg, GZ, MG, gMg, LG2,
                     T_own, skip, iterations):
    """``(u, a)``: the search for every block (party ``qs[b]``, support ``S[Kstart[b]:Kstart[b+1]]``).

    Arrays: ``indptr, indices, data``: Dz by columns (int64, int64, float64); ``row_q, row_t``: party slot
    and step of each Dz row; ``group_of``: group of each slot; ``Mg``: (groups, T+1, T+1) ``M_g``; ``GZ``,
    ``MG``: (n_H, T+1) ``gz_j`` and ``M_j gz_j``; ``gMg``: (n_H,) ``gz_j^T M_j gz_j``; ``LG2``: ``||LG||^2``;
    ``T_own``: (B, T+1) ``t_q``; ``skip``: (B,) blocks left at 0 (pinned parties: zero right-hand side).
    """
    nH, T1 = GZ.shape
    B = qs.size
    out_u = np.zeros(Kstart[B])
    out_a = np.zeros(B)
    mark = np.full(nH, -1, np.int64)
    jloc = np.zeros(nH, np.int64)
    for b in range(B):
        if skip[b]:
            continue
        q = qs[b]
        k0 = Kstart[b]
        K = Kstart[b + 1] - k0
        # ---- every Dz entry of the support columns, with the local index of its party (q is party 0)
        ne = 0
        for k in range(K):
            c = S[k0 + k]
            ne += indptr[c + 1] - indptr[c]
        ej = np.empty(ne, np.int64)
        et = np.empty(ne, np.int64)
        ek = np.empty(ne, np.int64)
        ev = np.empty(ne)
        J = np.empty(ne + 1, np.int64)
        J[0] = q
        mark[q] = b
        jloc[q] = 0
        nJ = 1
        i = 0
        for k in range(K):
            c = S[k0 + k]
            for e in range(indptr[c], indptr[c + 1]):
                r = indices[e]
                j = row_q[r]
                if mark[j] != b:
                    mark[j] = b
                    jloc[j] = nJ
                    J[nJ] = j
                    nJ += 1
                ej[i] = jloc[j]
                et[i] = row_t[r]
                ek[i] = k
                ev[i] = data[e]
                i += 1
        # ---- entries grouped by party (stable: by column within a party)
        pst = np.zeros(nJ + 1, np.int64)
        for i in range(ne):
            pst[ej[i] + 1] += 1
        for jl in range(nJ):
            pst[jl + 1] += pst[jl]
        fill = pst[:-1].copy()
        order = np.empty(ne, np.int64)
        for i in range(ne):
            order[fill[ej[i]]] = i
            fill[ej[i]] += 1
        # distinct columns (pairs) per party; Gram blocks of the lightly touched parties
        npair = np.zeros(nJ, np.int64)
        for jl in range(nJ):
            last = -1
            for s in range(pst[jl], pst[jl + 1]):
                k = ek[order[s]]
                if k != last:
                    npair[jl] += 1
                    last = k
        gram = np.zeros(nJ, np.bool_)
        hoff = np.zeros(nJ + 1, np.int64)  # offsets into hval ((m+1)^2 each)
        koff = np.zeros(nJ + 1, np.int64)  # offsets into hk (m each)
        for jl in range(nJ):
            m = npair[jl]
            gram[jl] = jl > 0 and m + 1 < T1
            hoff[jl + 1] = hoff[jl] + ((m + 1) * (m + 1) if gram[jl] else 0)
            koff[jl + 1] = koff[jl] + (m if gram[jl] else 0)
        hval = np.zeros(hoff[nJ])
        hk = np.empty(koff[nJ], np.int64)
        diag = np.zeros(K + 1)
        rest = LG2
        pstart = np.empty(T1 + 1, np.int64)  # pair boundaries within one party (m <= T here)
        for jl in range(nJ):
            j = J[jl]
            g = group_of[j]
            rest -= gMg[j]
            diag[K] += gMg[j]
            if gram[jl]:
                m = npair[jl]
                w = m + 1
                h0 = hoff[jl]
                hval[h0] = gMg[j]
                # pair boundaries
                p = 0
                last = -1
                for s in range(pst[jl], pst[jl + 1]):
                    k = ek[order[s]]
                    if k != last:
                        pstart[p] = s
                        hk[koff[jl] + p] = k
                        p += 1
                        last = k
                pstart[m] = pst[jl + 1]
                for a1 in range(m):
                    acc = 0.0
                    for s in range(pstart[a1], pstart[a1 + 1]):
                        o = order[s]
                        acc += ev[o] * MG[j, et[o]]
                    hval[h0 + a1 + 1] = acc
                    hval[h0 + (a1 + 1) * w] = acc
                    for a2 in range(a1, m):
                        acc = 0.0
                        for s in range(pstart[a1], pstart[a1 + 1]):
                            o = order[s]
                            for s2 in range(pstart[a2], pstart[a2 + 1]):
                                o2 = order[s2]
                                acc += ev[o] * ev[o2] * Mg[g, et[o], et[o2]]
                        hval[h0 + (a1 + 1) * w + a2 + 1] = acc
                        hval[h0 + (a2 + 1) * w + a1 + 1] = acc
                    diag[hk[koff[jl] + a1]] += hval[h0 + (a1 + 1) * w + a1 + 1]
            else:
                # diagonal of Y^T M Y over each pair's one or two entries
                s = pst[jl]
                while s < pst[jl + 1]:
                    k = ek[order[s]]
                    s2 = s
                    while s2 < pst[jl + 1] and ek[order[s2]] == k:
                        s2 += 1
                    acc = 0.0
                    for x1 in range(s, s2):
                        o = order[x1]
                        for x2 in range(s, s2):
                            o2 = order[x2]
                            acc += ev[o] * ev[o2] * Mg[g, et[o], et[o2]]
                    diag[k] += acc
                    s = s2
        c2 = max(0.0, rest)
        diag[K] += c2
        for k in range(K + 1):
            if not diag[k] > 0.0:
                diag[k] = 1.0
        # ---- right-hand side Y_q^T M_q t_q
        gq = group_of[q]
        Mt = np.zeros(T1)
        for t1 in range(T1):
            acc = 0.0
            for t2 in range(T1):
                acc += Mg[gq, t1, t2] * T_own[b, t2]
            Mt[t1] = acc
        rhs = np.zeros(K + 1)
        acc = 0.0
        for t1 in range(T1):
            acc += MG[q, t1] * T_own[b, t1]
        rhs[K] = acc
        for s in range(pst[0], pst[1]):
            o = order[s]
            rhs[ek[o]] += ev[o] * Mt[et[o]]
        # ---- Jacobi-preconditioned CG on the normal equations
        x = np.zeros(K + 1)
        res = rhs.copy()
        z = res / diag
        pv = z.copy()
        rz = 0.0
        for k in range(K + 1):
            rz += res[k] * z[k]
        stop = rz * 1e-20
        v = np.empty(T1)
        zz = np.empty(T1)
        xs = np.empty(T1)
        Np = np.empty(K + 1)
        for _ in range(iterations):
            if not (rz > stop) or not np.isfinite(rz):
                break
            Np[:] = 0.0
            for jl in range(nJ):
                j = J[jl]
                if gram[jl]:
                    m = npair[jl]
                    w = m + 1
                    h0 = hoff[jl]
                    xs[0] = pv[K]
                    for a1 in range(m):
                        xs[a1 + 1] = pv[hk[koff[jl] + a1]]
                    for a1 in range(w):
                        acc = 0.0
                        for a2 in range(w):
                            acc += hval[h0 + a1 * w + a2] * xs[a2]
                        if a1 == 0:
                            Np[K] += acc
                        else:
                            Np[hk[koff[jl] + a1 - 1]] += acc
                else:
                    g = group_of[j]
                    for t1 in range(T1):
                        v[t1] = pv[K] * GZ[j, t1]
                    for s in range(pst[jl], pst[jl + 1]):
                        o = order[s]
                        v[et[o]] += ev[o] * pv[ek[o]]
                    for t1 in range(T1):
                        acc = 0.0
                        for t2 in range(T1):
                            acc += Mg[g, t1, t2] * v[t2]
                        zz[t1] = acc
                    acc = 0.0
                    for t1 in range(T1):
                        acc += GZ[j, t1] * zz[t1]
                    Np[K] += acc
                    for s in range(pst[jl], pst[jl + 1]):
                        o = order[s]
                        Np[ek[o]] += ev[o] * zz[et[o]]
            Np[K] += c2 * pv[K]
            pq = 0.0
            for k in range(K + 1):
                pq += pv[k] * Np[k]
            if not (pq > 0.0) or not np.isfinite(pq):
                break
            al = rz / pq
            rzn = 0.0
            for k in range(K + 1):
                x[k] += al * pv[k]
                res[k] -= al * Np[k]
                z[k] = res[k] / diag[k]
                rzn += res[k] * z[k]
            be = rzn / rz
            for k in range(K + 1):
                pv[k] = z[k] + be * pv[k]
            rz = rzn
        for k in range(K):
            out_u[k0 + k] = x[k]
        out_a[b] = x[K]
    return out_u, out_a


@_njit
def _supports_py(qs, near_ptr, near_idx, tb_ptr, tb_idx, U):
    """``(S, Kstart)``: the unseen messages touching a party within one hop of each ``qs[b]``, sorted, block
    after block (``near``: parties within one hop, ``tb``: messages touching each party; both CSR)."""
    B = qs.size
    mark = np.full(U, -1, np.int64)
    counts = np.zeros(B + 1, np.int64)
    parts = []
    for b in range(B):
        q = qs[b]
        n_cols = 0
        for e in range(near_ptr[q], near_ptr[q + 1]):
            p = near_idx[e]
            n_cols += tb_ptr[p + 1] - tb_ptr[p]
        cols = np.empty(n_cols, np.int64)
        k = 0
        for e in range(near_ptr[q], near_ptr[q + 1]):
            p = near_idx[e]
            for f in range(tb_ptr[p], tb_ptr[p + 1]):
                c = tb_idx[f]
                if mark[c] != b:
                    mark[c] = b
                    cols[k] = c
                    k += 1
        cols = np.sort(cols[:k])
        parts.append(cols)
        counts[b + 1] = counts[b] + k
    S = np.empty(counts[B], np.int64)
    for b in range(B):
        S[counts[b]: counts[b + 1]] = parts[b]
    return S, counts


@_njit
def _gamma(n):
    eps = 1.1102230246251565e-16  # unit roundoff of float64
    return n * eps / (1.0 - n * eps)


@_njit
def _evaluate_blocks_py(qs, S, Kstart, u, a, indptr, indices, data, row_q, row_t, group_of, Pst, absPst,
                        defect, GZ, AGZ, T_own, blocked, AX2, AE2, TX, TE, gamma_v, gamma_r):
    """Rigorous ``(X, E)`` of ``dy_b = a_b G + u_b`` for every block: ``LocalTier.evaluate_batch`` step by
    step (a block whose search is not finite is evaluated at ``dy = 0``). ``Pst, absPst``: (groups, T+1,
    T+1) ``P_g`` and ``|P_g|``; ``AGZ``: (n_H, T+1) ``|Dz| |G|``; ``defect``: per slot; the rest as in
    :func:`_solve_blocks_py` and ``LocalTier.__init__``."""
    eps = 1.1102230246251565e-16
    nH, T1 = GZ.shape
    B = qs.size
    X = np.empty(B)
    E = np.empty(B)
    mark = np.full(nH, -1, np.int64)
    jloc = np.zeros(nH, np.int64)
    g_t = 1.0 + _gamma(T1 + 4)
    for b in range(B):
        q = qs[b]
        k0 = Kstart[b]
        K = Kstart[b + 1] - k0
        ab = a[b]
        ok = np.isfinite(ab)
        for k in range(K):
            if not np.isfinite(u[k0 + k]):
                ok = False
        if not ok:
            ab = 0.0
        # the parties the support touches (q first) and their injection change v, with its error scale av
        n_e = 0
        for k in range(K):
            c = S[k0 + k]
            n_e += indptr[c + 1] - indptr[c]
        J = np.empty(n_e + 1, np.int64)
        J[0] = q
        mark[q] = b
        jloc[q] = 0
        nJ = 1
        for k in range(K):
            c = S[k0 + k]
            for e in range(indptr[c], indptr[c + 1]):
                j = row_q[indices[e]]
                if mark[j] != b:
                    mark[j] = b
                    jloc[j] = nJ
                    J[nJ] = j
                    nJ += 1
        V = np.empty((nJ, T1))
        AV = np.empty((nJ, T1))
        aa = abs(ab)
        for jl in range(nJ):
            j = J[jl]
            for t in range(T1):
                V[jl, t] = ab * GZ[j, t]
                AV[jl, t] = aa * AGZ[j, t]
        if ok:
            for k in range(K):
                c = S[k0 + k]
                uk = u[k0 + k]
                for e in range(indptr[c], indptr[c + 1]):
                    r = indices[e]
                    jl = jloc[row_q[r]]
                    cu = data[e] * uk
                    V[jl, row_t[r]] += cu
                    AV[jl, row_t[r]] += abs(cu)
        for t in range(T1):
            V[0, t] -= T_own[b, t]
            AV[0, t] += abs(T_own[b, t])
        # per party: bounds on |u_j[0]| and ||u_j[1:]|| of the exact u_j = P_j v_j (LocalTier._party_bounds)
        sx = 0.0
        se = 0.0
        ax = 0.0
        ae = 0.0
        for jl in range(nJ):
            j = J[jl]
            g = group_of[j]
            vn2 = 0.0
            for t in range(T1):
                w = abs(V[jl, t]) + gamma_v * AV[jl, t]
                vn2 += w * w
            vn = np.sqrt(vn2) * g_t
            extra = defect[j] * vn * (1.0 + 4.0 * eps)
            e2 = 0.0
            bx = 0.0
            for t in range(T1):
                res = 0.0
                absres = 0.0
                for s in range(T1):
                    res += Pst[g, t, s] * V[jl, s]
                    absres += absPst[g, t, s] * (abs(V[jl, s]) + AV[jl, s])
                absres *= g_t
                up = abs(res) + gamma_r * absres
                if t == 0:
                    bx = up
                else:
                    e2 += up * up
            bx = (bx + extra) * (1.0 + 4.0 * eps)
            be = (np.sqrt(e2) * g_t + extra) * (1.0 + 4.0 * eps)
            sx += bx * bx * (1.0 + 2.0 * eps)
            se += be * be * (1.0 + 2.0 * eps)
            ax += AX2[j]
            ae += AE2[j]
        up_b = 1.0 + _gamma(nJ + 2)
        down = 1.0 - (up_b - 1.0)
        a2 = ab * ab * (1.0 + 2.0 * eps)
        rest_x = max(TX - ax * down, 0.0) * (1.0 + 2.0 * eps)
        rest_e = max(TE - ae * down, 0.0) * (1.0 + 2.0 * eps)
        rel = 1.0 + _gamma(nJ * T1 + 8)
        xb = (sx * up_b + a2 * rest_x * (1.0 + 2.0 * eps)) * rel
        eb = (se * up_b + a2 * rest_e * (1.0 + 2.0 * eps)) * rel
        if blocked[b]:  # pinned rows: the own unit change stays unexplained
            xb = max(xb, 1.0) * rel
        X[b] = xb
        E[b] = eb
    return X, E


def _need() -> None:
    if numba is None:
        raise RuntimeError("the compiled local tier needs numba: pip install 'flwr-inca[scale]'")


def solve_blocks(*args):
    """:func:`_solve_blocks_py`, compiled."""
    _need()
    return _solve_blocks_py(*args)


def supports(*args):
    """:func:`_supports_py`, compiled."""
    _need()
    return _supports_py(*args)


def evaluate_blocks(*args):
    """:func:`_evaluate_blocks_py`, compiled."""
    _need()
    return _evaluate_blocks_py(*args)
