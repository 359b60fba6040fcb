"""CPGTStrategy trained for real on 4 CPU processes (gloo) on scikit-learn's digits, resumed, and the quick start's
refusal (a step size outside Theorem 2 is refused in one process: tests/test_cpgt.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_privdec.privacy.accounting.cpgt import cpgt_epsilon, laplace_norm_factor
from tests.multiprocess import fit_digits_in_one_launch

pytestmark = pytest.mark.multiprocess

NOISE = {"noise_x": 0.01, "noise_y": 0.01, "noise_decay": 0.5, "lipschitz": 0.1}
COMMON = ["--strategy", "cpgt", "--topology", "ring", "--lr", "0.5", "--batch-size", "337", "--clip", "1.0",
          "--noise-seed", "3", "--strategy-kwargs", str(NOISE).replace("'", '"')]


def test_cpgt_trains_digits_reports_its_epsilon_and_resumes_every_nodes_state(tmp_path):
    first, resumed = fit_digits_in_one_launch(
        (tmp_path / "first", [*COMMON, "--max-epochs", "50", "--ckpt-dir", str(tmp_path / "ckpt")]),
        # resumed at round 40 (in the same processes, by a new Trainer and strategy)
        (tmp_path / "resumed", [*COMMON, "--max-epochs", "50", "--resume", str(tmp_path / "ckpt" / "epoch=39-*.ckpt")]))
    dimension = first[0]["params"].numel()
    for node in first:
        assert node["test_acc"] > 0.5  # chance is 0.1
        assert node["global_step"] == node["rounds"] == node["ledger_steps"] == 50  # full batch (B >= every shard, q = 1): 1 step per epoch
        # the only messages: two uncompressed float32 differences to each of the 2 ring neighbours per round
        assert node["bytes_sent"] == 50 * 2 * 2 * 4 * dimension
        # the epsilon the node's privacy reports is Theorem 2's bound for this run: alpha = lr, adjacency 2C / (qJ)
        assert node["sample_rate"] == 1.0  # B >= every shard: the whole shard each step (1,347 examples = 3 x 337 + 336)
        shard = node["expected_batch_size"]
        assert shard in (336, 337)
        expected = cpgt_epsilon(
            alpha=0.5, lipschitz=0.1, q=0.5, noise_x=0.01, noise_y=0.01, sensitivity=2 * 1.0 / shard,
            norm_factor=laplace_norm_factor(dimension, "l2"),
        )
        assert node["epsilon"] == pytest.approx(expected, rel=1e-9)
        assert node["noise_multiplier"] == 0.0
    # the nodes track each other: the models agree closely after 50 rounds of gradient tracking
    params = torch.stack([node["params"] for node in first])
    assert (params - params.mean(0)).norm() / params.mean(0).norm() < 0.05

    for a, b in zip(first, resumed):
        assert b["ledger_steps"] == b["rounds"] == 50  # the counts continued
        assert b["bytes_sent"] == a["bytes_sent"]
        assert torch.equal(a["params"], b["params"])  # x, u, replicas, noise and sampling streams restored
        assert b["epsilon"] == a["epsilon"]


def test_the_digits_quick_starts_default_cpgt_path_says_before_training_why_epsilon_3_cannot_train():
    """examples/digits.py --strategy cpgt --epsilon 3 used to raise TypeError (noise_decay, lipschitz required). Now:
    the example's stated L, noise_decay='auto' (q = 0.760 for alpha 0.5, L 0.25), full batches, and an error before
    training that the tracker noise leaves no fixed point (offset 27.7 C; epsilon >= ~83 needed)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "examples" / "digits.py"), "--strategy", "cpgt", "--epsilon", "3",
               "--epochs", "3", "--json"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "PrivacyConfigError" in run.stderr
    assert "q = 0.7595" in run.stderr and "L = 0.25" not in run.stdout
    assert "there is no fixed point" in run.stderr and "raise target_epsilon to about 83.2" in run.stderr
    assert "Epoch 0" not in run.stderr  # refused before the first step
