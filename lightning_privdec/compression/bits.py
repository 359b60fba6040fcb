"""Fixed-width bit packing for compressed payloads (shared by QSGD and Sign).

Layout (the wire format, identical for every width): the ``n`` values form one
little-endian bit stream -- bit ``j`` of value ``i`` sits at stream position
``i * w + j`` -- and stream bit ``p`` is bit ``p % 8`` of byte ``p // 8``. The
last byte is zero-padded. Hence ``n`` values of width ``w`` occupy exactly
``ceil(n * w / 8)`` bytes.

All operations are vectorised (no Python loop over elements) and keep the
input's device. CPU tensors go through NumPy's ``packbits``/``unpackbits``
(``bitorder="little"`` is exactly this layout; one C pass); other devices use
torch ops, with three code paths producing the same layout:

* ``w % 8 == 0`` (8, 16, ...): split each value into ``w // 8`` bytes;
* ``8 % w == 0`` (1, 2, 4): place ``8 // w`` values in each byte;
* otherwise: expand to one byte per bit, then fold groups of 8 bits.
  Temporary memory is ``n * w`` bytes.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["MAX_WIDTH", "packed_nbytes", "pack_bits", "unpack_bits"]

#: Widest supported field. Unpacked values are returned as int64, so 32 bits is safe.
MAX_WIDTH: int = 32


def _check_width(width: int) -> None:
    if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"bit width must be an int in [1, {MAX_WIDTH}], got {width!r}")


def packed_nbytes(count: int, width: int) -> int:
    """Bytes needed to pack ``count`` values of ``width`` bits: ``ceil(count * width / 8)``."""
    _check_width(width)
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return (count * width + 7) // 8


def _container(width: int) -> np.dtype:
    """The little-endian unsigned integer type that holds one value of ``width`` bits."""
    return np.dtype("<u1" if width <= 8 else "<u2" if width <= 16 else "<u4")


def _pack_numpy(flat: torch.Tensor, width: int) -> torch.Tensor:
    if width == 1:
        bits = (flat.numpy() & 1).astype(np.uint8, copy=False) if flat.dtype != torch.bool else flat.numpy()
    else:  # one row of little-endian bits per value, its first `width` bits kept
        values = flat.numpy().astype(_container(width), copy=False)
        bits = np.unpackbits(values.view(np.uint8).reshape(-1, values.itemsize), axis=1, bitorder="little")
        bits = bits[:, :width]
    return torch.from_numpy(np.packbits(bits.reshape(-1), bitorder="little"))


def _unpack_numpy(packed: torch.Tensor, width: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    bits = np.unpackbits(packed.numpy(), count=count * width, bitorder="little")
    if width == 1:
        return torch.from_numpy(bits).to(dtype)
    container = _container(width)
    rows = np.zeros((count, 8 * container.itemsize), dtype=np.uint8)
    rows[:, :width] = bits.reshape(count, width)
    values = np.packbits(rows, axis=1, bitorder="little").view(container).reshape(-1)
    return torch.from_numpy(values.astype(np.int64) if width > 8 else values).to(dtype)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative integers ``< 2**width`` into a 1-D uint8 tensor.

    Args:
        values: integer (or bool) tensor of any shape; flattened in row-major order.
            Values must lie in ``[0, 2**width)``; this is not checked (a check would
            force a device sync), higher bits are silently dropped.
        width: bits per value, ``1 <= width <= 32``.

    Returns:
        uint8 tensor of length ``packed_nbytes(values.numel(), width)`` on ``values.device``.
    """
    _check_width(width)
    if values.is_floating_point() or values.is_complex():
        raise ValueError(f"pack_bits expects an integer or bool tensor, got dtype {values.dtype}")
    flat = values.reshape(-1)
    if width == 8:  # one byte per value
        return flat.to(torch.uint8)
    if flat.device.type == "cpu":
        return _pack_numpy(flat.contiguous(), width)
    return _pack_torch(flat, width)


def _pack_torch(flat: torch.Tensor, width: int) -> torch.Tensor:
    n = flat.numel()
    device = flat.device
    if width % 8 == 0:
        # One or more whole bytes per value: byte b of value i is (v >> 8b) & 0xFF.
        shifts = torch.arange(0, width, 8, device=device, dtype=torch.int64)
        out = (flat.to(torch.int64).unsqueeze(1) >> shifts) & 0xFF
        return out.to(torch.uint8).reshape(-1)

    if 8 % width == 0:
        # Several values per byte: value slot j of a byte is shifted left by j * width.
        per_byte = 8 // width
        pad = (-n) % per_byte
        v = flat.to(torch.uint8) & ((1 << width) - 1)
        if pad:
            v = torch.cat([v, v.new_zeros(pad)])
        shifts = torch.arange(0, 8, width, device=device, dtype=torch.uint8)
        return (v.reshape(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)

    # Generic width: explode to bits (one uint8 per bit), then fold 8 bits per byte.
    shifts = torch.arange(width, device=device, dtype=torch.int64)
    bits = ((flat.to(torch.int64).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.arange(8, device=device, dtype=torch.uint8)
    return (bits.reshape(-1, 8) << weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, count: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: read ``count`` values of ``width`` bits.

    Args:
        packed: 1-D uint8 tensor of length ``packed_nbytes(count, width)``.
        width: bits per value, ``1 <= width <= 32``.
        count: number of values to read (the trailing padding bits are ignored).
        dtype: of the result (default int64; a float dtype skips the int64 intermediate for decoders).

    Returns:
        tensor of shape ``(count,)`` and ``dtype`` on ``packed.device``.
    """
    _check_width(width)
    expected = packed_nbytes(count, width)
    if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != expected:
        raise ValueError(
            f"unpack_bits expects a 1-D uint8 tensor of {expected} bytes for {count} values of "
            f"{width} bits, got dtype={packed.dtype}, shape={tuple(packed.shape)}"
        )
    device = packed.device
    if width == 8:  # one byte per value: nothing to reassemble
        return packed.to(dtype)
    if device.type == "cpu":
        return _unpack_numpy(packed.contiguous(), width, count, dtype)
    return _unpack_torch(packed, width, count).to(dtype)


def _unpack_torch(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    device = packed.device

    if width % 8 == 0:
        nb = width // 8
        shifts = torch.arange(0, width, 8, device=device, dtype=torch.int64)
        return (packed.to(torch.int64).reshape(count, nb) << shifts).sum(dim=1)

    if 8 % width == 0:
        shifts = torch.arange(0, 8, width, device=device, dtype=torch.uint8)
        v = (packed.unsqueeze(1) >> shifts) & ((1 << width) - 1)
        return v.reshape(-1)[:count].to(torch.int64)

    weights = torch.arange(8, device=device, dtype=torch.uint8)
    bits = ((packed.unsqueeze(1) >> weights) & 1).reshape(-1)[: count * width]
    shifts = torch.arange(width, device=device, dtype=torch.int64)
    return (bits.reshape(count, width).to(torch.int64) << shifts).sum(dim=1)
