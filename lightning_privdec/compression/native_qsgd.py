"""QSGD(8)'s host chunk loops as compiled C (``_qsgd.c``): the levels, the packed sign bits and the error feedback of
an encode in one pass per block, and a decode's additions in another, instead of about ten NumPy and torch passes
(5 ms against ~15 ms for the 9.7M coordinates of ``benchmarks/private_step.py``'s ``wide`` model, one thread).

Built and cached by :mod:`lightning_privdec.native`. Before use the kernels must give, bit for bit, what the NumPy/torch
path gives (:meth:`~.quantizers.QSGD.encode_feedback_` and :meth:`~.quantizers.QSGD.decode_add_` with
``native=False``) on crafted vectors: every node's public copies then hold the same bits whether or not it compiled
the kernels. Without a compiler, on any failure, or with ``PRIVDEC_NATIVE_QSGD=0``, the NumPy/torch path runs.

The encode with error feedback also forms ``x - copy`` as it reads both, in a pass for the norm and in the chunk loop,
instead of writing it into a workspace (~8 ms less on ``wide``, and no model-sized buffer): the compiled norm must give
``torch.linalg.vector_norm``'s bits (its 8-lane float32 reduction, checked on its own); where it does not, torch
computes the norm of a written difference and the other kernels still run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lightning_privdec import native

SOURCE = Path(__file__).with_name("_qsgd.c")
_FLOAT32, _INT32, _UINT8 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.uint8)


class Kernels(NamedTuple):
    encode: Any  # (x, dither, unit, s, scale, levels, signs, feedback or None, of_difference=False) -> None, one chunk
    decode_add: Any  # (levels, signs, scale, out) -> None
    difference_norm: Any = None  # (x, copy) -> float32 ||x - copy|| as torch gives it; None where it does not


def qsgd8_kernels() -> Kernels | None:
    """The compiled kernels, or None (the NumPy/torch path runs): built, loaded and checked once per process."""
    return native.kernel("PRIVDEC_NATIVE_QSGD", SOURCE, _kernels_of, _check, what="QSGD(8) on the host",
                         fallback="the NumPy/torch path")


def _kernels_of(library: Any) -> Kernels:
    encode, decode, norm = library.qsgd8_encode, library.qsgd8_decode_add, library.qsgd8_difference_norm
    encode.restype = decode.restype = None
    norm.restype = ctypes.c_float
    encode.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_float] + [
        ctypes.c_void_p] * 3 + [ctypes.c_int32]
    decode.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    norm.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64]

    def run_encode(x: np.ndarray, dither: np.ndarray, unit: float, s: int, scale: float, levels: np.ndarray,
                   signs: np.ndarray, feedback: np.ndarray | None, of_difference: bool = False) -> None:
        n = len(x)
        if of_difference and feedback is None:
            raise ValueError("compiled kernel: the difference x - feedback needs the feedback")
        arrays = [(x, _FLOAT32, n), (dither, _INT32, n), (levels, _UINT8, n), (signs, _UINT8, (n + 7) // 8)]
        if feedback is not None:
            arrays.append((feedback, _FLOAT32, n))
        addresses = native.pointers(arrays, [levels, signs] + ([] if feedback is None else [feedback]))
        encode(*addresses[:2], n, unit, s, scale, *addresses[2:4], addresses[4] if feedback is not None else None,
               int(of_difference))

    def run_norm(x: np.ndarray, copy: np.ndarray) -> float:
        n = len(x)
        return norm(*native.pointers([(x, _FLOAT32, n), (copy, _FLOAT32, n)]), n)

    def run_decode(levels: np.ndarray, signs: np.ndarray, scale: float, out: np.ndarray) -> None:
        n = len(out)
        addresses = native.pointers([(levels, _UINT8, n), (signs, _UINT8, (n + 7) // 8), (out, _FLOAT32, n)], [out])
        decode(*addresses[:2], n, scale, addresses[2])

    kernels = Kernels(run_encode, run_decode)
    failure = _check_norm(run_norm)
    if failure is not None:  # torch's reduction is not the one reproduced here: its norm of a difference runs
        native.log.info("QSGD(8) on the host: the difference's norm through torch (the compiled one %s)", failure)
        return kernels
    return kernels._replace(difference_norm=run_norm)


def check_vectors() -> list[tuple[Any, Any, int]]:
    """(x, copy, key) triples that reach every branch: random vectors over two chunks with a partial byte of sign
    bits, and of 40 coordinates (levels over 0..s); zeros; negative zeros; one non-zero coordinate whose dithered
    level is s + 1 before the clamp (key 103638: its 24-bit dither is at least 2^24 - 128); values with a tiny
    non-zero norm; a NaN (the norm is NaN, every level 0); values whose norm overflows float32; a zero difference."""
    import torch

    from lightning_privdec.compression.quantizers import _QUANTIZE_CHUNK

    generator = torch.Generator().manual_seed(20261127)
    d = _QUANTIZE_CHUNK + 13
    x = torch.randn(d, generator=generator)
    copy = torch.randn(d, generator=generator) * 0.5
    with_nan = torch.randn(37, generator=generator)
    with_nan[5] = float("nan")
    huge = torch.tensor([1e30, -1e30, 3e29, -2e30, 1.0])
    return [(x, copy, 1000), (torch.randn(40, generator=generator), torch.zeros(40), 1001),
            (torch.zeros(77), torch.zeros(77), 1002), (torch.full((9,), -0.0), torch.zeros(9), 1003),
            (torch.tensor([-1.0]), torch.zeros(1), 103638),
            (torch.randn(333, generator=generator) * 1e-18, torch.zeros(333), 1005),
            (with_nan, torch.zeros(37), 1006), (huge, torch.zeros(5), 1007), (x[:1000], x[:1000].clone(), 1008)]


def norm_check_vectors() -> list[tuple[Any, Any]]:
    """(x, copy) pairs for the difference's norm: :func:`check_vectors`'s, and random ones of every length up to 64
    at three scales (each remainder n mod 8, where torch adds the last squares unfused in fours, then fused)."""
    import torch

    generator = torch.Generator().manual_seed(20261128)
    pairs = [(x, copy) for x, copy, _ in check_vectors()]
    for scale in (1e-3, 1.0, 37.0):
        pairs += [(torch.randn(n, generator=generator) * scale, torch.randn(n, generator=generator) * scale)
                  for n in range(1, 65)]
    return pairs


def _check_norm(difference_norm: Any) -> str | None:
    """``difference_norm`` against ``torch.linalg.vector_norm(x - copy)`` on :func:`norm_check_vectors`, bit for bit
    (a NaN matching any NaN); None, or what differs."""
    import torch

    for k, (x, copy) in enumerate(norm_check_vectors()):
        expected = torch.linalg.vector_norm(torch.sub(x, copy))
        if not _same_bits(expected, torch.tensor(difference_norm(x.numpy(), copy.numpy()), dtype=torch.float32)):
            return f"gave another norm than torch (check pair {k})"
    return None


def _check(kernels: Kernels) -> str | None:
    """The kernels against the NumPy/torch path on :func:`check_vectors`: the payload, the sender's copy after the
    feedback and a receiver's copy after decoding, bit for bit (a NaN matching any NaN: a NaN or overflowing norm
    makes the copies NaN, with the sign bits of each path's negation); None, or what differs."""
    import torch

    from lightning_privdec.compression.quantizers import QSGD

    quantizer = QSGD(8)
    ways = [(False, False), (kernels, False)] + ([(kernels, True)] if kernels.difference_norm is not None else [])
    for k, (x, copy, key) in enumerate(check_vectors()):
        results = []
        for use, of_difference in ways:  # the NumPy/torch path; the kernels on x - copy; the kernels forming it
            sender, receiver = copy.clone(), copy.clone()
            with np.errstate(invalid="ignore"):  # NumPy's cast of the NaN vector's NaN level (to 0)
                payload = quantizer._quantize(x if of_difference else torch.sub(x, sender), key, None,
                                              feedback=sender, native=use, difference=of_difference)
            quantizer._decode_add(payload, receiver, native=use)
            results.append([*payload, sender, receiver])
        for got in results[1:]:
            for name, expected, value in zip(("levels", "signs", "norm", "feedback", "decoded"), results[0], got):
                if not _same_bits(expected, value):
                    return f"gave other {name} bits than the NumPy/torch path (check vector {k})"
    return None


def _same_bits(expected: Any, got: Any) -> bool:
    """Bit for bit equal, a NaN matching any NaN (a NaN norm makes every decoded value NaN, whatever its sign bit)."""
    import torch

    if expected.shape != got.shape or expected.dtype != got.dtype:
        return False
    if expected.is_floating_point():
        nan = torch.isnan(expected)
        if not torch.equal(nan, torch.isnan(got)):
            return False
        expected, got = expected[~nan], got[~nan]
    return torch.equal(expected.view(torch.uint8), got.view(torch.uint8))
