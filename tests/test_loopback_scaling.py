"""benchmarks/loopback_scaling.py: a private strategy on simulated nodes sends the bytes its message format implies,
trains, and the prediction formulas give the ring's and gossip's known costs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import loopback_scaling as scaling  # noqa: E402


def _args(**kwargs):
    defaults = dict(steps=8, sample_rate=0.25, alpha=1.0, lr=0.1, seed=0)
    return argparse.Namespace(**{**defaults, **kwargs})


def test_privsgp_on_simulated_nodes_sends_one_model_per_step_and_learns():
    row = scaling.run("privsgp", 6, _args())
    d = 64 * 64 + 64 + 64 * 10 + 10
    assert row["parameters"] == d
    assert row["bytes_per_node_step"] == 4 * d + 8  # float32 model + float64 push-sum weight, one peer per step
    assert row["examples_per_node"] == pytest.approx(1348 / 6)
    assert row["mean_node_accuracy"] > 0.2  # chance is 0.1
    assert 0 <= row["consensus_relative_mean"] < 0.5


def test_dp_csgp_randk_sends_a_tenth_of_the_model():
    row = scaling.run("dp_csgp", 4, _args(steps=3))
    d = row["parameters"]
    assert row["bytes_per_node_step"] == pytest.approx(4 * round(0.1 * d) + 8, rel=0.01)


def test_predicted_times_follow_the_formulas():
    d, mbit = 1_000_000, 1000.0
    ring = scaling.predicted_seconds("ring", 64, d, 0.0, mbit, alpha=0.0)
    assert ring == pytest.approx(2 * 63 / 64 * 4 * d * 8 / 1e9)
    assert scaling.predicted_seconds("ring", 64, d, 0.0, mbit, alpha=0.01) == pytest.approx(ring + 126 * 0.01)
    assert scaling.predicted_seconds("gossip", 1024, d, 4 * d, mbit, alpha=0.01) == pytest.approx(4 * d * 8 / 1e9 + 0.01)
