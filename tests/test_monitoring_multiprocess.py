"""Monitoring callbacks, W&B logging, network-average evaluation and non-IID data in real 4-process runs."""

import csv
from pathlib import Path

import pytest
import torch

from tests.multiprocess import fit_digits_in_one_launch
from tests.wandb_records import history_rows

SCRIPT = Path(__file__).parent / "scripts" / "fit_monitored.py"
NODES = 4
pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[dict]]]:
    """One launch of 4 processes: a private run logging to W&B (offline) on Dirichlet shards, then in the same
    processes an uncompressed push-sum run logging to CSV; each run's directory and per-rank results."""
    root = tmp_path_factory.mktemp("monitored")
    fits = {
        "private_wandb": ["--strategy", "dp_csgp", "--epsilon", "3", "--logger", "wandb", "--alpha", "0.5"],
        "push_sum_csv": ["--strategy", "push_sum", "--compressor", "none", "--gamma", "1", "--logger", "csv",
                         "--alpha", "0.3", "--max-epochs", "2"],
    }
    results = fit_digits_in_one_launch(*((root / name, args) for name, args in fits.items()), script=SCRIPT)
    return {name: (root / name, result) for name, result in zip(fits, results)}


@pytest.fixture(scope="module")
def private_wandb_run(runs) -> tuple[Path, list[dict]]:
    return runs["private_wandb"]


def test_wandb_offline_run_holds_epsilon_consensus_and_bytes(private_wandb_run):
    out, results = private_wandb_run
    run_files = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(run_files) == 1  # rank 0 logs for everyone
    rows = history_rows(run_files[0])
    keys = set().union(*rows)
    for i in range(NODES):
        assert {f"privacy/epsilon/node_{i}", f"consensus/distance_sq/node_{i}", f"consensus/relative/node_{i}",
                f"comm/bytes_sent/node_{i}", f"comm/bytes_sent_total/node_{i}"} <= keys
    assert {"privacy/epsilon_max", "consensus/relative_max", "comm/compression_ratio", "val/acc"} <= keys
    last = {}
    for row in rows:
        last.update(row)
    # the logged numbers are the strategy's own: epsilon from every node's accountant, bytes from its exchange
    epsilons = {r["rank"]: r["epsilon"] for r in results}
    for i in range(NODES):
        assert last[f"privacy/epsilon/node_{i}"] == pytest.approx(epsilons[i], rel=1e-6)
        assert 0 < last[f"comm/bytes_sent_total/node_{i}"] <= results[i]["bytes_sent"]
    assert 0 < last["privacy/epsilon_max"] <= 3.0
    assert last["comm/compression_ratio"] == pytest.approx(2.0, rel=0.02)  # RandK(0.5): half the values travel
    assert 0 < last["consensus/relative_max"] < 1.0


def test_network_average_evaluation_restores_each_nodes_model(private_wandb_run):
    _, results = private_wandb_run
    for r in results:
        assert r["validations"] >= 3 and r["restored_after_validation"]
        assert r["own_unchanged_by_test"] and r["own_differs_from_average"]
        # what was validated and tested is the network average, not the node's own model
        assert r["test_acc_logged"] == pytest.approx(r["average_model_acc"], abs=1e-6)
        assert r["val_acc_logged"] == pytest.approx(r["average_model_acc"], abs=1e-6)
    assert results[0]["average_model_acc_full"] > 0.3  # 10 classes: chance is 0.1


def test_dirichlet_shards_reach_the_private_loader(private_wandb_run):
    _, results = private_wandb_run
    sizes = [r["shard_size"] for r in results]
    assert sum(sizes) == 1348  # the whole training split, each example on exactly one node
    assert len(set(sizes)) > 1  # Dirichlet shares are unequal, unlike Lightning's IID shards
    assert all(r["sampler"] == "PoissonBatchSampler" for r in results)


def read_csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_consensus_and_bytes_callbacks_match_a_direct_computation(runs):
    out, results = runs["push_sum_csv"]
    for r in results:
        assert r["comm"]["comm/compression_ratio"] == 1.0  # uncompressed: exactly the dense model + push-sum weight
        # measured once more at the end of training: the totals include the last steps (2 epochs of 11 steps is not
        # a multiple of every_n_steps=5)
        assert r["comm"][f"comm/bytes_sent_total/node_{r['rank']}"] == r["bytes_sent"]
        assert sorted(r["consensus"]) == sorted(results[0]["consensus"])
        assert r["consensus"] == results[0]["consensus"]  # every node computed the same table
    steps = results[0]["global_step"]
    assert steps % 5  # the last steps fall after the last periodic measurement (every_n_steps=5)...
    rows = read_csv_rows(out / "csv" / "version_0" / "metrics.csv")
    logged = [row for row in rows if row.get("comm/bytes_sent_total")]
    assert int(logged[-1]["step"]) == steps  # ...and are logged at the end of training, in the totals
    assert float(logged[-1]["comm/bytes_sent_total"]) == sum(r["bytes_sent"] for r in results)
    histograms = torch.stack([torch.bincount(torch.tensor(r["train_labels"]), minlength=10) for r in results])
    assert histograms.sum() == 1348
    assert (histograms == 0).sum() > 0  # alpha = 0.3: some node misses some class
