"""Multi-process training on the digits task; every rank writes its own model and accuracy to --out.

Launched by the tests as ``python tests/scripts/fit_digits.py --devices 4 ...``. ``--start-method`` picks Lightning's
launcher: ``fork`` (the default here: the ranks are forked from this process once it has imported Lightning, about half
the start-up of a launch on a small machine) for the tests of what the strategy does, or ``popen`` (the strategy's
default, what a user's script gets: Lightning's subprocess launcher runs this script again for every other rank) for
the tests of launching itself (torchrun across two "machines", the kill-and-resume test). Either way each rank writes
its result in :class:`WriteResult` (``on_fit_end``, in the rank's own process), one code path for both. Several fits
separated by ``--then`` run one after the other in the same launch (starting Python, Lightning and the ranks costs
more than a digits fit); a ``--resume`` pattern such as ``ckpt/epoch=1-*.ckpt`` names a checkpoint an earlier fit of
the launch wrote.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_privdec import PrivacyBudgetCallback
from lightning_privdec.strategies import NON_PRIVATE_STRATEGIES, PRIVATE_STRATEGIES
from lightning_privdec.data.digits import DigitsClassifier, DigitsDataModule, accuracy


class StallAfterEpoch(Callback):
    """Stands in for a crash window: after epoch N is checkpointed, write a marker and wait to be killed."""

    def __init__(self, epoch: int, marker: Path) -> None:
        self.epoch, self.marker = epoch, marker

    def on_train_epoch_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        if trainer.current_epoch == self.epoch:
            trainer.strategy.barrier()
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text("checkpointed")
            time.sleep(3600)


class WriteResult(Callback):
    """After the fit, in every rank's own process (the process group still up): check Lightning's collectives and
    write this rank's model, test accuracy, gossip and privacy counts to ``<out>/rank<r>.pt``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank = trainer.global_rank
        strategy = trainer.strategy  # global collectives still work for metrics and logging
        collectives = {
            "reduce_sum": strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum").item(),
            "all_gather": strategy.all_gather(torch.tensor([rank])).reshape(-1).tolist(),
            "broadcast": strategy.broadcast(f"from rank {rank}", src=0),
        }
        strategy.barrier()
        params = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        gossip = getattr(strategy, "gossip", None)
        result = {
            "rank": rank,
            "params": params,
            "test_acc": accuracy(pl_module, *trainer.datamodule.tensors["test"]),
            "global_step": trainer.global_step,
            "bytes_sent": gossip.exchange.traffic.bytes_sent if gossip is not None else None,
            "rounds": gossip.round if gossip is not None else None,
            "collectives": collectives,
        }
        dp = getattr(strategy, "privacy", None)
        if dp is not None:
            result.update(
                epsilon=dp.epsilon(),
                ledger_steps=dp.steps,
                sigma_cdp=getattr(dp, "sigma_cdp", None),
                sigma_cor=getattr(dp, "sigma_cor", None),
                noise_split=getattr(dp, "split", None),
                noise_multiplier=dp.noise_multiplier,
                sample_rate=dp.sample_rate,
                expected_batch_size=dp.expected_batch_size,
                stopped_at_step=next(
                    (c.stopped_at_step for c in trainer.callbacks if isinstance(c, PrivacyBudgetCallback)), None
                ),
            )
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(result, self.out / f"rank{rank}.pt")
        if rank == 0:
            print(f"rank0 test_acc={result['test_acc']:.4f} steps={trainer.global_step} pid={os.getpid()}")


def make_strategy(args: argparse.Namespace):  # noqa: ANN201
    if args.strategy == "ddp":
        return "ddp" if args.start_method == "popen" else f"ddp_{args.start_method}"
    common = dict(topology=args.topology, compressor=args.compressor, consensus_step=args.gamma, seed=args.seed,
                  start_method=args.start_method)
    common.update(json.loads(args.strategy_kwargs))
    if args.strategy in NON_PRIVATE_STRATEGIES:
        return NON_PRIVATE_STRATEGIES[args.strategy](**common)
    if args.strategy == "decor":
        noise = dict(sigma_cdp=args.sigma_cdp, sigma_cor=args.sigma_cor, adversary=args.adversary, baseline=args.baseline,
                     key_file_dir=args.key_dir)
    else:
        noise = dict(noise_multiplier=args.noise_multiplier, grad_sample_mode=args.grad_sample_mode)
    return PRIVATE_STRATEGIES[args.strategy](
        **common,
        **noise,
        max_grad_norm=args.clip,
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        noise_seed=args.noise_seed,
    )


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="push_sum", choices=["ddp", *NON_PRIVATE_STRATEGIES, *PRIVATE_STRATEGIES])
    parser.add_argument("--topology", default="exponential-one-peer")
    parser.add_argument("--compressor", default=None)
    parser.add_argument("--gamma", type=lambda text: text if text == "auto" else float(text), default="auto")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--start-method", default="fork", choices=["fork", "popen"],
                        help="Lightning's launcher: fork the ranks from this process, or run this script once per rank")
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (torchrun --nnodes)")
    parser.add_argument("--max-epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt-dir", type=Path, default=None)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--stall-at-epoch", type=int, default=None)
    parser.add_argument("--epsilon", type=float, default=None)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--noise-multiplier", type=float, default=None)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--noise-seed", type=int, default=None)
    parser.add_argument("--sigma-cdp", type=float, default=None)
    parser.add_argument("--sigma-cor", type=float, default=None)
    parser.add_argument("--adversary", default="eavesdropper")
    parser.add_argument("--baseline", default=None, choices=["ldp", "cdp"])
    parser.add_argument("--key-dir", default=None, help="decor: keep each node's X25519 key in this directory")
    parser.add_argument("--grad-sample-mode", default="hooks", choices=["hooks", "functorch", "ghost"])
    parser.add_argument("--strategy-kwargs", default="{}", help="JSON object of extra strategy arguments")
    parser.add_argument("--csv", action="store_true", help="log to a CSVLogger under --out")
    parser.add_argument("--float16", action="store_true",
                        help="precision '16-mixed' on CPU: float16 autocast and Lightning's GradScaler")
    return parser


def checkpoint(pattern: Path | None) -> Path | None:
    """``--resume``: a path, or a pattern that matches exactly one checkpoint."""
    if pattern is None or "*" not in str(pattern):
        return pattern
    (match,) = sorted(pattern.parent.glob(pattern.name))
    return match


def main(argv: list[str]) -> None:
    parser = arguments()
    runs = [parser.parse_args(run) for separator, run in itertools.groupby(argv, lambda a: a == "--then")
            if not separator]
    if len({(args.devices, args.num_nodes, args.start_method) for args in runs}) != 1:
        parser.error("every fit of one launch runs on the same processes: give each the same --devices, --num-nodes "
                     "and --start-method")
    for args in runs:
        fit(args)


def fit(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    model = DigitsClassifier(lr=args.lr, momentum=args.momentum, per_sample_loss=args.grad_sample_mode == "ghost")
    data = DigitsDataModule(batch_size=args.batch_size, seed=0)
    callbacks: list[Callback] = []
    if args.ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1, every_n_epochs=1))
    if args.strategy in PRIVATE_STRATEGIES:
        callbacks.append(PrivacyBudgetCallback(log_every_n_steps=5))
    if args.stall_at_epoch is not None:
        callbacks.append(StallAfterEpoch(args.stall_at_epoch, args.out / "stalled"))
    callbacks.append(WriteResult(args.out))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=make_strategy(args),
        max_epochs=args.max_epochs,
        callbacks=callbacks,
        logger=CSVLogger(args.out, name="csv", version=0) if args.csv else False,
        log_every_n_steps=5,
        enable_checkpointing=args.ckpt_dir is not None,
        plugins=[MixedPrecision("16-mixed", "cpu")] if args.float16 else None,
        default_root_dir=args.out,  # the write-ahead privacy ledger of runs without checkpoints goes here
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=data, ckpt_path=checkpoint(args.resume))

if __name__ == "__main__":
    main(sys.argv[1:])
