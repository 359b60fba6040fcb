"""Peak resident set of one rank of a real Lightning fit: DDP against the private strategies, on the same model.

``--nodes`` local processes (gloo over loopback, one intra-op thread each) fit ``benchmarks/network.py``'s model
(``wide`` or ``mlp``; default ``wide``, 9.7M parameters, on synthetic inputs of its shape) with Lightning's
``DDPStrategy`` (whose ranks import nothing of this package) or the network benchmark's private strategies and
settings (its ``build_strategy``: the time-varying exponential-one-peer graph, sigma = 1, C = 1) for ``--steps``
steps, one configuration after the other. Each rank reports its peak resident set (``ru_maxrss``) after the fit and its resident set after the imports,
before any tensor. Nothing is recorded: the table is printed.

    python benchmarks/rank_memory.py --nodes 8 --configs ddp,dp_csgp_randk0.1,dp_csgp_qsgd8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore")
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    sys.path.insert(0, str(HERE))
    from network import BATCH, build_module, build_net

    rank, nodes = int(os.environ["NODE_RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=nodes)
    if args.configs == "ddp":  # Lightning's own strategy: nothing of lightning_privdec imported
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy()
    else:
        from network import build_strategy

        strategy = build_strategy(args.configs, 30.0)
    imports = _rss_mib()
    L.seed_everything(0, verbose=False)
    # synthetic inputs of the model's shape (network.py's digits would import lightning_privdec into the DDP rank)
    data = TensorDataset(torch.randn(1024, 64), torch.randint(0, 10, (1024,)))
    loader = DataLoader(data, batch_size=BATCH[args.model], shuffle=True, drop_last=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, num_nodes=nodes, strategy=strategy, max_steps=args.steps,
        max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0,
    )  # fmt: skip
    trainer.fit(build_module(build_net(args.model)), train_dataloaders=loader)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.out, f"{rank}.json").write_text(json.dumps({"imports": imports, "peak": peak}))
    dist.barrier()
    dist.destroy_process_group()


def run(config: str, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]), WORLD_SIZE=str(args.nodes),
                   LOCAL_RANK="0", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        s.close()
        command = [sys.executable, __file__, "--child", "--configs", config, "--model", args.model, "--steps",
                   str(args.steps), "--out", out]
        procs = [subprocess.Popen(command, env=dict(env, NODE_RANK=str(r), RANK=str(r)), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for r in range(args.nodes)]
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"{config}: a rank failed:\n" + "\n".join(e[-3000:] for e in errors if e))
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(args.nodes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--configs", default="ddp,dp_csgp_randk0.1,dp_csgp_qsgd8")
    parser.add_argument("--model", default="wide")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = {config: run(config, args) for config in args.configs.split(",")}
    reference = statistics.median(r["peak"] for r in rows["ddp"]) if "ddp" in rows else None
    print(f"`python benchmarks/rank_memory.py --nodes {args.nodes} --configs {args.configs} --model {args.model} "
          f"--steps {args.steps}`\n")
    print("| rank of | peak RSS MiB, median (min-max) over ranks | / DDP rank | RSS after imports MiB |")
    print("|---|---:|---:|---:|")
    for config, ranks in rows.items():
        peaks = [r["peak"] for r in ranks]
        ratio = f"{statistics.median(peaks) / reference:.2f}x" if reference else "n/a"
        print(f"| {config} | {statistics.median(peaks):.0f} ({min(peaks):.0f}-{max(peaks):.0f}) | {ratio} | "
              f"{statistics.median(r['imports'] for r in ranks):.0f} |")


if __name__ == "__main__":
    main()
