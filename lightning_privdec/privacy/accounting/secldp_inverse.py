"""The linear algebra of Decor's per-round accountant (:mod:`.secldp_step`): ``max_{|I| = q} max_{i in H}
[(I + rho L_H)^{-1}]_ii`` over every set ``I`` of q colluding nodes (Decor Algorithms 2 and 3, with sigma_cdp = 1 and
rho = sigma_cor^2 / sigma_cdp^2).

The diagonal of the inverse is computed exactly (no estimators; accurate to machine precision times the
condition number ``1 + sigma_cor^2 lambda_max(L) / sigma_cdp^2``, as any method): banded Cholesky after a reverse
Cuthill-McKee ordering plus the Takahashi selected-inversion recurrence (``O(n b^2)`` for bandwidth ``b``), or dense
LAPACK when the bandwidth is large. Deletions (curious/colluding adversaries) are rank-``|E_I|`` Woodbury updates of
the full-graph inverse, polished by iterative refinement. The eavesdropper on a ring of 5000 nodes takes ~30 ms,
on a 50 x 100 torus well under a second; the curious adversary on a 1000-node ring or torus about half a second.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
import scipy.linalg as sla
import scipy.sparse as sp
from scipy.sparse.csgraph import reverse_cuthill_mckee

from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = ["MAX_COLLUDING_SUBSETS", "colluding_sets", "laplacian", "normalized_step"]

Method = Literal["auto", "banded", "dense"]

#: Algorithm 3 enumerates all C(n, q) colluding sets; beyond this many we refuse (use the closed-form bound)
MAX_COLLUDING_SUBSETS = 20_000

#: the dense path holds an n x n matrix; beyond this it would need gigabytes
_DENSE_MAX_NODES = 12_000
#: deletions are processed in chunks of this many colluding sets (bounds the columns of the inverse held at once)
_CHUNK = 128


_THREADPOOLS: Any = None


def _single_threaded_blas() -> contextlib.AbstractContextManager[Any]:
    """Limit BLAS to one thread around loops of tiny BLAS calls (OpenBLAS's spinning workers slow them ~20x on a
    loaded machine); a no-op without threadpoolctl."""
    global _THREADPOOLS
    if _THREADPOOLS is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - optional
            _THREADPOOLS = False
        else:
            _THREADPOOLS = ThreadpoolController()
    if _THREADPOOLS is False:
        return contextlib.nullcontext()
    return _THREADPOOLS.limit(limits=1, user_api="blas")


def laplacian(adj: sp.csr_array) -> sp.csr_array:
    """The graph Laplacian D - A of a symmetric 0/1 adjacency."""
    degrees = np.asarray(adj.sum(axis=1)).ravel()
    return sp.csr_array(sp.diags_array(degrees, format="csr") - adj)


class _Inverse:
    """Exact ``(I + rho L)^{-1}`` for one graph: its diagonal and any of its columns.

    ``banded``: reverse Cuthill-McKee ordering, banded Cholesky ``LL^T`` (LAPACK pbtrf), and the Takahashi
    recurrence ``Z_ij = delta_ij / d_i - sum_{k > i} L_ki Z_kj`` restricted to the band (``O(n b^2)``).
    ``dense``: Cholesky and triangular inverse (LAPACK potrf/trtri), ``O(n^3)``.
    """

    def __init__(self, adj: sp.csr_array, rho: float, method: Method = "auto") -> None:
        self.n = n = adj.shape[0]
        if method not in ("auto", "banded", "dense"):
            raise PrivacyConfigError(f"method must be 'auto', 'banded' or 'dense', got {method!r}")
        matrix = sp.csr_array(sp.identity(n, format="csr") + rho * laplacian(adj))
        perm, band = None, n - 1
        if method == "banded" or (method == "auto" and n > 96):
            perm = reverse_cuthill_mckee(sp.csr_matrix(adj), symmetric_mode=True).astype(np.intp)
            coo = adj[perm][:, perm].tocoo()
            band = int(np.max(np.abs(coo.row - coo.col))) if coo.nnz else 0
        if method == "auto":
            # rough seconds: a Python step of O(b^2) per row (Takahashi) vs O(n^3) BLAS
            banded_cost = n * (8e-6 + 4e-9 * band * band)
            method = "banded" if perm is not None and (banded_cost <= 1e-10 * n**3 or n > _DENSE_MAX_NODES) else "dense"
        self.method = method
        self._full: np.ndarray | None = None
        too_big = (
            f"the exact accountant on this {n}-node graph would need more than a few GB (its bandwidth after "
            f"reordering is {band}); use secldp_step_bound (Decor Thm. 1/6) instead"
        )
        if method == "dense":
            if n > _DENSE_MAX_NODES:
                raise PrivacyConfigError(too_big)
            upper, info = sla.lapack.dpotrf(matrix.toarray(), lower=0, clean=1)
            if info != 0:
                raise PrivacyConfigError("Cholesky factorization failed: the noise covariance is not positive definite")
            self._rinv, info = sla.lapack.dtrtri(upper, lower=0)  # M^{-1} = R^{-1} R^{-T}
            self._diag = np.einsum("ij,ij->i", self._rinv, self._rinv)
        else:
            assert perm is not None
            if (band + 1) * (n + band) * 8 > 2e9:
                raise PrivacyConfigError(too_big)
            permuted = matrix[perm][:, perm].tocoo()
            lower = permuted.row >= permuted.col
            storage = np.zeros((band + 1, n))
            storage[(permuted.row - permuted.col)[lower], permuted.col[lower]] = permuted.data[lower]
            self._chol = sla.cholesky_banded(storage, lower=True)
            self._perm = perm
            self._diag = np.empty(n)
            with _single_threaded_blas():
                self._diag[perm] = self._takahashi(self._chol)

    @staticmethod
    def _takahashi(chol: np.ndarray) -> np.ndarray:
        """Diagonal of ``A^{-1}`` from the lower banded Cholesky factor of ``A`` (selected inversion)."""
        band, n = chol.shape[0] - 1, chol.shape[1]
        pivots = chol[0]
        inv_d = 1.0 / (pivots * pivots)
        unit = chol[1:] / pivots  # unit[m - 1, i] = L_{i+m, i} / L_{ii}
        diag = np.empty(n)
        window = np.zeros((band, band))  # Z[S, S] for S = (i+1 .. i+band)
        for i in range(n - 1, -1, -1):
            column = unit[:, i]
            z = -(window @ column)
            zii = inv_d[i] - column @ z
            diag[i] = zii
            if band:
                nxt = np.empty((band, band))
                nxt[0, 0] = zii
                nxt[1:, 0] = z[:-1]
                nxt[0, 1:] = z[:-1]
                nxt[1:, 1:] = window[:-1, :-1]
                window = nxt
        return diag

    def diag(self) -> np.ndarray:
        return self._diag

    def solve(self, rhs: np.ndarray) -> np.ndarray:
        """``Z @ rhs`` for an (n,) or (n, k) array."""
        if self.method == "dense":
            if self._full is not None:
                return self._full @ rhs
            return self._rinv @ (self._rinv.T @ rhs)
        solved = sla.cho_solve_banded((self._chol, True), rhs[self._perm], check_finite=False)
        out = np.empty_like(solved)
        out[self._perm] = solved
        return out

    def columns(self, index: np.ndarray) -> np.ndarray:
        """``Z[:, index]`` (n x len(index))."""
        index = np.asarray(index, dtype=np.intp)
        if self.method == "dense" and self._full is None and len(index) * 4 > self.n:
            self._full = self._rinv @ self._rinv.T
        if self.method == "dense" and self._full is not None:
            return self._full[:, index]
        rhs = np.zeros((self.n, len(index)))
        rhs[index, np.arange(len(index))] = 1.0
        return self.solve(rhs)


def colluding_sets(n: int, q: int) -> Iterator[tuple[int, ...]]:
    """Every set of q colluding nodes out of n (Decor Alg. 3), refused above :data:`MAX_COLLUDING_SUBSETS`."""
    count = math.comb(n, q)
    if count > MAX_COLLUDING_SUBSETS:
        raise PrivacyConfigError(
            f"the exact accountant against {q} colluding nodes enumerates all C({n}, {q}) = {count:,} colluding sets "
            f"(Decor Alg. 3), more than {MAX_COLLUDING_SUBSETS:,}; use the closed-form bound secldp_step_bound "
            f"(Decor Thm. 6, eq. (13)) instead"
        )
    return itertools.combinations(range(n), q)


class _Deletions:
    """``max_{h in H} [(I + rho L_H)^{-1}]_hh`` for many deleted sets ``I`` (``H = V \\ I``), from one inverse.

    Removing the ``r`` edges with an endpoint in ``I`` turns ``M = I + rho L`` into ``M_I = (I + rho L_H) (+) I_q``.
    With ``K`` their incidence vectors, ``Y = Z K`` and the (positive definite) capacitance
    ``Cap = I/rho - K^T Y``, Woodbury gives ``M_I^{-1} = Z + Y Cap^{-1} Y^T``: O(n r^2) per set instead of a new
    factorization. The entries that can be the maximum are then polished by iterative refinement against the exact
    sparse ``M_I`` (Woodbury alone loses digits when rho is large, worst when a deletion disconnects the graph).
    Small honest sets, sets touching many edges, and updates that do not converge are factorized directly.
    """

    def __init__(self, adj: sp.csr_array, rho: float, method: Method) -> None:
        self.adj, self.rho, self.method = adj, rho, method
        self.n = adj.shape[0]
        self.laplacian = laplacian(adj)
        self.full = _Inverse(adj, rho, method)
        self.base = self.full.diag()

    def neighbours(self, v: int) -> np.ndarray:
        return self.adj.indices[self.adj.indptr[v]:self.adj.indptr[v + 1]]

    def direct(self, honest: np.ndarray) -> float:
        sub = sp.csr_array(self.adj[honest][:, honest])
        return float(np.max(_Inverse(sub, self.rho, self.method).diag()))

    def worst(self, subsets: Iterator[tuple[int, ...]]) -> float:
        worst = 0.0
        while True:
            chunk = list(itertools.islice(subsets, _CHUNK))
            if not chunk:
                return worst
            touched = {v for subset in chunk for v in subset}
            needed = np.array(sorted(touched | {int(w) for v in touched for w in self.neighbours(v)}), dtype=np.intp)
            position = np.full(self.n, -1, dtype=np.intp)
            position[needed] = np.arange(len(needed))
            block = self.full.columns(needed) if len(needed) else np.zeros((self.n, 0))
            with _single_threaded_blas():
                for deleted in chunk:
                    worst = max(worst, self.one(deleted, block, position))

    def one(self, deleted: tuple[int, ...], block: np.ndarray, position: np.ndarray) -> float:
        n, rho = self.n, self.rho
        honest_mask = np.ones(n, dtype=bool)
        honest_mask[list(deleted)] = False
        honest_count = n - len(deleted)
        edges = sorted({(min(u, int(v)), max(u, int(v))) for u in deleted for v in self.neighbours(u)})
        if not edges:  # deleting isolated vertices changes nothing for the others
            return float(np.max(self.base[honest_mask]))
        if honest_count <= 64 or len(edges) ** 2 > 4 * honest_count:
            return self.direct(np.flatnonzero(honest_mask))
        heads = np.array([e[0] for e in edges], dtype=np.intp)
        tails = np.array([e[1] for e in edges], dtype=np.intp)
        y = block[:, position[heads]] - block[:, position[tails]]  # n x r
        capacitance = np.eye(len(edges)) / rho - (y[heads] - y[tails])
        try:
            chol = np.linalg.cholesky(0.5 * (capacitance + capacitance.T))
        except np.linalg.LinAlgError:
            return self.direct(np.flatnonzero(honest_mask))
        p = sla.solve_triangular(chol, y.T, lower=True, check_finite=False).T  # Y Cap^{-1} Y^T = P P^T
        approx = self.base + np.einsum("ij,ij->i", p, p)
        approx[~honest_mask] = -np.inf
        top = float(np.max(approx))
        if not (np.isfinite(top) and (1.0 - 1e-6) / honest_count <= top <= 1.0 + 1e-6):
            return self.direct(np.flatnonzero(honest_mask))

        def apply_approx(v: np.ndarray) -> np.ndarray:  # ~M_I^{-1} v, kept zero on the deleted rows
            out = self.full.solve(v) + p @ (p.T @ v)
            out[~honest_mask] = 0.0
            return out

        def apply_exact(x: np.ndarray) -> np.ndarray:  # M_I x = x + rho (L x - K K^T x), for x zero on I
            kx = x[heads] - x[tails]
            out = x + rho * (self.laplacian @ x)
            np.subtract.at(out, heads, rho * kx)
            np.add.at(out, tails, rho * kx)
            return out

        # Refine the entries that can be the maximum. Woodbury's error e is measured on them; any entry whose
        # approximation is more than 4e below the top cannot be the maximum, otherwise widen and repeat.
        window = 1e-6
        for _ in range(4):
            candidates = np.flatnonzero(approx >= top - window * top)
            if len(candidates) > 64:
                return self.direct(np.flatnonzero(honest_mask))
            diagonal = (candidates, np.arange(len(candidates)))
            rhs = np.zeros((n, len(candidates)))
            rhs[diagonal] = 1.0
            x = apply_approx(rhs)
            previous = math.inf
            for _ in range(12):  # iterative refinement against the exact sparse M_I
                step = apply_approx(rhs - apply_exact(x))
                x += step
                change = float(np.max(np.abs(step[diagonal])) / np.max(np.abs(x[diagonal])))
                if change <= 1e-14 or (change > 0.5 * previous and change <= 1e-10):
                    break  # converged, or stalled at the conditioning of M_I (any method's accuracy)
                previous = change
            else:
                return self.direct(np.flatnonzero(honest_mask))
            refined = x[diagonal]
            error = float(np.max(np.abs(refined - approx[candidates]) / refined))
            if 4.0 * error <= window:
                others = np.delete(approx, candidates)
                outside = float(np.max(others)) * (1.0 + error) if len(others) else -np.inf
                return min(max(float(np.max(refined)), outside), 1.0)
            window = 8.0 * error
        return self.direct(np.flatnonzero(honest_mask))


def normalized_step(adj: sp.csr_array, rho: float, q: int, method: Method) -> float:
    """``max_{|I|=q} max_{i in H} [(I + rho L_H)^{-1}]_ii`` (Decor Alg. 3 with sigma_cdp = 1)."""
    n = adj.shape[0]
    subsets = colluding_sets(n, q)
    if adj.nnz == n * (n - 1):  # complete graph: every honest set is complete, Sigma^{-1} has two eigenvalues
        honest = n - q
        return 1.0 / honest + (1.0 - 1.0 / honest) / (1.0 + rho * honest)
    if q == 0:
        return float(np.max(_Inverse(adj, rho, method).diag()))
    return _Deletions(adj, rho, method).worst(subsets)
