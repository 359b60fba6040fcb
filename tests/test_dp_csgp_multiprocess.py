"""DP-CSGP and its baselines, trained for real on 4 CPU processes (gloo) on scikit-learn's digits: the quick start's
own launch, and every other fit in one shared launch (tests' fits one after the other in the same processes)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_privdec.privacy import epsilon_for
from tests.multiprocess import fit_digits_in_one_launch, relative_consensus_distance

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


RESUMED = ["--strategy", "dp_csgp", "--compressor", "randk:0.5", "--gamma", "0.5", "--epsilon", "2.0",
           "--noise-seed", "7", "--lr", "0.3"]
PRECISION = ["--strategy", "dp_csgp", "--epsilon", "3", "--noise-seed", "3", "--max-epochs", "2", "--lr", "0.3"]
#: every digits fit of the tests below, by name: the arguments after --out (a {ckpt} in them: the launch's checkpoints)
FITS = {
    # a fixed sigma with a small budget: the callback must stop the run long before max_epochs
    "budget": ["--strategy", "privsgp", "--noise-multiplier", "1.5", "--epsilon", "2.0", "--max-epochs", "20", "--csv",
               "--noise-seed", "1"],
    "first": [*RESUMED, "--max-epochs", "3", "--ckpt-dir", "{ckpt}"],
    "resumed": [*RESUMED, "--max-epochs", "3", "--resume", "{ckpt}/epoch=1-*.ckpt"],
    # resuming with a longer plan keeps the total within the budget
    "longer": [*RESUMED, "--max-epochs", "5", "--resume", "{ckpt}/epoch=1-*.ckpt"],
    # 5 epochs: measured worst node 0.85-0.88 over three noise draws, consensus distance 0.064 (privsgp), 0.039 (dp2sgd)
    "privsgp": ["--strategy", "privsgp", "--epsilon", "8", "--lr", "0.5", "--max-epochs", "5"],
    "dp2sgd": ["--strategy", "dp2sgd", "--topology", "ring", "--epsilon", "8", "--lr", "0.5", "--max-epochs", "5"],
    "float32": PRECISION,
    "float16": [*PRECISION, "--float16"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """Every fit of :data:`FITS`, one after the other in one launch of 4 processes (a new Trainer and strategy each):
    the directory and each fit's per-rank results."""
    root = tmp_path_factory.mktemp("dp_csgp")
    fits = [(root / name, [a.format(ckpt=root / "ckpt") for a in args]) for name, args in FITS.items()]
    return root, dict(zip(FITS, fit_digits_in_one_launch(*fits)))


def test_privacy_budget_is_logged_per_node_and_training_stops_before_exceeding_it(runs):
    root, fits = runs
    results = fits["budget"]
    steps = {r["global_step"] for r in results}
    assert len(steps) == 1, "all nodes must stop at the same step"
    (step,) = steps
    assert 0 < step < 20 * 11
    for node in results:
        assert node["stopped_at_step"] == step
        assert node["epsilon"] <= 2.0
        assert node["ledger_steps"] == step
        assert epsilon_for(1.5, node["sample_rate"], step + 1, 1e-5) > 2.0  # one more step would have exceeded it
    rows = read_csv_metrics(root / "budget" / "csv" / "version_0" / "metrics.csv")
    logged = [row for row in rows if row.get("privacy/epsilon/node_3")]
    assert logged, "per-node epsilon never reached the logger"
    last = logged[-1]
    assert float(last["privacy/epsilon_max"]) == pytest.approx(max(r["epsilon"] for r in results), rel=1e-6)
    assert {f"privacy/epsilon/node_{i}" for i in range(4)} <= set(last)


def test_a_resumed_private_run_continues_its_epsilon_and_its_trajectory(runs):
    _, fits = runs
    first, resumed, longer = fits["first"], fits["resumed"], fits["longer"]
    for a, b in zip(first, resumed):
        assert b["ledger_steps"] == a["ledger_steps"] == a["global_step"] == 33  # the count continued, not reset
        assert b["epsilon"] == pytest.approx(a["epsilon"], rel=1e-9)
        assert (a["params"] == b["params"]).all()  # same noise, same samples, same gossip
    for node in longer:
        assert node["global_step"] == 55
        assert node["epsilon"] <= 2.0
        assert node["noise_multiplier"] > first[0]["noise_multiplier"]


def test_privsgp_and_dp2sgd_baselines_train(runs):
    _, fits = runs
    for results in (fits["privsgp"], fits["dp2sgd"]):
        assert min(r["test_acc"] for r in results) > 0.6
        assert max(r["epsilon"] for r in results) <= 8.0
        assert relative_consensus_distance(results) < 0.1


def test_16_mixed_takes_the_same_steps_on_every_node_as_float32(runs):
    """precision="16-mixed" (float16 autocast and Lightning's GradScaler, on CPU) on 4 gossiping nodes: every node
    takes every step (none skipped), each node's ledger counts the float32 run's steps and epsilon, and the models
    follow the float32 run's trajectory to float16's rounding (per-example gradients unscaled before clipping)."""
    _, fits = runs
    for a, b in zip(fits["float32"], fits["float16"]):
        assert a["global_step"] == b["global_step"] == 22 and a["ledger_steps"] == b["ledger_steps"] == 22
        assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-12)
        assert float((a["params"] - b["params"]).norm() / a["params"].norm()) < 1e-2
        assert abs(a["test_acc"] - b["test_acc"]) < 0.05
