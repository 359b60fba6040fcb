"""Spectral summaries of gossip: how fast mixing drives nodes to consensus.

``consensus_rate(P)`` takes the mixing product over one period,
``P = A(period-1) @ ... @ A(0)``, and returns a factor ``r`` in ``[0, 1]`` (for
valid, connected topologies: ``r < 1``) such that the distance to consensus
shrinks roughly like ``r ** periods``:

* **doubly stochastic P** (rows and columns sum to 1): ``r = ||P - 11ᵀ/n||₂``,
  the largest singular value of ``P - 11ᵀ/n`` (= the second largest singular
  value of ``P``). It is the worst-case Euclidean contraction of the deviation
  from the average in one period: ``||P x - x̄1|| <= r ||x - x̄1||``. For a
  symmetric (or any normal) ``P`` it equals the second largest eigenvalue modulus.
* **otherwise** (only column-stochastic, i.e. push-sum, or only row-stochastic):
  ``r`` is the second largest eigenvalue modulus of ``P`` (all eigenvalues but
  the Perron eigenvalue 1), which is the asymptotic rate at which ``P^k``
  converges to its rank-one limit (``π1ᵀ`` for push-sum, whose de-biased ratio
  ``x / y`` then equals the average). A one-step Euclidean bound is not used
  here because for irregular directed graphs ``||P (I - 11ᵀ/n)||₂`` can exceed 1
  even though push-sum converges.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx
import numpy as np

__all__ = ["algebraic_connectivity", "consensus_rate", "is_doubly_stochastic", "period_product"]

_ATOL = 1e-9


def period_product(matrices: Sequence[np.ndarray]) -> np.ndarray:
    """Return ``A(p-1) @ ... @ A(0)`` for ``matrices = [A(0), ..., A(p-1)]``."""
    product = np.eye(len(matrices[0]))
    for matrix in matrices:
        product = matrix @ product
    return product


def is_doubly_stochastic(matrix: np.ndarray, atol: float = _ATOL) -> bool:
    """Whether every row and every column of ``matrix`` sums to 1 (within ``atol``)."""
    return bool(
        np.allclose(matrix.sum(axis=0), 1.0, rtol=0.0, atol=atol)
        and np.allclose(matrix.sum(axis=1), 1.0, rtol=0.0, atol=atol)
    )


def consensus_rate(product: np.ndarray) -> float:
    """Per-period convergence factor of a mixing product (see the module docstring)."""
    n = len(product)
    if n == 1:
        return 0.0
    if is_doubly_stochastic(product):
        return float(np.linalg.norm(product - 1.0 / n, ord=2))
    eigenvalues = np.linalg.eigvals(product)
    perron = int(np.argmin(np.abs(eigenvalues - 1.0)))
    return float(np.max(np.abs(np.delete(eigenvalues, perron))))


def algebraic_connectivity(graph: nx.Graph) -> float:
    """Second smallest eigenvalue of the Laplacian of an undirected graph (0 if disconnected)."""
    if graph.number_of_nodes() < 2:
        return 0.0
    spectrum = np.sort(nx.laplacian_spectrum(nx.Graph(graph), weight=None))
    return float(max(spectrum[1], 0.0))
