"""One node's local DP-SGD mechanics: Poisson sampling, per-sample clipping and its own Gaussian noise.

Per step (Abadi et al. 2016, Alg. 1, on this node's shard only): Poisson-sample a batch at rate q = B / J, compute
per-sample gradients, clip each to C, sum, add this node's own N(0, sigma^2 C^2 I) and divide by the expected batch
size qJ. Every node draws its own noise: it never comes from a shared or central source.

This module holds the mechanics only; which C and sigma a step uses, and what it costs, are each paper's algorithm
(:mod:`lightning_privdec.algorithms`) and its accountant (:mod:`.accounting`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from lightning_privdec.privacy.config import PrivacyParameters
from lightning_privdec.privacy.dp_step import DPStepStats, noise_clipped_sum
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.noise import node_noise_generator, seed_caveat
from lightning_privdec.privacy.per_sample import (
    DEFAULT_GRAD_SAMPLE_MODE,
    GhostClipping,
    PerSampleGradients,
    check_private_model,
)
from lightning_privdec.privacy.sampling import poisson_dataloader, sampler_shard_indices


def check_sampler_is_replaceable(sampler: Sampler, num_examples: int) -> None:
    """Refuse a training sampler whose choice of examples Poisson sampling would silently drop.

    Kept: shuffling or sequential order (Poisson sampling replaces both) and a ``DistributedSampler`` (it only says
    which examples are this node's). Refused: any other sampler (weights, replacement, a subset, a custom order),
    also when Lightning has wrapped it in its ``DistributedSamplerWrapper``.
    """
    inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # Lightning's DistributedSamplerWrapper
    if isinstance(sampler, DistributedSampler) and inner is None:
        return
    user = inner if inner is not None else sampler
    if isinstance(user, SequentialSampler):
        return
    if isinstance(user, RandomSampler) and not user.replacement and user.num_samples == num_examples:
        return
    raise PrivacyConfigError(
        f"the training DataLoader's sampler is a {type(user).__name__}, which private strategies cannot keep: the "
        "accountant's amplification by subsampling assumes that every example of a node's shard joins each batch "
        "independently with the same probability q = B / J (Poisson sampling), so the strategy draws the batches "
        "itself and the sampler's weights, order or subset would be lost. Remove sampler= (for class imbalance, "
        "weight the loss instead, e.g. F.cross_entropy(logits, y, weight=class_weights)); to choose which examples "
        "a node holds, use a DistributedSampler that states them as node_indices (as DirichletPartitionSampler does), "
        "or give each process a dataset of only its own examples and pass node_local_data=True."
    )


class LocalDPSGD:
    """Per-sample clipping, per-node noise and Poisson sampling of one node.

    Args:
        parameters: the user's privacy parameters (validated here).
        rank: this node's id (keys its own noise and sampling streams).
        device: where the noise is drawn (the model's device).
        grad_sample_mode: ``"bookkeeping"`` (default: one backward pass, per-sample norms and the clipped sum
            without per-sample gradients in memory), ``"hooks"`` (Opacus's per-layer rules, per-sample gradients
            materialised), ``"functorch"`` (``training_step`` returns the batch mean of per-example losses in these
            three), or ``"ghost"`` (ghost clipping: two backward passes; ``training_step`` must return per-sample
            losses).
        noise_seed: ``None`` (default) keys noise and sampling with 256 bits of OS entropy each; an int makes them
            reproducible (tests only, NOT private: whoever knows the seed knows the noise).
        secure_mode: Gaussian noise with Opacus's floating-point mitigation (:mod:`.noise`; 4x the noise cost).
    """

    def __init__(
        self,
        parameters: PrivacyParameters,
        *,
        rank: int,
        device: torch.device,
        grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE,
        noise_seed: int | None = None,
        secure_mode: bool = False,
    ) -> None:
        self.parameters = parameters.validate()
        self.rank = rank
        self.grad_sample_mode = grad_sample_mode
        self.noise_seed = noise_seed
        self.secure_mode = secure_mode
        self.noise_generator = node_noise_generator(device, noise_seed, rank, stream="noise", secure_mode=secure_mode)
        self.sampling_generator = node_noise_generator("cpu", noise_seed, rank, stream="sampling")
        self.per_sample: PerSampleGradients | None = None
        self.ghost: GhostClipping | None = None
        self.loss_scale = 1.0  # precision="16-mixed": the GradScaler's scale of the current step's loss
        self._module: nn.Module | None = None
        self._ghost_norms: torch.Tensor | None = None
        self.noise_multiplier: float | None = None
        self.sample_rate: float | None = None
        self.expected_batch_size: float | None = None
        self.last_step: DPStepStats | None = None
        self.micro_batches = 1  # physical micro-batches per Poisson-sampled logical batch (accumulate_grad_batches)
        self._accumulated: list[torch.Tensor] | None = None  # clipped sums of this logical step's earlier micro-batches
        self._accumulated_norms: list[torch.Tensor] = []
        self._examples: tuple[Any, Any] | None = None  # (the shard, the loader's collate_fn): the probe's batches
        self.examples_checked: str | None = None  # what check_examples found for the attached model

    # ---- setup ---------------------------------------------------------------------------------------------------
    @property
    def privacy_caveat(self) -> str:
        """What every line stating this node's privacy ends with: the fixed-seed caveat, or nothing."""
        return seed_caveat(self.noise_seed)

    def attach(self, module: nn.Module, fix_model: bool = False) -> None:
        """Validate (or fix) the model for per-sample DP and attach per-sample gradient hooks to it in place."""
        if self._module is module:
            return  # a second fit of the same model: the hooks carry on
        self.detach()
        check_private_model(module, fix=fix_model)
        self._module = module
        self.examples_checked = None
        if self.grad_sample_mode == "ghost":
            self.ghost = GhostClipping(module, self.parameters.max_grad_norm)
        else:
            self.per_sample = PerSampleGradients(module, mode=self.grad_sample_mode)

    def detach(self) -> None:
        """Remove the per-sample hooks from the model they are attached to."""
        for hooks in (self.per_sample, self.ghost):
            if hooks is not None:
                hooks.detach()
        self.per_sample = self.ghost = None
        self._module = None

    def set_loss_scale(self, scale: float) -> None:
        """``precision="16-mixed"``: the next backward pass's loss (ghost clipping's per-sample losses) is multiplied
        by ``scale``; per-example gradients are unscaled before clipping and an example's overflowed (non-finite) rows
        are zeroed rather than skipping the step (:meth:`PerSampleGradients.set_loss_scale`)."""
        self.loss_scale = float(scale)
        for hooks in (self.per_sample, self.ghost):
            if hooks is not None:
                hooks.set_loss_scale(scale)

    def take_nonfinite_examples(self) -> int:
        """Examples with an overflowed (zeroed) per-example gradient part since the last call (16-mixed only)."""
        hooks = self.per_sample if self.per_sample is not None else self.ghost
        return hooks.take_nonfinite_examples() if hooks is not None else 0

    def ghost_backward(self, per_sample_losses: torch.Tensor) -> None:
        """Ghost clipping's two backward passes; ``p.grad`` then holds the sum of clipped per-sample gradients."""
        assert self.ghost is not None
        self._ghost_norms = self.ghost.backward(per_sample_losses)

    def sample_shard(
        self,
        dataloader: DataLoader,
        world_size: int = 1,
        node_local_data: bool = False,
        micro_batches: int = 1,
        steps_per_epoch: int | None = None,
    ) -> DataLoader:
        """Replace the node's training loader by Poisson sampling of its shard (sets q and the expected batch size).

        The batches per epoch are ``steps_per_epoch`` (common to all nodes, so all gossip the same number of rounds;
        default: those of the user's loader); q = B / J uses this node's own shard size J, so nodes holding more
        data sample at a lower rate and spend less epsilon. With ``micro_batches = k > 1`` (Lightning's
        ``accumulate_grad_batches``) each step is ONE Poisson batch of expected size k B (q = k B / J), handed to
        Lightning as k micro-batches: one noise draw, one ledger entry and one gossip round per logical step.
        """
        batch_size = dataloader.batch_size
        if batch_size is None:
            raise PrivacyConfigError(
                "the training DataLoader has no batch_size (a custom batch_sampler?): private strategies need "
                "DataLoader(dataset, batch_size=B) to set the Poisson sampling rate q = B / J"
            )
        sampler = dataloader.sampler
        num_examples = len(dataloader.dataset)  # type: ignore[arg-type]
        check_sampler_is_replaceable(sampler, num_examples)
        if isinstance(sampler, DistributedSampler):  # Lightning decides the shard; padding duplicates are dropped
            shard = sampler_shard_indices(sampler, num_examples)
        elif world_size == 1 or node_local_data:
            shard = list(range(num_examples))  # the loader already holds only this node's data
        else:
            raise PrivacyConfigError(
                "the training DataLoader has no DistributedSampler, so every node would sample the WHOLE dataset and "
                "each example would be released by all nodes (the per-node epsilon would understate its loss). "
                "Keep Lightning's use_distributed_sampler=True, or, if each process really loads only its own "
                "data, pass node_local_data=True to the strategy"
            )
        shard_size = len(shard)
        if micro_batches > 1 and not self.supports_micro_batches:
            raise PrivacyConfigError(self.micro_batch_refusal)
        self.micro_batches = micro_batches
        batch_size = self._batch_size_for_shard(batch_size * micro_batches, shard_size)
        if not 0 < batch_size <= shard_size:
            raise PrivacyConfigError(
                f"batch_size={batch_size} does not fit node {self.rank}'s shard of {shard_size} examples; "
                "use a batch size between 1 and the shard size, or fewer nodes"
            )
        self.sample_rate = batch_size / shard_size
        private = poisson_dataloader(
            dataloader, shard, self.sample_rate, generator=self.sampling_generator,
            steps_per_epoch=max(1, (steps_per_epoch or len(dataloader)) // micro_batches), micro_batches=micro_batches,
        )
        self.expected_batch_size = self.sample_rate * shard_size
        self._examples = (private.dataset, private.collate_fn)
        return private

    def check_examples(self, backward: Callable[[Any], Any]) -> str | None:
        """Before the first step on the attached model (once): refuse, naming the layer or the loss and the fix,
        per-sample gradients that are not per example (:meth:`PerSampleGradients.check_examples`). The probe's
        batches are the first m examples of the shard (m the expected (micro-)batch size, 2 to 64), collated with
        the training loader's ``collate_fn`` and passed to ``backward(batch)``, which runs the user's forward and
        backward without changing the model's train/eval mode and says whether there was a loss. The sampling and
        noise generators are not touched. Returns the probe's summary (None: no per-example clipping to check, as
        Decor's user-level clipping)."""
        hooks = self.per_sample if self.per_sample is not None else self.ghost
        if hooks is None or self._examples is None or self.examples_checked is not None:
            return self.examples_checked
        shard, collate = self._examples
        size = round((self.expected_batch_size or 2) / self.micro_batches)
        examples = min(len(shard), 64, max(2, size))
        self.examples_checked = hooks.check_examples(
            lambda indices: backward(collate([shard[i] for i in indices])), examples
        )
        return self.examples_checked

    def _batch_size_for_shard(self, batch_size: int, shard_size: int) -> int:
        """The expected batch size B this node samples with (q = B / J); engines with other sampling rules override."""
        return batch_size

    # ---- the step ------------------------------------------------------------------------------------------------
    #: whether a logical batch may arrive as several micro-batches (engines that must see the whole batch at once
    #: override this with the reason in :attr:`micro_batch_refusal`)
    supports_micro_batches = True
    micro_batch_refusal = ""

    @property
    def step_max_grad_norm(self) -> float:
        """The clip bound C of the step being taken (Dyn-D2P's follows its schedule)."""
        return self.parameters.max_grad_norm

    def _clipped_sum_into_grads(self, max_grad_norm: float) -> torch.Tensor:
        """p.grad <- the sum of this (micro-)batch's per-sample gradients clipped to C, in any per-sample mode;
        returns the unclipped norms. The per-sample state is cleared for the next batch."""
        if self.ghost is not None:
            norms = self._ghost_norms
            if norms is None:  # training_step returned None: no backward, nothing to clip
                for p in self.ghost.parameters:
                    p.grad = torch.zeros_like(p)
                norms = torch.zeros(0, device=self.ghost.parameters[0].device)
            self._ghost_norms = None
            return norms
        assert self.per_sample is not None
        norms = self.per_sample.clip_and_sum(max_grad_norm)  # book-keeping never materialises per-sample gradients
        self.per_sample.clear()
        return norms

    @property
    def _trainable(self) -> list[nn.Parameter]:
        hooks = self.ghost if self.ghost is not None else self.per_sample
        assert hooks is not None
        return hooks.parameters

    def accumulate_micro_batch(self) -> None:
        """Clip one micro-batch of a logical Poisson batch and keep its clipped sum for the step's single noise draw
        (Opacus's BatchMemoryManager, with Lightning's ``accumulate_grad_batches``); ``p.grad`` is freed."""
        norms = self._clipped_sum_into_grads(self.step_max_grad_norm)
        params = self._trainable
        if self._accumulated is None:
            self._accumulated = [p.grad.detach().clone() for p in params]
        else:
            for total, p in zip(self._accumulated, params):
                total.add_(p.grad)
        self._accumulated_norms.append(norms)
        for p in params:
            p.grad = None

    def clip_and_noise(self, max_grad_norm: float, noise_multiplier: float) -> DPStepStats:
        """p.grad <- (sum of per-sample gradients clipped to C + N(0, sigma^2 C^2 I)) / qJ over the whole logical
        batch (its micro-batches included), in any per-sample mode. Records nothing: the caller accounts for the
        step."""
        assert self.expected_batch_size is not None
        norms = self._clipped_sum_into_grads(max_grad_norm)
        params = self._trainable
        if self._accumulated is not None:  # the earlier micro-batches of this logical batch
            for p, total in zip(params, self._accumulated):
                p.grad.add_(total)
            norms = torch.cat([*self._accumulated_norms, norms.to(self._accumulated_norms[0].device)])
            self._accumulated, self._accumulated_norms = None, []
        return noise_clipped_sum(
            params, norms, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
            expected_batch_size=self.expected_batch_size, generator=self.noise_generator,
        )

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    def generator_state(self) -> dict[str, Any]:
        if self.noise_seed is None:
            return {}
        return {
            "noise_generator": self.noise_generator.get_state(),
            "sampling_generator": self.sampling_generator.get_state(),
        }

    def load_generator_state(self, state: Mapping[str, Any]) -> None:
        if self.noise_seed is not None and "noise_generator" in state:
            self.noise_generator.set_state(state["noise_generator"])
            self.sampling_generator.set_state(state["sampling_generator"])
