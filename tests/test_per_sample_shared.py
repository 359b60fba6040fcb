"""Parameters used once for the whole batch (privacy/per_sample/shared.py): a class token, a learned position
embedding, a relative-position bias table looked up with an index buffer. Their per-example gradients come from the
gradient of the broadcast result, without replaying the layer, and equal torch.func's vmap(grad) on random and
crafted data; any other use of a layer's own parameter falls back to replay; a buffer updated in the forward is
refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from lightning_privdec.audit import sensitivity
from lightning_privdec.privacy import PerSampleGradients
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample import check_private_model


def _vit() -> nn.Module:
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)  # fmt: skip


class RelativeBias(nn.Module):
    """Attention with a relative-position bias table looked up with a (T, T) index buffer, added to the logits."""

    def __init__(self, steps: int = 5, dim: int = 8, heads: int = 2, sdpa: bool = False) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads, self.sdpa = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads, sdpa
        self.table = nn.Parameter(0.1 * torch.randn(2 * steps - 1, heads))
        offsets = torch.arange(steps)[:, None] - torch.arange(steps)[None, :] + steps - 1
        self.register_buffer("index", offsets.flatten())

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index].view(t, t, self.heads).permute(2, 0, 1).unsqueeze(0)
        if self.sdpa:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            out = ((q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5 + bias).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class ProductWithOwnWeight(nn.Module):
    """Its own parameter in a matrix product with the batch: not a broadcast, so the call is replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.out = nn.Linear(8, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(x.flatten(1) @ self.weight))


class RunningStatistic(nn.Module):
    """Updates a buffer with a statistic of the batch in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: Tensor) -> Tensor:
        self.mean.mul_(0.9).add_(0.1 * x.detach().flatten(1).mean(0))
        return (x.flatten(1) - self.mean) * self.scale


class HeadSizedBias(nn.Module):
    """A (7, 3, 3) parameter plus a zero tensor made from the batch's tensor (``x.new_zeros``), then added to the
    (B, 7, 3, 3) batch: with B = 7 the intermediate's dimension 0 has the batch's size without being the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(7, 3, 3))
        self.out = nn.Linear(63, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(x + (self.bias + x.new_zeros(7, 3, 3))).flatten(1))


def _relative(sdpa: bool = False) -> nn.Module:
    return nn.Sequential(RelativeBias(sdpa=sdpa), nn.Flatten(), nn.Linear(40, 10))


CASES = {
    "vit": (_vit, (3, 32, 32)),
    "relative_bias": (_relative, (5, 8)),
    "relative_bias_sdpa": (lambda: _relative(sdpa=True), (5, 8)),
    "own_weight_product": (ProductWithOwnWeight, (8,)),
    "head_sized_bias": (HeadSizedBias, (7, 3, 3)),  # 4 + 3 crafted examples: B = 7
}


def _crafted(x: Tensor) -> Tensor:
    """Random examples plus example 0 times 1e4, a near-duplicate of it, and example 0 times 1e-20."""
    first = x[:1]
    return torch.cat([x, first * 1e4, first + 1e-6 * torch.randn_like(first), first * 1e-20])


def _reference(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(values: dict, xi: Tensor, yi: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, values, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


@pytest.mark.parametrize("mode", ["hooks", "bookkeeping"])
@pytest.mark.parametrize("name", list(CASES))
def test_per_example_gradients_equal_vmap_grad_on_random_and_crafted_data(name: str, mode: str) -> None:
    torch.manual_seed(0)
    build, shape = CASES[name]
    model = build().eval()  # dropout off: vmap(grad) draws no batch's masks
    x = _crafted(torch.randn(4, *shape))
    y = torch.randint(0, 10, (x.shape[0],))
    want = _reference(model, x, y)
    psg = PerSampleGradients(model, mode=mode)
    psg._hooks.probing = True  # record in eval mode
    for _ in range(2):  # the second step: rule layers' parameters frozen during their calls (after the first check)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        kinds = {r.name: r.kind for r in psg._hooks.records}
        got = dict(zip([n for n, _ in model.named_parameters()], psg.per_sample_grads()))
        psg.clear()
    psg.detach()
    for n, w in want.items():
        # each example to its own magnitude, or to 1e-3 of the batch's where its true gradient is rounding noise
        # (example 0 times 1e-20: uniform attention, a gradient that is 0 in exact arithmetic)
        own = w.flatten(1).abs().amax(dim=1).view(-1, *([1] * (w.dim() - 1)))
        scale = torch.maximum(own, 1e-3 * w.abs().max()).clamp_min(1e-30)
        assert torch.allclose(got[n] / scale, w / scale, atol=1e-4), n
    if name == "vit":
        assert kinds[""] == "shared" and kinds["encoder"] == "shared"
    elif name == "head_sized_bias":
        assert kinds[""] == "shared"
    elif name.startswith("relative_bias"):
        assert kinds["0"] == "shared" and kinds["0.qkv"] == "rule"
    else:
        assert kinds[""] == "replay" and "out" not in kinds  # the call replayed as a whole


def test_the_setup_line_names_the_broadcast_parameters(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO):
        PerSampleGradients(_vit(), mode="bookkeeping").detach()
    line = next(r.getMessage() for r in caplog.records if "per-sample" in r.getMessage())
    assert "broadcast: 1 VisionTransformer, 1 Encoder" in line and "2 MultiheadAttention" in line and "replay" not in line


def test_a_table_with_an_index_buffer_is_not_refused_and_a_running_statistic_is() -> None:
    assert check_private_model(_relative()) is not None  # the buffer is read, not updated
    model = nn.Sequential(RunningStatistic(), nn.Linear(8, 2))
    check_private_model(model)
    psg = PerSampleGradients(model)
    with pytest.raises(PrivacyConfigError, match=r"layer 0 \(RunningStatistic\) updates its buffer mean"):
        model(torch.randn(4, 8))
    psg.detach()


def test_a_refusal_without_an_automatic_fix_does_not_propose_one() -> None:
    layer = nn.Linear(4, 4)
    layer.register_buffer("counter", torch.zeros(1))  # Opacus's rule: a trainable layer of its own with buffers
    with pytest.raises(PrivacyConfigError, match="with buffers") as error:
        check_private_model(nn.Sequential(layer))
    assert "fix_model=True cannot" in str(error.value) and "pass fix_model=True" not in str(error.value)


def test_the_attack_on_broadcast_parameters_holds_in_every_mode_and_precision() -> None:
    """The sensitivity attack's row for these parameters: every example clipped, none moves the sum beyond C."""
    results = sensitivity.run_attacks(("shared_parameters",))
    assert {r.mode for r in results} == set(sensitivity.MODES)
    assert all(r.holds and r.ratio > 0.5 for r in results), results


def test_the_attack_catches_the_batch_gradient_given_to_one_example(monkeypatch: pytest.MonkeyPatch) -> None:
    """Positive control: the batch's gradient of these parameters given to the first example as its own (what
    treating a parameter used once for the whole batch as one example would do) lets an example move the clipped
    sum beyond C."""
    from lightning_privdec.privacy.per_sample import shared

    original = shared.grad_samples

    def one_row(call, scale, drop_nonfinite=False):  # noqa: ANN001, ANN202
        rows = original(call, scale, drop_nonfinite)
        return {p: torch.cat([g.sum(dim=0, keepdim=True), torch.zeros_like(g[1:])]) for p, g in rows.items()}

    build, clip, _ = sensitivity.ATTACKS["shared_parameters"]

    def ratio() -> float:
        model, batch, warm_up = build()
        batch = tuple(t[[0, 2, 3, 4]] for t in batch)  # without the near-duplicate of example 0
        for layer in (model.embed, model.qkv):  # the broadcast parameters alone are trained
            layer.requires_grad_(False)
        return float(sensitivity.sensitivity(model, batch, sensitivity._token_loss, clip=clip, mode="hooks",
                                             warm_up=warm_up).max())  # fmt: skip

    assert 0.5 < ratio() <= 1 + sensitivity.TOLERANCE
    monkeypatch.setattr(shared, "grad_samples", one_row)
    assert ratio() > 1.2


def test_a_table_looked_up_once_for_the_batch_is_named_in_the_refusal() -> None:
    """An nn.Embedding looked up with ``torch.arange(T)`` (no batch dimension): the refusal names that layer, not
    the token embedding that saw the batch, and says how to fix it."""

    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos, self.out = nn.Embedding(20, 8), nn.Embedding(6, 8), nn.Linear(8, 3)

        def forward(self, ids: Tensor) -> Tensor:
            return self.out((self.tok(ids) + self.pos(torch.arange(ids.shape[1]))).mean(1))

    model = Positions()
    psg = PerSampleGradients(model, mode="bookkeeping")
    F.cross_entropy(model(torch.randint(0, 20, (4, 6))), torch.randint(0, 3, (4,))).backward()
    with pytest.raises(PrivacyConfigError, match=r"layer pos \(Embedding\) was called on 6 examples of a batch of 4 "
                                                 r"\(the size the other layers saw\).*self\.pos_embedding"):  # fmt: skip
        psg.clip_and_sum(1.0)
    psg.detach()
