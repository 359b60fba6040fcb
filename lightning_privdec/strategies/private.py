"""The private step shared by every private strategy: local DP-SGD on each node, then the algorithm's gossip.

Each node Poisson-samples its own shard at q = B / J, clips per-sample gradients to C, adds its OWN Gaussian noise
N(0, sigma^2 C^2 I), divides by qJ, and records the step in its own ledger (:class:`NodePrivacyEngine`). The gossip
that follows only sees privatized updates, so it is post-processing: compression costs no privacy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_privdec.privacy import NodePrivacyEngine, PrivacyConfigError, PrivacyParameters
from lightning_privdec.strategies.base import DecentralizedStrategy


class PrivateDecentralizedStrategy(DecentralizedStrategy):
    """Base of the private strategies: a :class:`DecentralizedStrategy` whose gradients are privatized per node.

    Args:
        max_grad_norm: per-sample clipping bound C.
        noise_multiplier: sigma; or give ``target_epsilon`` and ``target_delta`` and sigma is calibrated before
            training from the planned steps (``max_steps``, or ``max_epochs`` x batches per epoch) and q = B / J.
        accountant: ``"rdp"``, ``"prv"`` or ``"gdp"`` (Opacus's accountants).
        grad_sample_mode: ``"hooks"`` (default) or ``"functorch"`` per-sample gradients.
        fix_model: replace layers incompatible with per-sample DP (BatchNorm -> GroupNorm) instead of raising.
        noise_seed: ``None`` (default, secure): noise and sampling from OS entropy; an int: reproducible streams
            derived from (seed, rank), for tests only.
        Other arguments: see :class:`DecentralizedStrategy`.
    """

    def __init__(
        self,
        topology: Any = "exponential",
        compressor: Any = None,
        *,
        max_grad_norm: float,
        noise_multiplier: float | None = None,
        target_epsilon: float | None = None,
        target_delta: float | None = None,
        accountant: str = "rdp",
        grad_sample_mode: str = "hooks",
        fix_model: bool = False,
        noise_seed: int | None = None,
        **kwargs: Any,
    ) -> None:
        # the privacy parameters are checked first, before any process or graph exists
        self.privacy_parameters = PrivacyParameters(
            max_grad_norm=max_grad_norm,
            noise_multiplier=noise_multiplier,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            accountant=accountant,
        ).validate()
        super().__init__(topology, compressor, **kwargs)
        self.grad_sample_mode = grad_sample_mode
        self.fix_model = fix_model
        self.noise_seed = noise_seed
        self.privacy: NodePrivacyEngine | None = None

    def configure_ddp(self) -> None:
        # Fix and hook the model before its parameters are broadcast, flattened and handed to the optimizer.
        self.privacy = NodePrivacyEngine(
            self.privacy_parameters,
            rank=self.global_rank,
            device=self.root_device,
            grad_sample_mode=self.grad_sample_mode,
            noise_seed=self.noise_seed,
        )
        self.privacy.attach(self.model, fix_model=self.fix_model)
        super().configure_ddp()

    def _check_optimization(self, trainer: pl.Trainer) -> None:
        super()._check_optimization(trainer)
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            raise PrivacyConfigError(
                f"{type(self).__name__} supports automatic optimization only: with manual optimization the "
                "strategy cannot tell which backward passes make one private step. Remove "
                "`self.automatic_optimization = False`."
            )
        if trainer.accumulate_grad_batches != 1:
            raise PrivacyConfigError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches} would merge several Poisson batches into "
                "one noisy step, which the accountant does not model. Use a larger batch_size instead."
            )

    # ---- data: Poisson sampling of this node's shard ---------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or self.privacy is None:
            return dataloader
        if not isinstance(dataloader, DataLoader):
            raise PrivacyConfigError(
                f"private strategies need a torch DataLoader for training (got {type(dataloader).__name__}) to "
                "Poisson-sample each node's shard"
            )
        return self.privacy.private_dataloader(dataloader, self._planned_steps(trainer, len(dataloader)))

    @staticmethod
    def _planned_steps(trainer: pl.Trainer, batches_per_epoch: int) -> int:
        limit = trainer.limit_train_batches
        if isinstance(limit, int):
            batches_per_epoch = min(batches_per_epoch, limit)
        elif limit is not None and limit < 1.0:
            batches_per_epoch = max(1, int(batches_per_epoch * limit))
        epochs = trainer.max_epochs if trainer.max_epochs is not None else -1
        by_epochs = epochs * batches_per_epoch if epochs >= 0 else None
        if trainer.max_steps is not None and trainer.max_steps >= 0:
            return trainer.max_steps if by_epochs is None else min(trainer.max_steps, by_epochs)
        if by_epochs is None:
            raise PrivacyConfigError(
                "the privacy budget is spent over the planned number of steps, but this Trainer has no end: "
                "set max_steps or max_epochs"
            )
        return by_epochs

    # ---- the step ------------------------------------------------------------------------------------------------
    def transform_gradients(self) -> None:
        assert self.privacy is not None
        self.privacy.privatize()

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def node_state_dict(self) -> dict[str, Any]:
        state = super().node_state_dict()
        assert self.privacy is not None
        state["privacy"] = self.privacy.state_dict()
        return state

    def load_node_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_node_state_dict(state)
        assert self.privacy is not None
        self.privacy.load_state_dict(state["privacy"])
