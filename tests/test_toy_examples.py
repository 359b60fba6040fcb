"""The papers' toy experiments run their algorithm files without Lightning, on the loopback network."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.scripts_as_modules import load_script

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):  # noqa: ANN201
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))  # the toys share examples/toy_digits.py, as when run as scripts
    return load_script(EXAMPLES / f"{name}.py")


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


def test_the_cpgt_toy_learns_and_its_agents_agree_within_the_pure_epsilon_budget(capsys) -> None:
    result = load("toy_cpgt").main(["--nodes", "3", "--steps", "60", "--epsilon", "20"])
    printed = capsys.readouterr().out
    assert result["worst_accuracy"] > 0.6  # ten classes: chance is 0.1
    assert result["epsilon"] == pytest.approx(20.0, rel=1e-9)  # the calibrated scales spend the budget
    assert result["consensus_distance"] < 0.01  # gradient tracking keeps the agents together
    assert printed.count("pure epsilon-DP (delta = 0)") == 3 and "after 60 steps" in printed


@pytest.mark.slow  # a whole toy experiment
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


@pytest.mark.slow  # a whole toy experiment
def test_the_decor_toy_spends_what_the_secldp_formula_gives_for_its_noise(capsys) -> None:
    """The epsilon the toy prints is Thm. 6's slope for its calibrated pair, amplified and composed over its rounds."""
    import networkx as nx

    from lightning_privdec.privacy.accounting.secldp import secldp_epsilon_example_level
    from lightning_privdec.privacy.accounting.secldp_step import secldp_step

    result = load("toy_decor").main(["--nodes", "4", "--steps", "20", "--epsilon", "2"])
    assert result["sigma_cor"] > 0 and result["steps"] == 20  # the correlated noise is used, every round counted
    slope = secldp_step(nx.cycle_graph(4), result["sigma_cdp"], result["sigma_cor"], 1.0, "eavesdropper",
                        level="example")
    expected = secldp_epsilon_example_level(slope, 20, 1e-5, result["sample_rate"])
    assert result["epsilon"] == pytest.approx(expected, rel=1e-9) and 1.9 < expected <= 2.0
    assert f"epsilon {expected:.3f} after 20 steps" in capsys.readouterr().out
