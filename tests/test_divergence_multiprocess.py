"""The divergence guard and consensus_step="auto" in real 4-process runs (gloo) on scikit-learn's digits."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.multiprocess import SCRIPT, clean_environment

pytestmark = pytest.mark.multiprocess

UNSTABLE = ["--strategy", "push_sum", "--topology", "exponential", "--compressor", "randk:0.1", "--max-epochs", "8"]


def test_unstable_error_feedback_stops_every_node_with_the_cause(tmp_path):
    # RandK(0.1) with DP-CSGP's implicit consensus_step = 1: the error-feedback gossip blows up geometrically
    command = [sys.executable, str(SCRIPT), "--devices", "4", "--out", str(tmp_path), *UNSTABLE, "--gamma", "1"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=clean_environment())
    assert run.returncode != 0
    assert "DivergenceError: training diverged" in run.stderr, run.stderr[-4000:]
    assert "consensus_step=1 is too large for compressor=RandK(ratio=0.1) on this graph" in run.stderr
    assert not list(tmp_path.glob("rank*.pt"))  # no node went on to finish training


def test_the_same_run_with_the_automatic_consensus_step_trains(tmp_path):
    # consensus_step="auto" (the default), guard on
    command = [sys.executable, str(SCRIPT), "--devices", "4", "--out", str(tmp_path), *UNSTABLE]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240, env=clean_environment())
    assert run.returncode == 0, run.stderr[-4000:]
    output = run.stdout + run.stderr
    assert "consensus_step='auto' chose" not in output  # a default with nothing to act on: debug level only
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(4)]
    assert min(r["test_acc"] for r in results) > 0.8
