"""Sparsifying compressors: TopK and RandK (biased, contractive forms).

Both keep ``k = max(1, floor(ratio * d))`` coordinates and satisfy
``E||Q(x) - x||^2 <= (1 - k/d) ||x||^2`` (CHOCO-SGD, Koloskova et al. 2019,
Sec. 3 examples "top_k" / "rand_k"; DP-CSGP Assumption 4 with rand_a).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch


from .base import Compressor, PayloadSpec, Workspace, _check_dim, public_words

__all__ = ["TopK", "RandK"]

# Guards floor(ratio * d) against float round-off, e.g. 0.29 * 100 == 28.999999999999996.
_FLOOR_EPS = 1e-9
# TopK looks for its k-th largest magnitude in a strided sample of this many elements before the exact top-k
_TOPK_SAMPLE = 16384
_MASK_53 = (1 << 53) - 1
#: RandK keeps its coordinates in runs of this many consecutive ones (:class:`RandK`)
_RUN = 64


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

    The draw (a *rotated comb*): the k kept coordinates are m = ceil(k / L) runs of L consecutive coordinates (the
    last run holds the k - (m - 1) L left over), run j starting at ``j B`` with ``B = floor(d / m) >= L``; the whole
    comb is then shifted by one uniform ``c`` in ``[0, d)``, modulo d. That is all the randomness, and all that
    ``E||Q(x) - x||^2 = sum_i P(i dropped) x_i^2`` needs: any fixed set S0 of k coordinates, rotated by a uniform c,
    keeps every coordinate i with probability ``P(c in i - S0) = k/d`` exactly (up to c's rounding below). The runs make
    the gathers and scatters contiguous: the sender and each receiver read and write about k/d of the vector's
    memory, in strided blocks, not every cache line of it as one pick per ``d/k`` coordinates would. L is
    :data:`_RUN` (64 float32 values, four cache lines), halved while the runs would not fit in their blocks.
    ``c = floor(u d)`` of a 53-bit uniform u from the message's public keystream (:func:`~.base.public_words`, keyed
    by ``key``, which sender and receiver agree on): each c has probability within ``d 2^-53`` relative of 1/d,
    which :meth:`omega2` accounts for. Only the k values travel, in the order of the runs: ``[values (k,) x.dtype]``;
    a receiver's draw is one keystream word.
    """

    name = "randk"

    def omega2(self, d: int) -> float:
        """``1 - k/d``, less the shift's rounding: every coordinate is kept with probability at least
        ``k/d (1 - d 2^-53)`` (the class docstring), so ``1 - k/d (1 - d 2^-53)``."""
        return 1.0 - self.num_kept(d) / d * (1.0 - d * 2.0**-53)

    def comb(self, d: int) -> tuple[int, int, int]:
        """(m runs, run length L, run spacing B) of the comb for a d-vector (the class docstring)."""
        k = self.num_kept(d)
        length = _RUN
        while length > 1 and -(-k // length) > 1 and d // -(-k // length) < length:
            length //= 2
        runs = -(-k // length)
        return runs, min(length, k), d // runs

    @staticmethod
    def shift(d: int, key: int) -> int:
        """The comb's uniform shift c in [0, d) for ``key``: ``floor(u d)``, u the keystream's first 53-bit uniform."""
        return (int(public_words(key, 1)[0]) & _MASK_53) * d >> 53

    def pieces(self, d: int, key: int) -> list[tuple[int, int, int, int]]:
        """The kept coordinates as strided blocks ``(start, rows, length, first)``: coordinates ``start + r B + t``
        (r < rows, t < length: B the comb's spacing) carry the payload's entries ``first + r length + t``. At most
        five blocks: the full runs before and after the wrap at d, the run it cuts (two) and the last run."""
        runs, length, spacing = self.comb(d)
        k, c = self.num_kept(d), self.shift(d, key)
        blocks = []
        groups = [(0, runs - 1, length), (runs - 1, runs, k - (runs - 1) * length)]  # full runs, then the last
        for first_run, end_run, size in groups:
            j = first_run
            while j < end_run:
                start = j * spacing + c
                if start >= d:  # this run and the rest wrapped around: one block
                    blocks.append((start - d, end_run - j, size, j * length))
                    break
                if start + size > d:  # cut by the wrap: its two parts
                    cut = d - start
                    blocks += [(start, 1, cut, j * length), (0, 1, size - cut, j * length + cut)]
                    j += 1
                    continue
                intact = min(end_run, j + (d - size - start) // spacing + 1)  # the runs that end before d
                blocks.append((start, intact - j, size, j * length))
                j = intact
        return [b for b in blocks if b[1] and b[2]]

    def indices(self, d: int, key: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The k kept coordinates (int64, on ``device``) in payload order for a d-vector and ``key``."""
        _, _, spacing = self.comb(d)
        parts = [(start + spacing * torch.arange(rows)[:, None] + torch.arange(length)).reshape(-1)
                 for start, rows, length, _ in self.pieces(d, key)]
        return torch.cat(parts).to(device)

    def _views(
        self, d: int, key: int, vectors: Sequence[torch.Tensor], values: torch.Tensor
    ) -> Iterator[tuple[list[torch.Tensor], torch.Tensor]]:
        """For each block of :meth:`pieces`: the kept coordinates of each of ``vectors`` (contiguous d-vectors) as
        strided (rows, length) views, and the matching (rows, length) view of the payload ``values``."""
        _, _, spacing = self.comb(d)
        for start, rows, length, first in self.pieces(d, key):
            kept = [v.as_strided((rows, length), (spacing, 1), v.storage_offset() + start) for v in vectors]
            yield kept, values[first : first + rows * length].view(rows, length)

    def payload_spec(self, d: int, dtype: torch.dtype = torch.float32) -> PayloadSpec:
        return [((self.num_kept(d),), dtype)]

    def encode(self, x: torch.Tensor, key: int) -> list[torch.Tensor]:
        x = self._check_input(x)
        values = torch.empty(self.num_kept(x.numel()), dtype=x.dtype, device=x.device)
        for (kept,), out in self._views(x.numel(), key, [x], values):
            out.copy_(kept)
        return [values]

    def encode_difference(
        self, x: torch.Tensor, reference: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        """``encode(x - reference)`` reading only the k kept coordinates of each."""
        return [self._kept_difference(x, reference.contiguous(), key, feedback=False)]

    def decode_add_(
        self, payload: Sequence[torch.Tensor], out: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> torch.Tensor:
        self._check_payload(payload, out.numel(), out.dtype)
        if not out.is_contiguous():
            return super().decode_add_(payload, out, key, workspace)
        for (kept,), values in self._views(out.numel(), key, [out], payload[0]):
            kept.add_(values)  # out[i] + v_i: the rounding of out + decode(...)
        return out

    def encode_feedback_(
        self, x: torch.Tensor, copy: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        if not copy.is_contiguous():
            return super().encode_feedback_(x, copy, key, workspace)
        return [self._kept_difference(x, copy, key, feedback=True)]

    def _kept_difference(self, x: torch.Tensor, reference: torch.Tensor, key: int, *, feedback: bool) -> torch.Tensor:
        """The payload of ``x - reference`` (``reference`` contiguous), reading only the kept coordinates; with
        ``feedback`` each block's values are also added into ``reference`` while it is in the cache."""
        x = x.contiguous()
        values = torch.empty(self.num_kept(x.numel()), dtype=x.dtype, device=x.device)
        for (kept_x, kept_reference), out in self._views(x.numel(), key, [x, reference], values):
            torch.sub(kept_x, kept_reference, out=out)
            if feedback:
                kept_reference.add_(out)
        return values

    def decode(
        self,
        payload: Sequence[torch.Tensor],
        d: int,
        key: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        self._check_payload(payload, d, dtype)
        (values,) = payload
        out = torch.zeros(d, dtype=dtype, device=values.device)
        for (kept,), part in self._views(d, key, [out], values):
            kept.copy_(part)
        return out
