"""A 2-process private run that is refused at setup, for the one-message-per-run test.

``python tests/scripts/bad_setup.py batch_norm``: a model with 12 BatchNorm layers on every node;
``python tests/scripts/bad_setup.py model``: node 1's model has a wider first layer than node 0's.
Lightning's subprocess launcher (the strategy's default) starts rank 1 by running this script again, as for a user's
script: the test checks what such a user sees, every rank's own output on one console.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec import PrivSGPStrategy


class Model(L.LightningModule):
    def __init__(self, batch_norms: int, width: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(8, width)]
        for _ in range(batch_norms):
            layers += [nn.BatchNorm1d(width), nn.Linear(width, width)]
        self.net = nn.Sequential(*layers, nn.Tanh(), nn.Linear(width, 2))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    case = sys.argv[1]
    rank = int(os.environ.get("LOCAL_RANK", 0))  # set by the launcher for rank 1
    torch.set_num_threads(1)
    model = Model(batch_norms=12, width=16) if case == "batch_norm" else Model(batch_norms=0, width=16 + 16 * rank)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        strategy=PrivSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=0))
    trainer.fit(model, DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8))


if __name__ == "__main__":
    main()
