"""One node's local DP-SGD pieces, each held by the papers that use it (:mod:`lightning_privdec.algorithms`):

* :class:`ShardSampler` - Poisson sampling of the node's shard at q = B / J (every paper);
* :class:`PerSampleClipping` - per-sample gradients of the node's model clipped to C and summed, in any per-sample
  mode, micro-batches of one logical batch accumulated (every paper but Decor's user level);
* :class:`GaussianMechanism` - this node's own N(0, sigma^2 C^2 I) on the clipped sum, divided by qJ
  (:func:`noise_clipped_sum`; DP-CSGP, Dyn-D2P; PrivSGP-VR and Decor draw from its generator for their own noise).

Together they are Abadi et al. 2016, Alg. 1, on this node's shard only. Every node draws its own noise: it never
comes from a shared or central source. Which C and sigma a step uses, and what it costs, are each paper's algorithm
and its accountant (:mod:`.accounting`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from lightning_privdec.privacy.dp_step import DPStepStats
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.noise import NoiseGenerator, node_noise_generator
from lightning_privdec.privacy.per_sample import (
    DEFAULT_GRAD_SAMPLE_MODE,
    GhostClipping,
    PerSampleGradients,
    check_private_model,
    mean_loss_multiplier,
)
from lightning_privdec.privacy.sampling import poisson_dataloader, sampler_shard_indices
from lightning_privdec.privacy.validation import check_max_grad_norm
from lightning_privdec.tensors import KeptBuffers, round_into_grad


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


class ShardSampler:
    """Poisson sampling of one node's shard, from the node's own sampling stream.

    Args:
        rank: this node's id (keys its sampling stream and names it in messages).
        noise_seed: ``None``: the stream is keyed with 256 bits of OS entropy; an int: reproducible (tests only).
        micro_batch_refusal: why a logical batch may not arrive as several micro-batches (None: it may).
        batch_size_for_shard: the expected batch size B sampled from a shard of J for a requested B (default: B).
    """

    def __init__(
        self, *, rank: int, noise_seed: int | None = None, micro_batch_refusal: str | None = None,
        batch_size_for_shard: Callable[[int, int], int] | None = None,
    ) -> None:
        self.rank = rank
        self.generator = node_noise_generator("cpu", noise_seed, rank, stream="sampling")
        self.micro_batch_refusal = micro_batch_refusal
        self.batch_size_for_shard = batch_size_for_shard or (lambda batch_size, shard_size: batch_size)
        self.sample_rate: float | None = None
        self.expected_batch_size: float | None = None
        self.micro_batches = 1  # physical micro-batches per Poisson-sampled logical batch (accumulate_grad_batches)
        self.examples: tuple[Any, Any] | None = None  # (the shard, the loader's collate_fn): the probe's batches

    def sample(
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
        if node_local_data:  # the loader already holds only this node's data
            if getattr(sampler, "node_indices", None) is not None:
                raise PrivacyConfigError(
                    f"node_local_data=True says that each process's loader holds only its own node's data, but the "
                    f"training loader's {type(sampler).__name__} picks node {self.rank}'s examples out of a shared "
                    "dataset. Pass node_local_data=False to keep the partition, or drop the sampler"
                )
            shard = list(range(num_examples))  # a DistributedSampler Lightning added (use_distributed_sampler) too
        elif isinstance(sampler, DistributedSampler):  # Lightning decides the shard; padding duplicates are dropped
            shard = sampler_shard_indices(sampler, num_examples)
        elif world_size == 1:
            shard = list(range(num_examples))
        else:
            raise PrivacyConfigError(
                "the training DataLoader has no DistributedSampler, so every node would sample the WHOLE dataset and "
                "each example would be released by all nodes (the per-node epsilon would understate its loss). "
                "Keep Lightning's use_distributed_sampler=True, or, if each process really loads only its own "
                "data, pass node_local_data=True to the strategy"
            )
        shard_size = len(shard)
        if micro_batches > 1 and self.micro_batch_refusal is not None:
            raise PrivacyConfigError(self.micro_batch_refusal)
        self.micro_batches = micro_batches
        batch_size = self.batch_size_for_shard(batch_size * micro_batches, shard_size)
        if not 0 < batch_size <= shard_size:
            raise PrivacyConfigError(
                f"batch_size={batch_size} does not fit node {self.rank}'s shard of {shard_size} examples; "
                "use a batch size between 1 and the shard size, or fewer nodes"
            )
        self.sample_rate = batch_size / shard_size
        private = poisson_dataloader(
            dataloader, shard, self.sample_rate, generator=self.generator,
            steps_per_epoch=max(1, (steps_per_epoch or len(dataloader)) // micro_batches), micro_batches=micro_batches,
        )
        self.expected_batch_size = self.sample_rate * shard_size
        self.examples = (private.dataset, private.collate_fn)
        return private


class PerSampleClipping:
    """Per-sample gradients of the node's model, each clipped to C, summed into ``p.grad``.

    Args:
        max_grad_norm: C (Dyn-D2P sets each step's C_k here before its backward pass).
        grad_sample_mode: ``"bookkeeping"`` (default: one backward pass, per-sample norms and the clipped sum
            without per-sample gradients in memory), ``"hooks"`` (Opacus's per-layer rules, per-sample gradients
            materialised), ``"functorch"`` (``training_step`` returns the batch mean of per-example losses in these
            three), or ``"ghost"`` (ghost clipping: two backward passes; ``training_step`` must return per-sample
            losses).
    """

    def __init__(self, max_grad_norm: float, grad_sample_mode: str = DEFAULT_GRAD_SAMPLE_MODE) -> None:
        self._max_grad_norm = check_max_grad_norm(max_grad_norm)
        self.grad_sample_mode = grad_sample_mode
        self.per_sample: PerSampleGradients | None = None
        self.ghost: GhostClipping | None = None
        self.loss_scale = 1.0  # precision="16-mixed": the GradScaler's scale of the current step's loss
        self.module: nn.Module | None = None
        self.examples_checked: str | None = None  # what check_examples found for the attached model
        self._ghost_norms: torch.Tensor | None = None
        self._accumulated: list[torch.Tensor] | None = None  # clipped sums of this logical step's earlier micro-batches
        self._clipped_sums: list[torch.Tensor] | None = None  # the last clipped_sum's float64 sums, until taken
        self._accumulated_norms: list[torch.Tensor] = []

    @property
    def max_grad_norm(self) -> float:
        """C of the step being taken."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._max_grad_norm = float(value)
        if self.ghost is not None:
            self.ghost.max_grad_norm = self._max_grad_norm

    def attach(self, module: nn.Module, fix_model: bool = False) -> None:
        """Validate (or fix) the model for per-sample DP and attach per-sample gradient hooks to it in place."""
        if self.module is module:
            return  # a second fit of the same model: the hooks carry on
        self.detach()
        check_private_model(module, fix=fix_model)
        self.module = module
        self.examples_checked = None
        if self.grad_sample_mode == "ghost":
            self.ghost = GhostClipping(module, self.max_grad_norm)
        else:
            self.per_sample = PerSampleGradients(module, mode=self.grad_sample_mode)

    def detach(self) -> None:
        """Remove the per-sample hooks from the model they are attached to."""
        for hooks in (self.per_sample, self.ghost):
            if hooks is not None:
                hooks.detach()
        self.per_sample = self.ghost = None
        self.module = None

    @property
    def hooks(self) -> PerSampleGradients | GhostClipping | None:
        return self.per_sample if self.per_sample is not None else self.ghost

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The attached model's trainable parameters, in the order of the clipped sum."""
        hooks = self.hooks
        if hooks is None:
            raise RuntimeError("per-sample clipping used before attach()")
        return hooks.parameters

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
        hooks = self.hooks
        return hooks.take_nonfinite_examples() if hooks is not None else 0

    def mean_loss_multiplier(self, expected_batch_size: float | None) -> float:
        """What the next backward pass's mean loss is multiplied by, ``B / 2^ceil(log2 E)`` (:func:`~.per_sample.
        mean_loss_multiplier`; the per-example gradients are told): each example's output gradient is then its own
        loss gradient times the run's constant power of two, rounded alike whatever the batch, instead of times a
        1/B that rounds every example's gradient anew when one example leaves (crafted near-cancelling examples
        turned that rounding into 1% of C in float32). 1 without per-sample gradients (ghost clipping)."""
        if self.per_sample is None:
            return 1.0
        multiplier = mean_loss_multiplier(self.per_sample.forward_batch_size, expected_batch_size or None)
        self.per_sample.set_mean_loss_multiplier(multiplier)
        return multiplier

    def ghost_backward(self, per_sample_losses: torch.Tensor, expected_batch_size: float | None = None) -> None:
        """Ghost clipping's backward pass at C (:meth:`GhostClipping.backward`; ``expected_batch_size`` sets its
        power-of-two loss factor); ``p.grad`` then holds the sum of clipped per-sample gradients."""
        assert self.ghost is not None
        self._ghost_norms = self.ghost.backward(per_sample_losses, expected_batch_size)

    def check_examples(self, backward: Callable[[Any], Any], examples: tuple[Any, Any], size: int) -> str | None:
        """Before the first step on the attached model (once): refuse, naming the layer or the loss and the fix,
        per-sample gradients that are not per example (:meth:`PerSampleGradients.check_examples`). The probe's
        batch is the first ``size`` examples of the shard, ``examples`` = (shard, collate_fn), passed to
        ``backward(batch)``, which runs the user's forward and backward without changing the model's train/eval mode
        and says whether there was a loss. Returns the probe's summary."""
        hooks = self.hooks
        if hooks is None or self.examples_checked is not None:
            return self.examples_checked
        shard, collate = examples
        self.examples_checked = hooks.check_examples(
            lambda indices: backward(collate([shard[i] for i in indices])), min(len(shard), size)
        )
        return self.examples_checked

    def _micro_batch_into_grads(self, into_grads: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The sum of this micro-batch's per-sample gradients clipped to C (float64, one per parameter; ``p.grad``
        holds it rounded, with ``into_grads``) and the unclipped norms. The per-sample state is cleared for the next
        batch."""
        if self.ghost is not None:
            norms = self._ghost_norms
            if norms is None:  # training_step returned None: no backward, nothing to clip
                self.ghost.clip_nothing()
                norms = torch.zeros(0, device=self.ghost.parameters[0].device)
            self._ghost_norms = None
            return norms, self.ghost.take_clipped_sums()
        assert self.per_sample is not None
        # book-keeping: not the batch's per-sample gradients
        norms = self.per_sample.clip_and_sum(self.max_grad_norm, into_grads=into_grads)
        self.per_sample.clear()
        return norms, self.per_sample.take_clipped_sums()

    def accumulate_micro_batch(self) -> None:
        """Clip one micro-batch of a logical Poisson batch and keep its clipped sum for the step (Opacus's
        BatchMemoryManager, with Lightning's ``accumulate_grad_batches``), in float64; ``p.grad`` is freed."""
        norms, sums = self._micro_batch_into_grads(into_grads=False)
        if self._accumulated is None:
            self._accumulated = [summed.clone() for summed in sums]
        else:
            for total, summed in zip(self._accumulated, sums):
                total.add_(summed)
        self._accumulated_norms.append(norms)
        for p in self.parameters:
            p.grad = None

    def clipped_sum(self, into_grads: bool = True) -> torch.Tensor:
        """p.grad <- the sum of per-sample gradients clipped to C over the whole logical batch (its micro-batches
        included), rounded to p's dtype (unless ``into_grads`` is False: the caller noises the float64 sums into
        ``p.grad``); the float64 sums themselves go to :meth:`take_clipped_sums`. Returns the unclipped norms (for the
        step's statistics only)."""
        norms, sums = self._micro_batch_into_grads(into_grads and self._accumulated is None)
        if self._accumulated is not None:  # the earlier micro-batches of this logical batch
            sums = [summed + total for summed, total in zip(sums, self._accumulated)]
            for p, summed in zip(self.parameters, sums):
                if into_grads:
                    round_into_grad(p, summed)
            norms = torch.cat([*self._accumulated_norms, norms.to(self._accumulated_norms[0].device)])
            self._accumulated, self._accumulated_norms = None, []
        self._clipped_sums = sums
        return norms

    def take_clipped_sums(self) -> list[torch.Tensor]:
        """The last :meth:`clipped_sum`'s sums in float64, one per parameter (:attr:`parameters`' order), handed
        over: a mechanism adds its noise to them before any rounding to float32
        (:meth:`PerSampleGradients.take_clipped_sums` says why)."""
        if self._clipped_sums is None:
            raise RuntimeError("take_clipped_sums() without a clipped_sum() since the last one")
        sums, self._clipped_sums = self._clipped_sums, None
        return sums

    @torch.no_grad()
    def clipped_mean(self, expected_batch_size: float) -> DPStepStats:
        """p.grad <- the clipped sum divided by the expected batch size qJ, without noise (CPGT's and Decor's noise
        is their own), divided in float64 and rounded once."""
        norms = self.clipped_sum(into_grads=False)
        for p, summed in zip(self.parameters, self.take_clipped_sums()):
            round_into_grad(p, summed.mul_(1.0 / expected_batch_size))
        return DPStepStats.of(norms, self.max_grad_norm, noise_std=0.0)


def _noise_and_scale_into_grads(
    params: Sequence[torch.Tensor],
    clipped_sums: Sequence[torch.Tensor],
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    generator: NoiseGenerator,
    outputs: KeptBuffers | None = None,
) -> float:
    """p.grad <- (clipped sum + N(0, sigma^2 C^2 I)) / (q J) for every parameter; returns the noise std sigma C.
    A parameter without a ``.grad`` that fits gets a buffer from ``outputs`` (kept across steps) where given.

    Computed as ``N(0, (sigma C / qJ)^2 I) + clipped sum / qJ`` in one pass per parameter, into the existing
    ``p.grad`` where it fits (a clipped sum may BE ``p.grad``), the noise added chunk by chunk as it is drawn
    (:meth:`NoiseGenerator.add_normal_`): a step allocates nothing of the model's size and keeps no noise vector
    (many small gradients are drawn into through one vector the generator keeps)."""
    std = noise_multiplier * max_grad_norm
    scale = 1.0 / expected_batch_size
    grads = []
    for p in params:
        grad = p.grad
        if grad is None or grad.shape != p.shape or grad.dtype != p.dtype or grad.device != p.device:
            grad = None if outputs is None else outputs.get(p, p.shape, p.dtype, p.device)
            grad = torch.empty_like(p) if grad is None else grad
        grads.append(grad if grad.is_contiguous() else torch.empty_like(p, memory_format=torch.contiguous_format))
    if std > 0:
        generator.add_normal_(grads, std * scale, clipped_sums, scale)
    else:
        for grad, summed in zip(grads, clipped_sums):
            torch.mul(summed, scale, out=grad)
    for p, grad in zip(params, grads):
        p.grad = grad
    return std


@torch.no_grad()
def noise_clipped_sum(
    params: Sequence[torch.Tensor],
    per_sample_norms: torch.Tensor,
    *,
    max_grad_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    generator: NoiseGenerator,
    clipped_sums: Sequence[torch.Tensor] | None = None,
    outputs: KeptBuffers | None = None,
) -> DPStepStats:
    """Finish a DP-SGD step on the float64 sums of clipped per-sample gradients ``clipped_sums`` (Abadi et al. 2016,
    Algorithm 1, lines 5-6; :meth:`PerSampleClipping.take_clipped_sums`): the noise is added to them in float64 and
    the noisy value rounded to ``p.grad``'s dtype once, a post-processing (rounding the sum first is not, and moves it
    by up to half a float32 unit of the whole sum).

    Args:
        params: the trainable parameters; ``p.grad`` holds the clipped sum (None: no example reached it).
        per_sample_norms: the unclipped norms ||g_i|| (B of them; B may be 0); they only feed the statistics.
        max_grad_norm: C. noise_multiplier: sigma; ``N(0, sigma^2 C^2 I)`` is added to the sum (0 adds nothing).
        expected_batch_size: ``q J``; the noisy sum is divided by it, not by the realised batch size ``B``.
        generator: THIS node's generator (:func:`~lightning_privdec.privacy.noise.node_noise_generator`: ChaCha20
            under a 256-bit key).
        clipped_sums: the float64 clipped sums, one per parameter (:meth:`PerSampleGradients.take_clipped_sums`);
            required (``p.grad`` holds them rounded, and that rounding is not a post-processing of the noisy value).
        outputs: host buffers kept across steps for the noisy gradients of parameters without a ``.grad`` to write.

    The values are checked once, where they are set (:mod:`.validation`): C when the node's clipping is built,
    sigma with the privacy parameters, qJ when the node's shard is sampled.
    """
    params = list(params)
    if clipped_sums is None:
        raise ValueError(
            "noise_clipped_sum needs clipped_sums=: the float64 clipped sums (clipper.take_clipped_sums() after "
            "clip_and_sum, or PerSampleClipping.take_clipped_sums()). Noising p.grad, the sum already rounded to "
            "float32, is not sound: the rounding moves with the other examples (1.00014 C for 4,000 examples)"
        )
    sums = list(clipped_sums)
    if len(sums) != len(params) or any(t.shape != p.shape for t, p in zip(sums, params)):
        raise ValueError(f"noise_clipped_sum: {len(sums)} clipped sums for {len(params)} parameters, or a shape "
                         "that differs from its parameter's")
    if any(t.dtype != torch.float64 for t in sums):
        raise ValueError("noise_clipped_sum: the clipped sums must be the float64 ones (take_clipped_sums()), not "
                         "sums rounded to a narrower dtype before the noise")
    std = _noise_and_scale_into_grads(params, sums, max_grad_norm, noise_multiplier, expected_batch_size, generator,
                                      outputs)
    return DPStepStats.of(per_sample_norms, max_grad_norm, noise_std=std)


class GaussianMechanism:
    """This node's own Gaussian noise (never from a shared or central source).

    Args:
        rank: this node's id (keys its noise stream).
        device: where the noise is drawn (the model's device).
        noise_seed: ``None``: keyed with 256 bits of OS entropy; an int: reproducible (tests only, NOT private).
        secure_mode: Gaussian noise with Opacus's floating-point mitigation (:mod:`.noise`; 4x the noise cost).
    """

    def __init__(self, *, rank: int, device: torch.device | str, noise_seed: int | None = None,
                 secure_mode: bool = False) -> None:
        self.generator: NoiseGenerator = node_noise_generator(
            device, noise_seed, rank, stream="noise", secure_mode=secure_mode
        )
        self._outputs = KeptBuffers()  # the noisy gradients' memory on the host, reused across steps

    def noise_clipped_sum(self, params: list[nn.Parameter], norms: torch.Tensor, *, max_grad_norm: float,
                          noise_multiplier: float, expected_batch_size: float,
                          clipped_sums: Sequence[torch.Tensor] | None = None) -> DPStepStats:
        """p.grad <- (the float64 ``clipped_sums`` + N(0, sigma^2 C^2 I)) / qJ (:func:`noise_clipped_sum`)."""
        return noise_clipped_sum(
            params, norms, max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size, generator=self.generator, clipped_sums=clipped_sums,
            outputs=self._outputs,
        )

    def normal(self, numel: int, std: float, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """``numel`` draws of N(0, std^2) from this node's stream (a paper's own noise on its own sum)."""
        return self.generator.normal(numel, std, dtype, device)
