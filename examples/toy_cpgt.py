"""CPGT without Lightning: n simulated nodes on the loopback network, distributed least squares.

Node i holds rows (a, b) of a linear model and minimizes f_i(x) = mean (a^T x - b)^2 / 2; the network minimizes
sum_i f_i. Every node runs :class:`~lightning_privdec.algorithms.cpgt.CPGTNode` (Algorithm 1: clipped gradients,
gradient tracking, Laplace noise d q^k on the state and the tracker, compressed exchange) through
:func:`~lightning_privdec.algorithms.simulation.train_network`, with full batches (Theorem 2's whole-run bound needs
them) and d_x = d_y calibrated to the budget; prints each node's distance to the least-squares solution before and
after training, its epsilon (pure DP, delta = 0), and the consensus distance::

    python examples/toy_cpgt.py --nodes 4 --steps 100 --epsilon 3 --compressor qsgd:8

L is the smoothness constant of the unclipped f_i, largest eigenvalue of mean a a^T over the node's rows: with a
clipping bound above every per-example gradient met in training it is the clipped gradient's too (an assumption the
user makes, as for any model).
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn
from torch.utils.data import TensorDataset

from lightning_privdec.algorithms.cpgt import CPGTNode, CPGTOptions
from lightning_privdec.algorithms.simulation import consensus_distance, train_network
from lightning_privdec.compression import build_compressor
from lightning_privdec.privacy import PrivacyParameters
from lightning_privdec.topology import build_topology

ROWS, DIM = 50, 3  # per node


def squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(a^T x - b)^2 / 2 per example."""
    return (prediction.squeeze(-1) - target).pow(2) / 2


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--compressor", default="none", help="'none', 'qsgd:8', 'topk:0.6', ...")
    p.add_argument("--lr", type=float, default=0.15, help="alpha, the step size")
    p.add_argument("--noise-decay", type=float, default=0.8, help="q")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="C")
    args = p.parse_args(argv)

    g = torch.Generator().manual_seed(0)
    A = torch.randn(args.nodes, ROWS, DIM, generator=g, dtype=torch.float64)
    b = A @ torch.randn(DIM, generator=g, dtype=torch.float64) + 0.1 * torch.randn(args.nodes, ROWS, generator=g,
                                                                                     dtype=torch.float64)
    solution = torch.linalg.lstsq(A.reshape(-1, DIM), b.reshape(-1, 1)).solution.squeeze(-1)
    lipschitz = max(float(torch.linalg.eigvalsh(A[i].T @ A[i] / ROWS).max()) for i in range(args.nodes))
    parameters = PrivacyParameters(max_grad_norm=args.max_grad_norm, noise_multiplier=0.0)  # no Gaussian noise
    options = CPGTOptions(noise_decay=args.noise_decay, lipschitz=lipschitz, target_epsilon=args.epsilon)

    def make_node(rank: int) -> CPGTNode:
        with warnings.catch_warnings():  # the Gaussian-noise warning of noise_multiplier=0: CPGT's noise is Laplace
            warnings.filterwarnings("ignore", message="noise_multiplier=0 adds no noise")
            return CPGTNode(parameters, options=options, rank=rank, device=torch.device("cpu"))

    def public_start() -> nn.Module:
        model = nn.Linear(DIM, 1, bias=False, dtype=torch.float64)
        nn.init.zeros_(model.weight)  # every node starts from the same public point
        return model

    def distance(model: nn.Module) -> float:
        return float((model.weight.detach().squeeze(0) - solution).norm())

    start = distance(public_start())
    runs = train_network(
        make_node,
        public_start,
        [TensorDataset(A[i], b[i]) for i in range(args.nodes)],
        topology=build_topology("ring", args.nodes, weights="metropolis"),
        compressor=None if args.compressor == "none" else build_compressor(args.compressor),
        batch_size=ROWS, steps=args.steps, lr=args.lr, loss=squared_error,
    )
    errors = [distance(run.model) for run in runs]
    for rank, (run, error) in enumerate(zip(runs, errors)):
        print(f"node {rank}: ||x_i - x*|| {start:.4f} -> {error:.4f}, epsilon {run.node.epsilon():.4f} "
              f"(delta = {run.node.delta:g}) after {run.node.steps} rounds ({run.node.noise_summary()})")
    print(f"consensus distance max_i ||x_i - x_bar|| = {consensus_distance(runs):.4f}")
    node = runs[0].node
    return {"error_start": start, "worst_error": max(errors), "epsilon": max(run.node.epsilon() for run in runs),
            "delta": max(run.node.delta for run in runs), "noise": node.noise_x, "lipschitz": lipschitz,
            "rows": ROWS, "dimension": DIM}


if __name__ == "__main__":
    main()
