"""ConsensusErrorCallback: how far each node's model is from the network average."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_privdec.callbacks._parameters import trainable_vector
from lightning_privdec.strategies.checks import gather_tensors


class ConsensusErrorCallback(Callback):
    """Per-node consensus error ``||z_i - z_bar||^2`` and its relative form ``||z_i - z_bar||^2 / ||z_bar||^2``.

    ``z_i`` is node i's (de-biased) model, the parameters its module holds; ``z_bar`` is their average over all nodes.

    Monitoring only: computing ``z_bar`` needs a GLOBAL all-reduce of every node's full parameter vector, a collective
    that decentralized training itself never uses. It costs one model-sized all-reduce every ``every_n_steps`` steps
    and reveals the network-average model to every node (under Decor's threat model that is an extra release: keep it
    off in deployments that rely on it). Leave the callback out, or pass ``every_n_steps=0``, to turn it off.

    Logged keys: ``consensus/distance_sq/node_<i>``, ``consensus/relative/node_<i>``, ``consensus/distance_sq_max``,
    ``consensus/distance_sq_mean``, ``consensus/relative_max``, ``consensus/relative_mean``.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"every_n_steps must be a non-negative integer (0 turns it off); got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.last: dict[str, float] = {}

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            pl_module.log_dict(self.measure(trainer, pl_module), on_step=True, on_epoch=False, rank_zero_only=True)

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        """All nodes together: every node's distance to the average (a collective: call it on every node)."""
        strategy = trainer.strategy
        z = trainable_vector(pl_module).to(torch.float64)
        z_bar = strategy.reduce(z.clone(), reduce_op="sum") / strategy.world_size
        distance_sq = torch.sum((z - z_bar) ** 2)
        relative = distance_sq / torch.clamp(torch.sum(z_bar**2), min=torch.finfo(torch.float64).tiny)
        per_node = gather_tensors(torch.stack([distance_sq, relative])).cpu()
        metrics = {f"consensus/distance_sq/node_{i}": float(v) for i, v in enumerate(per_node[:, 0])}
        metrics.update({f"consensus/relative/node_{i}": float(v) for i, v in enumerate(per_node[:, 1])})
        metrics.update(
            {
                "consensus/distance_sq_max": float(per_node[:, 0].max()),
                "consensus/distance_sq_mean": float(per_node[:, 0].mean()),
                "consensus/relative_max": float(per_node[:, 1].max()),
                "consensus/relative_mean": float(per_node[:, 1].mean()),
            }
        )
        self.last = metrics
        return metrics
