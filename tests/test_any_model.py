"""Per-sample clipping on models nobody in this project wrote, unchanged: torchvision ResNets and MobileNetV3 (in-place
ReLU, ``out += identity``), a ViT, Lightning's Transformer and LSTM demos, nn.GRU, attention with causal and padding
masks, embeddings, norms, tied weights, Hugging Face GPT-2 and BERT. For every grad_sample_mode the clipped sum
must equal the one computed from a per-example backward loop (the privacy unit is the example, a whole sequence
for sequence models)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_privdec.privacy import GhostClipping, PerSampleGradients, check_private_model
from lightning_privdec.privacy.dp_step import clip_and_accumulate
from lightning_privdec.privacy.per_sample import GRAD_SAMPLE_MODES

torchvision = pytest.importorskip("torchvision")
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # peft calling transformers
B = 3  # examples per batch: small, so that the per-example loop stays fast


def _no_dropout(model: nn.Module) -> nn.Module:
    """Dropout off (the per-example loop cannot draw the batch's masks); replay itself keeps dropout's masks."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, (nn.MultiheadAttention, nn.RNNBase)):
            m.dropout = 0.0
    return model


# ---- the models: (model, batch, per-example losses of shape (B,)) ---------------------------------------------------
def _cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def _images(size: int, classes: int = 10) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, 3, size, size, generator=g), torch.randint(0, classes, (B,), generator=g)


def _tokens(vocab: int, steps: int) -> Tensor:
    return torch.randint(0, vocab, (B, steps), generator=torch.Generator().manual_seed(2))


def resnet(depth: int) -> tuple:
    from torchvision.models import resnet18, resnet50

    build = {18: resnet18, 50: resnet50}[depth]
    return build(num_classes=10, norm_layer=lambda c: nn.GroupNorm(8, c)), _images(8), _cross_entropy


def mobilenet() -> tuple:
    from torchvision.models import mobilenet_v3_small

    model = mobilenet_v3_small(num_classes=10)
    with pytest.warns(UserWarning, match="BatchNorm2d"):
        check_private_model(model, fix=True)  # its BatchNorms -> GroupNorm, in place
    return _no_dropout(model), _images(8), _cross_entropy


def vit() -> tuple:
    from torchvision.models import VisionTransformer

    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                              num_classes=10)  # fmt: skip
    return model, _images(32), _cross_entropy


def lightning_transformer() -> tuple:
    """Lightning's demo, unchanged: nn.Transformer (batch first) with a causal target mask, tokens -> log-probs."""
    from lightning.pytorch.demos.transformer import LightningTransformer

    vocab, steps = 40, 5
    model = _no_dropout(LightningTransformer(vocab_size=vocab).model)
    inputs, target = _tokens(vocab, steps), _tokens(vocab, steps).roll(1, dims=1)

    def losses(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, t = batch
        return F.nll_loss(m(x, t), t.reshape(-1), reduction="none").view(x.shape[0], -1).mean(dim=1)

    return model, (inputs, target), losses


def lightning_lstm() -> tuple:
    """Lightning's LSTM demo, unchanged: 4-layer nn.LSTM (batch first) with an explicit (layers, B, H) state."""
    from lightning.pytorch.demos.lstm import LightningLSTM

    vocab, steps = 30, 4
    model = _no_dropout(LightningLSTM(vocab_size=vocab).model)
    inputs = _tokens(vocab, steps + 1)

    def losses(m: nn.Module, batch: tuple[Tensor]) -> Tensor:
        (x,) = batch
        hidden = m.init_hidden(x.shape[0])
        out, _ = m(x[:, :-1], hidden)
        return F.nll_loss(out, x[:, 1:].reshape(-1), reduction="none").view(x.shape[0], -1).mean(dim=1)

    return model, (inputs,), losses


class GRUTagger(nn.Module):
    """nn.GRU with batch_first=False, an explicit initial state, and a head on every step."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.gru, self.head = nn.Embedding(20, 6), nn.GRU(6, 5, num_layers=2), nn.Linear(5, 3)
        self.h0 = nn.Parameter(torch.zeros(2, 1, 5))  # a learned initial state on the root (replayed whole)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.gru(self.embed(x.t()), self.h0.expand(-1, x.shape[0], -1).contiguous())
        return self.head(out).mean(dim=0)


def gru() -> tuple:
    return GRUTagger(), (_tokens(20, 4), torch.tensor([0, 2, 1])), _cross_entropy


class LSTMCellLoop(nn.Module):
    """nn.LSTMCell stepped by hand (its h is computed from its c inside the call), then a head on the last h."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.cell, self.head = nn.Embedding(20, 6), nn.LSTMCell(6, 5), nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        emb, state = self.embed(x), None
        for t in range(x.shape[1]):
            state = self.cell(emb[:, t], state)
        return self.head(state[0])


def lstm_cell() -> tuple:
    return LSTMCellLoop(), (_tokens(20, 4), torch.tensor([0, 2, 1])), _cross_entropy


class MaskedAttention(nn.Module):
    """TransformerEncoderLayer with a causal mask and a key-padding mask, then a sequence-first nn.MultiheadAttention
    with a per-head 3-D mask."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.mha = nn.MultiheadAttention(8, 2)  # batch_first=False
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        steps = x.shape[1]
        padding = x == 0
        causal = torch.ones(steps, steps, dtype=torch.bool).triu(1)
        h = self.layer(self.embed(x), src_mask=causal, src_key_padding_mask=padding, is_causal=True)
        seq = h.transpose(0, 1)
        per_head = torch.eye(steps, dtype=torch.bool).roll(1, dims=1).repeat(x.shape[0] * 2, 1, 1)  # (B * heads, T, T)
        out, _ = self.mha(seq, seq, seq, attn_mask=per_head, key_padding_mask=padding)
        return self.head(out.mean(dim=0))


def attention() -> tuple:
    x = _tokens(20, 5)
    x[0, 3:] = 0  # padding
    return MaskedAttention(), (x, torch.tensor([0, 2, 1])), _cross_entropy


class Norms(nn.Module):
    """Embedding, LayerNorm, GroupNorm, RMSNorm, a Linear used twice, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.ln, self.gn, self.rms = nn.Embedding(20, 8), nn.LayerNorm(8), nn.GroupNorm(2, 8), nn.RMSNorm(8)
        self.mix, self.head = nn.Linear(8, 8), nn.Linear(8, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(self.embed(x))
        h = self.gn(h.transpose(1, 2)).transpose(1, 2)
        h = self.mix(torch.tanh(self.mix(self.rms(h))))
        return self.head(h).mean(dim=1)


def norms() -> tuple:
    return Norms(), (_tokens(20, 4), torch.tensor([1, 5, 7])), _cross_entropy


def gpt2() -> tuple:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=40, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)  # lm_head tied to the token embedding
    ids = _tokens(40, 6)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0  # a padded sequence

    def losses(m: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, attention_mask = batch
        logits = m(input_ids=x, attention_mask=attention_mask).logits[:, :-1]
        token = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none") * attention_mask[:, 1:]
        return token.sum(dim=1) / attention_mask[:, 1:].sum(dim=1)

    return model, (ids, mask), losses


def gpt2_lora() -> tuple:
    """LoRA adapters (peft) on GPT-2's attention: only the adapters are trainable."""
    peft = pytest.importorskip("peft")
    model, batch, losses = gpt2()
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    lora = peft.get_peft_model(model, config)
    for m in lora.modules():  # B starts at zero; move it so that A's gradients are not all zero
        if isinstance(m, nn.Linear) and m.weight.requires_grad:
            nn.init.normal_(m.weight, std=0.1)
    return lora, batch, losses


def bert() -> tuple:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=8, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    ids = _tokens(40, 6)
    mask = torch.ones_like(ids)
    mask[1, 3:] = 0

    def losses(m: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        x, attention_mask, y = batch
        return F.cross_entropy(m(input_ids=x, attention_mask=attention_mask).logits, y, reduction="none")

    return transformers.BertForSequenceClassification(config), (ids, mask, torch.tensor([0, 2, 1])), losses


MODELS = {
    "resnet18": lambda: resnet(18),
    "resnet50": lambda: resnet(50),
    "mobilenet_v3_small": mobilenet,
    "vit": vit,
    "lightning_transformer": lightning_transformer,
    "lightning_lstm": lightning_lstm,
    "gru": gru,
    "lstm_cell": lstm_cell,
    "attention_masks": attention,
    "norms_embedding_tied": norms,
    "gpt2": gpt2,
    "gpt2_lora": gpt2_lora,
    "bert": bert,
}
#: the slowest model is checked in the default mode only (its layers are ResNet-18's)
MODES = {"resnet50": ("bookkeeping",)}
FLOAT32 = {"resnet18", "resnet50", "mobilenet_v3_small", "lightning_lstm"}  # big enough that float64 costs seconds


def _build(name: str) -> tuple[nn.Module, tuple, object]:
    torch.manual_seed(0)
    model, batch, losses = MODELS[name]()
    if name not in FLOAT32:
        model = model.double()
        batch = tuple(t.double() if t.is_floating_point() else t for t in batch)
    return model.train(), batch, losses


def _per_example_loop(model: nn.Module, batch: tuple, losses) -> list[list[Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(batch[0].shape[0]):
        one = tuple(t[i : i + 1] for t in batch)
        out.append([g if g is not None else torch.zeros_like(p) for p, g in
                    zip(params, torch.autograd.grad(losses(model, one).sum(), params, allow_unused=True))])  # fmt: skip
    return out


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[Tensor], float, list[Tensor], Tensor]]:
    """Per model: its initial parameters, the clip and the per-example loop's clipped sum and norms. The loop does not
    depend on the mode: the model's first test computes it, its other modes' tests (next in the order) reuse it."""
    return {}


def _reference(references: dict, name: str, model: nn.Module, batch: tuple, losses) -> tuple[float, list, Tensor]:
    if name not in references:
        reference = _per_example_loop(model, batch, losses)
        per_example = [torch.stack(gs) for gs in zip(*reference)]
        norms = torch.stack([torch.linalg.vector_norm(torch.cat([g.flatten() for g in gs])) for gs in reference])
        clip = float(norms.median())  # clips some examples, not all
        expected, expected_norms = clip_and_accumulate(per_example, clip, torch.device("cpu"))
        references[name] = ([p.detach().clone() for p in model.parameters()], clip, expected, expected_norms)
    initial, clip, expected, expected_norms = references[name]
    # the reference is this model's: _build seeds the initialisation, so every mode's test builds the same model
    assert len(initial) == len(list(model.parameters()))
    assert all(torch.equal(a, p) for a, p in zip(initial, model.parameters()))
    return clip, expected, expected_norms


@pytest.mark.parametrize(
    ("name", "mode"), [(name, mode) for name in MODELS for mode in MODES.get(name, GRAD_SAMPLE_MODES)]
)
def test_clipped_sum_equals_the_per_example_loop(name: str, mode: str, references: dict) -> None:
    model, batch, losses = _build(name)
    clip, expected, expected_norms = _reference(references, name, model, batch, losses)
    if mode == "ghost":
        ghost = GhostClipping(model, clip)
        got_norms = ghost.backward(losses(model, batch))
        ghost.detach()
    else:
        psg = PerSampleGradients(model, mode=mode)
        losses(model, batch).mean().backward()
        got_norms = psg.clip_and_sum(clip)
        psg.detach()
    if name in FLOAT32:  # float32 in another order (GroupNorm on 1 x 1 maps is ill-conditioned): 2e-3 of the norms,
        # 5e-3 for MobileNetV3, whose third example's norm the loop and the batch each round by up to 3e-3 of
        # float64's (2.96e-3 on an Intel Xeon, 1.2e-3 on an AMD EPYC), on either side depending on the machine and the
        # number of intra-op threads
        rtol = 5e-3 if name == "mobilenet_v3_small" else 2e-3
        torch.testing.assert_close(got_norms.to(expected_norms.dtype), expected_norms, atol=1e-4, rtol=rtol)
        for p, want in zip([p for p in model.parameters() if p.requires_grad], expected):
            assert torch.linalg.vector_norm(p.grad - want) <= 1e-3 * torch.linalg.vector_norm(want) + 1e-7
    else:
        torch.testing.assert_close(got_norms, expected_norms, atol=1e-9, rtol=1e-7)
        for p, want in zip([p for p in model.parameters() if p.requires_grad], expected):
            torch.testing.assert_close(p.grad, want, atol=1e-9, rtol=1e-7)
    assert not any(hasattr(m, "activations") for m in model.modules())  # nothing left on the model


def test_replay_keeps_dropout_masks_and_the_model_is_unchanged() -> None:
    """With dropout on, the per-example gradients (replayed with the call's random state) still sum to autograd's
    batch gradient; the hooks leave the model's modules and forward untouched."""
    from lightning.pytorch.demos.transformer import LightningTransformer

    torch.manual_seed(0)
    model = LightningTransformer(vocab_size=30).model.double().train()
    modules = dict(model.named_modules())
    x, t = _tokens(30, 5), _tokens(30, 5)
    psg = PerSampleGradients(model, mode="bookkeeping")
    F.nll_loss(model(x, t), t.reshape(-1), reduction="sum").backward()
    batch_grads = [p.grad.clone() for p in psg.parameters]
    summed = [g.sum(dim=0) / 1.0 for g in psg.per_sample_grads()]
    for got, want in zip(summed, batch_grads):
        torch.testing.assert_close(got / B, want, atol=1e-9, rtol=1e-7)  # mean-loss convention: rows are B * grad
    psg.detach()
    assert dict(model.named_modules()) == modules


def test_one_setup_line_names_each_layers_mechanism(caplog: pytest.LogCaptureFixture) -> None:
    model, _, _ = _build("attention_masks")
    with caplog.at_level(logging.INFO):
        PerSampleGradients(model, mode="bookkeeping").detach()
    lines = [r.getMessage() for r in caplog.records if "per-sample" in r.getMessage()]
    assert len(lines) == 1
    mechanisms = dict(part.split(": ") for part in lines[0].split("): ", 1)[1].split("; "))
    assert set(mechanisms["book-keeping"].split(", ")) == {"2 MultiheadAttention", "3 Linear"}
    assert mechanisms["closed form"] == "1 Embedding, 2 LayerNorm"  # (a small table: bookkeeping_embedding.MIN_ENTRIES)
    assert "replay" not in lines[0]


def test_batchnorm_stays_refused_with_the_fix_named() -> None:
    from torchvision.models import resnet18

    with pytest.raises(Exception, match="fix_model=True"):
        PerSampleGradients(resnet18(num_classes=10))


def test_a_private_strategy_trains_the_unchanged_transformer_demo() -> None:
    """DP-CSGP (the first line a user writes) on Lightning's Transformer demo, one process, a few steps."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.transformer import LightningTransformer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_privdec import DPCSGPStrategy

    class Demo(LightningTransformer):
        def prepare_data(self) -> None:  # the demo downloads WikiText-2; synthetic tokens instead
            pass

        def train_dataloader(self) -> DataLoader:
            tokens = torch.randint(0, 30, (24, 6), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=6)

    torch.manual_seed(0)
    model = Demo(vocab_size=30)
    before = [p.detach().clone() for p in model.parameters()]
    strategy = DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model)
    assert trainer.global_step == 3 and strategy.privacy.ledger.steps == 3
    assert math.isfinite(strategy.privacy.epsilon())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


class RecurrentState(nn.Module):
    """An nn.LSTM whose initial state is ``"carried"`` from the previous step (detached, as in truncated
    backpropagation through time), ``"fresh"`` every step, or an ``"encoder"``'s final state of the same step."""

    def __init__(self, state: str) -> None:
        super().__init__()
        self.state, self.hidden = state, None
        self.embed, self.head = nn.Embedding(10, 4), nn.Linear(5, 3)
        self.encoder, self.lstm = nn.LSTM(4, 5, batch_first=True), nn.LSTM(4, 5, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        e = self.embed(x)
        if self.state == "encoder":
            hx = self.encoder(e)[1]
        elif self.state == "carried" and self.hidden is not None:
            hx = (self.hidden[0].detach(), self.hidden[1].detach())
        else:
            hx = (e.new_zeros(1, x.shape[0], 5), e.new_zeros(1, x.shape[0], 5))
        out, self.hidden = self.lstm(e, hx)
        return self.head(out[:, -1])


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
@pytest.mark.parametrize("state", ["carried", "fresh", "encoder"])
def test_a_hidden_state_carried_into_the_next_step_is_refused(state: str, mode: str) -> None:
    from lightning_privdec.privacy.errors import PrivacyConfigError

    model = RecurrentState(state)
    hooks = GhostClipping(model, 1.0) if mode == "ghost" else PerSampleGradients(model, mode=mode)
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        x, y = torch.randint(0, 10, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)
        losses = F.cross_entropy(model(x), y, reduction="none")
        if mode == "ghost":
            hooks.backward(losses)
        else:
            losses.mean().backward()
            hooks.clip_and_sum(1.0)
            hooks.clear()

    step()
    if state == "carried":
        with pytest.raises(PrivacyConfigError, match=r"layer lstm \(LSTM\) was passed a hidden state carried over"):
            step()
    else:
        step()
        step()
    hooks.detach()


def test_the_unchanged_lstm_demo_is_refused_before_its_first_release() -> None:
    """Lightning's LSTM demo carries its state across batches: refused at the second forward pass of the per-example
    probe that runs before the first step (it carries the probe's first state into its second pass), before
    PyTorch's own size error (a Poisson batch of another size) and before any private release."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos.lstm import LightningLSTM
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_privdec import DPCSGPStrategy
    from lightning_privdec.privacy.errors import PrivacyConfigError

    model = LightningLSTM(vocab_size=16)
    model.prepare_data = lambda: None  # the demo downloads WikiText-2; synthetic tokens instead
    tokens = torch.randint(0, 16, (32, 6), generator=torch.Generator().manual_seed(0))
    strategy = DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    with pytest.raises(PrivacyConfigError, match=r"layer model\.rnn \(LSTM\) .* carried over .*`self\.hidden = None`"):
        trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    assert trainer.global_step == 0 and strategy.privacy.ledger.steps == 0


class ParameterReadOutsideItsLayer(nn.Module):
    """``b.weight`` is also used in the root's forward, where no hook on ``b`` sees it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)) @ self.b.weight.t() @ self.b.weight)


@pytest.mark.parametrize("mode", ["bookkeeping", "hooks"])
def test_a_use_the_hooks_cannot_see_stops_the_first_step(mode: str) -> None:
    from lightning_privdec.privacy.errors import PrivacyConfigError

    model = ParameterReadOutsideItsLayer()
    psg = PerSampleGradients(model, mode=mode)
    F.cross_entropy(model(torch.randn(5, 4)), torch.randint(0, 2, (5,))).backward()
    with pytest.raises(PrivacyConfigError, match="'b.weight' do not add up"):
        psg.clip_and_sum(1.0)
    psg.detach()


@pytest.mark.multiprocess
def test_lora_example_gossips_only_the_adapters(tmp_path) -> None:  # noqa: ANN001
    """examples/finetune_lora.py --synthetic on 2 processes: the bytes per step are the adapters', not the model's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("peft")
    from tests.multiprocess import run_group

    example = Path(__file__).resolve().parents[1] / "examples" / "finetune_lora.py"
    result: subprocess.CompletedProcess = run_group(
        [sys.executable, str(example), "--synthetic", "--nodes", "2", "--max-steps", "2", "--examples", "64"], 600,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["steps"] == 2 and report["trainable_parameters"] < report["all_parameters"] / 10
    assert 0 < report["bytes_sent_node0_per_step"] < 2 * 4 * report["trainable_parameters"]  # float32 adapters
    assert report["bytes_sent_node0_per_step"] < report["bytes_of_the_whole_model"] / 10
