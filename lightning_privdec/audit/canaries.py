"""Dirac gradient canaries on a small least-squares model (the audited model of ``privdec-audit``).

The model is linear, w in R^(f + m): the first f coordinates fit an ordinary least-squares task, and coordinate
f + j belongs to canary j alone. Canary j is an example whose loss is <w, x_j> with x_j = norm * e_(f + j), so its
per-sample gradient is the constant ``norm * e_(f + j)`` at every parameter value (a "Dirac canary", the worst case
for DP-SGD's clipping: its whole norm points along a direction no other example touches). With norm >= C the
node clips it to exactly C, the sensitivity the accountant assumes, and an auditor reads canary j's influence off
coordinate f + j of whatever the node releases.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

__all__ = ["AuditModel", "CanaryDesign", "audit_loss", "node_dataset"]


class AuditModel(nn.Module):
    """``<w, x>``: one bias-free linear layer (Opacus computes its per-sample gradients), started at w = 0."""

    def __init__(self, dimension: int, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.linear = nn.Linear(dimension, 1, bias=False, dtype=dtype)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x).squeeze(-1)


def audit_loss(output: Tensor, target: Tensor, is_canary: Tensor) -> Tensor:
    """Per-example losses: ``<w, x>`` for canaries (constant gradient x), ``(<w, x> - y)^2 / 2`` for the data."""
    return torch.where(is_canary, output, 0.5 * (output - target) ** 2)


@dataclass(frozen=True)
class CanaryDesign:
    """m canaries, each included with probability 1/2 in the audited node's shard, and f data features.

    Args:
        canaries: m.
        features: f, the dimension of the least-squares task (every node's ordinary examples).
        examples: ordinary examples of the audited node.
        norm: the canaries' gradient norm (>= C, so that honest clipping scales them to exactly C).
        seed: draws the inclusions S and the ordinary data.
    """

    canaries: int
    features: int = 8
    examples: int = 200
    norm: float = 500.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.canaries, bool) or not isinstance(self.canaries, int) or self.canaries < 2:
            raise ValueError(f"the audit needs at least 2 canaries, got {self.canaries!r} (e.g. 1000)")
        if self.features < 1 or self.examples < 1:
            raise ValueError(f"need features >= 1 and examples >= 1, got {self.features}, {self.examples}")
        if not self.norm > 0:
            raise ValueError(f"the canary gradient norm must be > 0, got {self.norm!r}")

    @property
    def dimension(self) -> int:
        return self.features + self.canaries

    @property
    def canary_coordinates(self) -> slice:
        """Where the canaries' gradients live in the flat parameter vector."""
        return slice(self.features, self.features + self.canaries)

    def inclusions(self) -> np.ndarray:
        """S: which canaries go into the audited node's shard (independent fair coins)."""
        return np.random.default_rng([self.seed, 1]).random(self.canaries) < 0.5


def node_dataset(
    design: CanaryDesign, rank: int, included: np.ndarray | None, examples: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> TensorDataset:
    """Node ``rank``'s shard: ``examples`` ordinary examples (default ``design.examples``), then the included canaries
    (``included=None``: none).

    Ordinary examples have unit-norm features on the first f coordinates and noisy linear targets, so every per-example
    Hessian has norm <= 1 (L = 1 for CPGT's smoothness assumption).
    """
    examples = design.examples if examples is None else int(examples)
    rng = np.random.default_rng([design.seed, 2, rank])
    x = rng.standard_normal((examples, design.features))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    w_star = np.random.default_rng([design.seed, 3]).standard_normal(design.features)
    y = x @ w_star + 0.1 * rng.standard_normal(examples)
    features = np.zeros((examples, design.dimension))
    features[:, : design.features] = x
    rows, targets, flags = [features], [y], [np.zeros(examples, dtype=bool)]
    if included is not None:
        ids = np.flatnonzero(included)
        canaries = np.zeros((len(ids), design.dimension))
        canaries[np.arange(len(ids)), design.features + ids] = design.norm
        rows.append(canaries)
        targets.append(np.zeros(len(ids)))
        flags.append(np.ones(len(ids), dtype=bool))
    return TensorDataset(
        torch.as_tensor(np.concatenate(rows), dtype=dtype),
        torch.as_tensor(np.concatenate(targets), dtype=dtype),
        torch.as_tensor(np.concatenate(flags)),
    )
