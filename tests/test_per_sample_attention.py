"""nn.MultiheadAttention without a per-example replay (privacy/per_sample/attention.py): its forward while recording
equals torch's to rounding, its per-example gradients equal torch.func's grad of the unhooked module, example by
example in float64, on random and crafted examples (batch first and sequence first, self- and cross-attention, every kind of mask, weights
returned), book-keeping's norms are upper bounds of the float64 truth, the configurations it does not cover keep
the replay, and the module itself is left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad

from lightning_privdec.privacy import PerSampleGradients
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample import attention

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")
B, L, S, E, H = 5, 4, 6, 8, 2


def _inputs(batch_first: bool, kind: str, dims: tuple[int, int] = (E, E), crafted: bool = True) -> tuple:
    """query, key, value laid out as the module reads them; ``kind``: "self" (one tensor), "kv" (key is value) or
    "cross" (three tensors). ``crafted``: example 0 times 10 (attention scores of ~1e2: a nearly one-hot softmax,
    whose float32 rounding stays below the tolerance; from ~30 on, float32 itself, autograd's as much as the rule's,
    misses the float64 truth by more: 3% at 1e3), example 1 a near-duplicate of it, example 2 times 1e-20."""
    gen = torch.Generator().manual_seed(0)

    def make(steps: int, dim: int) -> Tensor:
        x = torch.randn(B, steps, dim, generator=gen)
        if crafted:
            x[0] *= 10
            x[1] = x[0] * (1 + 1e-6)
            x[2] *= 1e-20
        return x if batch_first else x.transpose(0, 1).contiguous()

    query = make(L, E)
    if kind == "self":
        return query, query, query
    key = make(S, dims[0])
    return (query, key, key) if kind == "kv" else (query, key, make(S, dims[1]))


def _masks(kind: str, which: str) -> dict:
    src = L if kind == "self" else S
    padding = torch.zeros(B, src, dtype=torch.bool)
    padding[3, -2:] = True
    if which == "none":
        return {}
    if which == "causal":  # the is_causal hint with its mask
        return {"attn_mask": torch.ones(L, src, dtype=torch.bool).triu(1), "is_causal": True}
    if which == "padding_float":
        return {"key_padding_mask": torch.zeros(B, src).masked_fill(padding, float("-inf")),
                "attn_mask": torch.randn(L, src, generator=torch.Generator().manual_seed(1))}  # fmt: skip
    per_head = torch.rand(B * H, L, src, generator=torch.Generator().manual_seed(2)) < 0.3
    per_head[..., 0] = False  # every query sees a key
    return {"key_padding_mask": padding, "attn_mask": per_head}  # "per_head": 3-D and padding


def _per_example_mask(kwargs: dict, i: int) -> dict:
    out = dict(kwargs)
    if "key_padding_mask" in out:
        out["key_padding_mask"] = out["key_padding_mask"][i : i + 1]
    mask = out.get("attn_mask")
    if mask is not None and mask.dim() == 3:
        out["attn_mask"] = mask.view(B, H, *mask.shape[1:])[i]
    return out


def _loss(out: Tensor, weights: Tensor | None, target: Tensor) -> Tensor:
    loss = (out * target).sum()
    return loss if weights is None else loss + 0.5 * (weights * weights).sum()


def _reference(module: nn.MultiheadAttention, inputs: tuple, kwargs: dict, target: Tensor) -> dict[str, Tensor]:
    """torch.func.grad of the unhooked ``module``, example by example, in float64."""
    dim = 0 if module.batch_first else 1
    ref = copy.deepcopy(module).double()
    params = {n: p.detach() for n, p in ref.named_parameters()}
    q, k, v = (t.double() for t in inputs)

    def one(p: dict, i: int, qi: Tensor, ki: Tensor, vi: Tensor, ti: Tensor) -> Tensor:
        qi, ki, vi, ti = (t.unsqueeze(dim) for t in (qi, ki, vi, ti))
        out, weights = functional_call(ref, p, (qi, ki, vi), kwargs_for[i])
        return _loss(out, weights, ti)

    kwargs = {k: m.double() if isinstance(m, Tensor) and m.is_floating_point() else m for k, m in kwargs.items()}
    kwargs_for = {i: _per_example_mask(kwargs, i) for i in range(B)}
    rows = [grad(one)(params, i, q.select(dim, i), k.select(dim, i), v.select(dim, i),
                      target.double().select(dim, i)) for i in range(B)]  # fmt: skip
    return {n: torch.stack([r[n] for r in rows]) for n in params}


def _check(module: nn.MultiheadAttention, inputs: tuple, kwargs: dict, mode: str = "bookkeeping",
           need_weights: bool = False) -> PerSampleGradients:  # fmt: skip
    module.train()
    torch_module = copy.deepcopy(module)
    psg = PerSampleGradients(module, mode=mode, loss_reduction="sum", batch_first=module.batch_first, strict=False)
    q, k, v = inputs
    out, weights = module(q, k, v, need_weights=need_weights, **kwargs)
    want_out, want_weights = torch_module(q, k, v, need_weights=need_weights, **kwargs)
    others = (1, 2) if module.batch_first else (0, 2)
    scale = want_out.abs().amax(dim=others, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(out / scale, want_out / scale, atol=1e-5, rtol=0)  # each example to its own size
    if need_weights:
        torch.testing.assert_close(weights, want_weights, atol=1e-5, rtol=1e-4)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    _loss(out, weights, target).backward()
    got = dict(zip([n for n, p in module.named_parameters() if p.requires_grad], psg.per_sample_grads()))
    want = _reference(torch_module, inputs, kwargs | {"need_weights": need_weights}, target)
    # each example to the magnitude of its whole gradient (float32 rounding is relative to it: a parameter whose
    # gradient nearly vanishes for one example carries the rounding of the others' terms), or to 1e-4 of the batch's
    # where the whole gradient is rounding noise
    own = torch.stack([w.flatten(1).abs().amax(dim=1) for w in want.values()]).amax(dim=0)
    own = torch.maximum(own, 1e-4 * own.max()).clamp_min(1e-30)
    for n, w in want.items():
        size = own.view(-1, *([1] * (w.dim() - 1)))
        assert torch.allclose(got[n].double() / size, w / size, atol=2e-5), n
    return psg


@pytest.mark.parametrize(("batch_first", "kind", "masks", "need_weights"), [
    (True, "self", "causal", False),
    (False, "kv", "causal", True),
    (True, "cross", "per_head", False),
])  # fmt: skip
def test_forward_equals_torch_and_per_example_gradients_equal_torch_func(batch_first: bool, kind: str, masks: str,
                                                                   need_weights: bool) -> None:  # fmt: skip
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, batch_first=batch_first)
    psg = _check(module, _inputs(batch_first, kind), _masks(kind, masks), need_weights=need_weights)
    assert "book-keeping: 1 MultiheadAttention" in psg.report
    psg.detach()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bookkeeping", "hooks", "functorch"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kind", ["self", "kv", "cross"])
@pytest.mark.parametrize("masks", ["none", "causal", "padding_float", "per_head"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_every_configuration_and_mode(mode: str, batch_first: bool, kind: str, masks: str, need_weights: bool) -> None:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, batch_first=batch_first, add_zero_attn=masks == "padding_float")
    _check(module, _inputs(batch_first, kind), _masks(kind, masks), mode, need_weights).detach()


def test_separate_projection_weights_without_bias_and_a_zero_key() -> None:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, kdim=6, vdim=7, bias=False, add_zero_attn=True, batch_first=True)
    psg = _check(module, _inputs(True, "cross", dims=(6, 7)), _masks("cross", "per_head"))
    assert "replay" not in psg.report
    psg.detach()


@pytest.mark.parametrize("config", [{"add_bias_kv": True}, pytest.param({"kdim": 6, "vdim": 7}, marks=pytest.mark.slow)])
def test_the_configurations_it_does_not_cover_keep_the_replay(config: dict) -> None:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, batch_first=True, **config)
    dims = (config.get("kdim", E), config.get("vdim", E))
    psg = _check(module, _inputs(True, "cross", dims=dims, crafted=False), _masks("cross", "padding_float"))
    assert "replay: 1 MultiheadAttention" in psg.report
    psg.detach()


def test_book_keeping_norms_are_upper_bounds_of_the_float64_truth() -> None:
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, batch_first=False)
    inputs, kwargs = _inputs(False, "kv", crafted=False), _masks("kv", "per_head")
    unhooked = copy.deepcopy(module)
    psg = PerSampleGradients(module, mode="bookkeeping", loss_reduction="sum", batch_first=False, strict=False)
    out, _ = module(*inputs, need_weights=False, **kwargs)
    target = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * target).sum().backward()
    norms = psg.clip_and_sum(1e9).double()
    want = _reference(unhooked, inputs, kwargs | {"need_weights": False}, target)
    truth = torch.sqrt(sum(w.flatten(1).square().sum(dim=1) for w in want.values()))
    assert torch.all(norms >= truth) and torch.all(norms <= truth * (1 + 1e-3)), (norms, truth)
    psg.detach()


def test_dropout_per_example_gradients_are_those_of_the_same_masks() -> None:
    """With dropout, example i's gradient is that of its own loss under the same random draws (the same
    computation, seed and batch): the others' losses contribute nothing to it."""
    torch.manual_seed(0)
    module = nn.MultiheadAttention(E, H, dropout=0.5, batch_first=True)
    q, k, v = _inputs(True, "kv", crafted=False)
    target = torch.randn(B, L, E, generator=torch.Generator().manual_seed(3))
    psg = PerSampleGradients(module, mode="hooks", loss_reduction="sum", strict=False)
    torch.manual_seed(7)
    out, _ = module(q, k, v, need_weights=True)  # dropout on the returned weights' path
    (out * target).sum().backward()
    got = psg.per_sample_grads()
    psg.detach()
    for i in (0, 3):
        module.zero_grad()
        torch.manual_seed(7)
        out, _ = attention.forward(module, q, k, v, need_weights=True)
        (out[i] * target[i]).sum().backward()
        for p, rows in zip(module.parameters(), got):
            torch.testing.assert_close(rows[i], p.grad, atol=1e-5, rtol=1e-4)


def test_the_module_is_left_as_it_was() -> None:
    module = nn.MultiheadAttention(E, H, batch_first=True)
    state = module.state_dict()
    params = list(module.parameters())
    psg = PerSampleGradients(module, strict=False)
    assert list(module.parameters()) == params and module.state_dict().keys() == state.keys()
    assert all(module.state_dict()[n] is not None for n in state)
    copied = copy.deepcopy(module)  # while attached: the copy computes with its own parameters
    with torch.no_grad():
        for p in copied.parameters():
            p.mul_(2)
    x = torch.randn(2, L, E)
    assert not torch.allclose(copied(x, x, x)[0], module(x, x, x)[0])
    psg.clear()
    module.eval()  # not recording: torch's own forward (its fast path included)
    with torch.no_grad():
        torch.testing.assert_close(module(x, x, x)[0], type(module).forward(module, x, x, x)[0])
    psg.detach()
    assert "forward" not in module.__dict__ and list(module.parameters()) == params


def test_an_unbatched_query_is_refused_with_the_fix() -> None:
    module = nn.MultiheadAttention(E, H)
    psg = PerSampleGradients(module, strict=False)
    x = torch.randn(L, E)
    with pytest.raises(PrivacyConfigError, match="unbatched 2-D query"):
        module(x, x, x)
    psg.detach()
