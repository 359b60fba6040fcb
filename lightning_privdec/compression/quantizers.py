"""Quantizing compressors: CHOCO-SGD's scaled QSGD and the scaled sign compressor.

Both send one sign bit per coordinate (packed, :mod:`.bits`) plus a float32
scale; QSGD additionally sends a ``bits``-bit level per coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .base import Compressor, PayloadSpec, Workspace, _check_dim, public_stream, public_words
from .bits import pack_bits, packed_nbytes, unpack_bits

__all__ = ["QSGD", "Sign"]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic precision: float64 stays float64, everything else (fp16/bf16/fp32) uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_DITHER_CHUNK = 1 << 20  # coordinates dithered per keystream read (even: whole 64-bit words), and decoded per pass


def _add_dither_(scaled: torch.Tensor, key: int, workspace: Workspace | None) -> torch.Tensor:
    """``scaled += u``, u ~ U[0, 1)^d from the message's keystream (:func:`~.base.public_stream`), chunk by chunk:
    24-bit uniforms for float32 work (as NumPy's float32 draws), 53-bit ones for float64, each added in one pass.
    Only the sender draws them (decoding does not need u)."""
    d, wide = scaled.numel(), scaled.dtype == torch.float64
    stream = public_stream(key)
    for start in range(0, d, _DITHER_CHUNK):
        m = min(_DITHER_CHUNK, d - start)
        words = public_words(key, m if wide else (m + 1) // 2, workspace, stream, name="dither")
        uniform = words.bitwise_and_((1 << 53) - 1) if wide else words.view(torch.int32)[:m].bitwise_and_(
            (1 << 24) - 1)
        scaled[start : start + m].add_(uniform.to(scaled.device), alpha=2.0 ** -(53 if wide else 24))  # r 2^-b: exact
    return scaled


def _uniform(d: int, key: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The dithering u ~ U[0, 1)^d that the encoder adds for ``key`` (float64 for float64 work, else float32)."""
    return _add_dither_(torch.zeros(d, dtype=torch.float64 if dtype == torch.float64 else torch.float32,
                                    device=device), key, None)


def _signs(packed_signs: torch.Tensor, d: int, dtype: torch.dtype) -> torch.Tensor:
    """+1 / -1 per coordinate from the packed sign bits (bit 1 = negative)."""
    return unpack_bits(packed_signs, 1, d, dtype=dtype).mul_(-2).add_(1)


class QSGD(Compressor):
    """Biased b-bit stochastic quantizer scaled by 1/tau (CHOCO-SGD, Koloskova et al. 2019, Sec. 3):

        Q(x) = ||x|| / (s * tau) * sign(x) * floor(s |x| / ||x|| + u),
        s = 2^(bits-1),  u ~ U[0, 1]^d,  tau = 1 + min(d / s^2, sqrt(d) / s).

    The unscaled quantizer is unbiased with variance <= (tau - 1) ||x||^2
    (Alistarh et al. 2017, Lemma 3.1), so dividing by tau gives
    ``E||Q(x) - x||^2 <= (1 - 1/tau) ||x||^2`` = :meth:`omega2`.

    Levels ``l = floor(s|x|/||x|| + u)`` lie in ``{0, ..., s}``, which needs
    exactly ``bits`` bits. Payload (``bits + 1`` bits per coordinate + 4 bytes):
    ``[levels (ceil(d*bits/8),) uint8, sign bits (ceil(d/8),) uint8, norm (1,) float32]``.
    The dithering ``u`` comes from the message's keystream under ``key`` (the same on
    every device type); decoding is deterministic and does not need it.
    ``x = 0`` decodes to 0.
    The norm travels as float32, also for float64 inputs.
    """

    name = "qsgd"

    def __init__(self, bits: int) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
            raise ValueError(f"QSGD: bits (per-coordinate level width) must be an int in [1, 16], got {bits!r}")
        self.bits: int = bits
        self.s: int = 2 ** (bits - 1)  # number of quantization intervals; levels are 0..s

    def tau(self, d: int) -> float:
        """CHOCO-SGD's scaling ``tau = 1 + min(d / s^2, sqrt(d) / s)``."""
        _check_dim(d)
        return 1.0 + min(d / self.s**2, math.sqrt(d) / self.s)

    def omega2(self, d: int) -> float:
        """``1 - 1/tau`` (CHOCO-SGD, Sec. 3, qsgd_s with delta = 1/tau)."""
        return 1.0 - 1.0 / self.tau(d)

    def payload_spec(self, d: int, dtype: torch.dtype = torch.float32) -> PayloadSpec:
        _check_dim(d)
        return [
            ((packed_nbytes(d, self.bits),), torch.uint8),
            ((packed_nbytes(d, 1),), torch.uint8),
            ((1,), torch.float32),
        ]

    def encode(self, x: torch.Tensor, key: int) -> list[torch.Tensor]:
        x = self._check_input(x)
        return self._encode_into(x.clone() if x.dtype == _work_dtype(x.dtype) else x, key, None)

    def encode_difference(
        self, x: torch.Tensor, reference: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        difference = workspace.get("difference", x.numel(), x.dtype, x.device) if workspace is not None else None
        return self._encode_into(torch.sub(x, reference, out=difference), key, workspace)

    def _encode_into(self, x: torch.Tensor, key: int, workspace: Workspace | None) -> list[torch.Tensor]:
        """The payload of ``x``, computed in place in ``x`` (which it overwrites)."""
        signs = pack_bits(x < 0, 1)
        work = _work_dtype(x.dtype)
        xw = x.to(work)
        norm = torch.linalg.vector_norm(xw)
        # Clamp avoids 0/0 for x = 0 (then all levels are 0) without a host sync.
        scaled = xw.abs_().mul_(self.s / norm.clamp_min(torch.finfo(work).tiny))  # s |x| / ||x|| in [0, s]
        # floor(s |x| / ||x|| + u), clamped: float round-off in s*ratio + u can reach s + 1 when ratio == 1. The
        # conversion truncates, which is the floor of these non-negative values.
        levels = _add_dither_(scaled, key, workspace).clamp_(max=self.s)
        levels_int = levels.to(torch.uint8 if self.bits <= 8 else torch.int32)
        return [pack_bits(levels_int, self.bits), signs, norm.to(torch.float32).reshape(1)]

    def decode_add_(
        self, payload: Sequence[torch.Tensor], out: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> torch.Tensor:
        """``out += scale * levels * signs`` in one pass over the unpacked bytes (no decoded vector), with the
        rounding of ``out + decode(...)`` (``scale * level`` rounded, its sign exact, then the sum)."""
        d = out.numel()
        self._check_payload(payload, d, out.dtype)
        if out.dtype != _work_dtype(out.dtype):  # half precision: decode in float32, then round and add
            return out.add_(self._decode(payload, d, out.dtype))
        packed_levels, packed_signs, norm = payload
        levels = packed_levels if self.bits == 8 else unpack_bits(
            packed_levels, self.bits, d, dtype=torch.uint8 if self.bits <= 8 else torch.int32)
        signs = unpack_bits(packed_signs, 1, d, dtype=torch.uint8).view(torch.int8).mul_(-2).add_(1)  # +1 / -1
        scale = float(norm.to(out.dtype) / (self.tau(d) * self.s))
        for start in range(0, d, _DITHER_CHUNK):  # chunks: the integer factors' casts stay small
            end = min(d, start + _DITHER_CHUNK)
            out[start:end].addcmul_(levels[start:end], signs[start:end], value=scale)
        return out

    def decode(
        self,
        payload: Sequence[torch.Tensor],
        d: int,
        key: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        self._check_payload(payload, d, dtype)
        return self._decode(payload, d, dtype)

    def _decode(self, payload: Sequence[torch.Tensor], d: int, dtype: torch.dtype) -> torch.Tensor:
        packed_levels, packed_signs, norm = payload
        work = _work_dtype(dtype)
        levels = unpack_bits(packed_levels, self.bits, d, dtype=work)
        scale = norm.to(work) / (self.tau(d) * self.s)
        return levels.mul_(_signs(packed_signs, d, work)).mul_(scale).to(dtype)

    def __repr__(self) -> str:
        return f"QSGD(bits={self.bits})"


class Sign(Compressor):
    """Scaled sign compressor (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", Alg. 1):

        Q(x) = (||x||_1 / d) * sign(x),   with sign(0) := +1.

    ``||Q(x) - x||^2 = ||x||^2 - ||x||_1^2 / d <= (1 - 1/d) ||x||^2`` because
    ``||x||_1 >= ||x||_2``; :meth:`omega2` returns this worst case over x
    (equality for 1-sparse x; dense x usually contract much more).
    Deterministic (``key`` unused). Payload (1 bit per coordinate + 4 bytes):
    ``[sign bits (ceil(d/8),) uint8, scale (1,) float32]``.
    """

    name = "sign"

    def omega2(self, d: int) -> float:
        _check_dim(d)
        return 1.0 - 1.0 / d

    def payload_spec(self, d: int, dtype: torch.dtype = torch.float32) -> PayloadSpec:
        _check_dim(d)
        return [((packed_nbytes(d, 1),), torch.uint8), ((1,), torch.float32)]

    def encode(self, x: torch.Tensor, key: int) -> list[torch.Tensor]:
        x = self._check_input(x)
        scale = x.abs().sum(dtype=_work_dtype(x.dtype)) / x.numel()
        return [pack_bits(x < 0, 1), scale.to(torch.float32).reshape(1)]

    def decode(
        self,
        payload: Sequence[torch.Tensor],
        d: int,
        key: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        self._check_payload(payload, d, dtype)
        packed_signs, scale = payload
        work = _work_dtype(dtype)
        return _signs(packed_signs, d, work).mul_(scale.to(work)).to(dtype)
