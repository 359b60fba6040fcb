"""The Lightning glue, tested for real: 4 CPU processes over gloo (forked by Lightning's multiprocessing launcher:
tests/scripts/fit_digits.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.multiprocess import SCRIPT, fit_digits_in_one_launch, launch, relative_consensus_distance, stop_group

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def eight_epochs(tmp_path_factory) -> dict[str, list[dict]]:
    """Lightning's DDP, push-sum, QSGD-compressed push-sum and D-PSGD on a ring, 8 epochs each, one after the other in
    one launch of 4 processes: each fit's per-rank results."""
    root = tmp_path_factory.mktemp("eight_epochs")
    fits = {"ddp": ["--strategy", "ddp"], "push_sum": ["--strategy", "push_sum"], "qsgd": ["--compressor", "qsgd:8"],
            "dpsgd": ["--strategy", "dpsgd", "--topology", "ring"]}
    results = fit_digits_in_one_launch(*((root / name, [*args, "--max-epochs", "8"]) for name, args in fits.items()))
    return dict(zip(fits, results))


def test_push_sum_matches_lightning_ddp_accuracy_and_ends_in_consensus(eight_epochs):
    ddp, push_sum = eight_epochs["ddp"], eight_epochs["push_sum"]
    ddp_acc = ddp[0]["test_acc"]
    assert ddp_acc > 0.85  # the task is learnable in this budget
    for node in push_sum:
        assert node["test_acc"] >= ddp_acc - 0.03, (node["rank"], node["test_acc"], ddp_acc)
    assert relative_consensus_distance(push_sum) < 0.02
    for node in push_sum:  # Lightning's reduce / all_gather / broadcast / barrier keep working for metrics
        assert node["collectives"] == {"reduce_sum": 10.0, "all_gather": [0, 1, 2, 3], "broadcast": "from rank 0"}
    # gossip really happened, one message per round to one peer (one-peer exponential graph, 4 nodes)
    d = push_sum[0]["params"].numel()
    for node in push_sum:
        assert node["rounds"] == node["global_step"] > 0
        assert node["bytes_sent"] == node["rounds"] * (4 * d + 8)


def test_compressed_push_sum_and_dpsgd_train_to_consensus(eight_epochs):
    compressed, dpsgd = eight_epochs["qsgd"], eight_epochs["dpsgd"]
    for results in (compressed, dpsgd):
        assert min(node["test_acc"] for node in results) > 0.85
        assert relative_consensus_distance(results) < 0.02
    dense_bytes = 4 * compressed[0]["params"].numel() + 8
    assert compressed[0]["bytes_sent"] < 0.35 * compressed[0]["rounds"] * dense_bytes


def test_checkpoint_kill_resume_gives_the_same_parameters_as_an_uninterrupted_run(tmp_path):
    common = ["--compressor", "randk:0.5", "--gamma", "0.5", "--momentum", "0.9", "--lr", "0.05", "--max-epochs", "4"]
    command = [sys.executable, str(SCRIPT), "--devices", "4", *common]
    # 1. train, checkpoint every epoch, and kill every process for real after epoch 2's checkpoint
    crashed = launch(
        [*command, "--out", str(tmp_path / "crashed"), "--ckpt-dir", str(tmp_path / "ckpt"), "--stall-at-epoch", "2"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 240
    while not (tmp_path / "crashed" / "stalled").exists():
        assert crashed.poll() is None, "the run died before reaching its checkpoint"
        assert time.monotonic() < deadline, "the run never reached its checkpoint"
        time.sleep(0.5)
    stop_group(crashed, timeout=30)
    checkpoint = next((tmp_path / "ckpt").glob("epoch=1-*.ckpt"))
    # 2. resume from it in new processes; 3. an uninterrupted run (after it, in the same processes)
    resumed, straight = fit_digits_in_one_launch((tmp_path / "resumed", [*common, "--resume", str(checkpoint)]),
                                                 (tmp_path / "straight", common))
    for a, b in zip(resumed, straight):
        assert a["global_step"] == b["global_step"] == 44
        assert (a["params"] == b["params"]).all(), f"node {a['rank']} diverged after resume"
        assert a["bytes_sent"] == b["bytes_sent"]
