"""benchmarks/gpu_check.py's smoke run on CPU (``--accelerator cpu --quick``): every section runs and writes numbers
that are finite and consistent, so the script is ready for the next GPU."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.multiprocess import run_group

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import KINDS, MODELS  # noqa: E402


@pytest.mark.multiprocess
def test_the_quick_cpu_run_writes_every_section_with_plausible_numbers(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = run_group([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--accelerator", "cpu", "--quick",
                      "--json", str(out)], timeout=600, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["complete"] and result["device"].startswith("CPU: ") and result["accelerator"] == "cpu"
    sections = result["sections"]
    assert set(sections) == {"tests", "noise", "attacks", "throughput", "ranks", "profile", "memory"}
    assert not any("error" in sections[name] for name in ("noise", "attacks", "throughput", "ranks", "profile"))
    assert "## gpu_check.py" in done.stdout and result["device"] in done.stdout  # the table, with the device

    tests = sections["tests"]  # the device-fixture test passes on CPU; the CUDA-only one is counted as skipped
    assert tests["device"] == "cpu" and tests["exit_code"] == 0 and tests["error"] is None
    assert tests["failed"] == tests["errors"] == 0 and tests["passed"] >= 3
    assert tests["cuda_only"] == {"passed": 0, "failed": 0, "skipped": 1, "errors": 0}
    assert tests["collected"] == tests["passed"] + tests["skipped"]

    noise = sections["noise"]
    assert [r["coordinates"] for r in noise["rows"]] == [100_000, 1_000_000]
    for row in noise["rows"]:  # ChaCha20 on a CPU: nanoseconds per coordinate, not microseconds
        assert 0 < row["ns_per_coordinate"] < 5_000 and 0 < row["torch_randn_ns_per_coordinate"] < 5_000
        assert row["peak_memory_bytes"] is None and "target_met" not in row  # no GPU, no GPU target
    distribution = noise["distribution"]
    assert distribution["passed"] and distribution["equals_cpu_draws"] and distribution["device"] == "cpu"
    assert abs(distribution["std"] - 1) < 0.01 and set(distribution["tails"]) == {"2", "3", "4"}

    attacks = sections["attacks"]  # the quick run's two attacks, every mode and precision each applies to
    assert {r["attack"] for r in attacks["rows"]} == {"gram_linear", "gram_conv_per_example"}
    assert attacks["over"] == [] and attacks["not_run"] == [] and attacks["attack_seconds"] > 0
    assert len(attacks["rows"]) >= 8 and all(r["holds"] and r["ratio"] <= 1 + 1e-5 for r in attacks["rows"])
    assert "Clipping attacks on cpu:" in done.stdout

    rows = {(r["model"], r["precision"], r["kind"]): r for r in sections["throughput"]["rows"]}
    expected = {(m, p, k) for m, spec in MODELS.items() for p in spec["quick_precisions"] for k in KINDS}
    assert set(rows) == expected
    for (model, precision, kind), row in rows.items():
        if kind == "opacus-ghost" and model != "efficientnet_b0":
            assert row["error"]  # Opacus refuses torchvision's in-place residual add and GPT-2's tied weights
            continue
        assert "error" not in row, row
        assert row["steps"] == 1 and row["parameters"] > 10_000 and row["peak_memory_bytes"] is None
        assert math.isfinite(row["samples_per_second"]) and row["samples_per_second"] > 0
        assert row["step_ms"] * row["samples_per_second"] == pytest.approx(1000 * row["batch"])
    assert sections["throughput"]["targets"] == []  # the targets are the GPU's

    ranks = sections["ranks"]
    assert ranks["ranks"] == 2 and [r["strategy"] for r in ranks["rows"]] == ["dp_csgp"]
    (run,) = ranks["rows"]
    assert run["nodes"] == 2 and run["steps"] == 1 and run["parameters_finite_per_node"] == [True, True]
    assert all(0 < eps <= 3.0 for eps in run["epsilon_per_node"]) and len(run["epsilon_per_node"]) == 2
    assert run["bytes_sent_node0"] > 0 and run["peak_gpu_memory_bytes_per_node"] is None

    profiled = sections["profile"]["rows"]
    assert [r["model"] for r in profiled] == ["resnet18", "gpt2"] and not any("error" in r for r in profiled)
    for r in profiled:  # on the CPU: no kernels, the host's operators
        assert r["wall_ms"] > 0 and r["device_activities"] == 0 and r["device_busy_ms"] is None
        assert r["aten_calls"] > 100 and r["host_syncs"] >= 1  # the step's finite check reads one value
        assert r["top_host_ops"] and all(o["calls"] >= 1 and o["self_host_ms"] >= 0 for o in r["top_host_ops"])

    memory = sections["memory"]["rows"]
    assert len(memory) == len(rows) + len(noise["rows"]) + 1
    assert all(r["peak_memory_bytes"] is None for r in memory)  # measured on CUDA only


def test_pytest_outcomes_are_read_from_the_junit_report_and_from_a_run_cut_short(tmp_path: Path) -> None:
    from gpu_check import count_outcomes, junit_outcomes, verbose_outcomes

    report = tmp_path / "junit.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_noise" name="test_a[cpu]"/>'
        '<testcase classname="tests.test_noise" name="test_b"><failure message="assert 1 == 2&#10;more"/></testcase>'
        '<testcase classname="tests.test_overlap" name="test_c[cuda]"><skipped message="needs a CUDA device"/></testcase>'
        '<testcase classname="tests.test_overlap" name="test_d"><error message="fixture failed"/></testcase>'
        "</testsuite></testsuites>"
    )
    outcomes = junit_outcomes(report)
    assert [(t["id"], t["outcome"]) for t in outcomes] == [
        ("tests/test_noise.py::test_a[cpu]", "passed"), ("tests/test_noise.py::test_b", "failed"),
        ("tests/test_overlap.py::test_c[cuda]", "skipped"), ("tests/test_overlap.py::test_d", "error"),
    ]  # fmt: skip
    assert outcomes[1]["message"] == "assert 1 == 2"
    assert count_outcomes(outcomes) == {"passed": 1, "failed": 1, "skipped": 1, "errors": 1}
    printed = (
        "tests/test_noise.py::test_a[cpu] PASSED [ 33%]\n"
        "tests/test_noise.py::test_b FAILED [ 66%]\n"
        "tests/test_overlap.py::test_c[cuda] SKIPPED (needs a CUDA device) [100%]\n"
        "FAILED tests/test_noise.py::test_b - assert 1 == 2\n"
        "tests/test_overlap.py::test_d "  # cut here: not counted
    )
    assert [(t["id"], t["outcome"]) for t in verbose_outcomes(printed)] == [
        (t["id"], t["outcome"]) for t in outcomes[:3]
    ]


def test_the_ranks_section_launches_strategies_side_by_side_on_distinct_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several strategies' gloo worlds start at once (on a GPU machine a launch is mostly imports and CUDA's start),
    each on its own port, their ranks sharing the cores' intra-op threads, and the rows keep the strategies' order."""
    import argparse
    import os
    import threading
    import time

    import gpu_check

    running, most, ports, lock = [0], [0], [], threading.Lock()

    def launch(args, strategy, steps, batch, images, timeout, port, threads):  # noqa: ANN001, ANN202, PLR0913
        assert threads == max(1, (os.cpu_count() or 1) // (4 * gpu_check.CONCURRENT_LAUNCHES))
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            ports.append(port)
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return {"strategy": strategy, "epsilon_per_node": [1.0], "parameters_finite_per_node": [True], "wall_s": 0.3}

    monkeypatch.setattr(gpu_check, "launch_example", launch)
    strategies = ["dp_csgp", "privsgp", "dp2sgd", "decor", "dyn_d2p", "privsgp_vr", "cpgt"]
    args = argparse.Namespace(strategies=",".join(strategies), quick=False, ranks=4, concurrent_launches=None)
    result = gpu_check.run_ranks(args, time.time() + 60)
    assert [row["strategy"] for row in result["rows"]] == strategies
    assert most[0] == gpu_check.CONCURRENT_LAUNCHES == result["concurrent_launches"]
    assert len(set(ports)) == len(strategies)


def test_throughput_rows_and_the_library_tree_are_chosen_on_the_command_line(tmp_path: Path) -> None:
    """--models, --kinds and --precisions pick the throughput rows (all by default); --library must hold the
    package, and an unknown name is refused with the choices."""
    from gpu_check import PRECISIONS, parse_args

    args = parse_args([])
    assert (args.models, args.kinds, args.precisions, args.library) == (tuple(MODELS), KINDS, PRECISIONS, None)
    args = parse_args(["--models", "gpt2,resnet18", "--kinds", "ghost", "--precisions", "fp32",
                       "--library", str(ROOT)])  # fmt: skip
    chosen = (args.models, args.kinds, args.precisions, args.library)
    assert chosen == (("gpt2", "resnet18"), ("ghost",), ("fp32",), ROOT)
    for bad in (["--models", "gpt3"], ["--kinds", "dp"], ["--library", str(tmp_path)],
                ["--quick", "--models", "resnet18", "--precisions", "bf16-mixed"]):  # no row left
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_the_chosen_rows_and_tree_reach_the_section_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The throughput and profile children get the row choices and --library; the noise child runs this checkout."""
    import gpu_check

    commands = {}

    def record(command: list[str], timeout: float) -> dict:
        commands[command[command.index("--child") + 1]] = command
        return {"output": "", "error": None, "tail": ""}

    monkeypatch.setattr(gpu_check, "run_bounded", record)
    args = gpu_check.parse_args(["--models", "gpt2", "--kinds", "ghost", "--library", str(ROOT)])
    for section in ("throughput", "profile", "noise"):
        gpu_check.run_child_section(args, section, 60.0)
    for section, command in commands.items():
        assert command[command.index("--models") + 1] == "gpt2" and command[command.index("--kinds") + 1] == "ghost"
        if section == "noise":
            assert "--library" not in command
        else:
            assert command[command.index("--library") + 1] == str(ROOT)


def test_attacks_past_the_deadline_are_named_not_lost() -> None:
    """The attacks section runs one attack after the other until its deadline: those it did not reach are named, the
    rows of those it ran kept."""
    import argparse
    import time

    import gpu_check

    args = argparse.Namespace(accelerator="cpu", quick=True, deadline=time.time() - 1)
    cut = gpu_check.attacks_child(args)
    assert cut["rows"] == [] and cut["not_run"] == list(gpu_check.QUICK_ATTACKS) and cut["largest"] is None
    result = {"date": "-", "device": "CPU", "command": "-", "total_s": 0.0, "machine": "-", "software": "-",
              "sections": {"attacks": cut}}  # fmt: skip
    assert "none run (time limit): gram_linear, gram_conv_per_example" in gpu_check.format_table(result)
