"""Poisson sampling of each node's own shard (the sampling the DP-SGD accountants assume).

Privacy amplification by subsampling (Abadi et al. 2016, Sec. 3.1; Mironov, Talwar, Zhang 2019) holds for Poisson
sampling: every example of the node's shard of J examples joins a step's batch independently with probability
``q = B / J``. Batches therefore have random size (mean ``qJ``, possibly 0), and the DP step divides by ``qJ``.
Each node samples its own shard with its own generator, so batch membership is secret to the node.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from opacus.data_loader import wrap_collate_with_empty
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, Subset
from torch.utils.data._utils.collate import default_collate

from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.noise import NoiseGenerator, node_noise_generator

__all__ = ["PoissonBatchSampler", "node_shard_indices", "poisson_dataloader", "sampler_shard_indices"]


class PoissonBatchSampler(UniformWithReplacementSampler):
    """Batches of indices in ``range(num_samples)``, each index included independently with probability q.

    Opacus's ``UniformWithReplacementSampler`` (the sampled Gaussian mechanism's sampling) with checked arguments,
    drawing the inclusion mask from a :class:`~lightning_privdec.privacy.noise.NoiseGenerator` (ChaCha20 under a
    256-bit key) instead of a torch generator.

    Args:
        num_samples: J, the size of this node's shard.
        sample_rate: q = B / J in (0, 1].
        steps_per_epoch: batches per ``iter()``; default ``round(1 / q)`` (one pass over J examples in expectation;
            Opacus truncates ``int(1 / q)`` instead, which float error can turn into one step less).
        micro_batches: k: each Poisson batch is yielded as k consecutive micro-batches (sizes differing by at most
            one; some may be empty), for gradient accumulation over one logical batch. ``len()`` counts micro-batches.
        generator: this node's sampling generator. ``None`` keys a fresh one from ``os.urandom`` (recommended:
            the amplification argument assumes nobody else knows which examples were sampled).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int | None = None,
        generator: NoiseGenerator | None = None,
        micro_batches: int = 1,
    ) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples <= 0:
            raise PrivacyConfigError(f"num_samples must be a positive integer (the shard size J), got {num_samples!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise PrivacyConfigError(
                f"sample_rate must lie in (0, 1], got {sample_rate!r}; use q = batch_size / shard_size"
            )
        if steps_per_epoch is None:
            steps_per_epoch = max(1, round(1.0 / sample_rate))
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch <= 0:
            raise PrivacyConfigError(f"steps_per_epoch must be a positive integer, got {steps_per_epoch!r}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches <= 0:
            raise PrivacyConfigError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.micro_batches = micro_batches
        super().__init__(
            num_samples=num_samples,
            sample_rate=float(sample_rate),
            generator=generator if generator is not None else node_noise_generator("cpu", None, 0, "sampling"),
            steps=steps_per_epoch,
        )

    @property
    def expected_batch_size(self) -> float:
        """q J, the divisor of the DP step."""
        return self.sample_rate * self.num_samples

    def record_batches(self) -> deque[list[int]]:
        """Keep every batch this sampler yields, in order, in the returned FIFO (for algorithms that must know WHICH
        examples a step used, e.g. PrivSGP-VR's gradient table). The consumer pops one batch per step; batches the
        DataLoader prefetched but never trained on are dropped when the next epoch's iterator starts."""
        if getattr(self, "_yielded", None) is None:
            self._yielded: deque[list[int]] = deque()
        return self._yielded

    def __iter__(self) -> Iterator[list[int]]:
        yielded = getattr(self, "_yielded", None)
        if yielded is not None:
            yielded.clear()  # a new epoch: whatever the last one prefetched was never trained on
        k = self.micro_batches
        for _ in range(self.steps):
            indices = self.generator.bernoulli(self.num_samples, self.sample_rate).nonzero().reshape(-1).tolist()
            if yielded is not None:
                yielded.append(indices)
            size, extra = divmod(len(indices), k)
            start = 0
            for i in range(k):
                end = start + size + (1 if i < extra else 0)
                yield indices[start:end]
                start = end

    def __len__(self) -> int:
        return self.steps * self.micro_batches


def node_shard_indices(num_samples: int, rank: int, world_size: int) -> list[int]:
    """Node ``rank``'s disjoint shard of ``range(num_samples)``: ``rank, rank + world_size, ...``.

    Unlike ``DistributedSampler`` there is no padding: an example duplicated into two shards (or twice into one)
    would be sampled more often than the accountant assumes.
    """
    if not 0 <= rank < world_size:
        raise PrivacyConfigError(f"rank must lie in [0, world_size={world_size}), got {rank}")
    return list(range(rank, num_samples, world_size))


def sampler_shard_indices(sampler: DistributedSampler, num_samples: int) -> list[int]:
    """The examples a ``DistributedSampler`` gives its rank, without padding or repetition.

    A sampler that states its node's examples (``node_indices``, e.g. a non-IID partition) is taken at its word;
    otherwise the strided shard of :func:`node_shard_indices`.
    """
    node_indices = getattr(sampler, "node_indices", None)
    if node_indices is not None:
        return sorted(set(int(i) for i in node_indices))
    return node_shard_indices(num_samples, sampler.rank, sampler.num_replicas)


def _empty_batch_collate(dataset: Dataset, collate_fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``collate_fn`` that turns an empty index list into zero-length tensors of the right shape and dtype.

    Opacus's ``wrap_collate_with_empty`` learns the batch structure from the first non-empty batch it sees, which
    fails when the very first batch (or a worker's first batch) is empty; here it is primed with the collation of
    the dataset's first example, so every process knows the structure from the start.
    """
    wrapped = wrap_collate_with_empty(collate_fn=collate_fn)
    wrapped.first_batch = collate_fn([dataset[0]])
    return wrapped


def poisson_dataloader(
    dataloader: DataLoader,
    shard_indices: Sequence[int] | None,
    sample_rate: float,
    generator: NoiseGenerator | None = None,
    *,
    steps_per_epoch: int | None = None,
    micro_batches: int = 1,
) -> DataLoader:
    """A DataLoader over this node's shard that Poisson-samples every batch (rate ``sample_rate``).

    Args:
        dataloader: the user's loader; its dataset, ``collate_fn``, ``num_workers``, ``pin_memory`` and worker
            settings are kept; its batch size, sampler, shuffling and ``drop_last`` are replaced.
        shard_indices: this node's examples in ``dataloader.dataset``. ``None``: the loader's whole dataset, or, if
            its sampler is a ``DistributedSampler`` (Lightning injects one), the sampler's rank's strided shard
            without padding (:func:`node_shard_indices`).
        sample_rate: q = B / J for a shard of J examples.
        generator: this node's sampling generator (``None``: keyed from ``os.urandom``).
        steps_per_epoch: Poisson batches per epoch (default ``round(1 / q)``).
        micro_batches: each Poisson batch comes out as this many micro-batches (:class:`PoissonBatchSampler`).

    Empty batches come out as zero-length tensors with the usual trailing shapes and dtypes. Give the result to
    Lightning from the strategy's ``process_dataloader`` (after Lightning's own sampler injection) or run with
    ``Trainer(use_distributed_sampler=False)``: Lightning cannot inject a sampler into a Poisson batch sampler.
    """
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset):
        raise PrivacyConfigError(
            "Poisson sampling needs a map-style dataset (with __len__ and __getitem__); got an IterableDataset"
        )
    if shard_indices is None and isinstance(dataloader.sampler, DistributedSampler):
        shard_indices = sampler_shard_indices(dataloader.sampler, len(dataset))
    shard: Dataset = dataset if shard_indices is None else Subset(dataset, list(shard_indices))
    if len(shard) == 0:
        raise PrivacyConfigError("this node's shard is empty: every node needs at least one example")
    batch_sampler = PoissonBatchSampler(
        num_samples=len(shard), sample_rate=sample_rate, steps_per_epoch=steps_per_epoch, generator=generator,
        micro_batches=micro_batches,
    )
    collate_fn = dataloader.collate_fn if dataloader.collate_fn is not None else default_collate
    kwargs: dict[str, Any] = {}
    if dataloader.num_workers > 0:
        kwargs.update(prefetch_factor=dataloader.prefetch_factor, persistent_workers=dataloader.persistent_workers)
    if getattr(dataloader, "pin_memory_device", ""):
        kwargs["pin_memory_device"] = dataloader.pin_memory_device
    return DataLoader(
        shard,
        batch_sampler=batch_sampler,
        collate_fn=_empty_batch_collate(shard, collate_fn),
        num_workers=dataloader.num_workers,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator,
        **kwargs,
    )
