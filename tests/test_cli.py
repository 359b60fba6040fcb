"""Tests for the ``privdec-account`` command line (lightning_privdec.cli.account)."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from lightning_privdec.cli import account
from lightning_privdec.cli.account import SUBCOMMANDS, main
from lightning_privdec.privacy import epsilon_for

KEYS = {"epsilon", "noise_multiplier", "delta", "steps", "sample_rate", "accountant"}

pytestmark = [
    pytest.mark.filterwarnings("ignore:Optimal order is the"),
    pytest.mark.filterwarnings("ignore:GDP accounting is experimental"),
]


def run_as_script(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """The module run as ``python -m lightning_privdec.cli.account ARGS`` runs it (its ``__main__`` block), in this
    process: a fresh interpreter would only add the package's import, which every launched test already makes."""
    argv = sys.argv
    sys.argv = [account.__file__, *args]
    try:
        runpy.run_path(account.__file__, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """The same main() the console script calls, in this process (one run of the module's ``__main__`` block is enough
    to test it: test_epsilon_from_noise_multiplier_json)."""
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def test_console_script_is_declared() -> None:
    (script,) = [ep for ep in entry_points(group="console_scripts") if ep.name == "privdec-account"]
    assert script.value == "lightning_privdec.cli.account:main"
    assert "dpsgd" in SUBCOMMANDS


def test_epsilon_from_noise_multiplier_json(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_as_script(capsys, "dpsgd", "--noise-multiplier", "1.1", "--sample-rate", "0.01", "--steps", "1000",
                   "--delta", "1e-5", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert set(record) == KEYS
    assert record["epsilon"] == pytest.approx(epsilon_for(1.1, 0.01, 1000, 1e-5, "rdp"), rel=1e-12)
    assert record["noise_multiplier"] == 1.1 and record["delta"] == 1e-5
    assert record["steps"] == 1000 and record["sample_rate"] == 0.01 and record["accountant"] == "rdp"


def test_noise_multiplier_from_target_epsilon_json(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_main(capsys, "dpsgd", "--target-epsilon", "2.0", "--sample-rate", "0.02", "--steps", "300",
                            "--delta", "1e-5", "--accountant", "prv", "--json")
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert set(record) == KEYS and record["accountant"] == "prv"
    achieved = epsilon_for(record["noise_multiplier"], 0.02, 300, 1e-5, "prv")
    assert 0.99 * 2.0 <= achieved <= 2.0
    assert record["epsilon"] == pytest.approx(achieved, rel=1e-12)


def test_bad_input_exits_with_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_main(capsys, "dpsgd", "--noise-multiplier", "1.0", "--sample-rate", "1.5", "--steps", "100",
                            "--delta", "1e-5")
    assert done.returncode == 2 and done.stdout == ""
    assert "--sample-rate: must lie in (0, 1], got 1.5" in done.stderr


def test_unreachable_target_exits_with_code_2(capsys: pytest.CaptureFixture[str]) -> None:
    done = run_main(capsys, "dpsgd", "--target-epsilon", "0.001", "--sample-rate", "0.01", "--steps", "1000",
                            "--delta", "1e-5", "--json")
    assert done.returncode == 2 and done.stdout == ""
    assert "cannot reach target_epsilon=0.001" in done.stderr


# ---- in-process: the same main() the console script calls ----------------------------------------------------
def test_readable_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dpsgd", "--noise-multiplier", "0.5", "--sample-rate", "0.001", "--steps", "10",
                 "--delta", "1e-5", "--accountant", "gdp"]) == 0
    out, err = capsys.readouterr()
    sound, approximation = out.strip().splitlines()
    assert sound.startswith("epsilon = ") and "(rdp accountant" in sound  # the sound value leads
    assert approximation.startswith("GDP approximation (central limit theorem, NOT a bound")
    assert float(approximation.rsplit("~", 1)[1]) == pytest.approx(0.069, abs=2e-3)
    assert float(sound.split()[2]) > 1.0  # GDP's 0.069 would under-state it more than tenfold
    assert main(["dpsgd", "--target-epsilon", "2", "--sample-rate", "0.001", "--steps", "10", "--delta", "1e-5",
                 "--accountant", "gdp", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["accountant"] == "rdp" and record["epsilon"] <= 2.0  # calibrated by the sound accountant
    assert record["epsilon_gdp_approximation"] < record["epsilon"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dpsgd", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"],
         "one of the arguments --noise-multiplier --target-epsilon is required"),
        (["dpsgd", "--noise-multiplier", "1", "--target-epsilon", "1", "--sample-rate", "0.01", "--steps", "10",
          "--delta", "1e-5"], "not allowed with argument"),
        (["dpsgd", "--noise-multiplier", "-1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"],
         "must be >= 0"),
        (["dpsgd", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "0", "--delta", "1e-5"],
         "must be a positive integer"),
        (["dpsgd", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1"],
         "must lie strictly between 0 and 1"),
        (["dpsgd", "--noise-multiplier", "x", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"],
         "expected a number"),
        (["dpsgd", "--noise-multiplier", "1", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5",
          "--accountant", "moments"], "invalid choice: 'moments'"),
        (["dpsgd", "--target-epsilon", "1e9", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5"],
         "cannot calibrate"),
        ([], "required"),
    ],
)
def test_bad_input_messages(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err
