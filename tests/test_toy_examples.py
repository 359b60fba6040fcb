"""The papers' toy experiments run their algorithm files without Lightning, on the loopback network."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):  # noqa: ANN201
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("example", "arguments"),
    [("toy_dp_csgp", ["--compressor", "randk:0.5"]), ("toy_dp_csgp", ["--compressor", "none"]), ("toy_dyn_d2p", []),
     ("toy_decor", [])],
)
def test_a_toy_experiment_learns_within_its_budget(example: str, arguments: list[str], capsys) -> None:
    result = load(example).main(["--nodes", "3", "--steps", "60", "--epsilon", "3", *arguments])
    printed = capsys.readouterr().out
    assert result["worst_accuracy"] > 0.6  # ten classes: chance is 0.1
    assert 2.9 <= result["epsilon"] <= 3.0  # the accountant spent the budget it was calibrated to, never more
    assert printed.count("node ") == 3 and "consensus distance" in printed


@pytest.mark.parametrize("compressor", ["none", "qsgd:8"])
def test_cpgt_approaches_the_least_squares_solution_at_its_calibrated_pure_epsilon(compressor: str, capsys) -> None:
    from lightning_privdec.privacy.accounting.cpgt import cpgt_epsilon

    result = load("toy_cpgt").main(["--nodes", "3", "--steps", "60", "--epsilon", "3", "--compressor", compressor])
    printed = capsys.readouterr().out
    assert result["worst_error"] < result["error_start"] / 5  # every node, despite the Laplace noise
    assert result["delta"] == 0.0  # pure epsilon-DP
    # Theorem 2's sound bound at the example's alpha, q and calibrated scale, with the adjacency distance 2C/J
    expected = cpgt_epsilon(alpha=0.15, lipschitz=result["lipschitz"], q=0.8, noise_x=result["noise"],
                            noise_y=result["noise"], sensitivity=2 * 1.0 / result["rows"],
                            norm_factor=result["dimension"] ** 0.5)
    assert result["epsilon"] == pytest.approx(expected, rel=1e-12) and expected == pytest.approx(3.0, rel=1e-9)
    assert printed.count("node ") == 3 and "consensus distance" in printed


def test_the_privsgp_vr_toy_experiment_learns_and_spends_what_its_accountant_says(capsys) -> None:
    result = load("toy_privsgp_vr").main(["--nodes", "3", "--steps", "40", "--epsilon", "3"])
    printed = capsys.readouterr().out
    assert result["last_loss"] < 0.5 * result["first_loss"]  # every node's training loss at least halves
    assert result["worst_accuracy"] > 0.6  # ten classes: chance is 0.1
    assert 2.9 <= result["epsilon"] <= 3.0
    node = result["node_0"]  # the ledger's epsilon is the composition of the two mechanisms of each of its steps
    assert node["steps"] == 40 and node["split"] is not None
    assert node["epsilon"] == pytest.approx(node["epsilon_sound_formula"], rel=1e-12)
    assert printed.count("node ") == 3 and "consensus distance" in printed
