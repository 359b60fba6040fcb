"""The Trainer and the simulator run one node step (lightning_privdec/algorithms/node.py): for every private
strategy, 2 nodes and a fixed noise seed, a Trainer fit and the loopback simulation the audit and the toy examples
use end with the same parameters, the same ledger and the same bytes on the wire, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import networkx as nx
import pytest
import torch

from lightning_privdec.algorithms.node import private_step
from lightning_privdec.audit.observer import WireTap
from lightning_privdec.comm import LoopbackNetwork
from lightning_privdec.privacy.pairwise import PairwiseSecrets
from lightning_privdec.privacy.write_ahead import WriteAheadLedger
from lightning_privdec.strategies import PRIVATE_STRATEGIES
from lightning_privdec.strategies.offline import offline_node, offline_strategy, train_offline
from tests.multiprocess import run_group
from tests.node_step_cases import BATCH, LR, NODES, STEPS, NodeClassifier, loss, node_data, outcome, strategy_arguments

pytestmark = [
    pytest.mark.filterwarnings("ignore:CPGT's epsilon covers"),
    pytest.mark.filterwarnings("ignore:Optimal order is the"),
]

SCRIPT = Path(__file__).parent / "scripts" / "fit_every_strategy.py"


def simulate(name: str, key_dir: Path) -> list[dict]:
    """The strategy's nodes on the loopback network (strategies/offline.py, as privdec-audit runs them)."""
    strategies = [offline_strategy(name, rank, NODES, **strategy_arguments(name, key_dir)) for rank in range(NODES)]
    secrets = None
    if name == "decor":  # the keys the Trainer's nodes kept, agreed in memory instead of over the network
        graph = nx.Graph(strategies[0].topology.union_graph())
        secrets = {r: PairwiseSecrets(r, sorted(graph.neighbors(r)), key_file=key_dir / f"node_{r}.key")
                   for r in range(NODES)}
        public = {r: s.public_key_bytes() for r, s in secrets.items()}
        for s in secrets.values():
            s.agree(public)

    models = [NodeClassifier().net for _ in range(NODES)]  # seeded in this thread: the threads share torch's RNG

    def node(rank: int, exchange) -> dict:  # noqa: ANN001
        tap, model, strategy = WireTap(exchange), models[rank], strategies[rank]
        private = offline_node(strategy, secrets)
        train_offline(strategy, private, model, node_data(rank), exchange=tap, batch_size=BATCH, steps=STEPS, lr=LR,
                      loss=loss)
        return outcome(model, private.ledger, tap.sent)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return LoopbackNetwork(NODES, timeout=120.0).run(node)
    finally:
        torch.set_num_threads(threads)


def test_a_paper_privatizes_and_the_node_step_records_the_release_it_announced_and_writes_it_ahead(tmp_path):
    """A paper's privatize() only clips and noises; private_step records next_release() as taken before the call
    (Dyn-D2P's moves on with every step) and writes the accounting state before anything could leave the node."""
    from tests.test_dyn_d2p import planned_node, take_step
    from tests.test_dp_csgp import attached_node, loader

    e, model = attached_node(target_epsilon=2.0, target_delta=1e-5, seed=5)
    e.private_dataloader(loader(), planned_steps=20, world_size=4)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3)), torch.randint(0, 2, (4,))).backward()
    e.privatize()
    assert e.steps == 0  # nothing recorded by the paper
    ledger = WriteAheadLedger(tmp_path, "run", rank=1)
    release = e.next_release()
    private_step(e, ledger)
    assert e.ledger.history == [(release.noise_multiplier, release.sample_rate, 1)]
    assert ledger.read()["steps"] == 1

    model = torch.nn.Linear(3, 1)
    dyn = planned_node(model=model)  # a schedule: every step releases its own sigma_k
    announced = []
    for _ in range(3):
        announced.append(dyn.next_release())
        take_step(dyn, model, torch.randn(5, 3), torch.randn(5, 1), "hooks")
    assert len({release.noise_multiplier for release in announced}) == 3
    assert [(r.noise_multiplier, r.sample_rate, 1) for r in announced] == dyn.ledger.history


@pytest.mark.multiprocess
def test_the_trainer_and_the_simulator_take_the_same_steps_bit_for_bit(tmp_path: Path) -> None:
    out, key_dir = tmp_path / "trainer", tmp_path / "keys"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--key-dir", str(key_dir)]
    result = run_group(command, timeout=600)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    for name in sorted(PRIVATE_STRATEGIES):
        simulated = simulate(name, key_dir)
        for rank in range(NODES):
            trained = torch.load(out / name / f"rank{rank}.pt", weights_only=True)
            assert len(trained["sent"]) == STEPS and all(trained["sent"]), (name, rank)  # every step gossiped
            assert trained["ledger"] == simulated[rank]["ledger"], (name, rank)
            assert trained["sent"] == simulated[rank]["sent"], (name, rank)
            assert torch.equal(trained["params"], simulated[rank]["params"]), (name, rank)


def test_the_simulated_nodes_stop_together_when_one_more_step_would_exceed_a_node_budget():
    """A given sigma with a target: the node with the larger sampling rate reaches its target first, and every node
    stops at that step (the strategies' shared budget stop), each within its own target."""
    from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
    from lightning_privdec.algorithms.simulation import train_network
    from lightning_privdec.privacy import PrivacyParameters
    from lightning_privdec.topology import build_topology

    parameters = PrivacyParameters(max_grad_norm=1.0, noise_multiplier=3.0, target_epsilon=2.0, target_delta=1e-5)
    datasets = [torch.utils.data.Subset(node_data(rank), range(size)) for rank, size in enumerate([32, 64])]
    runs = train_network(
        lambda rank: DPCSGPNode(parameters, rank=rank, device=torch.device("cpu"), noise_seed=0),
        lambda: NodeClassifier().net, datasets, topology=build_topology("exponential", NODES, weights="push-sum"),
        batch_size=BATCH, steps=200, lr=LR, loss=loss,
    )
    steps = [run.node.steps for run in runs]
    assert steps[0] == steps[1] < 200
    assert runs[0].node.next_step_exceeds_budget()  # the node with q = 1/2 stopped the run
    assert not runs[1].node.next_step_exceeds_budget()  # the other (q = 1/4) had budget left, and stopped with it
    assert all(run.node.epsilon() <= 2.0 for run in runs)
