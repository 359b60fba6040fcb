"""Concrete topologies: the named graph families and wrappers around user graphs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import networkx as nx

from .base import Topology, to_digraph
from .errors import TopologyError
from .mixing import WeightSpec

__all__ = [
    "CompleteGraph",
    "DirectedRing",
    "ErdosRenyi",
    "ExponentialGraph",
    "OnePeerExponentialGraph",
    "Ring",
    "StaticTopology",
    "TimeVaryingTopology",
    "Torus",
]


def _circulant(num_nodes: int, offsets: Iterable[int]) -> nx.DiGraph:
    """Directed graph where every node ``i`` sends to ``(i + o) % n`` for each offset ``o``."""
    graph: nx.DiGraph[int] = nx.DiGraph()
    graph.add_nodes_from(range(num_nodes))
    steps = {o % num_nodes for o in offsets} - {0}
    graph.add_edges_from((i, (i + o) % num_nodes) for i in range(num_nodes) for o in steps)
    return graph


def _exponents(num_nodes: int) -> int:
    """``floor(log2(n - 1)) + 1`` for ``n >= 2`` (number of powers of two below n), 0 for n = 1."""
    return (num_nodes - 1).bit_length()


class ExponentialGraph(Topology):
    """Static directed exponential graph: node i sends to ``(i + 2^p) % n`` for ``p = 0..floor(log2(n-1))``."""

    name = "exponential"
    auto_rule = "push-sum"

    def __init__(self, num_nodes: int, *, weights: WeightSpec = "auto") -> None:
        super().__init__(num_nodes, weights=weights)

    def _build_graph(self, index: int) -> nx.DiGraph:
        return _circulant(self.num_nodes, (2**p for p in range(_exponents(self.num_nodes))))


class OnePeerExponentialGraph(Topology):
    """Time-varying exponential graph: in round k node i sends only to ``(i + 2^(k mod m)) % n``.

    ``m = floor(log2(n-1)) + 1`` is the period (1 for n <= 2; n = 1 has no edges).
    With push-sum weights and ``n = 2^m`` one period averages exactly.
    """

    name = "exponential-one-peer"
    auto_rule = "push-sum"

    def __init__(self, num_nodes: int, *, weights: WeightSpec = "auto") -> None:
        super().__init__(num_nodes, period=max(1, _exponents(num_nodes)), weights=weights)

    def _build_graph(self, index: int) -> nx.DiGraph:
        return _circulant(self.num_nodes, [2**index])


class DirectedRing(Topology):
    """Static directed ring: i sends to ``(i + 1) % n``."""

    name = "directed-ring"
    auto_rule = "push-sum"

    def __init__(self, num_nodes: int, *, weights: WeightSpec = "auto") -> None:
        super().__init__(num_nodes, weights=weights)

    def _build_graph(self, index: int) -> nx.DiGraph:
        return _circulant(self.num_nodes, [1])


class Ring(Topology):
    """Static undirected ring: i exchanges with ``i ± 1 (mod n)``; n = 2 is a single edge."""

    name = "ring"
    auto_rule = "metropolis"

    def __init__(self, num_nodes: int, *, weights: WeightSpec = "auto") -> None:
        super().__init__(num_nodes, weights=weights)

    def _build_graph(self, index: int) -> nx.DiGraph:
        return _circulant(self.num_nodes, [1, -1])


class CompleteGraph(Topology):
    """Static complete graph: everyone exchanges with everyone."""

    name = "complete"
    auto_rule = "metropolis"

    def __init__(self, num_nodes: int, *, weights: WeightSpec = "auto") -> None:
        super().__init__(num_nodes, weights=weights)

    def _build_graph(self, index: int) -> nx.DiGraph:
        return _circulant(self.num_nodes, range(1, self.num_nodes))


class Torus(Topology):
    """Static undirected 2-D torus of ``rows x cols`` nodes; node ``r * cols + c`` sits at (r, c).

    Each node exchanges with its wrap-around neighbours up/down/left/right;
    duplicate neighbours (a side of length <= 2) are merged and a side of
    length 1 adds no edges.
    """

    name = "torus"
    auto_rule = "metropolis"

    def __init__(self, rows: int, cols: int, *, weights: WeightSpec = "auto") -> None:
        for value, what in ((rows, "rows"), (cols, "cols")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TopologyError(f"Torus {what} must be a positive integer, got {value!r}")
        self.rows, self.cols = rows, cols
        super().__init__(rows * cols, weights=weights)

    def _build_graph(self, index: int) -> nx.Graph:
        rows, cols = self.rows, self.cols
        graph: nx.Graph[int] = nx.Graph()
        graph.add_nodes_from(range(rows * cols))
        for r in range(rows):
            for c in range(cols):
                node = r * cols + c
                graph.add_edge(node, ((r + 1) % rows) * cols + c)
                graph.add_edge(node, r * cols + (c + 1) % cols)
        return graph  # self-loops from sides of length 1 are dropped by to_digraph

    def _repr_args(self) -> str:
        return f"rows={self.rows}, cols={self.cols}"


class ErdosRenyi(Topology):
    """Static undirected G(n, p) random graph, redrawn until connected.

    Draw ``t`` uses seed ``seed + t``; the first connected draw is kept (its
    seed is ``drawn_seed``), so the graph is a deterministic function of
    ``(n, p, seed)`` and identical on every process.
    """

    name = "erdos-renyi"
    auto_rule = "metropolis"
    max_draws: int = 1000

    def __init__(self, num_nodes: int, p: float, seed: int = 0, *, weights: WeightSpec = "auto") -> None:
        super().__init__(num_nodes, weights=weights)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise TopologyError(f"Erdos-Renyi edge probability p must be in (0, 1], got {p!r}")
        self.p, self.seed = float(p), int(seed)
        for attempt in range(self.max_draws):
            candidate = nx.gnp_random_graph(self.num_nodes, self.p, seed=self.seed + attempt)
            if nx.is_connected(candidate):
                self._graph, self.drawn_seed = candidate, self.seed + attempt
                return
        raise TopologyError(
            f"no connected Erdos-Renyi graph with n={num_nodes}, p={p} in {self.max_draws} draws; "
            f"use a larger p (connectivity needs p well above ln(n)/n = {math.log(num_nodes) / num_nodes:.3g})"
        )

    def _build_graph(self, index: int) -> nx.Graph:
        return self._graph

    def _repr_args(self) -> str:
        return f"num_nodes={self.num_nodes}, p={self.p}, seed={self.seed}"


class StaticTopology(Topology):
    """Any user graph: ``nx.Graph`` is undirected, ``nx.DiGraph`` directed (edge j->i: j sends to i).

    ``weights="auto"`` is "metropolis" for an ``nx.Graph`` and "push-sum" for an ``nx.DiGraph``.

    Nodes are mapped to ranks in sorted order of their labels (a graph on
    ``0..n-1`` keeps its ids; ``node_labels[rank]`` is the original label).
    Self-loops are ignored.
    """

    def __init__(self, graph: nx.Graph, *, weights: WeightSpec = "auto", name: str = "custom") -> None:
        if not isinstance(graph, nx.Graph):
            raise TopologyError(f"StaticTopology needs an nx.Graph or nx.DiGraph, got {type(graph).__name__}")
        if graph.number_of_nodes() == 0:
            raise TopologyError("StaticTopology got an empty graph; add one node per process")
        try:
            self.node_labels: list = sorted(graph.nodes)
        except TypeError:
            raise TopologyError(
                "the graph's node labels cannot be sorted (mixed types?); relabel them to 0..n-1 first"
            ) from None
        relabelled = nx.relabel_nodes(graph, {v: i for i, v in enumerate(self.node_labels)}, copy=True)
        self.name = name
        self.auto_rule = "push-sum" if graph.is_directed() else "metropolis"
        super().__init__(len(self.node_labels), weights=weights)
        self._graph = to_digraph(relabelled, self.num_nodes)

    def _build_graph(self, index: int) -> nx.DiGraph:
        return self._graph


class TimeVaryingTopology(Topology):
    """A user schedule: ``fn(k)`` is the graph of round ``k`` for ``0 <= k < period``.

    The schedule is assumed to repeat with ``period``: round ``k`` uses
    ``fn(k % period)`` (cached), and validation checks that the union of the
    ``period`` graphs is strongly connected. Graphs must use node ids
    ``0..num_nodes-1`` (missing ids are isolated nodes); ``nx.Graph`` rounds are undirected.
    """

    def __init__(
        self,
        fn: Callable[[int], nx.Graph],
        num_nodes: int,
        period: int,
        *,
        weights: WeightSpec = "auto",
        name: str = "time-varying",
    ) -> None:
        if not callable(fn):
            raise TopologyError(f"TimeVaryingTopology needs a callable round -> graph, got {type(fn).__name__}")
        self.fn = fn
        self.name = name
        super().__init__(num_nodes, period=period, weights=weights)

    def _build_graph(self, index: int) -> nx.Graph:
        return self.fn(index)
