"""Sparsifying compressors: TopK and RandK (biased, contractive forms).

Both keep ``k = max(1, floor(ratio * d))`` coordinates and satisfy
``E||Q(x) - x||^2 <= (1 - k/d) ||x||^2`` (CHOCO-SGD, Koloskova et al. 2019,
Sec. 3 examples "top_k" / "rand_k"; DP-CSGP Assumption 4 with rand_a).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import numpy as np

from .base import Compressor, PayloadSpec, _check_dim, make_generator, seed_of

__all__ = ["TopK", "RandK"]

# Guards floor(ratio * d) against float round-off, e.g. 0.29 * 100 == 28.999999999999996.
_FLOOR_EPS = 1e-9
# TopK looks for its k-th largest magnitude in a strided sample of this many elements before the exact top-k
_TOPK_SAMPLE = 16384


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
        idx = self.kept_indices(x.abs(), self.num_kept(x.numel()))
        return [x[idx], idx.to(torch.int32)]

    @staticmethod
    def kept_indices(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
        """Indices of the k largest ``magnitudes`` (unsorted): an exact top-k.

        For large d and small k a strided sample of ``magnitudes`` gives a threshold t that about 2k entries reach;
        the top-k of those candidates is the top-k of the whole vector whenever at least k reach t (checked; else the
        full ``torch.topk`` runs). This replaces one O(d) partial sort by one O(d) comparison.
        """
        d = magnitudes.numel()
        stride = d // _TOPK_SAMPLE
        if magnitudes.device.type == "cpu" and stride >= 4 and 8 * k <= d:
            sample = magnitudes[::stride]
            rank = min(sample.numel(), max(1, -(-2 * k // stride)))  # ceil(2k / stride): about 2k entries above t
            threshold = torch.topk(sample, rank, sorted=False).values.min()
            candidates = (magnitudes >= threshold).nonzero().squeeze(1)
            if k <= candidates.numel() <= 8 * k:  # the k-th largest is >= t, so all of the top-k are candidates
                return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]
        return torch.topk(magnitudes, k, sorted=False).indices

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

    The coordinates are a uniformly random k-subset of ``range(d)`` drawn from a
    generator seeded with ``key``; the receiver regenerates them from the same key,
    so only the k values travel. Payload: ``[values (k,) x.dtype]``.

    On CPU the subset comes from NumPy's ``Generator.choice(d, k, replace=False)``
    (PCG64 seeded with ``key``; Floyd's algorithm, O(k) for k << d) and travels in
    ascending index order, on other devices from ``torch.randperm(d)[:k]`` on the
    device (O(d)). CPU and CUDA
    therefore pick different coordinates for the same key, so both ends must use
    the same device type, and the same NumPy (resp. torch) version.
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
        if torch.device(device).type == "cpu":
            chosen = np.random.default_rng(seed_of(key)).choice(d, size=k, replace=False, shuffle=False)
            if 16 * k < d:
                chosen.sort()
            else:  # ascending order through a mask, O(d): sequential gathers and scatters cost less than a sort saves
                mask = np.zeros(d, dtype=bool)
                mask[chosen] = True
                chosen = np.flatnonzero(mask)
            idx = torch.from_numpy(chosen.astype(np.int64, copy=False))
        else:
            idx = torch.randperm(d, generator=make_generator(key, device), device=device)[:k]
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
