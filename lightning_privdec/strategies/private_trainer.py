"""The Trainer as a private strategy sees it: the settings and loaders it refuses (one node's refusal stops every
node, said once), the steps its budget is planned over, its ``max_time`` timer, and whether the step now being taken
is the plan's last."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Timer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_privdec.algorithms.node import planned_steps
from lightning_privdec.privacy import PrivacyConfigError
from lightning_privdec.strategies.checks import gather_from_nodes, raised_on_every_node

T = TypeVar("T")


def stop_every_node_on(problem: PrivacyConfigError | None) -> None:
    """One node's configuration error stops every node here, instead of leaving the others waiting for it (every
    node calls this at the same point); rank 0 prints the first failing node's message, the others stay quiet."""
    failed = [(r, m) for r, m in enumerate(gather_from_nodes(problem and str(problem))) if m is not None]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if problem is not None:
        raise raised_on_every_node(problem, rank)
    if failed:
        error = PrivacyConfigError(f"node {failed[0][0]} cannot train privately, so no node starts: {failed[0][1]}")
        raise raised_on_every_node(error, rank)


def on_every_node(action: Callable[[], T]) -> T:
    """``action()``, run by every node at the same point; a PrivacyConfigError on any node stops every node
    (:func:`stop_every_node_on`)."""
    problem, result = None, None
    try:
        result = action()
    except PrivacyConfigError as exc:
        problem = exc
    stop_every_node_on(problem)
    return result  # type: ignore[return-value]


def check_private_training(trainer: pl.Trainer, name: str, max_grad_norm: float) -> None:
    """Refuse the Trainer settings a private step cannot honour: manual optimization, ``gradient_clip_val``."""
    if not trainer.lightning_module.automatic_optimization:
        raise PrivacyConfigError(
            f"{name} supports automatic optimization only: with manual optimization the strategy cannot tell which "
            "backward passes make one private step. Remove `self.automatic_optimization = False`."
        )
    if trainer.gradient_clip_val:
        raise PrivacyConfigError(
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) cannot be combined with {name}: Lightning would "
            "clip the privatized gradient after its noise is added, shrinking noise and signal alike without "
            "bounding any example further (each example's gradient is already clipped to "
            f"max_grad_norm={max_grad_norm} before the noise). Remove gradient_clip_val; the per-example bound is "
            "max_grad_norm."
        )


def check_private_loader(dataloader: object) -> DataLoader:
    """The training loader, if a node's shard can be Poisson-sampled from it: a DataLoader of a map-style dataset."""
    if not isinstance(dataloader, DataLoader):
        raise PrivacyConfigError(
            f"private strategies need a torch DataLoader for training (got {type(dataloader).__name__}) to "
            "Poisson-sample each node's shard"
        )
    if isinstance(dataloader.dataset, IterableDataset):
        raise PrivacyConfigError(
            "private strategies cannot train on an IterableDataset: Poisson sampling, which the accountant's "
            "amplification by subsampling assumes, needs a finite shard whose examples can be drawn by index. "
            "Use a map-style Dataset (with __len__ and __getitem__; e.g. TensorDataset, or list(...) of a stream "
            "that fits in memory), or a non-private strategy for streaming data"
        )
    return dataloader


def check_one_loader(trainer: pl.Trainer) -> None:
    """Private training reads ONE DataLoader (one sampling rate q per step)."""
    loaders = trainer.fit_loop._combined_loader
    if loaders is not None and len(loaders.flattened) > 1:
        raise PrivacyConfigError(
            f"private strategies train on ONE DataLoader; got {len(loaders.flattened)}. Each would have its own "
            "sampling rate q while the accountant records one per step: combine the datasets into one loader."
        )


def max_time_timer(trainer: pl.Trainer) -> Timer | None:
    """The Timer that ``Trainer(max_time=...)`` installs, if any."""
    return next((c for c in trainer.callbacks if isinstance(c, Timer) and c._duration is not None), None)


def trainer_planned_steps(trainer: pl.Trainer, batches_per_epoch: int) -> int:
    """:func:`~lightning_privdec.algorithms.node.planned_steps` of the Trainer's limits; Lightning's default of
    ``max_epochs=1000`` as the only end is warned about (sigma would be calibrated for far too many steps)."""
    time_limited = max_time_timer(trainer) is not None
    if trainer.max_epochs == 1000 and (trainer.max_steps is None or trainer.max_steps < 0) and not time_limited:
        rank_zero_warn(
            "the privacy budget is planned over Lightning's default of max_epochs=1000; set max_epochs or "
            "max_steps to the training you intend, or sigma will be far larger than needed"
        )
    return planned_steps(batches_per_epoch, limit_batches=trainer.limit_train_batches, max_epochs=trainer.max_epochs,
                         max_steps=trainer.max_steps, time_limited=time_limited)


def plan_ends_with_this_step(trainer: pl.Trainer) -> bool:
    """Whether the Trainer stops after the step now being taken anyway (max_steps, or the last batch of the last
    epoch), identically on every node."""
    completed = trainer.global_step + 1
    if trainer.max_steps is not None and 0 <= trainer.max_steps <= completed:
        return True
    last_epoch = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
    return last_epoch and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def backward_outside_step(
    strategy: pl.strategies.Strategy, batch: Any, backward: Callable[[Tensor], None], train: bool | None = True
) -> bool:
    """The user's ``training_step`` on one batch outside the training loop (nothing logged, no optimizer), and
    ``backward`` of its loss; whether it returned one. ``train``: the modules' mode meanwhile (None: as they are)."""
    module = strategy.lightning_module
    assert module is not None
    modes = [(m, m.training) for m in module.modules()]
    if train is not None:
        module.train(train)
    module.log = module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        with torch.enable_grad():
            output = strategy.training_step(strategy.batch_to_device(batch), 0)
            loss = output.get("loss") if isinstance(output, dict) else output
            if loss is not None:
                backward(loss)
            return loss is not None
    finally:
        del module.log, module.log_dict  # the class's own methods again
        for m, training in modes:
            m.training = training


def ledger_directories(trainer: pl.Trainer, checkpoint_saved: bool) -> list[Any]:
    """Where a write-ahead ledger may go, first choice first (:class:`~lightning_privdec.algorithms.node.
    WriteAheadPlace`): the checkpoint directory, the log directory, the root directory once a checkpoint was saved."""
    return [getattr(trainer.checkpoint_callback, "dirpath", None), trainer.loggers and trainer.log_dir,
            trainer.default_root_dir if checkpoint_saved else None]


def time_left(trainer: pl.Trainer) -> tuple[float, float]:
    """``max_time``'s (elapsed, remaining) seconds."""
    timer = max_time_timer(trainer)
    assert timer is not None
    return timer.time_elapsed(), timer.time_remaining() or 0.0
