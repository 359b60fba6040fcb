"""``build_topology``: turn a user's topology spec into a :class:`Topology`."""

from __future__ import annotations

import math

import networkx as nx

from .base import Topology
from .errors import TopologyError
from .graphs import (
    CompleteGraph,
    DirectedRing,
    ErdosRenyi,
    ExponentialGraph,
    OnePeerExponentialGraph,
    Ring,
    StaticTopology,
    Torus,
)
from .mixing import WeightSpec

__all__ = ["TOPOLOGY_NAMES", "build_topology", "default_erdos_renyi_p", "torus_shape"]

#: Names accepted by :func:`build_topology` (case-insensitive, "_" allowed for "-").
TOPOLOGY_NAMES: tuple[str, ...] = (
    "exponential",
    "exponential-one-peer",
    "ring",
    "directed-ring",
    "complete",
    "torus",
    "erdos-renyi",
)


def default_erdos_renyi_p(num_nodes: int) -> float:
    """Default G(n, p) edge probability: ``min(1, 2 ln(n) / n)``, twice the connectivity threshold."""
    return 1.0 if num_nodes < 2 else min(1.0, 2.0 * math.log(num_nodes) / num_nodes)


def torus_shape(num_nodes: int) -> tuple[int, int]:
    """The most square ``(rows, cols)`` with ``rows * cols == num_nodes``, ``2 <= rows <= cols``.

    Raises:
        TopologyError: if no such factorisation exists (n < 4 or n prime).
    """
    for rows in range(math.isqrt(num_nodes), 1, -1):
        if num_nodes % rows == 0:
            return rows, num_nodes // rows
    raise TopologyError(
        f"'torus' needs num_nodes = rows x cols with rows, cols >= 2, but {num_nodes} has no such "
        "factorisation; use 'ring' or 'exponential', or Torus(rows, cols) explicitly"
    )


def build_topology(
    spec: object,
    num_nodes: int,
    *,
    weights: WeightSpec = "auto",
    seed: int = 0,
    erdos_renyi_p: float | None = None,
) -> Topology:
    """Build the topology described by ``spec`` for ``num_nodes`` processes.

    ``spec`` is one of :data:`TOPOLOGY_NAMES`, an ``nx.Graph``/``nx.DiGraph``
    (see :class:`StaticTopology`) or a :class:`Topology` (including
    :class:`TimeVaryingTopology`). A ``Topology`` built with ``weights="auto"``
    takes the ``weights`` given here; one built with explicit weights keeps them.
    ``seed`` and ``erdos_renyi_p`` (default :func:`default_erdos_renyi_p`) only
    affect "erdos-renyi". The size is checked against ``num_nodes``.
    """
    if isinstance(spec, str):
        return _from_name(spec, num_nodes, weights, seed, erdos_renyi_p)
    if isinstance(spec, Topology):
        topology = spec.with_weights(weights) if spec.weights == "auto" and weights != "auto" else spec
    elif isinstance(spec, nx.Graph):
        topology = StaticTopology(spec, weights=weights)
    elif callable(spec):
        raise TopologyError(
            "a bare callable round -> graph has no period; wrap it as "
            "TimeVaryingTopology(fn, num_nodes, period) to say how often the schedule repeats"
        )
    else:
        raise TopologyError(
            f"unsupported topology spec of type {type(spec).__name__}; pass one of {list(TOPOLOGY_NAMES)}, "
            "an nx.Graph / nx.DiGraph, or a Topology such as TimeVaryingTopology(fn, num_nodes, period)"
        )
    topology.check_num_nodes(num_nodes)
    return topology


def _from_name(
    name: str, num_nodes: int, weights: WeightSpec, seed: int, erdos_renyi_p: float | None
) -> Topology:
    key = name.strip().lower().replace("_", "-")
    if key == "exponential":
        return ExponentialGraph(num_nodes, weights=weights)
    if key == "exponential-one-peer":
        return OnePeerExponentialGraph(num_nodes, weights=weights)
    if key == "ring":
        return Ring(num_nodes, weights=weights)
    if key == "directed-ring":
        return DirectedRing(num_nodes, weights=weights)
    if key == "complete":
        return CompleteGraph(num_nodes, weights=weights)
    if key == "torus":
        rows, cols = torus_shape(num_nodes)
        return Torus(rows, cols, weights=weights)
    if key == "erdos-renyi":
        p = default_erdos_renyi_p(num_nodes) if erdos_renyi_p is None else erdos_renyi_p
        return ErdosRenyi(num_nodes, p, seed, weights=weights)
    raise TopologyError(
        f"unknown topology {name!r}; valid names are {list(TOPOLOGY_NAMES)}, or pass an nx.Graph, "
        "nx.DiGraph or Topology object"
    )
