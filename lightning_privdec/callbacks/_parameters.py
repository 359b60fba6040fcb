"""The model as one vector, for the monitoring callbacks (reads and in-place writes; never re-binds parameters)."""

from __future__ import annotations

import torch
from torch import nn


def trainable_vector(module: nn.Module) -> torch.Tensor:
    """The trainable parameters, flattened in ``module.parameters()`` order (a new tensor)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters() if p.requires_grad])


def float_state(module: nn.Module) -> list[torch.Tensor]:
    """Every floating-point parameter and buffer of the module (the tensors an evaluation reads)."""
    tensors = [p for p in module.parameters()] + [b for b in module.buffers()]
    return [t for t in tensors if t.is_floating_point()]
