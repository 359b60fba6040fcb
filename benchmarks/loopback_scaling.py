"""How accuracy, consensus and bytes grow with the number of nodes, and what a step would cost on a real network.

Part 1 (measured). Each private strategy runs on n simulated nodes in ONE process (the loopback exchange, one thread
per node; messages packed exactly as on the wire, so the byte counts are those of a real run) for n = 16, 64, 256 on
scikit-learn's digits. The total training set is fixed (1,348 images), split among the n nodes by a Dirichlet(alpha)
label partition, so each node holds 1348 / n images on average (5 at n = 256). Every node samples its shard by
Poisson sampling at the same rate q, so the expected global batch (q x 1,348) is the same at every n (CPGT, whose
sound accounting needs full batches, uses q = 1). Noise and
clipping as in ``benchmarks/network.py``: C = 1, sigma = 1 (Decor: sigma_cdp = sigma_cor = 1; CPGT and Dyn-D2P take
their noise from their own rules at the given noise multiplier), plain SGD. Reported per (strategy, n): the mean test
accuracy of the nodes' own models, the accuracy of the network-average model, the consensus distance
mean_i ||z_i - z_bar||^2 / ||z_bar||^2, the bytes each node sends per step (mean over nodes, counted by the
exchange) and the accountant's per-node epsilon.

Part 2 (predicted). The communication time of one step at N = 64 and 1,024 nodes on R = 1 Gbit/s links, for a
model of d float32 parameters:

    ring all-reduce (DDP):   T = 2 (N - 1) / N x 4 d x 8 / R  +  2 (N - 1) x alpha
    one-peer gossip:         T = b x 8 / R                    +  alpha

b is the bytes a node sends per step, measured on the loopback network (independent of N; scaled to d); the ring
moves 2 (N - 1) / N x 4 d bytes per node in 2 (N - 1) dependent transfers (``benchmarks/network.py`` counted 67.9 MB
per node at N = 8 for the 9.67M-parameter MLP against 67.69 MB by this formula); alpha is the latency of one
dependent message. Two values of alpha: 0.055 s, measured on the namespaces (8 nodes, digits MLP at 100 Mbit/s,
where bytes take 2 ms: DDP's exchange 0.767 s over its 14 dependent transfers, push-sum's 0.055 s for its one
message; an upper bound, set by 8 Python processes on 2 cores), and 0 (the bandwidth term alone). Checked against
the namespace runs at N = 8, 1 Gbit/s (wide MLP): the formulas give 1.31 s (ring) and 0.37 s (gossip) against the
measured exchange times 1.18 s and 0.45 s. Compute is not included: add it.

    python benchmarks/loopback_scaling.py                              # n = 16, 64, 256, every private strategy
    python benchmarks/loopback_scaling.py --nodes 16 --steps 20 --no-record
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from machine_info import append_results, machine_line, software_line

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLIP, SIGMA = 1.0, 1.0
#: strategy name (lightning_privdec.strategies.PRIVATE_STRATEGIES) -> its arguments in this study
STRATEGIES: dict[str, dict[str, Any]] = {
    "privsgp": {"topology": "exponential-one-peer", "noise_multiplier": SIGMA},
    "dp_csgp": {"topology": "exponential-one-peer", "compressor": "randk:0.1", "consensus_step": 0.05,
                "noise_multiplier": SIGMA},
    "dp2sgd": {"topology": "ring", "noise_multiplier": SIGMA},
    "privsgp_vr": {"topology": "exponential-one-peer", "noise_multiplier": SIGMA},
    "dyn_d2p": {"topology": "exponential-one-peer", "target_epsilon": 8.0, "target_delta": 1e-5},  # sigma from the budget
    "decor": {"topology": "ring", "sigma_cdp": SIGMA * CLIP, "sigma_cor": SIGMA * CLIP},
    "cpgt": {"topology": "ring", "noise_decay": 0.9, "lipschitz": 1.0, "target_epsilon": 8.0},  # Laplace, pure epsilon
}
#: latency of one dependent message, measured on the namespaces (see the module docstring)
ALPHA_MEASURED = 0.055
WIDE_PARAMETERS = 9_670_666


def digits_split(nodes: int, alpha: float, seed: int) -> tuple[list[TensorDataset], tuple[torch.Tensor, ...]]:
    """Every node's shard of the fixed digits training set (Dirichlet label split), and the test set."""
    from lightning_privdec.data.digits import load_digits_tensors
    from lightning_privdec.data.partition import dirichlet_partition

    tensors = load_digits_tensors(seed=0)
    x, y = tensors["train"]
    parts = dirichlet_partition(y, nodes, alpha, seed=seed, min_examples=1, max_tries=1000)
    return [TensorDataset(x[p], y[p]) for p in parts], tensors["test"]


def make_model(seed: int) -> nn.Module:
    """The digits MLP (64-64-10, as DigitsClassifier); the same seed on every node: the public x^0."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def private_node(rank: int, exchange: Any, name: str, kwargs: dict[str, Any], secrets: dict | None,
                 model: nn.Module, data: TensorDataset, batch_size: int, steps: int, lr: float) -> dict[str, Any]:
    """One node's ``steps`` private steps without Lightning: the strategy's own node algorithm driven by
    :func:`lightning_privdec.algorithms.simulation.train_node` (the strategies' private step on plain PyTorch). All
    use of the library's node-level API is in this function. Returns the de-biased parameters and counters."""
    from lightning_privdec.strategies.offline import offline_node, offline_strategy, train_offline

    strategy = offline_strategy(name, rank, exchange.world_size, **kwargs)
    node = offline_node(strategy, secrets)  # Decor: pairwise keys agreed in memory, not over torch.distributed
    run = train_offline(strategy, node, model, data, exchange=exchange, batch_size=batch_size, steps=steps, lr=lr,
                        loss=F.cross_entropy)
    return {"z": run.parameters.clone(), "bytes_sent": exchange.traffic.bytes_sent, "epsilon": float(node.epsilon())}


@torch.no_grad()
def accuracy(model: nn.Module, z: torch.Tensor, test: tuple[torch.Tensor, ...]) -> float:
    torch.nn.utils.vector_to_parameters(z, model.parameters())
    x, y = test
    return (model(x).argmax(-1) == y).float().mean().item()


def run(name: str, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """One (strategy, n) cell: train on the loopback network, then evaluate every node and the average model."""
    from lightning_privdec.comm import LoopbackNetwork
    from lightning_privdec.privacy.pairwise import simulate_key_agreement
    from lightning_privdec.topology import build_topology

    datasets, test = digits_split(nodes, args.alpha, args.seed)
    batches = [max(1, round(args.sample_rate * len(ds))) for ds in datasets]
    if name == "cpgt":  # its sound accounting needs full batches (its paper's Assumption 4): q = 1
        batches = [max(len(ds) for ds in datasets)] * nodes
    kwargs = {**STRATEGIES[name], "max_grad_norm": CLIP, "seed": args.seed, "noise_seed": args.seed}
    secrets = None
    if name == "decor":
        graph = build_topology(kwargs["topology"], nodes).union_graph()
        secrets = simulate_key_agreement({k: sorted(graph.neighbors(k)) for k in range(nodes)})
    models = [make_model(args.seed) for _ in range(nodes)]
    network = LoopbackNetwork(nodes, timeout=600.0)
    started = time.perf_counter()
    results = network.run(lambda rank, exchange: private_node(rank, exchange, name, kwargs, secrets, models[rank],
                                                              datasets[rank], batches[rank], args.steps, args.lr))
    seconds = time.perf_counter() - started
    z = torch.stack([r["z"] for r in results])
    mean = z.mean(0)
    relative = ((z - mean).pow(2).sum(1) / mean.pow(2).sum()).mean().item()
    probe = make_model(args.seed)
    node_acc = [accuracy(probe, zi, test) for zi in z]
    return {
        "strategy": name, "nodes": nodes, "steps": args.steps, "parameters": z.shape[1],
        "mean_node_accuracy": float(np.mean(node_acc)), "min_node_accuracy": float(np.min(node_acc)),
        "average_model_accuracy": accuracy(probe, mean, test), "consensus_relative_mean": relative,
        "bytes_per_node_step": float(np.mean([r["bytes_sent"] for r in results])) / args.steps,
        "epsilon_max": max(r["epsilon"] for r in results), "examples_per_node": float(np.mean([len(d) for d in datasets])),
        "seconds": seconds,
    }


def predicted_seconds(config: str, nodes: int, d: int, gossip_bytes: float, mbit: float, alpha: float) -> float:
    """The formulas of the module docstring: communication seconds per step."""
    rate = mbit * 1e6
    if config == "ring":
        return 2 * (nodes - 1) / nodes * 4 * d * 8 / rate + 2 * (nodes - 1) * alpha
    return gossip_bytes * 8 / rate + alpha


def prediction_table(rows: list[dict[str, Any]], mbit: float) -> list[str]:
    """Predicted communication seconds per step at 64 and 1,024 nodes: DDP's ring vs one-peer gossip, for the digits
    MLP (gossip bytes from the loopback rows) and the 9.67M-parameter wide MLP (the same bytes per parameter)."""
    per_parameter = {}
    for row in rows:  # bytes per node per step do not depend on n: any row of the strategy
        per_parameter.setdefault(row["strategy"], row["bytes_per_node_step"] / row["parameters"])
    sizes = (64, 1024)
    head = " | ".join(f"N = {n:,}, alpha = {a:g} s" for a in (ALPHA_MEASURED, 0.0) for n in sizes)
    lines = [f"| model | d | config | bytes/node/step | {head} |", "|---|---:|---|---:|" + "---:|" * 4]
    for model, d in (("mlp", 4810), ("wide", WIDE_PARAMETERS)):
        configs: list[tuple[str, str, float]] = [("ring", "DDP ring all-reduce", 0.0)]
        configs += [("gossip", f"one-peer gossip, {name}", per_parameter[name] * d)
                    for name in ("privsgp", "dp_csgp") if name in per_parameter]  # fmt: skip
        for config, label, nbytes in configs:
            times = [predicted_seconds(config, n, d, nbytes, mbit, a) for a in (ALPHA_MEASURED, 0.0) for n in sizes]
            shown = "2 (N-1)/N x 4d" if config == "ring" else f"{nbytes / 1e6:.3f} MB"
            lines.append(f"| {model} | {d:,} | {label} | {shown} | " + " | ".join(f"{t:.4g}" for t in times) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="16,64,256", help="comma list of n")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma list out of {','.join(STRATEGIES)}")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sample-rate", type=float, default=0.25, help="q: each node's batch is q x its shard")
    parser.add_argument("--alpha", type=float, default=1.0, help="Dirichlet concentration of the label split")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mbit", type=float, default=1000.0, help="link rate of the prediction")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    parser.add_argument("--no-record", action="store_true", help="print only; do not append to RESULTS.md")
    parser.add_argument("--report", nargs="+", type=Path, default=None,
                        help="JSON files of earlier runs (--json): print and record them instead of running")
    args = parser.parse_args()
    if args.report:
        record([json.loads(path.read_text()) for path in args.report], args)
        return
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {list(STRATEGIES)}")
    sizes = [int(n) for n in args.nodes.split(",")]
    torch.set_num_threads(1)  # n node threads on tiny tensors
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="Optimal order is the")
    started = time.perf_counter()
    rows, failures = [], []
    header = ("| strategy | n | examples/node | mean node acc | min node acc | average-model acc | consensus "
              "distance | bytes/node/step | epsilon (max node) | run s |")
    print(header + "\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for name in names:
        for n in sizes:
            try:
                row = run(name, n, args)
            except Exception as exc:  # one strategy's refusal must not hide the others' numbers
                failures.append(f"{name} at n = {n}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
                print(f"| {name} | {n} | failed: {failures[-1]} |", flush=True)
                continue
            rows.append(row)
            print(f"| {name} | {n} | {row['examples_per_node']:.1f} | {row['mean_node_accuracy']:.3f} | "
                  f"{row['min_node_accuracy']:.3f} | {row['average_model_accuracy']:.3f} | "
                  f"{row['consensus_relative_mean']:.2e} | {row['bytes_per_node_step']:,.0f} | "
                  f"{row['epsilon_max']:.2f} | {row['seconds']:.0f} |", flush=True)
    elapsed = time.perf_counter() - started
    command = "python benchmarks/loopback_scaling.py " + " ".join(sys.argv[1:])
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "failures": failures, "command": command, "seconds": elapsed,
                                         "machine": machine_line()}, indent=1))
    record([{"rows": rows, "failures": failures, "command": command, "seconds": elapsed, "machine": machine_line()}],
           args)


def record(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Print the scaling table and the prediction; append both to RESULTS.md unless --no-record."""
    order = list(STRATEGIES)
    rows = sorted((r for run_ in runs for r in run_["rows"]), key=lambda r: (order.index(r["strategy"]), r["nodes"]))
    failures = [f for run_ in runs for f in run_["failures"]]
    table = ["| strategy | n | examples/node | mean node acc | min node acc | average-model acc | consensus distance | "
             "bytes/node/step | epsilon (max node) | run s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    table += [f"| {r['strategy']} | {r['nodes']} | {r['examples_per_node']:.1f} | {r['mean_node_accuracy']:.3f} | "
              f"{r['min_node_accuracy']:.3f} | {r['average_model_accuracy']:.3f} | {r['consensus_relative_mean']:.2e} | "
              f"{r['bytes_per_node_step']:,.0f} | {r['epsilon_max']:.2f} | {r['seconds']:.0f} |" for r in rows]
    prediction = prediction_table(rows, args.mbit)
    print("\n" + "\n".join(table))
    print(f"\npredicted communication seconds per step at R = {args.mbit:g} Mbit/s\n" + "\n".join(prediction))
    if args.no_record:
        return
    steps = sorted({r["steps"] for r in rows})
    text = "\n".join([
        "", f"## loopback_scaling.py — {datetime.date.today()}", "",
        *[f"- `{run_.get('command', '(command not recorded)')}` ({run_.get('seconds', 0):.0f} s); "
          f"{run_.get('machine', machine_line())}" for run_ in runs],
        f"- {software_line(opacus=True)}", "",
        f"{', '.join(map(str, steps))} steps, q = {args.sample_rate}, Dirichlet alpha = {args.alpha}, lr = {args.lr}, "
        f"C = {CLIP}, sigma = {SIGMA}, digits MLP (4,810 parameters), 1,348 training images in all; consensus distance "
        "= mean_i ||z_i - z_bar||^2 / ||z_bar||^2; run s: wall-clock of the whole cell (one process, n threads).", "",
        *table, "", *([f"Failed: {f}" for f in failures] + [""] if failures else []),
        f"Predicted communication seconds per step at R = {args.mbit:g} Mbit/s (formulas in the script's docstring):",
        "", *prediction, ""])
    append_results(text, args.results)

if __name__ == "__main__":
    main()
