"""Sequence losses whose per-example gradients depend on their own example only: the mean within each example, then
over the batch.

Per-example clipping bounds one example's influence only if each example's gradient is a function of that example
alone. Hugging Face's ``outputs.loss`` (and ``F.cross_entropy(..., ignore_index=-100)`` on a flattened batch) is the
mean over every token of the batch: with padded sequences of different lengths each example's gradient is divided by
the batch's token count, so removing one example rescales all the others, and the private strategies refuse it before
training (:mod:`lightning_privdec.privacy.per_sample.probe`). These helpers average each example's tokens first::

    out = self.model(input_ids=ids, attention_mask=mask)
    loss = causal_lm_loss(out.logits, labels)  # labels: -100 at padding, as for Hugging Face

An example without any counted token contributes zero. ``reduction="none"`` gives the per-example losses (ghost
clipping's ``training_step`` returns them).
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor

from lightning_privdec.privacy.errors import PrivacyConfigError


def seq2seq_loss(
    logits: Tensor, labels: Tensor, *, ignore_index: int = -100, reduction: Literal["mean", "none"] = "mean"
) -> Tensor:
    """Token cross-entropy averaged within each example, then over the batch (``"mean"``) or per example
    (``"none"``, shape (batch,)). ``logits`` (batch, time, vocab) are aligned with ``labels`` (batch, time), as an
    encoder-decoder's decoder logits are with its labels; tokens labelled ``ignore_index`` are not counted."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise PrivacyConfigError(
            f"expected logits of shape (batch, time, vocab) and labels of shape (batch, time); got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    if reduction not in ("mean", "none"):
        raise PrivacyConfigError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    tokens = F.cross_entropy(logits.transpose(1, 2).float(), labels, ignore_index=ignore_index, reduction="none")
    counted = (labels != ignore_index).sum(dim=1)
    per_example = tokens.sum(dim=1) / counted.clamp_min(1).to(tokens.dtype)
    return per_example.mean() if reduction == "mean" else per_example


def causal_lm_loss(
    logits: Tensor, labels: Tensor, *, ignore_index: int = -100, reduction: Literal["mean", "none"] = "mean"
) -> Tensor:
    """:func:`seq2seq_loss` of a causal language model: position t predicts token t + 1 (the shift Hugging Face's
    causal-LM loss applies: pass the same ``labels`` you would pass to the model, -100 at padding)."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise PrivacyConfigError(
            f"expected logits of shape (batch, time, vocab) and labels of shape (batch, time); got "
            f"{tuple(logits.shape)} and {tuple(labels.shape)}"
        )
    return seq2seq_loss(logits[:, :-1], labels[:, 1:], ignore_index=ignore_index, reduction=reduction)
