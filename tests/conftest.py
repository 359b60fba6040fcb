"""Keep tests independent: an in-process Trainer leaves a process group and Lightning's launch variables behind.

Also memoizes Opacus's RDP of one subsampled Gaussian step (a pure function of (q, sigma, alpha)): the calibrations and
ledgers of many tests evaluate the same orders at the same (q, sigma) again and again (in a pure-Python series)."""

from __future__ import annotations

import os
import signal

import numpy as np
import opacus.accountants.analysis.prv.prvs as opacus_prvs
import opacus.accountants.analysis.rdp as opacus_rdp
import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import kill_process_groups


def _stop(signum: int, frame: object) -> None:
    """A SIGTERM (a CI timeout, ``timeout``) ends the session like Ctrl-C: launched runs are killed on the way out."""
    kill_process_groups()
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _stop)

_SCALARS = (float, int, np.floating, np.integer)
_RDP_CACHE_LIMIT = 1 << 18
_rdp_cache: dict[tuple, object] = {}
_compute_rdp = opacus_rdp._compute_rdp


def _memoized_compute_rdp(q, sigma, alpha):
    """Opacus's ``_compute_rdp(q, sigma, alpha)``, computed once per exact argument values and types (the same float
    comes back: nothing a test checks changes, only how often the series is summed). Anything else (a tensor) is
    passed straight through."""
    if not all(isinstance(v, _SCALARS) for v in (q, sigma, alpha)):
        return _compute_rdp(q, sigma, alpha)
    key = (q, sigma, alpha, type(q), type(sigma), type(alpha))
    value = _rdp_cache.get(key)
    if value is None:
        if len(_rdp_cache) >= _RDP_CACHE_LIMIT:
            _rdp_cache.clear()
        value = _rdp_cache[key] = _compute_rdp(q, sigma, alpha)
    return value


# compute_rdp looks _compute_rdp up in its module; the PRV module imported the name itself
opacus_rdp._compute_rdp = _memoized_compute_rdp
opacus_prvs._compute_rdp = _memoized_compute_rdp


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
