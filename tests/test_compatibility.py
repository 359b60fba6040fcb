"""The models users bring train privately, unchanged: the CI subset of benchmarks/compatibility.py (docs/models.md).

torchvision's ResNet-18 (GroupNorm, in-place ReLU, residual +=), Lightning's own Transformer demo, the LSTM demo's
model (a fresh state per batch: the demo itself carries its state across batches, which per-example privacy cannot
allow), a Hugging Face GPT-2 built from a config, a frozen backbone and bf16-mixed, each with DP-CSGP's default
per-sample mode on 2 gloo processes. The benchmark gives each model a launch of its own (one model's crash cannot
spoil another's cells); here every model's cell runs in one launch of the benchmark's per-launch child, so the test
pays the processes' start-up once.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.multiprocess import run_group

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compatibility.py"
SUBSET = ("resnet18", "transformer_demo", "lstm", "gpt2", "frozen_backbone", "resnet18_bf16")


def test_the_representative_models_train_with_a_private_strategy(tmp_path: Path) -> None:
    out = tmp_path / "cells.json"
    command = [sys.executable, str(SCRIPT), "--child", "--out", str(out), "--workdir", str(tmp_path),
               "--models", ",".join(SUBSET), "--strategies", "dp_csgp", "--modes", "bookkeeping"]
    result = run_group(command, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    cells = json.loads(out.read_text())
    assert {model: row["dp_csgp/bookkeeping"] for model, row in cells.items()} == {model: "trains" for model in SUBSET}
