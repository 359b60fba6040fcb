"""The host's narrow Box-Muller transform as one fused C loop (``_box_muller.c``), compiled on first use.

NumPy runs the transform of a float32 draw (:func:`~.keystream._narrow_box_muller`) as about fifteen passes over a
chunk, each a SIMD loop of its own: ~1.7 ns per coordinate on one core here, more than the ChaCha20 keystream
(~1.2 ns). The C loop does the same float32 arithmetic block by block in the L1 cache, with glibc's vector
logarithm, cosine and sine (libmvec): ~0.75 ns. Only those three functions' last bits differ from NumPy's.

The library is compiled for this machine (``-O3 -march=native -fno-math-errno``, linked with libmvec) by the C
compiler ``$CC`` (default ``cc``) into a per-user cache directory (``$PRIVDEC_NATIVE_CACHE``, default
``$XDG_CACHE_HOME/lightning_privdec`` or ``~/.cache/lightning_privdec``), named by a hash of the source, the flags,
the compiler (and its version), glibc's version and the CPU, so processes sharing a machine compile it once (an
atomic rename: a concurrent compile is harmless). The directory must be this user's alone and no link, and the
library is opened without following links, checked to be this user's alone and loaded through that descriptor.
Before use it must reproduce NumPy's transform on crafted and random keystream words (both ends of the radius, the
float64 logarithm's boundary, the angles' ends) to float32 precision, and its own values bit for bit when started
1 to 16 pairs later. Without a compiler or libmvec (macOS, musl, Windows), when anything fails, or with
``PRIVDEC_NATIVE_NOISE=0``, NumPy's transform runs: the same format, said once in the log. The last bits of a draw
therefore depend on the host's configuration (compiled or not, and for which vector width): a fixed ``noise_seed``
reproduces a draw bit for bit on one configuration only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("_box_muller.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared")
LIBRARIES = ("-lmvec", "-lm")

#: (words, angles, cosines, sines, radius_factor, angle_scale, near_one) -> None, in place; see _box_muller.c
Transform = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float, float, float], None]

_lock = threading.Lock()
_loaded: list[Transform | None] = []


def _new_lock_in_child() -> None:
    """A process forked while another thread builds holds a copy of the taken lock: a fresh one lets it build."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)

_OFF = ("0", "false", "off", "no")  # values of PRIVDEC_NATIVE_NOISE that switch the compiled transform off


def native_transform() -> Transform | None:
    """The compiled transform, or None (NumPy's runs): built, loaded and checked once per process."""
    if os.environ.get("PRIVDEC_NATIVE_NOISE", "1").strip().lower() in _OFF:
        return None
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_build_and_check())
    return _loaded[0]


def _build_and_check() -> Transform | None:
    """Any failure, whatever it raises, leaves NumPy's transform for the rest of the process, said once."""
    try:
        library = _load(_compiled())
    except Exception as error:  # noqa: BLE001 - no compiler, no libmvec, a cache that cannot be trusted: NumPy's
        log.info("float32 noise on the host: NumPy's transform (the compiled one, ~2x faster, needs a C compiler and "
                 "glibc's libmvec): %s", error)
        return None
    try:
        function = library.narrow_box_muller
        function.restype = None
        function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 3
        transform = partial(_call, function)
        failure = _check(transform)
    except Exception as error:  # noqa: BLE001
        failure = f"failed its check: {error!r}"
    if failure is not None:
        log.warning("float32 noise on the host: NumPy's transform; the compiled one %s (a compiler or libmvec "
                    "problem: please report it; PRIVDEC_NATIVE_NOISE=0 skips the compiled transform)", failure)
        return None
    return transform


def _call(function: Any, words: np.ndarray, angles: np.ndarray, cosines: np.ndarray, sines: np.ndarray,
          radius_factor: float, angle_scale: float, near_one: float) -> None:
    """The C function on checked arrays: 1-D, contiguous, aligned, of the right dtypes and sizes (q <= p), the
    outputs writeable and no two arrays sharing memory (its pointers are ``restrict``)."""
    p, q = len(cosines), len(sines)
    if q > p:
        raise ValueError(f"native noise transform: {q} sines of {p} pairs")
    arrays = ((words, _INT64, p), (angles, _INT32, p), (cosines, _FLOAT32, p), (sines, _FLOAT32, q))
    spans = []
    for array, dtype, size in arrays:
        flags = array.flags
        if array.dtype != dtype or array.ndim != 1 or len(array) < size or not (flags.c_contiguous and flags.aligned):
            raise ValueError(f"native noise transform: expected a contiguous, aligned {dtype} vector of at least "
                             f"{size} entries, got {array.dtype} {array.shape}")
        spans.append((array.ctypes.data, array.nbytes))
    if not (cosines.flags.writeable and sines.flags.writeable):
        raise ValueError("native noise transform: the outputs must be writeable")
    ordered = sorted((start, start + nbytes) for start, nbytes in spans if nbytes)
    if any(end > next_start for (_, end), (next_start, _) in zip(ordered, ordered[1:])):
        raise ValueError("native noise transform: its arrays must not share memory")
    function(spans[0][0], spans[1][0], spans[2][0], spans[3][0] if q else None, p, q, radius_factor, angle_scale,
             near_one)  # ctypes releases the GIL for the call


_INT64, _INT32, _FLOAT32 = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32)


def _private(info: os.stat_result, what: str) -> None:
    """Refuses ``what`` unless this user owns it and nobody else may write it (a library loaded from it must be
    this user's alone)."""
    if hasattr(os, "getuid") and (info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise RuntimeError(f"{what} is not this user's alone: a library loaded from it must be (set "
                           "PRIVDEC_NATIVE_CACHE to a private directory)")


def _cache_directory() -> Path:
    configured = os.environ.get("PRIVDEC_NATIVE_CACHE")
    if configured:
        directory = Path(configured)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = Path(base) / "lightning_privdec"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        raise RuntimeError(f"{directory} is a symbolic link: the cache must be a directory of its own (set "
                           "PRIVDEC_NATIVE_CACHE to a private directory)")
    _private(info, str(directory))
    return directory


def _load(path: Path) -> ctypes.CDLL:
    """The library at ``path``, opened without following a link and checked to be this user's alone before it is
    loaded through its open descriptor (what is checked is what is loaded)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise RuntimeError(f"{path} is not a regular file")
        _private(info, str(path))
        return ctypes.CDLL(f"/proc/self/fd/{descriptor}" if os.path.isdir("/proc/self/fd") else str(path))
    finally:
        os.close(descriptor)


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
    compiler = shlex.split(os.environ.get("CC", "cc"))
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC', 'cc')}) on the PATH")
    if platform.system() != "Linux":
        raise RuntimeError(f"libmvec is glibc's (Linux); this is {platform.system()}")
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), repr((FLAGS, LIBRARIES, compiler, version, platform.libc_ver())).encode(),
                 _cpu_signature().encode()):
        digest.update(part)
    directory = _cache_directory()
    target = directory / f"box_muller-{digest.hexdigest()[:24]}.so"
    if target.exists():
        return target
    handle, partial_path = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=directory)
    os.close(handle)
    try:
        done = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", partial_path, *LIBRARIES], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler[0]).name} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial_path, target)
    finally:
        if os.path.exists(partial_path):
            os.unlink(partial_path)
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
