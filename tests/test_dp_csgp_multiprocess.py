"""DP-CSGP and its baselines, trained for real on 4 CPU processes (gloo) on scikit-learn's digits."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_privdec.privacy import epsilon_for
from tests.multiprocess import fit_digits, fit_digits_in_one_launch, relative_consensus_distance

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


def test_dp_csgp_trains_digits_above_chance_at_epsilon_3_and_reports_its_epsilon(tmp_path):
    command = [sys.executable, str(ROOT / "examples" / "digits.py"), "--epsilon", "3", "--epochs", "15", "--json"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["strategy"] == "dp_csgp" and result["compressor"] == "RandK(ratio=0.5)"
    assert min(result["test_acc_per_node"]) > 0.5  # chance is 0.1
    for eps in result["epsilon_per_node"]:
        assert 2.9 <= eps <= 3.0  # the calibrated sigma spends the budget, within 1%, never more
    # the epsilon the run reports is the RDP accountant's for its own history (node 0: 337 of 1,348 images)
    sample_rate = 32 / 337
    expected = epsilon_for(result["noise_multiplier"], sample_rate, result["steps"], 1e-5)
    assert result["epsilon_per_node"][0] == pytest.approx(expected, rel=1e-6)


def read_csv_metrics(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_privacy_budget_is_logged_per_node_and_training_stops_before_exceeding_it(tmp_path):
    # a fixed sigma with a small budget: the callback must stop the run long before max_epochs
    results = fit_digits(
        tmp_path / "run", "--strategy", "privsgp", "--noise-multiplier", "1.5", "--epsilon", "2.0",
        "--max-epochs", "20", "--csv", "--noise-seed", "1",
    )
    steps = {r["global_step"] for r in results}
    assert len(steps) == 1, "all nodes must stop at the same step"
    (step,) = steps
    assert 0 < step < 20 * 11
    for node in results:
        assert node["stopped_at_step"] == step
        assert node["epsilon"] <= 2.0
        assert node["ledger_steps"] == step
        assert epsilon_for(1.5, node["sample_rate"], step + 1, 1e-5) > 2.0  # one more step would have exceeded it
    rows = read_csv_metrics(tmp_path / "run" / "csv" / "version_0" / "metrics.csv")
    logged = [row for row in rows if row.get("privacy/epsilon/node_3")]
    assert logged, "per-node epsilon never reached the logger"
    last = logged[-1]
    assert float(last["privacy/epsilon_max"]) == pytest.approx(max(r["epsilon"] for r in results), rel=1e-6)
    assert {f"privacy/epsilon/node_{i}" for i in range(4)} <= set(last)


def test_a_resumed_private_run_continues_its_epsilon_and_its_trajectory(tmp_path):
    common = ["--strategy", "dp_csgp", "--compressor", "randk:0.5", "--gamma", "0.5", "--epsilon", "2.0",
              "--noise-seed", "7", "--lr", "0.3"]
    checkpoint = str(tmp_path / "ckpt" / "epoch=1-*.ckpt")
    first, resumed, longer = fit_digits_in_one_launch(
        (tmp_path / "first", [*common, "--max-epochs", "4", "--ckpt-dir", str(tmp_path / "ckpt")]),
        (tmp_path / "resumed", [*common, "--max-epochs", "4", "--resume", checkpoint]),
        # resuming with a longer plan keeps the total within the budget
        (tmp_path / "longer", [*common, "--max-epochs", "8", "--resume", checkpoint]))
    for a, b in zip(first, resumed):
        assert b["ledger_steps"] == a["ledger_steps"] == a["global_step"]  # the count continued, not reset
        assert b["epsilon"] == pytest.approx(a["epsilon"], rel=1e-9)
        assert (a["params"] == b["params"]).all()  # same noise, same samples, same gossip
    for node in longer:
        assert node["global_step"] == 88
        assert node["epsilon"] <= 2.0
        assert node["noise_multiplier"] > first[0]["noise_multiplier"]


def test_privsgp_and_dp2sgd_baselines_train(tmp_path):
    privsgp, dp2sgd = fit_digits_in_one_launch(
        (tmp_path / "privsgp", ["--strategy", "privsgp", "--epsilon", "8", "--lr", "0.5", "--max-epochs", "10"]),
        (tmp_path / "dp2sgd", ["--strategy", "dp2sgd", "--topology", "ring", "--epsilon", "8", "--lr", "0.5",
                               "--max-epochs", "10"]))
    for results in (privsgp, dp2sgd):
        assert min(r["test_acc"] for r in results) > 0.6
        assert max(r["epsilon"] for r in results) <= 8.0
        assert relative_consensus_distance(results) < 0.1


def test_16_mixed_takes_the_same_steps_on_every_node_as_float32(tmp_path):
    """precision="16-mixed" (float16 autocast and Lightning's GradScaler, on CPU) on 4 gossiping nodes: every node
    takes every step (none skipped), each node's ledger counts the float32 run's steps and epsilon, and the models
    follow the float32 run's trajectory to float16's rounding (per-example gradients unscaled before clipping)."""
    common = ["--strategy", "dp_csgp", "--epsilon", "3", "--noise-seed", "3", "--max-epochs", "2", "--lr", "0.3"]
    wide, half = fit_digits_in_one_launch((tmp_path / "float32", common), (tmp_path / "float16", [*common, "--float16"]))
    for a, b in zip(wide, half):
        assert a["global_step"] == b["global_step"] == 22 and a["ledger_steps"] == b["ledger_steps"] == 22
        assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-12)
        assert float((a["params"] - b["params"]).norm() / a["params"].norm()) < 1e-2
        assert abs(a["test_acc"] - b["test_acc"]) < 0.05
