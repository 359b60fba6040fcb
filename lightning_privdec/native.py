"""Small C kernels compiled on first use for this machine, cached per user, loaded only when they can be trusted.

A kernel's module (:mod:`lightning_privdec.privacy.native_noise`, :mod:`lightning_privdec.compression.native_qsgd`)
names its C source; :func:`library` compiles it (``$CC``, default ``cc``, with :data:`FLAGS`) into a per-user cache
directory (``$PRIVDEC_NATIVE_CACHE``, default ``$XDG_CACHE_HOME/lightning_privdec`` or ``~/.cache/lightning_privdec``),
named by a hash of the source, the flags, the compiler and its version, glibc's version and the CPU, so processes
sharing a machine compile it once (an atomic rename: a concurrent compile is harmless). The directory must be this
user's alone and no link; the library is opened without following links, checked to be this user's alone and loaded
through that descriptor (what is checked is what is loaded). Each kernel's module then checks the kernel against its
NumPy or torch path before use and falls back to that path on any failure (:func:`once`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared")
#: values of a kernel's switch variable (``PRIVDEC_NATIVE_NOISE``, ``PRIVDEC_NATIVE_QSGD``) that turn it off
OFF = ("0", "false", "off", "no")

T = TypeVar("T")
_lock = threading.Lock()  # guards _locks
_locks: dict[str, threading.Lock] = {}  # one per kernel: a kernel's build never waits for another's
_built: dict[str, Any] = {}
_building = threading.local()  # the names this thread is building (a check that reaches its own kernel gets None)


def _new_lock_in_child() -> None:
    """A process forked while another thread builds holds copies of taken locks: fresh ones let it build."""
    global _lock, _locks
    _lock, _locks = threading.Lock(), {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def switched_off(variable: str) -> bool:
    """Whether the environment variable ``variable`` turns a kernel off (:data:`OFF`)."""
    return os.environ.get(variable, "1").strip().lower() in OFF


def once(name: str, build: Callable[[], T | None]) -> T | None:
    """``build()``'s result for ``name``, built once per process (the first caller builds, the others wait for that
    kernel only); None to a call from within its own build (a check that reaches its own kernel: the fallback)."""
    if name in _built:
        return _built[name]
    building = getattr(_building, "names", frozenset())
    if name in building:
        return None
    with _lock:
        lock = _locks.setdefault(name, threading.Lock())
    with lock:
        if name not in _built:
            _building.names = building | {name}
            try:
                _built[name] = build()
            finally:
                _building.names = building
    return _built[name]


def kernel(
    switch: str, source: Path, make: Callable[[ctypes.CDLL], T], check: Callable[[T], str | None], *,
    libraries: Sequence[str] = (), what: str, fallback: str, needs: str = "a C compiler",
) -> T | None:
    """``make(library)`` of ``source``'s library, built once per process, if ``check`` of it returns None; else None
    (the caller runs ``fallback``, its NumPy or torch path). ``switch`` (an environment variable, :data:`OFF`) turns
    it off; any failure (no compiler, a cache that cannot be trusted, a check that fails or raises) is said once in
    the log, as ``what``'s."""
    if switched_off(switch):
        return None

    def build() -> T | None:
        try:
            loaded = library(source, libraries)
        except Exception as error:  # noqa: BLE001 - whatever stops the build: the fallback
            log.info("%s: %s (the compiled one needs %s): %s", what, fallback, needs, error)
            return None
        try:
            made = make(loaded)
            failure = check(made)
        except Exception as error:  # noqa: BLE001
            failure = f"failed its check: {error!r}"
        if failure is not None:
            log.warning("%s: %s; the compiled one %s (please report it; %s=0 skips it)", what, fallback, failure,
                        switch)
            return None
        return made

    return once(source.stem, build)


def library(source: Path, libraries: Sequence[str] = ()) -> ctypes.CDLL:
    """``source`` compiled (or found in the cache) and loaded; raises whatever stops it."""
    return _load(_compiled(source, libraries))


def pointers(arrays: Sequence[tuple[Any, Any, int]], writeable: Sequence[Any] = ()) -> list[int]:
    """The addresses of ``arrays`` (``(array, dtype, least size)`` each: NumPy vectors) for a C kernel whose pointers
    are ``restrict``: each 1-D, contiguous, aligned, of its dtype and at least its size, those in ``writeable``
    writeable, and no two sharing memory; a ValueError says which condition fails."""
    spans = []
    for array, dtype, size in arrays:
        flags = array.flags
        if array.dtype != dtype or array.ndim != 1 or len(array) < size or not (flags.c_contiguous and flags.aligned):
            raise ValueError(f"compiled kernel: expected a contiguous, aligned {dtype} vector of at least {size} "
                             f"entries, got {array.dtype} {array.shape}")
        spans.append((array.ctypes.data, array.nbytes))
    if not all(array.flags.writeable for array in writeable):
        raise ValueError("compiled kernel: the outputs must be writeable")
    if overlap(spans):
        raise ValueError("compiled kernel: its arrays must not share memory")
    return [start for start, _ in spans]


def overlap(spans: Sequence[tuple[int, int]]) -> bool:
    """Whether any two of the memory spans ``(address, bytes)`` overlap (an empty one overlaps nothing)."""
    ordered = sorted((start, start + nbytes) for start, nbytes in spans if nbytes)
    return any(end > next_start for (_, end), (next_start, _) in zip(ordered, ordered[1:]))


def run_parts(parts: Sequence[Callable[[], None]], stop: Callable[[], None] | None = None) -> None:
    """``parts[0]`` on this thread and every other part on a thread of its own (a compiled loop releases the GIL),
    kept off this thread's CPU where it may run elsewhere (:func:`keep_off`); a part whose thread cannot start runs on
    this thread. Returns when every part has ended (an interrupt while waiting waits on, so nothing writes after the
    return) and raises the first failure; ``stop()``, if given, is called at every failure (parts that can end early
    check what it sets)."""
    failures: list[BaseException] = []
    callers_cpu = cpu_now()

    def failed(error: BaseException) -> None:
        failures.append(error)
        if stop is not None:
            stop()

    def run(part: Callable[[], None], helper: bool) -> None:
        if helper:
            keep_off(callers_cpu)
        try:
            part()
        except BaseException as error:  # noqa: BLE001 - re-raised on the calling thread
            failed(error)

    started: list[threading.Thread] = []
    try:
        for part in parts[1:]:
            thread = threading.Thread(target=run, args=(part, True), daemon=True)
            try:
                thread.start()
            except RuntimeError:  # no thread to be had: this one runs the part
                run(part, False)
                continue
            started.append(thread)
        if parts:
            run(parts[0], False)
    finally:
        for thread in started:
            while thread.is_alive():
                try:
                    thread.join()
                except BaseException as error:  # noqa: BLE001
                    failed(error)
    if failures:
        raise failures[0]


_SCHED_GETCPU = getattr(ctypes.CDLL(None), "sched_getcpu", None) if sys.platform.startswith("linux") else None


def cpu_now() -> int | None:
    """The CPU the calling thread runs on (Linux), else None."""
    cpu = _SCHED_GETCPU() if _SCHED_GETCPU is not None else -1
    return cpu if cpu >= 0 else None


def keep_off(cpu: int | None) -> None:
    """Keep this thread, a short-lived helper of :func:`run_parts`, off ``cpu`` (its caller's) where it may run
    elsewhere: two threads of one job that share a core run no faster than one, and the scheduler put them there
    whenever another process kept the second core busy (a float32 noise draw took from 7% less to 8% more with 2
    threads than with 1; kept apart, 11-26% less, and the same when idle). The caller's own CPUs are untouched."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return
    try:
        allowed = os.sched_getaffinity(0)
        if cpu in allowed and len(allowed) > 1:
            os.sched_setaffinity(threading.get_native_id(), allowed - {cpu})
    except OSError:  # a CPU set this thread may not change: it runs where the scheduler puts it
        pass


def host_float32(tensor: Any) -> bool:
    """Whether ``tensor`` (a torch tensor) is a contiguous float32 vector of host memory: what the float32 kernels
    take by address."""
    return host_vector(tensor, "torch.float32")


def host_vector(tensor: Any, dtype: str) -> bool:
    """Whether ``tensor`` (a torch tensor) is a contiguous vector of host memory of ``dtype`` (its name, e.g.
    ``"torch.float64"``: the float64 clipped sums the noise kernel reads)."""
    return tensor.device.type == "cpu" and str(tensor.dtype) == dtype and tensor.is_contiguous()


def tensors_overlap(tensors: Sequence[Any], in_place: Sequence[tuple[Any, Any]] = ()) -> bool:
    """Whether the memory of any two of ``tensors`` and the ``in_place`` pairs' tensors overlaps, an ``(output,
    input)`` pair of ``in_place`` being allowed to be the same memory (a kernel that reads an entry before it writes
    it); :func:`overlap` of their spans."""
    def span(t: Any) -> tuple[int, int]:
        return t.data_ptr(), t.numel() * t.element_size()

    spans = [span(t) for t in tensors]
    for output, given in in_place:
        spans += [span(output)] if span(given) == span(output) else [span(output), span(given)]
    return overlap(spans)


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


#: descriptors of the loaded libraries, kept open: the dynamic loader knows a library by the name it was opened with,
#: so a closed descriptor's number, reused for the next library, would name the first one again
_descriptors: list[int] = []


def _load(path: Path) -> ctypes.CDLL:
    """The library at ``path``, opened without following a link and checked to be this user's alone before it is
    loaded through its open descriptor (what is checked is what is loaded)."""
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    through_descriptor = os.path.isdir("/proc/self/fd")
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise RuntimeError(f"{path} is not a regular file")
        _private(info, str(path))
        loaded = ctypes.CDLL(f"/proc/self/fd/{descriptor}" if through_descriptor else str(path))
    except BaseException:
        os.close(descriptor)
        raise
    if through_descriptor:
        _descriptors.append(descriptor)
    else:
        os.close(descriptor)
    return loaded


@functools.cache
def _toolchain(cc: str) -> tuple[list[str], str]:
    """The compiler command ``cc`` names and what a library built by it depends on (the command, its version,
    glibc's version, the CPU), once per process and ``$CC`` for every kernel."""
    compiler = shlex.split(cc)
    if not compiler or shutil.which(compiler[0]) is None:
        raise RuntimeError(f"no C compiler ({cc}) on the PATH")
    if platform.system() != "Linux":
        raise RuntimeError(f"the kernels are built for glibc (Linux); this is {platform.system()}")
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    return compiler, repr((compiler, version, platform.libc_ver(), _cpu_signature()))


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and flags where Linux says them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _compiled(source: Path, libraries: Sequence[str] = ()) -> Path:
    """The library's path in the cache, compiled there first when absent."""
    compiler, toolchain = _toolchain(os.environ.get("CC", "cc"))
    digest = hashlib.sha256()
    for part in (source.read_bytes(), repr((FLAGS, tuple(libraries))).encode(), toolchain.encode()):
        digest.update(part)
    directory = _cache_directory()
    target = directory / f"{source.stem.lstrip('_')}-{digest.hexdigest()[:24]}.so"
    if target.exists():
        return target
    handle, partial_path = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=directory)
    os.close(handle)
    try:
        done = subprocess.run([*compiler, *FLAGS, str(source), "-o", partial_path, *libraries], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(compiler[0]).name} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial_path, target)
    finally:
        if os.path.exists(partial_path):
            os.unlink(partial_path)
    return target
