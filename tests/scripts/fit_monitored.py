"""4-process digits fit with every monitoring callback, logging to W&B (offline) or CSV; results per rank to --out.
Several fits separated by ``--then`` run one after the other in the same processes (one launch). Lightning's
subprocess launcher (the strategy's default, as in a user's script) starts the ranks: the script tests each rank's own
model after the fit with ``trainer.test``, which needs the rank's process to outlive ``trainer.fit`` (forked ranks
end with it).

    python tests/scripts/fit_monitored.py --out /tmp/run --strategy dp_csgp --epsilon 3 --logger wandb --alpha 0.5
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lightning_privdec.callbacks import (
    CommunicationCostCallback,
    ConsensusErrorCallback,
    NetworkAverageEvaluation,
    PrivacyBudgetCallback,
)
from lightning_privdec.data import DigitsClassifier, DigitsDataModule
from lightning_privdec.data.digits import accuracy
from lightning_privdec.strategies import PRIVATE_STRATEGIES, STRATEGIES


def own_parameters(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).clone()


class ParameterProbe(Callback):
    """Records the node's parameters at validation start (placed before NetworkAverageEvaluation, it sees the node's
    own model) or at validation end (placed after it, it sees the model NetworkAverageEvaluation restored)."""

    def __init__(self, at_start: bool) -> None:
        self.at_start = at_start
        self.seen: list[torch.Tensor] = []

    def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        if self.at_start:
            self.seen.append(own_parameters(pl_module))

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        if not self.at_start:
            self.seen.append(own_parameters(pl_module))


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="dp_csgp", choices=sorted(STRATEGIES))
    parser.add_argument("--compressor", default="randk:0.5")
    parser.add_argument("--gamma", type=float, default=0.5)
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--alpha", type=float, default=None, help="Dirichlet label partition (non-IID)")
    parser.add_argument("--max-epochs", type=int, default=3)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--logger", default="wandb", choices=["wandb", "csv"])
    parser.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: list[str]) -> None:
    parser = arguments()
    runs = [parser.parse_args(run) for separator, run in itertools.groupby(argv, lambda a: a == "--then")
            if not separator]
    if len({args.devices for args in runs}) != 1:
        parser.error("every fit of one launch runs on the same processes: give each the same --devices")
    for args in runs:
        fit(args)


def fit(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    private = args.strategy in PRIVATE_STRATEGIES
    common = dict(topology="exponential", compressor=args.compressor, consensus_step=args.gamma)
    if private:
        common.update(max_grad_norm=1.0, target_epsilon=args.epsilon, target_delta=1e-5, noise_seed=0)
    strategy = STRATEGIES[args.strategy](**common)
    before, after = ParameterProbe(at_start=True), ParameterProbe(at_start=False)
    callbacks: list[Callback] = [
        ConsensusErrorCallback(every_n_steps=5),
        CommunicationCostCallback(every_n_steps=5),
        before,
        NetworkAverageEvaluation(),
        after,
    ]
    if private:
        callbacks.append(PrivacyBudgetCallback(log_every_n_steps=5))
    if args.logger == "wandb":
        logger = WandbLogger(offline=True, save_dir=str(args.out), project="lightning-privdec-test")
    else:
        logger = CSVLogger(args.out, name="csv", version=0)
    model = DigitsClassifier(lr=0.5 if private else 0.1)
    data = DigitsDataModule(batch_size=32, seed=0, partition_alpha=args.alpha)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.max_epochs,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=5,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    val_acc = float(trainer.callback_metrics["val/acc"])
    own = own_parameters(model)
    average = trainer.strategy.all_gather(own).mean(0)
    average_model = DigitsClassifier()
    torch.nn.utils.vector_to_parameters(average, average_model.parameters())
    test_x, test_y = data.tensors["test"]
    loader = trainer.train_dataloader
    sampler = loader.batch_sampler if private else loader.sampler
    test_metrics = trainer.test(model, datamodule=data, verbose=False)[0]
    # each node evaluates its DistributedSampler share of the test set: score the average model on the same share
    evaluated = torch.tensor(list(iter(trainer.test_dataloaders.sampler)), dtype=torch.long)
    result = {
        "rank": trainer.global_rank,
        "val_acc_logged": val_acc,
        "test_acc_logged": float(test_metrics["test/acc"]),
        "average_model_acc": accuracy(average_model, test_x[evaluated], test_y[evaluated]),
        "average_model_acc_full": accuracy(average_model, test_x, test_y),
        "own_model_acc": accuracy(model, test_x, test_y),
        "own_unchanged_by_test": bool(torch.equal(own, own_parameters(model))),
        "own_differs_from_average": not torch.allclose(own, average),
        "restored_after_validation": all(torch.equal(b, a) for b, a in zip(before.seen, after.seen)),
        "validations": min(len(before.seen), len(after.seen)),
        "train_labels": data.tensors["train"][1][
            torch.tensor(sorted(getattr(loader.sampler, "node_indices", [])), dtype=torch.long)
        ].tolist()
        if args.alpha is not None and not private
        else None,
        "shard_size": len(loader.dataset) if private else None,
        "sampler": type(sampler).__name__,
        "consensus": next(c.last for c in callbacks if isinstance(c, ConsensusErrorCallback)),
        "comm": next(c.last for c in callbacks if isinstance(c, CommunicationCostCallback)),
        "bytes_sent": trainer.strategy.gossip.exchange.traffic.bytes_sent,
        "global_step": trainer.global_step,
        "epsilon": trainer.strategy.privacy.epsilon() if private else None,
    }
    if args.logger == "wandb" and trainer.is_global_zero:
        import wandb

        wandb.finish()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / f"rank{trainer.global_rank}.pt")
    if trainer.is_global_zero:
        print(f"rank0 val_acc={val_acc:.4f} pid={os.getpid()}")


if __name__ == "__main__":
    main(sys.argv[1:])
