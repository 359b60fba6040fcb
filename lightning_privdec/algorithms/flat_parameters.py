"""A module's trainable parameters as views into one flat buffer, so a gossip round is one message per peer."""

from __future__ import annotations

import torch
from torch import nn


class FlatParameters:
    """Re-points every trainable parameter of ``module`` at a slice of one contiguous buffer.

    The ``nn.Parameter`` objects stay the same (optimizers and Lightning keep working); only their storage moves.
    Writing into :attr:`buffer` changes the module's parameters in place, with no per-tensor copies.
    """

    def __init__(self, module: nn.Module) -> None:
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        if not self.parameters:
            raise ValueError("the model has no trainable parameters: there is nothing to gossip")
        dtypes = {p.dtype for p in self.parameters}
        devices = {p.device for p in self.parameters}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"all trainable parameters must share one dtype and device to be gossiped as one flat buffer; "
                f"found dtypes {sorted(map(str, dtypes))} on devices {sorted(map(str, devices))}. "
                "Cast the model with `model.to(dtype)` (mixed precision plugins keep float32 parameters)."
            )
        (dtype,), (device,) = dtypes, devices
        self.numel = sum(p.numel() for p in self.parameters)
        self.buffer = torch.empty(self.numel, dtype=dtype, device=device)
        offset = 0
        with torch.no_grad():
            for p in self.parameters:
                view = self.buffer[offset : offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                offset += p.numel()

    def version(self) -> int:
        """A count that grows with every in-place write to the buffer or to a parameter (their version counters);
        a write through ``p.data`` is not counted."""
        return self.buffer._version + sum(p._version for p in self.parameters)
