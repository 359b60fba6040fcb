"""Decor without Lightning: n simulated nodes on a ring (loopback network), logistic regression on digits.

Every node runs :class:`~lightning_privdec.algorithms.decor.DecorNode` (Algorithm 1: clip, pairwise-cancelling
noise from secrets agreed with X25519, independent noise, D-PSGD gossip) through
:func:`~lightning_privdec.algorithms.simulation.train_network`; prints each node's test accuracy and SecLDP epsilon
against the eavesdropper, and the consensus distance::

    python examples/toy_decor.py --nodes 4 --steps 200 --epsilon 3
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import networkx as nx

from lightning_privdec.algorithms.decor import DecorNode, DecorOptions
from lightning_privdec.algorithms.simulation import consensus_distance, train_network
from lightning_privdec.data.digits import accuracy, load_digits_tensors
from lightning_privdec.privacy import PrivacyParameters, simulate_key_agreement
from lightning_privdec.topology import build_topology


def public_start(model: nn.Module) -> nn.Module:
    """Every node starts from the same public parameters."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.linspace(-0.01, 0.01, p.numel()).reshape(p.shape))
    return model


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=0.5)
    args = p.parse_args(argv)

    data = load_digits_tensors()
    (x, y), (x_test, y_test) = data["train"], data["test"]
    parameters = PrivacyParameters(max_grad_norm=1.0, target_epsilon=args.epsilon, target_delta=1e-5)
    topology = build_topology("ring", args.nodes, weights="metropolis")
    graph = nx.Graph(topology.union_graph())
    secrets = simulate_key_agreement({k: sorted(graph.neighbors(k)) for k in range(args.nodes)})

    def node(rank: int) -> DecorNode:
        decor = DecorNode(parameters, graph=graph, options=DecorOptions(), rank=rank, device=torch.device("cpu"))
        decor.secrets = secrets[rank]  # this node's pairwise secrets (in a real run: agreed over the network)
        return decor

    runs = train_network(
        node,
        lambda: public_start(nn.Linear(x.shape[1], 10)),
        [TensorDataset(x[k :: args.nodes], y[k :: args.nodes]) for k in range(args.nodes)],
        topology=topology, push_sum_weight=False,
        batch_size=32, steps=args.steps, lr=args.lr, loss=F.cross_entropy,
    )
    accuracies = [accuracy(run.model, x_test, y_test) for run in runs]
    for rank, (run, acc) in enumerate(zip(runs, accuracies)):
        print(f"node {rank}: test accuracy {acc:.3f}, epsilon {run.node.epsilon():.3f} after {run.node.steps} steps "
              f"({run.node.noise_summary()})")
    print(f"consensus distance max_i ||x_i - x_bar|| = {consensus_distance(runs):.4f}")
    node = runs[0].node
    return {
        "worst_accuracy": min(accuracies), "epsilon": max(run.node.epsilon() for run in runs),
        "sigma_cdp": node.sigma_cdp, "sigma_cor": node.sigma_cor, "sample_rate": node.sample_rate, "steps": node.steps,
    }


if __name__ == "__main__":
    main()
