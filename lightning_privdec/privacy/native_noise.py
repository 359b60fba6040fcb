"""The host's narrow Box-Muller transform as one fused C loop (``_box_muller.c``), compiled on first use.

NumPy runs the transform of a float32 draw (:func:`~.keystream._narrow_box_muller`) as about fifteen passes over a
chunk, each a SIMD loop of its own: ~1.7 ns per coordinate on one core here, more than the ChaCha20 keystream
(~1.2 ns). The C loop does the same float32 arithmetic block by block in the L1 cache, with glibc's vector
logarithm, cosine and sine (libmvec): ~0.75 ns. Only those three functions' last bits differ from NumPy's.

The library is compiled for this machine (``-O3 -march=native -fno-math-errno``, linked with libmvec) and cached
per user by :mod:`lightning_privdec.native`, which also decides when a cached library can be trusted.
Before use it must reproduce NumPy's transform on crafted and random keystream words (both ends of the radius, the
float64 logarithm's boundary, the angles' ends) to float32 precision, and its own values bit for bit when started
1 to 16 pairs later. Without a compiler or libmvec (macOS, musl, Windows), when anything fails, or with
``PRIVDEC_NATIVE_NOISE=0``, NumPy's transform runs: the same format, said once in the log. The last bits of a draw
therefore depend on the host's configuration (compiled or not, and for which vector width): a fixed ``noise_seed``
reproduces a draw bit for bit on one configuration only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from lightning_privdec import native

SOURCE = Path(__file__).with_name("_box_muller.c")
LIBRARIES = ("-lmvec", "-lm")

#: (words, angles, cosines, sines, radius_factor, angle_scale, near_one) -> None, in place; see _box_muller.c
Transform = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float, float], None]


def native_transform() -> Transform | None:
    """The compiled transform, or None (NumPy's runs): built, loaded and checked once per process."""
    return native.kernel("PRIVDEC_NATIVE_NOISE", SOURCE, _transform_of, _check, libraries=LIBRARIES,
                         what="float32 noise on the host", fallback="NumPy's transform",
                         needs="a C compiler and glibc's libmvec")


def _transform_of(library: Any) -> Transform:
    function = library.narrow_box_muller
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 3
    return partial(_call, function)


def _call(function: Any, words: np.ndarray, angles: np.ndarray, cosines: np.ndarray, sines: np.ndarray,
          radius_factor: float, angle_scale: float, near_one: float) -> None:
    """The C function on checked arrays (:func:`~lightning_privdec.native.pointers`; q <= p)."""
    p, q = len(cosines), len(sines)
    if q > p:
        raise ValueError(f"native noise transform: {q} sines of {p} pairs")
    addresses = native.pointers(((words, _INT64, p), (angles, _INT32, p), (cosines, _FLOAT32, p), (sines, _FLOAT32, q)),
                                writeable=(cosines, sines))
    function(*addresses[:3], addresses[3] if q else None, p, q, radius_factor, angle_scale,
             near_one)  # ctypes releases the GIL for the call


_INT64, _INT32, _FLOAT32 = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32)


def check_words(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Keystream words that reach every branch of the transform: random pairs, then both ends of m (m = 1, the
    largest radius; m = 2^53, r = 0), m on both sides of the float64 logarithm's boundary (1 - 2^-12) and halfway
    between two float32 values, and the angle words' ends (-2^31, 2^31 - 1, 0, +-1)."""
    m = np.array([1, 2, 3, 1 << 52, (1 << 53) - 1, 1 << 53, (1 << 53) - (1 << 41), (1 << 53) - (1 << 41) - 1,
                  (1 << 53) - (1 << 41) + 1, (1 << 40) + (1 << 16), (1 << 53) - 3 * (1 << 28)], dtype=np.int64)
    crafted = ((np.int64(1 << 53) - m).astype(np.uint64) << np.uint64(11)) | np.uint64(0x5A5)  # low bits ignored
    words = np.concatenate([crafted.view(np.int64), rng.integers(-(1 << 63), (1 << 63) - 1, size=5000, dtype=np.int64)])
    ends = np.array([-(1 << 31), (1 << 31) - 1, 0, 1, -1], dtype=np.int32)
    angles = np.concatenate([np.resize(ends, len(crafted)),
                             rng.integers(-(1 << 31), (1 << 31) - 1, size=5000, dtype=np.int32)])
    return words, angles


def _check(transform: Transform) -> str | None:
    """The compiled transform against NumPy's on :func:`check_words` (both scales of draws, an odd count: sines of
    all pairs but the last), and against itself started 1 to 16 pairs later (the same bits wherever a block starts):
    None, or what differs."""
    from lightning_privdec.privacy.keystream import KeystreamBuffers, _narrow_box_muller_numpy, _narrow_constants

    words, angles = check_words(np.random.default_rng(20261127))
    p = len(words)
    buffers = KeystreamBuffers("cpu", narrow_only=True)
    buffers.reserve(p)
    for scale in (1.0, 3.5):
        expected = np.empty(2 * p, np.float32)
        _narrow_box_muller_numpy(words.copy(), angles, expected[:p], expected[p : 2 * p - 1], buffers, scale)
        got = np.full(2 * p, np.nan, np.float32)
        transform(words.copy(), angles, got[:p], got[p : 2 * p - 1], *_narrow_constants(scale))
        excess = np.abs(got[:-1] - expected[:-1]) - (2.0**-19 * np.abs(expected[:-1]) + scale * 2.0**-22)
        excess[np.isnan(excess)] = np.inf
        if excess.max() > 0 or not np.isnan(got[-1]):
            worst = int(np.argmax(excess)) if excess.max() > 0 else 2 * p - 1
            return (f"gave {got[worst]!r} where NumPy's gives {expected[worst]!r} (entry {worst} of {2 * p - 1}, "
                    f"scale {scale})")
        for start in range(1, 17):
            later = np.empty(p - start, np.float32), np.empty(p - start, np.float32)
            transform(words[start:].copy(), angles[start:].copy(), *later, *_narrow_constants(scale))
            if not (np.array_equal(later[0], got[start:p]) and np.array_equal(later[1][:-1], got[p + start : -1])):
                return f"gave other values for the same words started {start} pairs later (scale {scale})"
    return None
