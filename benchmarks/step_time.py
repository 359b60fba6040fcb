"""Per-step wall time and bytes on the wire: Lightning DDP vs push-sum gossip, on N CPU processes.

What it measures
----------------
The same model (an MLP, 784-H-H/2-10, about 1.3M parameters with the default H=1024), the same synthetic data
(fixed seed, batch 64 per process) and the same optimizer (plain SGD) are trained for ``--warmup + --steps`` steps
under five strategies, each in its own fresh N-process Lightning run (gloo on CPU):

    ddp        Lightning's DDPStrategy (gradient all-reduce)
    push_sum   DecentralizedPushSumStrategy("exponential-one-peer"), uncompressed
    randk      ... with RandK(0.1)
    topk       ... with TopK(0.01)
    qsgd       ... with QSGD(8)

For every rank a callback takes ``time.perf_counter()`` at ``on_train_batch_start`` and ``on_train_batch_end``
(forward + backward + optimizer step + gossip; data loading excluded), drops the first ``--warmup`` steps and keeps
the median of the rest. The table shows rank 0's median, the maximum of the ranks' medians, and both as a ratio to
the DDP run of the same invocation. For push-sum runs it also reports the median time spent inside
``strategy.gossip.step`` (compression + exchange + mixing) and inside the exchange itself.

Bytes per node per step are *measured* for push-sum (``strategy.gossip.exchange.traffic``: bytes_sent / rounds,
averaged over ranks) and compared with the stated size ``out_degree x (compressor.encoded_nbytes(d) + 8)`` (8 bytes:
the float64 push-sum weight; dense: 4d + 8). For DDP the ring all-reduce volume ``2 (N-1)/N x 4d`` is shown as an
*estimate*: it is not measured (gloo picks its own algorithm).

Targets (from the issue): uncompressed push-sum no slower than 1.2x DDP; measured bytes within 5% of the stated size.

How to run
----------
    python benchmarks/step_time.py                      # all five configs, 4 processes, 10 warm-up + 100 steps
    python benchmarks/step_time.py --configs ddp,push_sum --steps 200 --json results.json
    python benchmarks/step_time.py --hidden 2048        # a bigger model (about 3.7M parameters)
    python benchmarks/step_time.py --repeats 3          # interleaved repeats, medians over runs (less noise)

The parent process never builds a Trainer: it re-runs this file as a child with ``--config NAME --out FILE`` for
each configuration; Lightning's subprocess launcher then starts ranks 1..N-1 of that child. Every rank uses
``torch.set_num_threads(1)``. With 4 processes on a 2-core machine the timings are noisy and include CPU contention
between ranks (each rank gets about half a core), and whatever else runs on the machine shifts them further;
compare ratios within one invocation only, and use ``--repeats`` when the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

CONFIGS: dict[str, str | None] = {  # name -> compressor spec; "ddp" is Lightning's own strategy
    "ddp": None,
    "push_sum": None,
    "randk": "randk:0.1",
    "topk": "topk:0.01",
    "qsgd": "qsgd:8",
}
LABELS = {
    "ddp": "DDP",
    "push_sum": "push-sum (uncompressed)",
    "randk": "push-sum + RandK(0.1)",
    "topk": "push-sum + TopK(0.01)",
    "qsgd": "push-sum + QSGD(8)",
}
TOPOLOGY = "exponential-one-peer"
INPUT_DIM, NUM_CLASSES = 784, 10
WEIGHT_BYTES = 8  # the push-sum weight y travels as one float64
TIME_TARGET, BYTES_TOLERANCE = 1.2, 0.05


# ---------------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100, help="timed steps per run (after warm-up)")
    parser.add_argument("--warmup", type=int, default=10, help="steps dropped before timing")
    parser.add_argument("--devices", type=int, default=4, help="CPU processes per run")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list out of {','.join(CONFIGS)}")
    parser.add_argument("--hidden", type=int, default=1024, help="first hidden width H of the MLP 784-H-H/2-10")
    parser.add_argument("--batch-size", type=int, default=64, help="per process")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs per config, interleaved; medians are reported")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for one configuration")
    parser.add_argument("--json", type=Path, default=None, help="also write all results to this file")
    # internal: one configuration in one Lightning run (set by the parent)
    parser.add_argument("--config", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.config_list = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.config_list + ([args.config] if args.config else []) if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}; choose from {list(CONFIGS)}")
    if args.steps < 1 or args.warmup < 0 or args.devices < 2 or args.repeats < 1:
        parser.error("need --steps >= 1, --warmup >= 0, --devices >= 2 and --repeats >= 1")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# child: one configuration, one N-process Lightning run (this code runs on every rank)
# ---------------------------------------------------------------------------------------------------------------------
def build_model(hidden: int, lr: float = 0.01):  # noqa: ANN201
    import lightning as L
    import torch
    from torch import nn

    class MLP(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Linear(INPUT_DIM, hidden),
                nn.ReLU(),
                nn.Linear(hidden, hidden // 2),
                nn.ReLU(),
                nn.Linear(hidden // 2, NUM_CLASSES),
            )

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            inputs, targets = batch
            return nn.functional.cross_entropy(self.net(inputs), targets)  # nothing logged: no extra collectives

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=lr)

    return MLP()


def build_loader(batch_size: int, devices: int, batches_per_epoch: int, seed: int):  # noqa: ANN201
    """Synthetic, learnable data: random inputs labelled by a fixed random linear map (identical on every rank)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    gen = torch.Generator().manual_seed(seed)
    n = batch_size * devices * batches_per_epoch
    inputs = torch.randn(n, INPUT_DIM, generator=gen)
    targets = (inputs @ torch.randn(INPUT_DIM, NUM_CLASSES, generator=gen)).argmax(dim=1)
    # Lightning adds a DistributedSampler: each rank sees batches_per_epoch distinct batches per epoch.
    return DataLoader(TensorDataset(inputs, targets), batch_size=batch_size, shuffle=True, drop_last=True)


def build_strategy(config: str):  # noqa: ANN201
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_privdec import DecentralizedPushSumStrategy

    if config == "ddp":
        return DDPStrategy()
    return DecentralizedPushSumStrategy(topology=TOPOLOGY, compressor=CONFIGS[config], seed=0)


def _timed(fn, record: list[float]):  # noqa: ANN001, ANN202
    """Wrap ``fn`` so that every call appends its wall time (seconds) to ``record``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)

    return wrapper


def make_step_timer(warmup: int):  # noqa: ANN201
    """A Callback timing every training batch on this rank, plus the gossip round and the exchange inside it."""
    from lightning.pytorch.callbacks import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.steps: list[float] = []
            self.gossip: list[float] = []
            self.exchange: list[float] = []
            # batch start -> next batch start: the step plus data loading and Lightning's per-step SIGTERM broadcast
            self.iterations: list[float] = []
            self._start: float | None = None

        def on_train_start(self, trainer, pl_module) -> None:  # noqa: ANN001
            gossip = getattr(trainer.strategy, "gossip", None)
            if gossip is not None:  # instance attributes shadow the methods; the library is untouched
                gossip.step = _timed(gossip.step, self.gossip)
                gossip.exchange.exchange = _timed(gossip.exchange.exchange, self.exchange)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            now = time.perf_counter()
            if self._start is not None:
                self.iterations.append(now - self._start)
            self._start = now

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            self.steps.append(time.perf_counter() - self._start)

        def summary(self) -> dict[str, Any]:
            def median_ms(values: list[float]) -> float | None:
                kept = values[warmup:]
                return 1e3 * statistics.median(kept) if kept else None

            return {
                "median_step_ms": median_ms(self.steps),
                "median_gossip_ms": median_ms(self.gossip),
                "median_exchange_ms": median_ms(self.exchange),
                "median_iteration_ms": median_ms(self.iterations),
                "timed_steps": max(0, len(self.steps) - warmup),
            }

    return StepTimer()


def expected_push_sum_bytes(strategy: Any, rank: int, d: int) -> float:
    """Stated bytes per node per round: mean out-degree over one period x (payload + push-sum weight)."""
    topology = strategy.topology
    out_degree = statistics.mean(len(topology.out_peers(rank, k)) for k in range(topology.period))
    dtype = strategy.flat.buffer.dtype
    itemsize = strategy.flat.buffer.element_size()
    payload = itemsize * d if strategy.compressor is None else strategy.compressor.encoded_nbytes(d, dtype)
    return out_degree * (payload + WEIGHT_BYTES)


def rank_result(trainer: Any, timer: Any, d: int) -> dict[str, Any]:
    """Everything this rank measured."""
    result = {"rank": trainer.global_rank, "global_step": trainer.global_step, **timer.summary()}
    gossip = getattr(trainer.strategy, "gossip", None)
    if gossip is not None:
        traffic = gossip.exchange.traffic
        result.update(
            bytes_sent=traffic.bytes_sent,
            bytes_received=traffic.bytes_received,
            rounds=traffic.rounds,
            expected_bytes_per_step=expected_push_sum_bytes(trainer.strategy, trainer.global_rank, d),
        )
    return result


def run_child(args: argparse.Namespace) -> None:
    """One configuration on args.devices processes; rank 0 writes every rank's results to args.out."""
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # num_workers, logger and sampler hints would bury the numbers
    import lightning as L
    import torch.distributed as dist

    L.seed_everything(args.seed, verbose=False)
    model = build_model(args.hidden)
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    timer = make_step_timer(args.warmup)
    total_steps = args.warmup + args.steps
    loader = build_loader(args.batch_size, args.devices, min(total_steps, 32), args.seed)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=build_strategy(args.config),
        max_steps=total_steps,
        max_epochs=-1,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, train_dataloaders=loader)

    mine = rank_result(trainer, timer, d)
    ranks: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(ranks, mine)  # after training: not part of any timed step
    if trainer.global_rank == 0:
        out = {"config": args.config, "devices": trainer.world_size, "num_params": d, "ranks": ranks}
        args.out.write_text(json.dumps(out, indent=1))


# ---------------------------------------------------------------------------------------------------------------------
# parent: run every configuration, then summarise
# ---------------------------------------------------------------------------------------------------------------------
def run_config(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """Launch one child run (fresh processes) and return its JSON results."""
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        out = Path(tmp) / f"{config}.json"
        cmd = [
            sys.executable, os.path.abspath(__file__),
            "--config", config, "--out", str(out),
            "--devices", str(args.devices), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--hidden", str(args.hidden), "--batch-size", str(args.batch_size), "--seed", str(args.seed),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise RuntimeError(f"config {config!r} failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out.read_text())
    result["wall_s"] = elapsed
    return result


def summarise_run(result: dict[str, Any]) -> dict[str, Any]:
    """Reduce the per-rank numbers of one run to the table's columns."""
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    n, d = result["devices"], result["num_params"]
    summary = {
        "config": result["config"],
        "rank0_ms": ranks[0]["median_step_ms"],
        "max_rank_ms": max(r["median_step_ms"] for r in ranks),
        "per_rank_ms": [r["median_step_ms"] for r in ranks],
        "gossip_ms": ranks[0].get("median_gossip_ms"),
        "exchange_ms": ranks[0].get("median_exchange_ms"),
        "iteration_ms": ranks[0].get("median_iteration_ms"),
        "wall_s": result["wall_s"],
        "runs_rank0_ms": [ranks[0]["median_step_ms"]],
    }
    if result["config"] == "ddp":
        summary.update(measured_bytes=None, expected_bytes=2 * (n - 1) / n * 4 * d)
    else:
        summary.update(
            measured_bytes=statistics.mean(r["bytes_sent"] / r["rounds"] for r in ranks),
            expected_bytes=statistics.mean(r["expected_bytes_per_step"] for r in ranks),
        )
    return summary


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row per configuration: the median over repeats of each run's numbers (bytes do not vary)."""
    per_run = [summarise_run(r) for r in runs]
    summary = dict(per_run[0])
    for key in ("rank0_ms", "max_rank_ms", "gossip_ms", "exchange_ms", "iteration_ms"):
        summary[key] = _median_or_none([s[key] for s in per_run])
    summary["per_rank_ms"] = [statistics.median(column) for column in zip(*(s["per_rank_ms"] for s in per_run))]
    summary["wall_s"] = sum(s["wall_s"] for s in per_run)
    summary["runs_rank0_ms"] = [s["rank0_ms"] for s in per_run]
    return summary


def machine_description(args: argparse.Namespace) -> list[str]:
    import lightning
    import torch

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or cpu
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"machine: {cpu}, {cores} usable cores ({os.cpu_count()} logical); {platform.platform()}",
        f"software: python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}",
        f"setup: {args.devices} CPU processes (gloo), torch.set_num_threads(1) per rank, MLP 784-{args.hidden}-"
        f"{args.hidden // 2}-10, batch {args.batch_size}/process, SGD, topology {TOPOLOGY}, "
        f"{args.warmup} warm-up + {args.steps} timed steps",
    ]


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _bytes_cells(s: dict[str, Any]) -> tuple[str, str, str]:
    if s["measured_bytes"] is None:
        return "not measured", f"{s['expected_bytes']:,.0f} (estimated, ring)", "n/a"
    diff = (s["measured_bytes"] - s["expected_bytes"]) / s["expected_bytes"]
    verdict = "PASS" if abs(diff) <= BYTES_TOLERANCE else "FAIL"
    return f"{s['measured_bytes']:,.0f}", f"{s['expected_bytes']:,.0f}", f"{100 * diff:+.2f}% {verdict}"


def format_report(summaries: list[dict[str, Any]], num_params: int, devices: int) -> list[str]:
    ddp = next((s for s in summaries if s["config"] == "ddp"), None)
    lines = [
        f"model parameters d = {num_params:,}; bytes are per node per step",
        "",
        "| config | median step ms (rank0) | max-over-ranks median ms | ratio to DDP (rank0 / max) "
        "| bytes/node/step measured | expected | diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        if ddp is not None:
            ratio = f"{s['rank0_ms'] / ddp['rank0_ms']:.2f}x / {s['max_rank_ms'] / ddp['max_rank_ms']:.2f}x"
        else:
            ratio = "n/a (no ddp run)"
        measured, expected, diff = _bytes_cells(s)
        lines.append(
            f"| {LABELS[s['config']]} | {s['rank0_ms']:.1f} | {s['max_rank_ms']:.1f} | {ratio} "
            f"| {measured} | {expected} | {diff} |"
        )
    lines += [
        "",
        "Details. Step = on_train_batch_start -> on_train_batch_end. Iteration = batch start -> next batch start, i.e."
        " the step plus data loading and Lightning's per-step SIGTERM broadcast (a global collective).",
        "",
        "| config | per-rank median step ms | rank0 iteration ms | rank0 gossip.step ms | of which exchange ms "
        "| run wall s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for s in summaries:
        per_rank = ", ".join(f"{v:.1f}" for v in s["per_rank_ms"])
        gossip = _fmt(s["gossip_ms"], ".1f") if s["gossip_ms"] is not None else "n/a (all-reduce in backward)"
        lines.append(
            f"| {s['config']} | {per_rank} | {_fmt(s['iteration_ms'], '.1f')} | {gossip} "
            f"| {_fmt(s['exchange_ms'], '.1f')} | {s['wall_s']:.1f} |"
        )
    lines += ["", *target_lines(summaries, ddp)]
    lines.append(
        f"note: {devices} processes share {len(os.sched_getaffinity(0))} cores here, so ranks pre-empt each other; "
        "step times carry CPU contention, and load from other work on the machine can move a run by tens of percent. "
        "Compare ratios within one invocation; --repeats N interleaves N runs per config and reports medians."
    )
    return lines


def target_lines(summaries: list[dict[str, Any]], ddp: dict[str, Any] | None) -> list[str]:
    lines = []
    push_sum = next((s for s in summaries if s["config"] == "push_sum"), None)
    if ddp is not None and push_sum is not None:
        ratio = push_sum["rank0_ms"] / ddp["rank0_ms"]
        worst = push_sum["max_rank_ms"] / ddp["max_rank_ms"]
        verdict = "MET" if ratio <= TIME_TARGET else "NOT MET"
        lines.append(
            f"uncompressed push-sum / DDP = {ratio:.2f}x (target <= {TIME_TARGET}x): {verdict}"
            f"   [max-over-ranks medians: {worst:.2f}x]"
        )
        if len(push_sum["runs_rank0_ms"]) > 1:
            ratios = ", ".join(f"{p / q:.2f}x" for p, q in zip(push_sum["runs_rank0_ms"], ddp["runs_rank0_ms"]))
            lines.append(f"  per repeat (rank0): {ratios}")
    for s in summaries:
        if s["measured_bytes"] is not None:
            diff = (s["measured_bytes"] - s["expected_bytes"]) / s["expected_bytes"]
            verdict = "MET" if abs(diff) <= BYTES_TOLERANCE else "NOT MET"
            lines.append(
                f"{LABELS[s['config']]}: measured bytes within {100 * BYTES_TOLERANCE:.0f}% of stated size "
                f"({100 * diff:+.2f}%): {verdict}"
            )
    return lines


def run_parent(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    for line in machine_description(args):
        print(line, flush=True)
    results: dict[str, list[dict[str, Any]]] = {config: [] for config in args.config_list}
    for repeat in range(args.repeats):  # interleaved, so slow drifts in machine load hit every config alike
        for config in args.config_list:
            label = config if args.repeats == 1 else f"{config} (repeat {repeat + 1}/{args.repeats})"
            print(f"running {label} ...", end=" ", flush=True)
            results[config].append(run_config(config, args))
            print(f"{results[config][-1]['wall_s']:.1f}s", flush=True)
    summaries = [summarise(runs) for runs in results.values()]
    num_params = results[args.config_list[0]][0]["num_params"]
    print()
    for line in format_report(summaries, num_params, args.devices):
        print(line)
    total = time.perf_counter() - started
    print(f"total wall time: {total:.1f}s")
    if args.json is not None:
        payload = {"machine": machine_description(args), "summaries": summaries, "raw": results, "total_s": total}
        args.json.write_text(json.dumps(payload, indent=1))
        print(f"results written to {args.json}")


def main() -> None:
    args = parse_args()
    if args.config is not None:
        if args.out is None:
            raise SystemExit("--config needs --out")
        run_child(args)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
