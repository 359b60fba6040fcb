"""Keep tests independent: an in-process Trainer leaves a process group and Lightning's launch variables behind."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import kill_process_groups


def _stop(signum: int, frame: object) -> None:
    """A SIGTERM (a CI timeout, ``timeout``) ends the session like Ctrl-C: launched runs are killed on the way out."""
    kill_process_groups()
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _stop)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist runs one worker per core (README: -n 2 on 2 cores): intra-op threads in each would oversubscribe
    # them. A test that needs several threads sets them itself.
    torch.set_num_threads(1)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kill_process_groups()


#: the device of the tests that take the ``device`` fixture (per-sample clipping, noise, mixed precision): ``cpu``,
#: or ``cuda`` to run them on a GPU (benchmarks/gpu_check.py sets it); a GPU named without one fails every such test
TEST_DEVICE_VARIABLE = "PRIVDEC_TEST_DEVICE"


@pytest.fixture
def device() -> torch.device:
    """``torch.device`` of ``$PRIVDEC_TEST_DEVICE`` (default ``cpu``)."""
    device = torch.device(os.environ.get(TEST_DEVICE_VARIABLE, "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.fail(f"{TEST_DEVICE_VARIABLE}={device} but torch sees no CUDA device")
    return device


@pytest.fixture
def accelerator(device: torch.device) -> str:
    """Lightning's ``accelerator`` for :func:`device`."""
    return "gpu" if device.type == "cuda" else device.type


@pytest.fixture(autouse=True)
def isolate_distributed_state():
    environment = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)
