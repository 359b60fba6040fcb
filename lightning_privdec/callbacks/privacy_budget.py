"""PrivacyBudgetCallback: each node's epsilon, logged and enforced."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_privdec.strategies.checks import gather_tensors
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy


class PrivacyBudgetCallback(Callback):
    """Logs the privacy each node's data has spent, from the node's accountant.

    Every value comes from the node's :class:`~lightning_privdec.privacy.PrivacyLedger`, which is part of the
    strategy's checkpointed node state: a resumed run continues the count, never resets it. The budget itself is
    enforced by the private strategy (privacy must not depend on an optional callback): when the next step would take
    any node past ``target_epsilon``, every node stops at the same step with a message; this callback reports it.

    Logged keys (every ``log_every_n_steps`` optimizer steps and at the end of training):
    ``privacy/epsilon/node_<i>`` for every node, ``privacy/epsilon_max``, ``privacy/epsilon_min``, ``privacy/delta``,
    ``privacy/noise_multiplier``, ``privacy/sample_rate``, ``privacy/steps``. Engines with a schedule that also offer
    the paper's own (approximate) accounting (Dyn-D2P: ``paper_epsilon()``, ``current_clip``, ``current_noise_std``)
    add ``privacy/epsilon_paper_clt/node_<i>`` and ``privacy/epsilon_paper_clt_max`` (the paper's CLT value, NOT the
    epsilon spent, which stays ``privacy/epsilon/...``), and ``privacy/max_grad_norm``, ``privacy/noise_std`` (the
    clip and noise std of the next step).
    """

    def __init__(self, log_every_n_steps: int = 10) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.epsilons: list[float] = []  # the last logged epsilon of every node

    @staticmethod
    def _strategy(trainer: pl.Trainer) -> PrivateDecentralizedStrategy:
        if not isinstance(trainer.strategy, PrivateDecentralizedStrategy):
            raise TypeError(
                f"PrivacyBudgetCallback needs a private strategy (DPCSGPStrategy, PrivSGPStrategy, ...); "
                f"the Trainer uses {type(trainer.strategy).__name__}"
            )
        return trainer.strategy

    @property
    def stopped_at_step(self) -> int | None:
        """The step at which the strategy stopped training to stay within the budget (None if it did not)."""
        return self._stopped_at_step

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._strategy(trainer)  # fail before training, not at the first log
        self._stopped_at_step: int | None = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.log_every_n_steps == 0:
            self._log(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stopped_at_step = self._strategy(trainer).budget_stopped_at_step
        self._log(trainer, pl_module, final=True)

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, final: bool = False) -> None:
        engine = self._strategy(trainer).privacy
        assert engine is not None
        local = torch.tensor([engine.epsilon()], dtype=torch.float64, device=trainer.strategy.root_device)
        self.epsilons = gather_tensors(local).reshape(-1).tolist()
        metrics = {f"privacy/epsilon/node_{i}": eps for i, eps in enumerate(self.epsilons)}
        metrics.update(
            {
                "privacy/epsilon_max": max(self.epsilons),
                "privacy/epsilon_min": min(self.epsilons),
                "privacy/delta": engine.delta,
                "privacy/noise_multiplier": float(engine.noise_multiplier or 0.0),
                "privacy/sample_rate": float(engine.sample_rate or 0.0),
                "privacy/steps": float(engine.steps),
            }
        )
        if callable(getattr(engine, "paper_epsilon", None)):  # same engine type on every node: the gather matches
            local = torch.tensor([engine.paper_epsilon()], dtype=torch.float64, device=trainer.strategy.root_device)
            paper = gather_tensors(local).reshape(-1).tolist()
            metrics.update({f"privacy/epsilon_paper_clt/node_{i}": eps for i, eps in enumerate(paper)})
            metrics["privacy/epsilon_paper_clt_max"] = max(paper)
            metrics["privacy/max_grad_norm"] = float(engine.current_clip)
            metrics["privacy/noise_std"] = float(engine.current_noise_std)
        if final:  # hooks outside the training step cannot use self.log: write to the loggers directly
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
            return
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
