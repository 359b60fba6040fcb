"""A run launched by a test dies with the test process, however that process ends (here: SIGKILL, which no handler
sees), down to the processes the run started itself (as Lightning's launcher starts ranks 1..n)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"),
]

REPO = Path(__file__).resolve().parents[1]

#: stands in for pytest: launches a run whose own child writes its pid, then waits
TEST_PROCESS = """
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.multiprocess import launch
rank = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
launch([sys.executable, "-c", "import subprocess, sys; subprocess.call(sys.argv[1:])", sys.executable, "-c", rank,
        sys.argv[2]])
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_killed_test_process_takes_its_launched_runs_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "rank"
    parent = subprocess.Popen([sys.executable, "-c", TEST_PROCESS, str(REPO), str(pid_file)])
    rank = None
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()):
            assert parent.poll() is None and time.monotonic() < deadline, "the run never started"
            time.sleep(0.1)
        rank = int(pid_file.read_text())
        assert alive(rank)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while alive(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(rank), "the launched run outlived the test process that started it"
    finally:
        parent.kill()
        parent.wait()
        if rank is not None and alive(rank):
            os.kill(rank, signal.SIGKILL)
