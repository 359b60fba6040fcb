"""scikit-learn's bundled handwritten digits (1,797 real 8x8 images, no download) as a Lightning task.

Used by the quick start, the tests and the benchmarks: real data, small enough to train on 2 CPU cores in seconds.
Needs scikit-learn (``pip install lightning-privdec[examples]``).
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec.data.partition import DirichletPartitionSampler


def load_digits_tensors(seed: int = 0, test_fraction: float = 0.25) -> dict[str, tuple[Tensor, Tensor]]:
    """Standardised features and labels, split into a fixed train and test set."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("the digits task needs scikit-learn: pip install 'lightning-privdec[examples]'") from exc
    data = load_digits()
    features = torch.tensor(data.data, dtype=torch.float32) / 16.0
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    features, labels = features[order], labels[order]
    n_test = int(len(labels) * test_fraction)
    mean, std = features[n_test:].mean(0), features[n_test:].std(0).clamp_min(1e-3)
    features = (features - mean) / std
    return {"train": (features[n_test:], labels[n_test:]), "test": (features[:n_test], labels[:n_test])}


class DigitsDataModule(L.LightningDataModule):
    """Train and test loaders; under a distributed strategy Lightning shards the training set over the nodes.

    ``partition_alpha``: split the training set across the nodes by a Dirichlet(alpha) label partition (non-IID,
    :class:`~lightning_privdec.data.DirichletPartitionSampler`) instead of Lightning's IID shards.
    """

    def __init__(self, batch_size: int = 32, seed: int = 0, partition_alpha: float | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed
        self.partition_alpha = partition_alpha
        self.tensors: dict[str, tuple[Tensor, Tensor]] = {}

    def setup(self, stage: str | None = None) -> None:
        if not self.tensors:
            self.tensors = load_digits_tensors(self.seed)

    def train_dataloader(self) -> DataLoader:
        train = TensorDataset(*self.tensors["train"])
        if self.partition_alpha is None:
            return DataLoader(train, batch_size=self.batch_size, shuffle=True)
        sampler = DirichletPartitionSampler(self.tensors["train"][1], alpha=self.partition_alpha, seed=self.seed)
        return DataLoader(train, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self) -> DataLoader:
        return self.test_dataloader()

    def test_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*self.tensors["test"]), batch_size=256)


class DigitsClassifier(L.LightningModule):
    """A 64-hidden-unit MLP; no BatchNorm, so it is compatible with per-sample differential privacy.

    ``per_sample_loss=True`` makes ``training_step`` return the per-example losses, as ghost clipping needs.
    """

    def __init__(self, lr: float = 0.1, momentum: float = 0.0, hidden: int = 64, per_sample_loss: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))

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
        self.log("val/acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=False)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test/acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)


@torch.no_grad()
def accuracy(model: nn.Module, features: Tensor, labels: Tensor) -> float:
    """Fraction of correctly classified examples."""
    model.eval()
    return (model(features).argmax(-1) == labels).float().mean().item()
