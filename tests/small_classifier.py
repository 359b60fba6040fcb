"""The small classifier and data the in-process strategy tests train (8 features, 3 classes)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


class Classifier(pl.LightningModule):
    """A small MLP; ``nan_at_step`` turns that step's inputs into NaN, ``batch_norm`` adds a BatchNorm1d."""

    def __init__(self, batch_norm: bool = False, manual: bool = False, nan_at_step: int | None = None) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, 16)] + ([nn.BatchNorm1d(16)] if batch_norm else [])
        self.net = nn.Sequential(*layers, nn.Tanh(), nn.Linear(16, 3))
        self.automatic_optimization = not manual
        self.nan_at_step = nan_at_step

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.trainer.global_step == self.nan_at_step:
            x = x * float("nan")
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def dataset(n: int = 128) -> TensorDataset:
    """``n`` examples whose class is how many of the first two features are positive."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
