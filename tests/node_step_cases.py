"""What tests/test_node_step.py fits two ways, the Trainer's and the simulator's: every private strategy, 2 nodes,
a fixed noise seed, 4 steps of the pinned-epsilon run's 3-class problem (each node its own 64 examples, batch 16)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec.comm import pack
from tests.test_pinned_epsilon import CONFIGURATIONS, Classifier

NODES, STEPS, BATCH, LR = 2, 4, 16, 0.05  # LR: Classifier's SGD


def strategy_arguments(name: str, key_dir: Path) -> dict[str, Any]:
    """The strategy's arguments: the pinned run's noise levels, a fixed noise seed, each node's own data; Decor's
    X25519 keys kept in ``key_dir`` so that the simulator agrees the same pairwise secrets."""
    extra = {"key_file_dir": str(key_dir)} if name == "decor" else {}
    return {**CONFIGURATIONS["noise"][name], "noise_seed": 0, "node_local_data": True, **extra}


def node_data(rank: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(100 + rank)
    return TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator))


class NodeClassifier(Classifier):
    """The pinned run's model, training on its node's own data."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(node_data(self.global_rank), batch_size=BATCH)


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Classifier.training_step's loss, for the simulator."""
    return F.cross_entropy(output, target)


def outcome(model: torch.nn.Module, ledger: Any, sent: list[dict[int, list[torch.Tensor]]]) -> dict[str, Any]:
    """What the two paths must agree on, bit for bit: the final parameters, the ledger, every message's bytes."""
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad]).clone(),
        "ledger": ledger.state_dict(),
        "sent": [{peer: bytes(pack(tensors).numpy()) for peer, tensors in round_.items()} for round_ in sent],
    }
