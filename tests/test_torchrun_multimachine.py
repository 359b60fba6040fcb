"""Two torchrun launches on this machine stand in for two machines: 4 nodes (2 per "machine") train in one graph
(the strategy's default launcher, ``start_method="popen"``: torchrun starts every rank, Lightning starts none)."""

import socket
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from tests.multiprocess import SCRIPT, process_group, relative_consensus_distance

pytestmark = pytest.mark.multiprocess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_machines_train_one_graph(tmp_path: Path):
    port = free_port()
    out = tmp_path / "run"
    with ExitStack() as stack:
        machines = []
        for node_rank in (0, 1):  # the README's multi-machine commands, with 127.0.0.1 as the first machine's address
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--node-rank", str(node_rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
                str(SCRIPT), "--num-nodes", "2", "--devices", "2", "--strategy", "push_sum",
                "--topology", "exponential-one-peer", "--max-epochs", "4", "--out", str(out), "--start-method", "popen",
            ]
            log = stack.enter_context(open(tmp_path / f"machine{node_rank}.log", "w"))
            machines.append(stack.enter_context(process_group(command, stdout=log, stderr=subprocess.STDOUT)))
        for process in machines:
            process.wait(timeout=400)
    logs = "\n".join((tmp_path / f"machine{r}.log").read_text()[-3000:] for r in (0, 1))
    assert all(p.returncode == 0 for p in machines), logs
    results = [torch.load(out / f"rank{rank}.pt") for rank in range(4)]
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["collectives"]["all_gather"] == [0, 1, 2, 3]  # one world of 4 processes across both launches
        assert r["collectives"]["reduce_sum"] == 1 + 2 + 3 + 4
    assert len({r["global_step"] for r in results}) == 1 and results[0]["global_step"] > 0
    assert len({r["rounds"] for r in results}) == 1  # every node took part in every gossip round
    # one-peer exponential graph over 4 nodes: rank 1 sends to 2 and 3 on alternate rounds, so gossip crosses machines
    assert relative_consensus_distance(results) < 0.05
    assert min(r["test_acc"] for r in results) > 0.8
