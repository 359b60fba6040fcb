"""nn.LSTM, nn.GRU and nn.RNN without a per-example replay (privacy/per_sample/recurrent.py): unrolled during the
private step, their weights' products recorded as nn.Linear calls over the sequence. Per-example gradients equal
each example's own autograd gradient (its own backward pass through the module's own forward: torch.func's vmap
cannot batch the fused recurrent kernels) on random and crafted data; norms are upper bounds; the output is the
module's; configurations outside the rule are replayed or refused as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

from lightning_privdec.audit import sensitivity
from lightning_privdec.privacy import PerSampleGradients
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample.capture import layer_units


class Tagger(nn.Module):
    """A recurrent layer, then a head on every step summed over time; ``encoded_state``: the initial state is
    computed from the example (it requires grad), else ``state`` passes a given (data) initial state."""

    def __init__(self, rnn: nn.RNNBase, encoded_state: bool = False) -> None:
        super().__init__()
        self.rnn = rnn
        out = (rnn.proj_size or rnn.hidden_size) * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(out, 3)
        layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
        self.encoder = nn.Linear(rnn.input_size, layers * (rnn.proj_size or rnn.hidden_size)) if encoded_state else None

    def forward(self, x: Tensor, state: Tensor | tuple | None = None) -> Tensor:
        time = 1 if self.rnn.batch_first else 0
        if self.encoder is not None:
            first = x.select(time, 0)
            state = torch.tanh(self.encoder(first)).view(first.shape[0], -1, self.rnn.hidden_size).transpose(0, 1)
            state = state.contiguous()
        out = self.rnn(x) if state is None else self.rnn(x, state)
        return self.head(out[0]).sum(dim=time)


def _case(name: str) -> tuple[Tagger, bool, bool]:
    """(model, batch_first, passes a data initial state)."""
    if name == "lstm_2_layers_bidirectional":
        return Tagger(nn.LSTM(4, 5, num_layers=2, bidirectional=True, batch_first=True)), True, False
    if name == "gru_sequence_first_bidirectional_state":
        return Tagger(nn.GRU(4, 5, num_layers=2, bidirectional=True)), False, True
    if name == "gru_encoded_state":
        return Tagger(nn.GRU(4, 5, batch_first=True), encoded_state=True), True, False
    if name == "lstm_projection_state":
        return Tagger(nn.LSTM(4, 5, num_layers=2, proj_size=3, batch_first=True)), True, True
    if name == "lstm_sequence_first_state_without_bias":  # the fused kernel (recurrent._fused_lstm) with a state
        return Tagger(nn.LSTM(4, 5, num_layers=2, bias=False, bidirectional=True)), False, True
    if name == "rnn_relu_without_bias":
        return Tagger(nn.RNN(4, 5, num_layers=2, nonlinearity="relu", bias=False, batch_first=True)), True, False
    if name == "gru_frozen_input_weights":  # the data input (no grad) and W_ih frozen: only W_hh's product is trained
        model = Tagger(nn.GRU(4, 5, batch_first=True))
        model.rnn.weight_ih_l0.requires_grad_(False)
        model.rnn.bias_ih_l0.requires_grad_(False)
        return model, True, False
    raise KeyError(name)


CASES = ["lstm_2_layers_bidirectional", "gru_sequence_first_bidirectional_state", "gru_encoded_state",
         "lstm_projection_state", "lstm_sequence_first_state_without_bias", "rnn_relu_without_bias",
         "gru_frozen_input_weights"]  # fmt: skip


def _batch(model: Tagger, batch_first: bool, with_state: bool, steps: int = 7) -> tuple[Tensor, Tensor, object]:
    """4 random examples plus crafted ones: example 0 times 1e4, a near-duplicate of it, example 0 times 1e-20;
    (x, labels, initial state or None)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, steps, 4, generator=gen, dtype=torch.float64)
    first = x[:1]
    x = torch.cat([x, first * 1e4, first + 1e-6 * torch.randn(first.shape, generator=gen, dtype=x.dtype),
                   first * 1e-20])  # fmt: skip
    y = torch.randint(0, 3, (x.shape[0],), generator=gen)
    state = None
    if with_state:
        rnn = model.rnn
        layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
        h0 = torch.randn(layers, x.shape[0], rnn.proj_size or rnn.hidden_size, generator=gen, dtype=x.dtype)
        state = (h0, torch.randn(layers, x.shape[0], rnn.hidden_size, generator=gen, dtype=x.dtype)) \
            if isinstance(rnn, nn.LSTM) else h0  # fmt: skip
    return (x if batch_first else x.transpose(0, 1).contiguous()), y, state


def _example(x: Tensor, y: Tensor, state: object, i: int, batch_first: bool) -> tuple:
    pick = slice(i, i + 1)
    xi = x[pick] if batch_first else x[:, pick]
    si = None if state is None else tuple(s[:, pick] for s in state) if isinstance(state, tuple) else state[:, pick]
    return xi, y[pick], si


def _reference(model: Tagger, x: Tensor, y: Tensor, state: object, batch_first: bool) -> dict[str, Tensor]:
    """Each example's gradient from its own forward (the module's own) and backward pass."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads: dict[str, list[Tensor]] = {n: [] for n, _ in trainable}
    for i in range(y.shape[0]):
        xi, yi, si = _example(x, y, state, i, batch_first)
        model.zero_grad()
        F.cross_entropy(model(xi, si), yi).backward()
        for n, p in trainable:
            grads[n].append(p.grad.clone())
    model.zero_grad()
    return {n: torch.stack(g) for n, g in grads.items()}


@pytest.mark.parametrize("mode", ["bookkeeping", "hooks"])
@pytest.mark.parametrize("name", CASES)
def test_per_example_gradients_equal_each_example_s_own_gradient(name: str, mode: str) -> None:
    torch.manual_seed(0)
    model, batch_first, with_state = _case(name)
    model = model.double()
    x, y, state = _batch(model, batch_first, with_state)
    want = _reference(model, x, y, state, batch_first)
    psg = PerSampleGradients(model, mode=mode, batch_first=batch_first)
    assert {n: k for n, _, k in layer_units(model)}["rnn"] == "unrolled"
    for step in range(2):  # the second step: autograd's parameter gradients skipped (after the first step's check)
        model.zero_grad()
        F.cross_entropy(model(x, state), y).backward()
        got = dict(zip([n for n, p in model.named_parameters() if p.requires_grad], psg.per_sample_grads()))
        kinds = {r.name: r.kind for r in psg._hooks.records}
        psg.clear()
    psg.detach()
    assert "rnn" not in kinds and kinds["rnn.weight_hh_l0"] == "rule"  # no replay of the layer
    for n, w in want.items():
        scale = w.flatten(1).abs().amax(dim=1).clamp_min(1e-30).view(-1, *([1] * (w.dim() - 1)))
        assert torch.allclose(got[n] / scale, w / scale, atol=1e-9, rtol=0), n
    assert "forward" not in model.rnn.__dict__  # detach() restored the class's forward


def _exact_norms(psg: PerSampleGradients) -> Tensor:
    """The exact (float64) norm of each example's gradient computed from the recorded float32 inputs and output
    gradients: what the bounds must bound."""
    squared = 0
    for call in psg._arithmetic.passes()[0]:
        a, g, layer = call.activations[0].double(), call.backprops.double(), call.module
        if g.dim() == 2:
            a, g = a.unsqueeze(1), g.unsqueeze(1)
        squared = squared + torch.einsum("btd,btp->bdp", g, a).flatten(1).square().sum(dim=1)
        if layer.bias is not None:
            squared = squared + g.sum(dim=1).square().sum(dim=1)
    return squared.sqrt()


@pytest.mark.parametrize("name", ["lstm_2_layers_bidirectional", "gru_sequence_first_bidirectional_state"])
def test_norms_bound_the_exact_norms_in_float32_on_long_sequences(name: str) -> None:
    """Book-keeping's float32 norms are at least the exact norms of what each example adds, and close to the
    float64 model's per-example norms, on 40 steps (the per-example norm method) and 7 (the Gram-matrix one),
    crafted examples included."""
    for steps in (7, 40):
        torch.manual_seed(0)
        model, batch_first, with_state = _case(name)
        x, y, state = _batch(model.double(), batch_first, with_state, steps=steps)
        want = _reference(model, x, y, state, batch_first)
        reference = torch.cat([w.flatten(1) for w in want.values()], dim=1).norm(dim=1)
        model = model.float()
        state = None if state is None else state.float()
        psg = PerSampleGradients(model, mode="bookkeeping", batch_first=batch_first)
        model.zero_grad()
        F.cross_entropy(model(x.float(), state), y).backward()
        exact = _exact_norms(psg)
        norms = psg.clip_and_sum(1.0).double()
        psg.detach()
        assert torch.all(norms >= exact), (steps, norms / exact)
        # examples whose gradient is not float32 rounding noise (a loss gradient of 1 - p with p near 1)
        honest = reference > 1e-3 * reference.max()
        assert int(honest.sum()) >= 4
        assert torch.allclose(norms[honest], reference[honest], rtol=1e-3), (steps, norms / reference)


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")  # torch's own forward
@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batch_first", [True, False])
def test_the_unrolled_output_is_the_module_s(cls: type[nn.RNNBase], batch_first: bool) -> None:
    torch.manual_seed(0)
    kwargs = {"proj_size": 2} if cls is nn.LSTM else {}
    rnn = cls(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first, **kwargs)
    x = torch.randn(5, 6, 3) if batch_first else torch.randn(6, 5, 3)
    own = rnn(x)
    params = [id(p) for p in rnn.parameters()]
    psg = PerSampleGradients(rnn, mode="bookkeeping", batch_first=batch_first)
    unrolled = rnn(x)
    assert [id(p) for p in rnn.parameters()] == params  # the same parameter objects
    for a, b in zip(torch.utils._pytree.tree_flatten(own)[0], torch.utils._pytree.tree_flatten(unrolled)[0]):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6), (a - b).abs().max()
    assert unrolled[0].is_contiguous()
    assert psg._hooks.records  # the unrolled form ran (and was recorded)
    psg.detach()


def test_layers_outside_the_rule_are_replayed() -> None:
    class OwnForward(nn.LSTM):
        def forward(self, x, hx=None):
            return super().forward(2 * x, hx)

    patched = nn.GRU(3, 4)
    patched.forward = lambda x, hx=None: nn.GRU.forward(patched, x, hx)  # a forward set on the instance elsewhere
    model = nn.ModuleDict({"cell": nn.LSTMCell(3, 4), "own": OwnForward(3, 4), "gru": nn.GRU(3, 4),
                           "patched": patched})  # fmt: skip
    kinds = {n: k for n, _, k in layer_units(model)}
    assert kinds == {"cell": "replay", "own": "replay", "gru": "unrolled", "patched": "replay"}


def test_a_packed_sequence_and_an_unbatched_sequence_are_refused() -> None:
    rnn = nn.GRU(3, 4, batch_first=True)
    psg = PerSampleGradients(rnn, mode="bookkeeping")
    packed = pack_padded_sequence(torch.randn(2, 5, 3), torch.tensor([5, 3]), batch_first=True)
    with pytest.raises(PrivacyConfigError, match=r"layer <root> \(GRU\) returned a PackedSequence"):
        rnn(packed)
    with pytest.raises(PrivacyConfigError, match=r"unbatched sequence of shape \(5, 3\)"):
        rnn(torch.randn(5, 3))
    with torch.no_grad():
        rnn(torch.randn(5, 3))  # outside the private step: the module's own forward
    psg.detach()


def test_the_attack_on_recurrent_layers_holds() -> None:
    """The sensitivity attack's rows for nn.LSTM and nn.GRU (book-keeping, float32; every mode and precision:
    ``privdec-audit --clipping`` and the slow test below)."""
    results = sensitivity.run_attacks(("recurrent_lstm", "recurrent_gru"), modes=("bookkeeping",))
    assert all(r.holds and r.ratio > 0.5 for r in results), results


@pytest.mark.slow
def test_the_attack_on_recurrent_layers_holds_in_every_mode_and_precision() -> None:
    results = sensitivity.run_attacks(("recurrent_lstm", "recurrent_gru"))
    assert {r.mode for r in results} == set(sensitivity.MODES)
    assert all(r.holds and r.ratio > 0.5 for r in results), results


def test_an_overflowed_input_product_saturates_the_fused_lstm_as_the_stepped_cells_do() -> None:
    """An input of 3e38 overflows the input product W_ih x + b_ih to +-inf: the fused kernel gets it clamped to the
    largest float (the identity's 0 * inf would make every gate of the example NaN); the step stays finite with the
    stepped cells' norms."""
    from lightning_privdec.privacy.per_sample import recurrent

    torch.manual_seed(0)
    model = Tagger(nn.LSTM(4, 5, batch_first=True))
    assert recurrent._fuses(model.rnn)
    x, y = torch.randn(3, 4, 4), torch.tensor([0, 1, 2])
    x[0, 1] = 3e38
    norms = {}
    for fused in (True, False):
        psg = PerSampleGradients(model, mode="bookkeeping", batch_first=True)
        original = recurrent.FUSED_HIDDEN_SIZE
        recurrent.FUSED_HIDDEN_SIZE = original if fused else 0
        try:
            model.zero_grad()
            out = model(x)
            assert torch.isfinite(out).all()
            F.cross_entropy(out, y).backward()
            norms[fused] = psg.clip_and_sum(1.0)
            assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        finally:
            recurrent.FUSED_HIDDEN_SIZE = original
            psg.detach()
    torch.testing.assert_close(norms[True], norms[False], rtol=1e-4, atol=0)


def test_a_larger_lstm_keeps_the_stepped_cells() -> None:
    """The fused kernel is chosen by the layer's shape alone: hidden size at most FUSED_HIDDEN_SIZE, no projection."""
    from lightning_privdec.privacy.per_sample import recurrent

    assert recurrent._fuses(nn.LSTM(4, recurrent.FUSED_HIDDEN_SIZE))
    assert not recurrent._fuses(nn.LSTM(4, recurrent.FUSED_HIDDEN_SIZE + 1))
    assert not recurrent._fuses(nn.LSTM(4, 8, proj_size=3))
    assert not recurrent._fuses(nn.GRU(4, 8))
