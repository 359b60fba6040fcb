"""ResNet-18 (GroupNorm) on CIFAR-10 with any lightning-privdec strategy, logging to Weights & Biases.

    python examples/cifar_resnet.py --strategy dp_csgp --epsilon 3 --devices 4 --wandb
    python examples/cifar_resnet.py --strategy dyn_d2p --epsilon 1 --accelerator gpu --devices 8
    python examples/cifar_resnet.py --synthetic --max-steps 20          # offline: FakeData in CIFAR-10's shape
    python examples/cifar_resnet.py --partition dirichlet --alpha 0.5   # non-IID label split across the nodes

Several machines (one line per machine; the same command with --node-rank 0 and 1):

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/cifar_resnet.py --num-nodes 2 --devices 4 --accelerator gpu

Per-sample differential privacy cannot use BatchNorm (it mixes examples within a batch), so the ResNet-18 here
uses GroupNorm. Defaults follow each strategy's paper where it gives them (see --help).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from lightning_privdec.callbacks import (
    CommunicationCostCallback,
    ConsensusErrorCallback,
    NetworkAverageEvaluation,
    PrivacyBudgetCallback,
)
from lightning_privdec.data import DirichletPartitionSampler
from lightning_privdec.strategies import PRIVATE_STRATEGIES, STRATEGIES
from lightning_privdec.strategies.checks import gather_tensors

#: the papers' CIFAR-10 / ResNet-18 settings where they state them; the rest are this example's choices
PAPER_DEFAULTS: dict[str, dict[str, Any]] = {
    "dp_csgp": dict(lr=0.03, clip=1.5, delta=1e-4, topology="exponential", compressor="randk:0.5"),  # DP-CSGP, Sec. 5
    "privsgp": dict(lr=0.03, clip=1.5, delta=1e-4, topology="exponential", compressor=None),  # DP-CSGP's baseline
    "dp2sgd": dict(lr=0.03, clip=1.5, delta=1e-4, topology="ring", compressor=None),  # DP-CSGP's baseline
    "dyn_d2p": dict(lr=0.05, clip=7.0, delta=1e-4, topology="exponential-one-peer", compressor=None),  # Dyn-D2P, C0=7
    "privsgp_vr": dict(lr=0.03, clip=1.5, delta=1e-5, topology="exponential-one-peer", compressor=None),
    "decor": dict(lr=0.03, clip=1.5, delta=1e-5, topology="ring", compressor=None),
    "cpgt": dict(lr=0.03, clip=1.5, delta=1e-5, topology="ring", compressor="topk:0.2"),
}
FALLBACK = dict(lr=0.05, clip=1.5, delta=1e-4, topology="exponential-one-peer", compressor=None)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = "; ".join(
        f"{name}: lr {d['lr']}, clip {d['clip']}, delta {d['delta']}, {d['topology']}, {d['compressor'] or 'exact'}"
        for name, d in PAPER_DEFAULTS.items()
    )
    p = argparse.ArgumentParser(
        description=__doc__,
        epilog=f"Per-strategy defaults (papers' settings where given): {defaults}. Non-private: lr {FALLBACK['lr']}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--strategy", default="dp_csgp", choices=sorted(STRATEGIES))
    p.add_argument("--topology", default=None, help="graph name (default: the strategy's, see below)")
    p.add_argument("--compressor", default=None, help="none, randk:R, topk:R, qsgd:B, sign (default: the strategy's)")
    p.add_argument("--gamma", type=lambda text: text if text == "auto" else float(text), default="auto",
                   help="consensus step of compressed gossip: a number in (0, 1] or auto (default: chosen at setup)")
    p.add_argument("--epsilon", type=float, default=3.0, help="per-node target epsilon (default 3)")
    p.add_argument("--delta", type=float, default=None, help="target delta (default: the strategy's, 1e-4 for DP-CSGP)")
    p.add_argument("--clip", type=float, default=None, help="per-sample clipping bound (default: the strategy's, 1.5)")
    p.add_argument("--lr", type=float, default=None, help="SGD learning rate (default: the strategy's, 0.03 DP-CSGP)")
    p.add_argument("--batch-size", type=int, default=64, help="expected per-node batch size (default 64)")
    p.add_argument("--devices", type=int, default=4, help="processes per machine (default 4)")
    p.add_argument("--accelerator", default="cpu", help="cpu or gpu (NCCL) (default cpu)")
    p.add_argument("--num-nodes", type=int, default=1, help="machines (default 1)")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (default: by epochs)")
    p.add_argument("--max-epochs", type=int, default=10, help="training epochs (default 10)")
    p.add_argument("--partition", default="iid", choices=["iid", "dirichlet"], help="how the nodes split the data")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration for --partition dirichlet")
    p.add_argument("--data-dir", type=Path, default=Path("data"), help="where CIFAR-10 is (or is downloaded to)")
    p.add_argument("--synthetic", action="store_true", help="torchvision FakeData in CIFAR-10's shape (no download)")
    p.add_argument("--synthetic-size", type=int, default=1024, help="training images with --synthetic")
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases (WANDB_MODE=offline works too)")
    p.add_argument("--wandb-project", default="lightning-privdec")
    p.add_argument("--log-dir", type=Path, default=Path("lightning_logs"), help="CSV logs when not using W&B")
    p.add_argument("--log-every-n-steps", type=int, default=10, help="privacy, bytes and consensus logging interval")
    p.add_argument("--eval-average", action="store_true", help="validate the network-average model")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strategy-kwargs", default="{}", help="extra strategy arguments as JSON")
    p.add_argument("--json", action="store_true", help="print one JSON line with the results")
    args = p.parse_args(argv)
    defaults = PAPER_DEFAULTS.get(args.strategy, FALLBACK)
    for name in ("lr", "clip", "delta", "topology"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.compressor is None:
        args.compressor = defaults["compressor"] or "none"
    return args


# ---- model ---------------------------------------------------------------------------------------------------------
def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, channels), channels)


class BasicBlock(nn.Module):
    """ResNet's two-convolution block (He et al. 2016) with GroupNorm and out-of-place operations throughout:
    per-sample gradient hooks cannot see through in-place additions or activations."""

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.norm1 = group_norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.norm2 = group_norm(channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride, bias=False), group_norm(channels))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def resnet18_groupnorm(num_classes: int = 10) -> nn.Module:
    """ResNet-18 for 32x32 images (3x3 stem, no max-pool; 2-2-2-2 blocks of 64-128-256-512 channels, 11.2 M
    parameters) with GroupNorm(32) in place of BatchNorm."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), group_norm(64), nn.ReLU()]
    in_channels = 64
    for channels, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(in_channels, channels, stride), BasicBlock(channels, channels, 1)]
        in_channels = channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


class CifarClassifier(L.LightningModule):
    def __init__(self, lr: float, per_sample_loss: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = resnet18_groupnorm()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        losses = F.cross_entropy(self(x), y, reduction="none")
        if len(y):
            self.log("train/loss", losses.mean(), prog_bar=True)
        return losses if self.hparams.per_sample_loss else losses.mean()

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self(x).argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


# ---- data ----------------------------------------------------------------------------------------------------------
def cifar_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset, list[int]]:
    """(train, test, train labels): CIFAR-10 from torchvision, or FakeData of the same shape with --synthetic."""
    import torchvision.transforms as T
    from torchvision.datasets import CIFAR10, FakeData

    normalize = T.Normalize(CIFAR_MEAN, CIFAR_STD)
    if args.synthetic:
        train = FakeData(args.synthetic_size, (3, 32, 32), 10, transform=T.Compose([T.ToTensor(), normalize]))
        test = FakeData(max(64, args.synthetic_size // 4), (3, 32, 32), 10, T.Compose([T.ToTensor(), normalize]),
                        random_offset=args.synthetic_size)
        labels = [int(train[i][1]) for i in range(len(train))] if args.partition == "dirichlet" else []
        return train, test, labels
    augment = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), normalize])
    train = CIFAR10(args.data_dir, train=True, transform=augment)
    test = CIFAR10(args.data_dir, train=False, transform=T.Compose([T.ToTensor(), normalize]))
    return train, test, list(train.targets)


def download_cifar(data_dir: Path) -> None:
    """Fetch CIFAR-10 once, before any training process starts; a clear exit if that is impossible."""
    from torchvision.datasets import CIFAR10

    try:
        for train in (True, False):
            CIFAR10(data_dir, train=train, download=True)
    except Exception as exc:  # no network, a proxy, a broken mirror: say what to do instead
        sys.exit(
            f"could not download CIFAR-10 to {data_dir} ({type(exc).__name__}: {exc}). Put the extracted "
            "'cifar-10-batches-py' folder there, or run with --synthetic on machines without internet."
        )


class CifarData(L.LightningDataModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args

    def setup(self, stage: str | None = None) -> None:
        self.train, self.test, self.labels = cifar_datasets(self.args)

    def train_dataloader(self) -> DataLoader:
        a = self.args
        if a.partition == "dirichlet":
            sampler = DirichletPartitionSampler(self.labels, alpha=a.alpha, seed=a.seed)
            return DataLoader(self.train, batch_size=a.batch_size, sampler=sampler, num_workers=a.num_workers)
        return DataLoader(self.train, batch_size=a.batch_size, shuffle=True, num_workers=a.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test, batch_size=256, num_workers=self.args.num_workers)


# ---- strategy and run ----------------------------------------------------------------------------------------------
def build_strategy(args: argparse.Namespace):  # noqa: ANN201
    kwargs: dict[str, Any] = dict(topology=args.topology, compressor=args.compressor, consensus_step=args.gamma,
                                  seed=args.seed)
    if args.strategy in PRIVATE_STRATEGIES:
        kwargs.update(max_grad_norm=args.clip, target_epsilon=args.epsilon, target_delta=args.delta)
    kwargs.update(json.loads(args.strategy_kwargs))
    return STRATEGIES[args.strategy](**kwargs)


class Throughput(Callback):
    """Training samples per second, from the first step to the end (the first step's warm-up excluded)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.samples = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        if self.start is None:
            self.start = time.perf_counter()
            return
        self.samples += len(batch[1])

    def samples_per_second(self) -> float:
        return self.samples / (time.perf_counter() - self.start) if self.start and self.samples else 0.0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.synthetic and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        download_cifar(args.data_dir)  # the launching process (or each machine's first torchrun worker)
    L.seed_everything(args.seed, verbose=False)
    private = args.strategy in PRIVATE_STRATEGIES
    throughput = Throughput()
    every = args.log_every_n_steps
    callbacks: list[Callback] = [
        ConsensusErrorCallback(every_n_steps=every),  # one model-sized all-reduce per log step, for monitoring
        CommunicationCostCallback(every_n_steps=every),
        throughput,
    ]
    if private:
        callbacks.append(PrivacyBudgetCallback(log_every_n_steps=every))
    if args.eval_average:
        callbacks.append(NetworkAverageEvaluation())
    if args.wandb:
        logger = WandbLogger(project=args.wandb_project, config=vars(args) | {"data_dir": str(args.data_dir)})
    else:
        logger = CSVLogger(args.log_dir, name=f"cifar_{args.strategy}")
    model = CifarClassifier(lr=args.lr, per_sample_loss="ghost" in args.strategy_kwargs)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=build_strategy(args),
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=every,
        enable_checkpointing=not args.synthetic,
        enable_progress_bar=not args.json,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0 if args.synthetic else 1.0,
    )
    trainer.fit(model, datamodule=CifarData(args))
    device = trainer.strategy.root_device  # NCCL gathers CUDA tensors only; gloo either

    def per_node(value: float | int, dtype: torch.dtype) -> list:
        return gather_tensors(torch.tensor([value], dtype=dtype, device=device)).reshape(-1).tolist()

    speed = per_node(throughput.samples_per_second(), torch.float64)
    finite = per_node(int(all(bool(torch.isfinite(p).all()) for p in model.parameters())), torch.int64)
    peak = per_node(torch.cuda.max_memory_allocated(device), torch.int64) if device.type == "cuda" else None
    epsilons = per_node(trainer.strategy.privacy.epsilon(), torch.float64) if private else None
    if not trainer.is_global_zero:
        return
    result = {
        "strategy": args.strategy,
        "topology": trainer.strategy.topology.name,
        "compressor": str(trainer.strategy.compressor),
        "nodes": trainer.world_size,
        "steps": trainer.global_step,
        "epsilon_per_node": epsilons,
        "delta": args.delta if private else None,
        "samples_per_second_total": float(sum(speed)),
        "train_loss": float(trainer.callback_metrics.get("train/loss", float("nan"))),
        "bytes_sent_node0": trainer.strategy.gossip.exchange.traffic.bytes_sent,
        "parameters_finite_per_node": [bool(v) for v in finite],
        "peak_gpu_memory_bytes_per_node": peak,  # torch.cuda.max_memory_allocated; None off CUDA
    }
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
