"""CommunicationCostCallback: the bytes each node really put on and took off the wire."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_privdec.strategies.base import DecentralizedStrategy
from lightning_privdec.strategies.checks import gather_tensors


class CommunicationCostCallback(Callback):
    """Bytes sent and received per node, per step and cumulative, and the compression ratio.

    The counts are the exchange's own (the packed buffers handed to torch.distributed), so they include every payload,
    the push-sum weight and compressor metadata. The compression ratio of a step is what the same algorithm's
    uncompressed messages to the same out-neighbours would take (full-precision model, push-sum weight; CPGT's two
    vectors), divided by the bytes actually sent: exactly 1 without a compressor.

    Reading the counters needs one small all-gather (a few numbers per node) every ``every_n_steps`` steps, for
    monitoring only, and once more at the end of training, so the totals include the last steps.

    Logged keys: ``comm/bytes_sent/node_<i>``, ``comm/bytes_received/node_<i>`` (last step),
    ``comm/bytes_sent_total/node_<i>``, ``comm/bytes_received_total/node_<i>`` (cumulative, resumed runs included),
    ``comm/bytes_sent_mean`` (per node, last step), ``comm/bytes_sent_total`` (all nodes, cumulative),
    ``comm/compression_ratio`` (mean over nodes).
    """

    def __init__(self, every_n_steps: int = 10) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer; got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.last: dict[str, float] = {}
        self._logged_step: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, DecentralizedStrategy):
            raise TypeError(
                "CommunicationCostCallback counts gossip bytes and needs a lightning_privdec strategy; the Trainer "
                f"uses {type(trainer.strategy).__name__}"
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            pl_module.log_dict(self.measure(trainer), on_step=True, on_epoch=False, rank_zero_only=True)
            self._logged_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The totals after the last step (Lightning allows no ``self.log`` here: written to the loggers directly)."""
        strategy = trainer.strategy
        if trainer.global_step == self._logged_step or getattr(strategy, "gossip", None) is None:
            return
        metrics = self.measure(trainer)  # a collective: every node
        self._logged_step = trainer.global_step
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def measure(self, trainer: pl.Trainer) -> dict[str, float]:
        """Every node's counters (a collective: call it on every node)."""
        strategy = trainer.strategy
        assert isinstance(strategy, DecentralizedStrategy) and strategy.gossip is not None
        assert strategy.flat is not None and strategy.topology is not None
        traffic = strategy.gossip.exchange.traffic
        last_round = max(traffic.rounds - 1, 0)
        out_degree = len(strategy.topology.out_peers(strategy.global_rank, last_round))
        dense = out_degree * strategy.gossip.uncompressed_message_nbytes()
        ratio = dense / traffic.last_bytes_sent if traffic.last_bytes_sent else 0.0
        local = torch.tensor(
            [traffic.last_bytes_sent, traffic.last_bytes_received, traffic.bytes_sent, traffic.bytes_received, ratio],
            dtype=torch.float64,
            device=strategy.root_device,
        )
        per_node = gather_tensors(local).cpu()
        metrics: dict[str, float] = {}
        for column, name in enumerate(("bytes_sent", "bytes_received", "bytes_sent_total", "bytes_received_total")):
            metrics.update({f"comm/{name}/node_{i}": float(v) for i, v in enumerate(per_node[:, column])})
        metrics.update(
            {
                "comm/bytes_sent_mean": float(per_node[:, 0].mean()),
                "comm/bytes_sent_total": float(per_node[:, 2].sum()),
                "comm/compression_ratio": float(per_node[:, 4].mean()),
            }
        )
        self.last = metrics
        return metrics
