"""One flat vector and the list of tensors it stands for (a model's trainable parameters, their gradients)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def split_like(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like each of ``tensors``, in order (``flat`` holds exactly their elements)."""
    sizes = [t.numel() for t in tensors]
    if flat.numel() != sum(sizes):
        raise ValueError(f"a flat vector of {flat.numel()} elements cannot hold tensors of {sum(sizes)} elements")
    return [chunk.view_as(t) for chunk, t in zip(flat.split(sizes), tensors)]
