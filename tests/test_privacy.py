"""Tests for lightning_privdec.privacy: per-sample gradients, the DP step, Poisson sampling, accounting, config."""

from __future__ import annotations

import io
import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_privdec.privacy.accounting import GaussianRelease
from lightning_privdec.privacy import (
    ACCOUNTANTS,
    PerSampleGradients,
    PoissonBatchSampler,
    PrivacyConfigError,
    PrivacyLedger,
    PrivacyParameters,
    calibrate_noise_multiplier,
    check_private_model,
    epsilon_for,
    make_accountant,
    node_noise_generator,
    node_shard_indices,
    poisson_dataloader,
    privatize_gradients,
)
from lightning_privdec import (
    CorrelatedNoiseStrategy,
    CPGTStrategy,
    DP2SGDStrategy,
    DPCSGPStrategy,
    DynD2PStrategy,
    PrivSGPStrategy,
    PrivSGPVRStrategy,
)
from lightning_privdec.privacy.accounting.gaussian import gdp_epsilon_approximation
from lightning_privdec.privacy.noise import NoiseGenerator

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:GDP accounting is experimental"),
    pytest.mark.filterwarnings("ignore:the 'gdp' accountant"),
    pytest.mark.filterwarnings("ignore:Optimal order is the"),
]


class MLP(pl.LightningModule):
    """A small LightningModule whose training_step calls self(x); optional BatchNorm and a root-level parameter."""

    def __init__(self, batch_norm: bool = False, root_parameter: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(5, 8)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(8))
        layers += [nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3)]
        self.net = nn.Sequential(*layers)
        self.temperature = nn.Parameter(torch.ones(3)) if root_parameter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out * self.temperature if self.temperature is not None else out

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LinearRegression(pl.LightningModule):
    """Squared loss of a linear model: an input scaled by 1e4 really has a huge gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


def batch(n: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g)


def per_example_loop(model: MLP, x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    """Reference: one ordinary backward pass per example (hooks switched off)."""
    out = []
    for i in range(len(x)):
        model.zero_grad()
        model.training_step((x[i : i + 1], y[i : i + 1]), 0).backward()
        out.append([p.grad.detach().clone() for p in model.parameters() if p.requires_grad])
    return out


# ============================================================================ per-sample gradients
@pytest.mark.parametrize("mode", ["hooks", "functorch"])
@pytest.mark.parametrize("root_parameter", [False, True])
def test_per_sample_gradients_match_per_example_backward(mode: str, root_parameter: bool) -> None:
    torch.manual_seed(0)
    model = MLP(root_parameter=root_parameter)
    psg = PerSampleGradients(model, mode=mode)
    x, y = batch(6)
    model.training_step((x, y), 0).backward()  # the LightningModule's own forward, via self(x)
    grads = psg.per_sample_grads()
    params = psg.parameters
    assert params == [p for p in model.parameters() if p.requires_grad]
    assert [g.shape for g in grads] == [(6, *p.shape) for p in params]

    psg._hooks.disable_hooks()
    reference = per_example_loop(model, x, y)
    psg._hooks.enable_hooks()
    for i in range(6):
        for k in range(len(params)):
            torch.testing.assert_close(grads[k][i], reference[i][k], atol=1e-5, rtol=1e-4)
    psg.clear()
    assert all(p.grad_sample is None for p in params)
    psg.detach()
    assert not hasattr(model, "autograd_grad_sample_hooks")
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_per_sample_gradients_sum_reduction_and_accumulation_guard() -> None:
    torch.manual_seed(0)
    model = MLP()
    psg = PerSampleGradients(model, loss_reduction="sum")
    x, y = batch(4)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    summed = [g.sum(0) for g in psg.per_sample_grads()]
    for g, p in zip(summed, psg.parameters):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="grad accumulation"):  # a second backward without clear()
        F.cross_entropy(model(x), y, reduction="sum").backward()
    psg.detach()


def test_per_sample_modes_and_options_are_validated() -> None:
    model = MLP()
    with pytest.raises(PrivacyConfigError, match="GhostClipping"):
        PerSampleGradients(model, mode="ghost")  # ghost clipping has its own class
    with pytest.raises(PrivacyConfigError, match="hooks"):
        PerSampleGradients(model, mode="magic")  # type: ignore[arg-type]
    with pytest.raises(PrivacyConfigError, match="loss_reduction"):
        PerSampleGradients(model, loss_reduction="max")  # type: ignore[arg-type]
    psg = PerSampleGradients(model)
    with pytest.raises(PrivacyConfigError, match="already has per-sample hooks"):
        PerSampleGradients(model)
    psg.detach()
    PerSampleGradients(model).detach()  # attachable again after detach


# ============================================================================ model validation
def test_batchnorm_is_rejected_with_layer_name_and_fix() -> None:
    model = MLP(batch_norm=True)
    with pytest.raises(PrivacyConfigError) as info:
        check_private_model(model)
    message = str(info.value)
    assert "net.1" in message and "BatchNorm1d" in message
    assert "fix=True" in message and "ModuleValidator.fix" in message
    with pytest.raises(PrivacyConfigError, match="net.1"):
        PerSampleGradients(model)  # strict by default


def test_batchnorm_without_affine_parameters_is_rejected_too() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False), nn.Linear(4, 2))
    with pytest.raises(PrivacyConfigError, match="1 \\(BatchNorm1d\\)"):
        check_private_model(model)


def test_fix_replaces_batchnorm_in_place_and_warns() -> None:
    model = MLP(batch_norm=True)
    model.shared = model.net[1]  # the same BatchNorm under a second name
    net_before = model.net
    with pytest.warns(UserWarning, match="net.1: BatchNorm1d.* -> GroupNorm"):
        fixed = check_private_model(model, fix=True)
    assert fixed is model and model.net is net_before  # same objects: Lightning keeps holding them
    assert isinstance(model.net[1], nn.GroupNorm) and model.shared is model.net[1]
    assert not any(isinstance(m, nn.BatchNorm1d) for m in model.modules())
    check_private_model(model)  # now valid
    psg = PerSampleGradients(model)
    x, y = batch(4)
    model.training_step((x, y), 0).backward()
    assert all(g.shape[0] == 4 for g in psg.per_sample_grads())
    psg.detach()


def test_fix_keeps_lstm_and_replaces_running_stats_instance_norm() -> None:
    class Recurrent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(4, 6, batch_first=True)
            self.norm = nn.InstanceNorm1d(6, affine=True, track_running_stats=True)
            self.head = nn.Linear(6, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(x)
            return self.head(self.norm(out.transpose(1, 2)).transpose(1, 2)[:, -1])

    model = Recurrent()
    lstm = model.lstm
    with pytest.raises(PrivacyConfigError, match="norm \\(InstanceNorm1d\\)") as refused:
        check_private_model(model)
    assert "lstm" not in str(refused.value)  # nn.LSTM trains unchanged (per-layer replay)
    with pytest.warns(UserWarning, match="norm: InstanceNorm1d"):
        check_private_model(model, fix=True)
    assert model.lstm is lstm
    assert not model.norm.track_running_stats and not list(model.norm.buffers())
    psg = PerSampleGradients(model)
    model(torch.randn(3, 5, 4)).sum().backward()
    assert all(g.shape[0] == 3 for g in psg.per_sample_grads())
    psg.detach()


def test_fix_refuses_a_root_level_batchnorm() -> None:
    with pytest.raises(PrivacyConfigError, match="cannot be fixed in place"):
        check_private_model(nn.BatchNorm1d(4), fix=True)


def test_valid_model_passes_unchanged() -> None:
    model = MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_private_model(model, fix=True) is model


# ============================================================================ the DP step
def fixed_grad_samples(batch_size: int, seed: int = 0) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(40, 25)), nn.Parameter(torch.zeros(1000))]
    samples = [0.01 * torch.randn(batch_size, *p.shape, generator=g) for p in params]
    return params, samples


def flat_grad(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in params])


def test_noise_is_added_with_std_sigma_c_over_expected_batch_size() -> None:
    sigma, clip, expected = 1.5, 1.0, 8.0
    params, samples = fixed_grad_samples(6)
    gen = node_noise_generator("cpu", seed=0, rank=0)

    privatize_gradients(params, samples, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=expected,
                        generator=gen)
    clean = flat_grad(params).clone()
    # noise-free: deterministic, and equal to the clipped sum / expected batch size (norms here are < C)
    torch.testing.assert_close(clean, torch.cat([s.sum(0).reshape(-1) for s in samples]) / expected)
    privatize_gradients(params, samples, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=expected,
                        generator=gen)
    assert torch.equal(flat_grad(params), clean)

    draws = []
    for _ in range(20):
        stats = privatize_gradients(params, samples, max_grad_norm=clip, noise_multiplier=sigma,
                                    expected_batch_size=expected, generator=gen)
        draws.append(flat_grad(params) - clean)
    noise = torch.stack(draws)  # 20 draws x 2000 coordinates, over BOTH parameters
    target = sigma * clip / expected
    assert noise.std().item() == pytest.approx(target, rel=0.03)
    assert noise.mean().abs().item() < 4 * target / math.sqrt(noise.numel())
    assert (noise.std(dim=0) > 0).all()  # every coordinate is noised
    assert not torch.allclose(draws[0], draws[1])
    assert stats.batch_size == 6 and stats.noise_std == pytest.approx(sigma * clip)


def test_clipping_bounds_one_examples_influence_on_the_update() -> None:
    clip, lr, expected = 5.0, 0.1, 8.0
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)
    x[3] *= 1e4  # one example with a huge gradient

    def updated(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
        torch.manual_seed(0)
        model = LinearRegression()
        psg = PerSampleGradients(model)
        model.training_step((x[keep], y[keep]), 0).backward()
        stats = privatize_gradients(psg.parameters, psg.per_sample_grads(), max_grad_norm=clip,
                                    noise_multiplier=0.0, expected_batch_size=expected,
                                    generator=node_noise_generator("cpu", 0, 0))
        gradient = flat_grad(psg.parameters).clone()
        torch.optim.SGD(model.parameters(), lr=lr).step()
        psg.detach()
        return gradient, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), stats

    everyone = torch.arange(8)
    g_with, w_with, stats = updated(everyone)
    g_without, w_without, _ = updated(everyone[everyone != 3])
    assert stats.max_norm.item() > 1e4 * clip and 0 < stats.clipped_fraction.item() < 1
    assert (g_with - g_without).norm().item() <= clip / expected * (1 + 1e-4)
    assert (w_with - w_without).norm().item() <= lr * clip / expected * (1 + 1e-4)
    assert (g_with - g_without).norm().item() > 0.5 * clip / expected  # clipped to C, not dropped


def test_flat_clipping_is_joint_over_all_parameters() -> None:
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))]
    samples = [torch.full((1, 3), 3.0), torch.full((1, 4), 4.0)]  # joint norm sqrt(27 + 64) > per-parameter norms
    privatize_gradients(params, samples, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0,
                        generator=node_noise_generator("cpu", 0, 0))
    # C less the rounding bound of a sum of SUM_BLOCK = 256 examples (gamma_256 = 1.5e-5), whatever the batch size
    assert 1.0 - 3e-5 <= flat_grad(params).norm().item() <= 1.0
    torch.testing.assert_close(params[0].grad / params[1].grad[:3], torch.full((3,), 0.75))


def test_empty_batch_releases_pure_noise() -> None:
    sigma, clip, expected = 2.0, 1.0, 10.0
    params = [nn.Parameter(torch.zeros(5000))]
    params[0].grad = torch.full((5000,), float("nan"))  # what a mean loss over an empty batch leaves behind
    stats = privatize_gradients(params, [torch.zeros(0, 5000)], max_grad_norm=clip, noise_multiplier=sigma,
                                expected_batch_size=expected, generator=node_noise_generator("cpu", 1, 0))
    grad = params[0].grad
    assert torch.isfinite(grad).all() and stats.batch_size == 0
    assert grad.std().item() == pytest.approx(sigma * clip / expected, rel=0.05)
    privatize_gradients(params, [torch.zeros(0, 5000)], max_grad_norm=clip, noise_multiplier=0.0,
                        expected_batch_size=expected, generator=node_noise_generator("cpu", 0, 0))
    assert torch.equal(params[0].grad, torch.zeros(5000))


def test_empty_batch_through_a_lightning_module() -> None:
    model = MLP()
    psg = PerSampleGradients(model)
    x, y = batch(0)
    loss = model.training_step((x, y), 0)
    loss.backward()
    assert torch.isnan(loss)
    grads = psg.per_sample_grads()
    assert [g.shape for g in grads] == [(0, *p.shape) for p in psg.parameters]
    privatize_gradients(psg.parameters, grads, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4.0,
                        generator=node_noise_generator("cpu", 0, 0))
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in psg.parameters)
    psg.clear()
    # a step whose training_step skipped backward altogether also yields empty per-sample gradients
    assert all(g.shape[0] == 0 for g in psg.per_sample_grads())
    psg.detach()


def test_privatize_gradients_rejects_inconsistent_inputs() -> None:
    params = [nn.Parameter(torch.zeros(3))]
    kwargs = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0, generator=node_noise_generator("cpu", 0, 0))
    with pytest.raises(PrivacyConfigError, match="shape"):
        privatize_gradients(params, [torch.zeros(2, 4)], **kwargs)
    with pytest.raises(PrivacyConfigError, match="1 parameters but 2"):
        privatize_gradients(params, [torch.zeros(2, 3)] * 2, **kwargs)
    with pytest.raises(PrivacyConfigError, match="max_grad_norm"):
        privatize_gradients(params, [torch.zeros(2, 3)], **{**kwargs, "max_grad_norm": 0.0})
    with pytest.raises(PrivacyConfigError, match="expected_batch_size"):
        privatize_gradients(params, [torch.zeros(2, 3)], **{**kwargs, "expected_batch_size": 0})


def test_node_noise_generators_are_per_node() -> None:
    def draw(gen: NoiseGenerator) -> torch.Tensor:
        return gen.normal(64, 1.0)

    torch.manual_seed(0)  # seed_everything-style global seeding must not matter
    rank0, rank1 = node_noise_generator("cpu", 7, 0), node_noise_generator("cpu", 7, 1)
    a, b = draw(rank0), draw(rank1)
    assert not torch.allclose(a, b)
    assert torch.equal(a, draw(node_noise_generator("cpu", 7, 0)))  # reproducible per (seed, rank)
    assert not torch.allclose(a, draw(node_noise_generator("cpu", 8, 0)))
    torch.manual_seed(0)
    s1 = draw(node_noise_generator("cpu", None, 0))
    torch.manual_seed(0)
    s2 = draw(node_noise_generator("cpu", None, 0))
    assert not torch.allclose(s1, s2)  # seeded from os.urandom, independent of the global seed
    assert node_noise_generator(torch.device("cpu"), None, 3).device == torch.device("cpu")
    with pytest.raises(PrivacyConfigError, match="rank"):
        node_noise_generator("cpu", 0, -1)


# ============================================================================ Poisson sampling
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


# ============================================================================ a real Lightning fit
class RecordBatchSizes(pl.Callback):
    def __init__(self) -> None:
        self.batch_sizes: list[int] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self.batch_sizes.append(trainer.strategy.privacy.last_step.batch_size)


def test_private_strategy_fit_in_one_process_with_empty_poisson_batches() -> None:
    """PrivSGPStrategy on one node: one ledger entry per step, empty batches train, epsilon is the accountant's."""
    from lightning_privdec import PrivSGPStrategy

    model = MLP(root_parameter=True)
    x, y = batch(20, seed=2)
    strategy = PrivSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=0)
    record = RecordBatchSizes()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[record])
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=1))  # q = 1/20: many batches are empty
    engine = strategy.privacy
    assert engine.sample_rate == pytest.approx(0.05)
    assert engine.ledger.steps == trainer.global_step == 20
    assert 0 in record.batch_sizes and max(record.batch_sizes) > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert engine.epsilon() == pytest.approx(epsilon_for(1.0, 0.05, 20, 1e-5))


# ============================================================================ accounting
@pytest.mark.parametrize(
    ("accountant", "target", "q", "steps"),
    [
        ("rdp", 1.0, 0.01, 1000),
        ("rdp", 3.0, 0.004, 2000),
        ("rdp", 8.0, 0.1, 100),
        ("prv", 1.0, 0.02, 300),
        ("prv", 4.0, 0.05, 200),
    ],
)
def test_calibration_hits_the_target_within_one_percent(accountant: str, target: float, q: float, steps: int) -> None:
    sigma = calibrate_noise_multiplier(target, 1e-5, q, steps, accountant=accountant)
    achieved = epsilon_for(sigma, q, steps, 1e-5, accountant=accountant)
    assert 0.99 * target <= achieved <= target


def test_calibration_refuses_unreachable_targets_quickly() -> None:
    with pytest.raises(PrivacyConfigError, match="cannot reach .* floor"):
        calibrate_noise_multiplier(0.01, 1e-5, 0.01, 1000)  # below RDP's conversion floor even with sigma = 1e6
    with pytest.raises(PrivacyConfigError, match="cannot calibrate"):
        calibrate_noise_multiplier(1e9, 1e-5, 0.01, 1000)  # a target this loose needs no noise
    with pytest.raises(PrivacyConfigError, match="target_epsilon must be > 0"):
        calibrate_noise_multiplier(0.0, 1e-5, 0.01, 1000)
    with pytest.raises(PrivacyConfigError, match="unknown accountant 'moments'.*'rdp', 'prv'"):
        calibrate_noise_multiplier(1.0, 1e-5, 0.01, 1000, accountant="moments")


@pytest.mark.parametrize("opacus_cls", [RDPAccountant, PRVAccountant])
def test_epsilon_for_equals_opacus_accountants(opacus_cls: type) -> None:
    sigma, q, steps, delta = 1.1, 0.02, 150, 1e-5
    reference = opacus_cls()
    for _ in range(steps):
        reference.step(noise_multiplier=sigma, sample_rate=q)
    name = reference.mechanism()
    assert epsilon_for(sigma, q, steps, delta, accountant=name) == pytest.approx(reference.get_epsilon(delta),
                                                                                  rel=1e-9)
    ledger = PrivacyLedger(name, delta=delta)
    for _ in range(steps):
        ledger.record(GaussianRelease(sigma, q))
    assert ledger.history == [(sigma, q, steps)] == reference.history
    assert ledger.epsilon() == pytest.approx(reference.get_epsilon(delta), rel=1e-9)
    assert isinstance(make_accountant(name), opacus_cls)  # Opacus's (the PRV one with its RDP bounds cached)


def test_ledger_with_a_schedule_matches_opacus_rdp() -> None:
    reference, ledger = RDPAccountant(), PrivacyLedger("rdp")
    schedule = [(1.0, 0.01)] * 30 + [(0.8, 0.02)] * 20 + [(1.0, 0.01)] * 10
    for sigma, q in schedule:
        reference.step(noise_multiplier=sigma, sample_rate=q)
        ledger.record(GaussianRelease(sigma, q))
    assert ledger.history == reference.history and len(ledger.history) == 3 and ledger.steps == 60
    assert ledger.epsilon(1e-6) == pytest.approx(reference.get_epsilon(1e-6), rel=1e-12)


# The review's grid: GDP's central-limit epsilon against the tight PLD value (dp_accounting), and what calibrating
# to GDP would have given. Each case is one where GDP under-estimates epsilon.
@pytest.mark.parametrize(("sigma", "q", "steps", "gdp_epsilon", "tight_epsilon"), [(0.5, 0.001, 10, 0.069, 1.086)])
def test_gdp_is_shown_as_an_approximation_and_never_decides(sigma, q, steps, gdp_epsilon, tight_epsilon) -> None:
    assert gdp_epsilon_approximation(sigma, q, steps, 1e-5) == pytest.approx(gdp_epsilon, abs=2e-3)
    sound = epsilon_for(sigma, q, steps, 1e-5, accountant="prv")
    assert sound >= tight_epsilon * 0.99  # the sound accountant does not under-estimate
    for refused in (
        lambda: PrivacyLedger("gdp", delta=1e-5),
        lambda: epsilon_for(sigma, q, steps, 1e-5, accountant="gdp"),
        lambda: calibrate_noise_multiplier(2.0, 1e-5, q, steps, accountant="gdp"),
        lambda: PrivacyParameters(max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-5, accountant="gdp").validate(),
    ):
        with pytest.raises(PrivacyConfigError, match="accountant='gdp' is refused.*central-limit approximation.*'rdp'"):
            refused()


def test_every_private_strategy_refuses_gdp_when_built() -> None:
    budget = dict(max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-5, accountant="gdp")
    for build in (
        lambda: DPCSGPStrategy(**budget),
        lambda: PrivSGPStrategy(**budget),
        lambda: DP2SGDStrategy(**budget),
        lambda: PrivSGPVRStrategy(**budget),
        lambda: CPGTStrategy(noise_decay=0.9, lipschitz=1.0, **budget),
        lambda: CorrelatedNoiseStrategy(**budget),
    ):
        with pytest.raises(PrivacyConfigError, match="gdp"):
            build()
    with pytest.raises(PrivacyConfigError, match="CLT approximation"):
        DynD2PStrategy(**budget)


def test_ledger_state_dict_round_trip_continues_the_count() -> None:
    ledger = PrivacyLedger("rdp", delta=1e-5)
    assert ledger.epsilon() == 0.0 and ledger.steps == 0
    ledger.record(GaussianRelease(1.2, 0.01), steps=100)
    ledger.record(GaussianRelease(1.0, 0.01), steps=50)
    buffer = io.BytesIO()
    torch.save(ledger.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    resumed = PrivacyLedger("rdp")
    resumed.load_state_dict(state)
    assert resumed.steps == 150 and resumed.delta == 1e-5
    assert resumed.epsilon() == pytest.approx(ledger.epsilon(), rel=1e-12)
    resumed.record(GaussianRelease(1.0, 0.01))
    assert resumed.steps == 151 and resumed.history[-1] == (1.0, 0.01, 51)
    with pytest.raises(PrivacyConfigError, match="accountant 'rdp'"):
        PrivacyLedger("prv").load_state_dict(state)


def test_epsilon_if_looks_ahead_without_recording() -> None:
    ledger = PrivacyLedger("rdp", delta=1e-5)
    ledger.record(GaussianRelease(1.0, 0.01), steps=100)
    now = ledger.epsilon()
    ahead = ledger.epsilon_if(1.0, 0.01, steps=10)
    assert ahead > now and ledger.steps == 100
    assert ahead == pytest.approx(epsilon_for(1.0, 0.01, 110, 1e-5))
    assert ledger.epsilon_if(1.0, 0.01) < ahead
    with pytest.raises(PrivacyConfigError, match="no delta"):
        PrivacyLedger("rdp").epsilon()


def test_zero_noise_has_infinite_epsilon() -> None:
    for name in ACCOUNTANTS:
        assert epsilon_for(0.0, 0.01, 10, 1e-5, accountant=name) == math.inf


# ============================================================================ configuration
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(), "no privacy level given: pass noise_multiplier=..., or target_epsilon=... and target_delta"),
        (dict(target_epsilon=3.0), "target_epsilon=3.0 needs target_delta: pass target_delta="),
        (dict(target_epsilon=0.0, target_delta=1e-5), "target_epsilon must be a positive number, got 0.0"),
        (dict(target_epsilon=-1.0, target_delta=1e-5), "target_epsilon must be a positive number, got -1.0"),
        (dict(target_epsilon=3.0, target_delta=0.0), "target_delta must lie strictly between 0 and 1, got 0.0"),
        (dict(target_epsilon=3.0, target_delta=1.0), "target_delta must lie strictly between 0 and 1, got 1.0"),
        (dict(target_epsilon=3.0, target_delta=1.5), "target_delta must lie strictly between 0 and 1, got 1.5"),
        (dict(noise_multiplier=-0.5), "noise_multiplier must be a number >= 0, got -0.5"),
        (dict(noise_multiplier=1.0, max_grad_norm=0.0), "max_grad_norm must be a positive number, got 0.0"),
        (dict(noise_multiplier=1.0, max_grad_norm=-1.0), "max_grad_norm must be a positive number, got -1.0"),
        (
            dict(noise_multiplier=1.0, accountant="moments"),
            "unknown accountant 'moments'; choose one of 'rdp', 'prv'",
        ),
    ],
)
def test_privacy_parameter_errors(kwargs: dict, message: str) -> None:
    params = PrivacyParameters(**{"max_grad_norm": 1.0, **kwargs})
    with pytest.raises(PrivacyConfigError) as info:
        params.validate()
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_privacy_parameters_resolve() -> None:
    given = PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.3).validate()
    assert given.resolve(0.01, 1000) == 1.3
    assert given.delta_for_reporting == 1e-5
    budget = PrivacyParameters(max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-6)
    sigma = budget.resolve(0.01, 500)
    assert budget.delta_for_reporting == 1e-6
    assert 0.99 * 2.0 <= epsilon_for(sigma, 0.01, 500, 1e-6) <= 2.0
    with pytest.raises(PrivacyConfigError, match="sample_rate"):
        budget.resolve(0.0, 500)
    with pytest.raises(PrivacyConfigError, match="steps"):
        budget.resolve(0.01, 0)
    with pytest.warns(UserWarning, match="NOT differentially private"):
        PrivacyParameters(max_grad_norm=1.0, noise_multiplier=0.0).validate()


def test_ghost_clipping_gives_the_same_private_gradient_as_per_sample_hooks() -> None:
    """Ghost clipping never materialises per-sample gradients, yet its noisy clipped mean is the same."""
    from lightning_privdec.privacy import GhostClipping, noise_clipped_sum

    x, y = batch(10)
    x[3] *= 50.0  # one example far beyond the clipping bound
    reference, ghost_model = MLP(), MLP()
    ghost_model.load_state_dict(reference.state_dict())
    hooks = PerSampleGradients(reference)
    F.cross_entropy(reference(x), y).backward()
    privatize_gradients(
        hooks.parameters, hooks.per_sample_grads(), max_grad_norm=0.5, noise_multiplier=1.0,
        expected_batch_size=8, generator=node_noise_generator("cpu", 3, 0),
    )
    ghost = GhostClipping(ghost_model, max_grad_norm=0.5)
    norms = ghost.backward(F.cross_entropy(ghost_model(x), y, reduction="none"))
    stats = noise_clipped_sum(
        ghost.parameters, norms, max_grad_norm=0.5, noise_multiplier=1.0, expected_batch_size=8,
        generator=node_noise_generator("cpu", 3, 0),
    )
    assert stats.batch_size == 10 and float(stats.max_norm) > 0.5
    for a, b in zip(reference.parameters(), ghost_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(PrivacyConfigError, match="reduction='none'"):
        ghost.backward(F.cross_entropy(ghost_model(x), y))  # a mean loss cannot be ghost-clipped
    empty = ghost.backward(F.cross_entropy(ghost_model(x[:0]), y[:0], reduction="none"))
    assert empty.numel() == 0 and all(torch.count_nonzero(p.grad) == 0 for p in ghost.parameters)
    ghost.detach()


def test_each_accountant_records_only_its_own_release_with_sound_values():
    """A release is a frozen dataclass per mechanism: a bad value is refused when it is built, a release of another
    mechanism (or a bare tuple) when it is recorded; neither changes the ledger."""
    from lightning_privdec.privacy.accounting import (
        CPGTAccountant,
        LaplaceRelease,
        PrivacyLedger,
        SagaAccountant,
        SagaRelease,
        SecLDPAccountant,
        SecLDPRelease,
    )

    for bad in [(-1.0, 0.1), (1.0, 0.0), (1.0, 1.5), (float("nan"), 0.1), ("1", 0.1)]:
        with pytest.raises(ValueError, match="noise_multiplier|sample_rate"):
            GaussianRelease(*bad)
    with pytest.raises(ValueError, match="epsilon_step"):
        SecLDPRelease(-0.1)
    with pytest.raises(TypeError, match="GaussianRelease"):
        SagaRelease(((1.0, 0.1),))
    with pytest.raises(ValueError, match="noise_decay"):
        LaplaceRelease(1.0, 1.0, 0.0)

    gaussian, saga, secldp = PrivacyLedger("rdp", delta=1e-5), SagaAccountant("rdp", 1e-5), SecLDPAccountant(1e-5, "user")
    for ledger, wrong in [(gaussian, (1.0, 0.1)), (gaussian, SecLDPRelease(0.1)), (saga, GaussianRelease(1.0, 0.1)),
                          (secldp, GaussianRelease(1.0, 0.1))]:
        with pytest.raises(TypeError, match=f"{type(ledger).__name__} accounts for one {ledger.release_type.__name__}"):
            ledger.record(wrong)
        with pytest.raises(TypeError, match=ledger.release_type.__name__):
            ledger.epsilon_after(3, wrong)
        assert ledger.steps == 0
    gaussian.record(GaussianRelease(1.0, 0.1), steps=2)
    saga.record(SagaRelease.of([(1.0, 0.1), (2.0, 1.0)]))
    secldp.record(SecLDPRelease(0.01))
    assert (gaussian.steps, saga.steps, secldp.steps) == (2, 1, 1)
    with pytest.raises(ValueError, match="steps"):
        gaussian.record(GaussianRelease(1.0, 0.1), steps=0)

    cpgt = CPGTAccountant("sound")
    with pytest.raises(PrivacyConfigError, match="configure first"):
        cpgt.record(LaplaceRelease(1.0, 1.0, 0.9))
    cpgt.configure(alpha=0.1, lipschitz=1.0, q=0.9, noise_x=1.0, noise_y=1.0, sensitivity=1.0, norm_factor=1.0)
    with pytest.raises(PrivacyConfigError, match="differs from the noise the ledger accounts for"):
        cpgt.record(LaplaceRelease(2.0, 1.0, 0.9))
    cpgt.record(LaplaceRelease(1.0, 1.0, 0.9))
    assert cpgt.steps == 1
