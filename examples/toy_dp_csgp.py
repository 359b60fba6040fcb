"""DP-CSGP without Lightning: n simulated nodes on the loopback network, logistic regression on digits.

Every node runs :class:`~lightning_privdec.algorithms.dp_csgp.DPCSGPNode` (Algorithm 1: clip, noise, compressed
push-sum) through :func:`~lightning_privdec.algorithms.simulation.train_network`; prints each node's test accuracy
and epsilon, and the consensus distance::

    python examples/toy_dp_csgp.py --nodes 4 --steps 200 --epsilon 3 --compressor randk:0.5
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from toy_digits import digits_shards, parser, public_linear, report

from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.algorithms.simulation import train_network
from lightning_privdec.compression import build_compressor
from lightning_privdec.privacy import PrivacyParameters
from lightning_privdec.topology import build_topology


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = parser(__doc__)
    p.add_argument("--compressor", default="randk:0.5", help="'none', 'randk:0.5', 'qsgd:8', ...")
    args = p.parse_args(argv)
    shards, test = digits_shards(args.nodes)
    parameters = PrivacyParameters(max_grad_norm=1.0, target_epsilon=args.epsilon, target_delta=1e-5)
    runs = train_network(
        lambda rank: DPCSGPNode(parameters, rank=rank, device=torch.device("cpu")), public_linear, shards,
        topology=build_topology("exponential", args.nodes, weights="push-sum"),
        compressor=None if args.compressor == "none" else build_compressor(args.compressor),
        batch_size=32, steps=args.steps, lr=args.lr, loss=F.cross_entropy,
    )
    return report(runs, test)


if __name__ == "__main__":
    main()
