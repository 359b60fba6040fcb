"""Scaling with the number of processes: step time and bytes per node, push-sum (exponential-one-peer) vs DDP.

What it measures
----------------
For every world size in ``--world-sizes`` (default 2, 4, 8) and both configurations

    ddp        Lightning's DDPStrategy (gradient all-reduce)
    push_sum   DecentralizedPushSumStrategy("exponential-one-peer"), uncompressed

a fresh N-process Lightning run trains the MLP of ``benchmarks/step_time.py`` (784-H-H/2-10, about 1.3M parameters
with H = 1024) on its synthetic data, batch 64 per process, plain SGD. The model, data, per-step timing callback and
stated message size are step_time.py's (imported, not copied): step = ``on_train_batch_start`` ->
``on_train_batch_end`` (forward + backward + optimizer step + gossip or all-reduce), median over the timed steps
after ``--warmup``. The table gives rank 0's median, the largest of the ranks' medians, and bytes per node per step:
measured by the exchange for push-sum; for DDP the ring all-reduce volume 2 (N-1)/N x 4d, an estimate (DDP's traffic
is not observable from Python).

On CPU (``--device cpu``, gloo) all N processes share this machine's cores: when N exceeds the core count the numbers
measure CPU contention, not network scaling. ``--device cuda`` runs the same with NCCL, one GPU per rank; a world
size larger than the number of visible GPUs cannot run (NCCL >= 2.5 refuses two ranks of one communicator on the
same GPU with ``ncclInvalidUsage: Duplicate GPU detected``); ``--probe-shared-gpu`` records what NCCL answers when
N ranks are put on GPU 0 anyway.

    python benchmarks/scaling.py                                   # CPU, N = 2, 4, 8
    python benchmarks/scaling.py --world-sizes 2,4 --steps 50
    python benchmarks/scaling.py --device cuda --probe-shared-gpu  # on a GPU machine

Prints the table, writes ``benchmarks/scaling.png`` and appends the table with this machine's description to
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

import step_time  # noqa: E402  (benchmarks/step_time.py: model, data, strategies, timer, per-rank results)
from machine_info import append_results, machine_line, software_line, usable_cores  # noqa: E402

CONFIGS = ("ddp", "push_sum")
LABELS = {"ddp": "DDP (all-reduce)", "push_sum": f"push-sum ({step_time.TOPOLOGY})"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-sizes", default="2,4,8", help="comma list of process counts")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: gloo; cuda: NCCL, one GPU per rank")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (after warm-up)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--hidden", type=int, default=1024, help="first hidden width H of step_time.py's MLP")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs per cell, interleaved; medians are reported")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for one run")
    p.add_argument("--probe-shared-gpu", action="store_true",
                   help="cuda: also try N NCCL ranks on GPU 0 and record the outcome")  # fmt: skip
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "scaling.png")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    p.add_argument("--no-append", action="store_true", help="do not append to RESULTS.md")
    p.add_argument("--config", default=None, choices=CONFIGS, help=argparse.SUPPRESS)  # internal: child run
    p.add_argument("--devices", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.world_size_list = sorted({int(v) for v in args.world_sizes.split(",") if v.strip()})
    except ValueError:
        p.error(f"--world-sizes must be a comma list of integers, e.g. 2,4,8; got {args.world_sizes!r}")
    if not args.world_size_list or min(args.world_size_list) < 2:
        p.error("every world size must be at least 2 (one process has nobody to talk to)")
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
        p.error("need --steps >= 1, --warmup >= 0 and --repeats >= 1")
    return args


# ---------------------------------------------------------------------------------------------------------------------
# child: one configuration on N processes (runs on every rank)
# ---------------------------------------------------------------------------------------------------------------------
def build_strategy(config: str):  # noqa: ANN201
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_privdec import DecentralizedPushSumStrategy

    return DDPStrategy() if config == "ddp" else DecentralizedPushSumStrategy(topology=step_time.TOPOLOGY, seed=0)


def run_child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import lightning as L
    import torch.distributed as dist

    L.seed_everything(args.seed, verbose=False)
    model = step_time.build_model(args.hidden)
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    timer = step_time.make_step_timer(args.warmup)
    total = args.warmup + args.steps
    trainer = L.Trainer(
        accelerator="gpu" if args.device == "cuda" else "cpu",  # Lightning picks NCCL on GPUs, gloo on CPU
        devices=args.devices, strategy=build_strategy(args.config), max_steps=total, max_epochs=-1,
        callbacks=[timer], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    loader = step_time.build_loader(args.batch_size, args.devices, min(total, 32), args.seed)
    trainer.fit(model, train_dataloaders=loader)
    mine = {"rank": trainer.global_rank, **timer.summary()}
    gossip = getattr(trainer.strategy, "gossip", None)
    if gossip is not None:  # bytes counted by the exchange, and the stated size (payload + push-sum weight)
        traffic = gossip.exchange.traffic
        mine.update(bytes_per_step=traffic.bytes_sent / max(1, traffic.rounds),
                    expected_bytes=step_time.expected_push_sum_bytes(trainer.strategy, trainer.global_rank, d))
    ranks: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(ranks, mine)  # after training: outside every timed step
    if trainer.global_rank == 0:
        backend = dist.get_backend()
        args.out.write_text(json.dumps({"config": args.config, "devices": trainer.world_size, "num_params": d,
                                        "backend": backend, "ranks": ranks}))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()  # a clean shutdown: gloo can abort at interpreter exit otherwise


# ---------------------------------------------------------------------------------------------------------------------
# NCCL with several ranks on one GPU: what does it answer?
# ---------------------------------------------------------------------------------------------------------------------
def _shared_gpu_rank(rank: int, world: int, port: int, out: str) -> None:
    import datetime as dt

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=dt.timedelta(seconds=60))
        value = torch.ones(1, device="cuda:0")
        dist.all_reduce(value)
        torch.cuda.synchronize()
        answer = f"all_reduce returned {value.item():g} (expected {world})"
        dist.destroy_process_group()
    except Exception as exc:  # the outcome is the measurement
        answer = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    Path(out, f"rank{rank}.txt").write_text(answer)


def probe_shared_gpu(world: int, timeout: float = 120.0) -> str:
    """Start ``world`` NCCL ranks all on cuda:0 and report rank 0's outcome (an error, a hang, or a result)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="nccl_probe_") as tmp:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_shared_gpu_rank, args=(r, world, port, tmp)) for r in range(world)]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        answer = Path(tmp, "rank0.txt")
        outcome = answer.read_text() if answer.exists() else "no answer from rank 0"
    return outcome + (f" (ranks {hung} still running after {timeout:.0f}s, killed)" if hung else "")


# ---------------------------------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------------------------------
def run_one(config: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="scaling_") as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--config", config, "--devices", str(n),
               "--device", args.device, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--hidden", str(args.hidden), "--batch-size", str(args.batch_size), "--seed", str(args.seed)]  # fmt: skip
        result, elapsed = step_time._run_child(cmd, Path(tmp) / "result.json", f"{config} on {n} processes",
                                               args.timeout)
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    d = result["num_params"]
    summary = {
        "config": config, "devices": n, "num_params": d, "backend": result["backend"], "wall_s": elapsed,
        "rank0_ms": ranks[0]["median_step_ms"], "max_rank_ms": max(r["median_step_ms"] for r in ranks),
        "measured_bytes": None, "expected_bytes": 2 * (n - 1) / n * 4 * d,  # DDP: ring all-reduce estimate
    }  # fmt: skip
    if config == "push_sum":
        summary["measured_bytes"] = statistics.mean(r["bytes_per_step"] for r in ranks)
        summary["expected_bytes"] = statistics.mean(r["expected_bytes"] for r in ranks)
    return summary


def combine(cell: list[dict[str, Any]]) -> dict[str, Any]:
    """One table row from the repeats of one (N, config): medians of the step times, total wall time."""
    row = dict(cell[0])
    for key in ("rank0_ms", "max_rank_ms"):
        row[key] = statistics.median(r[key] for r in cell)
    row["wall_s"] = sum(r["wall_s"] for r in cell)
    row["repeats_rank0_ms"] = [r["rank0_ms"] for r in cell]
    return row


def format_table(rows: list[dict[str, Any]], skipped: dict[int, str]) -> list[str]:
    lines = [
        "| N | config | median step ms (rank 0) | max-over-ranks median ms | push-sum / DDP (rank 0) "
        "| bytes/node/step | source | wall s | per-run rank-0 ms |",
        "|---:|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in rows:
        ddp = next((r for r in rows if r["devices"] == row["devices"] and r["config"] == "ddp"), None)
        ratio = f"{row['rank0_ms'] / ddp['rank0_ms']:.2f}x" if ddp and row["config"] != "ddp" else ""
        if row["measured_bytes"] is None:
            nbytes, source = f"{row['expected_bytes']:,.0f}", "estimate 2(N-1)/N x 4d"
        else:
            nbytes, source = f"{row['measured_bytes']:,.0f}", f"measured (stated {row['expected_bytes']:,.0f})"
        lines.append(
            f"| {row['devices']} | {LABELS[row['config']]} | {row['rank0_ms']:.1f} | "
            f"{row['max_rank_ms']:.1f} | {ratio} | {nbytes} | {source} | {row['wall_s']:.0f} | "
            + ", ".join(f"{v:.1f}" for v in row.get("repeats_rank0_ms", [row["rank0_ms"]])) + " |"
        )
    for n, reason in skipped.items():
        lines.append(f"| {n} | both | not run | | | | {reason} | | |")
    return lines


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for config, color in zip(CONFIGS, ("tab:blue", "tab:orange")):
        mine = sorted((r for r in rows if r["config"] == config), key=lambda r: r["devices"])
        if not mine:
            continue
        ns = [r["devices"] for r in mine]
        label = LABELS[config]
        ax_t.plot(ns, [r["rank0_ms"] for r in mine], "o-", color=color, label=f"{label}, rank 0")
        ax_t.plot(ns, [r["max_rank_ms"] for r in mine], "s--", color=color, alpha=0.6, label=f"{label}, slowest rank")
        measured = mine[0]["measured_bytes"] is not None
        ax_b.plot(ns, [r["measured_bytes"] if measured else r["expected_bytes"] for r in mine], "o-" if measured else
                  "o--", color=color, label=f"{label} ({'measured' if measured else 'ring estimate'})")  # fmt: skip
    for ax in (ax_t, ax_b):
        ax.set_xscale("log", base=2)
        ax.set_xticks(args.world_size_list, [str(n) for n in args.world_size_list])
        ax.set_xlabel("processes N")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    d = rows[0]["num_params"] if rows else 0
    ax_t.set_ylabel("median step time (ms)")
    ax_t.set_title(f"step time, {args.device} ({rows[0]['backend'] if rows else ''}), MLP d = {d:,}", fontsize=10)
    ax_b.set_ylabel("bytes sent per node per step")
    ax_b.set_title("communication per node per step", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def main() -> None:
    args = parse_args()
    if args.config is not None:
        if args.out is None or args.devices is None:
            raise SystemExit("--config needs --devices and --out")
        run_child(args)
        return
    started = time.perf_counter()
    machine = [machine_line(), software_line()]
    for line in machine:
        print(line, flush=True)
    gpus, skipped, probes = 0, {}, {}
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise SystemExit("--device cuda: no CUDA device visible; run on a GPU machine or use --device cpu")
        print(f"GPUs visible: {gpus} ({torch.cuda.get_device_name(0)})", flush=True)
    runs: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):  # interleaved, so drifts in machine load hit every cell alike
        for n in args.world_size_list:
            if args.device == "cuda" and n > gpus:
                skipped[n] = f"needs {n} GPUs, {gpus} visible: NCCL allows one rank per GPU"
                if args.probe_shared_gpu and n not in probes:
                    probes[n] = probe_shared_gpu(n)
                    print(f"N={n} NCCL ranks on GPU 0: {probes[n]}", flush=True)
                continue
            for config in CONFIGS:
                print(f"[{repeat + 1}/{args.repeats}] {config} on {n} processes ...", end=" ", flush=True)
                run = run_one(config, n, args)
                runs.setdefault((n, config), []).append(run)
                print(f"{run['wall_s']:.0f}s: {run['rank0_ms']:.1f} ms/step (rank 0)", flush=True)
    rows = [combine(cell) for cell in runs.values()]
    total = time.perf_counter() - started
    cores = usable_cores()
    d = rows[0]["num_params"] if rows else None
    command = " ".join(["python benchmarks/scaling.py", *sys.argv[1:]])
    section = [
        f"\n## scaling.py — {datetime.date.today().isoformat()}, {args.device}, N = "
        f"{', '.join(map(str, args.world_size_list))}",
        "",
        f"Command: `{command}` (total wall time {total / 60:.1f} min). " + "; ".join(machine) + ".",
        "",
        f"Model: step_time.py's MLP 784-{args.hidden}-{args.hidden // 2}-10 (d = {d:,} parameters), synthetic data; "
        f"push-sum = DecentralizedPushSumStrategy on {step_time.TOPOLOGY}, uncompressed; DDP = Lightning's "
        f"DDPStrategy; batch {args.batch_size} per process, SGD, torch.set_num_threads(1) per rank, "
        f"{'gloo' if args.device == 'cpu' else 'NCCL'}. Medians over {args.steps} timed steps after {args.warmup} warm-up steps; "
        f"{args.repeats} interleaved run(s) per cell, median over runs (per-run rank-0 medians in the last column)."
        if d else "No run completed.",
        "",
        *format_table(rows, skipped),
        "",
    ]
    if args.device == "cpu":
        section.append(
            f"{cores} CPU cores here: with N > {cores} processes the ranks time-share the cores, so the growth of step "
            "time with N measures CPU contention (and whatever else runs on the machine), not network scaling. "
            "Bytes per node per step are the meaningful scaling figure: push-sum on a one-peer graph sends one "
            "model (4d + 8 bytes) per step at any N, while the ring all-reduce moves 2(N-1)/N x 4d."
        )
        import torch

        if not torch.cuda.is_available():
            section.append(
                "\nNCCL: not run here (no GPU on this machine); `--device cuda [--probe-shared-gpu]` runs the same "
                "table with one GPU per rank. Several NCCL ranks cannot share one GPU: since NCCL 2.5, "
                "ncclCommInitRank fails with ncclInvalidUsage ('Duplicate GPU detected : rank 1 and rank 0 both on "
                "CUDA device ...', NVIDIA/nccl issues 231 and 418; not measured here), so one GPU hosts N = 1 only."
            )
    for n, outcome in probes.items():
        section.append(f"\nN = {n} NCCL ranks on GPU 0 (probe): {outcome}")
    text = "\n".join(section) + "\n"
    print(text)
    if rows:
        plot(rows, args)
        print(f"plot: {args.plot}")
    if not args.no_append:
        append_results(text, args.results)
    if rows:
        by_n = {n: [r for r in rows if r["devices"] == n] for n in args.world_size_list}
        for n, pair in by_n.items():
            if len(pair) == 2:
                print(f"N={n}: push-sum/DDP step time {pair[1]['rank0_ms'] / pair[0]['rank0_ms']:.2f}x, bytes "
                      f"{pair[1]['measured_bytes'] / pair[0]['expected_bytes']:.2f}x of the all-reduce estimate")  # fmt: skip


if __name__ == "__main__":
    main()
