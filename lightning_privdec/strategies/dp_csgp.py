"""DP-CSGP and its two baselines from the paper, PrivSGP and DP^2-SGD, as Lightning strategies.

The algorithm, line by line (Algorithm 1 of DP-CSGP, Zhu, Zhao, Huang, Zhou, Ji, Xu): :mod:`lightning_privdec.
algorithms.dp_csgp`; its accountant: :mod:`lightning_privdec.privacy.accounting.gaussian`. The strategies only choose
the graph, the mixing weights and the compressor.
"""

from __future__ import annotations

from typing import Any

from lightning_privdec.compression import RandK
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy


class DPCSGPStrategy(PrivateDecentralizedStrategy):
    """DP-CSGP: push-sum over a directed column-stochastic graph + local DP-SGD + compressed messages.

    Example::

        DPCSGPStrategy(topology="exponential", compressor=RandK(0.5), max_grad_norm=1.5,
                       target_epsilon=3.0, target_delta=1e-5)
    """

    default_weights = "push-sum"
    required_mixing = "column"
    requires_symmetric_graph = False

    def __init__(self, topology: Any = "exponential", compressor: Any = RandK(0.5), **kwargs: Any) -> None:
        super().__init__(topology, compressor, **kwargs)


class PrivSGPStrategy(DPCSGPStrategy):
    """PrivSGP: DP-CSGP without compression (push-sum + local DP-SGD, exact messages); DP-CSGP's baseline."""

    def __init__(self, topology: Any = "exponential", compressor: Any = None, **kwargs: Any) -> None:
        super().__init__(topology, compressor, **kwargs)


class DP2SGDStrategy(PrivateDecentralizedStrategy):
    """DP^2-SGD: D-PSGD with local DP-SGD over an undirected graph with doubly-stochastic (Metropolis) weights."""
    supports_robust_clip = True  # its one message is the node's model

    default_weights = "metropolis"
    required_mixing = "doubly"
    requires_symmetric_graph = True

    def __init__(self, topology: Any = "ring", compressor: Any = None, **kwargs: Any) -> None:
        super().__init__(topology, compressor, **kwargs)
