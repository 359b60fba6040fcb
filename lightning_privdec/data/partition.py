"""Non-IID data: a Dirichlet(alpha) label partition of any labelled dataset across the nodes.

For every class c, proportions p_c ~ Dir(alpha 1_n) split that class's examples among the n nodes (Hsu, Qi, Brown
2019). Small alpha gives each node few classes; large alpha approaches an IID split. The partition is a pure function
of (labels, num_nodes, alpha, seed): every process computes the same one without communicating.

Use it through :class:`DirichletPartitionSampler` in the training ``DataLoader`` of any LightningModule or
LightningDataModule::

    DataLoader(train_set, batch_size=32, sampler=DirichletPartitionSampler(train_set.targets, alpha=0.5, seed=0))

It is a ``DistributedSampler``, so Lightning keeps it instead of injecting its own, and the private strategies take
each node's shard from it. Every node yields the same number of examples per epoch (so all nodes run the same number
of gossip rounds); a node with fewer examples than that cycles through its own shard in a fresh order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler

__all__ = ["DirichletPartitionSampler", "dirichlet_partition", "label_histograms"]


def _labels_array(labels: Any) -> np.ndarray:
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D sequence of class ids; got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        if not np.all(np.equal(np.mod(array, 1), 0)):
            raise ValueError("labels must be integer class ids")
        array = array.astype(np.int64)
    return array


def dirichlet_partition(
    labels: Any, num_nodes: int, alpha: float, *, seed: int = 0, min_examples: int = 1, max_tries: int = 100
) -> list[list[int]]:
    """Split example indices among ``num_nodes`` nodes with Dirichlet(alpha) label proportions.

    Args:
        labels: one class id per example (list, array or tensor).
        num_nodes: n.
        alpha: concentration > 0 (0.1: very skewed, 100: nearly IID).
        seed: the same seed gives the same partition on every process.
        min_examples: every node gets at least this many examples; draws are repeated (same seed stream) until they
            do, up to ``max_tries`` times.

    Returns: ``num_nodes`` sorted, disjoint lists of indices whose union is ``range(len(labels))``.
    """
    array = _labels_array(labels)
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes must be a positive integer; got {num_nodes!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a positive number (e.g. 0.5); got {alpha!r}")
    if num_nodes * min_examples > array.size:
        raise ValueError(
            f"{array.size} examples cannot give each of {num_nodes} nodes at least {min_examples}; "
            "use fewer nodes or a smaller min_examples"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(array)
    for _ in range(max_tries):
        parts: list[list[int]] = [[] for _ in range(num_nodes)]
        for c in classes:
            members = np.flatnonzero(array == c)
            rng.shuffle(members)
            proportions = rng.dirichlet(np.full(num_nodes, float(alpha)))
            cuts = (np.cumsum(proportions)[:-1] * members.size).astype(int)
            for node, chunk in enumerate(np.split(members, cuts)):
                parts[node].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_examples:
            return [sorted(p) for p in parts]
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) draw in {max_tries} tries gave every one of {num_nodes} nodes at least "
        f"{min_examples} examples; raise alpha or use fewer nodes"
    )


def label_histograms(labels: Any, parts: Sequence[Sequence[int]], num_classes: int | None = None) -> np.ndarray:
    """Counts of each class on each node: an array of shape (num_nodes, num_classes)."""
    array = _labels_array(labels)
    num_classes = int(array.max()) + 1 if num_classes is None else num_classes
    return np.stack([np.bincount(array[list(p)], minlength=num_classes) for p in parts])


class DirichletPartitionSampler(DistributedSampler):
    """This node's Dirichlet(alpha) share of a dataset, as a ``DistributedSampler``.

    Args:
        labels: one class id per example of the dataset (e.g. ``dataset.targets``).
        alpha: Dirichlet concentration.
        seed: the partition's seed, shared by all nodes (also seeds the per-epoch shuffle, see ``set_epoch``).
        num_replicas, rank: default to the process group's world size and rank, like ``DistributedSampler``.
        shuffle: reshuffle the node's examples every epoch.
        examples_per_epoch: examples each node yields per epoch; default ``ceil(len(labels) / num_replicas)``, the
            same on every node. A node with a smaller shard repeats its own examples (in a new order); a larger
            shard is subsampled. Private strategies ignore it: they Poisson-sample :attr:`node_indices` instead.
    """

    def __init__(
        self,
        labels: Any,
        alpha: float,
        *,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        examples_per_epoch: int | None = None,
        min_examples: int = 1,
    ) -> None:
        array = _labels_array(labels)
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must lie in [0, num_replicas={num_replicas}); got {rank}")
        # DistributedSampler's own fields, for code that reads them (Lightning, the private strategies)
        self.dataset = array
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = False
        self.alpha = alpha
        self.partition = dirichlet_partition(array, num_replicas, alpha, seed=seed, min_examples=min_examples)
        self.node_indices: list[int] = self.partition[rank]
        self.num_samples = (
            math.ceil(array.size / num_replicas) if examples_per_epoch is None else int(examples_per_epoch)
        )
        if self.num_samples < 1:
            raise ValueError(f"examples_per_epoch must be positive; got {examples_per_epoch}")
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + self.epoch * 7919 + self.rank)
        shard = torch.tensor(self.node_indices)
        order: list[torch.Tensor] = []
        remaining = self.num_samples
        while remaining > 0:
            perm = torch.randperm(len(shard), generator=generator) if self.shuffle else torch.arange(len(shard))
            order.append(shard[perm[:remaining]])
            remaining -= len(order[-1])
        return iter(torch.cat(order).tolist())

    def __len__(self) -> int:
        return self.num_samples
