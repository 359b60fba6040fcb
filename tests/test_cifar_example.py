"""examples/cifar_resnet.py end to end on CPU: synthetic CIFAR-shaped data, 2 processes, tiny limits."""

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.multiprocess import run_group
from tests.scripts_as_modules import load_script

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cifar_resnet.py"


def run_example(tmp_path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return run_group([sys.executable, str(EXAMPLE), *args], timeout, cwd=tmp_path)


def example_module() -> ModuleType:
    """The example imported in this process: no launch needed where it exits before training."""
    return load_script(EXAMPLE)


@pytest.mark.multiprocess
def test_synthetic_private_run_with_dirichlet_partition(tmp_path: Path):
    result = run_example(
        tmp_path, "--synthetic", "--synthetic-size", "32", "--devices", "2", "--max-steps", "2", "--batch-size", "4",
        "--num-workers", "0", "--partition", "dirichlet", "--alpha", "0.5", "--strategy", "dp_csgp", "--json",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["nodes"] == 2
    assert report["compressor"] == "RandK(ratio=0.5)" and report["delta"] == 1e-4  # the paper's defaults
    assert all(0 < eps <= 3.0 for eps in report["epsilon_per_node"])
    assert report["bytes_sent_node0"] > 0
    assert report["parameters_finite_per_node"] == [True, True] and report["peak_gpu_memory_bytes_per_node"] is None
    assert report["train_loss"] == report["train_loss"]  # not NaN
    assert list(tmp_path.glob("lightning_logs/cifar_dp_csgp/version_0/metrics.csv"))


def test_failed_download_names_synthetic(tmp_path: Path):
    # this machine reaches only package registries, so the download fails (and fails before any process launch):
    # sys.exit(message), which Python prints without a traceback and turns into exit status 1
    with pytest.raises(SystemExit) as exit_:
        example_module().main(["--data-dir", str(tmp_path / "no_cifar_here"), "--devices", "2", "--max-steps", "1"])
    message = exit_.value.code
    assert isinstance(message, str) and "--synthetic" in message and "CIFAR-10" in message


def test_help_states_the_papers_defaults(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        example_module().main(["--help"])
    assert exit_.value.code == 0
    assert "dp_csgp: lr 0.03, clip 1.5, delta 0.0001" in " ".join(capsys.readouterr().out.split())
