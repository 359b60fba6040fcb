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

The DP step's noise goes into float32 gradients through the same loop with the addition fused
(:meth:`NativeTransform.add_at`, ``fma(scale, sum, noise)``: ``torch.add``'s rounding where its adds fuse), so no chunk
of noise is written and read back; it must give the written noise followed by ``torch.add``, bit for bit, before
use, else the noise is written and torch adds it.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lightning_privdec import native

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("_box_muller.c")
LIBRARIES = ("-lmvec", "-lm")

#: (words, angles, cosines, sines, radius_factor, angle_scale, near_one) -> None, in place; see _box_muller.c
Transform = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float, float], None]


def native_transform() -> Transform | None:
    """The compiled transform, or None (NumPy's runs): built, loaded and checked once per process."""
    return native.kernel("PRIVDEC_NATIVE_NOISE", SOURCE, NativeTransform, _check, libraries=LIBRARIES,
                         what="float32 noise on the host", fallback="NumPy's transform",
                         needs="a C compiler and glibc's libmvec")


class NativeTransform:
    """The compiled transform: called as :data:`Transform`; :meth:`add_at` adds a chunk's noise into gradients."""

    def __init__(self, library: Any) -> None:
        #: whether :meth:`add_at` gave torch.add's bits in the load-time check, for float32 and for float64 sums
        #: (else only the written transform runs, and torch adds)
        self.adds = self.adds_wide = False
        self._write, self._add = library.narrow_box_muller, library.narrow_box_muller_add
        self._add_wide = library.narrow_box_muller_add64
        self._write.restype = self._add.restype = self._add_wide.restype = None
        self._write.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 3
        self._add.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 4
        self._add_wide.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 3 + [ctypes.c_double]

    def __call__(self, words: np.ndarray, angles: np.ndarray, cosines: np.ndarray, sines: np.ndarray,
                 radius_factor: float, angle_scale: float, near_one: float) -> None:
        _call(self._write, words, angles, cosines, sines, radius_factor, angle_scale, near_one)

    def add_at(self, words: int, angles: int, p: int, cosines: int, cos_sums: int, sines: int, sin_sums: int, q: int,
               constants: tuple[float, float, float], alpha: float, wide: bool = False) -> None:
        """The transform of ``p`` pairs (their int64 radius words and int32 angle words at ``words`` and ``angles``)
        added: ``cosines[i] = noise_i + alpha cos_sums[i]`` for every pair, ``sines[i]`` likewise for the first ``q``
        (fused, as ``torch.add(noise, sums, alpha=alpha)`` rounds). Every argument but the counts is the address of a
        vector of that length (float32 for the outputs; float32 sums, or float64 with ``wide``: then the addition is
        float64 and its result rounded to float32 once), which the caller has checked (an output may be its float32
        sums; nothing else may share memory: see :func:`~.noise._added_as_made`)."""
        if not 0 <= q <= p or not (words and angles and cosines and cos_sums) or (q and not (sines and sin_sums)):
            raise ValueError(f"native noise transform: {q} sines of {p} pairs, or a missing address")
        add = self._add_wide if wide else self._add
        add(words, angles, cosines, cos_sums, sines or None, sin_sums or None, p, q, *constants, alpha)


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
    None, or what differs. The fused addition (:func:`_check_add`) is checked too; where it fails only the written
    transform is used (``adds`` stays False)."""
    from lightning_privdec.privacy.keystream import KeystreamBuffers, _narrow_box_muller_numpy, _narrow_constants

    words, angles = check_words(np.random.default_rng(20261127))
    p = len(words)
    buffers = KeystreamBuffers("cpu", narrow_only=True)
    step = buffers.chunk_words  # NumPy's transform in chunks its buffers hold (the chunk size a draw has now)
    buffers.reserve(step)
    add_failure = None
    written: dict[float, np.ndarray] = {}  # the written noise per scale, for the float64 sums' check
    for scale in (1.0, 3.5):
        expected = np.empty(2 * p, np.float32)
        for a in range(0, p, step):
            b = min(a + step, p)
            _narrow_box_muller_numpy(words[a:b].copy(), angles[a:b], expected[a:b], expected[p + a : p + min(b, p - 1)],
                                     buffers, scale)
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
        add_failure = add_failure or _check_add(transform, words, angles, got[: 2 * p - 1], scale)
        written[scale] = got[: 2 * p - 1]
    if add_failure is not None:  # the written transform stands; its noise is written, then added by torch
        log.info("float32 noise on the host: written, then added (the compiled addition %s)", add_failure)
    elif isinstance(transform, NativeTransform):
        transform.adds = True
        wide_failure = next(filter(None, (_check_add(transform, words, angles, noise, scale, wide=True)
                                          for scale, noise in written.items())), None)
        if wide_failure is not None:
            log.info("float32 noise on float64 sums: written, then added (the compiled addition %s)", wide_failure)
        else:
            transform.adds_wide = True
    return None


def _check_add(transform: Transform, words: np.ndarray, angles: np.ndarray, noise: np.ndarray,
               scale: float, wide: bool = False) -> str | None:
    """:meth:`NativeTransform.add_at` against the written ``noise`` (cosines, then the sines of all pairs but the
    last) followed by ``torch.add(noise, sums, alpha=...)``, in place and into other vectors: the same bits (``wide``:
    float64 sums, whose sum with the noise torch computes in float64 and rounds to the float32 output once)."""
    import torch

    from lightning_privdec.privacy.keystream import _narrow_constants

    if not isinstance(transform, NativeTransform):
        return None  # a stand-in without the fused addition (tests): the written transform is checked
    p = len(words)
    sums = torch.from_numpy(np.random.default_rng(7).standard_normal(2 * p - 1) * 100)
    sums = sums if wide else sums.float()
    for alpha in (1.0, -0.37):
        expected = torch.add(torch.from_numpy(noise), sums, alpha=alpha).float()
        for in_place in (False,) if wide else (True, False):
            out = sums.clone() if in_place else torch.full((2 * p - 1,), float("nan"))
            read = out if in_place else sums
            radius_words, angle_words = words.copy(), angles.copy()
            transform.add_at(radius_words.ctypes.data, angle_words.ctypes.data, p, out.data_ptr(), read.data_ptr(),
                             out[p:].data_ptr(), read[p:].data_ptr(), p - 1, _narrow_constants(scale), alpha, wide)
            if not torch.equal(out.view(torch.int32), expected.view(torch.int32)):
                return (f"added its noise with other bits than torch.add (alpha {alpha}, scale {scale}, "
                        f"{'in place' if in_place else 'into other vectors'})")
    return None
