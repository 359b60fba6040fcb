"""Every private strategy trains with every grad_sample_mode it accepts, and uses the mode it was given.

(Decor once built its dp with the default mode whatever the user passed: with "ghost" the backward pass got a
per-sample loss vector and failed with an unrelated error.)
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec.privacy import GRAD_SAMPLE_MODES, PrivacyConfigError
from lightning_privdec.strategies import PRIVATE_STRATEGIES
from tests.strategy_arguments import PRIVATE_STRATEGY_ARGUMENTS as ARGUMENTS

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:CPGT's epsilon covers"),
    pytest.mark.filterwarnings("ignore:noise_multiplier=0 adds no noise"),
]

#: the modes a strategy refuses, and the words its refusal must contain
REFUSED = {("privsgp_vr", "ghost"): "ghost"}


class PerSampleLossClassifier(pl.LightningModule):
    """Returns per-example losses under ghost clipping (which needs them), the mean loss otherwise."""

    def __init__(self, ghost: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.ghost = ghost
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        losses = F.cross_entropy(self.net(x), y, reduction="none")
        self.losses.append(float(losses.mean()) if len(losses) else 0.0)
        return losses if self.ghost else losses.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ModeProbe(pl.Callback):
    """Records which per-sample machinery the node's privacy ran each step."""

    def __init__(self) -> None:
        self.used: set[str] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        dp = trainer.strategy.privacy
        self.used.add("ghost" if dp.clipping.ghost is not None else dp.clipping.per_sample.mode)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=16)


#: what each strategy's end-of-fit privacy summary names
SUMMARY = {
    "dp_csgp": "Gaussian noise sigma", "privsgp": "Gaussian noise sigma", "dp2sgd": "Gaussian noise sigma",
    "privsgp_vr": "Gaussian noise sigma", "decor": "pairwise-cancelling sigma_cor", "dyn_d2p": "Dyn-D2P schedule",
    "cpgt": "pure epsilon-DP (delta = 0): Laplace noise",
}


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_every_private_strategy_trains_with_every_mode_it_accepts(
    name: str, mode: str, tmp_path, caplog, accelerator: str
) -> None:
    assert set(ARGUMENTS) == set(PRIVATE_STRATEGIES)  # a new strategy joins this matrix
    build = lambda: PRIVATE_STRATEGIES[name](grad_sample_mode=mode, noise_seed=0, **ARGUMENTS[name])  # noqa: E731
    if (name, mode) in REFUSED:
        with pytest.raises(PrivacyConfigError, match=REFUSED[name, mode]):
            build()
        return
    strategy, probe, model = build(), ModeProbe(), PerSampleLossClassifier(ghost=mode == "ghost")
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[probe], default_root_dir=tmp_path,
    )
    with caplog.at_level("INFO"):
        trainer.fit(model, _loader())
    assert trainer.global_step == 2 and strategy.privacy.steps == 2
    # every fit ends with each node's epsilon and the noise that bought it, without any callback
    summary = next(r.getMessage() for r in caplog.records if "final privacy per node" in r.getMessage())
    assert SUMMARY[name] in summary and f"node 0: epsilon = {strategy.privacy.epsilon():.4f} after 2" in summary
    assert not any("stopping after step" in r.getMessage() for r in caplog.records)  # it ended as planned
    assert probe.used == {mode}  # the mode asked for is the mode that ran
    assert all(math.isfinite(loss) for loss in model.losses)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert strategy.privacy.epsilon() > 0


def test_ghost_clipping_follows_the_per_sample_hooks_trajectory(tmp_path) -> None:
    """The same noise seed, so the same Poisson batches and noise: ghost clipping (per-example losses, clipped in
    their own backward) takes the steps the per-sample hooks take, through the Trainer's step."""

    def fit(mode: str) -> torch.Tensor:
        torch.manual_seed(0)
        model = PerSampleLossClassifier(ghost=mode == "ghost")
        strategy = PRIVATE_STRATEGIES["dp_csgp"](
            grad_sample_mode=mode, max_grad_norm=1.0, target_epsilon=3.0, target_delta=1e-5, noise_seed=3
        )
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path / mode,
        )
        trainer.fit(model, _loader())
        assert trainer.global_step == 8 and strategy.privacy.steps == 8
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    hooks, ghost = fit("hooks"), fit("ghost")
    assert torch.allclose(hooks, ghost, atol=1e-4), (hooks - ghost).abs().max()


class GradientDtypes(pl.Callback):
    """The dtypes of the privatized gradient (clipped sum + noise) each step, as the optimizer sees it."""

    def __init__(self) -> None:
        self.dtypes: set[torch.dtype] = set()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.dtypes |= {p.grad.dtype for p in pl_module.parameters() if p.grad is not None}


def assert_bf16_mixed_trains(strategy, model: pl.LightningModule, tmp_path, accelerator: str) -> None:  # noqa: ANN001
    """Two bf16-mixed steps: the optimizer sees float32 gradients (clipped sum + noise), the parameters stay float32
    and finite, and epsilon is spent."""
    dtypes = GradientDtypes()
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[dtypes], precision="bf16-mixed",
        default_root_dir=tmp_path,
    )
    trainer.fit(model, _loader())
    assert trainer.global_step == 2 and dtypes.dtypes == {torch.float32}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.isfinite(p).all() for p in model.parameters()) and strategy.privacy.epsilon() > 0


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_bf16_mixed_trains_every_private_strategy_with_float32_clipping_and_noise(
    name: str, tmp_path, accelerator: str
) -> None:
    strategy = PRIVATE_STRATEGIES[name](noise_seed=0, **ARGUMENTS[name])
    assert_bf16_mixed_trains(strategy, PerSampleLossClassifier(ghost=False), tmp_path, accelerator)


class ConvClassifier(PerSampleLossClassifier):
    """A convolution, a GroupNorm and a linear layer on 2 x 2 x 2 images (the 8 features)."""

    def __init__(self, ghost: bool) -> None:
        super().__init__(ghost)
        self.net = nn.Sequential(nn.Unflatten(1, (2, 2, 2)), nn.Conv2d(2, 4, kernel_size=1), nn.GroupNorm(2, 4),
                                 nn.Flatten(), nn.Linear(16, 3))


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_bf16_mixed_trains_a_convolution_in_every_per_sample_mode(mode: str, tmp_path, accelerator: str) -> None:
    """functorch re-runs each layer outside the forward's autocast: its inputs must be cast back (it once failed with
    "Input type (CPUBFloat16Type) and weight type (torch.FloatTensor) should be the same")."""
    strategy = PRIVATE_STRATEGIES["dp_csgp"](noise_seed=0, grad_sample_mode=mode, **ARGUMENTS["dp_csgp"])
    assert_bf16_mixed_trains(strategy, ConvClassifier(ghost=mode == "ghost"), tmp_path, accelerator)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_precision_parameters_are_refused_with_the_reason(precision: str, tmp_path) -> None:
    for name, cls in PRIVATE_STRATEGIES.items():
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=cls(noise_seed=0, **ARGUMENTS[name]), max_steps=1,
                             logger=False, enable_checkpointing=False, precision=precision, default_root_dir=tmp_path)
        with pytest.raises(PrivacyConfigError, match="significant bits.*Use precision='bf16-mixed'"):
            trainer.fit(PerSampleLossClassifier(ghost=False), _loader())
        assert trainer.global_step == 0


def test_an_unknown_mode_is_refused_when_the_strategy_is_built() -> None:
    for name, cls in PRIVATE_STRATEGIES.items():
        with pytest.raises(PrivacyConfigError, match="grad_sample_mode.*'bookkeeping'"):
            cls(grad_sample_mode="vmap", **ARGUMENTS[name])


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_a_finished_fit_leaves_no_layer_or_input_alive(mode: str, tmp_path) -> None:
    """The per-sample gradient hooks on each layer's outputs once formed a cycle through autograd's C++ nodes that
    Python's collector cannot free: every step's records (the layer and its inputs) stayed alive for the process's
    life (about 100 MB per fit of ResNet-18, and each step's inputs)."""
    import gc
    import weakref

    strategy = PRIVATE_STRATEGIES["dp_csgp"](noise_seed=0, grad_sample_mode=mode, **ARGUMENTS["dp_csgp"])
    model = ConvClassifier(ghost=mode == "ghost")
    layer, data = weakref.ref(model.net[1]), _loader()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    trainer.fit(model, data)
    assert trainer.global_step == 2
    del trainer, strategy, model
    gc.collect()
    assert layer() is None


class PrivatizedGradients(pl.Callback):
    """Each step's privatized gradient as the optimizer sees it (after Lightning's precision plugin unscaled it)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        self.steps.append(torch.cat([p.grad.flatten() for p in pl_module.parameters()]).clone())


def _fit_16_mixed(  # noqa: ANN202
    name: str, loader: DataLoader, tmp_path, device: torch.device, precision: str = "16-mixed"
):
    """Two steps: float16 autocast and Lightning's GradScaler (on CPU the code path of "16-mixed" on a GPU; on a GPU
    CUDA's own GradScaler)."""
    torch.manual_seed(0)
    model, probe = PerSampleLossClassifier(ghost=False), PrivatizedGradients()
    strategy = PRIVATE_STRATEGIES[name](noise_seed=0, **ARGUMENTS[name])
    plugins = [MixedPrecision("16-mixed", device.type)] if precision == "16-mixed" else []
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, strategy=strategy, max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[probe], plugins=plugins, default_root_dir=tmp_path,
    )
    trainer.fit(model, loader)
    return trainer, strategy, model, probe


@pytest.mark.parametrize("name", sorted(ARGUMENTS))
def test_16_mixed_unscales_before_clipping_and_skips_no_step(name: str, tmp_path, device: torch.device) -> None:
    """The privatized gradient under "16-mixed" is the float32 run's (same Poisson batches and noise) to float16's
    rounding: per-example gradients were unscaled before clipping (clipping the scaled ones would shrink the sum by
    the scale, 65536); the optimizer gets it in float32, and the GradScaler skipped no step (its scale never backed
    off), which every node's ledger counts."""
    *_, reference = _fit_16_mixed(name, _loader(), tmp_path, device, precision="32-true")
    trainer, strategy, model, probe = _fit_16_mixed(name, _loader(), tmp_path, device)
    assert trainer.global_step == 2 and strategy.privacy.steps == 2
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**16
    for got, want in zip(probe.steps, reference.steps):
        assert got.dtype == torch.float32
        assert float((got - want).norm() / want.norm()) < 1e-2
    assert strategy.private_precision.nonfinite_examples == 0


def test_16_mixed_an_overflowing_example_adds_zero_and_no_step_is_skipped(tmp_path, device: torch.device) -> None:
    """Examples whose features overflow float16 (1e6 > 65504: inf - inf = NaN in the first layer's output) contribute
    zero to the layers they reach; every step is taken (none skipped: a skip would release, without noise, whether
    some example overflowed), the parameters stay finite and the count is kept for the end-of-fit summary."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    x[::2, :2] = 1e6
    loader = DataLoader(TensorDataset(x, (x[:, 1] > 0).long()), batch_size=16)
    trainer, strategy, model, probe = _fit_16_mixed("dp_csgp", loader, tmp_path, device)
    assert trainer.global_step == 2 and strategy.privacy.steps == 2
    assert trainer.precision_plugin.scaler.get_scale() == 2.0**16
    assert strategy.private_precision.nonfinite_examples > 0
    assert all(torch.isfinite(step).all() for step in probe.steps)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _NoneOnEmptyBatch(PerSampleLossClassifier):
    """Returns None for an empty Poisson batch (Lightning then runs no backward pass)."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):  # noqa: ANN201
        return None if len(batch[0]) == 0 else super().training_step(batch, batch_idx)


class _ParameterMoves(pl.Callback):
    def __init__(self) -> None:
        self.moves: list[tuple[int, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx) -> None:
        self.before, self.size = torch.cat([p.detach().flatten() for p in pl_module.parameters()]), len(batch[0])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        after = torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        self.moves.append((self.size, float((after - self.before).norm())))


@pytest.mark.parametrize(("name", "mode", "accumulate"), [
    ("dp_csgp", "ghost", 1), ("dp_csgp", "bookkeeping", 2), ("decor", "user", 1), ("privsgp_vr", "bookkeeping", 1),
])
def test_16_mixed_matches_float32_in_ghost_accumulation_user_level_and_vr_table(
    name, mode, accumulate, tmp_path, device, accelerator
):
    """Ghost clipping (its per-sample losses scaled too), micro-batches, Decor's user-level clipping (the batch
    gradient unscaled before clipping) and PrivSGP-VR's table (filled under the same scaling) give the float32 run's
    privatized gradients and parameter moves to float16's rounding; the GradScaler's scale is held (its growth would
    only grow: no step overflows)."""
    arguments = dict(ARGUMENTS[name])
    if mode == "user":
        arguments["clipping"] = "user"
    elif name != "privsgp_vr":
        arguments["grad_sample_mode"] = mode
    runs = {}
    for precision in ("32-true", "16-mixed"):
        torch.manual_seed(0)
        model, probe, moves = _NoneOnEmptyBatch(ghost=mode == "ghost"), PrivatizedGradients(), _ParameterMoves()
        strategy = PRIVATE_STRATEGIES[name](noise_seed=0, **arguments)
        scaler = torch.amp.GradScaler(device.type, growth_interval=1)  # would double the scale every step
        plugins = [MixedPrecision("16-mixed", device.type, scaler=scaler)] if precision == "16-mixed" else []
        trainer = pl.Trainer(
            accelerator=accelerator, devices=1, strategy=strategy, max_steps=4, logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[probe, moves], plugins=plugins,
            accumulate_grad_batches=accumulate, default_root_dir=tmp_path,
        )
        trainer.fit(model, _loader())
        assert strategy.privacy.steps == 4
        runs[precision] = (probe.steps, moves.moves)
    assert scaler.get_scale() == 2.0**16
    for got, want in zip(*(runs[p][0] for p in ("16-mixed", "32-true"))):
        assert float((got - want).norm() / want.norm()) < 1e-2
    for (size, got), (want_size, want) in zip(runs["16-mixed"][1], runs["32-true"][1]):  # every step applied
        assert size == want_size and got == pytest.approx(want, rel=1e-2, abs=1e-9)


def test_16_mixed_an_empty_batch_returning_none_still_takes_its_noise_only_step(tmp_path, device, accelerator) -> None:
    """Lightning's precision plugin skips the optimizer step when the closure returns None; the strategy returns a
    zero loss instead, so the noise-only update of an empty Poisson batch is applied as in float32 (a node that kept
    its model would reveal that its batch was empty)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=1)  # q = 1/64: empty batches are common
    moved = {}
    for precision in ("32-true", "16-mixed"):
        torch.manual_seed(0)
        model, moves = _NoneOnEmptyBatch(ghost=False), _ParameterMoves()
        strategy = PRIVATE_STRATEGIES["dp_csgp"](noise_seed=0, max_grad_norm=1.0, noise_multiplier=1.0)
        plugins = [MixedPrecision("16-mixed", device.type)] if precision == "16-mixed" else []
        trainer = pl.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=8, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[moves], plugins=plugins, default_root_dir=tmp_path)
        trainer.fit(model, loader)
        moved[precision] = moves.moves
    assert any(size == 0 for size, _ in moved["16-mixed"])
    for (size, got), (_, want) in zip(moved["16-mixed"], moved["32-true"]):
        assert got == pytest.approx(want, rel=1e-2), size
