"""The host's narrow Box-Muller transform as one fused C loop (``_box_muller.c``), compiled on first use.

NumPy runs the transform of a float32 draw (:func:`~.keystream._narrow_box_muller`) as about fifteen passes over a
chunk, each a SIMD loop of its own: ~1.7 ns per coordinate on one core here, more than the ChaCha20 keystream
(~1.2 ns). The C loop does the same float32 arithmetic block by block in the L1 cache, with glibc's vector
logarithm, cosine and sine (libmvec): ~0.6 ns. Only those three functions' last bits differ from NumPy's.

The library is compiled for this machine (``-O3 -march=native -fno-math-errno``, linked with libmvec) by the C
compiler ``$CC`` (default ``cc``) into a per-user cache directory (``$PRIVDEC_NATIVE_CACHE``, default
``$XDG_CACHE_HOME/lightning_privdec`` or ``~/.cache/lightning_privdec``), named by a hash of the source, the flags,
the compiler and the CPU, so processes sharing a machine compile it once (an atomic rename: a concurrent compile
is harmless). Before use it must reproduce NumPy's transform on crafted and random keystream words (both ends of the
radius, the float64 logarithm's boundary, the angles' ends) to float32 precision. Without a compiler or libmvec
(macOS, musl, Windows), or when it fails its check, or with ``PRIVDEC_NATIVE_NOISE=0``, NumPy's transform runs:
the same format, said once in the log.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_box_muller.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared")
LIBRARIES = ("-lmvec", "-lm")

#: (words, angles, cosines, sines, radius_factor, angle_scale, near_one) -> None, in place; see _box_muller.c
Transform = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float, float], None]

_lock = threading.Lock()
_loaded: list[Transform | None] = []


def native_transform() -> Transform | None:
    """The compiled transform, or None (NumPy's runs): built, loaded and checked once per process."""
    if os.environ.get("PRIVDEC_NATIVE_NOISE", "1") == "0":
        return None
    with _lock:
        if not _loaded:
            _loaded.append(_build_and_check())
        return _loaded[0]


def _build_and_check() -> Transform | None:
    try:
        library = ctypes.CDLL(str(_compiled()))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.info("float32 noise on the host: NumPy's transform (a C compiler and glibc's libmvec make it ~2x "
                 "faster): %s", error)
        return None
    function = library.narrow_box_muller
    function.restype = None
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 3

    def transform(words: np.ndarray, angles: np.ndarray, cosines: np.ndarray, sines: np.ndarray,
                  radius_factor: float, angle_scale: float, near_one: float) -> None:
        p, q = len(cosines), len(sines)
        for array, dtype, size in ((words, np.int64, p), (angles, np.int32, p), (cosines, np.float32, p),
                                   (sines, np.float32, q)):  # fmt: skip
            if array.dtype != dtype or len(array) < size or not array.flags.c_contiguous or array.ndim != 1:
                raise ValueError(f"native noise transform: expected a contiguous {np.dtype(dtype)} vector of at "
                                 f"least {size} entries, got {array.dtype} {array.shape}")
        if not (cosines.flags.writeable and sines.flags.writeable):
            raise ValueError("native noise transform: the outputs must be writeable")
        function(words.ctypes.data, angles.ctypes.data, cosines.ctypes.data, sines.ctypes.data if q else None,
                 p, q, radius_factor, angle_scale, near_one)  # ctypes releases the GIL for the call

    failure = _check(transform)
    if failure is not None:
        log.warning("float32 noise on the host: NumPy's transform; the compiled one %s", failure)
        return None
    return transform


def _cache_directory() -> Path:
    configured = os.environ.get("PRIVDEC_NATIVE_CACHE")
    if configured:
        directory = Path(configured)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = Path(base) / "lightning_privdec"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise RuntimeError(f"{directory} is not this user's alone: a library loaded from it must be (set "
                           "PRIVDEC_NATIVE_CACHE to a private directory)")
    return directory


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags where Linux says them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compiled() -> Path:
    """The library's path in the cache, compiled there first when absent."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')}) on the PATH")
    if platform.system() != "Linux":
        raise RuntimeError(f"libmvec is glibc's (Linux); this is {platform.system()}")
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr((FLAGS, LIBRARIES, compiler)).encode(), _cpu_signature().encode()):
        digest.update(part)
    directory = _cache_directory()
    target = directory / f"box_muller-{digest.hexdigest()[:24]}.so"
    if target.exists():
        return target
    handle, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=directory)
    os.close(handle)
    try:
        done = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", partial, *LIBRARIES], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler).name} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


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
    all pairs but the last): None, or what differs."""
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
        tolerance = 2.0**-19 * np.abs(expected) + scale * 2.0**-22
        if not np.all(np.abs(got[:-1] - expected[:-1]) <= tolerance[:-1]) or not np.isnan(got[-1]):
            worst = int(np.nanargmax(np.abs(got[:-1] - expected[:-1]) - tolerance[:-1]))
            return (f"gave {got[worst]!r} where NumPy's gives {expected[worst]!r} (entry {worst} of {2 * p - 1}, "
                    f"scale {scale})")
    return None
