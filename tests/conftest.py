"""Keep tests independent: an in-process Trainer leaves a process group and Lightning's launch variables behind."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import kill_process_groups


def _stop(signum: int, frame: object) -> None:
    """A SIGTERM (a CI timeout, ``timeout``) ends the session like Ctrl-C: launched runs are killed on the way out."""
    kill_process_groups()
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _stop)

#: intra-op threads of an xdist worker (None: torch's default, one per core)
WORKER_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else None
if WORKER_THREADS is not None:
    # pytest-xdist runs one worker per core (README: -n 2 on 2 cores): intra-op threads in each would oversubscribe
    # them, and OpenMP's threads then wait for each other at every parallel op (10-30x slower). OMP_NUM_THREADS also
    # stops Lightning's launchers from raising the count to one per core at every in-process fit.
    os.environ["OMP_NUM_THREADS"] = str(WORKER_THREADS)
    torch.set_num_threads(WORKER_THREADS)


#: the noise's compiled transform (privacy/native_noise.py) is built into a directory of this session's, not the
#: user's cache; processes the tests launch inherit it
NATIVE_CACHE = os.environ.setdefault("PRIVDEC_NATIVE_CACHE", tempfile.mkdtemp(prefix="privdec-native-"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kill_process_groups()
    if NATIVE_CACHE.startswith(tempfile.gettempdir()) and "privdec-native-" in NATIVE_CACHE:
        shutil.rmtree(NATIVE_CACHE, ignore_errors=True)


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
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # a test (or a Trainer it ran) that changed them does not slow the next ones
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)
