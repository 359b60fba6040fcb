"""Book-keeping's per-layer norms and clipped sums (privacy/per_sample/bookkeeping.py) against a per-example backward
loop in float64, through both of its ways to a norm (ghost Gram matrices and one example at a time)."""

from __future__ import annotations

import copy
import math
import itertools

import pytest
import torch
from torch import Tensor, nn

from lightning_privdec.audit.sensitivity import ATTACKS
from lightning_privdec.privacy.per_sample import (
    PerSampleGradients,
    bookkeeping,
    bookkeeping_conv,
)

LAYERS = {
    # name: (layer, input shape without the batch); comments: which norm the cost rule picks
    "linear_2d": (lambda: nn.Linear(7, 5), (7,)),  # T = 1: ghost
    "linear_3d_ghost": (lambda: nn.Linear(16, 12), (3, 16)),  # T (p + d) = 84 < 192
    "linear_3d_per_example": (lambda: nn.Linear(4, 3), (9, 4)),  # 63 > 12
    "conv2d_per_example": (lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 8, 8)),  # T = 64
    "conv2d_input_gram": (lambda: nn.Conv2d(32, 32, 3, padding=1), (32, 6, 6)),  # ResNet's small-map stages
    "conv2d_groups_input_gram": (lambda: nn.Conv2d(64, 64, 3, padding=1, groups=2, bias=False), (64, 6, 6)),
    "conv1d_input_gram": (lambda: nn.Conv1d(64, 64, 3, padding=1), (64, 10)),
    "conv2d_ghost": (lambda: nn.Conv2d(16, 24, 3, stride=2, padding=1), (16, 4, 4)),  # T = 4
    "conv2d_groups_dilation": (lambda: nn.Conv2d(8, 12, 3, padding=2, dilation=2, groups=4, bias=False), (8, 5, 5)),
    "conv2d_depthwise_ghost": (lambda: nn.Conv2d(6, 6, (3, 1), groups=6), (6, 3, 1)),  # T = 1
    "conv2d_asymmetric": (lambda: nn.Conv2d(5, 7, (3, 2), stride=(2, 1), padding=(1, 0)), (5, 6, 5)),
    "conv1d_ghost": (lambda: nn.Conv1d(12, 10, 3, padding=1), (12, 2)),
    "conv1d_per_example": (lambda: nn.Conv1d(2, 3, 5, stride=2), (2, 31)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, padding=1), (2, 3, 3, 3)),
    # kernel taps that read only padding (their gradient is 0, the rest comes from a cropped kernel)
    "conv2d_dead_taps": (lambda: nn.Conv2d(8, 12, 3, padding=1), (8, 1, 1)),  # only the centre is live
    "conv2d_strided_dead_taps": (lambda: nn.Conv2d(6, 8, 3, stride=2, padding=1), (6, 2, 2)),
    "conv2d_dilated_dead_taps": (lambda: nn.Conv2d(4, 6, (3, 7), stride=(1, 3), padding=(2, 3), dilation=(2, 1)), (4, 1, 5)),
    "conv3d_dead_taps": (lambda: nn.Conv3d(2, 3, 3, padding=1), (2, 1, 1, 2)),
    # MobileNetV3's late depthwise layers: a 5 x 5 kernel on a 2 x 2 map, two output channels per input channel
    "conv2d_depthwise_dead_taps": (lambda: nn.Conv2d(6, 12, 5, stride=2, padding=2, groups=6), (6, 2, 2)),
    "hf_conv1d_ghost": (lambda: _hf_conv1d(24, 16), (3, 16)),  # GPT-2's transposed linear layer
    "hf_conv1d_2d": (lambda: _hf_conv1d(5, 7), (7,)),
}


def _hf_conv1d(out_features: int, in_features: int) -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(out_features, in_features)
    nn.init.normal_(layer.bias)
    return layer


def _per_example(layer: nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(x.shape[0]):
        layer.zero_grad()
        (layer(x[i : i + 1]) * cotangent[i : i + 1]).sum().backward()
        out.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    return out


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_norms_and_clipped_sum_equal_a_per_example_loop(name: str) -> None:
    build, shape = LAYERS[name]
    torch.manual_seed(0)
    layer = build().double()
    x = torch.randn(5, *shape, dtype=torch.float64)
    cotangent = torch.randn_like(layer(x))
    expected = _per_example(layer, x, cotangent)
    norms2 = torch.stack([sum(g.square().sum() for g in e.values()) for e in expected])
    factor = torch.rand(5, dtype=torch.float64)

    assert bookkeeping.has_bookkeeping(layer, cotangent)
    got = bookkeeping.squared_norms(layer, x, cotangent, torch.float64)
    torch.testing.assert_close(got, norms2, rtol=1e-10, atol=1e-12)
    sums = bookkeeping.clipped_sums(layer, x, cotangent, factor)
    for n, p in layer.named_parameters():
        want = sum(f * e[n] for f, e in zip(factor, expected))
        torch.testing.assert_close(sums[p].view_as(p), want, rtol=1e-10, atol=1e-12)


CONV_LAYERS = sorted(n for n in LAYERS if n.startswith(("conv1d", "conv2d")))


@pytest.mark.parametrize("method", ["ghost", "input_gram", "per_example"])
@pytest.mark.parametrize("name", CONV_LAYERS)
def test_every_norm_method_gives_the_per_example_norms(name: str, method: str) -> None:
    """Whatever the cost rule would pick: each of the three ways to a convolution's norms, on strides, dilation,
    groups, asymmetric kernels and 1-d inputs, equals the per-example loop."""
    build, shape = LAYERS[name]
    torch.manual_seed(4)
    layer = build().double()
    x = torch.randn(4, *shape, dtype=torch.float64)
    cotangent = torch.randn_like(layer(x))
    expected = torch.stack([sum(g.square().sum() for g in e.values()) for e in _per_example(layer, x, cotangent)])
    got = bookkeeping.squared_norms(layer, x, cotangent, torch.float64, method)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


def test_the_cost_rule_picks_every_way() -> None:
    """The cases above exercise every norm: ghost for tiny maps / short sequences, the input's Gram for small maps
    with many channels, per example otherwise."""
    picks = {}
    for name, (build, shape) in LAYERS.items():
        layer = build()
        x = torch.zeros(2, *shape)
        picks[name] = bookkeeping.norm_method(layer, x, torch.zeros(layer(x).shape))
    ghost = ("conv2d_ghost", "conv1d_ghost", "linear_3d_ghost", "linear_2d", "hf_conv1d_ghost")
    assert all(picks[n] == "ghost" for n in ghost), picks
    assert all(picks[n] == "input_gram" for n in LAYERS if n.endswith("input_gram")), picks
    per_example = ("conv2d_per_example", "conv1d_per_example", "linear_3d_per_example", "conv3d")
    assert all(picks[n] == "per_example" for n in per_example), picks


def test_circular_padding_and_same_padding_keep_the_closed_form_rule() -> None:
    assert not bookkeeping.covers(nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"))
    assert not bookkeeping.covers(nn.Conv2d(3, 4, 3, padding="same"))
    assert bookkeeping.covers(nn.Conv2d(3, 4, 3, padding=1))


def test_bookkeeping_clips_a_convolutional_network_like_hooks() -> None:
    """Whole model: book-keeping's clipped sum equals the materialising mode's (float64), with strides, groups,
    GroupNorm, a residual in place and both norm ways in one network."""
    torch.manual_seed(1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Conv2d(3, 8, 3, padding=1)
            self.norm = nn.GroupNorm(2, 8)
            self.block = nn.Conv2d(8, 8, 3, padding=1, groups=2)
            self.down = nn.Conv2d(8, 32, 3, stride=4, padding=1)
            self.head = nn.Linear(32 * 16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.norm(self.stem(x)))
            out = self.block(h)
            out += h  # torchvision's residual, in place on a layer's output
            h = out
            return self.head(torch.relu(self.down(h)).flatten(1))

    x, y = torch.randn(6, 3, 16, 16, dtype=torch.float64), torch.randint(0, 3, (6,))
    results = {}
    for mode in ("hooks", "bookkeeping"):
        torch.manual_seed(2)
        model = Net().double()
        with PerSampleGradients(model, mode) as per_sample:
            nn.functional.cross_entropy(model(x), y).backward()
            norms = per_sample.clip_and_sum(0.05)
            results[mode] = (norms, [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(results["bookkeeping"][0], results["hooks"][0], rtol=1e-9, atol=1e-12)
    for a, b in zip(results["bookkeeping"][1], results["hooks"][1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_after_the_first_step_the_backward_skips_weight_gradients_and_results_stay_the_same() -> None:
    """From the second step on, rule layers' parameters stop requiring grad during their call (autograd's batch
    weight gradient is never read once the first step's sums check passed): the clipped sums stay equal to the
    materialising mode's, every parameter requires grad again after the forward pass (also one that raised), and
    autograd left no gradient of its own in a rule layer's weight."""
    torch.manual_seed(3)
    model_a = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    model_b = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    model_b.load_state_dict(model_a.state_dict())
    model_a, model_b = model_a.double(), model_b.double()
    per_a, per_b = PerSampleGradients(model_a, "bookkeeping"), PerSampleGradients(model_b, "hooks")
    seen_during_forward = []
    # runs after the per-sample pre-hook: what the layer's call sees (the stem's input never requires grad, so the
    # stem keeps its weight gradient: its output must still require grad)
    model_a[4].register_forward_pre_hook(lambda m, i: seen_during_forward.append(m.weight.requires_grad))
    for step in range(3):
        x, y = torch.randn(5, 2, 4, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
        for model, per in ((model_a, per_a), (model_b, per_b)):
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            if model is model_a:
                assert all(p.requires_grad for p in model.parameters())
                assert (model[4].weight.grad is None) == (step > 0)  # skipped from the second step on
                assert model[0].weight.grad is not None
            per.clip_and_sum(0.1)
            per.clear()
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    assert seen_during_forward == [True, False, False]

    def failing(module, inputs):  # noqa: ANN001, ANN202
        raise RuntimeError("boom")

    handle = model_a[4].register_forward_pre_hook(failing)  # raises after ours froze the weight
    with pytest.raises(RuntimeError, match="boom"):
        model_a(torch.randn(2, 2, 4, 4, dtype=torch.float64))
    handle.remove()
    per_a.clear()  # (the always-called forward hook or, at the latest, the end of the step restores it)
    assert all(p.requires_grad for p in model_a.parameters())
    per_a.detach()
    per_b.detach()


def test_a_non_reentrant_checkpoint_keeps_every_parameter_trained() -> None:
    """A checkpointed block is recomputed in the backward pass and the recomputation stops early (before the
    layer's forward hooks): its layers must still be unfrozen and clipped from the second step on."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.a(x))
            h = checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=False)
            return self.c(h)

    torch.manual_seed(4)
    model_a, model_b = Net().double(), Net().double()
    model_b.load_state_dict(model_a.state_dict())
    per_a, per_b = PerSampleGradients(model_a, "bookkeeping"), PerSampleGradients(model_b, "hooks")
    for _ in range(3):
        x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
        for model, per in ((model_a, per_a), (model_b, per_b)):
            model.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            per.clip_and_sum(0.2)
            per.clear()
        assert all(p.requires_grad and p.grad is not None for p in model_a.parameters())
        for a, b in zip(model_a.parameters(), model_b.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    per_a.detach()
    per_b.detach()


@pytest.mark.parametrize("name", ["conv2d_per_example", "conv2d_ghost", "conv1d_ghost", "conv3d", "linear_3d_ghost"])
def test_an_empty_batch_gives_no_norms_and_zero_sums(name: str) -> None:
    build, shape = LAYERS[name]
    layer = build().double()
    x = torch.zeros(0, *shape, dtype=torch.float64)
    g = torch.zeros_like(layer(x))
    assert bookkeeping.squared_norms(layer, x, g, torch.float64).shape == (0,)
    for p, summed in bookkeeping.clipped_sums(layer, x, g, torch.zeros(0, dtype=torch.float64)).items():
        assert summed.view_as(p).abs().sum() == 0


@pytest.mark.parametrize("name", ["linear_3d_ghost", "linear_3d_per_example", "conv2d_input_gram", "conv2d_ghost"])
def test_an_example_with_zero_output_gradients_is_not_computed_apart(name: str) -> None:
    """An example that no loss reaches (a zero-initialised head, a dead unit) adds exactly 0: it is neither marked
    ill-conditioned nor recomputed in float64, and its bound is still an upper bound (>= 0); with a non-finite
    input it is marked (its bound is not finite), so that 0 * inf never reaches the batch's sum."""
    build, shape = LAYERS[name]
    torch.manual_seed(5)
    layer = build()
    x = torch.randn(3, *shape)
    g = torch.randn_like(layer(x))
    g[0] = 0.0
    bound = bookkeeping.norm_bound(layer, x, g, defer_exact=True)
    assert not bool(bound.exact[0]) and float(bound.upper[0]) >= 0.0
    factor = torch.ones(3, dtype=torch.float64)
    with_zero = bookkeeping.clipped_sums(layer, x, g, factor, bookkeeping.compute_exact(layer, x, g, bound))
    without = bookkeeping.clipped_sums(layer, x[1:], g[1:], factor[1:])
    for p in with_zero:  # (up to the float32 rounding of a product over other rows)
        torch.testing.assert_close(with_zero[p], without[p], rtol=1e-5, atol=1e-5)
    x[0].view(-1)[0] = float("inf")
    assert bool(bookkeeping.norm_bound(layer, x, g, defer_exact=True).exact[0])


def test_all_zero_marks_exactly_the_examples_whose_every_entry_is_zero() -> None:
    """Zeros and negative zeros are zero; one NaN, infinity or denormal among zeros is not; an example without
    entries is (it adds nothing)."""
    g = torch.zeros(6, 3, 4)
    g[1, 2, 3] = -0.0
    g[2, 0, 1] = float("nan")
    g[3, 1, 1] = float("-inf")
    g[4, 2, 2] = 1e-45  # the smallest float32 denormal
    g[5] = torch.randn(3, 4)
    assert bookkeeping._all_zero(g).tolist() == [True, True, False, False, False, False]
    assert bookkeeping._all_zero(torch.zeros(2, 0, 5)).tolist() == [True, True]
    assert bookkeeping._all_zero(torch.zeros(0, 4)).tolist() == []


def test_an_isolated_convolution_examples_bound_is_finite_for_half_precision_and_huge_finite_inputs() -> None:
    """The float64 path of an isolated example takes its terms' mass from float32 patch norms: bfloat16 activations
    (autocast) are cast to float32 first (bfloat16's own rounding bound is infinite for a 3 x 3 x 64 patch), and a
    finite input whose float32 square overflows gets float64 patch norms (else its bound is inf, or NaN where its
    output gradients are 0), as before; either way the bound covers the float64 gradient's norm."""
    torch.manual_seed(11)
    layer = nn.Conv2d(64, 8, 3, padding=1)
    a = torch.randn(2, 64, 5, 5)
    g = torch.randn(2, 8, 5, 5)
    _, upper_half = bookkeeping._exact_gradients(layer, a.bfloat16(), g, torch.float32)
    _, upper_float = bookkeeping._exact_gradients(layer, a.bfloat16().float(), g, torch.float32)
    assert torch.equal(upper_half, upper_float) and bool(torch.isfinite(upper_half).all())
    a[0, 0, 2, 2] = 1e20
    g[0, :, 1:4, 1:4] = 0.0  # no output position that reads the huge input has a gradient
    grads, upper = bookkeeping._exact_gradients(layer, a, g, torch.float32)
    assert bool(torch.isfinite(upper).all())
    norms = torch.linalg.vector_norm(torch.cat([v.flatten(1) for v in grads.values()], dim=1), dim=1)
    assert bool((upper >= norms).all())


def test_a_linear_layer_on_empty_sequences_has_a_zero_bound() -> None:
    """A (B, 0, d) input (every example's sequence empty): no entries, a gradient of exactly 0, a bound of 0."""
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 0, 4)
    g = torch.randn_like(layer(x))
    bound = bookkeeping.norm_bound(layer, x, g)
    assert not bool(bound.exact.any()) and bool((bound.upper >= 0).all()) and bool(torch.isfinite(bound.upper).all())


def test_per_example_norms_in_chunks_equal_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(6)
    g, a = torch.randn(7, 9, 3), torch.randn(7, 9, 4)
    one_at_a_time = torch.stack([bookkeeping.norm_upper_bound(g[i].t() @ a[i]) for i in range(7)])
    for entries in (1, 24, 1 << 22):  # one example, two examples, all at once
        monkeypatch.setattr(bookkeeping, "PER_EXAMPLE_ENTRIES", entries)
        torch.testing.assert_close(bookkeeping._per_example_weight_norms(g, a), one_at_a_time, rtol=1e-6, atol=0)


@pytest.mark.parametrize("group_entries", [bookkeeping.GROUP_ENTRIES, 2 * 4 * 5 * (16 + 12)])
def test_calls_of_one_shape_get_the_bounds_each_would_get_alone(
    monkeypatch: pytest.MonkeyPatch, group_entries: int
) -> None:
    """norm_bounds stacks calls of one shape (a transformer's projections), at most GROUP_ENTRIES entries at a time:
    each call's bounds and ill-conditioned marks are what norm_bound gives it alone; calls of other shapes are
    computed apart."""
    monkeypatch.setattr(bookkeeping, "GROUP_ENTRIES", group_entries)
    torch.manual_seed(7)
    same = [nn.Linear(16, 12) for _ in range(3)]
    other = nn.Linear(12, 16)
    calls = [(layer, torch.randn(4, 5, 16), torch.randn(4, 5, 12)) for layer in same]
    calls.append((other, torch.randn(4, 5, 12), torch.randn(4, 5, 16)))
    calls[1][2][2] = 0.0  # an example no loss reaches
    model, (x, target), _ = ATTACKS["gram_linear"][0]()
    calls.append((model, x, target))  # an ill-conditioned example 0
    calls.append((nn.Linear(16, 8, bias=False), x.clone(), target.clone()))
    stacked = bookkeeping.norm_bounds(calls)
    for (layer, a, g), bound in zip(calls, stacked):
        alone = bookkeeping.norm_bound(layer, a, g, defer_exact=True)
        torch.testing.assert_close(bound.upper, alone.upper, rtol=1e-6, atol=0)
        assert torch.equal(bound.exact, alone.exact)
    assert bool(stacked[-1].exact[0]) and bool(stacked[-2].exact[0])
    keys = [bookkeeping._shape_key(layer, a, g) for layer, a, g in calls]
    groups = bookkeeping._groups(keys, [a.numel() + g.numel() for _, a, g in calls])
    assert groups[0] == ([0, 1] if group_entries < 3 * 4 * 5 * (16 + 12) else [0, 1, 2])


def test_larger_calls_are_stacked_on_a_gpu_than_on_a_cpu() -> None:
    """A call of 2^21 entries is past the CPU's stacking limit and within a GPU's (the meta device stands in)."""
    layer = nn.Linear(64, 64)
    a, g = torch.empty(256, 64, 64), torch.empty(256, 64, 64)
    assert bookkeeping._shape_key(layer, a, g) is None
    assert bookkeeping._shape_key(layer, a.to("meta"), g.to("meta")) is not None


@pytest.mark.parametrize("group_entries", [bookkeeping.GROUP_ENTRIES, 5 * 3 * (16 + 12)])
def test_calls_of_one_shape_get_the_clipped_sums_each_would_get_alone(
    monkeypatch: pytest.MonkeyPatch, group_entries: int
) -> None:
    """clipped_sums_of batches the nn.Linear calls of one shape, at most GROUP_ENTRIES entries at a time (here: all
    of a shape together, or each call alone): each layer's sums are what clipped_sums gives it alone."""
    monkeypatch.setattr(bookkeeping, "GROUP_ENTRIES", group_entries)
    groups = []
    split = bookkeeping._groups
    monkeypatch.setattr(bookkeeping, "_groups", lambda *args: groups.append(made := split(*args)) or made)
    torch.manual_seed(8)
    from transformers.pytorch_utils import Conv1D

    layers = [nn.Linear(16, 12), nn.Linear(16, 12), nn.Linear(16, 12, bias=False), Conv1D(12, 16), Conv1D(12, 16),
              nn.Linear(16, 12)]  # fmt: skip
    calls = []
    for layer, batch in zip(layers, (5, 5, 5, 5, 5, 3)):  # the last: the first two's shape on another batch size
        a, g = torch.randn(batch, 3, 16), torch.randn(batch, 3, 12)
        bound = bookkeeping.norm_bound(layer, a, g)
        calls.append((layer, a, g, torch.rand(batch, dtype=torch.float64), bound))
    for (layer, a, g, factor, bound), together in zip(calls, bookkeeping.clipped_sums_of(calls)):
        alone = bookkeeping.clipped_sums(layer, a, g, factor, bound)
        assert together.keys() == alone.keys()
        for p in alone:
            torch.testing.assert_close(together[p], alone[p], rtol=1e-6, atol=1e-6)
            assert together[p].untyped_storage().nbytes() == together[p].numel() * together[p].element_size()
    assert groups == [[[0, 1], [2], [3, 4], [5]] if group_entries > 5 * 3 * (16 + 12) else [[k] for k in range(6)]]


def test_small_materialised_gradients_are_clipped_side_by_side_as_each_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-example gradients a closed form materialises (small embeddings, LayerNorms) are bounded and summed
    side by side, one norm bound of their concatenated rows and one product for the clipped sums: the norms and sums
    of each taken alone, up to rounding, every norm at least the exact per-example norm."""
    from lightning_privdec.privacy.per_sample import arithmetic

    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.norm1, self.norm2 = nn.Embedding(11, 6), nn.LayerNorm(6), nn.LayerNorm(6)
            self.head = nn.Linear(6, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm2(torch.tanh(self.norm1(self.embed(tokens))))).mean(dim=1)

    groups = []
    stacked_rows = arithmetic._stacked_rows
    monkeypatch.setattr(arithmetic, "_stacked_rows",
                        lambda materialised: groups.append(stacked := stacked_rows(materialised)) or stacked)
    torch.manual_seed(5)
    models = [Tagger(), Tagger()]
    for p in models[0].parameters():
        nn.init.normal_(p)
    models[1].load_state_dict(models[0].state_dict())
    tokens, targets = torch.randint(0, 11, (7, 4)), torch.randn(7, 3)
    results, sizes = [], []
    for model, stack_entries in zip(models, (bookkeeping.STACK_ENTRIES, 0)):
        monkeypatch.setattr(bookkeeping, "STACK_ENTRIES", stack_entries)
        with PerSampleGradients(model, "bookkeeping") as per_sample:
            nn.functional.mse_loss(model(tokens), targets).backward()
            norms = per_sample.clip_and_sum(1.0)
        results.append((norms, [p.grad.clone() for p in model.parameters()]))
        sizes.append({tuple(len(params) for params, _ in stacked) for stacked in groups})
        groups.clear()
    assert sizes == [{(5,)}, {(1,) * 5}]  # the embedding's and both LayerNorms' together; each alone
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=0)  # the bounds' own margins differ
    for together, alone in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)  # (through their clip factors)
    exact = []  # each example's gradient norm, in float64, one at a time
    reference = Tagger().double()
    reference.load_state_dict(models[0].state_dict())
    for i in range(7):
        reference.zero_grad()
        (7 * nn.functional.mse_loss(reference(tokens[i : i + 1]), targets[i : i + 1].double()) / 7).backward()
        exact.append(torch.sqrt(sum(p.grad.square().sum() for p in reference.parameters())))
    assert bool((results[0][0].double() >= torch.stack(exact) * (1 - 1e-7)).all())


@pytest.mark.parametrize("name", ["conv2d_per_example", "conv2d_groups_dilation", "conv2d_dead_taps",
                                  "conv1d_per_example", "conv2d_asymmetric", "conv3d"])  # fmt: skip
@pytest.mark.parametrize("position_block", [1 << 10, 1, 3])
def test_per_example_convolution_norms_in_chunks_equal_one_at_a_time(
    name: str, position_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Per-example weight gradients by chunks of examples and, where the map holds more than POSITION_BLOCK
    positions (BLOCKED_LOOSENESS 0), by blocks of output rows added in float64: each example's own gradient and
    norm."""
    monkeypatch.setattr(bookkeeping_conv, "POSITION_BLOCK", position_block)
    monkeypatch.setattr(bookkeeping_conv, "BLOCKED_LOOSENESS", 0.0)  # blocks wherever the map holds more
    build, shape = LAYERS[name]
    torch.manual_seed(9)
    layer = build()
    a = torch.randn(5, *shape)
    g = torch.randn_like(layer(a))
    one_at_a_time = torch.stack([
        bookkeeping.norm_upper_bound(bookkeeping_conv._conv_weight_grad(layer, g[i : i + 1], a[i : i + 1]))
        for i in range(5)
    ])  # fmt: skip
    one_gradient_each = torch.stack([
        bookkeeping_conv._conv_weight_grad(layer, g[i : i + 1], a[i : i + 1]).flatten() for i in range(5)
    ])  # fmt: skip
    for entries in (1, 2 * layer.weight.numel(), 1 << 22):  # one example, two, all at once
        monkeypatch.setattr(bookkeeping_conv, "PER_EXAMPLE_ENTRIES", entries)
        norms, kept, terms, products = bookkeeping_conv._per_example_weight_norms(layer, a, g, keep=True)
        torch.testing.assert_close(norms, one_at_a_time, rtol=1e-5, atol=0)
        torch.testing.assert_close(kept, one_gradient_each, rtol=1e-4, atol=1e-5)  # (rounded in another grouping)
        assert kept.dtype == g.dtype
        assert bookkeeping_conv._per_example_weight_norms(layer, a, g)[1] is None  # kept only when asked
        positions, per_row = g.shape[2:].numel(), g.shape[3:].numel()
        if positions <= position_block:
            assert (terms, products) == (positions, 1)
        else:  # rows of at most position_block positions (one row at least)
            rows = max(1, position_block // per_row)
            assert (terms, products) == (rows * per_row, -(-g.shape[2] // rows))


def test_a_kept_row_whose_blocks_overflow_only_when_added_is_computed_apart() -> None:
    """Each block's float32 gradient finite, their float64 sum past float32's largest value (a review's case): the
    kept row is infinite, so the example's norm is too and it is computed apart, its row left out of the sum; the
    clipped sums stay finite and one example moves them by at most C."""
    from lightning_privdec.privacy.dp_step import clip_factor

    torch.manual_seed(0)
    length = 16 * bookkeeping_conv.POSITION_BLOCK
    conv = nn.Conv1d(1, 1, 1, bias=False)
    a, g = torch.randn(4, 1, length), torch.randn(4, 1, length)
    a[0], g[0] = 1.0, 3e34  # a block: 3.1e37; the example: 4.9e38
    assert bookkeeping_conv._needs_position_blocks(length, 1, torch.float32)

    def clipped(a: torch.Tensor, g: torch.Tensor, clip: float) -> torch.Tensor:
        bound = bookkeeping.compute_exact(conv, a, g, bookkeeping.norm_bounds([(conv, a, g)])[0])
        assert bound.rows is not None
        return bookkeeping.clipped_sums(conv, a, g, clip_factor(bound.upper, clip), bound)[conv.weight].double()

    bound = bookkeeping.norm_bounds([(conv, a, g)])[0]
    assert not bool(torch.isfinite(bound.upper[0])) and bool(bound.exact[0])
    for clip in (1.0, 100.0):
        full = clipped(a, g, clip)
        assert bool(torch.isfinite(full).all())
        assert float((full - clipped(a[1:], g[1:], clip)).norm()) <= clip * (1 + 1e-5)


def test_an_ill_conditioned_kept_row_is_computed_apart() -> None:
    """A kept per-example row whose terms are large against its norm (two positions' patches differing by one pixel
    under opposite output gradients: mass about 5,000 times the norm) is computed apart, as exact_rows does for
    materialised rows, though its bound is not loose (its rounding bound about 3% of its norm); an honest row is
    not."""
    torch.manual_seed(2)
    layer = nn.Conv2d(3, 4, 3, bias=False)
    a, g = torch.randn(5, 3, 8, 8), torch.randn(5, 4, 6, 6)
    a[0] = 10.0
    a[0, :, 2, 2] += 0.02  # the top-left pixel of position (2, 2)'s patch only
    e = torch.randn(4)
    g[0] = 0
    g[0, :, 2, 2], g[0, :, 2, 3] = 1e4 * e / e.norm(), -1e4 * e / e.norm()
    assert bookkeeping.norm_method(layer, a, g) == "per_example" and bookkeeping_conv.keeps_rows(layer, a, g)
    bound = bookkeeping.norm_bounds([(layer, a, g)])[0]
    assert bound.rows is not None and bound.exact.tolist() == [True, False, False, False, False]
    exact = bookkeeping.compute_exact(layer, a, g, bound)
    assert not bool(exact.rows[0].any()) and bool(torch.isfinite(exact.upper).all())


def test_only_maps_whose_whole_map_bound_would_be_loose_are_summed_by_blocks() -> None:
    """ResNet's stem on a 224 x 224 image (12,544 positions, patches of 147) by blocks; its 64-channel 3 x 3 layers on
    56 x 56 maps (3,136 positions, bound about 1.2% above) and any map of at most POSITION_BLOCK positions not."""
    needs = bookkeeping_conv._needs_position_blocks
    assert needs(112 * 112, 147, torch.float32)
    assert not needs(56 * 56, 576, torch.float32)
    assert not needs(bookkeeping_conv.POSITION_BLOCK, 10**6, torch.bfloat16)
    assert needs(56 * 56, 576, torch.bfloat16)


@pytest.mark.parametrize("name", ["conv2d_per_example", "conv1d_per_example", "conv3d", "conv2d_asymmetric"])
def test_per_example_bounds_by_blocks_of_positions_hold_each_example_s_exact_norm(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 per-example weight gradients summed by blocks of output rows, the blocks added in float64 (a small
    POSITION_BLOCK): every bound, with and without the kept rows, is at least the example's float64 norm and within
    1% of it (nobody is computed apart), and the kept rows' clipped sum is the per-example loop's."""
    monkeypatch.setattr(bookkeeping_conv, "POSITION_BLOCK", 3)
    monkeypatch.setattr(bookkeeping_conv, "BLOCKED_LOOSENESS", 0.0)
    build, shape = LAYERS[name]
    torch.manual_seed(5)
    layer = build()
    a = torch.randn(6, *shape) * 10 + 3
    g = torch.randn_like(layer(a))
    reference = copy.deepcopy(layer).double()
    expected = _per_example(reference, a.double(), g.double())
    exact = torch.stack([sum(e.square().sum() for e in grads.values()) for grads in expected]).sqrt()
    bounds = bookkeeping.norm_bound(layer, a, g, "per_example"), bookkeeping.norm_bounds([(layer, a, g)])[0]
    kept = bookkeeping.norm_method(layer, a, g) == "per_example" and bookkeeping_conv.keeps_rows(layer, a, g)
    assert (bounds[1].rows is not None) == kept
    for bound in bounds:
        assert not bool(bound.exact.any())
        assert bool((bound.upper >= exact).all()) and bool((bound.upper <= exact * 1.01).all())
    factor = torch.rand(6, dtype=torch.float64)
    for p, value in bookkeeping.clipped_sums(layer, a, g, factor, bounds[1]).items():  # kept rows (where kept)
        name_of = next(n for n, q in layer.named_parameters() if q is p)
        want = sum(f * e[name_of] for f, e in zip(factor, expected))
        torch.testing.assert_close(value.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["conv2d_per_example", "conv1d_per_example", "conv3d"])
def test_a_convolution_keeps_its_per_example_gradients_for_its_clipped_sum(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A convolution whose norms are computed one example at a time keeps those gradients (where they hold no more
    entries than its input, its output gradient or PER_EXAMPLE_ENTRIES) and sums them with the clip factors instead
    of a second weight-gradient computation: the sums of that computation, a bound above the exact norm but without
    the batch product's rounding, and examples computed apart still added apart."""
    build, shape = LAYERS[name]
    torch.manual_seed(4)
    layer = build()
    a = torch.randn(6, *shape)
    g = torch.randn_like(layer(a))
    assert bookkeeping.norm_method(layer, a, g) == "per_example"
    kept = bookkeeping.norm_bounds([(layer, a, g)])[0]
    plain = bookkeeping.norm_bound(layer, a, g)
    assert kept.rows is not None and kept.rows.shape == (6, layer.weight.numel())
    assert plain.rows is None  # only the clipped sum's own bounds keep them
    exact = torch.stack([sum(e.square().sum() for e in grads.values())
                         for grads in _per_example(copy.deepcopy(layer).double(), a.double(), g.double())]).sqrt()
    # above each example's norm, and below the bound with the batch's weight-gradient rounding the kept rows avoid
    assert bool((kept.upper >= exact).all()) and bool((kept.upper <= plain.upper).all())
    factor = torch.rand(6, dtype=torch.float64)
    together = bookkeeping.clipped_sums(layer, a, g, factor, kept)
    apart = bookkeeping.clipped_sums(layer, a, g, factor, plain)
    assert together.keys() == apart.keys()
    for p in apart:
        torch.testing.assert_close(together[p], apart[p], rtol=1e-5, atol=1e-6)
    marked = bookkeeping.NormBound(kept.upper, torch.tensor([True, False, False, False, False, True]), rows=kept.rows)
    marked = bookkeeping.compute_exact(layer, a, g, marked)  # examples 0 and 5 computed apart in float64
    assert marked.exact_grads and not bool(marked.rows[[0, 5]].any())  # their rows leave the rows' sum
    assert torch.equal(marked.rows[1:5], kept.rows[1:5])
    for p, value in bookkeeping.clipped_sums(layer, a, g, factor, marked).items():
        torch.testing.assert_close(value, apart[p], rtol=1e-5, atol=1e-6)
    # 3,200 weight entries per example against 2 x 10 x 10 input entries and 64 x 6 x 6 output gradient entries
    monkeypatch.setattr(bookkeeping_conv, "PER_EXAMPLE_ENTRIES", 6 * 3200 - 1)
    wide = nn.Conv2d(2, 64, 5)
    x = torch.randn(6, 2, 10, 10)
    assert bookkeeping.norm_method(wide, x, wide(x)) == "per_example"
    assert bookkeeping.norm_bounds([(wide, x, torch.randn_like(wide(x)))])[0].rows is None


def test_a_kept_row_that_overflowed_is_left_out_of_the_sum() -> None:
    """An example of finite inputs and output gradients whose float32 per-example weight gradient overflows: its kept
    row is infinite, its bound too, so it is computed apart in float64, and its row is zeroed in the rows' sum (0
    times infinity would make the layer's whole sum NaN); the sum equals the one without kept rows."""
    torch.manual_seed(6)
    layer = nn.Conv2d(3, 4, 3, padding=1)
    a, g = torch.randn(5, 3, 8, 8), torch.randn(5, 4, 8, 8)
    a[0], g[0] = 1e19, 1e19
    assert bookkeeping.norm_method(layer, a, g) == "per_example"
    kept = bookkeeping.norm_bounds([(layer, a, g)])[0]
    assert kept.rows is not None and not bool(torch.isfinite(kept.rows[0]).all())
    kept = bookkeeping.compute_exact(layer, a, g, kept)
    assert bool(kept.exact[0]) and not bool(kept.exact[1:].any()) and not bool(kept.rows[0].any())
    from lightning_privdec.privacy.dp_step import clip_factor

    factor = clip_factor(kept.upper, 1.0)  # example 0's float64 gradient is about 1e40: clipped to C
    plain = bookkeeping.norm_bound(layer, a, g)
    together = bookkeeping.clipped_sums(layer, a, g, factor, kept)
    apart = bookkeeping.clipped_sums(layer, a, g, factor, plain)
    for p in apart:
        assert bool(torch.isfinite(together[p]).all())
        torch.testing.assert_close(together[p], apart[p], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "build, shape",
    [
        (lambda: nn.Conv2d(6, 12, 5, stride=2, padding=2, groups=6), (6, 2, 2)),  # window sums (most taps dead)
        (lambda: nn.Conv2d(4, 4, 5, padding=2, groups=4), (4, 1, 1)),
        (lambda: nn.Conv2d(4, 6, (3, 7), stride=(1, 3), padding=(2, 3), dilation=(2, 1)), (4, 1, 5)),
        (lambda: nn.Conv3d(4, 4, 3, padding=1, groups=2), (4, 1, 1, 2)),
        (lambda: nn.Conv1d(4, 4, 7, padding=3, groups=4), (4, 2)),
        (lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), (8, 6, 6)),  # every tap live: a convolution of ones
        (lambda: nn.Conv2d(3, 5, 3, stride=2, padding=1), (3, 7, 7)),
        (lambda: nn.Conv2d(6, 12, 1, stride=2, padding=1), (6, 5, 5)),  # 1 x 1: channel sums
        (lambda: nn.Conv1d(4, 4, 1, stride=3, padding=2), (4, 8)),
        (lambda: nn.Conv2d(6, 6, 1, groups=3), (6, 4, 4)),
    ],
)
def test_patch_norms_bound_the_patches_norms(build, shape) -> None:
    """Each output position's input-patch norm (per example and group) is bounded from above, tightly, whichever way
    its squares are summed: against the float64 sum of the unfolded patches."""
    torch.manual_seed(5)
    layer = build()
    x = torch.randn(3, *shape) * torch.logspace(-10, 10, 3).view(3, *[1] * len(shape))
    out = layer(x)
    ones = torch.ones((layer.groups, layer.in_channels // layer.groups, *layer.kernel_size), dtype=torch.float64)
    conv = {1: nn.functional.conv1d, 2: nn.functional.conv2d, 3: nn.functional.conv3d}[x.dim() - 2]
    exact = conv(x.double().square(), ones, None, layer.stride, layer.padding, layer.dilation, layer.groups)
    exact = exact.sqrt().view(3, layer.groups, -1)
    got = bookkeeping_conv._patch_norms(layer, x, out.shape[2:])
    assert got.dtype == torch.float64 and got.shape == exact.shape
    assert (got >= exact).all()
    # a position that reads only padding (exactly 0) may get the underflow floor, sqrt(patch size x float32's tiny)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-21)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_clipped_sums_written_into_kept_buffers_equal_fresh_ones_over_steps_and_micro_batches(set_to_none: bool) -> None:
    """An nn.Linear's float64 clipped sum is written, on the host, into a buffer kept across steps (no allocation of
    tens of MB, and its page faults, per step), and its .grad gets it rounded: bit for bit the sums of fresh tensors,
    over steps, with zero_grad setting .grad to None or zeroing it, and with two backward passes (micro-batches) per
    step, whose sums add up (the second pass must not write where the first's is). Sums that a caller still holds
    (taken with take_clipped_sums) are never written: the next step's sum then goes to a new buffer."""
    torch.manual_seed(5)
    model_a = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    model_b = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    model_b.load_state_dict(model_a.state_dict())
    kept = PerSampleGradients(model_a, "bookkeeping", allow_grad_accumulation=True)
    fresh = PerSampleGradients(model_b, "bookkeeping", allow_grad_accumulation=True)
    fresh._arithmetic._sum_buffer = lambda p: None  # every sum in a fresh tensor, as before the buffers
    seen: dict[str, int] = {}
    held = None  # the float64 sums the "caller" keeps from step 2 on
    middle_index = 2  # model[2].weight
    for step in range(5):
        micro_batches = [(torch.randn(4, 6), torch.randint(0, 3, (4,))) for _ in range(1 + step % 2)]
        sums = {}
        for model, per in ((model_a, kept), (model_b, fresh)):
            model.zero_grad(set_to_none=set_to_none)
            for x, y in micro_batches:
                nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
            per.clip_and_sum(0.5)
            per.clear()
            sums[id(per)] = per.take_clipped_sums()
        for (name, a), b, sum_a, sum_b in zip(model_a.named_parameters(), model_b.parameters(), sums[id(kept)],
                                              sums[id(fresh)]):
            assert torch.equal(a.grad, b.grad), (step, name)
            assert sum_a.dtype == torch.float64 and torch.equal(sum_a, sum_b), (step, name)
            assert torch.equal(a.grad, sum_a.float()), (step, name)  # .grad: the float64 sum rounded
        middle = sums[id(kept)][middle_index]
        if not set_to_none:  # the .grad autograd made at the first step, written into every step
            grad = model_a[2].weight.grad
            assert seen.setdefault("grad", grad.data_ptr()) == grad.data_ptr()
        buffer = kept._arithmetic._sum_buffers._kept[model_a[2].weight][0]
        if step in (0, 2, 4):  # one pass: the sum is the kept buffer itself
            assert middle.data_ptr() == buffer.data_ptr()
            if step == 0:
                seen["buffer"] = buffer.data_ptr()
            elif step == 2:
                assert buffer.data_ptr() == seen["buffer"]  # reused: nobody held step 0's sums
                held, released = middle, middle.clone()  # kept by the "caller" across the next steps
            else:  # step 2's buffer is still held: a new one
                assert buffer.data_ptr() != seen["buffer"]
        else:  # two passes: the first wrote the buffer, their sum is a fresh tensor
            assert middle.data_ptr() != buffer.data_ptr()
        del sums, middle
    if held is not None:
        assert torch.equal(held, released)  # never overwritten by a later step's sum
    kept.detach()
    fresh.detach()


@pytest.mark.parametrize("name", ["conv2d_per_example", "conv2d_groups_dilation", "conv2d_dead_taps",
                                  "conv2d_strided_dead_taps", "conv2d_dilated_dead_taps", "conv3d_dead_taps",
                                  "conv2d_depthwise_dead_taps", "conv1d_per_example"])  # fmt: skip
def test_a_convolution_weight_gradient_never_reads_the_weight_values(name: str) -> None:
    """The weight-gradient kernel gets a stand-in of the (cropped or repeated) weight's shape, never a copy of its
    values: with NaN weights and NaN stand-ins the batch's and each example's gradients are still autograd's; a kept
    buffer holding NaN gets the cropped kernel's gradient and zeros in its dead taps."""
    build, shape = LAYERS[name]
    torch.manual_seed(11)
    layer = build()
    a = torch.randn(4, *shape)
    out = layer(a)
    g = torch.randn_like(out)
    expected = torch.autograd.grad(out, layer.weight, g)[0]
    each = torch.stack([torch.autograd.grad(layer(a[i : i + 1]), layer.weight, g[i : i + 1])[0] for i in range(4)])
    with torch.no_grad():
        layer.weight.fill_(float("nan"))
    deterministic, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)  # with fill_uninitialized_memory: torch.empty (the stand-in) holds NaN
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        torch.testing.assert_close(bookkeeping_conv._conv_weight_grad(layer, g, a), expected)
        stacked = bookkeeping_conv._conv_weight_grad(
            layer, g.reshape(1, -1, *g.shape[2:]), a.reshape(1, -1, *a.shape[2:]), 4)
        torch.testing.assert_close(stacked.reshape(each.shape), each)
        if "dead_taps" in name:
            buffer = torch.full_like(expected, float("nan"))
            written = bookkeeping_conv._conv_weight_grad(layer, g, a, out=buffer)
            assert written.data_ptr() == buffer.data_ptr()
            torch.testing.assert_close(written, expected)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_a_convolution_on_a_small_map_gets_autograd_s_weight_gradient(dims: int) -> None:
    """Where the output has at most SMALL_MAP positions (FLOAT64_SMALL_MAP in float64, the clipped sums') the weight
    gradient is one matrix product per group of the unfolded input (bookkeeping_conv._small_map_weight_grad): autograd's, in float64, for the batch and for
    examples side by side, over kernels, padding (dead taps, and a position that reads only padding), strides,
    dilations and groups; a kept buffer holding NaN gets it with zeros in the dead taps."""
    torch.manual_seed(14)
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dims - 1]
    seen = 0
    for kernel, size, padding, stride, dilation, groups in itertools.product(
        (1, 3, 5), (1, 2, 3), (0, 1, 2, 4), (1, 2, 5), (1, 2), (1, 2)
    ):
        layer = conv(4, 6, kernel, stride, padding, dilation, groups, bias=False).double()
        a = torch.randn(5, 4, *[size] * dims, dtype=torch.float64)
        try:
            out = layer(a)
        except RuntimeError:  # a kernel larger than the padded input
            continue
        if out.shape[2:].numel() > bookkeeping_conv.FLOAT64_SMALL_MAP:  # (float64: the clipped sums' threshold)
            continue
        seen += 1
        g = torch.randn_like(out)
        expected = torch.autograd.grad(out, layer.weight, g)[0]
        each = torch.stack([torch.autograd.grad(layer(a[i : i + 1]), layer.weight, g[i : i + 1])[0] for i in range(5)])
        torch.testing.assert_close(bookkeeping_conv._conv_weight_grad(layer, g, a), expected, rtol=1e-12, atol=1e-12)
        stacked = bookkeeping_conv._conv_weight_grad(
            layer, g.reshape(1, -1, *g.shape[2:]), a.reshape(1, -1, *a.shape[2:]), 5)
        torch.testing.assert_close(stacked.reshape(each.shape), each, rtol=1e-12, atol=1e-12)
        buffer = torch.full_like(expected, float("nan"))
        written = bookkeeping_conv._conv_weight_grad(layer, g, a, out=buffer)
        writes = bookkeeping_conv.writes_into(layer, a.shape[2:], out.shape[2:], g.dtype)
        assert writes or not (groups == 1 or out.shape[2:].numel() == 1)  # (a product always writes)
        assert (written.data_ptr() == buffer.data_ptr()) == writes
        torch.testing.assert_close(written, expected, rtol=1e-12, atol=1e-12)
    assert seen > 20


def test_a_convolution_with_dead_taps_writes_its_clipped_sum_into_the_kept_buffer() -> None:
    """A convolution whose dead taps are cropped writes its float64 clipped sum into the buffer kept across steps (as
    an nn.Linear does), bit for bit the fresh tensor's sum, its dead taps zero though the buffer held other values
    (the step before's sum, changed by the caller that took it) in them."""
    torch.manual_seed(12)

    def model() -> nn.Module:
        torch.manual_seed(13)
        return nn.Sequential(nn.Conv2d(3, 4, 1), nn.Tanh(), nn.Conv2d(4, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                             nn.Linear(8, 3))  # the second convolution's weight gradient is skipped in the backward

    model_a, model_b = model(), model()
    kept = PerSampleGradients(model_a, "bookkeeping")
    fresh = PerSampleGradients(model_b, "bookkeeping")
    fresh._arithmetic._sum_buffer = lambda p: None
    for step in range(3):
        x, y = torch.randn(5, 3, 1, 1), torch.randint(0, 3, (5,))
        sums = []
        for m, per in ((model_a, kept), (model_b, fresh)):
            m.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(m(x), y, reduction="sum").backward()
            per.clip_and_sum(0.5)
            per.clear()
            sums.append(per.take_clipped_sums()[2])  # the second convolution's weight
        conv_a, conv_b = sums
        assert torch.equal(conv_a, conv_b) and torch.equal(model_a[2].weight.grad, conv_a.float()), step
        assert torch.count_nonzero(conv_a[..., 1, 1]) > 0 and torch.count_nonzero(conv_a[..., 0, :]) == 0
        assert conv_a.data_ptr() == kept._arithmetic._sum_buffers._kept[model_a[2].weight][0].data_ptr()
        conv_a.add_(1.0)  # a caller's use of the taken sum (the noise), in the dead taps too
        del sums, conv_a, conv_b
    kept.detach()
    fresh.detach()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_patches_from_a_strided_view_equal_unfolds(channels_last: bool, dtype: torch.dtype) -> None:
    """Ghost norms read a convolution's patches from a strided view of the padded input (unfold's im2col walks the
    batch one example at a time): the same values in the same order as ``nn.functional.unfold``, bit for bit, for
    padding, stride, dilation, rectangular kernels, a 1 x 1 map and a strided input with a storage offset."""
    import itertools

    checked = 0
    for (h, w), kernel, dilation, padding, stride in itertools.product(
        [(5, 7), (1, 1), (3, 9)], [(1, 1), (3, 3), (2, 3)], [(1, 1), (2, 1)], [(0, 0), (1, 2)], [(1, 1), (2, 3)]
    ):
        a = torch.randn(3, 4, h, w).to(dtype)
        a = a.to(memory_format=torch.channels_last) if channels_last else a
        out = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, d, p, s in zip((h, w), kernel, dilation, padding, stride)]
        if min(out) <= 0:
            continue
        expected = nn.functional.unfold(a, kernel, dilation=dilation, padding=padding, stride=stride)
        assert torch.equal(bookkeeping_conv._unfold(a, kernel, dilation, padding, stride, tuple(out)), expected)
        checked += 1
    assert checked >= 60  # the geometries whose output is not empty
    offset = torch.randn(6, 4, 9, 9).to(dtype)[2:5, :, 1:8, :]  # not contiguous, storage offset > 0
    expected = nn.functional.unfold(offset, (3, 3), padding=(1, 1))
    assert torch.equal(bookkeeping_conv._unfold(offset, (3, 3), (1, 1), (1, 1), (1, 1), (7, 9)), expected)


def test_ghost_norms_of_a_grouped_pointwise_convolution_on_channels_last_maps() -> None:
    """A channels-last 1 x 1 map's patches are viewable as they lie: they are handed on contiguous, as unfold's are,
    so the per-group view of a grouped layer works, with the norms of the contiguous input."""
    layer = nn.Conv2d(64, 64, 1, groups=2)
    x = torch.randn(4, 64, 2, 2)
    cotangent = torch.randn_like(layer(x))
    assert bookkeeping.norm_method(layer, x, cotangent) == "ghost"
    last = x.to(memory_format=torch.channels_last)
    assert bookkeeping_conv._unfold(last, (1, 1), (1, 1), (0, 0), (1, 1), (2, 2)).is_contiguous()
    expected = bookkeeping.squared_norms(layer, x, cotangent, torch.float32)
    assert torch.equal(bookkeeping.squared_norms(layer, last, cotangent.to(memory_format=torch.channels_last),
                                                 torch.float32), expected)


def _embedding_gradients(ids: torch.Tensor, g: torch.Tensor, vocab: int, padding_idx: int | None) -> torch.Tensor:
    """Each example's gradient of an embedding table, (B, V, d), in float64 (the exact sums of its rows' terms)."""
    batch, dim = g.shape[0], g.shape[-1]
    flat_ids, flat_g = ids.reshape(batch, -1), g.double().reshape(batch, -1, dim)
    if padding_idx is not None:
        flat_g = flat_g.masked_fill((flat_ids == padding_idx).unsqueeze(-1), 0.0)
    grads = torch.zeros(batch, vocab, dim, dtype=torch.float64)
    return grads.scatter_add_(1, flat_ids.unsqueeze(-1).expand(-1, -1, dim), flat_g)


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_norm_bounds_hold_the_exact_norms_and_its_clipped_sum_is_the_closed_form_s(
    padding_idx, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Book-keeping of nn.Embedding (bookkeeping_embedding): on ids of shape (B, 3, 4) with repeated tokens, the
    bounds are at least the float64 norms of the per-example gradients and within 1e-3 of them; an example's bound
    does not depend on the other examples (bit for bit); the clipped sum is sum_i c_i W_i."""
    from lightning_privdec.privacy.per_sample import bookkeeping_embedding

    monkeypatch.setattr(bookkeeping_embedding, "MIN_ENTRIES", 0)  # a small table
    torch.manual_seed(11)
    layer = nn.Embedding(20, 6, padding_idx=padding_idx)
    ids, g = torch.randint(0, 6, (7, 3, 4)), torch.randn(7, 3, 4, 6)
    ids[0] = 2  # every position the padding token (or one token repeated twelve times)
    g[1] *= 1e4
    exact = torch.linalg.vector_norm(_embedding_gradients(ids, g, 20, padding_idx).flatten(1), dim=1)
    assert bookkeeping.has_bookkeeping(layer, g)
    bound = bookkeeping.norm_bound(layer, ids, g).upper
    assert bool((bound >= exact).all()) and bool((bound <= exact * (1 + 1e-3) + 1e-20).all())  # (underflow floors)
    if padding_idx is not None:
        assert float(bound[0]) < 1e-20  # the padding row gets no gradient
    assert torch.equal(bookkeeping.norm_bound(layer, ids[2:5], g[2:5]).upper, bound[2:5])
    factor = torch.rand(7, dtype=torch.float64)
    summed = bookkeeping.clipped_sums(layer, ids, g, factor, bookkeeping.NormBound(bound))[layer.weight]
    want = torch.einsum("b,bvd->vd", factor, _embedding_gradients(ids, g, 20, padding_idx))
    torch.testing.assert_close(summed.double(), want, rtol=1e-5, atol=1e-4)
    layer.weight.requires_grad_(False)
    assert not bookkeeping.has_bookkeeping(layer, g)  # a frozen table has no gradient to bound
    monkeypatch.undo()
    assert not bookkeeping.has_bookkeeping(nn.Embedding(20, 6), g)  # a small table keeps the closed form


def test_a_tied_embedding_is_bounded_jointly_within_its_exact_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """An embedding table that is also an output layer's weight (and an embedding called twice) is book-kept: each
    example's norm bound is at least its float64 gradient norm and within 2e-3 of it (the cross term <A, E> of the
    two uses, not the triangle inequality's ||A|| + ||E||), and the clipped sums are the per-example loop's."""

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.block = nn.Embedding(30, 8), nn.Linear(8, 8)
            self.out = nn.Linear(8, 30, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
            h = self.embed(ids) + self.embed(context).mean(dim=1, keepdim=True)
            return self.out(torch.tanh(self.block(h)))

    from lightning_privdec.privacy.per_sample import bookkeeping_embedding

    monkeypatch.setattr(bookkeeping_embedding, "MIN_ENTRIES", 0)  # a small table
    torch.manual_seed(12)
    model = TiedLM()
    ids, context, targets = torch.randint(0, 30, (6, 7)), torch.randint(0, 30, (6, 3)), torch.randint(0, 30, (6, 7))

    def losses(model: nn.Module, ids: torch.Tensor, context: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(ids, context).transpose(1, 2), targets, reduction="none").mean(1)

    reference = TiedLM().double()
    reference.load_state_dict(model.state_dict())
    per_example = []
    for i in range(6):
        grads = torch.autograd.grad(losses(reference, ids[i : i + 1], context[i : i + 1], targets[i : i + 1]).sum(),
                                    list(reference.parameters()))
        per_example.append(torch.cat([gr.flatten() for gr in grads]))
    exact = torch.linalg.vector_norm(torch.stack(per_example), dim=1)
    with PerSampleGradients(model, "bookkeeping") as per_sample:
        losses(model, ids, context, targets).mean().backward()
        norms = per_sample.clip_and_sum(float(exact.median()))
    assert bool((norms.double() >= exact).all()) and bool((norms.double() <= exact * (1 + 2e-3)).all()), norms / exact
    factor = (float(exact.median()) / exact).clamp(max=1.0)
    want = (factor.unsqueeze(1) * torch.stack(per_example)).sum(dim=0)
    got = torch.cat([p.grad.double().flatten() for p in model.parameters()])
    assert torch.linalg.vector_norm(got - want) <= 2e-3 * torch.linalg.vector_norm(want)  # (the factors' 2e-3)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(6, 64, 256), (5, 5, 13, 255)])  # (B, T..., p): aligned as is; padded slots
def test_a_long_sequence_s_clipped_sum_is_its_examples_own_products_summed_in_float64(
    transposed: bool, shape: tuple[int, ...]
) -> None:
    """An nn.Linear (or Hugging Face's Conv1D) over at least EXAMPLE_PRODUCT_STEPS positions on a CPU sums its
    examples' own float32 weight gradients in float64 (bookkeeping._sum_of_example_products): the float64 sum of each
    example's float32 product times its factor; removing an example, at any index, moves the sum by exactly that
    example's weighted product (no other product moves); an example with factor 0 whose product overflows adds
    nothing; an example whose float32 product could overflow (its mass reaches PRODUCT_MASS_LIMIT) is computed apart
    in float64 by its bound, alone (the other examples keep their float32 products, whatever it does). The bias's
    sum and the norm bounds' rows (T, not a block's) go with it."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(16)
    p, d_out = shape[-1], 300
    layer = Conv1D(d_out, p) if transposed else nn.Linear(p, d_out)
    a, g = torch.randn(*shape), torch.randn(*shape[:-1], d_out)
    batch = shape[0]
    assert bookkeeping.sums_by_example_products(layer, a, g)
    factor = torch.rand(batch, dtype=torch.float64)

    def own(i: int) -> Tensor:  # example i's float32 product, in float64
        ai, gi = a[i].reshape(-1, p), g[i].reshape(-1, d_out)
        return (ai.t() @ gi if transposed else gi.t() @ ai).double()

    got = bookkeeping._sum_of_example_products(layer, a, g, factor)
    assert got.dtype == torch.float64 and got.shape == layer.weight.shape
    torch.testing.assert_close(got, sum(factor[i] * own(i) for i in range(batch)), rtol=1e-12, atol=1e-12)
    for x in (0, 2, batch - 1):
        keep = [i for i in range(batch) if i != x]
        without = bookkeeping._sum_of_example_products(layer, a[keep], g[keep], factor[keep])
        assert float((got - without - factor[x] * own(x)).abs().max()) < 1e-12 * float(got.abs().max())
    sums = bookkeeping.clipped_sums(layer, a, g, factor)
    bias = layer.bias
    torch.testing.assert_close(sums[bias], torch.einsum("k,k...->...", factor, g.double()).reshape(-1, d_out).sum(0),
                               rtol=1e-12, atol=1e-12)
    assert bookkeeping.norm_bound(layer, a.reshape(batch, -1, p), g.reshape(batch, -1, d_out)).rounding is not None
    assert bookkeeping._linear_estimates(layer, a.reshape(batch, -1, p), g.reshape(batch, -1, d_out), None)[3] == \
        math.prod(shape[1:-1])
    huge_a, huge_g = a.clone(), g.clone()
    huge_a[1], huge_g[1] = 1e25, 1e25  # its float32 product overflows to infinity
    zeroed = factor.clone()
    zeroed[1] = 0.0
    keep = [i for i in range(batch) if i != 1]
    out = bookkeeping._sum_of_example_products(layer, huge_a, huge_g, zeroed)
    assert out is not None and bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, bookkeeping._sum_of_example_products(layer, a[keep], g[keep], factor[keep]),
                               rtol=1e-12, atol=1e-12)
    with_huge, without = (bookkeeping.clipped_sums(layer, huge_a, huge_g, zeroed),
                          bookkeeping.clipped_sums(layer, a[keep], g[keep], factor[keep]))
    for param in (layer.weight, bias):  # the bias's sum leaves the overflowed example out too
        torch.testing.assert_close(with_huge[param], without[param], rtol=1e-12, atol=1e-12)
    large_a, large_g = a.clone(), g.clone()
    large_a[1], large_g[1] = 1e19, 1e19  # 1e38 per term: a float32 sum of them overflows, the float64 one does not
    flat_a, flat_g = large_a.reshape(batch, -1, p), large_g.reshape(batch, -1, d_out)
    bound = bookkeeping.norm_bound(layer, flat_a, flat_g)
    assert bound.exact is not None and bool(bound.exact[1]) and int(bound.exact.sum()) == 1  # computed apart
    sums = bookkeeping.clipped_sums(layer, flat_a, flat_g, factor, bound)
    apart = torch.einsum("k,k...->...", factor[keep], torch.stack([own(i) for i in keep])) + factor[1] * (
        large_a[1].reshape(-1, p).double().t() @ large_g[1].reshape(-1, d_out).double()
        if transposed else large_g[1].reshape(-1, d_out).double().t() @ large_a[1].reshape(-1, p).double())
    assert bool(torch.isfinite(sums[layer.weight]).all())
    torch.testing.assert_close(sums[layer.weight], apart, rtol=1e-9, atol=0.0)


def test_a_large_map_s_clipped_sum_is_its_examples_rows_summed_in_float64() -> None:
    """A convolution with at least ROW_POSITIONS output positions sums its examples' float32 weight gradients in
    float64 (bookkeeping_conv.sum_of_rows), four per grouped convolution, the last chunk padded with zero examples:
    the float64 autograd sum up to each row's float32 rounding; removing an example changes the sum by exactly that
    example's weighted row (no other row moves: each is computed by the same convolution whatever the batch size);
    an example with factor 0 whose float32 row overflows adds nothing (not NaN)."""
    torch.manual_seed(15)
    layer = nn.Conv2d(3, 5, 3, padding=1)
    a, g = torch.randn(7, 3, 12, 12), torch.randn(7, 5, 12, 12)
    assert bookkeeping_conv.sums_by_rows(layer, g.shape[2:])
    factor = torch.rand(7, dtype=torch.float64)
    got = bookkeeping_conv.sum_of_rows(layer, a, g, factor)
    rows = torch.stack([bookkeeping_conv._conv_weight_grad(layer, g[i : i + 1].double(), a[i : i + 1].double())
                        for i in range(7)])
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.einsum("k,k...->...", factor, rows), rtol=1e-5, atol=1e-6)
    for x in (0, 3, 6):  # 7 -> 6 examples: the last chunk holds 3, then 2
        keep = [i for i in range(7) if i != x]
        without = bookkeeping_conv.sum_of_rows(layer, a[keep], g[keep], factor[keep])
        alone = bookkeeping_conv.sum_of_rows(layer, a[x : x + 1], g[x : x + 1], factor[x : x + 1])
        assert float((got - without - alone).abs().max()) < 1e-12
    huge = g.clone()
    huge[2] = 1e30
    a_huge = a.clone()
    a_huge[2] = 1e30  # its float32 row overflows to infinity
    zeroed = factor.clone()
    zeroed[2] = 0.0
    out = bookkeeping_conv.sum_of_rows(layer, a_huge, huge, zeroed)
    keep = [i for i in range(7) if i != 2]
    assert bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, bookkeeping_conv.sum_of_rows(layer, a[keep], g[keep], factor[keep]),
                               rtol=1e-12, atol=1e-12)
