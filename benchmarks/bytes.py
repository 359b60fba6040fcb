"""Bytes per node per step: dense gossip vs each compressor vs DDP's all-reduce, for two model sizes.

What it measures
----------------
For the digits MLP of the quick start and for the GroupNorm ResNet-18 of examples/cifar_resnet.py, n nodes run one
real gossip round (``PushSumGossip`` over the loopback exchange: the compressor really encodes, the exchange packs
the buffers it would hand to torch.distributed and counts their bytes) on each graph and compressor. The table shows
the measured bytes each node sent in that round (mean over nodes and over ``--rounds`` rounds), the compression
ratio against dense gossip on the same graph, and DDP's ring all-reduce volume per node, ``2 (n-1)/n x 4d`` bytes
(a formula: DDP's traffic is not observable from Python, and gloo/NCCL may pick other algorithms).

    python benchmarks/bytes.py                   # n = 8, both models, all compressors
    python benchmarks/bytes.py --nodes 16 --no-resnet

Prints the table, writes ``benchmarks/bytes.png`` and appends the table with this machine's description to
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from lightning_privdec.algorithms import PushSumGossip  # noqa: E402
from lightning_privdec.comm import LoopbackNetwork  # noqa: E402
from lightning_privdec.compression import build_compressor  # noqa: E402
from lightning_privdec.data import DigitsClassifier  # noqa: E402
from lightning_privdec.topology import build_topology  # noqa: E402
from machine_info import append_results, machine_line, software_line  # noqa: E402  (benchmarks/machine_info.py)

COMPRESSORS = ["none", "randk:0.5", "randk:0.1", "topk:0.1", "topk:0.01", "qsgd:8", "qsgd:4", "sign"]
GRAPHS = ["exponential-one-peer", "exponential"]


def model_sizes(include_resnet: bool) -> dict[str, int]:
    sizes = {"digits MLP": sum(p.numel() for p in DigitsClassifier().parameters())}
    if include_resnet:
        from cifar_resnet import resnet18_groupnorm

        sizes["ResNet-18 (GroupNorm)"] = sum(p.numel() for p in resnet18_groupnorm().parameters())
    return sizes


def measured_bytes(d: int, nodes: int, graph: str, compressor: str, rounds: int) -> float:
    """Mean bytes one node sends per gossip round, counted by the exchange."""
    topology = build_topology(graph, nodes, weights="push-sum")
    network = LoopbackNetwork(nodes, timeout=600)

    def node(rank: int, exchange) -> int:  # noqa: ANN001
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(d, generator=generator)
        gossip = PushSumGossip(x, rank=rank, topology=topology, exchange=exchange,
                               compressor=build_compressor(compressor), reference=torch.zeros(d), consensus_step=0.5)
        for _ in range(rounds):
            gossip.step(gossip.x + 0.01 * torch.randn(d, generator=generator))
        return exchange.traffic.bytes_sent

    return sum(network.run(node)) / (nodes * rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="gossip rounds measured per configuration")
    parser.add_argument("--no-resnet", action="store_true", help="skip the 11M-parameter model")
    parser.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "bytes.png")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)

    n = args.nodes
    rows = []
    for model, d in model_sizes(not args.no_resnet).items():
        allreduce = 2 * (n - 1) / n * 4 * d
        for graph in GRAPHS:
            dense = None
            for compressor in COMPRESSORS:
                sent = measured_bytes(d, n, graph, compressor, args.rounds)
                dense = sent if compressor == "none" else dense
                rows.append((model, d, graph, compressor, sent, dense / sent, sent / allreduce))
                print(f"{model:22s} d={d:>9,d} {graph:21s} {compressor:10s} {sent:>14,.0f} B  "
                      f"x{dense / sent:7.2f} vs dense  {sent / allreduce:6.3f} of all-reduce", flush=True)

    header = (
        f"\n## bytes.py — {datetime.date.today().isoformat()}, {n} nodes\n\n- {machine_line()}\n- {software_line()}\n\n"
        f"Command: `python benchmarks/bytes.py --nodes {n}`. Bytes each node sends per step (measured by the exchange, "
        f"mean over nodes and {args.rounds} rounds); DDP ring all-reduce per node = 2(n-1)/n x 4d (formula).\n\n"
        "| model | d | graph | compressor | bytes/node/step | vs dense gossip | DDP all-reduce bytes/node/step | "
        "share of all-reduce |\n|---|---:|---|---|---:|---:|---:|---:|\n"
    )
    table = "".join(
        f"| {m} | {d:,} | {g} | {c} | {s:,.0f} | {r:.2f}x | {2 * (n - 1) / n * 4 * d:,.0f} | {a:.3f} |\n"
        for m, d, g, c, s, r, a in rows
    )
    print(header + table)
    append_results(header + table, args.results)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r[0] for r in rows}, key=[r[0] for r in rows].index)
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        d = next(r[1] for r in rows if r[0] == model)
        width = 0.8 / len(GRAPHS)
        for k, graph in enumerate(GRAPHS):
            values = [r[4] for r in rows if r[0] == model and r[2] == graph]
            ax.bar([i + k * width for i in range(len(COMPRESSORS))], values, width, label=graph)
        ax.axhline(2 * (n - 1) / n * 4 * d, color="k", linestyle="--", label="DDP ring all-reduce")
        ax.set_xticks([i + width / 2 for i in range(len(COMPRESSORS))], COMPRESSORS, rotation=30)
        ax.set_yscale("log")
        ax.set_ylabel("bytes sent per node per step")
        ax.set_title(f"{model} (d = {d:,}), {n} nodes")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
