"""Who talks to whom, with which weights, in gossip round k.

One process is one node and its rank is its node id in ``0..n-1``. A
:class:`Topology` gives the round-k communication graph (edge ``(j, i)``: j
sends to i) and the mixing matrix ``A`` (``A[i, j]``: weight receiver i gives
sender j). Build one with :func:`build_topology` or a concrete class, then
call :meth:`Topology.validate` before training. This package imports neither
torch nor lightning.
"""

from .base import Topology
from .errors import TopologyError
from .factory import TOPOLOGY_NAMES, build_topology, default_erdos_renyi_p, torus_shape
from .graphs import (
    CompleteGraph,
    DirectedRing,
    ErdosRenyi,
    ExponentialGraph,
    OnePeerExponentialGraph,
    Ring,
    StaticTopology,
    TimeVaryingTopology,
    Torus,
)
from .mixing import (
    MIXING_MODES,
    WEIGHT_RULES,
    WeightSpec,
    metropolis_weights,
    push_sum_weights,
    uniform_weights,
)
from .spectral import algebraic_connectivity, consensus_rate

__all__ = [
    "MIXING_MODES",
    "TOPOLOGY_NAMES",
    "WEIGHT_RULES",
    "CompleteGraph",
    "DirectedRing",
    "ErdosRenyi",
    "ExponentialGraph",
    "OnePeerExponentialGraph",
    "Ring",
    "StaticTopology",
    "TimeVaryingTopology",
    "Topology",
    "TopologyError",
    "Torus",
    "WeightSpec",
    "algebraic_connectivity",
    "build_topology",
    "consensus_rate",
    "default_erdos_renyi_p",
    "metropolis_weights",
    "push_sum_weights",
    "torus_shape",
    "uniform_weights",
]
