"""Large logical batches: one Poisson batch split into micro-batches (``accumulate_grad_batches``) is one DP step.

One noise draw, one ledger entry and one gossip round per logical batch, and the same privatized gradient as the
unsplit batch (with a fixed noise seed, to float rounding).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec.algorithms.node import private_step
from lightning_privdec import DPCSGPStrategy, DynD2PStrategy, PrivSGPVRStrategy
from lightning_privdec.privacy import GRAD_SAMPLE_MODES, PrivacyConfigError, PrivacyParameters
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.privacy.noise import node_noise_generator
from lightning_privdec.privacy.sampling import PoissonBatchSampler

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_micro_batches_give_the_unsplit_batchs_privatized_gradient(mode: str) -> None:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(23, 6, generator=g), torch.randint(0, 3, (23,), generator=g)
    x[4] *= 50  # an example whose gradient is clipped

    def privatized(chunks: list[slice]) -> list[torch.Tensor]:
        model = _model()
        dp = DPCSGPNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=0.7), rank=0,
                                   device=torch.device("cpu"), grad_sample_mode=mode, noise_seed=5)
        dp.attach(model)
        dp.noise_multiplier, dp.sample_rate, dp.expected_batch_size = 0.7, 0.5, 20.0
        for i, chunk in enumerate(chunks):
            losses = F.cross_entropy(model(x[chunk]), y[chunk], reduction="none")
            if mode == "ghost":
                dp.clipping.ghost_backward(losses)
            else:
                losses.mean().backward()
            if i < len(chunks) - 1:
                dp.clipping.accumulate_micro_batch()
        stats = private_step(dp)
        assert stats.batch_size == 23 and dp.ledger.steps == 1  # one ledger entry for the logical batch
        return [p.grad.clone() for p in model.parameters()]

    whole = privatized([slice(0, 23)])
    split = privatized([slice(0, 8), slice(8, 8), slice(8, 16), slice(16, 23)])  # an empty micro-batch included
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_sampler_splits_each_poisson_batch_without_changing_it() -> None:
    def batches(k: int) -> list[list[int]]:
        return list(PoissonBatchSampler(200, 0.2, steps_per_epoch=4, micro_batches=k,
                                        generator=node_noise_generator("cpu", 3, 0, "sampling")))

    whole, split = batches(1), batches(3)
    assert len(split) == 3 * len(whole) == len(PoissonBatchSampler(200, 0.2, steps_per_epoch=4, micro_batches=3))
    for step, logical in enumerate(whole):
        parts = split[3 * step : 3 * step + 3]
        assert sum(parts, []) == logical and max(map(len, parts)) - min(map(len, parts)) <= 1


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(strategy: pl.strategies.Strategy, batch_size: int, accumulate: int, tmp_path) -> tuple[pl.Trainer, nn.Module]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 6, generator=g)
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=batch_size)
    model = Classifier()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         accumulate_grad_batches=accumulate, default_root_dir=tmp_path)
    trainer.fit(model, loader)
    return trainer, model


@pytest.mark.parametrize("make", [
    lambda: DPCSGPStrategy(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5, noise_seed=4),
    lambda: DynD2PStrategy(max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5, noise_seed=4),
])
def test_accumulate_grad_batches_trains_exactly_like_the_unsplit_batch(make, tmp_path) -> None:
    """batch_size 8 with accumulate_grad_batches=4 against batch_size 32: the same Poisson batches (q = 32 / 128),
    the same noise, the same steps, ledger and epsilon, and the same model to float rounding."""
    split_trainer, split_model = _fit(make(), 8, 4, tmp_path / "split")
    whole_trainer, whole_model = _fit(make(), 32, 1, tmp_path / "whole")
    split, whole = split_trainer.strategy.privacy, whole_trainer.strategy.privacy
    assert split_trainer.global_step == whole_trainer.global_step == 8  # 4 logical steps per epoch, 2 epochs
    assert split.sample_rate == whole.sample_rate == 32 / 128
    assert split.ledger.history == whole.ledger.history and split.epsilon() == whole.epsilon()
    assert split.gaussian.generator.draws == whole.gaussian.generator.draws == 8  # one noise draw per logical step
    for a, b in zip(split_model.parameters(), whole_model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_nodes_that_need_the_whole_batch_refuse_micro_batches(tmp_path) -> None:
    with pytest.raises(PrivacyConfigError, match="PrivSGP-VR .* accumulate_grad_batches=1"):
        _fit(PrivSGPVRStrategy(max_grad_norm=1.0, noise_multiplier=1.0), 8, 4, tmp_path)
