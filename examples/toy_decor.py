"""Decor without Lightning: n simulated nodes on a ring (loopback network), logistic regression on digits.

Every node runs :class:`~lightning_privdec.algorithms.decor.DecorNode` (Algorithm 1: clip, pairwise-cancelling
noise from secrets agreed with X25519, independent noise, D-PSGD gossip) through
:func:`~lightning_privdec.algorithms.simulation.train_network`; prints each node's test accuracy and SecLDP epsilon
against the eavesdropper, and the consensus distance::

    python examples/toy_decor.py --nodes 4 --steps 200 --epsilon 3
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import networkx as nx
from toy_digits import digits_shards, parser, public_linear, report

from lightning_privdec.algorithms.decor import DecorNode, DecorOptions
from lightning_privdec.algorithms.simulation import train_network
from lightning_privdec.privacy import PrivacyParameters, simulate_key_agreement
from lightning_privdec.topology import build_topology


def main(argv: list[str] | None = None) -> dict[str, float | int | None]:
    args = parser(__doc__).parse_args(argv)
    shards, test = digits_shards(args.nodes)
    parameters = PrivacyParameters(max_grad_norm=1.0, target_epsilon=args.epsilon, target_delta=1e-5)
    topology = build_topology("ring", args.nodes, weights="metropolis")
    graph = nx.Graph(topology.union_graph())
    secrets = simulate_key_agreement({k: sorted(graph.neighbors(k)) for k in range(args.nodes)})

    def node(rank: int) -> DecorNode:
        decor = DecorNode(parameters, graph=graph, options=DecorOptions(), rank=rank, device=torch.device("cpu"))
        decor.secrets = secrets[rank]  # this node's pairwise secrets (in a real run: agreed over the network)
        return decor

    runs = train_network(node, public_linear, shards, topology=topology, push_sum_weight=False, batch_size=32,
                         steps=args.steps, lr=args.lr, loss=F.cross_entropy)
    node = runs[0].node  # the calibrated noise pair and the accountant's inputs, for a reader to recompute epsilon
    return {**report(runs, test), "sigma_cdp": node.sigma_cdp, "sigma_cor": node.sigma_cor, "steps": node.steps,
            "sample_rate": node.sample_rate}


if __name__ == "__main__":
    main()
