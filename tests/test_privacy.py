"""Tests for lightning_privdec.privacy: per-sample gradients, model validation, a private fit, the privacy parameters.

The DP step is tested in tests/test_dp_step.py, Poisson sampling in tests/test_sampling.py, the accountants in
tests/test_accounting.py."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec.privacy import (
    PerSampleGradients,
    PrivacyConfigError,
    PrivacyParameters,
    check_private_model,
    epsilon_for,
)

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
    dp = strategy.privacy
    assert dp.sample_rate == pytest.approx(0.05)
    assert dp.ledger.steps == trainer.global_step == 20
    assert 0 in record.batch_sizes and max(record.batch_sizes) > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert dp.epsilon() == pytest.approx(epsilon_for(1.0, 0.05, 20, 1e-5))


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
        (dict(noise_multiplier=1.0, max_grad_norm=1e-9), "max_grad_norm=1e-09 is below 2^-26 (1.5e-8)"),
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


