"""Decor (Allouah, Koloskova, El Firdoussi, Jaggi, Guerraoui, ICML 2024), Algorithm 1, per user i and round t:

    1   sample a batch
    2   g_i = Clip(grad; C)                                   (per example, averaged; or the batch gradient)
    3   v_ij ~ N(0, sigma_cor^2 I) for j in N_i, v_ij = -v_ji  (from the pairwise secret of edge {i, j})
    4   vbar_i ~ N(0, sigma_cdp^2 I)                          (this node's own randomness)
    5   g~_i = g_i + sum_{j in N_i} v_ij + vbar_i
    6   x_i^{t+1/2} = x_i^t - eta_t g~_i
    7-8 gossip with a symmetric doubly-stochastic W: x_i^{t+1} = sum_j W_ij x_j^{t+1/2}

Lines 3-5 are :func:`decor_perturbation`; lines 6-8 are the D-PSGD gossip of
:class:`~lightning_privdec.algorithms.mixing.PushSumGossip` with ``push_sum_weight=False``. Because v_ij = -v_ji,
sum_i sum_{j in N_i} v_ij = 0: the network average only carries the independent noise (variance sigma_cdp^2 / n).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from lightning_privdec.privacy.noise import NoiseGenerator


class CorrelatedNoiseSource(Protocol):
    """sum_{j in N_i} v_ij^(t) for this node: identical-magnitude, opposite-sign noise at both ends of every edge."""

    def sum_for_round(self, round: int, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor: ...


def decor_perturbation(
    numel: int,
    round_: int,
    *,
    correlated: CorrelatedNoiseSource | None,
    sigma_cdp: float,
    generator: NoiseGenerator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Decor Algorithm 1, lines 3-5: sum_{j in N_i} v_ij^(t) + vbar_i, to be added to the clipped gradient."""
    device = torch.device(device)
    noise = generator.normal(numel, sigma_cdp, dtype, device)
    if correlated is not None:
        noise.add_(correlated.sum_for_round(round_, numel, dtype, device))
    return noise
