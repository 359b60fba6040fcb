"""PrivacyBudgetCallback: each node's epsilon, logged and enforced."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_privdec.strategies.checks import gather_tensors
from lightning_privdec.strategies.private import PrivateDecentralizedStrategy


#: logged beside the epsilons of a run with a fixed ``noise_seed``
NOT_PRIVATE_KEY = "privacy/not_private_fixed_noise_seed"


class PrivacyBudgetCallback(Callback):
    """Logs the privacy each node's data has spent, from the node's accountant.

    Every value comes from the node's accountant (:class:`~lightning_privdec.privacy.accounting.Accountant`), which is
    part of the strategy's checkpointed node state: a resumed run continues the count, never resets it. The budget
    itself is enforced by the private strategy (privacy must not depend on an optional callback): when the next step
    would take any node past ``target_epsilon``, every node stops at the same step with a message; this callback
    reports it.

    Logged keys (every ``log_every_n_steps`` optimizer steps and at the end of training):
    ``privacy/epsilon/node_<i>`` for every node, ``privacy/epsilon_max``, ``privacy/epsilon_min``, ``privacy/delta``,
    ``privacy/noise_multiplier``, ``privacy/sample_rate``, ``privacy/steps``: the node's accountant's
    :meth:`~lightning_privdec.privacy.accounting.Accountant.metrics` (gathered from every node) and the algorithm's
    ``step_metrics()``. Dyn-D2P's accountant adds ``privacy/epsilon_paper_clt/node_<i>`` and
    ``privacy/epsilon_paper_clt_max`` (the paper's CLT value, NOT the epsilon spent, which stays
    ``privacy/epsilon/...``), its node ``privacy/max_grad_norm`` and ``privacy/noise_std`` (the clip and noise std of
    the next step). A run with a fixed ``noise_seed`` (not private: whoever knows the seed knows the noise) also logs
    ``privacy/not_private_fixed_noise_seed`` = 1 with every one of these, so that no logged epsilon of it stands alone.
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
        node = self._strategy(trainer).privacy
        assert node is not None
        # every node's accountant metrics (same keys on every node: the configuration is checked at setup)
        mine = node.ledger.metrics()
        local = torch.tensor(list(mine.values()), dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = gather_tensors(local).reshape(-1, len(mine)).tolist()
        metrics: dict[str, float] = {}
        for column, key in enumerate(mine):
            values = [row[column] for row in gathered]
            metrics.update({f"privacy/{key}/node_{i}": value for i, value in enumerate(values)})
            metrics[f"privacy/{key}_max"] = max(values)
        self.epsilons = [row[0] for row in gathered]
        metrics["privacy/epsilon_min"] = min(self.epsilons)
        metrics["privacy/delta"] = node.delta
        metrics.update({f"privacy/{key}": value for key, value in node.step_metrics().items()})
        if node.privacy_caveat:
            metrics[NOT_PRIVATE_KEY] = 1.0
        if final:  # hooks outside the training step cannot use self.log: write to the loggers directly
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
            return
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
