"""DP-CSGP and its two baselines from the paper: PrivSGP and DP^2-SGD.

DP-CSGP (Zhu, Zhao, Huang, Zhou, Ji, Xu), Algorithm 1, per node i and step t:

    1-7   compressed error-feedback push-sum: q_i = Q(x_i - x_hat_i), exchange, w_i, y_i, z_i = w_i / y_i
          (lightning_privdec.algorithms.mixing, run by the base strategy after the update)
    8-10  Poisson-sample a batch, per-sample gradients at z_i clipped to C, noise N(0, sigma^2 C^2 I)
          (lightning_privdec.privacy, run by PrivateDecentralizedStrategy.transform_gradients)
    11    x_i = w_i - eta (g_i + N_i)   (the user's optimizer applied to the numerator)

Differences from the paper, on purpose: a common public initialisation with x_hat = x at start instead of zeros
(keeps X - X_hat = 0 at t = 1 and works for CNNs); sigma calibrated by a numerical accountant instead of
Proposition 2's formula, whose constant c2 is never given (docs/privacy.md); mini-batches with Poisson sampling at
q = B / J instead of one example per step.
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

    default_weights = "metropolis"
    required_mixing = "doubly"
    requires_symmetric_graph = True

    def __init__(self, topology: Any = "ring", compressor: Any = None, **kwargs: Any) -> None:
        super().__init__(topology, compressor, **kwargs)
