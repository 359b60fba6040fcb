"""A small multi-process run for the reliability tests: faults, configuration mismatches and determinism.

Launched as ``python tests/scripts/fit_reliability.py --devices 4 --out DIR ...``. ``--start-method``: ``fork`` (the
default here: the ranks are forked by Lightning's multiprocessing launcher, about half the start-up) or ``popen`` (the
strategy's default, what a user's script gets: Lightning runs this script again for every other rank), which the
tests of a killed or hung node use (under ``fork`` the launching process would end the survivors itself) and
``--mismatch`` needs (each process builds its own strategy). Every rank writes ``DIR/pid<r>`` at setup and
``DIR/rank<r>_run<i>.pt`` (its parameters) after each run that ends normally, from :class:`Record` in its own process.
Several configurations separated by ``--then`` run one after the other in the same launch, each in its own ``--out``;
before each, the launching process prints ``== fit DIR``, so that a log can be split by configuration.
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_privdec.strategies import STRATEGIES
from lightning_privdec.strategies.checks import NodeMismatchError


class TinyClassifier(L.LightningModule):
    """A small MLP on synthetic data; each node's training data is :func:`node_loader`'s for its rank."""

    def __init__(self, data: str) -> None:
        super().__init__()
        self.data = data
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=g)
        return node_loader(self.data, self.global_rank, x, (x[:, 0] + 0.5 * x[:, 1] > 0).long())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class FaultAtStep(Callback):
    """At the start of step ``step``, node ``rank`` writes the time to ``marker`` and sends itself ``signum``:
    SIGKILL (the process dies) or SIGSTOP (it hangs: alive, connections open, never answering)."""

    def __init__(self, signum: int, rank: int, step: int, marker: Path) -> None:
        self.signum, self.rank, self.step, self.marker = signum, rank, step, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            self.marker.write_text(str(time.time()))
            os.kill(os.getpid(), self.signum)


class Record(Callback):
    """In every rank's own process: its pid at setup (for the tests that watch ranks end), then, after a run that ends
    normally, its parameters, steps and privacy counts."""

    def __init__(self, out: Path, run: int) -> None:
        self.out, self.run = out, run

    def setup(self, trainer, pl_module, stage) -> None:  # noqa: ANN001
        (self.out / f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def on_fit_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        params = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        dp = getattr(trainer.strategy, "privacy", None)
        privacy = {} if dp is None else {"sample_rate": dp.sample_rate, "epsilon": dp.epsilon(),
                                             "private_steps": dp.steps}
        torch.save({"rank": trainer.global_rank, "params": params, "global_step": trainer.global_step,
                    "steps_per_epoch": trainer.strategy.steps_per_epoch, "epochs": trainer.current_epoch, **privacy},
                   self.out / f"rank{trainer.global_rank}_run{self.run}.pt")


class Stream(IterableDataset):
    """Examples streamed one by one (no length): this node's own data."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __iter__(self):  # noqa: ANN204
        return zip(self.x, self.y)


def node_loader(data: str, rank: int, x: torch.Tensor, y: torch.Tensor) -> DataLoader:
    """``shared``: the whole set (Lightning shards it); ``unequal``: node r holds its own 48 (1 + 4r) examples
    (node_local_data); ``iterable``: the same unequal shards as a stream without a length."""
    if data == "shared":
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    own = slice(0, 48 * (1 + 4 * rank))
    if data == "unequal":
        return DataLoader(TensorDataset(x[own], y[own]), batch_size=16, shuffle=True)
    return DataLoader(Stream(x[own], y[own]), batch_size=16)


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="push_sum", choices=list(STRATEGIES))
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--start-method", default="fork", choices=["fork", "popen"],
                        help="Lightning's launcher: fork the ranks from this process, or run this script once per rank")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--peer-timeout", type=float, default=None, help="the strategy's peer_timeout, in seconds")
    parser.add_argument("--kill", type=int, nargs=2, default=None, metavar=("RANK", "STEP"), help="SIGKILL")
    parser.add_argument("--hang", type=int, nargs=2, default=None, metavar=("RANK", "STEP"), help="SIGSTOP")
    parser.add_argument("--strategy-kwargs", default="{}", help="JSON: arguments of every node's strategy")
    parser.add_argument("--runs", type=int, default=1, help="train this many times, each from scratch")
    parser.add_argument("--data", default="shared", choices=("shared", "unequal", "iterable"),
                        help="every node's training data (see node_loader)")
    parser.add_argument("--mismatch", default=None,
                        help='JSON {"rank": {...}}: then one more run whose strategy these overrides make differ per '
                             "node; each rank writes the error it raises to mismatch<rank>.txt (--start-method popen)")
    return parser


def main(argv: list[str]) -> None:
    parser = arguments()
    configurations = [parser.parse_args(part) for separator, part in
                      itertools.groupby(argv, lambda a: a == "--then") if not separator]
    if len({(args.devices, args.start_method) for args in configurations}) != 1:
        parser.error("every configuration of one launch runs on the same processes: give each the same --devices "
                     "and --start-method")
    if any(args.mismatch is not None and args.start_method != "popen" for args in configurations):
        parser.error("--mismatch gives each process its own strategy: it needs --start-method popen")
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where a hung node waits
    torch.set_num_threads(1)
    for args in configurations:
        print(f"== fit {args.out}", flush=True)
        fit(args)


def fit(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    kwargs = {**json.loads(args.strategy_kwargs), "start_method": args.start_method}
    if args.peer_timeout is not None:
        kwargs["peer_timeout"] = timedelta(seconds=args.peer_timeout)
    faults = ((signal.SIGKILL, args.kill), (signal.SIGSTOP, args.hang))
    runs = [kwargs] * args.runs
    if args.mismatch is not None:  # popen: this process is one rank, known before the launch
        rank = int(os.environ.get("LOCAL_RANK", 0))
        runs.append({**kwargs, **json.loads(args.mismatch).get(str(rank), {})})
    for run, run_kwargs in enumerate(runs):  # every run from scratch: seed, strategy, model, Trainer
        L.seed_everything(0, verbose=False)
        trainer = L.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=STRATEGIES[args.strategy](**run_kwargs),
            max_steps=args.max_steps,
            callbacks=[Record(args.out, run),
                       *(FaultAtStep(signum, *at, args.out / "fault") for signum, at in faults if at is not None)],
            logger=False,
            enable_checkpointing=False,
            default_root_dir=args.out,  # where a private run's write-ahead privacy ledger goes
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=args.data == "shared",
        )
        try:
            trainer.fit(TinyClassifier(args.data))
        except NodeMismatchError as error:
            if run < args.runs:
                raise
            (args.out / f"mismatch{trainer.global_rank}.txt").write_text(f"step {trainer.global_step}: {error}")

if __name__ == "__main__":
    main(sys.argv[1:])
