"""Whether the per-sample gradients are per EXAMPLE: a probe that removes one example and looks.

Clipping each row of the recorded per-sample gradients bounds what one example moves the clipped sum by only if

(a) every recorded layer call's batch dimension (dimension 0, or 1 for ``batch_first=False`` and layers whose own
    ``batch_first`` says so) is the dimension of the sampled examples: a sequence-first model's dimension 0 is time,
    and a table looked up once for all examples (``pos_emb(torch.arange(T))``, a relative-position bias looked up
    with a (T, T) index) has no batch dimension at all; and
(b) each example's gradient depends on that example alone: a loss averaged over all the tokens of a padded batch
    (Hugging Face's ``outputs.loss``), or with in-batch negatives, scales or mixes the others' gradients.

Neither can be read off the sizes of one batch (T = B lines up; a token-mean loss has the right shapes). The probe
(:func:`check_examples`) runs the user's forward and backward on m examples, then on the same examples less one,
each batch collated again by the caller from the examples themselves (never sliced out of a collated batch: a
sequence-first batch sliced along dimension 0 loses a time step, and every layer's dimension 0 would shrink by one
as if it were the batch). It refuses, naming the layer, a call whose batch dimension is not m and then m - 1, and
refuses a batch whose remaining examples' per-layer gradient norms changed when the one example left and
also when it was replaced by another example at the same batch size (a GPU's kernels, chosen per batch size, round
the same example differently at m and m - 1; at one size they do not).

Both passes run in eval mode (dropout off) with the random-number generators seeded alike, so that the same example
computes the same thing in both; the user's generators and ``p.grad`` are restored afterwards. A pipeline that is
random for a fixed batch even so (a collate_fn that masks tokens at random, random augmentation in the dataset) makes
the comparison (b) meaningless: it is then skipped and said so in the returned summary; the size check (a) still
runs. The probe is a test on one batch, not a proof: a coupling that shows on other batches only is not seen.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample import bookkeeping
from lightning_privdec.privacy.rounding import full_precision

if TYPE_CHECKING:
    from lightning_privdec.privacy.per_sample.capture import Record
    from lightning_privdec.privacy.per_sample.gradients import PerSampleGradients

#: relative change of an example's per-layer gradient norm that counts as "changed" when another example is removed:
#: far above float rounding of the same computation on a batch of another size, far below what a coupled loss does
RTOL = 1e-3
RTOL_HALF = 3e-2  # output gradients in float16/bfloat16 (autocast)
#: a change between batch sizes m and m - 1 of at most 1 + ROUNDING_CHANGES x the tolerance, absent when the example is
#: replaced at size m, is the rounding of kernels chosen per batch size; a layer that divides by B changes by m/(m-1)
ROUNDING_CHANGES = 10

BATCH_DIMENSION_ERROR = (
    "layer {name} ({type}) was called on inputs whose {which} dimension does not follow the batch: with {m} examples "
    "its dimension {dim}, read as the examples' dimension, has size {first}{then}. Its per-sample gradients would be "
    "per position or time step, not per example, and clipping them bounds nothing one example does. Fix: make "
    "dimension {dim} the examples' dimension in every layer: feed batch-first inputs (batch, time, ...) to a "
    "sequence-first model (or give PerSampleGradients batch_first=False when every layer is (time, batch, ...)), "
    "and look up a table shared by the examples once per example, e.g. `self.pos_emb(positions.expand(batch, -1))` "
    "or an index of shape (1, ...) (expanded to the batch for you), not `self.pos_emb(torch.arange(T))` or a "
    "(T, T) relative-position index"
)
COUPLED_LOSS_ERROR = (
    "the examples' gradients depend on each other: removing one example of {m} changed the other examples' "
    "per-example gradient norms at every layer (by up to {change:.3g}x, layer {name}), so one example also moves "
    "the others' clipped gradients and the clipped sum's sensitivity is no longer max_grad_norm. The loss couples "
    "the examples: a mean over all the tokens of a padded batch (Hugging Face's `outputs.loss`), a loss normalised "
    "by a batch statistic, in-batch negatives (or every layer reads a dimension other than the examples' as the "
    "batch). Fix: average within each example, then over the batch: "
    "`lightning_privdec.privacy.causal_lm_loss(logits, labels)` for causal language models, "
    "`lightning_privdec.privacy.seq2seq_loss(logits, labels)` for encoder-decoder models, or return the mean of "
    "per-example losses (`reduction='none'`, then `.mean()`; the per-example losses themselves for ghost clipping)"
)
MIXING_LAYER_ERROR = (
    "layer {name} ({type}) gives the examples gradients that depend on the other examples: removing one example "
    "of {m} changed the others' per-example gradient norms at this layer by up to {change:.3g}x (not at every "
    "layer, so the loss is not the cause). Its dimension {dim} is not the examples' dimension (a table looked up "
    "once for all examples whose size happens to match the batch) or the layer mixes the examples. Fix: look up "
    "tables once per example (`self.table(index.expand(batch, *index.shape))`, or an index of shape (1, ...)) and "
    "keep every layer's computation within each example"
)

Key = tuple[str, int]  # (layer name, k-th call of that layer in the pass)


def check_examples(per_sample: PerSampleGradients, backward: Callable[[Sequence[int]], Any], examples: int) -> str:
    """The probe of the module docstring on examples ``0 .. examples - 1``: ``backward(indices)`` collates those
    examples (in that order), runs the user's forward and backward, and says whether there was a loss (False: none).
    Raises :class:`PrivacyConfigError` naming the layer (or the loss) and the fix; returns a one-line summary of what
    was checked."""
    if examples < 2:
        return "batch-dimension probe skipped: fewer than 2 examples"
    module, params = per_sample.module, per_sample.parameters
    saved_grads = [p.grad for p in params]
    saved_nonfinite = per_sample._arithmetic.nonfinite_examples
    modes = [(m, m.training) for m in module.modules()]
    probe = _Probe(per_sample, backward, examples)
    full = list(range(examples))
    try:
        # full float32 products (no TF32: on a GPU, TF32 kernels chosen per batch size round the same example's
        # gradients differently by ~1e-3, which the comparison would read as examples depending on each other)
        with _seeded_generators(params[0].device) as reseed, full_precision():
            probe.reseed = reseed
            for p in params:
                p.grad = None
            module.eval()  # dropout off: the same example computes the same thing in every pass
            per_sample._hooks.probing = True
            first = probe.run(full, seed=0)
            if first is None:
                return "batch-dimension probe skipped: training_step returned no loss"
            squares = torch.stack(list(first.values())).square().sum(0)  # each example's, over every call
            removed = int(squares.argmax())  # the largest gradient
            second = probe.run([i for i in full if i != removed], seed=0)
            if second is None:
                return "batch-dimension probe skipped: training_step returned no loss"
            changed = _changed(first, second, removed, probe.rtol)
            if not changed:
                return f"batch dimension and per-example independence checked on {examples} examples"
            again = probe.run(full, seed=1)
            if again is None or _changed(first, again, None, probe.rtol):
                return (
                    "per-example independence not checked: the gradients of a fixed batch differ from run to run "
                    "(a random collate_fn or random augmentation); the batch dimension was checked"
                )
            # the same removal at the same batch size: the removed example replaced by another one. Kernels chosen
            # per batch size (a GPU's convolution algorithms) round the same example differently at m and m - 1;
            # at one size they do not, while a coupling (a batch statistic, a token mean over examples of other
            # lengths, in-batch negatives) still moves the others
            stand_in = int(squares.argmin())
            stand_in = stand_in if stand_in != removed else (removed + 1) % examples
            replaced = probe.run([stand_in if i == removed else i for i in full], seed=0)
            if replaced is None:
                return "batch-dimension probe skipped: training_step returned no loss"
            rounding = max(ratio for _, ratio in changed) <= 1 + ROUNDING_CHANGES * probe.rtol
            if rounding and not _changed(first, _without(replaced, removed), removed, probe.rtol):
                return (
                    f"batch dimension and per-example independence checked on {examples} examples (the norms "
                    "moved by rounding only between batch sizes, not when an example was replaced)"
                )
            probe.refuse(first, changed)  # what the removal changed: the message speaks of removing
    finally:
        per_sample._hooks.probing = False
        per_sample.clear()
        for m, training in modes:
            m.training = training
        for p, g in zip(params, saved_grads):
            p.grad = g
        per_sample._arithmetic.nonfinite_examples = saved_nonfinite
    raise AssertionError("unreachable")  # pragma: no cover


class _Probe:
    """The passes of :func:`check_examples`, and what the first pass saw of each layer's batch dimension."""

    def __init__(self, per_sample: PerSampleGradients, backward: Callable[[Sequence[int]], Any], examples: int) -> None:
        self.per_sample, self.backward, self.examples = per_sample, backward, examples
        self.reseed: Callable[[int], None] = lambda seed: None
        self.rtol = RTOL

    def run(self, indices: list[int], seed: int) -> dict[Key, Tensor] | None:
        """One pass on ``indices``: the batch dimension of every recorded call checked against ``len(indices)``,
        then each call's per-example gradient norms (float64, on the CPU); None when there was no loss."""
        per_sample = self.per_sample
        per_sample.clear()
        self.reseed(seed)
        if self.backward(indices) is False:
            return None
        passes = per_sample._hooks.passes()
        if not passes:
            return None
        if len(passes) > 1:
            raise PrivacyConfigError(
                "training_step ran several backward passes on one batch: a private step is one forward and one "
                "backward pass of the sampled batch"
            )
        for record in passes[0]:
            self.check_batch_dimension(record, len(indices))
        return self.call_norms()

    def check_batch_dimension(self, record: Record, expected: int) -> None:
        for g, dim in zip(record.grads or [], record.batch_dims):
            if g is None or (g.dim() > dim and int(g.shape[dim]) == expected):
                continue
            size = int(g.shape[dim]) if g.dim() > dim else "none (the output has fewer dimensions)"
            first, then = size, ""
            if expected < self.examples:  # the pass without one example: the first pass had the full size
                first, then = self.examples, f", and with {expected} examples {size} (not {expected})"
            raise PrivacyConfigError(BATCH_DIMENSION_ERROR.format(
                name=record.name or "<root>", type=type(record.module).__name__, m=self.examples,
                which="leading" if dim == 0 else f"dimension-{dim}", dim=dim, first=first, then=then,
            ))

    def call_norms(self) -> dict[Key, Tensor]:
        """Each recorded call's per-example gradient norms, by (layer, occurrence), computed as the mode computes
        them (book-keeping's norms for the layers it covers in that mode, materialised per-sample gradients
        otherwise)."""
        per_sample = self.per_sample
        arithmetic = per_sample._arithmetic
        calls = arithmetic.passes()[0]
        half = (torch.float16, torch.bfloat16)  # the output gradients as autograd gave them (the calls promote them)
        if any(g is not None and g.dtype in half for c in calls for g in (c.record.grads or [])):
            self.rtol = RTOL_HALF
        out: dict[Key, Tensor] = {}
        seen: dict[str, int] = {}
        for c in calls:
            name = c.record.name
            key = (name, seen.get(name, 0))
            seen[name] = key[1] + 1
            bookkept = c.kind == "rule" and bookkeeping.has_bookkeeping(c.module, c.backprops)
            if per_sample.mode == "bookkeeping" and bookkept:
                dtype = torch.promote_types(c.backprops.dtype, torch.float32)
                squared = bookkeeping.squared_norms(c.module, c.activations[0], c.backprops, dtype).double()
            else:
                squared = torch.zeros(c.batch_size, dtype=torch.float64, device=per_sample.parameters[0].device)
                for gs in arithmetic._grad_samples([c]).values():
                    squared = squared + torch.linalg.vector_norm(gs.flatten(1), dim=1, dtype=torch.float64).square()
            out[key] = squared.clamp_min(0).sqrt().cpu()
        return out

    def refuse(self, first: dict[Key, Tensor], changed: list[tuple[Key, float]]) -> None:
        """Every layer changed: the loss (or every layer) couples the examples; else the first layer that did."""
        compared = [key for key, norms in first.items() if float(norms.max()) > 0]
        if len(changed) >= len(compared):
            (name, _), change = max(changed, key=lambda item: item[1])
            raise PrivacyConfigError(COUPLED_LOSS_ERROR.format(m=self.examples, change=change, name=name or "<root>"))
        (name, _), change = changed[0]
        module = dict(self.per_sample.module.named_modules()).get(name, self.per_sample.module)
        raise PrivacyConfigError(MIXING_LAYER_ERROR.format(
            name=name or "<root>", type=type(module).__name__, m=self.examples, change=change,
            dim=0 if self.per_sample._arithmetic.batch_first else 1,
        ))


@contextmanager
def _seeded_generators(device: torch.device):  # noqa: ANN202
    """Yields ``reseed(seed)``, which seeds torch's, Python's and NumPy's generators; all are restored on exit."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))

        def reseed(seed: int) -> None:
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)

        try:
            yield reseed
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def _without(norms: dict[Key, Tensor], index: int) -> dict[Key, Tensor]:
    return {key: torch.cat([n[:index], n[index + 1:]]) for key, n in norms.items()}


def _changed(
    first: dict[Key, Tensor], second: dict[Key, Tensor], removed: int | None, rtol: float
) -> list[tuple[Key, float]]:
    """The calls (in forward order) whose remaining examples' norms differ beyond ``rtol``, with the largest ratio of
    new to old norm (or old to new)."""
    out = []
    for key, before in first.items():
        after = second.get(key)
        if after is None:
            continue
        if removed is not None:
            before = torch.cat([before[:removed], before[removed + 1:]])
        if before.shape != after.shape:
            continue
        scale = float(torch.maximum(before, after).max()) if before.numel() else 0.0
        if scale == 0.0:
            continue
        difference = (before - after).abs()
        allowed = rtol * torch.maximum(before, after) + 0.1 * rtol * scale
        if bool((difference > allowed).any()):
            floor = 1e-3 * scale
            ratio = torch.maximum(before, after).clamp_min(floor) / torch.minimum(before, after).clamp_min(floor)
            out.append((key, float(ratio.max())))
    return out
