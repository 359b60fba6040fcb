"""Tests for ``privdec-account secldp`` (Decor's SecLDP accountant on the command line)."""

from __future__ import annotations

import json

import pytest

from lightning_privdec.cli.account import SUBCOMMANDS, main
from lightning_privdec.privacy.accounting.secldp_step import secldp_step
from lightning_privdec.privacy.accounting.secldp import secldp_epsilon, secldp_epsilon_example_level
from lightning_privdec.topology import build_topology

KEYS = {
    "epsilon_step", "epsilon", "topology", "nodes", "sigma_cdp", "sigma_cor", "clip", "adversary", "level", "steps",
    "delta", "sample_rate",
}
BASE = ["secldp", "--topology", "ring", "--nodes", "16", "--sigma-cdp", "90", "--sigma-cor", "700", "--clip", "1"]

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the")


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main([*args, "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    return json.loads(out)


def fail(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    return err


def test_registered() -> None:
    assert "secldp" in SUBCOMMANDS and "dpsgd" in SUBCOMMANDS


def test_epsilon_step_only(capsys: pytest.CaptureFixture[str]) -> None:
    record = run_json(capsys, *BASE)
    assert set(record) == KEYS
    graph = build_topology("ring", 16).graph(0)
    assert record["epsilon_step"] == pytest.approx(secldp_step(graph, 90.0, 700.0, 1.0), rel=1e-12)
    assert record["epsilon"] is None and record["steps"] is None and record["delta"] is None
    assert record["sample_rate"] is None and record["level"] == "user"
    assert record["topology"] == "ring" and record["nodes"] == 16 and record["adversary"] == "eavesdropper"
    assert record["sigma_cdp"] == 90.0 and record["sigma_cor"] == 700.0 and record["clip"] == 1.0


@pytest.mark.parametrize("adversary, expected", [("curious", "curious"), ("3", 3), ("eavesdropper", "eavesdropper")])
def test_user_level_epsilon(capsys: pytest.CaptureFixture[str], adversary: str, expected: str | int) -> None:
    record = run_json(capsys, *BASE, "--adversary", adversary, "--steps", "1000", "--delta", "1e-5")
    graph = build_topology("ring", 16).graph(0)
    step = secldp_step(graph, 90.0, 700.0, 1.0, expected)
    assert record["adversary"] == expected
    assert record["epsilon_step"] == pytest.approx(step, rel=1e-12)
    assert record["epsilon"] == pytest.approx(secldp_epsilon(step, 1000, 1e-5), rel=1e-12)
    assert record["steps"] == 1000 and record["delta"] == 1e-5


def test_example_level_epsilon(capsys: pytest.CaptureFixture[str]) -> None:
    record = run_json(
        capsys, "secldp", "--topology", "torus", "--nodes", "16", "--sigma-cdp", "0.7", "--sigma-cor", "5",
        "--clip", "1", "--steps", "1000", "--delta", "1e-5", "--sample-rate", "0.02",
    )
    graph = build_topology("torus", 16).graph(0)
    step = secldp_step(graph, 0.7, 5.0, 1.0, level="example")
    assert record["level"] == "example" and record["sample_rate"] == 0.02
    assert record["epsilon_step"] == pytest.approx(step, rel=1e-12)
    assert record["epsilon"] == pytest.approx(secldp_epsilon_example_level(step, 1000, 1e-5, 0.02), rel=1e-12)


def test_complete_and_erdos_renyi(capsys: pytest.CaptureFixture[str]) -> None:
    complete = run_json(capsys, "secldp", "--topology", "complete", "--nodes", "8", "--sigma-cdp", "1",
                        "--sigma-cor", "1000", "--clip", "1")
    assert complete["epsilon_step"] == pytest.approx(2 / 8, rel=1e-4)  # CDP level
    er = run_json(capsys, "secldp", "--topology", "erdos_renyi", "--nodes", "20", "--seed", "4", "--sigma-cdp", "1",
                  "--sigma-cor", "2", "--clip", "1")
    graph = build_topology("erdos-renyi", 20, seed=4).graph(0)
    assert er["epsilon_step"] == pytest.approx(secldp_step(graph, 1.0, 2.0, 1.0), rel=1e-12)


def test_readable_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--adversary", "curious", "--steps", "100", "--delta", "1e-5"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("epsilon_step = ") and "honest-but-curious" in out and "epsilon = " in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--topology", "directed-ring"], "Decor needs an undirected graph"),
        (["--topology", "exponential"], "Decor needs an undirected graph"),
        (["--topology", "moebius"], "unknown topology"),
        (["--topology", "torus", "--nodes", "13"], "factorisation"),
        (["--adversary", "16"], "at most n - 1"),
        (["--steps", "100"], "both --steps and --delta"),
        (["--delta", "1e-5"], "both --steps and --delta"),
        (["--sample-rate", "0.1"], "needs --steps and --delta"),
    ],
)
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    argv = list(BASE)
    for flag, value in zip(args[::2], args[1::2]):
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    err = fail(capsys, *argv)
    assert err.startswith("privdec-account secldp: error: ") and message in err


@pytest.mark.parametrize(
    "flag, value", [("--sigma-cdp", "-1"), ("--clip", "0"), ("--adversary", "spy"), ("--sample-rate", "2")]
)
def test_malformed_numbers_exit_2(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    argv = list(BASE)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value, "--steps", "10", "--delta", "1e-5"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_directed_graph_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # the console script itself is launched once, in tests/test_cli.py
    code = main([*BASE, "--topology", "directed-ring"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "undirected" in err
