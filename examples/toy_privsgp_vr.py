"""PrivSGP-VR without Lightning: n simulated nodes on the loopback network, logistic regression on digits.

Every node runs :class:`~lightning_privdec.algorithms.privsgp_vr.PrivSGPVRNode` (Algorithm 1: the SAGA table filled
at the common start, the corrected and noised gradient, push-sum over the time-varying exponential graph) through
:func:`~lightning_privdec.algorithms.simulation.train_network`; prints each node's training loss (first and last
steps), test accuracy and epsilon, and the consensus distance::

    python examples/toy_privsgp_vr.py --nodes 4 --steps 200 --epsilon 3
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from typing import Any

from toy_digits import digits_shards, parser, public_linear, report

from lightning_privdec.algorithms.privsgp_vr import PrivSGPVRNode
from lightning_privdec.algorithms.simulation import train_network
from lightning_privdec.privacy import PrivacyParameters
from lightning_privdec.topology import build_topology


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__)
    p.add_argument("--accounting", default="sound", choices=("sound", "paper", "no_amplification"))
    args = p.parse_args(argv)
    shards, test = digits_shards(args.nodes)
    parameters = PrivacyParameters(max_grad_norm=1.0, target_epsilon=args.epsilon, target_delta=1e-5)
    runs = train_network(
        lambda rank: PrivSGPVRNode(parameters, accounting=args.accounting, rank=rank, device=torch.device("cpu")),
        public_linear, shards, topology=build_topology("exponential-one-peer", args.nodes, weights="push-sum"),
        batch_size=32, steps=args.steps, lr=args.lr, loss=F.cross_entropy,
    )
    window = max(1, args.steps // 10)
    first = [sum(run.losses[:window]) / window for run in runs]
    last = [sum(run.losses[-window:]) / window for run in runs]
    print("training loss, first -> last tenth of the steps, per node: "
          + ", ".join(f"{a:.3f} -> {b:.3f}" for a, b in zip(first, last)))
    # node 0's noise, split, steps and epsilon, also by the closed-form composition
    return {**report(runs, test), "first_loss": max(first), "last_loss": max(last), "node_0": runs[0].node.report()}


if __name__ == "__main__":
    main()
