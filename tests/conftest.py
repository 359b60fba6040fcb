"""Keep tests independent: an in-process Trainer leaves a process group and Lightning's launch variables behind."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist

from tests.multiprocess import kill_process_groups


def _stop(signum: int, frame: object) -> None:
    """A SIGTERM (a CI timeout, ``timeout``) ends the session like Ctrl-C: launched runs are killed on the way out."""
    kill_process_groups()
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _stop)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kill_process_groups()


@pytest.fixture(autouse=True)
def isolate_distributed_state():
    environment = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)
