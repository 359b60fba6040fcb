"""Sparsifying compressors: TopK and RandK (biased, contractive forms).

Both keep ``k = max(1, floor(ratio * d))`` coordinates and satisfy
``E||Q(x) - x||^2 <= (1 - k/d) ||x||^2`` (CHOCO-SGD, Koloskova et al. 2019,
Sec. 3 examples "top_k" / "rand_k"; DP-CSGP Assumption 4 with rand_a).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import Compressor, PayloadSpec, _check_dim, make_generator

__all__ = ["TopK", "RandK"]

# Guards floor(ratio * d) against float round-off, e.g. 0.29 * 100 == 28.999999999999996.
_FLOOR_EPS = 1e-9


def _check_ratio(ratio: float, cls: str) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise ValueError(f"{cls}: ratio must be a number in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0):  # also rejects NaN
        raise ValueError(
            f"{cls}: ratio is the fraction of coordinates kept and must be in (0, 1], got {ratio!r}"
        )
    return ratio


class _Sparsifier(Compressor):
    """Shared parts of TopK / RandK: the ratio, k, omega^2 and the scatter-based decode."""

    def __init__(self, ratio: float) -> None:
        self.ratio: float = _check_ratio(ratio, type(self).__name__)

    def num_kept(self, d: int) -> int:
        """Number of coordinates kept for a d-vector: ``k = max(1, floor(ratio * d))``."""
        _check_dim(d)
        return min(d, max(1, math.floor(self.ratio * d + _FLOOR_EPS)))

    def omega2(self, d: int) -> float:
        """``1 - k/d`` (exact for RandK in expectation; worst case over x for TopK)."""
        return 1.0 - self.num_kept(d) / d

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ratio={self.ratio!r})"


class TopK(_Sparsifier):
    """Keep the k largest-magnitude coordinates (deterministic; ``key`` is unused).

    Payload: ``[values (k,) x.dtype, indices (k,) int32]`` -- ``k * (itemsize + 4)`` bytes.
    ``||top_k(x) - x||^2 <= (1 - k/d) ||x||^2`` since the dropped d-k coordinates
    are the smallest (CHOCO-SGD, Koloskova et al. 2019, Sec. 3). Ties are broken
    by ``torch.topk``. Indices are int32, so d must be < 2^31.
    """

    name = "topk"

    def payload_spec(self, d: int, dtype: torch.dtype = torch.float32) -> PayloadSpec:
        k = self.num_kept(d)
        if d > 2**31:
            raise ValueError(f"TopK sends int32 indices, so d must be <= 2**31, got {d}")
        return [((k,), dtype), ((k,), torch.int32)]

    def encode(self, x: torch.Tensor, key: int) -> list[torch.Tensor]:
        x = self._check_input(x)
        k = self.num_kept(x.numel())
        idx = torch.topk(x.abs(), k, sorted=False).indices
        return [x[idx], idx.to(torch.int32)]

    def decode(
        self,
        payload: Sequence[torch.Tensor],
        d: int,
        key: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        self._check_payload(payload, d, dtype)
        values, idx = payload
        out = torch.zeros(d, dtype=dtype, device=values.device)
        out[idx.to(torch.int64)] = values
        return out


class RandK(_Sparsifier):
    """Keep k coordinates drawn uniformly without replacement, WITHOUT 1/ratio rescaling.

    This is the biased, contractive rand_k of CHOCO-SGD (Koloskova et al. 2019,
    Sec. 3) / DP-CSGP's rand_a: ``E||Q(x) - x||^2 = (1 - k/d) ||x||^2``.

    The coordinates are ``torch.randperm(d)[:k]`` from a generator on the tensor's
    device seeded with ``key``; the receiver regenerates them from the same key,
    so only the k values travel. Payload: ``[values (k,) x.dtype]``.

    Cost: ``randperm`` is O(d) time and 8*d bytes of temporary memory on each
    encode *and* decode, independent of k (d ~ 11M: ~90 MB; about 0.4 s with
    2 CPU threads; on CUDA it runs on the GPU and is far cheaper). CPU and CUDA generators give different
    permutations for the same key, so both ends must use the same device type.
    """

    name = "randk"

    def __init__(self, ratio: float) -> None:
        super().__init__(ratio)
        self._last_indices: tuple[tuple[int, int, str], torch.Tensor] | None = None

    def indices(self, d: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The k kept coordinates (int64, unsorted) for a d-vector and ``key`` on ``device``.

        The last draw is remembered, so a sender's encode and its own decode of the same message (error feedback)
        pay for one permutation, not two.
        """
        cache_key = (d, key, str(torch.device(device)))
        last = self._last_indices  # one read: safe when simulated nodes share the compressor across threads
        if last is not None and last[0] == cache_key:
            return last[1]
        k = self.num_kept(d)
        gen = make_generator(key, device)
        idx = torch.randperm(d, generator=gen, device=device)[:k]
        self._last_indices = (cache_key, idx)
        return idx

    def payload_spec(self, d: int, dtype: torch.dtype = torch.float32) -> PayloadSpec:
        return [((self.num_kept(d),), dtype)]

    def encode(self, x: torch.Tensor, key: int) -> list[torch.Tensor]:
        x = self._check_input(x)
        idx = self.indices(x.numel(), key, x.device)
        return [x[idx]]

    def decode(
        self,
        payload: Sequence[torch.Tensor],
        d: int,
        key: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        self._check_payload(payload, d, dtype)
        (values,) = payload
        idx = self.indices(d, key, values.device)
        out = torch.zeros(d, dtype=dtype, device=values.device)
        out[idx] = values
        return out
