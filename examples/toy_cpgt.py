"""CPGT without Lightning: n simulated agents on the loopback network, logistic regression on digits.

Every agent runs :class:`~lightning_privdec.algorithms.cpgt.CPGTNode` (Algorithm 1: clipped full-batch gradient,
tracking, decaying Laplace noise on the compressed messages) through
:func:`~lightning_privdec.algorithms.simulation.train_network` on a ring with Metropolis weights. The Laplace scales
are calibrated so that Theorem 2's sound whole-run bound (pure epsilon, delta = 0) spends ``--epsilon``, under the
assumed smoothness ``--lipschitz``. That bound carries sqrt(d) (an l2 sensitivity priced by l1 Laplace noise: about 25
for this model's 650 parameters), hence the larger default budget. Prints each agent's test accuracy and epsilon,
and the consensus distance::

    python examples/toy_cpgt.py --nodes 4 --steps 200 --epsilon 20 --compressor topk:0.5
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from toy_digits import digits_shards, parser, public_linear, report

from lightning_privdec.algorithms.cpgt import CPGTNode, CPGTOptions
from lightning_privdec.algorithms.simulation import train_network
from lightning_privdec.compression import build_compressor
from lightning_privdec.privacy import PrivacyParameters
from lightning_privdec.topology import build_topology


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = parser(__doc__, epsilon=20.0, lr=0.3)
    p.add_argument("--compressor", default="none", help="'none', 'topk:0.5', 'qsgd:8', ...")
    p.add_argument("--lipschitz", type=float, default=0.1, help="L, assumed for every agent's gradient")
    p.add_argument("--noise-decay", type=float, default=0.5, help="q")
    args = p.parse_args(argv)  # --lr is alpha: Theorem 2 needs alpha L < 1/2
    shards, test = digits_shards(args.nodes)
    parameters = PrivacyParameters(max_grad_norm=1.0)  # C only: the budget and the Laplace noise are CPGT's options
    options = CPGTOptions(noise_decay=args.noise_decay, lipschitz=args.lipschitz, target_epsilon=args.epsilon)
    runs = train_network(
        lambda rank: CPGTNode(parameters, options=options, rank=rank, device=torch.device("cpu")),
        public_linear, shards, topology=build_topology("ring", args.nodes, weights="metropolis"),
        compressor=None if args.compressor == "none" else build_compressor(args.compressor),
        batch_size=max(map(len, shards)), steps=args.steps, lr=args.lr, loss=F.cross_entropy,  # full batches: q = 1
    )
    return report(runs, test)


if __name__ == "__main__":
    main()
