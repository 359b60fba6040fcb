"""Dirichlet(alpha) non-IID partition: deterministic, disjoint, skewed as alpha says; usable as a sampler."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec.data import DirichletPartitionSampler, dirichlet_partition, label_histograms
from lightning_privdec.privacy.noise import node_noise_generator
from lightning_privdec.privacy.sampling import poisson_dataloader

LABELS = load_digits().target  # 1,797 real labels, 10 classes


def test_partition_is_disjoint_complete_and_deterministic():
    parts = dirichlet_partition(LABELS, 8, alpha=0.5, seed=3)
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(len(LABELS)))
    assert parts == dirichlet_partition(LABELS, 8, alpha=0.5, seed=3)
    assert parts != dirichlet_partition(LABELS, 8, alpha=0.5, seed=4)


def test_label_histograms_follow_alpha():
    def skew(alpha: float) -> float:
        hist = label_histograms(LABELS, dirichlet_partition(LABELS, 8, alpha=alpha, seed=0), num_classes=10)
        assert hist.sum() == len(LABELS)
        assert np.array_equal(hist.sum(axis=0), np.bincount(LABELS, minlength=10))  # every example placed once
        shares = hist / hist.sum(axis=1, keepdims=True)
        return float(np.mean(shares.max(axis=1)))  # mean share of each node's most frequent class

    very_skewed, skewed, near_iid = skew(0.05), skew(0.5), skew(1000.0)
    assert very_skewed > 0.5  # mostly one or two classes per node
    assert very_skewed > skewed > near_iid
    assert near_iid < 0.15  # about 1/10 of each class everywhere
    hist = label_histograms(LABELS, dirichlet_partition(LABELS, 8, alpha=0.05, seed=0), num_classes=10)
    assert (hist == 0).sum() > 8 * 10 // 2  # most (node, class) pairs are empty when alpha is tiny


def test_min_examples_and_errors():
    parts = dirichlet_partition(LABELS, 20, alpha=0.05, seed=1, min_examples=10)
    assert min(len(p) for p in parts) >= 10
    with pytest.raises(ValueError, match="alpha must be a positive"):
        dirichlet_partition(LABELS, 4, alpha=0.0)
    with pytest.raises(ValueError, match="num_nodes"):
        dirichlet_partition(LABELS, 0, alpha=1.0)
    with pytest.raises(ValueError, match="cannot give each"):
        dirichlet_partition(LABELS[:5], 4, alpha=1.0, min_examples=2)
    with pytest.raises(ValueError, match="integer class ids"):
        dirichlet_partition([0.5, 1.0], 1, alpha=1.0)


def test_sampler_gives_each_node_its_part_and_equal_epochs():
    samplers = [DirichletPartitionSampler(LABELS, alpha=0.3, seed=2, num_replicas=4, rank=r) for r in range(4)]
    parts = dirichlet_partition(LABELS, 4, alpha=0.3, seed=2)
    lengths = {len(list(iter(s))) for s in samplers}
    assert lengths == {int(np.ceil(len(LABELS) / 4))}  # same number of examples per epoch on every node
    for sampler, part in zip(samplers, parts):
        assert sampler.node_indices == part
        assert set(iter(sampler)) <= set(part)  # never another node's example
        first = list(iter(sampler))
        sampler.set_epoch(1)
        assert list(iter(sampler)) != first  # reshuffled per epoch
        sampler.set_epoch(0)
        assert list(iter(sampler)) == first  # deterministic per epoch


def test_private_loader_poisson_samples_exactly_the_nodes_part():
    data = TensorDataset(torch.arange(len(LABELS)), torch.as_tensor(LABELS))
    sampler = DirichletPartitionSampler(LABELS, alpha=0.3, seed=2, num_replicas=4, rank=1)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    private = poisson_dataloader(loader, None, sample_rate=0.5, generator=node_noise_generator("cpu", 0, 1, "sampling"))
    seen = torch.cat([batch[0] for batch in private]).tolist()
    assert set(seen) <= set(sampler.node_indices)
    assert len(private.dataset) == len(sampler.node_indices)
