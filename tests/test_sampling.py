"""Poisson sampling (lightning_privdec.privacy.sampling): each node samples its own unpadded shard at rate q = B / J,
empty batches included."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_privdec.privacy import (
    PoissonBatchSampler,
    PrivacyConfigError,
    node_noise_generator,
    node_shard_indices,
    poisson_dataloader,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]


def make_loader(n: int = 40, **kwargs: object) -> DataLoader:
    x = torch.arange(n * 12, dtype=torch.float32).reshape(n, 3, 4)
    y = torch.arange(n)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, **kwargs)


def test_poisson_sampler_expected_batch_size() -> None:
    sampler = PoissonBatchSampler(200, 0.1, steps_per_epoch=2000, generator=node_noise_generator("cpu", 0, 0, "sampling"))
    sizes = torch.tensor([len(b) for b in sampler], dtype=torch.float64)
    assert len(sizes) == 2000 and sampler.expected_batch_size == pytest.approx(20.0)
    assert sizes.mean().item() == pytest.approx(20.0, abs=0.5)  # 5 standard errors
    assert sizes.var().item() == pytest.approx(200 * 0.1 * 0.9, rel=0.15)  # binomial, not fixed
    assert len(PoissonBatchSampler(100, 0.1)) == 10
    with pytest.raises(PrivacyConfigError, match="sample_rate"):
        PoissonBatchSampler(10, 0.0)


def test_poisson_dataloader_empty_batches_have_correct_shapes() -> None:
    shard = list(range(0, 40, 2))  # this node's 20 examples
    loader = poisson_dataloader(make_loader(), shard, sample_rate=0.05,
                                generator=node_noise_generator("cpu", 3, 0, "sampling"), steps_per_epoch=60)
    assert len(loader) == 60 and loader.batch_sampler.expected_batch_size == pytest.approx(0.05 * 20)
    empty = nonempty = 0
    for x, y in loader:
        assert x.shape[1:] == (3, 4) and x.dtype == torch.float32 and y.dtype == torch.int64
        assert x.shape[0] == y.shape[0]
        if len(y) == 0:
            empty += 1
        else:
            nonempty += 1
            assert set(y.tolist()) <= set(shard)  # only this node's shard
    assert empty > 5 and nonempty > 5  # P(empty) = 0.95^20 = 0.36


def test_poisson_dataloader_first_batch_empty_and_loader_settings_kept() -> None:
    def collate(items: list) -> dict:
        xs, ys = zip(*items)
        return {"x": torch.stack(xs), "y": torch.stack(ys)}

    original = make_loader(collate_fn=collate, pin_memory=False)
    loader = poisson_dataloader(original, [0, 1, 2], sample_rate=1e-9, generator=node_noise_generator("cpu", 0, 0, "sampling"),
                                steps_per_epoch=2)
    first = next(iter(loader))  # no non-empty batch seen before: structure still known
    assert first["x"].shape == (0, 3, 4) and first["y"].shape == (0,)
    assert loader.num_workers == original.num_workers and loader.pin_memory == original.pin_memory


def test_poisson_dataloader_with_workers() -> None:
    loader = poisson_dataloader(make_loader(num_workers=1), None, sample_rate=0.02,
                                generator=node_noise_generator("cpu", 0, 0, "sampling"), steps_per_epoch=8)
    assert loader.num_workers == 1
    assert all(x.shape[1:] == (3, 4) for x, _ in loader)


def test_node_generators_sample_different_batches() -> None:
    loader = make_loader()
    a = poisson_dataloader(loader, None, 0.25, node_noise_generator("cpu", 0, 0), steps_per_epoch=20)
    b = poisson_dataloader(loader, None, 0.25, node_noise_generator("cpu", 0, 1), steps_per_epoch=20)
    c = poisson_dataloader(loader, None, 0.25, steps_per_epoch=20)  # secure default generator
    batches = [[y.tolist() for _, y in dl] for dl in (a, b, c)]
    assert batches[0] != batches[1] and batches[0] != batches[2]


def test_poisson_dataloader_takes_an_unpadded_shard_from_a_distributed_sampler() -> None:
    dataset = make_loader(n=10).dataset
    original = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=4, rank=1))
    loader = poisson_dataloader(original, None, 1.0, node_noise_generator("cpu", 0, 0), steps_per_epoch=1)
    (_, y), = list(loader)
    assert y.tolist() == [1, 5, 9] == node_shard_indices(10, 1, 4)  # DistributedSampler would pad to 3 with repeats

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(3)

    with pytest.raises(PrivacyConfigError, match="IterableDataset"):
        poisson_dataloader(DataLoader(Stream()), None, 0.1)
