"""Dyn-D2P trained for real on 4 CPU processes (gloo) on scikit-learn's digits; checkpoint resume."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from lightning_privdec.privacy.accounting.schedule import calibrate_schedule
from tests.multiprocess import fit_digits_in_one_launch

pytestmark = [pytest.mark.multiprocess, pytest.mark.filterwarnings("ignore:Optimal order is the")]

KWARGS = {"rho_c": 2.0, "rho_mu": 2.0}
COMMON = ["--strategy", "dyn_d2p", "--epsilon", "3", "--clip", "1", "--lr", "0.5", "--noise-seed", "5",
          "--strategy-kwargs", json.dumps(KWARGS)]


def test_dyn_d2p_trains_digits_reports_its_accountants_epsilon_and_resumes_its_schedule(tmp_path):
    first, resumed = fit_digits_in_one_launch(
        (tmp_path / "first", [*COMMON, "--max-epochs", "4", "--csv", "--ckpt-dir", str(tmp_path / "ckpt")]),
        # resumed from the end of epoch 2 (in the same processes, by a new Trainer and strategy)
        (tmp_path / "resumed", [*COMMON, "--max-epochs", "4", "--resume", str(tmp_path / "ckpt" / "epoch=1-*.ckpt")]))
    steps = 4 * 11  # 11 batches of 32 per epoch on every node
    for node in first:
        assert node["global_step"] == node["ledger_steps"] == steps
        assert node["test_acc"] > 0.5  # chance is 0.1
        # the epsilon the run reports is the rigorous accountant's for the schedule it planned (K = 44, q = 32/J)
        schedule = calibrate_schedule(3.0, 1e-5, steps, node["sample_rate"], 1.0, **KWARGS)
        assert node["epsilon"] == pytest.approx(schedule.rigorous_epsilon(1e-5), rel=1e-9)
        assert 0.99 * 3.0 <= node["epsilon"] <= 3.0
    assert first[0]["sample_rate"] == pytest.approx(32 / 337)
    with (tmp_path / "first" / "csv" / "version_0" / "metrics.csv").open() as handle:
        logged = [row for row in csv.DictReader(handle) if row.get("privacy/epsilon_paper_clt_max")]
    assert logged, "the paper's CLT epsilon never reached the logger"
    last = logged[-1]
    assert float(last["privacy/epsilon_max"]) == pytest.approx(max(n["epsilon"] for n in first), rel=1e-6)
    clt = schedule.clt_epsilon(1e-5)  # measured: 2.64, below the rigorous 3.0
    assert float(last["privacy/epsilon_paper_clt_max"]) == pytest.approx(clt, rel=1e-3)
    assert float(last["privacy/max_grad_norm"]) == pytest.approx(schedule.clip(steps), rel=1e-6)
    assert float(last["privacy/noise_std"]) == pytest.approx(schedule.sigma(steps), rel=1e-6)

    # resuming from the end of epoch 2 continues the ledger and the schedule at step 22: same noise, same model
    for a, b in zip(first, resumed):
        assert b["ledger_steps"] == a["ledger_steps"] == steps
        assert b["epsilon"] == pytest.approx(a["epsilon"], rel=1e-12)
        assert torch.equal(a["params"], b["params"])
