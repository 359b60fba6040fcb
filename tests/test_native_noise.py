"""The compiled narrow Box-Muller transform (privacy/native_noise.py): NumPy's transform to float32 precision, the
same values wherever a chunk or block starts, and NumPy's transform whenever it cannot be built or trusted."""

from __future__ import annotations

import ctypes.util
import logging
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from lightning_privdec import native
from lightning_privdec.privacy import keystream, native_noise

#: whether the compiled transform can be built here: a C compiler and glibc's libmvec (Linux)
CAN_BUILD = (shutil.which(os.environ.get("CC", "cc").split()[0]) is not None and sys.platform.startswith("linux")
             and ctypes.util.find_library("mvec") is not None)
needs_compiler = pytest.mark.skipif(not CAN_BUILD, reason="needs a C compiler and glibc's libmvec (Linux)")


def _numpy(words: np.ndarray, angles: np.ndarray, q: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    buffers = keystream.KeystreamBuffers("cpu", narrow_only=True)
    buffers.reserve(len(words))
    cosines, sines = np.empty(len(words), np.float32), np.empty(q, np.float32)
    keystream._narrow_box_muller_numpy(words.copy(), angles, cosines, sines, buffers, scale)
    return cosines, sines


def _native(words: np.ndarray, angles: np.ndarray, q: int, scale: float) -> tuple[np.ndarray, np.ndarray]:
    transform = native_noise.native_transform()
    assert transform is not None
    cosines, sines = np.full(len(words) + 1, np.nan, np.float32), np.full(q + 1, np.nan, np.float32)
    transform(words.copy(), angles, cosines[:-1], sines[:-1], *keystream._narrow_constants(scale))
    assert np.isnan(cosines[-1]) and np.isnan(sines[-1])  # nothing written past the outputs
    return cosines[:-1], sines[:-1]


@needs_compiler
@pytest.mark.parametrize("scale", [1.0, 0.01, 40.0])
def test_the_compiled_transform_gives_numpys_draws_to_float32_precision(scale: float) -> None:
    """On crafted words (both ends of the radius, the float64 logarithm's boundary, the angles' ends) and 2^16
    random ones, every entry is within 2^-19 of NumPy's relatively (the two libraries' float32 logarithm, cosine and
    sine differ in their last bits) or within scale 2^-22 absolutely (near zero), and the tails are the same: the
    largest radius 8.57 scale at m = 1."""
    words, angles = native_noise.check_words(np.random.default_rng(3))
    words = np.concatenate([words, np.random.default_rng(4).integers(-(1 << 63), (1 << 63) - 1, size=1 << 16)])
    angles = np.concatenate([angles, np.random.default_rng(5).integers(-(1 << 31), (1 << 31) - 1, size=1 << 16,
                                                                        dtype=np.int32)])  # fmt: skip
    q = len(words) - 7
    expected, got = _numpy(words, angles, q, scale), _native(words, angles, q, scale)
    for e, g in zip(expected, got):
        assert np.all(np.abs(g - e) <= 2.0**-19 * np.abs(e) + scale * 2.0**-22)
    radius = np.hypot(got[0][:q].astype(np.float64), got[1].astype(np.float64))
    assert radius[0] == pytest.approx(scale * np.sqrt(2 * 53 * np.log(2)), rel=1e-6)  # m = 1: the largest radius
    assert radius[5] == 0.0  # m = 2^53: r = 0


@needs_compiler
def test_the_compiled_values_do_not_depend_on_where_a_chunk_or_block_starts() -> None:
    """Any slice of the words gives, bit for bit, the same entries as the whole: every entry goes through the same
    vector functions (a partial block is padded, never finished by scalar code), so a draw's values do not depend on
    its chunk size or on the threads that share its chunks."""
    rng = np.random.default_rng(6)
    words = rng.integers(-(1 << 63), (1 << 63) - 1, size=5000)
    angles = rng.integers(-(1 << 31), (1 << 31) - 1, size=5000, dtype=np.int32)
    cosines, sines = _native(words, angles, 5000, 1.0)
    for start, p, q in ((0, 5000, 4999), (1, 17, 3), (5, 1023, 1023), (511, 1030, 600), (4000, 1000, 0)):
        part_c, part_s = _native(words[start : start + p], angles[start : start + p], q, 1.0)
        assert np.array_equal(part_c, cosines[start : start + p]) and np.array_equal(part_s, sines[start : start + q])


def test_numpys_transform_runs_when_switched_off_or_when_the_library_cannot_be_built_or_trusted(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """``PRIVDEC_NATIVE_NOISE=0``, no compiler, a cache directory other users can write, or a library that fails
    its check: None (NumPy's transform), said in the log with what to do, and draws still come."""
    from lightning_privdec.privacy.noise import NoiseGenerator

    monkeypatch.setenv("PRIVDEC_NATIVE_NOISE", "0")
    assert native_noise.native_transform() is None
    assert NoiseGenerator(bytes(32), seeded=True).normal(1001, 1.0).isfinite().all()
    monkeypatch.delenv("PRIVDEC_NATIVE_NOISE")

    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setattr(native, "_built", {})
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native_noise.native_transform() is None
    assert "no C compiler (no-such-compiler-here)" in caplog.text and "libmvec" in caplog.text

    monkeypatch.delenv("CC")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(shared))
    monkeypatch.setattr(native, "_built", {})
    with pytest.raises(RuntimeError, match="not this user's alone"):
        native._cache_directory()
    assert native_noise.native_transform() is None

    link = tmp_path / "link"
    (tmp_path / "cache").mkdir(mode=0o700, exist_ok=True)
    link.symlink_to(tmp_path / "cache", target_is_directory=True)
    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(link))
    with pytest.raises(RuntimeError, match="symbolic link"):
        native._cache_directory()

    if CAN_BUILD:
        monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(tmp_path / "cache"))
        for failing_check in (lambda transform: "gave 1.0 where NumPy's gives 2.0",
                              lambda transform: np.nanargmax(np.full(3, np.nan))):  # a check that raises
            monkeypatch.setattr(native, "_built", {})
            monkeypatch.setattr(native_noise, "_check", failing_check)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger=native.__name__):
                assert native_noise.native_transform() is None
                assert native_noise.native_transform() is None  # decided once: no second build or check
            assert caplog.text.count("NumPy's transform") == 1 and "PRIVDEC_NATIVE_NOISE=0" in caplog.text
        assert "gave 1.0 where NumPy's gives 2.0" not in caplog.text and "All-NaN" in caplog.text


@needs_compiler
def test_the_library_is_compiled_once_into_the_cache_and_checked(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A second build finds the first one's library (same path, not rewritten); the check passes on it."""
    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(tmp_path))
    first = native._compiled(native_noise.SOURCE, native_noise.LIBRARIES)
    stamp = first.stat().st_mtime_ns
    assert native._compiled(native_noise.SOURCE, native_noise.LIBRARIES) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left
    monkeypatch.setattr(native, "_built", {})
    assert native_noise.native_transform() is not None


@needs_compiler
def test_a_fused_addition_unlike_torchs_leaves_the_written_transform(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Where the fused addition does not give torch.add's bits (a torch build whose add does not fuse), the compiled
    transform still writes the noise and torch adds it: said once at info level, no warning."""
    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_built", {})
    monkeypatch.setattr(native_noise, "_check_add", lambda *args: "added its noise with other bits than torch.add")
    with caplog.at_level(logging.INFO, logger=native_noise.__name__):
        transform = native_noise.native_transform()
    assert isinstance(transform, native_noise.NativeTransform) and not transform.adds
    assert "written, then added" in caplog.text and "WARNING" not in caplog.text
    from lightning_privdec.privacy import noise

    assert noise._added_as_made([torch.zeros(4)], [torch.ones(4)], [0, 4], 1.0, 1.0) is None


@needs_compiler
def test_draws_on_the_host_go_through_the_compiled_transform(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 draw on the host runs the compiled transform (every chunk), and NumPy's when it is switched off."""
    from lightning_privdec.privacy.noise import NoiseGenerator

    calls = []
    compiled = native_noise.native_transform()
    assert compiled is not None

    def counted(*args):  # noqa: ANN002, ANN202
        calls.append(len(args[2]))
        return compiled(*args)

    monkeypatch.setattr(keystream, "native_transform", lambda: counted)
    NoiseGenerator(bytes(32), seeded=True).normal(300_001, 1.0)
    assert sum(calls) == 150_001 and len(calls) == 2  # every pair, in chunks of CHUNK_WORDS = 2^17 pairs
    monkeypatch.setattr(keystream, "native_transform", native_noise.native_transform)
    monkeypatch.setenv("PRIVDEC_NATIVE_NOISE", "off")
    spied, numpys = [], keystream._narrow_box_muller_numpy

    def numpy_spy(*args):  # noqa: ANN002, ANN202
        spied.append(len(args[2]))
        return numpys(*args)

    monkeypatch.setattr(keystream, "_narrow_box_muller_numpy", numpy_spy)
    NoiseGenerator(bytes(32), seeded=True).normal(1001, 1.0)
    assert spied == [501]


@needs_compiler
def test_the_compiled_transform_refuses_arrays_it_cannot_take() -> None:
    """More sines than pairs, misaligned or shared memory, a wrong dtype or a read-only output: a clear error, never
    a call into C with them."""
    transform = native_noise.native_transform()
    assert transform is not None
    constants = keystream._narrow_constants(1.0)
    words, angles = np.zeros(8, np.int64), np.zeros(8, np.int32)
    cosines, sines = np.empty(8, np.float32), np.empty(8, np.float32)
    with pytest.raises(ValueError, match="9 sines of 8 pairs"):
        transform(words, angles, cosines, np.empty(9, np.float32), *constants)
    with pytest.raises(ValueError, match="must not share memory"):
        transform(words, angles, cosines, cosines[:4], *constants)
    misaligned = np.frombuffer(bytearray(8 * 8 + 1), dtype=np.int64, count=8, offset=1)
    assert not misaligned.flags.aligned
    with pytest.raises(ValueError, match="aligned"):
        transform(misaligned, angles, cosines, sines, *constants)
    with pytest.raises(ValueError, match="int32"):
        transform(words, angles.astype(np.int64), cosines, sines, *constants)
    read_only = np.empty(8, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        transform(words, angles, read_only, sines, *constants)


@needs_compiler
def test_a_library_others_may_write_is_not_loaded(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The cached library itself must be this user's alone: one that others may write is refused (and NumPy's
    transform runs), as is a link in its place."""
    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(tmp_path))
    library = native._compiled(native_noise.SOURCE, native_noise.LIBRARIES)
    library.chmod(0o777)
    with pytest.raises(RuntimeError, match="not this user's alone"):
        native._load(library)
    monkeypatch.setattr(native, "_built", {})
    assert native_noise.native_transform() is None
    library.chmod(0o755)
    moved = library.with_name("elsewhere.so")
    library.rename(moved)
    library.symlink_to(moved)
    with pytest.raises(OSError):
        native._load(library)  # O_NOFOLLOW: a link is not opened


def _build_in_child() -> None:
    if native_noise.native_transform() is None:
        raise SystemExit(3)


@needs_compiler
def test_a_process_forked_while_another_thread_builds_can_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A fork copies the build lock as it is: taken, if another thread was building. The child gets a fresh lock and
    builds instead of waiting forever."""
    import multiprocessing

    monkeypatch.setenv("PRIVDEC_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_built", {})
    with native._lock:  # as if another thread were building when the process forks
        child = multiprocessing.get_context("fork").Process(target=_build_in_child)
        child.start()
        child.join(timeout=120)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
