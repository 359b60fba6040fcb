"""Wire format: the tensors of one message packed into one flat byte buffer.

One round sends exactly one buffer per (sender, receiver) pair. A message is an ordered list of tensors (a
compressor's payload, the push-sum weight, ...); the receiver knows their shapes and dtypes in advance
(``TensorSpec``) because every node knows the schedule and the compressor, so no header travels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)


def message_nbytes(specs: Sequence[TensorSpec]) -> int:
    """Exact size in bytes of a message with these tensors."""
    return sum(spec.nbytes for spec in specs)


def pack(tensors: Sequence[Tensor], out: Tensor | None = None) -> Tensor:
    """Concatenate the raw bytes of ``tensors`` into one contiguous uint8 buffer (a view when there is one; else
    written into ``out`` when given)."""
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if len(views) == 1:
        return views[0]
    return torch.cat(views) if out is None else torch.cat(views, out=out)


def unpack(buffer: Tensor, specs: Sequence[TensorSpec]) -> list[Tensor]:
    """Split a uint8 buffer back into tensors of the given specs (views into ``buffer``; a misaligned piece is copied)."""
    expected = message_nbytes(specs)
    if buffer.numel() != expected:
        raise RuntimeError(f"received {buffer.numel()} bytes, expected {expected} for message {list(specs)}")
    tensors, offset = [], 0
    for spec in specs:
        chunk = buffer[offset : offset + spec.nbytes]
        if offset % spec.dtype.itemsize:  # a typed view needs an aligned offset: copy the few misaligned bytes
            chunk = chunk.clone()
        tensors.append(chunk.view(spec.dtype).reshape(spec.shape))
        offset += spec.nbytes
    return tensors
