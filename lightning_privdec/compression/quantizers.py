"""Quantizing compressors: CHOCO-SGD's scaled QSGD and the scaled sign compressor.

Both send one sign bit per coordinate (packed, :mod:`.bits`) plus a float32
scale; QSGD additionally sends a ``bits``-bit level per coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from lightning_privdec import native as native_layer

from .base import Compressor, PayloadSpec, Workspace, _check_dim, public_stream, public_words
from .bits import pack_bits, packed_nbytes, unpack_bits
from .native_qsgd import Kernels, qsgd8_kernels

__all__ = ["QSGD", "Sign"]


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Arithmetic precision: float64 stays float64, everything else (fp16/bf16/fp32) uses float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: coordinates quantized (and decoded) per pass, a multiple of 8 so that each chunk's packed bits start on a byte:
#: signs, dithering, levels, packing and error feedback run chunk by chunk in reused ~1 MB buffers (no vector of the
#: model's size). The dithering's keystream is read chunk after chunk in coordinate order: no value depends on it
_QUANTIZE_CHUNK = 1 << 18
_MASK_53 = (1 << 53) - 1


def _chunks(d: int) -> range:
    return range(0, d, max(8, _QUANTIZE_CHUNK - _QUANTIZE_CHUNK % 8))


def _chunk_size(d: int, start: int) -> int:
    return min(d - start, max(8, _QUANTIZE_CHUNK - _QUANTIZE_CHUNK % 8))


def _dither(stream: object, n: int, wide: bool, workspace: Workspace | None) -> torch.Tensor:
    """The next ``n`` dithering integers r of a message's keystream (:func:`~.base.public_stream`), on the host:
    24-bit ones (float32 work, as NumPy's float32 draws) from its 32-bit words, or 53-bit ones (float64 work) from its
    64-bit words; ``u = r 2^-b`` is then exact in the work dtype. Coordinate i always reads word i."""
    words = public_words(0, n if wide else (n + 1) // 2, workspace, stream, name="dither")
    values = words if wide else words.view(torch.int32)[:n]
    np.bitwise_and(values.numpy(), _MASK_53 if wide else (1 << 24) - 1, out=values.numpy())
    return values


def _uniform(d: int, key: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The dithering u ~ U[0, 1)^d that the encoder adds for ``key`` (float64 for float64 work, else float32)."""
    wide = dtype == torch.float64
    out = torch.empty(d, dtype=torch.float64 if wide else torch.float32, device=device)
    stream = public_stream(key)
    for start in _chunks(d):
        chunk = out[start : start + _chunk_size(d, start)]
        chunk.copy_(_dither(stream, chunk.numel(), wide, None)).mul_(2.0 ** -(53 if wide else 24))
    return out


def _kernels(native: bool | Kernels) -> Kernels | None:
    """The compiled kernels to use: ``native`` itself, the process's (True), or none (False)."""
    if isinstance(native, Kernels):
        return native
    return qsgd8_kernels() if native else None


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
        return self._quantize(self._check_input(x), key, None)

    def encode_difference(
        self, x: torch.Tensor, reference: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        difference = workspace.get("difference", x.numel(), x.dtype, x.device) if workspace is not None else None
        return self._quantize(torch.sub(x, reference, out=difference), key, workspace)

    def encode_feedback_(
        self, x: torch.Tensor, copy: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> list[torch.Tensor]:
        """Lines 1 and 4 at the sender: ``q = Q(x - copy)``, and ``copy += q`` added chunk by chunk while each chunk's
        levels are in the cache (float32 and float64 copies; others through the base class)."""
        if copy.dtype != _work_dtype(copy.dtype) or x.dtype != copy.dtype:
            return super().encode_feedback_(x, copy, key, workspace)
        return self._quantize(x, key, workspace, feedback=copy, difference=True)

    def _quantize(
        self, x: torch.Tensor, key: int, workspace: Workspace | None, feedback: torch.Tensor | None = None,
        native: bool | Kernels = True, difference: bool = False,
    ) -> list[torch.Tensor]:
        """The payload of ``x`` (left unchanged), or with ``difference`` of ``x - feedback``, chunk by chunk: each
        chunk's signs, dithered levels and packed bits while it is in the cache; with ``feedback`` (a copy of x's
        dtype), ``feedback += decode(payload)`` too. On the host, 8-bit float32 chunks run in compiled C where it
        builds (:mod:`.native_qsgd`, the same bits; ``native``: False never, or the kernels to use), which also forms
        the difference as it reads x and the copy; elsewhere it is written into ``workspace`` first."""
        d, work, device = x.numel(), _work_dtype(x.dtype), x.device
        host = device.type == "cpu"
        kernels = _kernels(native) if host and self.bits == 8 and work == torch.float32 else None
        if difference and feedback is None:
            raise ValueError("QSGD: the payload of x - feedback needs the feedback copy")
        fused = difference and kernels is not None and kernels.difference_norm is not None and (
            x.shape == feedback.shape and x.is_contiguous() and feedback.is_contiguous()
            and not native_layer.tensors_overlap((x, feedback)))
        if difference and not fused:
            out = workspace.get("difference", d, x.dtype, device) if workspace is not None else None
            x = torch.sub(x, feedback, out=out)
        wide = work == torch.float64
        xw = x.to(work)
        if not (xw.is_contiguous() and (feedback is None or feedback.is_contiguous())):
            kernels = None
        norm = (torch.tensor(kernels.difference_norm(x.numpy(), feedback.numpy()), dtype=torch.float32) if fused
                else torch.linalg.vector_norm(xw))
        # s |x| / ||x|| in [0, s]; x = 0 (or a norm so small that s / ||x|| overflows) gives all levels 0, without
        # a host sync
        factor = torch.nan_to_num(self.s / norm, nan=0.0, posinf=0.0)
        wire_norm = norm.to(torch.float32).reshape(1)
        levels = torch.empty(packed_nbytes(d, self.bits), dtype=torch.uint8, device=device)
        signs = torch.empty(packed_nbytes(d, 1), dtype=torch.uint8, device=device)
        scale = self._scale(wire_norm, d, feedback.dtype) if feedback is not None else 0.0
        scratch = workspace if workspace is not None else Workspace()
        stream = public_stream(key)
        if host:
            unit, signs_host = np.dtype(str(work).removeprefix("torch.")).type(factor.item()), signs.numpy()
        for start in _chunks(d):
            n = _chunk_size(d, start)
            chunk = xw[start : start + n]
            if kernels is not None:
                kernels.encode(chunk.numpy(), _dither(stream, n, wide, workspace).numpy(), float(unit), self.s,
                               scale, levels[start : start + n].numpy(), signs_host[start // 8 : start // 8 + packed_nbytes(n, 1)],
                               None if feedback is None else feedback[start : start + n].numpy(), fused)
                continue
            negative = scratch.at_least("qsgd_negative", n, torch.bool, device)
            scaled = scratch.at_least("qsgd_scaled", n, work, device)
            chunk_levels = (levels[start : start + n] if self.bits == 8
                            else scratch.at_least("qsgd_levels", n, self._level_dtype, device))
            dither = _dither(stream, n, wide, workspace)
            # floor(s |x| / ||x|| + u), clamped: float round-off in s*ratio + u can reach s + 1 when ratio == 1. The
            # conversion truncates, which is the floor of these non-negative values.
            if host:  # NumPy: torch's bool and uint8 casts cost 5-10x more on the host
                c, sc, u = chunk.numpy(), scaled.numpy(), scratch.at_least("qsgd_decoded", n, work, device).numpy()
                np.less(c, 0, out=negative.numpy())
                np.multiply(np.abs(c, out=sc), unit, out=sc)
                np.copyto(u, dither.numpy(), casting="unsafe")  # exact: below 2^24 (2^53)
                scaled.add_(torch.from_numpy(u), alpha=2.0 ** -(53 if wide else 24))  # + r 2^-b (exact), one rounding
                np.copyto(chunk_levels.numpy(), sc, casting="unsafe")  # the floor
                chunk_levels.clamp_(max=self.s)  # then the clamp (s is an integer: the same); torch's is 10x NumPy's
                signs_host[start // 8 : start // 8 + (n + 7) // 8] = np.packbits(negative.numpy(), bitorder="little")
            else:
                torch.lt(chunk, 0, out=negative)
                torch.abs(chunk, out=scaled).mul_(factor)
                scaled.add_(dither.to(device), alpha=2.0 ** -(53 if wide else 24)).clamp_(max=self.s)
                chunk_levels.copy_(scaled)
                signs[start // 8 : start // 8 + packed_nbytes(n, 1)].copy_(pack_bits(negative, 1))
            if self.bits != 8:
                first = start * self.bits // 8
                levels[first : first + packed_nbytes(n, self.bits)].copy_(pack_bits(chunk_levels, self.bits))
            if feedback is not None:
                self._add_decoded(feedback[start : start + n], chunk_levels, negative, scale, scratch)
        return [levels, signs, wire_norm]

    @property
    def _level_dtype(self) -> torch.dtype:
        return torch.uint8 if self.bits <= 8 else torch.int32

    def _scale(self, wire_norm: torch.Tensor, d: int, dtype: torch.dtype) -> float:
        """A decoded level's unit ``||x|| / (tau s)`` from the norm on the wire, in ``dtype``'s precision."""
        return float(wire_norm.to(dtype) / (self.tau(d) * self.s))

    @staticmethod
    def _add_decoded(out: torch.Tensor, levels: torch.Tensor, negative: torch.Tensor, scale: float,
                     scratch: Workspace) -> None:
        """``out += scale * level * sign`` for one chunk (``negative``: bool or 0/1 bytes), with the rounding of
        ``out + decode(...)`` (``scale * level`` rounded, its sign exact, then the sum)."""
        signed = scratch.at_least("qsgd_sign", out.numel(), torch.int8, out.device)  # +1 / -1
        if out.device.type == "cpu":
            sign = signed.numpy()
            np.add(np.multiply(negative.numpy().view(np.int8), np.int8(-2), out=sign), np.int8(1), out=sign)
        else:
            torch.mul(negative, -2, out=signed).add_(1)
        out.addcmul_(levels, signed, value=scale)

    def decode_add_(
        self, payload: Sequence[torch.Tensor], out: torch.Tensor, key: int, workspace: Workspace | None = None
    ) -> torch.Tensor:
        """``out += scale * levels * signs`` chunk by chunk over the unpacked bytes (no decoded vector), with the
        rounding of ``out + decode(...)`` (``scale * level`` rounded, its sign exact, then the sum)."""
        d = out.numel()
        self._check_payload(payload, d, out.dtype)
        if out.dtype != _work_dtype(out.dtype):  # half precision: decode in float32, then round and add
            return out.add_(self._decode(payload, d, out.dtype))
        return self._decode_add(payload, out, workspace)

    def _decode_add(self, payload: Sequence[torch.Tensor], out: torch.Tensor, workspace: Workspace | None = None,
                    native: bool | Kernels = True) -> torch.Tensor:
        """:meth:`decode_add_` of a checked payload into a float32 or float64 ``out``; on the host, 8-bit float32 in
        compiled C where it builds (:mod:`.native_qsgd`, the same bits; ``native``: False never, or the kernels)."""
        d = out.numel()
        packed_levels, packed_signs, norm = payload
        scale = self._scale(norm, d, out.dtype)
        on_host = all(t.device.type == "cpu" and t.is_contiguous() for t in (out, packed_levels, packed_signs))
        kernels = _kernels(native) if on_host and self.bits == 8 and out.dtype == torch.float32 else None
        if kernels is not None:
            for start in _chunks(d):
                n = _chunk_size(d, start)
                kernels.decode_add(packed_levels[start : start + n].numpy(),
                                   packed_signs[start // 8 : start // 8 + packed_nbytes(n, 1)].numpy(), scale,
                                   out[start : start + n].numpy())
            return out
        scratch = workspace if workspace is not None else Workspace()
        for start in _chunks(d):
            n = _chunk_size(d, start)
            if self.bits == 8:
                levels = packed_levels[start : start + n]
            else:
                first = start * self.bits // 8
                levels = unpack_bits(packed_levels[first : first + packed_nbytes(n, self.bits)], self.bits, n,
                                     dtype=self._level_dtype)
            negative = unpack_bits(packed_signs[start // 8 : start // 8 + packed_nbytes(n, 1)], 1, n,
                                   dtype=torch.uint8)
            self._add_decoded(out[start : start + n], levels, negative, scale, scratch)
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
