"""The divergence guard and consensus_step="auto" in real 4-process runs (gloo) on scikit-learn's digits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.multiprocess import SCRIPT, run_group

pytestmark = pytest.mark.multiprocess

UNSTABLE = ["--strategy", "push_sum", "--topology", "exponential", "--compressor", "randk:0.1", "--max-epochs", "8"]


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One launch of 4 processes: the run with consensus_step="auto" (the default, guard on), then in the same
    processes the same run with consensus_step=1, which must stop every node; the directory and the launch's result."""
    root = tmp_path_factory.mktemp("divergence")
    command = [sys.executable, str(SCRIPT), "--devices", "4", "--out", str(root / "auto"), *UNSTABLE,
               "--then", "--devices", "4", "--out", str(root / "gamma_1"), *UNSTABLE, "--gamma", "1"]
    return root, run_group(command, timeout=480)


def test_unstable_error_feedback_stops_every_node_with_the_cause(launch):
    # RandK(0.1) with DP-CSGP's implicit consensus_step = 1: the error-feedback gossip blows up geometrically
    root, run = launch
    assert run.returncode != 0
    assert "DivergenceError: training diverged" in run.stderr, run.stderr[-4000:]
    assert "consensus_step=1 is too large for compressor=RandK(ratio=0.1) on this graph" in run.stderr
    assert not list((root / "gamma_1").glob("rank*.pt"))  # no node went on to finish training


def test_the_same_run_with_the_automatic_consensus_step_trains(launch):
    root, run = launch
    assert sorted(p.name for p in (root / "auto").glob("rank*.pt")) == [f"rank{rank}.pt" for rank in range(4)], \
        run.stderr[-4000:]
    output = run.stdout + run.stderr
    assert "consensus_step='auto' chose" not in output  # a default with nothing to act on: debug level only
    results = [torch.load(root / "auto" / f"rank{rank}.pt") for rank in range(4)]
    assert min(r["test_acc"] for r in results) > 0.8
