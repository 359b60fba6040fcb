"""One flat vector and the list of tensors it stands for (a model's trainable parameters, their gradients), and
host buffers kept across steps."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor


def split_like(flat: Tensor, tensors: Sequence[Tensor]) -> list[Tensor]:
    """Views of ``flat`` shaped like each of ``tensors``, in order (``flat`` holds exactly their elements)."""
    sizes = [t.numel() for t in tensors]
    if flat.numel() != sum(sizes):
        raise ValueError(f"a flat vector of {flat.numel()} elements cannot hold tensors of {sum(sizes)} elements")
    return [chunk.view_as(t) for chunk, t in zip(flat.split(sizes), tensors)]


def round_into_grad(p: torch.nn.Parameter, value: Tensor) -> None:
    """``p.grad`` <- ``value`` rounded to p's dtype, into the existing ``p.grad`` where it fits."""
    if p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype and p.grad.device == p.device:
        p.grad.copy_(value)
    else:
        p.grad = value.to(p.dtype)


class KeptBuffers:
    """Host buffers kept across steps, one per key (a parameter), handed out again while nothing else holds their
    memory: a fresh tensor of tens of MB costs its page faults at every step on a CPU (16 ms of a 24 ms product for a
    3072 x 3072 layer here); one that a caller still holds keeps its values, and a new buffer is made. On a device,
    None (its caching allocator reuses memory without faults; a kept buffer would only add to the peak)."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, tuple[Tensor, int | None]] = {}

    def get(self, key: Hashable, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """An uninitialised host buffer of ``shape`` and ``dtype`` for ``key`` (a view of the kept one; None on a
        device)."""
        if device.type != "cpu":
            return None
        kept = self._kept.get(key)
        if kept is None or kept[0].shape != shape or kept[0].dtype != dtype or not _sole_use(*kept):
            buffer = torch.empty(shape, dtype=dtype)
            kept = self._kept[key] = (buffer, _storage_uses(buffer))
        # a view, not the kept tensor itself: a caller's reference to it then counts as a use of the memory (a plain
        # reference to the kept tensor would not, and the next step would overwrite what the caller holds)
        return kept[0].view(shape)


def _storage_uses(t: Tensor) -> int | None:
    """How many tensors hold ``t``'s memory (views included), where torch tells (a private function: None without)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    return None if use_count is None else int(use_count(t.untyped_storage()._cdata))


def _sole_use(buffer: Tensor, alone: int | None) -> bool:
    """Whether nothing but the kept ``buffer`` holds its memory now (``alone``: its count when it was made)."""
    uses = _storage_uses(buffer)
    return alone is not None and uses is not None and uses <= alone
