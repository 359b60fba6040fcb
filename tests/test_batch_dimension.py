"""Per-sample gradients are per EXAMPLE, or training is refused before the first update, naming the layer or the loss.

A sequence-first model, a table looked up once for all examples (positions, a relative-position bias) and a loss that
couples the examples (a token mean over a padded batch) all give per-row gradients whose rows are not the examples,
whatever the sizes (T = B included); the one-off probe of :mod:`lightning_privdec.privacy.per_sample.probe` finds
each of them. The honest variants (batch-first, tables looked up per example, the per-example sequence losses of
:mod:`lightning_privdec.privacy.losses`) train.
"""

from __future__ import annotations

import random

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_privdec import DPCSGPStrategy
from lightning_privdec.algorithms.dp_csgp import DPCSGPNode
from lightning_privdec.algorithms.simulation import train_network
from lightning_privdec.privacy import (
    GRAD_SAMPLE_MODES,
    PerSampleGradients,
    PrivacyConfigError,
    PrivacyParameters,
    causal_lm_loss,
    seq2seq_loss,
)
from lightning_privdec.topology import build_topology

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
]

VOCAB, D = 32, 16


class SequenceModel(nn.Module):
    """Embedding, LayerNorm, Linear and F.scaled_dot_product_attention only, with a learned position table; fed
    (T, B) tokens when ``sequence_first`` (no layer says so), else (B, T)."""

    def __init__(self, length: int, sequence_first: bool) -> None:
        super().__init__()
        self.sequence_first = sequence_first
        self.tok, self.pos_emb = nn.Embedding(VOCAB, D), nn.Embedding(length, D)
        self.norm, self.qkv = nn.LayerNorm(D), nn.Linear(D, 3 * D)
        self.out, self.head = nn.Linear(D, D), nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_first:  # (T, B): every layer's dimension 0 is time
            h = self.tok(x) + self.pos_emb(torch.arange(x.shape[0]))[:, None]
            q, k, v = (t.transpose(0, 1) for t in self.qkv(self.norm(h)).chunk(3, dim=-1))
            return self.head(h + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)))
        batch, length = x.shape
        h = self.tok(x) + self.pos_emb(torch.arange(length).expand(batch, length))
        q, k, v = self.qkv(self.norm(h)).chunk(3, dim=-1)
        return self.head(h + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class PositionTable(nn.Module):
    """A learned position table added to every example: looked up once with ``arange(T)`` (shared by the batch), or
    per example (``per_example``)."""

    def __init__(self, length: int, per_example: bool) -> None:
        super().__init__()
        self.per_example = per_example
        self.tok, self.pos_emb, self.head = nn.Embedding(VOCAB, D), nn.Embedding(length, D), nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape
        positions = torch.arange(length)
        pos = self.pos_emb(positions.expand(batch, length) if self.per_example else positions)
        return self.head(torch.tanh(self.tok(x) + pos))


class RelativeBias(nn.Module):
    """Attention with a relative-position bias table looked up with a (T, T) index, or per example."""

    def __init__(self, length: int, per_example: bool, heads: int = 2) -> None:
        super().__init__()
        self.per_example, self.heads = per_example, heads
        self.tok, self.qkv = nn.Embedding(VOCAB, D), nn.Linear(D, 3 * D)
        self.rel_bias, self.head = nn.Embedding(2 * length - 1, heads), nn.Linear(D, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape
        q, k, v = self.qkv(self.tok(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        index = torch.arange(length)[:, None] - torch.arange(length)[None, :] + length - 1
        if self.per_example:
            bias = self.rel_bias(index.expand(batch, length, length)).permute(0, 3, 1, 2)
        else:
            bias = self.rel_bias(index).permute(2, 0, 1)[None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.head(out.transpose(1, 2).reshape(batch, length, D))


def next_token_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each example's mean next-token cross-entropy, from batch-first (B, T, V) logits of (B, T) tokens."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none").mean(dim=1)


def sequence_first_collate(items: list[tuple[torch.Tensor]]) -> torch.Tensor:
    """The user's pipeline collates (T, B) batches: slicing one along dimension 0 would remove a time step."""
    return torch.stack([item[0] for item in items], dim=1)


class LM(pl.LightningModule):
    """Next-token prediction; a (T, B) batch when the model is sequence-first (``sequence_first_collate``)."""

    def __init__(self, model: nn.Module, per_sample_losses: bool = False) -> None:
        super().__init__()
        self.model, self.per_sample_losses = model, per_sample_losses

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        if getattr(self.model, "sequence_first", False):
            logits, tokens = self.model(batch).transpose(0, 1), batch.t()
        else:
            tokens = batch[0]
            logits = self.model(tokens)
        losses = next_token_losses(logits, tokens)
        return losses if self.per_sample_losses else losses.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _tokens(n: int, length: int) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(0)))


def _fit(module: pl.LightningModule, dataset, batch_size: int, tmp_path, mode: str = "bookkeeping",
         precision: str = "32-true", accumulate: int = 1, **loader):
    strategy = DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=0, grad_sample_mode=mode)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, precision=precision, accumulate_grad_batches=accumulate)
    trainer.fit(module, DataLoader(dataset, batch_size=batch_size, **loader))
    return trainer


def _refused_before_the_first_update(module: pl.LightningModule, match: str, *args, **kwargs) -> None:
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(PrivacyConfigError, match=match) as refusal:
        _fit(module, *args, **kwargs)
    assert all(torch.equal(a, p) for a, p in zip(before, module.parameters()))  # nothing was updated
    return refusal


@pytest.mark.parametrize("mode", GRAD_SAMPLE_MODES)
def test_a_sequence_first_model_is_refused_before_the_first_update_even_when_time_equals_the_batch(mode, tmp_path):
    torch.manual_seed(0)
    module = LM(SequenceModel(16, sequence_first=True), per_sample_losses=mode == "ghost")
    _refused_before_the_first_update(
        module, r"layer model\.tok \(Embedding\) was called on inputs whose leading dimension does not follow the "
        r"batch.*feed batch-first inputs", _tokens(64, 16), 16, tmp_path, mode, collate_fn=sequence_first_collate,
    )


def test_the_same_model_fed_batch_first_trains(tmp_path):
    torch.manual_seed(0)
    trainer = _fit(LM(SequenceModel(16, sequence_first=False)), _tokens(64, 16), 16, tmp_path)
    assert trainer.global_step == 2
    assert trainer.strategy.privacy.clipping.examples_checked == (
        "batch dimension and per-example independence checked on 16 examples"
    )


@pytest.mark.parametrize("per_example", [False, True])
def test_a_position_table_shared_by_the_batch_is_refused_when_its_length_equals_the_batch(per_example, tmp_path):
    """T = B = 8: the table's (T, d) rows line up with the examples; looked up per example it trains."""
    torch.manual_seed(0)
    module = LM(PositionTable(8, per_example))
    if per_example:
        assert _fit(module, _tokens(64, 8), 8, tmp_path).global_step == 2
    else:
        _refused_before_the_first_update(
            module, r"layer model\.pos_emb \(Embedding\) .* with 8 examples its dimension 0.* has size 8, and with 7 "
            r"examples 8 \(not 7\).*self\.pos_emb\(positions\.expand\(batch, -1\)\)", _tokens(64, 8), 8, tmp_path,
        )


@pytest.mark.parametrize("per_example", [False, True])
def test_a_relative_position_bias_looked_up_with_a_time_by_time_index_is_refused(per_example, tmp_path):
    torch.manual_seed(0)
    module = LM(RelativeBias(8, per_example))
    if per_example:
        assert _fit(module, _tokens(64, 8), 8, tmp_path).global_step == 2
    else:
        _refused_before_the_first_update(
            module, r"layer model\.rel_bias \(Embedding\) was called on inputs whose leading dimension does not "
            r"follow the batch", _tokens(64, 8), 8, tmp_path,
        )


# ---- a loss that couples the examples: Hugging Face's token mean over a padded batch ---------------------------------
LENGTHS = [24, 3, 3, 4, 3, 3]


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _sequences(lengths=LENGTHS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]


def pad_collate(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, and labels with -100 at padding (as Hugging Face's collators)."""
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


class CausalLM(pl.LightningModule):
    def __init__(self, per_example_loss: bool) -> None:
        super().__init__()
        self.model, self.per_example_loss = _tiny_llama(), per_example_loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        ids, mask, labels = batch
        if self.per_example_loss:
            return causal_lm_loss(self.model(input_ids=ids, attention_mask=mask).logits, labels)
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss  # the mean over the batch's tokens

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_hugging_faces_token_mean_loss_over_a_padded_batch_is_refused_with_the_fix(tmp_path):
    """Lengths [24, 3, 3, 4, 3, 3], the whole shard in every batch (q = 1): removing the long example multiplies
    the others' gradients by (6 / 34) / (5 / 11) = 2.58 under a token mean."""
    _refused_before_the_first_update(
        CausalLM(per_example_loss=False),
        r"the examples' gradients depend on each other: removing one example of 6 changed the other examples' "
        r"per-example gradient norms at every layer \(by up to 2\.5\dx.*Hugging Face's `outputs\.loss`.*"
        r"causal_lm_loss\(logits, labels\)", _sequences(), 6, tmp_path, collate_fn=pad_collate,
    )


def test_under_bf16_mixed_and_micro_batches_the_token_mean_is_refused_and_the_per_example_loss_trains(tmp_path):
    """Output gradients in bfloat16 (the probe's tolerance is 3e-2) and two micro-batches per Poisson batch."""
    options = dict(collate_fn=pad_collate, precision="bf16-mixed", accumulate=2)
    _refused_before_the_first_update(CausalLM(per_example_loss=False), "the examples' gradients depend on each other",
                                     _sequences(LENGTHS * 2), 6, tmp_path, **options)
    trainer = _fit(CausalLM(per_example_loss=True), _sequences(LENGTHS * 2), 6, tmp_path, **options)
    assert trainer.strategy.privacy.ledger.steps == 2 and trainer.strategy.privacy.clipping.examples_checked == (
        "batch dimension and per-example independence checked on 6 examples"  # the micro-batch's expected size
    )


def test_the_per_example_causal_lm_loss_trains(tmp_path):
    trainer = _fit(CausalLM(per_example_loss=True), _sequences(), 6, tmp_path, collate_fn=pad_collate)
    assert trainer.global_step == 2
    assert trainer.strategy.privacy.clipping.examples_checked.startswith("batch dimension and per-example independence checked")


@pytest.mark.parametrize("mode", ["bookkeeping", "hooks", "functorch"])
def test_the_probe_finds_the_coupled_loss_in_every_mode(mode):
    model, sequences = _tiny_llama(), _sequences()
    model.train()
    per_sample = PerSampleGradients(model, mode=mode)

    def backward(loss_of, indices):
        ids, mask, labels = pad_collate([sequences[i] for i in indices])
        loss_of(model(input_ids=ids, attention_mask=mask), labels).backward()

    with pytest.raises(PrivacyConfigError, match="the examples' gradients depend on each other"):
        per_sample.check_examples(lambda i: backward(lambda out, labels: F.cross_entropy(
            out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()), i), len(sequences))
    summary = per_sample.check_examples(lambda i: backward(lambda out, labels: causal_lm_loss(out.logits, labels), i),
                                        len(sequences))
    assert summary == "batch dimension and per-example independence checked on 6 examples"
    per_sample.detach()


def test_causal_lm_loss_is_each_examples_own_token_mean_whatever_the_padding():
    model = _tiny_llama()
    sequences = _sequences()
    ids, mask, labels = pad_collate(sequences)
    per_example = causal_lm_loss(model(input_ids=ids, attention_mask=mask).logits, labels, reduction="none")
    for i, s in enumerate(sequences):  # each example alone, unpadded: Hugging Face's own (token-mean) loss
        alone = model(input_ids=s[None], labels=s[None]).loss
        torch.testing.assert_close(per_example[i], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(causal_lm_loss(model(input_ids=ids, attention_mask=mask).logits, labels),
                               per_example.mean())
    logits = torch.randn(2, 5, VOCAB)
    targets = torch.tensor([[1, 2, 3, -100, -100], [-100, -100, -100, -100, -100]])
    losses = seq2seq_loss(logits, targets, reduction="none")  # aligned: no shift; no counted token: zero
    torch.testing.assert_close(losses[0], F.cross_entropy(logits[0, :3], targets[0, :3]))
    assert losses[1] == 0
    with pytest.raises(PrivacyConfigError, match=r"labels of shape \(batch, time\)"):
        causal_lm_loss(logits, targets[:, :3])


# ---- the simulator, and what the probe leaves behind ----------------------------------------------------------------
class BatchFirstOutside(nn.Module):
    """Takes (B, T) tokens but runs every layer on (T, B): no layer's dimension 0 is the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SequenceModel(16, sequence_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.t()).transpose(0, 1)


def test_the_simulator_refuses_a_sequence_first_model_too():
    tokens = _tokens(64, 16).tensors[0]
    options = dict(topology=build_topology("complete", 1), batch_size=16, steps=1, lr=0.1,
                   loss=lambda logits, x: next_token_losses(logits, x).mean())
    node = lambda rank: DPCSGPNode(PrivacyParameters(max_grad_norm=1.0, noise_multiplier=1.0), rank=rank,  # noqa: E731
                                   device=torch.device("cpu"), noise_seed=0)
    with pytest.raises(PrivacyConfigError, match=r"layer inner\.tok \(Embedding\) .* leading dimension"):
        train_network(node, BatchFirstOutside, [TensorDataset(tokens, tokens)], **options)
    runs = train_network(node, lambda: SequenceModel(16, sequence_first=False), [TensorDataset(tokens, tokens)],
                         **options)
    assert runs[0].node.steps == 1 and runs[0].node.clipping.examples_checked.startswith("batch dimension and per-example")


def test_the_probe_restores_gradients_generators_and_train_modes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    model.train()
    model[1].eval()  # a layer the user keeps in eval mode stays so
    x = torch.randn(8, 4)
    grads = [torch.full_like(p, 3.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    states = torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    per_sample = PerSampleGradients(model, mode="bookkeeping")
    summary = per_sample.check_examples(lambda i: model(x[i]).square().mean().backward(), 8)
    assert summary == "batch dimension and per-example independence checked on 8 examples"
    assert torch.equal(torch.random.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert np.array_equal(np.random.get_state()[1], states[2])
    assert model.training and model[0].training and not model[1].training
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert per_sample.batch_size == 0  # the probe's records are gone


def test_a_random_collate_makes_the_probe_say_it_did_not_check_independence_instead_of_refusing():
    """Tokens masked at random when collated (a masked-LM collator): a fixed batch's gradients change from run to
    run, so removing an example cannot be told from chance; the batch dimension is still checked."""
    torch.manual_seed(0)
    model = PositionTable(8, per_example=True)
    tokens = _tokens(16, 8).tensors[0]

    def backward(indices):
        batch = tokens[indices].masked_fill(torch.rand(len(indices), 8) < 0.3, 0)  # drawn per collation
        next_token_losses(model(batch), tokens[indices]).mean().backward()

    per_sample = PerSampleGradients(model, mode="hooks")
    assert per_sample.check_examples(backward, 8).startswith("per-example independence not checked")
    per_sample.detach()
    shared = PerSampleGradients(PositionTable(8, per_example=False), mode="hooks")
    with pytest.raises(PrivacyConfigError, match="layer pos_emb"):
        shared.check_examples(lambda i: next_token_losses(shared.module(tokens[i]), tokens[i]).mean().backward(), 8)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_the_simulator_trains_every_mode_like_bookkeeping(mode):
    """The same noise and Poisson batches: ghost clipping's per-example losses give the same model as book-keeping."""
    tokens = _tokens(32, 8).tensors[0]

    def run(grad_sample_mode):
        torch.manual_seed(0)
        return train_network(
            lambda rank: DPCSGPNode(PrivacyParameters(max_grad_norm=0.5, noise_multiplier=1.0), rank=rank,
                                    device=torch.device("cpu"), noise_seed=0, grad_sample_mode=grad_sample_mode),
            lambda: PositionTable(8, per_example=True), [TensorDataset(tokens, tokens)],
            topology=build_topology("complete", 1), batch_size=8, steps=3, lr=0.5,
            loss=lambda logits, x: next_token_losses(logits, x),  # per example; the simulator means them if needed
        )[0]

    reference, other = run("bookkeeping"), run(mode)
    # the modes' norm bounds carry the rounding bounds of their own sums (book-keeping's weight-gradient products
    # over 256 T rows, a materialised mode's sum over B rows): clipped examples' factors differ by ~1e-3
    assert other.node.steps == 3 and other.losses == pytest.approx(reference.losses, rel=1e-3)
    torch.testing.assert_close(other.parameters, reference.parameters, rtol=1e-2, atol=1e-4)
    torch.manual_seed(0)
    initial = torch.cat([p.detach().reshape(-1) for p in PositionTable(8, per_example=True).parameters()])
    assert (reference.parameters - initial).norm() > 0.1  # it trained


class _BatchSizeDependent(nn.Module):
    """Each example's output times a factor set by the batch size alone: 1 + ``change`` at an even batch size."""

    def __init__(self, change: float) -> None:
        super().__init__()
        self.linear, self.change = nn.Linear(4, 2), change

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (1 + self.change * (x.shape[0] % 2 == 0))


@pytest.mark.parametrize(("change", "accepted"), [(2e-3, True), (0.14, False)])
def test_a_rounding_sized_change_between_batch_sizes_passes_the_probe_and_a_larger_one_is_refused(change, accepted):
    """A GPU's kernels, chosen per batch size, round one example's gradient differently at m and m - 1 (~1e-3 on an
    H200's convolutions): replacing the removed example at size m changes nothing, and the probe passes. A layer that
    scales by the batch size (here 1.14x, what a 1/B does at m = 8) is refused like any coupling."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_BatchSizeDependent(change), nn.Tanh(), nn.Linear(2, 2)), torch.randn(8, 4)
    per_sample = PerSampleGradients(model, mode="bookkeeping")
    backward = lambda i: model(x[i]).square().sum(1).mean().backward()  # noqa: E731
    if accepted:
        assert per_sample.check_examples(backward, 8).endswith("not when an example was replaced)")
    else:
        with pytest.raises(PrivacyConfigError, match="gradients that depend on the other examples|depend on each other"):
            per_sample.check_examples(backward, 8)
    per_sample.detach()
