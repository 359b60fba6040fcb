"""One misbehaving node among honest DP²-SGD nodes on digits: the honest nodes' accuracy with and without
``robust="clip"`` (self-centred clipping, :mod:`lightning_privdec.comm.robust`).

n nodes on a ring (Metropolis weights), each running DP²-SGD (:class:`~lightning_privdec.algorithms.dp_csgp.
DPCSGPNode` with exact doubly-stochastic gossip, clip C = 1, noise multiplier ``--sigma``) on its round-robin shard of
scikit-learn's digits with a public logistic-regression start, in one process on the loopback network
(:mod:`lightning_privdec.algorithms.simulation`). Node 0 trains like the others but sends, instead of its model x,

    scaled     ``--scale`` x            (a huge model)
    sign-flip  -``--scale`` x           (the opposite direction, amplified)

The honest nodes (1 .. n-1) either mix plainly or clip every received model to within ``--radius`` of their own.
Printed: the honest nodes' worst and mean test accuracy per (attack, defence), and the no-attack reference.

    python benchmarks/robust_clip.py --nodes 6 --steps 100 --json robust.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from toy_digits import digits_shards, public_linear  # noqa: E402

from lightning_privdec.algorithms.dp_csgp import DPCSGPNode  # noqa: E402
from lightning_privdec.algorithms.simulation import train_node  # noqa: E402
from lightning_privdec.comm import Exchange, LoopbackNetwork, NonFiniteMessageError  # noqa: E402
from lightning_privdec.comm.base import Incoming, Outgoing, PendingRound  # noqa: E402
from lightning_privdec.comm.robust import ClippedExchange  # noqa: E402
from lightning_privdec.data.digits import accuracy  # noqa: E402
from lightning_privdec.privacy import PrivacyParameters  # noqa: E402
from lightning_privdec.topology import build_topology  # noqa: E402


class Attacker(Exchange):
    """Node 0's exchange: sends ``factor`` times its model instead of its model."""

    def __init__(self, inner: Exchange, factor: float) -> None:
        super().__init__(inner.rank, inner.world_size)
        self.inner, self.factor, self.traffic = inner, factor, inner.traffic

    def exchange(self, outgoing: Outgoing, incoming: Incoming):  # noqa: ANN201
        return self.start(outgoing, incoming).wait()

    def start(self, outgoing: Outgoing, incoming: Incoming, tag: int = 0) -> PendingRound:
        forged = {peer: [t * self.factor for t in tensors] for peer, tensors in outgoing.items()}
        return self.inner.start(forged, incoming, tag)


def run(nodes: int, steps: int, attack: str | None, radius: float | None, scale: float, sigma: float,
        lr: float, seed: int = 0) -> list[float] | None:
    """The test accuracy of every honest node (1 .. n-1) after ``steps`` steps; ``None`` if the models diverged
    (a node received a non-finite model and stopped)."""
    torch.manual_seed(seed)
    shards, test = digits_shards(nodes)
    topology = build_topology("ring", nodes, weights="metropolis")
    parameters = PrivacyParameters(max_grad_norm=1.0, noise_multiplier=sigma)
    network = LoopbackNetwork(nodes, timeout=600)
    factor = {"scaled": scale, "sign-flip": -scale}.get(attack or "", 1.0)

    def node(rank: int, exchange: Exchange):  # noqa: ANN202
        if rank == 0 and attack is not None:
            exchange = Attacker(exchange, factor)
        elif radius is not None:
            exchange = ClippedExchange(exchange, radius)
        return train_node(
            DPCSGPNode(parameters, rank=rank, device=torch.device("cpu"), noise_seed=seed * 100 + rank),
            public_linear(), shards[rank], exchange=exchange, topology=topology, batch_size=32, steps=steps, lr=lr,
            loss=F.cross_entropy, push_sum_weight=False,
        )

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = network.run(node)
    except NonFiniteMessageError:
        return None
    finally:
        torch.set_num_threads(threads)
    return [accuracy(r.model, *test) for r in runs[1:]]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=6)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--scale", type=float, default=10.0)
    parser.add_argument("--radius", type=float, default=0.5, help="tau of robust='clip' (L2, parameter units)")
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = []
    for attack in (None, "scaled", "sign-flip"):
        for radius in (None, args.radius):
            acc = run(args.nodes, args.steps, attack, radius, args.scale, args.sigma, args.lr)
            rows.append({"attack": attack or "none", "robust": "clip" if radius else "none", "radius": radius,
                         "worst": acc and min(acc), "mean": acc and sum(acc) / len(acc)})
    print("| node 0 sends | honest nodes mix | worst honest accuracy | mean honest accuracy |")
    print("|---|---|---:|---:|")
    for r in rows:
        robust = f"robust='clip', tau={r['radius']:g}" if r["radius"] else "plainly"
        if r["worst"] is None:
            print(f"| {r['attack']} | {robust} | diverged (non-finite models) | diverged |")
        else:
            print(f"| {r['attack']} | {robust} | {r['worst']:.3f} | {r['mean']:.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "arguments": vars(args) | {"json": str(args.json)}}, indent=1))
    return rows


if __name__ == "__main__":
    main()
