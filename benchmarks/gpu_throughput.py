"""Training throughput of ``examples/cifar_resnet.py --synthetic`` on one GPU: non-private push-sum vs each private
strategy.

What it measures
----------------
For each strategy, one run of the CIFAR example (GroupNorm ResNet-18, d = 11.2M, torchvision FakeData in CIFAR-10's
shape, no download) in its own process: ``--accelerator gpu --devices 1`` by default, ``--max-steps`` steps of
``--batch-size`` (Poisson-expected for private runs), the example's own per-strategy defaults (clip, lr, compressor,
target epsilon). The example reports the samples per second from the end of the first step to the end of training
(its ``Throughput`` callback); this script tabulates them against non-private push-sum on the same device, plots
them, and appends the table with the device's name to ``benchmarks/RESULTS.md``.

One GPU hosts one node: several NCCL ranks cannot share a GPU (see scaling.py), so on one GPU the gossip has no
neighbour and the numbers measure the per-node compute of each strategy (per-sample clipping, noise, compression,
PrivSGP-VR's table) on the GPU. ``--accelerator cpu`` runs the same table on CPU (a smoke run on machines without a
GPU).

    python benchmarks/gpu_throughput.py                          # every strategy, one GPU
    python benchmarks/gpu_throughput.py --accelerator cpu --max-steps 4 --batch-size 16 --no-append
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine_info import append_results, cpu_name, machine_line, software_line  # noqa: E402

NON_PRIVATE = "push_sum"
STRATEGIES = ("push_sum", "dp_csgp", "privsgp", "dyn_d2p", "privsgp_vr", "cpgt", "decor")
#: PrivSGP-VR keeps one clipped gradient per example of its shard (J x d): a zero-initialised table (no extra pass
#: before the first step) and room for it on the device; the default 2 GiB budget refuses ResNet-18 on any shard.
#: CPGT needs its noise decay and an assumed Lipschitz constant, and mini-batches need its "finite" accounting (the
#: whole-run accountings refuse a batch smaller than the shard).
EXTRA_KWARGS = {
    "privsgp_vr": {"table_init": "zeros", "max_table_bytes": 96 * 1024**3},
    "cpgt": {"noise_decay": 0.9, "lipschitz": 1.0, "accounting": "finite"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list out of " + ",".join(STRATEGIES))
    p.add_argument("--accelerator", default="gpu", help="gpu (default) or cpu")
    p.add_argument("--devices", type=int, default=1, help="processes (one GPU each; default 1)")
    p.add_argument("--max-steps", type=int, default=50, help="steps per run (the first is warm-up)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--synthetic-size", type=int, default=4096, help="FakeData training images (the node's shard)")
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=1800, help="seconds allowed for one run")
    p.add_argument("--plot", type=Path, default=ROOT / "benchmarks" / "gpu_throughput.png")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    p.add_argument("--no-append", action="store_true", help="print only: nothing appended to RESULTS.md")
    args = p.parse_args(argv)
    args.strategy_list = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(args.strategy_list) - set(STRATEGIES))
    if unknown:
        p.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    return args


def device_name(accelerator: str) -> str:
    import torch

    if accelerator == "gpu":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: run on a GPU machine, or pass --accelerator cpu for a CPU table")
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"CPU: {cpu_name()}"


def run_example(args: argparse.Namespace, strategy: str) -> dict:
    """One run of the CIFAR example; its JSON result line, plus the run's wall time."""
    command = [
        sys.executable, str(ROOT / "examples" / "cifar_resnet.py"), "--synthetic", "--json",
        "--strategy", strategy, "--accelerator", args.accelerator, "--devices", str(args.devices),
        "--max-steps", str(args.max_steps), "--batch-size", str(args.batch_size),
        "--synthetic-size", str(args.synthetic_size), "--num-workers", str(args.num_workers),
        "--log-every-n-steps", str(args.max_steps), "--log-dir", "/tmp/privdec_gpu_throughput_logs",
    ]  # fmt: skip
    if strategy in EXTRA_KWARGS:
        command += ["--strategy-kwargs", json.dumps(EXTRA_KWARGS[strategy])]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    wall = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"strategy": strategy, "error": (done.stderr or done.stdout).strip().splitlines()[-1:], "wall_s": wall}
    return json.loads(lines[-1]) | {"wall_s": wall}


def report(args: argparse.Namespace, device: str, results: list[dict], total_s: float) -> str:
    base = next((r["samples_per_second_total"] for r in results if r["strategy"] == NON_PRIVATE and "error" not in r),
                None)  # fmt: skip
    rows = []
    for r in results:
        if "error" in r:
            rows.append(f"| {r['strategy']} | failed: {' '.join(r['error'])[:200]} | | | | |")
            continue
        speed = r["samples_per_second_total"]
        ratio = f"{speed / base:.2f}x" if base else "n/a"
        eps = r["epsilon_per_node"][0] if r.get("epsilon_per_node") else None
        rows.append(f"| {r['strategy']} | {speed:,.1f} | {ratio} | {r['steps']} | "
                    f"{'-' if eps is None else f'{eps:.3g}'} | {r['wall_s']:.0f} |")  # fmt: skip
    return "\n".join([
        f"\n## gpu_throughput.py — {datetime.date.today().isoformat()}, {device}\n",
        f"Command: `{' '.join(['python benchmarks/gpu_throughput.py', *sys.argv[1:]])}` (total {total_s / 60:.1f} min).",
        "",
        f"- device: {device}",
        f"- {machine_line()}",
        f"- {software_line(opacus=True)}",
        f"- setup: examples/cifar_resnet.py --synthetic (GroupNorm ResNet-18, FakeData 3x32x32), {args.devices} "
        f"process(es) on {args.accelerator}, batch {args.batch_size}, {args.max_steps} steps, shard "
        f"{args.synthetic_size // args.devices} images per node, each strategy's example defaults; samples/s from "
        "the end of the first step to the end of training, summed over processes",
        "",
        "| strategy | samples/s | vs non-private push-sum | steps | epsilon (node 0) | run wall s |",
        "|---|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ])  # fmt: skip


def plot(args: argparse.Namespace, device: str, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in results if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["strategy"] for r in measured], [r["samples_per_second_total"] for r in measured], color="tab:blue")
    ax.set_ylabel("training samples / s")
    ax.set_title(f"examples/cifar_resnet.py --synthetic on {device}", fontsize=9)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=120)
    print(f"plot: {args.plot}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = device_name(args.accelerator)
    print(f"device: {device}", flush=True)
    started, results = time.perf_counter(), []
    for strategy in args.strategy_list:
        print(f"running {strategy} ... ", end="", flush=True)
        result = run_example(args, strategy)
        results.append(result)
        print(f"failed: {result['error']}" if "error" in result else
              f"{result['samples_per_second_total']:,.1f} samples/s ({result['wall_s']:.0f} s)", flush=True)  # fmt: skip
    text = report(args, device, results, time.perf_counter() - started)
    print(text)
    plot(args, device, results)
    if not args.no_append:
        append_results(text, args.results)
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
