"""Dyn-D2P without Lightning: n simulated nodes on the loopback network, logistic regression on digits.

Every node runs :class:`~lightning_privdec.algorithms.dyn_d2p.DynD2PNode` (Algorithm 1: the clip C_k and noise
sigma_k of its schedule, push-sum) through :func:`~lightning_privdec.algorithms.simulation.train_network`; prints each node's test accuracy
and epsilon, and the consensus distance::

    python examples/toy_dyn_d2p.py --nodes 4 --steps 200 --epsilon 1 --variant dyn
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from toy_digits import digits_shards, parser, public_linear, report

from lightning_privdec.algorithms.dyn_d2p import VARIANTS, DynD2PNode, DynD2POptions
from lightning_privdec.algorithms.simulation import train_network
from lightning_privdec.privacy import PrivacyParameters
from lightning_privdec.topology import build_topology


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = parser(__doc__)
    p.add_argument("--variant", default="dyn", choices=VARIANTS)
    p.add_argument("--rho-c", type=float, default=2.0)
    p.add_argument("--rho-mu", type=float, default=2.0)
    args = p.parse_args(argv)
    shards, test = digits_shards(args.nodes)
    parameters = PrivacyParameters(max_grad_norm=1.0, target_epsilon=args.epsilon, target_delta=1e-5)
    options = DynD2POptions(args.rho_c, args.rho_mu, args.variant)
    runs = train_network(
        lambda rank: DynD2PNode(parameters, options=options, rank=rank, device=torch.device("cpu")),
        public_linear, shards, topology=build_topology("exponential-one-peer", args.nodes, weights="push-sum"),
        batch_size=32, steps=args.steps, lr=args.lr, loss=F.cross_entropy,
    )
    return report(runs, test)


if __name__ == "__main__":
    main()
