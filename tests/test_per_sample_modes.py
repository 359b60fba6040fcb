"""Book-keeping clipping (the default per-sample mode) against Opacus's per-sample gradients, and the CPU fast paths
of the compressors against their reference implementations."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_privdec.algorithms.node import private_step
from lightning_privdec.compression import TopK
from lightning_privdec.compression.bits import _pack_numpy, _pack_torch, _unpack_numpy, _unpack_torch, pack_bits
from lightning_privdec.privacy import GhostClipping, PerSampleGradients, PrivacyConfigError, PrivacyParameters
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.privacy.dp_step import clip_and_accumulate
from lightning_privdec.privacy.per_sample import DEFAULT_GRAD_SAMPLE_MODE

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


class MLP(nn.Module):
    """Linear layers (closed forms), a LayerNorm (per-sample fallback) and optionally a root parameter (functorch)."""

    def __init__(self, root_parameter: bool = False) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 3))
        self.temperature = nn.Parameter(torch.ones(3)) if root_parameter else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out * self.temperature if self.temperature is not None else out


class Tied(nn.Module):
    """One Linear applied twice: its per-sample gradient is the sum of two outer products (no closed-form norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.a(torch.tanh(self.a(x)))))


class Sequence(nn.Module):
    """Embedding + Linear layers on (B, T, d) inputs: the T x T Gram-matrix norms."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(20, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(x))).mean(dim=1))


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.Linear(48, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.conv(x)).flatten(1))


def _batch(model: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    inputs = {
        "mlp": lambda: torch.randn(n, 5, generator=g),
        "mlp_root": lambda: torch.randn(n, 5, generator=g),
        "tied": lambda: torch.randn(n, 4, generator=g),
        "sequence": lambda: torch.randint(0, 20, (n, 4), generator=g),
        "conv": lambda: torch.randn(n, 1, 6, 6, generator=g),
    }[model]()
    return inputs, torch.randint(0, 2, (n,), generator=g)


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {"mlp": MLP, "mlp_root": lambda: MLP(True), "tied": Tied, "sequence": Sequence, "conv": Conv}[name]()


@pytest.mark.parametrize(
    "name, n, clip, reduction",
    [("mlp", 7, 0.5, "mean"), ("mlp", 7, 3.0, "sum"), ("mlp", 0, 1.0, "mean"), ("mlp_root", 6, 1.0, "mean"),
     ("tied", 6, 1.0, "mean"), ("sequence", 5, 1.0, "mean"), ("conv", 5, 3.0, "mean")],
)  # fmt: skip
def test_bookkeeping_clips_exactly_like_materialised_per_sample_gradients(
    name: str, n: int, clip: float, reduction: str, device: torch.device
) -> None:
    """sum_i min(1, C/||g_i||) g_i and the norms ||g_i|| agree with Opacus's per-sample gradients (mode 'hooks')."""
    reference, model = _model(name).to(device), _model(name).to(device)
    hooks = PerSampleGradients(reference, mode="hooks", loss_reduction=reduction)
    book = PerSampleGradients(model, mode="bookkeeping", loss_reduction=reduction)
    x, y = (t.to(device) for t in _batch(name, n))
    for m in (reference, model):
        F.cross_entropy(m(x), y, reduction=reduction).backward()
    expected_sums, expected_norms = clip_and_accumulate(hooks.per_sample_grads(), clip, device)
    for a, b in zip(hooks.per_sample_grads(), book.per_sample_grads()):  # materialised on demand
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    _assert_flat_per_sample_grads_match(hooks, book, n)
    norms = book.clip_and_sum(clip)
    torch.testing.assert_close(norms, expected_norms, atol=1e-5, rtol=2e-3)  # book-keeping's bound: + gamma_{256 T} of its sum
    assert n == 0 or 0 < int((norms > clip).sum()) <= n  # the cases clip at least one example
    for expected, p in zip(expected_sums, book.parameters):
        torch.testing.assert_close(p.grad, expected.to(p.grad.dtype), atol=1e-4, rtol=2e-3)
    assert not any(getattr(p, "grad_sample", None) is not None for p in model.parameters())
    book.clear()
    book.detach()
    assert not hasattr(model, "autograd_grad_sample_hooks")


def _assert_flat_per_sample_grads_match(hooks: PerSampleGradients, book: PerSampleGradients, n: int) -> None:
    """Both modes write the (n, d) matrix of per-sample gradients into a reused buffer, overwriting stale rows."""
    expected = torch.cat([g.flatten(1) for g in hooks.per_sample_grads()], dim=1)
    assert hooks.batch_size == book.batch_size == n
    buffer = torch.full((n + 2, expected.shape[1]), float("nan"), device=expected.device)
    for mode in (hooks, book):
        written = mode.flat_per_sample_grads(buffer[:n])
        assert n == 0 or written.data_ptr() == buffer.data_ptr()
        torch.testing.assert_close(written, expected, atol=1e-5, rtol=1e-4)
    assert torch.isnan(buffer[n:]).all()


class SubBatch(nn.Module):
    """A Linear applied to the first example only, beside full-batch Linears: its per-sample gradient has one row."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.first = nn.Linear(5, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head(h)
        return torch.cat([out[:1] + self.first(h[:1]), out[1:]])


@pytest.mark.parametrize("mode", ["bookkeeping", "hooks", "functorch"])
def test_a_layer_called_on_part_of_the_batch_is_refused(mode: str) -> None:
    """Its per-sample gradients cannot be attributed to their examples: rows given to the wrong examples would let one
    example move the clipped sum by up to 2C."""
    torch.manual_seed(0)
    model, (x, y) = SubBatch(), _batch("mlp", 6)
    book = PerSampleGradients(model, mode=mode)
    F.cross_entropy(model(x), y).backward()
    refusal = r"layer first \(Linear\) was called on 1 examples of a batch of 6.*max_grad_norm"
    with pytest.raises(PrivacyConfigError, match=refusal):
        book.clip_and_sum(1.0)


def test_bookkeeping_backward_passes_guard_and_no_backward() -> None:
    model, x, y = _model("mlp"), *_batch("mlp", 6)
    book = PerSampleGradients(model, mode="bookkeeping")
    assert torch.equal(book.clip_and_sum(1.0), torch.zeros(0))  # a step without backward: zeros, no examples
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in book.parameters)
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="grad accumulation"):  # a second backward before clear()
        F.cross_entropy(model(x), y).backward()
    book.detach()

    reference, model = _model("mlp"), _model("mlp")
    hooks = PerSampleGradients(reference, mode="hooks", allow_grad_accumulation=True)
    book = PerSampleGradients(model, mode="bookkeeping", allow_grad_accumulation=True)
    for m in (reference, model):  # two backward passes: their examples are concatenated
        F.cross_entropy(m(x), y).backward()
        F.cross_entropy(m(x[:2]), y[:2]).backward()
    expected_sums, expected_norms = clip_and_accumulate(hooks.per_sample_grads(), 0.5, torch.device("cpu"))
    _assert_flat_per_sample_grads_match(hooks, book, 8)
    # book-keeping's norms are upper bounds that carry the rounding bound of its own clipped sum
    torch.testing.assert_close(book.clip_and_sum(0.5), expected_norms, rtol=2e-3, atol=1e-5)
    for expected, p in zip(expected_sums, book.parameters):
        torch.testing.assert_close(p.grad, expected.to(p.grad.dtype), rtol=2e-3, atol=1e-4)


def test_the_node_defaults_to_bookkeeping_and_releases_what_hooks_release(device: torch.device) -> None:
    assert DEFAULT_GRAD_SAMPLE_MODE == "bookkeeping"
    x, y = (t.to(device) for t in _batch("mlp_root", 6))
    grads = {}
    for mode in ("bookkeeping", "hooks"):
        model = _model("mlp_root").to(device)
        kwargs = {} if mode == DEFAULT_GRAD_SAMPLE_MODE else {"grad_sample_mode": mode}
        dp = DPCSGPNode(PrivacyParameters(max_grad_norm=0.5, noise_multiplier=1.0), rank=3,
                                   device=device, noise_seed=7, **kwargs)
        dp.attach(model)
        assert dp.clipping.per_sample is not None and dp.clipping.per_sample.mode == mode
        dp.noise_multiplier, dp.sample_rate, dp.expected_batch_size = 1.0, 0.1, 4.0
        F.cross_entropy(model(x), y).backward()
        stats = private_step(dp)  # same noise stream (seed, rank): the released gradients must agree
        assert stats.batch_size == 6 and dp.steps == 1
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["bookkeeping"], grads["hooks"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=2e-3)  # the modes' norm bounds differ by their sums' rounding


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 7, 11, 16, 24, 32])
def test_numpy_bit_packing_matches_the_torch_path(width: int) -> None:
    for n in (0, 1, 9, 1001):
        values = torch.randint(0, 2**width, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int64)
        packed = _pack_torch(values, width)
        assert torch.equal(_pack_numpy(values, width), packed)
        assert torch.equal(_unpack_numpy(packed, width, n, torch.int64), _unpack_torch(packed, width, n))
    signs = torch.randn(77) < 0
    assert torch.equal(pack_bits(signs, 1), _pack_torch(signs, 1))


@pytest.mark.parametrize("kind", ["gaussian", "sorted", "strided", "ties"])
def test_topk_threshold_path_keeps_exactly_the_largest(kind: str) -> None:
    d, ratio = 200_003, 0.01
    g = torch.Generator().manual_seed(1)
    x = {
        "gaussian": lambda: torch.randn(d, generator=g),
        "sorted": lambda: torch.linspace(-1, 1, d),
        "strided": lambda: torch.where(torch.arange(d) % 12 == 0, 10.0, torch.rand(d, generator=g)),  # beats sampling
        "ties": lambda: torch.randint(0, 5, (d,), generator=g).float(),
    }[kind]()
    k = TopK(ratio).num_kept(d)
    kept = TopK.kept_indices(x.abs(), k)
    assert kept.numel() == k and kept.unique().numel() == k
    threshold = torch.topk(x.abs(), k).values[-1]
    assert bool((x.abs()[kept] >= threshold).all())  # a top-k set (ties may be broken either way)
    assert int((x.abs() > threshold).sum()) <= k


class _OwnScale(nn.Module):
    """A layer with no closed-form rule (replayed): x * w."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


@pytest.mark.parametrize("mode", ["hooks", "functorch", "bookkeeping", "ghost"])
def test_a_loss_scale_is_divided_out_before_clipping_and_an_overflowed_example_contributes_zero(
    mode: str, device: torch.device
) -> None:
    """precision="16-mixed" (docs/privacy.md): the backward pass's loss is multiplied by the GradScaler's scale S;
    clipping must see unscaled per-example gradients, and an example whose values overflowed (here NaN from its
    input on) must add nothing rather than poison the sum. Result: exactly the clipped sum of the other examples
    without any scale (float64)."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _OwnScale(8), nn.Linear(8, 3)).double().to(device)

    torch.manual_seed(1)
    x, y, clip, scale = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,)), 0.5, 2.0**12
    x, y = x.to(device), y.to(device)
    kept = [0, 1, 3, 4, 5]
    overflowed = x.clone()
    overflowed[2] = float("nan")

    def clipped_sum(inputs: torch.Tensor, targets: torch.Tensor, loss_scale: float | None) -> list[torch.Tensor]:
        model = build()
        if mode == "ghost":
            ghost = GhostClipping(model, clip)
            losses = F.cross_entropy(model(inputs), targets, reduction="none")
            if loss_scale is not None:
                ghost.set_loss_scale(loss_scale)
                losses = losses * loss_scale
            ghost.backward(losses)
            assert ghost.take_nonfinite_examples() == (1 if loss_scale is not None else 0)
            return [p.grad.clone() for p in model.parameters()]
        with PerSampleGradients(model, mode, loss_reduction="sum") as per_sample:
            if loss_scale is not None:
                per_sample.set_loss_scale(loss_scale)
            (F.cross_entropy(model(inputs), targets, reduction="sum") * (loss_scale or 1.0)).backward()
            per_sample.clip_and_sum(clip)
            assert per_sample.take_nonfinite_examples() == (1 if loss_scale is not None else 0)
        return [p.grad.clone() for p in model.parameters()]

    expected = clipped_sum(x[kept], y[kept], None)
    got = clipped_sum(overflowed, y, scale)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ---- convolutions on channels-last inputs ---------------------------------------------------------------------------
def _channels_last_model(name: str) -> tuple[nn.Module, torch.Tensor, list[nn.Module]]:
    """(model, input, the convolutions that see a channels-last input), float64. ``convnext``: torchvision's ConvNeXt
    built from a small config of convnext_tiny's layout (no weights): stem, three stages of one block, two
    downsamplings (a LayerNorm2d that permutes, then a Conv2d with kernel 2 and stride 2), the classifier."""
    torch.manual_seed(0)
    if name == "conv2d":
        conv = nn.Conv2d(3, 5, 3, padding=1)
        x = torch.randn(4, 3, 6, 6, dtype=torch.float64).to(memory_format=torch.channels_last)
        return nn.Sequential(conv, nn.Tanh(), nn.Conv2d(5, 2, 2, stride=2)).double(), x, [conv]
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    stages = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1), CNBlockConfig(64, None, 1)]
    model = ConvNeXt(stages, stochastic_depth_prob=0.0, layer_scale=0.5, num_classes=5).double()
    return model, torch.randn(3, 3, 16, 16, dtype=torch.float64), [model.features[2][1], model.features[4][1]]


def _per_example_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, d): each example's gradient by its own backward pass."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        loss = F.mse_loss(model(x[i : i + 1]), y[i : i + 1], reduction="sum")
        rows.append(torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)]))
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["conv2d", "convnext"])
@pytest.mark.parametrize("mode", ["bookkeeping", "hooks", "functorch", "ghost"])
def test_every_mode_clips_the_true_per_example_gradients_of_convolutions_on_channels_last_inputs(
    mode: str, name: str
) -> None:
    """Opacus's Conv2d rule unfolds with strides of the contiguous layout: on a channels-last input (ConvNeXt's
    downsampling, after its permuted LayerNorm) the hooks mode's per-example gradients were off by 125-143% and even
    their batch sum by ~100%. Every mode must give the per-example loop's gradients, norms and clipped sum."""
    model, x, convolutions = _channels_last_model(name)
    seen: list[bool] = []
    handles = [c.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous())) for c in convolutions]
    with torch.no_grad():
        y = torch.randn_like(model(x))
    assert seen and not any(seen)  # the case under test: these convolutions read channels-last inputs
    for handle in handles:
        handle.remove()
    expected = _per_example_loop(model, x, y)
    clip = float(expected.norm(dim=1).median())  # about half of the examples are clipped
    params = [p for p in model.parameters() if p.requires_grad]
    expected_sums, expected_norms = clip_and_accumulate(
        [expected[:, start : start + p.numel()].view(-1, *p.shape)
         for start, p in zip(torch.tensor([0] + [p.numel() for p in params]).cumsum(0).tolist(), params)],
        clip, torch.device("cpu"),
    )  # fmt: skip
    if mode == "ghost":
        ghost = GhostClipping(model, clip)
        norms = ghost.backward(F.mse_loss(model(x), y, reduction="none").flatten(1).sum(1))
        ghost.detach()
    else:
        with PerSampleGradients(model, mode) as per_sample:
            F.mse_loss(model(x), y, reduction="sum").div(x.shape[0]).backward()  # a mean over the examples
            # materialised in every mode (PrivSGP-VR's table), then clipped by the mode's own arithmetic
            torch.testing.assert_close(per_sample.flat_per_sample_grads(), expected, rtol=1e-10, atol=1e-12)
            norms = per_sample.clip_and_sum(clip)
    torch.testing.assert_close(norms, expected_norms, rtol=1e-8, atol=1e-12)  # float64: book-keeping's bound adds gamma_{256 T}
    assert 0 < int((norms > clip).sum()) < x.shape[0]
    for p, want in zip(params, expected_sums):
        torch.testing.assert_close(p.grad, want, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("entry", ["clip_and_sum", "per_sample_grads", "flat_per_sample_grads"])
@pytest.mark.parametrize("mode", ["bookkeeping", "hooks", "functorch"])
def test_the_first_step_sum_check_checks_the_arithmetic_the_caller_releases(
    monkeypatch: pytest.MonkeyPatch, mode: str, entry: str
) -> None:
    """A wrong closed-form rule (here Conv2d's, weight gradients doubled) must stop the first step wherever it is
    used: hooks mode, and materialised per-sample gradients in any mode (PrivSGP-VR's table); book-keeping's clipped
    sum and functorch never call it, and are released as they are."""
    from lightning_privdec.privacy.per_sample import capture

    rule = capture.RULES[nn.Conv2d]

    def doubled(layer: nn.Module, activations: list, backprops: torch.Tensor) -> dict:
        samples = rule(layer, activations, backprops)
        samples[layer.weight] = 2 * samples[layer.weight]
        return samples

    monkeypatch.setitem(capture.RULES, nn.Conv2d, doubled)
    model, (x, y) = _model("conv"), _batch("conv", 5)
    per_sample = PerSampleGradients(model, mode)
    F.cross_entropy(model(x), y).backward()
    release = {"clip_and_sum": lambda: per_sample.clip_and_sum(1.0), "per_sample_grads": per_sample.per_sample_grads,
               "flat_per_sample_grads": per_sample.flat_per_sample_grads}[entry]  # fmt: skip
    uses_the_rule = mode == "hooks" or (mode == "bookkeeping" and entry != "clip_and_sum")
    if uses_the_rule:
        with pytest.raises(PrivacyConfigError, match="'conv.weight' do not add up"):
            release()
    else:
        release()
    per_sample.detach()


def test_ghost_losses_under_a_float16_grad_scaler_overflow_no_sooner_than_a_mean_loss(device: torch.device) -> None:
    """A GradScaler's 2^16 times a confidently wrong example's loss gradient (|p - y| = 1) is past float16's 65,504:
    summed as they are, every example's float16 output gradient overflows and the example is zeroed. The sum carries
    the mean loss's power-of-two factor (2^-4 at 16 examples) instead: nothing overflows, and the clipped sum is
    float32's."""
    torch.manual_seed(0)
    x, y = torch.randn(16, 4, device=device), torch.ones(16, dtype=torch.long, device=device)

    def clipped_sum(precision: str, factor: bool = True) -> tuple[torch.Tensor, int]:
        model = nn.Linear(4, 2).to(device)
        with torch.no_grad():
            model.weight.mul_(0.01)
            model.bias.copy_(torch.tensor([20.0, -20.0]))  # p(y = 1) ~ e^-40: every example wrong and sure of it
        ghost = GhostClipping(model, 1.0)
        scale = 2.0**16 if precision == "16-mixed" else 1.0
        ghost.set_loss_scale(scale)
        if not factor:  # the plain sum (the positive control)
            ghost.loss_sum = lambda losses, expected=None: losses.sum()
        with torch.autocast(device.type, dtype=torch.float16, enabled=precision == "16-mixed"):
            losses = F.cross_entropy(model(x), y, reduction="none")
        ghost.backward(losses.float() * scale, expected_batch_size=16)
        dropped = ghost.take_nonfinite_examples()
        ghost.detach()
        return torch.cat([model.weight.grad.flatten(), model.bias.grad]), dropped

    want, _ = clipped_sum("32-true")
    got, dropped = clipped_sum("16-mixed")
    assert dropped == 0
    assert float((got - want).norm() / want.norm()) < 1e-2
    assert clipped_sum("16-mixed", factor=False)[1] == 16  # without the factor every example overflows


@pytest.mark.parametrize(("clip", "message"), [(0.0, "must be a positive number"), (1e-9, "is below 2^-26")])
def test_ghost_clipping_refuses_a_clip_bound_the_clipping_does_not_cover(clip: float, message: str) -> None:
    """GhostClipping(model, C) checks C as the strategies do (privacy.validation.check_max_grad_norm)."""
    from lightning_privdec.privacy import GhostClipping
    from lightning_privdec.privacy.errors import PrivacyConfigError

    with pytest.raises(PrivacyConfigError, match=re.escape(message)):
        GhostClipping(nn.Linear(2, 2), clip)
