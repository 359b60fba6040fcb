"""The :class:`Topology` base class: a communication schedule plus a mixing-weight rule."""

from __future__ import annotations

import copy
from typing import Any

import networkx as nx
import numpy as np

from . import spectral
from .errors import TopologyError
from .mixing import (
    WeightSpec,
    as_mixing_matrix,
    check_mixing_matrix,
    check_mixing_mode,
    check_weight_spec,
    rule_weights,
)

__all__ = ["Topology", "to_digraph"]

_UNDIRECTED_NAMES = "'ring', 'torus', 'complete', 'erdos-renyi' or an nx.Graph"


class Topology:
    """Base: a (possibly time-varying) communication schedule over ``num_nodes`` nodes plus a mixing-weight rule.

    One process is one node; its rank is its node id in ``0..num_nodes-1``. The
    schedule repeats every ``period`` rounds (``period == 1``: static), so round
    ``k`` uses the graph and weights of round ``k % period``. Subclasses implement
    :meth:`_build_graph`; graphs and mixing matrices are built lazily and cached.

    ``weights`` is a rule name ("auto", "push-sum", "metropolis", "uniform"), a
    fixed ``(n, n)`` array, or a callable ``round -> (n, n) array`` (called with
    ``round % period``). "auto" is "push-sum" for directed families/graphs and
    "metropolis" for undirected ones (``auto_rule``; when it is ``None``, decided
    by whether every round's graph is undirected).
    """

    name: str = "topology"
    auto_rule: str | None = None

    def __init__(self, num_nodes: int, *, period: int = 1, weights: WeightSpec = "auto") -> None:
        self.num_nodes: int = _positive_int(num_nodes, "num_nodes")
        self.period: int = _positive_int(period, "period")
        self.weights: WeightSpec = check_weight_spec(weights, self.num_nodes)
        self._graphs: dict[int, nx.DiGraph] = {}
        self._matrices: dict[int, np.ndarray] = {}
        self._symmetric: bool | None = None

    def _build_graph(self, index: int) -> nx.Graph:
        """Return the graph of round ``index`` (``0 <= index < period``) on nodes ``0..n-1``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _build_graph")

    # ----------------------------------------------------------------- schedule
    def graph(self, round: int) -> nx.DiGraph:
        """Round ``round``'s communication graph; edge ``(j, i)`` means j sends to i (frozen, no self-loops)."""
        index = self._index(round)
        if index not in self._graphs:
            built = to_digraph(self._build_graph(index), self.num_nodes, where=f"round {index}'s graph")
            self._graphs[index] = nx.freeze(built)
        return self._graphs[index]

    def union_graph(self) -> nx.DiGraph:
        """All edges used during one period, as one directed graph."""
        union: nx.DiGraph[int] = nx.DiGraph()
        union.add_nodes_from(range(self.num_nodes))
        for index in range(self.period):
            union.add_edges_from(self.graph(index).edges)
        return union

    def in_peers(self, rank: int, round: int) -> list[int]:
        """Sorted ranks that send to ``rank`` in round ``round`` (``rank`` itself excluded)."""
        return sorted(self.graph(round).predecessors(self._rank(rank)))

    def out_peers(self, rank: int, round: int) -> list[int]:
        """Sorted ranks that ``rank`` sends to in round ``round`` (``rank`` itself excluded)."""
        return sorted(self.graph(round).successors(self._rank(rank)))

    @property
    def is_static(self) -> bool:
        """Whether the schedule is the same every round (``period == 1``)."""
        return self.period == 1

    @property
    def is_symmetric(self) -> bool:
        """Whether every round's graph is undirected (edge j->i iff i->j)."""
        if self._symmetric is None:
            self._symmetric = all(_is_undirected(self.graph(k)) for k in range(self.period))
        return self._symmetric

    # ------------------------------------------------------------------ weights
    @property
    def weight_rule(self) -> str:
        """The weight rule in effect: "push-sum", "metropolis", "uniform" or "custom" (user matrices)."""
        if not isinstance(self.weights, str):
            return "custom"
        if self.weights == "auto":
            if self.auto_rule is not None:
                return self.auto_rule
            return "metropolis" if self.is_symmetric else "push-sum"
        return self.weights

    def with_weights(self, weights: WeightSpec) -> Topology:
        """A copy of this topology (same graphs) that uses another weight rule."""
        clone = copy.copy(self)
        clone.weights = check_weight_spec(weights, self.num_nodes)
        clone._matrices = {}
        return clone

    def mixing_matrix(self, round: int) -> np.ndarray:
        """Float64 ``(n, n)`` matrix ``A`` of round ``round``: ``A[i, j]`` = weight receiver i gives sender j."""
        index = self._index(round)
        if index not in self._matrices:
            self._matrices[index] = self._compute_matrix(index)
        return self._matrices[index].copy()

    def in_weights(self, rank: int, round: int) -> dict[int, float]:
        """``{j: A[rank, j]}`` for every in-peer ``j`` of ``rank`` and for ``rank`` itself."""
        row = self.mixing_matrix(round)[self._rank(rank)]
        return {j: float(row[j]) for j in sorted([*self.in_peers(rank, round), rank])}

    def _compute_matrix(self, index: int) -> np.ndarray:
        if isinstance(self.weights, str):
            return rule_weights(self.weight_rule, self.graph(index))
        if isinstance(self.weights, np.ndarray):
            return self.weights.copy()
        where = f"the weights callable's matrix for round {index}"
        return as_mixing_matrix(self.weights(index), self.num_nodes, where)

    # --------------------------------------------------------------- validation
    def validate(self, num_nodes: int, *, mixing: str = "column", require_symmetric: bool = False) -> None:
        """Raise :class:`TopologyError` unless this topology suits a run on ``num_nodes`` processes.

        Checks the size, (union) strong connectivity, and for every round of a
        period that the weights are non-negative, zero off the graph and
        stochastic as ``mixing`` requires ("column": columns sum to 1, push-sum;
        "doubly": rows and columns; "row": rows). ``require_symmetric`` demands
        undirected graphs, and with ``mixing="doubly"`` also symmetric weights.
        """
        check_mixing_mode(mixing)
        self.check_num_nodes(num_nodes)
        if require_symmetric and not self.is_symmetric:
            raise TopologyError(
                f"topology {self.name!r} is directed, but this algorithm needs an undirected graph "
                f"(symmetric weights); use {_UNDIRECTED_NAMES}"
            )
        self._check_connected()
        for index in range(self.period):
            where = f"topology {self.name!r}, weights of round {index}"
            check_mixing_matrix(
                self.mixing_matrix(index),
                self.graph(index),
                mixing=mixing,
                require_symmetric=require_symmetric and mixing == "doubly",
                where=where,
            )

    def check_num_nodes(self, num_nodes: int) -> None:
        """Raise :class:`TopologyError` unless the graph has exactly ``num_nodes`` (the world size) nodes."""
        if num_nodes != self.num_nodes:
            raise TopologyError(
                f"topology {self.name!r} has {self.num_nodes} nodes but the world size is {num_nodes} "
                f"processes; one process is one node, so devices * num_nodes must equal the graph size "
                f"({self.num_nodes}): build the topology for {num_nodes} nodes or change the Trainer's "
                "devices/num_nodes"
            )

    def _check_connected(self) -> None:
        union = self.union_graph()
        if nx.is_strongly_connected(union):
            return
        scope = "graph" if self.is_static else f"union of the graphs over one period ({self.period} rounds)"
        if self.is_symmetric:
            parts = list(nx.connected_components(union.to_undirected()))
            problem = f"is not connected: {len(parts)} components {_format_parts(parts)}"
        else:
            parts = list(nx.strongly_connected_components(union))
            problem = (
                f"is not strongly connected: {len(parts)} strongly connected components "
                f"{_format_parts(parts)}, so some nodes never hear from others"
            )
        raise TopologyError(
            f"the {scope} of topology {self.name!r} {problem}; gossip cannot reach consensus. Add edges "
            "so every node can reach every other node, or use a connected topology such as 'ring' or "
            "'exponential'"
        )

    # ----------------------------------------------------------------- spectral
    def period_product(self) -> np.ndarray:
        """Mixing over one period: ``A(period-1) @ ... @ A(0)``."""
        return spectral.period_product([self.mixing_matrix(k) for k in range(self.period)])

    def consensus_rate(self) -> float:
        """Per-period consensus factor of :meth:`period_product` (see :mod:`.spectral`); 0 = exact averaging."""
        return spectral.consensus_rate(self.period_product())

    def spectral_gap(self) -> float:
        """``1 - consensus_rate()``; larger means faster mixing."""
        return 1.0 - self.consensus_rate()

    def algebraic_connectivity(self) -> float:
        """Second smallest Laplacian eigenvalue of the (union) graph; undirected topologies only."""
        if not self.is_symmetric:
            raise TopologyError(
                f"algebraic connectivity is defined for undirected graphs, but topology {self.name!r} is "
                f"directed; use consensus_rate() instead, or {_UNDIRECTED_NAMES}"
            )
        return spectral.algebraic_connectivity(self.union_graph().to_undirected())

    def describe(self) -> dict[str, Any]:
        """A short, loggable summary: name, size, period, weights, symmetry and spectral quantities."""
        info: dict[str, Any] = {
            "name": self.name,
            "num_nodes": self.num_nodes,
            "period": self.period,
            "weights": self.weight_rule,
            "symmetric": self.is_symmetric,
            "consensus_rate": self.consensus_rate(),
            "spectral_gap": self.spectral_gap(),
        }
        if self.is_symmetric:
            info["algebraic_connectivity"] = self.algebraic_connectivity()
        return info

    def state_dict(self) -> dict[str, Any]:
        """Alias of :meth:`describe` (for loggers that expect ``state_dict``)."""
        return self.describe()

    def __repr__(self) -> str:
        weights = self.weights if isinstance(self.weights, str) else "custom"
        return f"{type(self).__name__}({self._repr_args()}, weights={weights!r})"

    def _repr_args(self) -> str:
        """Constructor-like arguments shown by ``repr`` (subclasses may override)."""
        return f"num_nodes={self.num_nodes}" + ("" if self.is_static else f", period={self.period}")

    # ------------------------------------------------------------------ helpers
    def _index(self, round: int) -> int:
        if isinstance(round, bool) or not isinstance(round, (int, np.integer)) or round < 0:
            raise TopologyError(f"round must be a non-negative integer, got {round!r}")
        return int(round) % self.period

    def _rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.num_nodes:
            raise TopologyError(f"rank must be an integer in 0..{self.num_nodes - 1}, got {rank!r}")
        return int(rank)


def to_digraph(graph: object, num_nodes: int, *, where: str = "graph") -> nx.DiGraph:
    """Normalise a user graph to a ``DiGraph`` on nodes ``0..num_nodes-1`` without self-loops.

    An undirected ``nx.Graph`` becomes both directions of every edge. Node ids
    must be integers in ``0..num_nodes-1``; ids that are absent become isolated nodes.
    """
    if not isinstance(graph, nx.Graph):
        raise TopologyError(f"{where} must be an nx.Graph or nx.DiGraph, got {type(graph).__name__}")
    bad = [v for v in graph.nodes if not _is_node_id(v, num_nodes)]
    if bad:
        raise TopologyError(
            f"{where} has node {bad[0]!r}, but nodes must be the ranks 0..{num_nodes - 1}; relabel it, "
            "e.g. with nx.convert_node_labels_to_integers(graph, ordering='sorted')"
        )
    result: nx.DiGraph[int] = nx.DiGraph()
    result.add_nodes_from(range(num_nodes))
    edges = [(int(u), int(v)) for u, v in graph.edges() if u != v]
    result.add_edges_from(edges)
    if not graph.is_directed():
        result.add_edges_from((v, u) for u, v in edges)
    return result


def _is_node_id(node: object, num_nodes: int) -> bool:
    return isinstance(node, (int, np.integer)) and not isinstance(node, bool) and 0 <= int(node) < num_nodes


def _is_undirected(graph: nx.DiGraph) -> bool:
    return all(graph.has_edge(v, u) for u, v in graph.edges)


def _positive_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise TopologyError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


def _format_parts(parts: list[set[int]], limit: int = 4) -> str:
    shown = [sorted(part) for part in sorted(parts, key=min)[:limit]]
    text = ", ".join(str(p if len(p) <= 8 else [*p[:8], "..."]) for p in shown)
    return text + (", ..." if len(parts) > limit else "")
