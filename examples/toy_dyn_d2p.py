"""Dyn-D2P without Lightning: n simulated nodes on the loopback network, logistic regression on digits.

Every node runs :class:`~lightning_privdec.algorithms.dyn_d2p.DynD2PNode` (Algorithm 1: the clip C_k and noise
sigma_k of its schedule, push-sum) through :func:`~lightning_privdec.algorithms.simulation.train_network`; prints each node's test accuracy
and epsilon, and the consensus distance::

    python examples/toy_dyn_d2p.py --nodes 4 --steps 200 --epsilon 1 --variant dyn
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from lightning_privdec.algorithms.dyn_d2p import VARIANTS, DynD2PNode, DynD2POptions
from lightning_privdec.algorithms.simulation import consensus_distance, train_network
from lightning_privdec.data.digits import accuracy, load_digits_tensors
from lightning_privdec.privacy import PrivacyParameters
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
    p.add_argument("--variant", default="dyn", choices=VARIANTS)
    p.add_argument("--rho-c", type=float, default=2.0)
    p.add_argument("--rho-mu", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=0.5)
    args = p.parse_args(argv)

    data = load_digits_tensors()
    (x, y), (x_test, y_test) = data["train"], data["test"]
    parameters = PrivacyParameters(max_grad_norm=1.0, target_epsilon=args.epsilon, target_delta=1e-5)
    runs = train_network(
        lambda rank: DynD2PNode(parameters, options=DynD2POptions(args.rho_c, args.rho_mu, args.variant), rank=rank,
                               device=torch.device("cpu")),
        lambda: public_start(nn.Linear(x.shape[1], 10)),
        [TensorDataset(x[k :: args.nodes], y[k :: args.nodes]) for k in range(args.nodes)],
        topology=build_topology("exponential-one-peer", args.nodes, weights="push-sum"),
        batch_size=32, steps=args.steps, lr=args.lr, loss=F.cross_entropy,
    )
    accuracies = [accuracy(run.model, x_test, y_test) for run in runs]
    for rank, (run, acc) in enumerate(zip(runs, accuracies)):
        print(f"node {rank}: test accuracy {acc:.3f}, epsilon {run.node.epsilon():.3f} after {run.node.steps} steps "
              f"({run.node.noise_summary()})")
    print(f"consensus distance max_i ||x_i - x_bar|| = {consensus_distance(runs):.4f}")
    return {"worst_accuracy": min(accuracies), "epsilon": max(run.node.epsilon() for run in runs)}


if __name__ == "__main__":
    main()
