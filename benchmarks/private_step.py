"""One node's private step against its non-private step, in one process: where the time and the memory go.

Model: ``benchmarks/network.py``'s ``wide`` MLP 64-3072-3072-10 (d = 9,670,666 parameters), batch 32 of synthetic
digits-shaped inputs, plain SGD, one intra-op thread unless ``--threads`` says otherwise.

* ``sgd``: the non-private step: forward, backward, ``optimizer.step()``.
* ``privsgp``, ``dp_csgp_randk0.1``, ``dp_csgp_qsgd8``: the strategies' private step on node 0 of an 8-node
  ``exponential-one-peer`` graph (the network benchmark's), exactly as :func:`~lightning_privdec.algorithms.simulation.
  train_node` runs it: per-sample clipping (the library's default mode), this node's ChaCha20 noise (sigma = 1,
  C = 1, Poisson q = 32 / 1024), the optimizer on the numerator x, the gossip round (compress, error feedback, line 5,
  push-sum weight) and the de-biased model. The exchange hands the node back, as each in-neighbour's message, a copy
  of what it sent: the decoding work is that of a real message (the same sizes and keys), only the transfer is absent.
* ``--memory``: every configuration in a fresh child process; its peak resident set (``ru_maxrss``) after the steps
  and its minor page faults per timed step (a fresh model-sized buffer costs d * 4 / 4096 = 9,444 of them),
  next to a ``ddp`` child: the same non-private step inside ``torch.nn.parallel.DistributedDataParallel`` on a
  one-process gloo group (DDP's gradient buckets; no peer to all-reduce with), and a ``ddp_lightning`` child: the
  same after ``import lightning``, the least a rank of Lightning's DDP strategy holds (the private children import
  ``lightning_privdec``, whose strategies import Lightning: ~300 MiB of the resident set before any tensor).
* ``--noise``: nanoseconds per coordinate of ``NoiseGenerator.normal`` (float32, 9.7M coordinates) with 1 and 2
  intra-op threads, with the machine as it is and with one busy-looping process beside it, in wall-clock and in
  process CPU time (on a loaded machine the CPU time is the generator's own work); ``torch.randn`` alongside.

Each timing is the median of ``--steps`` steps after ``--warmup`` in wall-clock and in process CPU time (on a
loaded machine the CPU time says more; with one intra-op thread it is the step's own work); the baseline is always
measured in the same run.
The tables are printed and, unless ``--no-record``, appended to ``benchmarks/RESULTS.md``.

    python benchmarks/private_step.py                      # step times, memory and noise
    python benchmarks/private_step.py --configs sgd,dp_csgp_randk0.1 --no-memory --no-noise --no-record
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WIDE_HIDDEN, INPUTS, CLASSES, BATCH, SHARD = 3072, 64, 10, 32, 1024
NODES, TOPOLOGY, NODE = 8, "exponential-one-peer", 0
CONFIGS = ("sgd", "privsgp", "dp_csgp_randk0.1", "dp_csgp_qsgd8")
COMPRESSORS = {"privsgp": None, "dp_csgp_randk0.1": "randk:0.1", "dp_csgp_qsgd8": "qsgd:8"}
GAMMA = {"privsgp": 1.0, "dp_csgp_randk0.1": 0.05, "dp_csgp_qsgd8": 0.5}  # network.py's consensus steps


def build_net(width: int):  # noqa: ANN201
    from torch import nn

    return nn.Sequential(nn.Linear(INPUTS, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, CLASSES))


class EchoExchange:
    """An exchange for one node that returns, as each in-neighbour's message, a copy of the message it sent."""

    def __new__(cls, rank: int, world_size: int):  # noqa: ANN204
        from lightning_privdec.comm.base import Exchange

        class _Echo(Exchange):
            def exchange(self, outgoing, incoming):  # noqa: ANN001, ANN202
                self._check_peers(outgoing, incoming)
                message = next(iter(outgoing.values()))
                if not hasattr(self, "_buffers") or [t.shape for t in self._buffers] != [t.shape for t in message]:
                    self._buffers = [t.clone() for t in message]  # receive buffers, reused as the real exchanges do
                for buffer, t in zip(self._buffers, message):
                    buffer.copy_(t)
                return {peer: list(self._buffers) for peer in incoming}

        return _Echo(rank, world_size)


FAULTS: list[int] = []  # minor page faults of the process when each step ended
CPU: list[float] = []  # process CPU seconds of each step


def _record(times: list[float], start: float, cpu_start: float) -> None:
    times.append(time.perf_counter() - start)
    CPU.append(time.process_time() - cpu_start)
    FAULTS.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


def run_steps(config: str, steps: int, warmup: int, width: int, seed: int = 0) -> list[float]:
    """Seconds per step of ``config`` (``steps`` after ``warmup``); :data:`FAULTS` gets the page-fault counts."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    model = build_net(width)
    data = TensorDataset(torch.randn(SHARD, INPUTS), torch.randint(0, CLASSES, (SHARD,)))
    times: list[float] = []
    if config in ("sgd", "ddp", "ddp_lightning"):
        net: torch.nn.Module = model
        if config == "ddp_lightning":
            import lightning  # noqa: F401
        if config != "sgd":
            import torch.distributed as dist

            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
            dist.init_process_group("gloo", rank=0, world_size=1)
            net = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
        while len(times) < steps + warmup:
            for x, y in loader:
                start, cpu_start = time.perf_counter(), time.process_time()
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(net(x), y).backward()
                optimizer.step()
                _record(times, start, cpu_start)
                if len(times) == steps + warmup:
                    break
        return times[warmup:]

    from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
    from lightning_privdec.algorithms.node import NodeRunner
    from lightning_privdec.algorithms.flat_parameters import FlatParameters
    from lightning_privdec.compression import build_compressor
    from lightning_privdec.privacy.config import PrivacyParameters
    from lightning_privdec.topology import build_topology

    node = DPCSGPNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0), rank=NODE,
                      device=torch.device("cpu"))
    node.attach(model)
    flat = FlatParameters(model)
    topology = build_topology(TOPOLOGY, NODES)
    gossip = node.build_gossip(
        flat.buffer, rank=NODE, topology=topology, exchange=EchoExchange(NODE, NODES),
        compressor=build_compressor(COMPRESSORS[config]), push_sum_weight=True, seed=seed,
        consensus_step=GAMMA[config], staleness=0,
    )
    optimizer = torch.optim.SGD(flat.parameters, lr=0.01)
    loader = node.private_dataloader(DataLoader(data, batch_size=BATCH), steps + warmup, NODES, node_local_data=True)
    runner = NodeRunner(model, flat, gossip, node, rank=NODE)  # the step the Trainer's strategies run
    while len(times) < steps + warmup:
        for x, y in loader:
            start, cpu_start = time.perf_counter(), time.process_time()
            optimizer.zero_grad(set_to_none=True)

            def gradients(x: Any = x, y: Any = y) -> Any:
                if len(x):
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    return loss
                return None

            runner.step(optimizer, gradients, step=len(times))
            _record(times, start, cpu_start)
            if len(times) == steps + warmup:
                break
    return times[warmup:]


def noise_ns_per_coordinate(
    threads: int, numel: int, repeats: int = 5
) -> tuple[tuple[float, float | None, float], tuple[float, float | None, float]]:
    """ns per float32 coordinate, medians over ``repeats``, in wall-clock and in process CPU time:
    ``NoiseGenerator.normal`` (reused output), its ``add_normal_`` into a gradient-sized list as the DP step does
    (None where the library has none) and ``torch.randn``."""
    import torch

    from lightning_privdec.privacy.noise import node_noise_generator

    torch.set_num_threads(threads)
    generator = node_noise_generator("cpu", None, 0)
    model = build_net(WIDE_HIDDEN)
    grads = [torch.zeros_like(p) for p in model.parameters()]
    assert sum(g.numel() for g in grads) == numel
    out = torch.empty(numel)
    calls = [lambda: generator.normal(numel, 1.0, torch.float32, reuse_output=True),
             (lambda: generator.add_normal_(grads, 1.0, grads, 0.5)) if hasattr(generator, "add_normal_") else None,
             lambda: torch.randn(numel, out=out)]
    wall: list[list[float]] = [[] for _ in calls]
    cpu: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats + 1):
        for call, w, c in zip(calls, wall, cpu):
            if call is not None:
                start, cpu_start = time.perf_counter(), time.process_time()
                call()
                w.append(time.perf_counter() - start)
                c.append(time.process_time() - cpu_start)

    def per(times: list[list[float]]) -> tuple[float, float | None, float]:
        values = [statistics.median(t[1:]) / numel * 1e9 if t else None for t in times]
        return values[0], values[1], values[2]  # type: ignore[return-value]

    return per(wall), per(cpu)


def randk_draw_and_read_ms(d: int, repeats: int = 15) -> tuple[float, float]:
    """(a received RandK(0.1) message's draw of its kept coordinates, reading it: adding its k values into the
    sender's public copy, which includes the draw), medians in ms, one thread."""
    import torch

    from lightning_privdec.compression import RandK

    torch.set_num_threads(1)
    compressor = RandK(0.1)
    k = compressor.num_kept(d)
    if hasattr(compressor, "pieces"):  # the rotated comb: the draw is one keystream word and the comb's blocks
        draw = lambda key: compressor.pieces(d, key)  # noqa: E731
    else:  # one index per kept coordinate
        draw = lambda key: compressor.indices(d, key)  # noqa: E731
    copy, wire = torch.zeros(d), torch.randn(k)
    draws, reads = [], []
    for key in range(repeats + 1):
        start = time.perf_counter()
        draw(1000 + key)
        draws.append(time.perf_counter() - start)
        start = time.perf_counter()
        compressor.decode_add_([wire], copy, 1000 + key)
        reads.append(time.perf_counter() - start)
    return statistics.median(draws[1:]) * 1e3, statistics.median(reads[1:]) * 1e3


def _busy(stop) -> None:  # noqa: ANN001
    while not stop.is_set():
        pass


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    times = run_steps(args.child, args.steps, args.warmup, args.width)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    faults = (FAULTS[-1] - FAULTS[args.warmup - 1]) / args.steps  # the timed steps (a 4 KiB page each)
    print(json.dumps({"config": args.child, "median_ms": statistics.median(times) * 1e3, "peak_rss_mib": peak_mib,
                      "faults": faults, "cpu_ms": statistics.median(CPU[args.warmup:]) * 1e3}))


def run_child(config: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", config, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--width", str(args.width), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=WIDE_HIDDEN)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--noise", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--record", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # this checkout's library, as in the children
    from machine_info import append_results, machine_line, software_line

    configs = args.configs.split(",")
    lines = [f"Command: `python benchmarks/private_step.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
             f"load average before: {os.getloadavg()[0]:.1f}", ""]
    rows = {config: run_child(config, args)
            for config in (configs + (["ddp", "ddp_lightning"] if args.memory else []))}
    base = rows.get("sgd")
    lines += [("| step | median ms | / non-private | CPU ms | / non-private | peak RSS MiB | / DDP | / DDP with "
               "Lightning imported | page faults per step |"), "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(value: float, reference: dict | None, key: str) -> str:
        return f"{value / reference[key]:.2f}x" if reference else "n/a"

    for config, row in rows.items():
        lines.append(
            f"| {config} | {row['median_ms']:.1f} | {ratio(row['median_ms'], base, 'median_ms')} | "
            f"{row['cpu_ms']:.1f} | {ratio(row['cpu_ms'], base, 'cpu_ms')} | {row['peak_rss_mib']:.0f} | "
            f"{ratio(row['peak_rss_mib'], rows.get('ddp'), 'peak_rss_mib')} | "
            f"{ratio(row['peak_rss_mib'], rows.get('ddp_lightning'), 'peak_rss_mib')} | {row['faults']:.0f} |"
        )
    if args.noise:
        import torch

        numel = 9_670_666
        lines += ["", f"Noise: ns per float32 coordinate, {numel:,} coordinates (the wide MLP's gradients), median "
                  "of 5, wall-clock (process CPU time): NoiseGenerator.normal (reused output) / add_normal_ into the "
                  "gradients (the DP step's path; n/a before it existed) / torch.randn", "",
                  "| threads | machine as is | one busy process beside |", "|---:|---:|---:|"]
        results = {}
        for busy in (False, True):
            stop = multiprocessing.Event()
            spinner = multiprocessing.Process(target=_busy, args=(stop,)) if busy else None
            if spinner:
                spinner.start()
            try:
                for threads in (1, 2):
                    results[(threads, busy)] = noise_ns_per_coordinate(threads, numel)
            finally:
                if spinner:
                    stop.set()
                    spinner.join()
        torch.set_num_threads(args.threads)

        def cell(values: tuple) -> str:  # noqa: ANN001
            wall, cpu = values
            return " / ".join("n/a" if w is None else f"{w:.2f} ({c:.2f})" for w, c in zip(wall, cpu))

        for threads in (1, 2):
            lines.append(f"| {threads} | {cell(results[(threads, False)])} | {cell(results[(threads, True)])} |")
    draw, read = randk_draw_and_read_ms(9_670_666)
    lines += ["", f"RandK(0.1) on d = 9,670,666 (k = 967,066), one thread: a received message's index draw {draw:.1f} ms, "
              f"reading it (decode_add_: the draw and its k values added into the copy) {read:.1f} ms."]
    lines.append(f"\nLoad average after: {os.getloadavg()[0]:.1f}. {machine_line()} {software_line()}")
    text = "\n".join(lines)
    print(text)
    if args.record:
        import datetime

        header = f"\n## private_step.py — {datetime.date.today().isoformat()}\n\n"
        append_results(header + text + "\n", ROOT / "benchmarks" / "RESULTS.md")


if __name__ == "__main__":
    main()
