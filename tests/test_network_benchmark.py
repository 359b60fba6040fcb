"""benchmarks/network.py: 3 nodes in their own network namespaces at a low rate; the bytes it measures and the rate
limit in force (a step cannot be shorter than its bytes through the node's link)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multiprocess import run_group

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "network.py"


def _namespaces_unavailable() -> str | None:
    """Why this machine cannot build the emulated network, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip`, `tc`)"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "`ip netns` does not work here"
    return None


@pytest.mark.multiprocess
@pytest.mark.skipif(_namespaces_unavailable() is not None, reason=str(_namespaces_unavailable()))
def test_three_nodes_at_a_low_rate_measure_the_bytes_and_respect_the_limit(tmp_path: Path) -> None:
    mbit, nodes, out = 8.0, 3, tmp_path / "rows.json"
    command = [sys.executable, str(SCRIPT), "--nodes", str(nodes), "--mbit", str(mbit), "--model", "wide",
               "--width", "256", "--steps", "3", "--warmup", "1", "--configs", "ddp,push_sum", "--prefix", "pdt",
               "--timeout", "420", "--json", str(out)]  # fmt: skip
    result = run_group(command, timeout=480)  # the nodes and the namespaces' processes die with pytest
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["config"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ddp", "push_sum"}
    d = rows["push_sum"]["num_params"]

    # push-sum on exponential-one-peer: one message per step, the float32 model plus the float64 push-sum weight
    push = rows["push_sum"]
    assert push["payload_bytes_per_node_step"] == 4 * d + 8
    # on the wire: the payload plus TCP/IP headers and Lightning's small per-step collectives
    payload = push["payload_bytes_per_node_step"]
    assert payload < push["bytes_per_node_step"] < 1.15 * payload
    # DDP's ring all-reduce sends 2 (n - 1) / n of the float32 gradients per node and step
    ring = 2 * (nodes - 1) / nodes * 4 * d
    assert ring < rows["ddp"]["bytes_per_node_step"] < 1.3 * ring

    for row in rows.values():
        assert row["nodes"] == nodes and row["mbit"] == mbit
        assert row["limit_seconds"] == pytest.approx(row["bytes_per_node_step"] * 8 / (mbit * 1e6))
        # the rate limit is in force: no step is shorter than its bytes through the link (5% for the median of
        # three steps against their mean bytes)
        assert row["step_seconds"] >= 0.95 * row["limit_seconds"], row
        assert row["compute_seconds"] >= 0 and row["exchange_seconds"] >= 0


def test_without_root_it_says_so_instead_of_a_traceback() -> None:
    """The privilege check runs first and ends with one line naming what is missing."""
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); os.geteuid = lambda: 1000; sys.argv[1:] = ['--nodes', '3']; "
        "import network; network.main()"
    )
    result = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS)], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "needs root" in result.stderr and "Traceback" not in result.stderr
