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
        self.norm, self.qkv, self.out, self.head = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Linear(D, VOCAB)

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


def next_token_loss(model: nn.Module, tokens: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean next-token cross-entropy of each example (B, T) tokens; the batch mean, or per example."""
    sequence_first = getattr(model, "sequence_first", False)
    logits = model(tokens.t() if sequence_first else tokens)
    if sequence_first:
        logits = logits.transpose(0, 1)
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none").mean(dim=1)
    return losses.mean() if reduction == "mean" else losses


class LM(pl.LightningModule):
    def __init__(self, model: nn.Module, per_sample_losses: bool = False) -> None:
        super().__init__()
        self.model, self.per_sample_losses = model, per_sample_losses

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return next_token_loss(self.model, batch[0], "none" if self.per_sample_losses else "mean")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _tokens(n: int, length: int) -> TensorDataset:
    return TensorDataset(torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(0)))


def _fit(module: pl.LightningModule, dataset, batch_size: int, tmp_path, mode: str = "bookkeeping", **loader):
    strategy = DPCSGPStrategy(max_grad_norm=1.0, noise_multiplier=1.0, noise_seed=0, grad_sample_mode=mode)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
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
        r"batch.*feed batch-first inputs", _tokens(64, 16), 16, tmp_path, mode,
    )


def test_the_same_model_fed_batch_first_trains(tmp_path):
    torch.manual_seed(0)
    trainer = _fit(LM(SequenceModel(16, sequence_first=False)), _tokens(64, 16), 16, tmp_path)
    assert trainer.global_step == 2
    assert trainer.strategy.privacy.examples_checked == (
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
