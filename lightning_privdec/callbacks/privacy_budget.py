"""PrivacyBudgetCallback: each node's epsilon, logged and enforced."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_privdec.privacy import NodePrivacyEngine, PrivacyConfigError
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy


class PrivacyBudgetCallback(Callback):
    """Logs the privacy each node's data has spent and stops training before any node exceeds its target.

    Every value comes from the node's accountant (its :class:`~lightning_privdec.privacy.PrivacyLedger`), which is
    part of the strategy's checkpointed node state: a resumed run continues the count, never resets it.

    Logged keys (every ``log_every_n_steps`` optimizer steps and at the end of training):
    ``privacy/epsilon/node_<i>`` for every node, ``privacy/epsilon_max``, ``privacy/epsilon_min``, ``privacy/delta``,
    ``privacy/noise_multiplier``, ``privacy/sample_rate``, ``privacy/steps``.

    Args:
        log_every_n_steps: logging interval in optimizer steps.
        stop_at_target: with a ``target_epsilon``, stop when the next step would take any node past it. All nodes
            stop at the same step (the decision is shared), so no node is left waiting for a neighbour.
    """

    def __init__(self, log_every_n_steps: int = 10, stop_at_target: bool = True) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.stop_at_target = stop_at_target
        self.epsilons: list[float] = []  # the last logged epsilon of every node
        self.stopped_at_step: int | None = None

    @staticmethod
    def _engine(trainer: pl.Trainer) -> NodePrivacyEngine:
        engine = getattr(trainer.strategy, "privacy", None)
        if not isinstance(engine, NodePrivacyEngine):
            raise RuntimeError("PrivacyBudgetCallback: the private strategy has not been set up yet")
        return engine

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not isinstance(trainer.strategy, PrivateDecentralizedStrategy):  # fail before training, not at the first log
            raise TypeError(
                f"PrivacyBudgetCallback needs a private strategy (DPCSGPStrategy, PrivSGPStrategy, ...); "
                f"the Trainer uses {type(trainer.strategy).__name__}"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = self._engine(trainer)
        if self.stop_at_target and engine.ledger.steps == 0 and engine.next_step_exceeds_budget():
            raise PrivacyConfigError(
                f"target_epsilon={engine.parameters.target_epsilon} cannot pay for a single step with "
                f"noise_multiplier={engine.noise_multiplier:.4g} at sample rate {engine.sample_rate:.4g} "
                f"(one step costs epsilon={engine.ledger.epsilon_if(engine.noise_multiplier, engine.sample_rate):.4g}"
                "); raise the noise multiplier or the budget"
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine(trainer)
        stop = False
        if self.stop_at_target and engine.parameters.target_epsilon is not None:
            stop = trainer.strategy.reduce_boolean_decision(engine.next_step_exceeds_budget(), all=False)
        if stop and not trainer.should_stop:
            trainer.should_stop = True
            self.stopped_at_step = trainer.global_step
            rank_zero_info(
                f"PrivacyBudgetCallback: stopping after step {trainer.global_step}: one more step would take a node "
                f"past target_epsilon={engine.parameters.target_epsilon} (delta={engine.delta})."
            )
        if stop or trainer.global_step % self.log_every_n_steps == 0:
            self._log(trainer, pl_module, engine)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module, self._engine(trainer), final=True)

    def _log(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, engine: NodePrivacyEngine, final: bool = False
    ) -> None:
        local = torch.tensor([engine.epsilon()], dtype=torch.float64, device=trainer.strategy.root_device)
        self.epsilons = trainer.strategy.all_gather(local).reshape(-1).tolist()
        metrics = {f"privacy/epsilon/node_{i}": eps for i, eps in enumerate(self.epsilons)}
        metrics.update(
            {
                "privacy/epsilon_max": max(self.epsilons),
                "privacy/epsilon_min": min(self.epsilons),
                "privacy/delta": engine.delta,
                "privacy/noise_multiplier": float(engine.noise_multiplier or 0.0),
                "privacy/sample_rate": float(engine.sample_rate or 0.0),
                "privacy/steps": float(engine.ledger.steps),
            }
        )
        if final:  # hooks outside the training step cannot use self.log: write to the loggers directly
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
            return
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
