"""The per-round slope of the SecLDP accountant of Decor (Allouah, Koloskova, El Firdoussi, Jaggi, Guerraoui, ICML
2024): how much one round of correlated-plus-independent noise on a graph reveals (Thm. 6, Algorithms 2 and 3).
Composition over rounds, the example level and calibration: :mod:`.secldp`.

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
  added to the *sum* of per-example clipped gradients (the DP-SGD convention of :mod:`.gaussian` and
  :func:`~lightning_privdec.privacy.local_dp.noise_clipped_sum`; dividing by the expected batch size afterwards is
  post-processing). Then ``Delta = C``: the paper's "sensitivity C/b" in units of the batch mean. Add/remove
  adjacency is what Opacus's Poisson subsampled-Gaussian RDP (Mironov, Talwar, Zhang 2019) assumes.

Composition and conversion: ``T`` rounds are ``(alpha, T alpha eps_step)``-SecRDP (Lemma 10), converted with
Lemma 11 at the optimal order (proof of Cor. 12). Example level: the whitened mechanism is a Gaussian with noise
multiplier ``1 / sqrt(2 eps_step)``; we amplify by Poisson subsampling, compose the subsampled RDP over ``T``
rounds, and only then convert to (epsilon, delta) (not the other way round, a known defect of the paper's code).

The linear algebra (the diagonal of the inverse, exactly, for every colluding set): :mod:`.secldp_inverse`.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Union

import networkx as nx
import numpy as np
import scipy.linalg as sla
import scipy.sparse as sp

from lightning_privdec.privacy.accounting.secldp_inverse import (
    MAX_COLLUDING_SUBSETS,
    Method,
    colluding_sets,
    laplacian,
    normalized_step,
)
from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = [
    "ADVERSARIES",
    "MAX_COLLUDING_SUBSETS",
    "Adversary",
    "collusion_level",
    "secldp_step",
    "secldp_step_bound",
    "secldp_sensitivity",
]

Adversary = Union[str, int]
Level = Literal["user", "example"]

#: named adversaries and their collusion level q (Decor, Sec. 2: I = eavesdropper, II = curious users)
ADVERSARIES: dict[str, int] = {"eavesdropper": 0, "curious": 1}


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
    return scale * normalized_step(adj, rho, q, method) / sigma_cdp**2


def _min_algebraic_connectivity(adj: sp.csr_array, q: int) -> float:
    n = adj.shape[0]
    worst = math.inf
    for deleted in colluding_sets(n, q):
        honest = np.setdiff1d(np.arange(n), np.asarray(deleted, dtype=np.intp))
        sub = sp.csr_array(adj[honest][:, honest])
        if len(honest) <= 2000:
            value = float(sla.eigvalsh(laplacian(sub).toarray(), subset_by_index=[1, 1])[0])
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
