"""Faults and agreement across real processes (gloo): a node killed or hung mid-training stops every other node with
a clear error within the strategy's peer_timeout; nodes started with different configurations all stop at setup; the
same seed gives every node the same trajectory. A killed or hung node and different configurations per node are
launched as a user's script is (Lightning's subprocess launcher, tests/scripts/fit_reliability.py); the rest forks
its ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.multiprocess import launch, stop_group

pytestmark = pytest.mark.multiprocess

SCRIPT = Path(__file__).parent / "scripts" / "fit_reliability.py"


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has exited
    except (FileNotFoundError, ProcessLookupError):
        return False


class Run:
    """``fit_reliability.py`` on ``devices`` processes in a session of its own; times when each rank's process ended."""

    def __init__(self, out: Path, *args: str, devices: int, start_method: str = "fork") -> None:
        self.out, self.devices = out, devices
        out.mkdir(parents=True)
        self.log = out / "log.txt"
        command = [sys.executable, str(SCRIPT), "--devices", str(devices), "--start-method", start_method,
                   "--out", str(out), *args]
        with open(self.log, "w") as log:
            self.process = launch(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_for_exits(self, ranks: list[int], timeout: float) -> dict[int, float]:
        """Poll until the processes of ``ranks`` have ended; return when each was first seen gone."""
        deadline, ended = time.time() + timeout, {}
        while len(ended) < len(ranks) and time.time() < deadline:
            self.process.poll()
            for rank in ranks:
                pid_file = self.out / f"pid{rank}"
                if rank not in ended and pid_file.exists() and not alive(int(pid_file.read_text())):
                    ended[rank] = time.time()
            time.sleep(0.1)
        return ended

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def text_of(self, out: Path) -> str:
        """What was printed while the configuration writing to ``out`` ran (a launch of several, ``--then``)."""
        (part,) = [p for p in self.text().split("== fit ")[1:] if p.startswith(f"{out}\n")]
        return part

    def stop(self) -> None:
        stop_group(self.process, timeout=30)  # the session: a stopped node, and anything left over


def fault_time(run: Run, timeout: float = 240) -> float:
    marker = run.out / "fault"
    deadline = time.time() + timeout
    while not marker.exists() or not marker.read_text():
        assert run.process.poll() is None, f"the run ended before its fault:\n{run.text()[-3000:]}"
        assert time.time() < deadline, "the run never reached its fault"
        time.sleep(0.1)
    return float(marker.read_text())


@contextmanager
def survivors_of(
    tmp_path: Path, fault: str, peer_timeout: float, slack: float
) -> Iterator[tuple[Run, float, dict, str]]:
    """Three nodes; node 1 meets ``fault`` ("--kill" or "--hang") at step 5. Yields the run, the time of the fault,
    the exit times of nodes 0 and 2 (both must exit within peer_timeout + slack) and the log."""
    run = Run(tmp_path / "run", fault, "1", "5", "--peer-timeout", str(peer_timeout), "--max-steps", "1000",
              devices=3, start_method="popen")
    try:
        at = fault_time(run)
        ended = run.wait_for_exits([0, 2], timeout=peer_timeout + slack)
        log = run.text()
        assert sorted(ended) == [0, 2], f"survivors running {peer_timeout + slack} s after the fault:\n{log[-3000:]}"
        yield run, at, ended, log
    finally:
        run.stop()


def test_a_killed_node_stops_every_other_node_with_a_clear_error(tmp_path):
    peer_timeout, slack = 20.0, 40.0  # slack: raising, Lightning's teardown and exit on 2 loaded cores
    with survivors_of(tmp_path, "--kill", peer_timeout, slack) as (run, killed, ended, log):
        assert run.process.wait(timeout=30) != 0  # rank 0, the launching process, failed
        for rank in (0, 2):
            assert f"PeerFailureError: node {rank} lost contact with its gossip neighbours" in log, rank
        assert "restart all nodes and resume from the last checkpoint" in log
        # the dead process's sockets closed: detected at once, without waiting for the timeout
        assert "Connection closed by peer" in log or "Connection reset by peer" in log
        assert not list(run.out.glob("rank*_run0.pt"))  # nobody finished as if nothing had happened
        print({rank: round(t - killed, 1) for rank, t in ended.items()})  # seconds from the kill to each exit


def test_a_hung_node_stops_every_other_node_after_the_peer_timeout(tmp_path):
    # SIGSTOP: the node is alive and its connections stay open, so only the timeout can end the others' waits
    peer_timeout, slack = 10.0, 50.0
    with survivors_of(tmp_path, "--hang", peer_timeout, slack) as (run, hung, ended, log):
        assert min(ended.values()) - hung >= 0.9 * peer_timeout  # the timeout, not anything sooner, ended the wait
        for rank in (0, 2):
            assert f"PeerFailureError: node {rank} lost contact with its gossip neighbours" in log, rank
        assert run.process.wait(timeout=30) != 0
        assert "Timed out waiting" in log or "Application timeout" in log  # gloo's words for the timeout
        print({rank: round(t - hung, 1) for rank, t in ended.items()})


@pytest.fixture(scope="module")
def two_runs_then_a_mismatch(tmp_path_factory):
    """Two trainings from scratch (seed, strategy, model, Trainer) of DP-CSGP with RandK and a fixed noise seed on 2
    nodes, then a third whose node 1 is given another max_grad_norm (and another noise seed, which may differ)."""
    kwargs = {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "noise_seed": 7, "compressor": "randk:0.5"}
    mismatch = {"1": {"max_grad_norm": 2.0, "noise_seed": 8}}
    run = Run(tmp_path_factory.mktemp("runs") / "run", "--strategy", "dp_csgp", "--strategy-kwargs", json.dumps(kwargs),
              "--runs", "2", "--max-steps", "20", "--mismatch", json.dumps(mismatch), devices=2, start_method="popen")
    try:
        assert run.process.wait(timeout=300) == 0, run.text()[-3000:]
        assert len(run.wait_for_exits([0, 1], timeout=30)) == 2
        yield run
    finally:
        run.stop()


def test_the_same_seed_gives_every_node_the_same_trajectory(two_runs_then_a_mismatch):
    """Poisson sampling, noise, RandK and gossip repeat bit for bit on every node with a fixed noise_seed (the default,
    noise_seed=None, draws from OS entropy: test_privacy.py::test_node_noise_generators_are_per_node)."""
    out = two_runs_then_a_mismatch.out
    first, second = ([torch.load(out / f"rank{r}_run{i}.pt") for r in range(2)] for i in range(2))
    for a, b in zip(first, second):
        assert a["global_step"] == b["global_step"] == 20
        assert torch.equal(a["params"], b["params"]), f"node {a['rank']} took another trajectory"
    assert not torch.equal(first[0]["params"], first[1]["params"])  # each node's own noise and batches


def test_nodes_started_with_different_configurations_all_stop_at_setup(two_runs_then_a_mismatch):
    out = two_runs_then_a_mismatch.out
    assert not list(out.glob("rank*_run2.pt"))  # the third run trained on no node
    for rank in (0, 1):
        message = (out / f"mismatch{rank}.txt").read_text()
        assert message.startswith(f"step 0: node {rank}: the 2 nodes were started with different configurations:")
        assert "\n  max_grad_norm -> rank 0: 1.0; rank 1: 2.0\n" in message
        assert "noise_seed ->" not in message
        assert "start all processes from the same script and command line" in message


# ============================================================================ data as users have it
DATA = {  # a name: the strategy, every node's data and the strategy's arguments
    "dp_csgp-unequal": ("dp_csgp", "unequal", {"max_grad_norm": 1.0, "noise_multiplier": 1.0, "node_local_data": True}),
    "push_sum-unequal": ("push_sum", "unequal", {}),
    "push_sum-iterable": ("push_sum", "iterable", {}),
}


@pytest.fixture(scope="module")
def data_runs(tmp_path_factory) -> tuple[Path, Run]:
    """Every configuration of :data:`DATA`, 12 steps on 2 nodes, one after the other in one launch."""
    root = tmp_path_factory.mktemp("data")
    args: list[str] = []
    for i, (name, (strategy, data, kwargs)) in enumerate(DATA.items()):
        if i:
            args += ["--then", "--devices", "2", "--out", str(root / name)]
        args += ["--strategy", strategy, "--strategy-kwargs", json.dumps(kwargs), "--data", data, "--max-steps", "12"]
    run = Run(root / next(iter(DATA)), *args, devices=2)
    try:
        assert run.process.wait(timeout=240) == 0, run.text()[-3000:]
    finally:
        run.stop()
    return root, run


@pytest.mark.parametrize("name", DATA)
def test_nodes_holding_different_amounts_of_data_train_in_step(name, data_runs):
    """Node 0 holds 48 examples (3 batches), node 1 240 (15): every node takes node 0's 3 steps per epoch (one gossip
    round each); private nodes Poisson-sample their own shard at their own q = B / J_i and spend their own epsilon;
    a stream without a length takes max_steps steps, each node cycling its own data."""
    strategy, data, _ = DATA[name]
    root, run = data_runs
    nodes = [torch.load(root / name / f"rank{r}_run0.pt") for r in range(2)]
    assert [n["global_step"] for n in nodes] == [12, 12]
    assert [n["steps_per_epoch"] for n in nodes] == ([3, 3] if data == "unequal" else [12, 12])
    if strategy == "dp_csgp":
        assert [n["sample_rate"] for n in nodes] == [16 / 48, 16 / 240] and [n["private_steps"] for n in nodes] == [12, 12]
        assert nodes[0]["epsilon"] > nodes[1]["epsilon"] > 0  # the small node samples more of its data
    assert "different amounts of training data" in run.text_of(root / name) or data == "iterable"
