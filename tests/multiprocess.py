"""Helpers for tests that launch real multi-process Lightning runs of the scripts in tests/scripts/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).parent / "scripts" / "fit_digits.py"


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK")


def clean_environment() -> dict[str, str]:
    """This process's environment without distributed launch variables, so a child starts its own world."""
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


def fit_digits(out: Path, *args: str, devices: int = 4, timeout: float = 300, script: Path = SCRIPT) -> list[dict]:
    """Run the digits training on ``devices`` CPU processes (gloo) and return every rank's result."""
    command = [sys.executable, str(script), "--devices", str(devices), "--out", str(out), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=clean_environment())
    if result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return [torch.load(out / f"rank{rank}.pt") for rank in range(devices)]


def relative_consensus_distance(results: list[dict]) -> float:
    """max_i ||z_i - z_bar|| / ||z_bar|| over the nodes' final parameters."""
    params = torch.stack([r["params"] for r in results])
    mean = params.mean(0)
    return ((params - mean).norm(dim=1) / mean.norm()).max().item()
