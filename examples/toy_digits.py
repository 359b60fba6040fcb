"""What the papers' toy experiments share: digits split over n simulated nodes, one public starting model, the
arguments every toy takes, and the report (each node's test accuracy and epsilon, the consensus distance)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from lightning_privdec.algorithms.simulation import NodeRun, consensus_distance
from lightning_privdec.data.digits import accuracy, load_digits_tensors


def parser(description: str | None, *, steps: int = 200, epsilon: float = 3.0, lr: float = 0.5) -> argparse.ArgumentParser:
    """--nodes, --steps, --epsilon and --lr; each toy adds its own."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--epsilon", type=float, default=epsilon)
    p.add_argument("--lr", type=float, default=lr)
    return p


def digits_shards(nodes: int) -> tuple[list[TensorDataset], tuple[Tensor, Tensor]]:
    """scikit-learn's digits, the training set dealt round-robin to ``nodes`` nodes, and the test set."""
    data = load_digits_tensors()
    (x, y), test = data["train"], data["test"]
    return [TensorDataset(x[k::nodes], y[k::nodes]) for k in range(nodes)], test


def public_linear(features: int = 64, classes: int = 10) -> nn.Module:
    """Logistic regression from the same public parameters on every node."""
    model = nn.Linear(features, classes)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.linspace(-0.01, 0.01, p.numel()).reshape(p.shape))
    return model


def report(runs: Sequence[NodeRun], test: tuple[Tensor, Tensor]) -> dict[str, float]:
    """Print each node's test accuracy, epsilon and noise, and the consensus distance; return the worst figures."""
    accuracies = [accuracy(run.model, *test) for run in runs]
    for rank, (run, acc) in enumerate(zip(runs, accuracies)):
        print(f"node {rank}: test accuracy {acc:.3f}, epsilon {run.node.epsilon():.3f} after {run.node.steps} steps "
              f"({run.node.noise_summary()})")
    distance = consensus_distance(runs)
    print(f"consensus distance max_i ||x_i - x_bar|| = {distance:.4f}")
    return {"worst_accuracy": min(accuracies), "epsilon": max(run.node.epsilon() for run in runs),
            "consensus_distance": distance}
