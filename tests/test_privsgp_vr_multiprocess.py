"""PrivSGP-VR trained for real on 4 CPU processes (gloo) on scikit-learn's digits, then resumed from a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from opacus.accountants import RDPAccountant

from tests.multiprocess import fit_digits_in_one_launch

pytestmark = pytest.mark.multiprocess


def floating_tensors(obj):  # noqa: ANN001, ANN201
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from floating_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from floating_tensors(value)


def test_privsgp_vr_trains_digits_reports_its_accountants_epsilon_and_resumes_without_a_table(tmp_path):
    common = ["--strategy", "privsgp_vr", "--epsilon", "3", "--lr", "0.5", "--noise-seed", "5"]
    first, resumed = fit_digits_in_one_launch(
        (tmp_path / "first", [*common, "--max-epochs", "2", "--ckpt-dir", str(tmp_path / "ckpt")]),
        (tmp_path / "resumed", [*common, "--max-epochs", "2", "--resume", str(tmp_path / "ckpt" / "epoch=0-*.ckpt")]))
    steps = 2 * 11
    for node in first:
        assert node["test_acc"] > 0.5  # chance is 0.1
        assert node["global_step"] == node["ledger_steps"] == steps
        # the reported epsilon is Opacus's RDP composition of the two mechanisms of every step
        m, q, rho = node["noise_multiplier"], node["sample_rate"], node["noise_split"]
        assert q == pytest.approx(32 / 337) and 0 < rho < 1
        hand = RDPAccountant()
        hand.history = [(m * math.sqrt(rho) / 2, q, steps), (m * math.sqrt(1 - rho) / q, 1.0, steps)]
        assert node["epsilon"] == pytest.approx(hand.get_epsilon(1e-5), rel=1e-9)
        assert 0.99 * 3.0 <= node["epsilon"] <= 3.0

    # the checkpoint holds every node's state but no gradient table (337 x 4,810 floats per node)
    checkpoint = next((tmp_path / "ckpt").glob("epoch=0-*.ckpt"))
    saved = torch.load(checkpoint, weights_only=False)
    dimension = first[0]["params"].numel()
    assert max(t.numel() for t in floating_tensors(saved)) <= dimension
    assert all("table" not in node["privacy"] for node in saved["lightning_privdec"]["nodes"])

    for a, b in zip(first, resumed):
        assert b["global_step"] == b["ledger_steps"] == steps  # the ledger continued from step 11
        assert b["epsilon"] == pytest.approx(a["epsilon"], rel=1e-9)  # same plan: same noise and split
        assert b["noise_split"] == a["noise_split"]
        assert b["test_acc"] > 0.5
    # the table is rebuilt at the resumed parameters (not restored), so the trajectory departs from the first run's
    assert any(not torch.equal(a["params"], b["params"]) for a, b in zip(first, resumed))


def test_the_digits_quick_starts_defaults_train_privsgp_vr_above_80_percent_at_epsilon_3():
    """examples/digits.py --strategy privsgp_vr --epsilon 3: batch 0.76 J (256), 20 epochs, lr 1.0, the sound
    accountant's joint analysis. Measured worst node 0.835-0.866 over three seeds; the former defaults (B = 32, 30
    epochs, lr 0.5) gave 0.49-0.53."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from lightning_privdec.privacy.accounting.saga_calibration import calibrate_saga_noise

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, str(root / "examples" / "digits.py"), "--strategy", "privsgp_vr", "--epsilon", "3",
               "--json"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["steps"] == 40 and result["noise_split"] is None  # q = 256 / 337: the joint analysis is tighter
    noise = calibrate_saga_noise(3.0, 1e-5, 256 / 337, 40)
    assert result["noise_multiplier"] == pytest.approx(noise.noise_multiplier, rel=1e-9)
    assert all(eps <= 3.0 for eps in result["epsilon_per_node"])
    assert min(result["test_acc_per_node"]) >= 0.8
