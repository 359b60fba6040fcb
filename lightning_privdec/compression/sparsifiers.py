"""Sparsifying compressors: TopK and RandK (biased, contractive forms).

Both keep ``k = max(1, floor(ratio * d))`` coordinates and satisfy
``E||Q(x) - x||^2 <= (1 - k/d) ||x||^2`` (CHOCO-SGD, Koloskova et al. 2019,
Sec. 3 examples "top_k" / "rand_k"; DP-CSGP Assumption 4 with rand_a).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


from .base import Compressor, PayloadSpec, Workspace, _check_dim, public_words

__all__ = ["TopK", "RandK"]

# Guards floor(ratio * d) against float round-off, e.g. 0.29 * 100 == 28.999999999999996.
_FLOOR_EPS = 1e-9
# TopK looks for its k-th largest magnitude in a strided sample of this many elements before the exact top-k
_TOPK_SAMPLE = 16384
_MASK_53 = (1 << 53) - 1
#: RandK's error feedback gathers and writes back the kept coordinates in runs of this many picks (~2.6 MB of the
#: vector at ratio 0.1: both passes over the copy's cache lines hit the cache once)
_FEEDBACK_CHUNK = 1 << 16


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

    def encode_difference(
        self, x: torch.Tensor, reference: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        if workspace is None:
            return self.encode(x - reference, key)
        difference = torch.sub(x, reference, out=workspace.get("difference", x.numel(), x.dtype, x.device))
        magnitudes = torch.abs(difference, out=workspace.get("magnitude", x.numel(), x.dtype, x.device))
        idx = self.kept_indices(magnitudes, self.num_kept(x.numel()))
        return [difference[idx], idx.to(torch.int32)]

    def decode_add_(
        self, payload: Sequence[torch.Tensor], out: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> torch.Tensor:
        self._check_payload(payload, out.numel(), out.dtype)
        values, idx = payload
        return out.index_add_(0, idx, values)  # distinct indices: out[i] + v_i, the rounding of out + decode(...)

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
    """Keep k random coordinates, WITHOUT 1/ratio rescaling: the biased, contractive rand_k of CHOCO-SGD (Koloskova
    et al. 2019, Sec. 3) / DP-CSGP's rand_a, ``E||Q(x) - x||^2 = (1 - k/d) ||x||^2``.

    The draw (a *rotated stratified* sample, O(k)): the coordinates are cut into k consecutive blocks
    ``[floor(j d / k), floor((j + 1) d / k))`` of ``floor(d/k)`` or ``ceil(d/k)`` coordinates; one uniform offset
    per block picks one coordinate in it; a uniform cyclic shift ``c`` in ``[0, d)`` then moves every pick to
    ``(pick + c) mod d``. Every coordinate is kept with probability ``k/d`` (the shift puts it in block b with
    probability ``size_b / d``, and b keeps it with probability ``1 / size_b``), which is all the contraction above
    needs: ``E||Q(x) - x||^2 = sum_i P(i dropped) x_i^2`` (up to the offsets' rounding below). The k coordinates
    are distinct and spread over the whole vector (one per block), and the list is a rotation of an ascending list,
    so gathers and scatters run through memory in order. The shift is ``floor(u d)`` of a 53-bit uniform u, the offsets ``floor(r size / 2^b)`` of
    b-bit uniform integers r (int32 arithmetic with b >= 24 for blocks of up to 127 coordinates, else int64 with
    b <= 53): each offset's probability is within ``size 2^-b`` of ``1 / size`` relative, which :meth:`omega2`
    accounts for (RandK(0.1) on 9.7M coordinates: 8e-8).

    The randomness is the message's public keystream (:func:`~.base.public_words`, ChaCha20 keyed by ``key``, which
    sender and receiver agree on), so only the k values travel: ``[values (k,) x.dtype]``; a receiver's draw costs
    about as much as adding the k values in. The keystream is made on the host, so every device type picks the
    same coordinates for the same key.
    """

    name = "randk"

    def __init__(self, ratio: float) -> None:
        super().__init__(ratio)
        self._last_indices: tuple[tuple[int, int, str], torch.Tensor] | None = None
        self._blocks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, int]] = {}

    def _block_table(self, d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(first coordinate, size) of each of the k blocks, kept per (d, device), and the bits b of the offsets'
        uniforms. int32 (8 k bytes, uniforms of b = 31 - bits(largest block) >= 24 bits, so that ``r size`` and
        every index fit) while d < 2^30 and blocks hold at most 127 coordinates; else int64 and b <= 53."""
        table = self._blocks.get((d, str(device)))
        if table is None:
            k = self.num_kept(d)
            bounds = torch.div(torch.arange(k + 1, dtype=torch.int64, device=device) * d, k, rounding_mode="floor")
            largest = (-(-d // k)).bit_length()
            narrow = d < 2**30 and 31 - largest >= 24
            dtype, bits = (torch.int32, 31 - largest) if narrow else (torch.int64, min(53, 63 - largest))
            table = (bounds[:-1].to(dtype), (bounds[1:] - bounds[:-1]).to(dtype), bits)
            self._blocks[(d, str(device))] = table  # one assignment: safe when simulated nodes share the compressor
        return table

    def omega2(self, d: int) -> float:
        """``1 - k/d``, less the offsets' rounding: every coordinate is kept with probability at least
        ``k/d (1 - ceil(d/k) 2^-b)`` (b >= 24 bits, the class docstring), so ``1 - k/d (1 - ceil(d/k) 2^-b)``."""
        k = self.num_kept(d)
        _, _, bits = self._block_table(d, torch.device("cpu"))
        return 1.0 - k / d * (1.0 - (-(-d // k)) * 2.0**-bits)

    def indices(
        self, d: int, key: int, device: torch.device | str = "cpu", workspace: Workspace | None = None
    ) -> torch.Tensor:
        """The k kept coordinates (int32 or int64: :meth:`_block_table`) for a d-vector and ``key`` on ``device``.

        Without ``workspace`` the result is a fresh tensor and the last draw is remembered (a sender's encode and its
        own decode of one message draw once); with one it is written into the workspace's reused buffers (valid
        until the next draw with that workspace).
        """
        device = torch.device(device)
        cache_key = (d, key, str(device))
        if workspace is None:
            last = self._last_indices  # one read: safe when simulated nodes share the compressor across threads
            if last is not None and last[0] == cache_key:
                return last[1]
        k = self.num_kept(d)
        starts, sizes, bits = self._block_table(d, device)
        per_word = 8 // starts.element_size()  # uniforms per 64-bit keystream word
        # the message's public keystream: one word for the shift, then one uniform per block
        words = public_words(key, 1 + -(-k // per_word), workspace)
        shift = (int(words[0]) & _MASK_53) * d >> 53  # floor(u d), u a 53-bit uniform
        offsets = words[1:].view(starts.dtype)[:k].bitwise_and_((1 << bits) - 1)  # b-bit uniform integers r
        if device != offsets.device:
            offsets = offsets.to(device, non_blocking=True)
        # floor(r size / 2^b) < size, in place; then the block's first coordinate and the shift (all below 2^31)
        idx = offsets.mul_(sizes).bitwise_right_shift_(bits).add_(starts).add_(shift)
        wrapped = int(torch.searchsorted(idx, d))  # ascending before the wrap: the picks past d are a tail
        idx[wrapped:].sub_(d)
        if workspace is None:
            self._last_indices = (cache_key, idx)
        return idx

    def payload_spec(self, d: int, dtype: torch.dtype = torch.float32) -> PayloadSpec:
        return [((self.num_kept(d),), dtype)]

    def encode(self, x: torch.Tensor, key: int) -> list[torch.Tensor]:
        x = self._check_input(x)
        idx = self.indices(x.numel(), key, x.device)
        return [x[idx]]

    def encode_difference(
        self, x: torch.Tensor, reference: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        """``encode(x - reference)`` reading only the k kept coordinates of each."""
        idx = self.indices(x.numel(), key, x.device, workspace)
        return [torch.index_select(x, 0, idx).sub_(torch.index_select(reference, 0, idx))]

    def decode_add_(
        self, payload: Sequence[torch.Tensor], out: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> torch.Tensor:
        self._check_payload(payload, out.numel(), out.dtype)
        idx = self.indices(out.numel(), key, out.device, workspace)
        return out.index_add_(0, idx, payload[0])  # distinct indices: out[i] + v_i, the rounding of out + decode(...)

    def encode_feedback_(
        self, x: torch.Tensor, copy: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        idx = self.indices(x.numel(), key, x.device, workspace)  # drawn once for both lines
        values = torch.empty(idx.numel(), dtype=x.dtype, device=x.device)
        kept = (workspace or Workspace()).at_least("randk_kept", min(idx.numel(), _FEEDBACK_CHUNK), copy.dtype,
                                                   copy.device)
        # in runs of consecutive picks (the list ascends but for one wrap): the copy's cache lines that the gather
        # reads are still in the cache when the same coordinates are written back
        for start in range(0, idx.numel(), _FEEDBACK_CHUNK):
            run = idx[start : start + _FEEDBACK_CHUNK]
            chunk = torch.index_select(x, 0, run, out=values[start : start + run.numel()])
            chunk.sub_(torch.index_select(copy, 0, run, out=kept[: run.numel()]))
            copy.index_add_(0, run, chunk)
        return [values]

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
