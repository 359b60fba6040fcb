"""NetworkAverageEvaluation: validate and test the network-average model instead of each node's own."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_privdec.tensors import split_like
from lightning_privdec.callbacks._parameters import float_state


class NetworkAverageEvaluation(Callback):
    """Evaluates the average of all nodes' models, then gives every node its own model back.

    Before validation (and testing, if ``test=True``) every node's floating-point parameters and buffers are
    all-reduced to their mean over the nodes (a global collective, for evaluation only: it reveals the average model to
    every node) and loaded in place; after it, each node's own tensors are restored bit for bit, so training continues
    from exactly where it was. Without this callback every node validates its own model.
    """

    def __init__(self, validate: bool = True, test: bool = True) -> None:
        self.validate = validate
        self.test = test
        self._saved: list[torch.Tensor] | None = None

    def _swap_in_average(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size == 1:
            return
        tensors = float_state(pl_module)
        self._saved = [t.detach().clone() for t in tensors]
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
        average = trainer.strategy.reduce(flat, reduce_op="sum") / trainer.world_size
        with torch.no_grad():
            for t, value in zip(tensors, split_like(average, tensors)):
                t.copy_(value)

    def _restore(self, pl_module: pl.LightningModule) -> None:
        if self._saved is None:
            return
        with torch.no_grad():
            for t, saved in zip(float_state(pl_module), self._saved):
                t.copy_(saved)
        self._saved = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.validate:
            self._swap_in_average(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore(pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.test:
            self._swap_in_average(trainer, pl_module)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore(pl_module)
