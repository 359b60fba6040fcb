"""The SecLDP accountant of Decor (Allouah, Koloskova, El Firdoussi, Jaggi, Guerraoui, ICML 2024).

Mechanism (Decor, Alg. 1, line 4; Thm. 6 proof, eq. (14)): every round, node ``i`` releases

    g~_i = g_i + sum_{j in N_i} v_ij + vbar_i,   v_ij = -v_ji ~ N(0, sigma_cor^2 I),   vbar_i ~ N(0, sigma_cdp^2 I),

with ``g_i`` clipped to norm ``C``. An adversary that knows the pairwise secrets of a set ``I`` of ``q`` nodes
subtracts their noise; the honest nodes ``H`` are then seen with covariance ``sigma_cdp^2 I + sigma_cor^2 L_H``
(``L_H``: Laplacian of the subgraph induced by ``H``; Thm. 6 proof, eqs. (15)-(19)). By the Gaussian Renyi
divergence (Lemma 4) each round is ``(alpha, alpha * eps_step)``-SecRDP (Definition 4) with

    eps_step = (Delta^2 / 2) * max_{|I| = q} max_{i in H} [(sigma_cdp^2 I + sigma_cor^2 L_H)^{-1}]_ii

(Algorithms 2 and 3). Adversaries: ``"eavesdropper"`` (q = 0), ``"curious"`` (q = 1, non-colluding
honest-but-curious nodes), or an integer ``q`` of colluders; ``q = n - 1`` is local DP.

Sensitivity convention (``level=``):

* ``"user"`` (default, the paper's): one node's per-round input is replaced, ``X_A - X_B = 2C e_i`` (Thm. 6
  proof, eq. (17)), so ``Delta = 2C`` and ``eps_step = 2 C^2 max_i [...]_ii`` exactly as in Alg. 2. With
  ``sigma_cor = 0`` this is the LDP baseline ``eps_step = 2 C^2 / sigma^2``, i.e. ``sigma_LDP = C sqrt(2/eps_step)``.
* ``"example"``: one example of the node's shard is added or removed under Poisson sampling, and the noise is
  added to the *sum* of per-example clipped gradients (the DP-SGD convention of :mod:`.accountants` and
  ``privatize_gradients``; dividing by the expected batch size afterwards is post-processing). Then
  ``Delta = C``: the paper's "sensitivity C/b" in units of the batch mean. Add/remove adjacency is what Opacus's
  Poisson subsampled-Gaussian RDP (Mironov, Talwar, Zhang 2019) assumes.

Composition and conversion: ``T`` rounds are ``(alpha, T alpha eps_step)``-SecRDP (Lemma 10), converted with
Lemma 11 at the optimal order (proof of Cor. 12). Example level: the whitened mechanism is a Gaussian with noise
multiplier ``1 / sqrt(2 eps_step)``; we amplify by Poisson subsampling, compose the subsampled RDP over ``T``
rounds, and only then convert to (epsilon, delta) (not the other way round, a known defect of the paper's code).

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
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import networkx as nx
import numpy as np
import scipy.linalg as sla
import scipy.sparse as sp
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from scipy.optimize import brentq
from scipy.sparse.csgraph import reverse_cuthill_mckee

from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = [
    "ADVERSARIES",
    "LEVELS",
    "MAX_COLLUDING_SUBSETS",
    "Adversary",
    "CalibrationResult",
    "SecLDPCandidate",
    "calibrate_secldp",
    "cdp_sigma",
    "collusion_level",
    "eps_step_for",
    "ldp_sigma",
    "secldp_epsilon",
    "secldp_epsilon_example_level",
    "secldp_step",
    "secldp_step_bound",
    "secldp_sensitivity",
]

Adversary = Union[str, int]
Level = Literal["user", "example"]
Method = Literal["auto", "banded", "dense"]

#: named adversaries and their collusion level q (Decor, Sec. 2: I = eavesdropper, II = curious users)
ADVERSARIES: dict[str, int] = {"eavesdropper": 0, "curious": 1}
LEVELS: tuple[str, ...] = ("user", "example")

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


# ---- validation ---------------------------------------------------------------------------------------------------
def _number(value: Any, name: str, *, minimum: float = 0.0, strict: bool = False, allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise PrivacyConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise PrivacyConfigError(f"{name} must be finite, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise PrivacyConfigError(f"{name} must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return value


def _delta(delta: Any) -> float:
    delta = _number(delta, "delta")
    if not 0.0 < delta < 1.0:
        raise PrivacyConfigError(f"delta must lie strictly between 0 and 1, got {delta!r} (e.g. 1e-5)")
    return delta


def _steps(steps: Any, minimum: int = 0) -> int:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < minimum:
        raise PrivacyConfigError(f"steps must be an integer >= {minimum}, got {steps!r}")
    return int(steps)


def _sample_rate(sample_rate: Any) -> float:
    sample_rate = _number(sample_rate, "sample_rate")
    if not 0.0 < sample_rate <= 1.0:
        raise PrivacyConfigError(f"sample_rate must lie in (0, 1], got {sample_rate!r} (q = B / J on the shard)")
    return sample_rate


def collusion_level(adversary: Adversary, num_nodes: int | None = None) -> int:
    """The number q of colluding nodes for ``"eavesdropper"`` (0), ``"curious"`` (1) or an integer q >= 0."""
    if isinstance(adversary, str):
        key = adversary.strip().lower()
        if key in ADVERSARIES:
            q = ADVERSARIES[key]
        elif key.isdigit():
            q = int(key)
        else:
            raise PrivacyConfigError(
                f"unknown adversary {adversary!r}; use 'eavesdropper', 'curious' or a number q of colluding nodes"
            )
    elif isinstance(adversary, (int, np.integer)) and not isinstance(adversary, bool):
        q = int(adversary)
    else:
        raise PrivacyConfigError(f"adversary must be 'eavesdropper', 'curious' or an integer q, got {adversary!r}")
    if q < 0:
        raise PrivacyConfigError(f"the number of colluding nodes must be >= 0, got {q}")
    if num_nodes is not None and q >= num_nodes:
        raise PrivacyConfigError(
            f"{q} colluding nodes out of {num_nodes} leave nobody to protect; q must be at most n - 1 = "
            f"{num_nodes - 1} (q = n - 1 is local DP)"
        )
    return q


def secldp_sensitivity(clip: float, level: Level = "user") -> float:
    """L2 sensitivity of one node's per-round input: ``2C`` (user level, replace-one; Decor Thm. 6 proof, eq. (17))
    or ``C`` (example level, add/remove one example of the clipped sum under Poisson sampling)."""
    clip = _number(clip, "clip", strict=True)
    if level == "user":
        return 2.0 * clip
    if level == "example":
        return clip
    raise PrivacyConfigError(f"level must be 'user' or 'example', got {level!r}")


# ---- graphs -------------------------------------------------------------------------------------------------------
def _adjacency(graph: Any) -> sp.csr_array:
    """Symmetric 0/1 adjacency (no self-loops) of an undirected graph; a DiGraph must have every edge both ways."""
    if hasattr(graph, "union_graph") and hasattr(graph, "is_symmetric"):  # a lightning_privdec Topology
        if not graph.is_symmetric:
            raise PrivacyConfigError(
                f"topology {getattr(graph, 'name', graph)!r} is directed; Decor's pairwise noise v_ij = -v_ji needs "
                "an undirected graph (use 'ring', 'torus', 'complete' or 'erdos-renyi')"
            )
        if not graph.is_static:
            raise PrivacyConfigError("time-varying topologies are not supported: pass one round's graph")
        graph = graph.graph(0)
    if not isinstance(graph, nx.Graph):
        raise PrivacyConfigError(f"graph must be a networkx graph or a Topology, got {type(graph).__name__}")
    n = graph.number_of_nodes()
    if n == 0:
        raise PrivacyConfigError("the graph has no nodes")
    try:
        nodes = sorted(graph.nodes)
    except TypeError:
        nodes = list(graph.nodes)
    adj = sp.csr_array(nx.to_scipy_sparse_array(graph, nodelist=nodes, weight=None, format="csr", dtype=float))
    adj.setdiag(0.0)
    adj.eliminate_zeros()
    adj.data[:] = 1.0
    if graph.is_directed() and (adj != adj.T).nnz:
        raise PrivacyConfigError(
            "the graph is directed (some edge has no reverse edge); Decor's pairwise noise v_ij = -v_ji needs an "
            "undirected graph"
        )
    return adj


def _laplacian(adj: sp.csr_array) -> sp.csr_array:
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
        matrix = sp.csr_array(sp.identity(n, format="csr") + rho * _laplacian(adj))
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
            self._perm, self.bandwidth = perm, band
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


def _colluding_sets(n: int, q: int) -> Iterator[tuple[int, ...]]:
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
        self.laplacian = _laplacian(adj)
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


def _normalized_step(adj: sp.csr_array, rho: float, q: int, method: Method) -> float:
    """``max_{|I|=q} max_{i in H} [(I + rho L_H)^{-1}]_ii`` (Decor Alg. 3 with sigma_cdp = 1)."""
    n = adj.shape[0]
    subsets = _colluding_sets(n, q)
    if adj.nnz == n * (n - 1):  # complete graph: every honest set is complete, Sigma^{-1} has two eigenvalues
        honest = n - q
        return 1.0 / honest + (1.0 - 1.0 / honest) / (1.0 + rho * honest)
    if q == 0:
        return float(np.max(_Inverse(adj, rho, method).diag()))
    return _Deletions(adj, rho, method).worst(subsets)


# ---- per-round accountant ---------------------------------------------------------------------------------------
def secldp_step(
    graph: nx.Graph | Any,
    sigma_cdp: float,
    sigma_cor: float,
    clip: float,
    adversary: Adversary = "eavesdropper",
    *,
    level: Level = "user",
    method: Method = "auto",
) -> float:
    """Exact per-round SecRDP slope ``eps_step``: each Decor round is ``(alpha, alpha * eps_step)``-SecRDP.

    Decor Alg. 2 (eavesdropper, curious) and Alg. 3 (q colluders):
    ``eps_step = (Delta^2/2) max_{|I|=q} max_{i in H} [(sigma_cdp^2 I + sigma_cor^2 L_H)^{-1}]_ii`` with
    ``Delta = 2C`` at user level (``2 C^2 max [...]_ii`` as in the paper) and ``Delta = C`` at example level (see the
    module docstring). ``graph`` is an undirected ``nx.Graph``, a symmetric ``nx.DiGraph`` or a static undirected
    Topology. ``sigma_cor = 0`` gives the LDP value ``Delta^2 / (2 sigma_cdp^2)``; ``sigma_cdp = 0`` gives ``inf``.
    ``method`` picks the linear algebra ("banded" Takahashi selected inversion or "dense"); results agree to
    rounding. Against q colluders all ``C(n, q)`` sets are enumerated (refused above :data:`MAX_COLLUDING_SUBSETS`).
    """
    adj = _adjacency(graph)
    q = collusion_level(adversary, adj.shape[0])
    sigma_cdp = _number(sigma_cdp, "sigma_cdp")
    sigma_cor = _number(sigma_cor, "sigma_cor")
    return _step(adj, sigma_cdp, sigma_cor, secldp_sensitivity(clip, level), q, method)


def _step(adj: sp.csr_array, sigma_cdp: float, sigma_cor: float, sensitivity: float, q: int, method: Method) -> float:
    scale = sensitivity**2 / 2.0
    if sigma_cdp == 0.0:
        return math.inf  # the sum of the releases is noiseless (Decor Thm. 1 discussion)
    if sigma_cor == 0.0 or adj.shape[0] - q == 1:
        return scale / sigma_cdp**2  # no correlated noise left to hide behind: local DP
    rho = (sigma_cor / sigma_cdp) ** 2
    return scale * _normalized_step(adj, rho, q, method) / sigma_cdp**2


def _min_algebraic_connectivity(adj: sp.csr_array, q: int) -> float:
    n = adj.shape[0]
    worst = math.inf
    for deleted in _colluding_sets(n, q):
        honest = np.setdiff1d(np.arange(n), np.asarray(deleted, dtype=np.intp))
        sub = sp.csr_array(adj[honest][:, honest])
        if len(honest) <= 2000:
            value = float(sla.eigvalsh(_laplacian(sub).toarray(), subset_by_index=[1, 1])[0])
        else:
            value = float(nx.algebraic_connectivity(nx.from_scipy_sparse_array(sub), method="tracemin_lu"))
        worst = min(worst, max(value, 0.0))
    return worst


def secldp_step_bound(
    graph: nx.Graph | Any,
    sigma_cdp: float,
    sigma_cor: float,
    clip: float,
    q: Adversary = 0,
    *,
    level: Level = "user",
    algebraic_connectivity: float | None = None,
) -> float:
    """The paper's closed-form bound on ``eps_step`` (Decor Thm. 1 for q = 0, 1; Thm. 6, eq. (13) for any q):

    ``eps_step <= (Delta^2/2) [1/((n-q) sigma_cdp^2) + (1 - 1/(n-q)) / (sigma_cdp^2 + a_q(G) sigma_cor^2)]``,

    ``a_q(G)`` = minimum algebraic connectivity over the subgraphs left after deleting q vertices (computed over all
    ``C(n, q)`` sets with one eigenvalue problem each, so pass ``algebraic_connectivity`` for large graphs). Always
    ``>=`` :func:`secldp_step` (equal on the complete graph); often much looser on sparse graphs.
    """
    adj = _adjacency(graph)
    n = adj.shape[0]
    q = collusion_level(q, n)
    sigma_cdp = _number(sigma_cdp, "sigma_cdp")
    sigma_cor = _number(sigma_cor, "sigma_cor")
    scale = secldp_sensitivity(clip, level) ** 2 / 2.0
    if sigma_cdp == 0.0:
        return math.inf
    honest = n - q
    if honest == 1:
        return scale / sigma_cdp**2
    if algebraic_connectivity is None:
        a_q = _min_algebraic_connectivity(adj, q)
    else:
        a_q = _number(algebraic_connectivity, "algebraic_connectivity")
    return scale * (1.0 / (honest * sigma_cdp**2) + (1.0 - 1.0 / honest) / (sigma_cdp**2 + a_q * sigma_cor**2))


# ---- composition and conversion ---------------------------------------------------------------------------------
def secldp_epsilon(eps_step: float, steps: int, delta: float) -> float:
    """(epsilon, delta)-SecLDP after ``steps`` rounds of an ``(alpha, alpha eps_step)``-SecRDP mechanism.

    Composition (Decor Lemma 10) gives ``(alpha, T alpha eps_step)``; conversion (Lemma 11) gives
    ``T alpha eps_step + log(1/delta)/(alpha - 1)``, minimized at ``alpha* = 1 + sqrt(log(1/delta)/(T eps_step))``:
    ``epsilon = T eps_step + 2 sqrt(T eps_step log(1/delta))`` (proof of Decor Cor. 12).
    """
    eps_step = _number(eps_step, "eps_step", allow_inf=True)
    steps = _steps(steps)
    log_inv_delta = math.log(1.0 / _delta(delta))
    total = steps * eps_step if steps else 0.0
    if math.isinf(total):
        return math.inf
    return total + 2.0 * math.sqrt(total * log_inv_delta)


def eps_step_for(target_epsilon: float, steps: int, delta: float) -> float:
    """The per-round slope whose :func:`secldp_epsilon` is ``target_epsilon``:
    ``(sqrt(log(1/delta) + epsilon) - sqrt(log(1/delta)))^2 / T`` (inverse of the closed form)."""
    target_epsilon = _number(target_epsilon, "target_epsilon", strict=True)
    steps = _steps(steps, minimum=1)
    log_inv_delta = math.log(1.0 / _delta(delta))
    # sqrt(L + eps) - sqrt(L), written without cancellation
    root = target_epsilon / (math.sqrt(log_inv_delta + target_epsilon) + math.sqrt(log_inv_delta))
    return root * root / steps


def _orders(orders: Sequence[float] | None) -> list[float]:
    return list(RDPAccountant.DEFAULT_ALPHAS if orders is None else orders)


def secldp_epsilon_example_level(
    eps_step: float,
    steps: int,
    delta: float,
    sample_rate: float,
    *,
    orders: Sequence[float] | None = None,
) -> float:
    """Example-level (epsilon, delta) after ``steps`` rounds with Poisson sampling at rate ``sample_rate``.

    ``eps_step`` is the un-amplified slope at the example-level sensitivity (:func:`secldp_step` with
    ``level="example"``, i.e. ``Delta = C`` on the clipped sum). Whitening the honest releases by ``Sigma^{-1/2}``
    turns one round into a Gaussian mechanism whose sensitivity is ``Delta sqrt(max_i Sigma^{-1}_ii)``, i.e. noise
    multiplier ``z = 1/sqrt(2 eps_step)``; only the node holding the example is affected. We take the RDP of the
    Poisson subsampled Gaussian (Mironov, Talwar, Zhang 2019) at each order, multiply by ``T`` (compose), and then
    convert with Opacus's ``get_privacy_spent`` (Balle et al. 2020, Thm. 21) -- exactly Opacus's
    ``RDPAccountant`` for history ``[(z, sample_rate, steps)]``. Poisson sampling (not the paper's sampling without
    replacement, Wang et al. 2019) matches :func:`~lightning_privdec.privacy.poisson_dataloader`.
    """
    eps_step = _number(eps_step, "eps_step", allow_inf=True)
    steps = _steps(steps)
    delta = _delta(delta)
    sample_rate = _sample_rate(sample_rate)
    if steps == 0 or eps_step == 0.0:
        return 0.0
    if math.isinf(eps_step):
        return math.inf
    alphas = _orders(orders)
    noise_multiplier = 1.0 / math.sqrt(2.0 * eps_step)
    rdp = rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=alphas)
    epsilon, _ = rdp_analysis.get_privacy_spent(orders=alphas, rdp=rdp, delta=delta)
    return float(epsilon)


def _example_eps_step_for(
    target_epsilon: float, steps: int, delta: float, sample_rate: float, orders: Sequence[float] | None
) -> float:
    """The largest eps_step (relative precision 1e-10) whose example-level epsilon is <= target (bisection)."""

    def epsilon(x: float) -> float:
        return secldp_epsilon_example_level(x, steps, delta, sample_rate, orders=orders)

    lo = hi = eps_step_for(target_epsilon, steps, delta)
    for _ in range(400):
        if epsilon(hi) > target_epsilon:
            break
        lo, hi = hi, hi * 2.0
    else:
        raise PrivacyConfigError(f"target_epsilon={target_epsilon:g} is reached without any noise")
    for _ in range(400):
        if epsilon(lo) <= target_epsilon:
            break
        lo, hi = lo / 2.0, lo
    else:
        raise PrivacyConfigError(f"target_epsilon={target_epsilon:g} cannot be reached at delta={delta:g}")
    while hi / lo > 1.0 + 1e-10:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if epsilon(mid) <= target_epsilon else (lo, mid)
    return lo


# ---- baselines ----------------------------------------------------------------------------------------------------
def ldp_sigma(clip: float, eps_step: float, *, level: Level = "user") -> float:
    """LDP baseline noise (``sigma_cor = 0``): ``Delta / sqrt(2 eps_step)``, i.e. ``C sqrt(2) / sqrt(eps_step)`` at
    user level (Decor Sec. 6 and App. D.1)."""
    eps_step = _number(eps_step, "eps_step", strict=True)
    return secldp_sensitivity(clip, level) / math.sqrt(2.0 * eps_step)


def cdp_sigma(clip: float, eps_step: float, n: int, *, level: Level = "user") -> float:
    """CDP baseline noise ``sigma_LDP / sqrt(n)`` (Decor Sec. 6; meant for the complete graph)."""
    n = _steps(n, minimum=1)
    return ldp_sigma(clip, eps_step, level=level) / math.sqrt(n)


# ---- calibration --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SecLDPCandidate:
    """One point of the sweep: ``sigma_cor`` is ``None`` when even ``sigma_cor_max`` does not meet the budget."""

    sigma_cdp: float
    sigma_cor: float | None
    epsilon_step: float | None
    epsilon: float | None

    @property
    def feasible(self) -> bool:
        return self.sigma_cor is not None


@dataclass(frozen=True)
class CalibrationResult:
    """A noise pair meeting the budget, and every pair of the sweep (Decor App. D.1).

    Rule: the *smallest feasible sigma_cdp* on the grid (it drives the dominant utility term, Decor Sec. 5),
    with its ``sigma_cor`` the smallest meeting the budget and at most ``sigma_cor_max``.
    """

    sigma_cdp: float
    sigma_cor: float
    epsilon_step: float
    epsilon: float
    target_epsilon: float
    target_epsilon_step: float
    delta: float
    steps: int
    adversary: Adversary
    level: Level
    sample_rate: float | None
    sigma_ldp: float
    sigma_cdp_floor: float
    sigma_cor_max: float
    alternatives: tuple[SecLDPCandidate, ...] = field(default_factory=tuple)


def calibrate_secldp(
    target_epsilon: float,
    delta: float,
    steps: int,
    graph: nx.Graph | Any,
    clip: float,
    adversary: Adversary = "eavesdropper",
    sample_rate: float | None = None,
    *,
    num_candidates: int = 12,
    sigma_cor_max: float | None = None,
    method: Method = "auto",
    orders: Sequence[float] | None = None,
) -> CalibrationResult:
    """Find ``(sigma_cdp, sigma_cor)`` meeting ``target_epsilon`` after ``steps`` rounds (Decor App. D.1).

    1. Per-round budget: ``eps_step`` from :func:`eps_step_for` (user level), or, with ``sample_rate``, the largest
       ``eps_step`` whose :func:`secldp_epsilon_example_level` meets the target (bisection; example level).
    2. ``sigma_cdp`` on a geometric grid of ``num_candidates`` points from the CDP level ``sigma_LDP / sqrt(n)`` to
       the LDP level ``sigma_LDP = Delta / sqrt(2 eps_step)``.
    3. For each, the smallest ``sigma_cor`` in ``[0, sigma_cor_max]`` with :func:`secldp_step` ``<= eps_step``
       (root finding; the accountant is non-increasing in ``sigma_cor``); infeasible if even ``sigma_cor_max`` fails.
       Near the CDP level this always happens: the exact slope tends to the CDP value only as ``sigma_cor -> inf``.

    ``sigma_cor_max`` defaults to ``10 sigma_LDP``. The chosen pair is the feasible one with the smallest
    ``sigma_cdp``; ``alternatives`` lists every grid point. Every feasible pair's epsilon is ``<= target`` (up to
    rounding) and within about 1e-9 of it. Raises :class:`PrivacyConfigError` on invalid input.
    """
    target_epsilon = _number(target_epsilon, "target_epsilon", strict=True)
    delta = _delta(delta)
    steps = _steps(steps, minimum=1)
    adj = _adjacency(graph)
    n = adj.shape[0]
    q = collusion_level(adversary, n)
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 2:
        raise PrivacyConfigError(f"num_candidates must be an integer >= 2, got {num_candidates!r}")
    level: Level = "user" if sample_rate is None else "example"
    if sample_rate is None:
        target_step = eps_step_for(target_epsilon, steps, delta)

        def epsilon_of(step: float) -> float:
            return secldp_epsilon(step, steps, delta)
    else:
        sample_rate = _sample_rate(sample_rate)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Optimal order is the")
            target_step = _example_eps_step_for(target_epsilon, steps, delta, sample_rate, orders)

        def epsilon_of(step: float) -> float:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Optimal order is the")
                return secldp_epsilon_example_level(step, steps, delta, sample_rate, orders=orders)

    sigma_ldp = ldp_sigma(clip, target_step, level=level)
    floor = sigma_ldp / math.sqrt(n)
    cap = 10.0 * sigma_ldp if sigma_cor_max is None else _number(sigma_cor_max, "sigma_cor_max", strict=True)

    sensitivity = secldp_sensitivity(clip, level)

    def step(sigma_cdp: float, sigma_cor: float) -> float:
        return _step(adj, sigma_cdp, sigma_cor, sensitivity, q, method)

    candidates: list[SecLDPCandidate] = []
    for k, sigma_cdp in enumerate(np.geomspace(floor, sigma_ldp, num_candidates)):
        sigma_cdp = sigma_ldp if k == num_candidates - 1 else float(sigma_cdp)
        if step(sigma_cdp, 0.0) <= target_step * (1.0 + 1e-12):
            sigma_cor = 0.0
        elif step(sigma_cdp, cap) > target_step:
            candidates.append(SecLDPCandidate(sigma_cdp, None, None, None))
            continue
        else:
            sigma_cor = brentq(
                lambda s, c=sigma_cdp: step(c, s) / target_step - 1.0, 0.0, cap, xtol=1e-12 * cap, rtol=1e-10
            )
            for _ in range(60):  # land on the private side of the root
                if step(sigma_cdp, sigma_cor) <= target_step:
                    break
                sigma_cor = min(cap, sigma_cor * (1.0 + 1e-9) + 1e-15 * cap)
        achieved_step = step(sigma_cdp, sigma_cor)
        candidates.append(SecLDPCandidate(sigma_cdp, float(sigma_cor), achieved_step, epsilon_of(achieved_step)))
    feasible = [c for c in candidates if c.feasible]
    if not feasible:  # cannot happen: sigma_LDP with sigma_cor = 0 always meets the budget
        raise PrivacyConfigError("no feasible (sigma_cdp, sigma_cor) pair found")
    best = min(feasible, key=lambda c: c.sigma_cdp)
    assert best.sigma_cor is not None and best.epsilon_step is not None and best.epsilon is not None
    return CalibrationResult(
        sigma_cdp=best.sigma_cdp,
        sigma_cor=best.sigma_cor,
        epsilon_step=best.epsilon_step,
        epsilon=best.epsilon,
        target_epsilon=target_epsilon,
        target_epsilon_step=target_step,
        delta=delta,
        steps=steps,
        adversary=adversary,
        level=level,
        sample_rate=sample_rate,
        sigma_ldp=sigma_ldp,
        sigma_cdp_floor=floor,
        sigma_cor_max=cap,
        alternatives=tuple(candidates),
    )
