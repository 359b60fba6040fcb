"""Mixing-weight rules and the checks that a mixing matrix suits a gossip algorithm.

Conventions shared by the whole package: graphs are ``nx.DiGraph`` objects on
nodes ``0..n-1`` without self-loops, where edge ``(j, i)`` means *j sends to i*.
A mixing matrix ``A`` is a float64 ``(n, n)`` array where ``A[i, j]`` is the
weight receiver ``i`` applies to sender ``j``'s message and ``A[i, i]`` is
``i``'s self weight; ``A[i, j]`` is zero unless ``j == i`` or ``(j, i)`` is an edge.
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx
import numpy as np

from .errors import TopologyError

__all__ = [
    "MIXING_MODES",
    "WEIGHT_RULES",
    "WeightSpec",
    "as_mixing_matrix",
    "check_mixing_matrix",
    "check_mixing_mode",
    "check_weight_spec",
    "metropolis_weights",
    "push_sum_weights",
    "receive_matrix",
    "rule_weights",
    "uniform_weights",
]

#: Named weight rules accepted by ``weights=`` ("auto" resolves per topology).
WEIGHT_RULES: tuple[str, ...] = ("auto", "push-sum", "metropolis", "uniform")

#: Stochasticity a gossip algorithm needs: "column" (push-sum), "doubly", "row".
MIXING_MODES: tuple[str, ...] = ("column", "doubly", "row")

#: A rule name, a fixed ``(n, n)`` matrix, or a callable ``round -> (n, n) matrix``.
WeightSpec = str | np.ndarray | Callable[[int], np.ndarray]

_SUM_ATOL = 1e-8  # tolerance on row/column sums
_ZERO_ATOL = 1e-12  # weights below this count as zero


def check_weight_spec(weights: object, num_nodes: int) -> WeightSpec:
    """Check a ``weights=`` argument and return it in canonical form (arrays as float64)."""
    if isinstance(weights, str):
        if weights not in WEIGHT_RULES:
            raise TopologyError(
                f"unknown weight rule {weights!r}; use one of {list(WEIGHT_RULES)}, "
                "an (n, n) numpy array, or a callable round -> (n, n) array"
            )
        return weights
    if isinstance(weights, np.ndarray):
        return as_mixing_matrix(weights, num_nodes, "the weights= array")
    if callable(weights):
        return weights
    raise TopologyError(
        f"weights must be a rule name {list(WEIGHT_RULES)}, an (n, n) numpy array or a "
        f"callable round -> array, got {type(weights).__name__}"
    )


def as_mixing_matrix(value: object, num_nodes: int, where: str) -> np.ndarray:
    """Convert user weights to a float64 ``(num_nodes, num_nodes)`` array or raise."""
    try:
        matrix = np.array(value, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TopologyError(f"{where} is not a numeric matrix ({err}); pass an (n, n) array") from None
    if matrix.shape != (num_nodes, num_nodes):
        raise TopologyError(
            f"{where} has shape {matrix.shape} but the topology has {num_nodes} nodes; "
            f"pass a ({num_nodes}, {num_nodes}) matrix"
        )
    if not np.all(np.isfinite(matrix)):
        raise TopologyError(f"{where} contains NaN or infinite entries; pass finite weights")
    return matrix


def receive_matrix(graph: nx.DiGraph) -> np.ndarray:
    """0/1 matrix ``M`` with ``M[i, j] = 1`` iff ``j`` sends to ``i`` (zero diagonal)."""
    receive = np.zeros((graph.number_of_nodes(), graph.number_of_nodes()))
    for sender, receiver in graph.edges:
        if sender != receiver:
            receive[receiver, sender] = 1.0
    return receive


def push_sum_weights(graph: nx.DiGraph) -> np.ndarray:
    """Column-stochastic weights: sender ``j`` splits its mass evenly over its out-peers and itself."""
    receive = receive_matrix(graph)
    out_degree = receive.sum(axis=0)
    return (receive + np.eye(len(receive))) / (out_degree + 1.0)[None, :]


def metropolis_weights(graph: nx.DiGraph) -> np.ndarray:
    """Metropolis-Hastings weights ``1 / (1 + max(deg i, deg j))`` on edges; symmetric, doubly stochastic.

    Raises:
        TopologyError: if the graph is directed (some edge has no reverse edge).
    """
    receive = receive_matrix(graph)
    asymmetric = np.argwhere(receive != receive.T)
    if len(asymmetric):
        i, j = (int(v) for v in asymmetric[0])
        sender, receiver = (j, i) if receive[i, j] else (i, j)
        raise TopologyError(
            f"weights='metropolis' needs an undirected graph, but edge {sender}->{receiver} has no "
            f"reverse edge {receiver}->{sender}; use weights='push-sum' for directed graphs "
            "or an undirected topology"
        )
    degree = receive.sum(axis=1)
    matrix = receive / (1.0 + np.maximum(degree[:, None], degree[None, :]))
    np.fill_diagonal(matrix, 1.0 - matrix.sum(axis=1))
    return matrix


def uniform_weights(graph: nx.DiGraph) -> np.ndarray:
    """Row-stochastic weights: receiver ``i`` averages itself and its in-peers equally.

    Doubly stochastic only when every node has the same in-degree (regular graphs).
    """
    receive = receive_matrix(graph)
    in_degree = receive.sum(axis=1)
    return (receive + np.eye(len(receive))) / (in_degree + 1.0)[:, None]


_RULES: dict[str, Callable[[nx.DiGraph], np.ndarray]] = {
    "push-sum": push_sum_weights,
    "metropolis": metropolis_weights,
    "uniform": uniform_weights,
}


def rule_weights(rule: str, graph: nx.DiGraph) -> np.ndarray:
    """Mixing matrix of a named rule (not "auto", which the topology resolves first)."""
    try:
        return _RULES[rule](graph)
    except KeyError:
        raise TopologyError(f"unknown weight rule {rule!r}; use one of {sorted(_RULES)}") from None


def check_mixing_mode(mixing: str) -> None:
    """Raise :class:`TopologyError` unless ``mixing`` is one of :data:`MIXING_MODES`."""
    if mixing not in MIXING_MODES:
        raise TopologyError(f"unknown mixing mode {mixing!r}; use one of {list(MIXING_MODES)}")


def check_mixing_matrix(
    matrix: np.ndarray,
    graph: nx.DiGraph,
    *,
    mixing: str,
    require_symmetric: bool = False,
    where: str = "mixing matrix",
) -> None:
    """Raise :class:`TopologyError` unless ``matrix`` is a valid mixing matrix on ``graph``.

    Checks non-negativity, zero weight off the graph, the stochasticity named by
    ``mixing`` ("column", "doubly" or "row") and, if ``require_symmetric``, symmetry.
    """
    check_mixing_mode(mixing)
    negative = np.argwhere(matrix < -_ZERO_ATOL)
    if len(negative):
        i, j = (int(v) for v in negative[0])
        raise TopologyError(
            f"{where}: weight A[{i}, {j}] = {matrix[i, j]:.6g} is negative; "
            "mixing weights must be non-negative"
        )
    allowed = receive_matrix(graph) + np.eye(len(matrix))
    off_graph = np.argwhere((np.abs(matrix) > _ZERO_ATOL) & (allowed == 0))
    if len(off_graph):
        i, j = (int(v) for v in off_graph[0])
        raise TopologyError(
            f"{where}: weight A[{i}, {j}] = {matrix[i, j]:.6g} but {j}->{i} is not an edge of the "
            f"graph; set it to 0 or add the edge ({j}, {i})"
        )
    if mixing in ("column", "doubly"):
        _check_sums(matrix.sum(axis=0), "column", mixing, where)
    if mixing in ("row", "doubly"):
        _check_sums(matrix.sum(axis=1), "row", mixing, where)
    if require_symmetric and not np.allclose(matrix, matrix.T, rtol=0.0, atol=_SUM_ATOL):
        i, j = (int(v) for v in np.unravel_index(np.argmax(np.abs(matrix - matrix.T)), matrix.shape))
        raise TopologyError(
            f"{where}: this algorithm needs symmetric weights but A[{i}, {j}] = {matrix[i, j]:.6g} "
            f"!= A[{j}, {i}] = {matrix[j, i]:.6g}; use weights='metropolis' or a symmetric matrix"
        )


_FIXES = {
    "column": "use weights='push-sum' or normalise each column of your matrix",
    "doubly": "use weights='metropolis' (undirected graphs) or a doubly stochastic matrix",
    "row": "use weights='uniform' or normalise each row of your matrix",
}
_NEEDS = {
    "column": "mixing='column' (push-sum) needs every column to sum to 1",
    "doubly": "mixing='doubly' needs every row and column to sum to 1",
    "row": "mixing='row' needs every row to sum to 1",
}


def _check_sums(sums: np.ndarray, axis_name: str, mixing: str, where: str) -> None:
    bad = np.flatnonzero(np.abs(sums - 1.0) > _SUM_ATOL)
    if len(bad):
        k = int(bad[0])
        raise TopologyError(
            f"{where}: {axis_name} {k} sums to {sums[k]:.6g}, but {_NEEDS[mixing]}; {_FIXES[mixing]}"
        )
