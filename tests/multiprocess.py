"""Helpers for tests that launch real multi-process Lightning runs of the scripts in tests/scripts/."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

SCRIPT = Path(__file__).parent / "scripts" / "fit_digits.py"


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK")


def clean_environment() -> dict[str, str]:
    """This process's environment without distributed launch variables, so a child starts its own world."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


#: process groups of launched runs still alive (killed when the test ends, or when pytest is stopped)
_LIVE_GROUPS: set[int] = set()

#: ``python -c WATCHDOG <pytest's pid> command...``: runs the command in the watchdog's own process group and kills the
#: whole group when pytest ends, however it ends (SIGKILL, pytest-timeout's os._exit) through the kernel's parent-death
#: signal; the command's exit status is passed on.
WATCHDOG = """
import ctypes, os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda signum, frame: os.killpg(0, signal.SIGKILL))
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):  # pytest ended before the prctl
    os.killpg(0, signal.SIGKILL)
code = subprocess.call(sys.argv[2:])
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def die_with_parent() -> None:
    """In a worker started by ``torch.multiprocessing`` from a test: SIGKILL when the parent ends (a rank blocked in
    a gloo collective would not act on the SIGINT torch arranges)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def launch(command: Sequence[str], **popen: object) -> subprocess.Popen:
    """Start ``command`` in a session of its own (its process group's id is the returned process's pid), registered
    for :func:`kill_process_groups`; on Linux the group also dies with this process."""
    popen.setdefault("env", clean_environment())
    if sys.platform.startswith("linux"):
        command = [sys.executable, "-c", WATCHDOG, str(os.getpid()), *command]
    process = subprocess.Popen(list(command), start_new_session=True, **popen)  # type: ignore[call-overload]
    _LIVE_GROUPS.add(process.pid)
    return process


def kill_process_groups() -> None:
    """SIGKILL every launched run's whole process group: the launcher and every rank it started (a rank blocked in
    a collective may ignore SIGTERM)."""
    for group in list(_LIVE_GROUPS):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        _LIVE_GROUPS.discard(group)


def stop_group(process: subprocess.Popen, timeout: float | None = None) -> None:
    """SIGKILL the process group of a :func:`launch`-ed ``process`` and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait(timeout=timeout)
    _LIVE_GROUPS.discard(process.pid)


@contextmanager
def process_group(command: Sequence[str], **popen: object) -> Iterator[subprocess.Popen]:
    """:func:`launch`, killed with all its children on exit: after the test, on a timeout or an assertion, and when
    pytest itself is interrupted (tests/conftest.py)."""
    process = launch(command, **popen)
    try:
        yield process
    finally:
        stop_group(process)


def run_group(command: Sequence[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(capture_output=True, text=True)``, but the whole process group dies with it."""
    with process_group(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd) as process:
        stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)


def fit_digits(out: Path, *args: str, devices: int = 4, timeout: float = 300, script: Path = SCRIPT) -> list[dict]:
    """Run the digits training on ``devices`` CPU processes (gloo; forked by Lightning's multiprocessing launcher unless
    ``args`` name ``--start-method popen``) and return every rank's result."""
    (results,) = fit_digits_in_one_launch((out, args), devices=devices, timeout=timeout, script=script)
    return results


def fit_digits_in_one_launch(
    *fits: tuple[Path, Sequence[str]], devices: int = 4, timeout: float = 300, script: Path = SCRIPT
) -> list[list[dict]]:
    """Several digits fits one after the other in the same ``devices`` processes (one launch; a later fit may
    ``--resume`` a checkpoint pattern an earlier one wrote); every fit's per-rank results."""
    command = [sys.executable, str(script)]
    for i, (out, args) in enumerate(fits):
        command += [*(["--then"] if i else []), "--devices", str(devices), "--out", str(out), *args]
    result = run_group(command, timeout)
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return [[torch.load(out / f"rank{rank}.pt") for rank in range(devices)] for out, _ in fits]


def relative_consensus_distance(results: list[dict]) -> float:
    """max_i ||z_i - z_bar|| / ||z_bar|| over the nodes' final parameters."""
    params = torch.stack([r["params"] for r in results])
    mean = params.mean(0)
    return ((params - mean).norm(dim=1) / mean.norm()).max().item()
