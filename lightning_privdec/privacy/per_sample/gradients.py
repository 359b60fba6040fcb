"""Per-sample gradients for DP-SGD on a module Lightning already holds, with hooks attached in place.

DP-SGD (Abadi et al. 2016, Algorithm 1) clips each example's gradient, so it needs gradients per example, not only
their sum. Hooks on the existing module object (:mod:`.capture`) record every layer call's inputs ``a_i`` and
output gradients ``g_i``; Lightning, the optimizer and the strategy keep holding the same module and parameters,
and the LightningModule's own ``training_step`` (``self(x)``) feeds them.

The default mode, ``"bookkeeping"`` (Bu, Wang, Zha, Karypis 2023, "book-keeping" ghost clipping), computes nothing
more during the backward pass. Once it is over it gets each example's gradient norm without materialising the
batch's per-sample gradients (for a linear layer ||g_i a_i^T||^2 = ||g_i||^2 ||a_i||^2; Goodfellow 2015, Li et al.
2022; convolutions likewise, :mod:`.bookkeeping`) and then the sum of CLIPPED gradients in one weight-gradient
computation per layer, sum_i c_i g_i a_i^T = (c * G)^T A. The result is the same sum of clipped per-sample gradients
as ``"hooks"`` (same flat clipping, same mean-loss convention, the same training_step), with one backward pass; other
layers materialise their per-sample gradients by their rule or by replay (:mod:`.capture`), for that layer only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from lightning_privdec.privacy.dp_step import clip_and_accumulate
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample import attention, bookkeeping
from lightning_privdec.privacy.per_sample.arithmetic import (
    _PerSampleArithmetic,
    mean_loss_multiplier,
)
from lightning_privdec.privacy.per_sample.capture import Recorder, layer_units
from lightning_privdec.privacy.per_sample.checks import check_private_model
from lightning_privdec.privacy.per_sample.probe import check_examples
from lightning_privdec.privacy.validation import check_max_grad_norm
from lightning_privdec.tensors import round_into_grad

__all__ = ["DEFAULT_GRAD_SAMPLE_MODE", "GRAD_SAMPLE_MODES", "GhostClipping", "GradSampleMode", "PerSampleGradients",
           "mean_loss_multiplier"]  # fmt: skip

GradSampleMode = Literal["bookkeeping", "hooks", "functorch", "ghost"]
GRAD_SAMPLE_MODES: tuple[str, ...] = ("bookkeeping", "hooks", "functorch", "ghost")
#: the fastest mode that keeps DP-SGD's semantics for every model (see benchmarks/step_time.py --modes-only)
DEFAULT_GRAD_SAMPLE_MODE = "bookkeeping"
_PER_SAMPLE_MODES = ("bookkeeping", "hooks", "functorch")  # modes of PerSampleGradients (ghost: GhostClipping)
_ATTACHED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules with hooks of this package


def describe_units(units: list[tuple[str, nn.Module, str]], mode: str) -> str:
    """One line: how many layers of each type use which mechanism (the setup report)."""
    counts: dict[tuple[str, str], int] = {}
    for _, module, kind in units:
        if attention.is_projection(module):
            continue  # reported as its nn.MultiheadAttention
        if kind == "attention":
            kind, module_covered = "rule", True
        else:
            module_covered = bookkeeping.covers(module)
        mechanism = {"rule": "functorch vmap" if mode == "functorch" else "closed form", "shared": "broadcast",
                     "unrolled": "unrolled"}.get(kind, "replay")
        if kind == "rule" and mode in ("bookkeeping", "ghost") and module_covered:
            mechanism = "book-keeping"
        key = (type(module).__name__, mechanism)
        counts[key] = counts.get(key, 0) + 1
    by_mechanism: dict[str, list[str]] = {}
    for (name, mechanism), n in counts.items():
        by_mechanism.setdefault(mechanism, []).append(f"{n} {name}")
    return "; ".join(f"{mechanism}: {', '.join(names)}" for mechanism, names in by_mechanism.items())


class PerSampleGradients:
    """Per-sample gradients of ``module``'s trainable parameters, from hooks attached in place (the module object
    is not replaced nor rewritten; :meth:`detach` removes every hook).

    After a forward and backward pass of ``module`` (or of any code calling it, such as a LightningModule's
    ``training_step`` calling ``self(x)``) in training mode, :meth:`per_sample_grads` gives ``(B, *p.shape)`` per
    parameter and :meth:`clip_and_sum` leaves the sum of clipped per-sample gradients in ``p.grad``. Which layer
    uses which mechanism (closed form, book-keeping, replay; see :mod:`.capture`) is logged once, here.

    Args:
        module: the model; validated with :func:`check_private_model` when ``strict``.
        mode: ``"bookkeeping"`` (no per-sample gradients in memory for nn.Linear: norms and clipped sums from a
            and g, see the module docstring), ``"hooks"`` (Opacus's per-layer formulas, per-sample gradients
            materialised and kept in ``p.grad_sample`` by :meth:`per_sample_grads`) or ``"functorch"`` (vmap of
            ``torch.func.grad`` for every layer with a rule). Layers without a rule use replay in every mode.
            Ghost clipping with per-sample losses is :class:`GhostClipping`.
        loss_reduction: how the loss reduces over the batch, ``"mean"`` (Lightning's usual mean loss) or ``"sum"``;
            output gradients are multiplied by B for ``"mean"`` so the results are true per-example gradients.
        batch_first: whether inputs have the batch in dimension 0 (layers with their own ``batch_first``
            attribute, such as nn.LSTM and nn.MultiheadAttention, follow it).
        strict: validate the model first (recommended).
        allow_grad_accumulation: allow several backward passes before :meth:`clear`; their samples are then
            concatenated. Off by default: with Poisson sampling every step must be exactly one sampled batch.
    """

    def __init__(
        self,
        module: nn.Module,
        mode: GradSampleMode = "hooks",
        *,
        loss_reduction: Literal["mean", "sum"] = "mean",
        batch_first: bool = True,
        strict: bool = True,
        allow_grad_accumulation: bool = False,
        _report_as: str | None = None,
    ) -> None:
        if mode not in _PER_SAMPLE_MODES:
            raise PrivacyConfigError(
                f"unknown per-sample gradient mode {mode!r}; choose 'hooks' (default), 'functorch' or 'bookkeeping' "
                "(ghost clipping: GhostClipping)"
            )
        if loss_reduction not in ("mean", "sum"):
            raise PrivacyConfigError(
                f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}: how training_step's loss reduces "
                "over the batch"
            )
        if strict:
            check_private_model(module)
        if module in _ATTACHED or hasattr(module, "autograd_grad_sample_hooks"):
            raise PrivacyConfigError(
                f"{type(module).__name__} already has per-sample hooks attached; call detach() on the existing "
                "PerSampleGradients (or remove Opacus's hooks) first"
            )
        if not any(p.requires_grad for p in module.parameters()):
            raise PrivacyConfigError("the model has no trainable parameters: there is nothing to privatize")
        self.module = module
        self.mode = mode
        self.loss_reduction = loss_reduction
        units = layer_units(module)
        self.report = f"per-sample gradients ({_report_as or mode}): {describe_units(units, _report_as or mode)}"
        rank_zero_info(self.report)
        self._hooks = Recorder(module, units, batch_first=batch_first)
        self._arithmetic = _PerSampleArithmetic(
            self._hooks, loss_reduction=loss_reduction, batch_first=batch_first, functorch=mode == "functorch"
        )
        if not allow_grad_accumulation:
            self._hooks.grad_accumulation_allowed = False
        _ATTACHED.add(module)
        self._attached = True
        self._checked = False  # until the first step's check: each parameter's gradient from this backward pass
        self._batch_grads: dict[nn.Parameter, Tensor] = {}
        self._grad_hooks = [p.register_hook(partial(self._keep_batch_grad, p)) for p in self.parameters]
        self._clipped_sums: list[Tensor] | None = None  # the last clip_and_sum's float64 sums, until taken

    def set_loss_scale(self, scale: float, drop_nonfinite: bool = True) -> None:
        """Under ``precision="16-mixed"``: the next backward pass's loss is multiplied by ``scale`` (the GradScaler's),
        which every per-example gradient is divided by before clipping; with ``drop_nonfinite`` an example's
        non-finite (overflowed) rows of a layer call are zeroed instead of poisoning the sum (counted by
        :meth:`take_nonfinite_examples`), and output gradients are unscaled and summed in float32."""
        self._arithmetic.loss_scale = float(scale)
        self._arithmetic.drop_nonfinite = bool(drop_nonfinite)

    def set_mean_loss_multiplier(self, multiplier: float) -> None:
        """The next backward pass's mean loss is multiplied by ``multiplier`` (:func:`mean_loss_multiplier`), which
        the per-example gradients are divided by; reset by :meth:`clear`."""
        self._arithmetic.mean_loss_multipliers[self._hooks.forward_pass] = float(multiplier)

    @property
    def forward_batch_size(self) -> int:
        """Examples in the forward pass recorded last (before its backward pass: what the loss averages over)."""
        return int(self._hooks._pass_batch or 0)

    def take_nonfinite_examples(self) -> int:
        """Examples with a non-finite (overflowed) input or output gradient zeroed somewhere, over the backward
        passes since the last call (each pass counted once); resets the count."""
        count, self._arithmetic.nonfinite_examples = self._arithmetic.nonfinite_examples, 0
        return count

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Trainable parameters, in ``module.parameters()`` order (the order of :meth:`per_sample_grads`)."""
        return [p for p in self.module.parameters() if p.requires_grad]

    @property
    def attached(self) -> bool:
        return self._attached

    def per_sample_grads(self) -> list[Tensor]:
        """``[g_p of shape (B, *p.shape) for p in parameters]`` from the last backward pass(es).

        Parameters the batch did not reach get zeros. When no parameter got per-sample gradients (an empty Poisson
        batch whose step skipped backward) every entry is an empty ``(0, *p.shape)`` tensor, so the DP step
        releases pure noise. In ``"hooks"`` and ``"functorch"`` modes they are also kept in ``p.grad_sample``.
        """
        self._check_sums_once(bookkeeping=False)
        params = self.parameters
        grads = self._arithmetic.per_sample_grads(params)
        if self.mode != "bookkeeping":
            for p, g in zip(params, grads):
                p.grad_sample = g
        return grads

    @property
    def batch_size(self) -> int:
        """The number of per-sample gradients the last backward pass(es) recorded (0 when none)."""
        return self._arithmetic.batch_size()

    def flat_per_sample_grads(self, out: Tensor | None = None) -> Tensor:
        """The per-sample gradients as one ``(B, d)`` matrix, parameters concatenated in order, written into ``out``
        (shape ``(batch_size, d)``) when given: nn.Linear layers then write their outer products straight into it."""
        self._check_sums_once(bookkeeping=False)
        params = self.parameters
        if out is None:
            out = torch.empty(self.batch_size, sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        return self._arithmetic.per_sample_grads_into(params, out)

    def clip_and_sum(self, max_grad_norm: float, *, into_grads: bool = True) -> Tensor:
        """``p.grad <- sum_i min(1, C / (||g_i|| + 1e-6)) g_i`` (flat clipping: ||g_i|| over ALL parameters jointly,
        as in :func:`~lightning_privdec.privacy.dp_step.clip_and_accumulate`); returns the norms ``||g_i||``.
        The sums themselves are float64 (:meth:`take_clipped_sums`: what a mechanism adds its noise to), ``p.grad``
        holds them rounded to p's dtype (unless ``into_grads`` is False: a caller that noises the float64 sums into
        ``p.grad`` itself saves that pass).

        Book-keeping never materialises the g_i of nn.Linear layers (module docstring); the other modes clip
        materialised per-sample gradients. An empty batch, or a step without backward, leaves zeros.
        """
        self._check_sums_once(bookkeeping=self.mode == "bookkeeping")
        self._clipped_sums = None  # (its buffers may then be reused for this step's sums)
        params = self.parameters
        if self.mode == "bookkeeping":
            norms, sums = self._arithmetic.clip_and_sum(params, max_grad_norm, into_grads)
        else:
            sums, norms = clip_and_accumulate(self.per_sample_grads(), max_grad_norm, params[0].device)
            sums = [summed.to(p.device).view_as(p) for p, summed in zip(params, sums)]
            if into_grads:
                for p, summed in zip(params, sums):
                    round_into_grad(p, summed)
        self._clipped_sums = sums
        return norms

    def clip_nothing(self) -> None:
        """A step without examples (an empty Poisson batch, no backward pass): zero sums and zero ``p.grad``."""
        self._clipped_sums = [torch.zeros(p.shape, dtype=torch.float64, device=p.device) for p in self.parameters]
        for p in self.parameters:
            p.grad = torch.zeros_like(p)

    def take_clipped_sums(self) -> list[Tensor]:
        """The last :meth:`clip_and_sum`'s clipped sums in float64, one per parameter in :attr:`parameters`' order,
        handed over (a second call raises). Rounding a sum to float32 before the noise is added would not be a
        rounding of the noisy value: removing one example would move the rounded sum by up to half a float32 unit of
        the whole sum besides that example's C (1.00014 C for 4,000 clipped examples); rounding the noisy sum is
        post-processing."""
        if self._clipped_sums is None:
            raise RuntimeError("take_clipped_sums() without a clip_and_sum() since the last one")
        sums, self._clipped_sums = self._clipped_sums, None
        return sums

    def _keep_batch_grad(self, p: nn.Parameter, grad: Tensor) -> None:
        if self._hooks.enabled and not self._hooks.replaying:
            grad = grad.detach()
            self._batch_grads[p] = grad if p not in self._batch_grads else self._batch_grads[p] + grad

    def _check_sums_once(self, *, bookkeeping: bool) -> None:
        """On the first backward pass: the per-example gradients must add up to autograd's gradient of the batch
        (divided by B for a mean loss; taken by gradient hooks on the parameters, so stale ``.grad`` values do not
        count). They do not when part of a parameter's gradient comes from a use no hook
        sees (a parameter read outside its own layer's forward), from a batch dimension read wrongly, or from a
        per-example rule that is wrong for its input; training would then clip and release something that is not the
        per-example gradient, so it stops here instead. The sum checked is that of the arithmetic the caller releases
        (``bookkeeping``: book-keeping's clipped sum with clip factor 1; else the materialised per-example gradients
        of :meth:`per_sample_grads` and :meth:`flat_per_sample_grads`, whatever the mode)."""
        self._hooks.unfreeze_parameters()  # every trainable parameter is read from here on
        if self._checked:
            return
        passes = self._arithmetic.passes()
        if len(passes) != 1 or max(c.batch_size for c in passes[0]) == 0 or self._arithmetic.last_pass_nonfinite:
            return  # nothing recorded yet, an empty batch, several passes (their sum is no batch gradient), overflow
        self._checked = True
        for handle in self._grad_hooks:
            handle.remove()
        # from now on autograd's own gradients of rule layers' parameters are never read: skip computing them
        self._hooks.skip_parameter_grads = True
        sums = self._arithmetic.batch_sum(passes[0], bookkeeping=bookkeeping)
        multiplier = self._arithmetic.mean_loss_multipliers.get(passes[0][0].record.forward_pass, 1.0)
        scale = 1.0 / max(c.batch_size for c in passes[0]) if self.loss_reduction == "mean" else 1.0
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        grads = self._batch_grads
        wanted = [
            grads[p].double() / (self._arithmetic.loss_scale * multiplier) if p in grads
            else torch.zeros_like(p, dtype=torch.float64)
            for _, p in named
        ]
        self._batch_grads = {}
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(w) for w in wanted]))
        low = any(c.backprops is not None and c.backprops.dtype in (torch.float16, torch.bfloat16) for c in passes[0])
        relative = 5e-2 if low else 1e-2  # half-precision output gradients (autocast) carry 3 digits
        for (name, p), want in zip(named, wanted):
            got = sums[p].double() * scale if p in sums else torch.zeros_like(want)
            error, size = torch.linalg.vector_norm(got - want), torch.linalg.vector_norm(want)
            if error > relative * size + 1e-4 * total + 1e-7:  # float32 sums in another order stay far below
                raise PrivacyConfigError(
                    f"the per-example gradients of parameter {name!r} do not add up to its gradient (relative "
                    f"error {float(error / (size + 1e-12)):.2g}): part of it "
                    "comes from a use the per-sample hooks do not see, such as the parameter read in another "
                    "module's forward, or the layer's batch dimension is not the one assumed (pass batch_first=). "
                    "Use the parameter only inside the forward of the module that owns it. If it is used there only, "
                    f"the {self.mode!r} mode's per-example rule is wrong for this layer's input: try another "
                    "grad_sample_mode"
                )

    def check_examples(self, backward: Callable[[Sequence[int]], Any], examples: int) -> str:
        """Before training: refuse, naming the layer or the loss and the fix, a model whose recorded batch
        dimension is not the examples' (a sequence-first model, a table looked up once for all examples) or whose
        examples' gradients depend on each other (a token-mean loss over a padded batch). ``backward(indices)``
        collates examples ``indices`` of the data (a subset of ``range(examples)``, in that order) as the training
        loader does, runs the user's forward and backward, and returns False when there was no loss. Runs the
        forward and backward three times at most, in eval mode; ``p.grad``, the random-number generators and the
        layers' train/eval modes are restored. See :mod:`.probe`, which says what the check cannot see. Returns a
        one-line summary of what was checked."""
        return check_examples(self, backward, examples)

    def clear(self) -> None:
        """Forget the stored per-sample gradients and activations (call after every optimizer step)."""
        self._arithmetic._counted.clear()
        self._arithmetic.mean_loss_multipliers.clear()
        self._hooks.forget()
        self._batch_grads = {}
        if self.mode == "bookkeeping":
            return  # (its per_sample_grads never set p.grad_sample)
        for p in self.module.parameters():
            if hasattr(p, "grad_sample"):
                p.grad_sample = None

    def detach(self) -> None:
        """Remove the hooks and every attribute they added; the module is as before. Idempotent."""
        if not self._attached:
            return
        self.clear()
        self._hooks.remove()
        for handle in self._grad_hooks:
            handle.remove()
        for p in self.module.parameters():
            if hasattr(p, "grad_sample"):
                del p.grad_sample
        _ATTACHED.discard(self.module)
        self._attached = False

    def __enter__(self) -> PerSampleGradients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return f"PerSampleGradients({type(self.module).__name__}, mode={self.mode!r}, attached={self._attached})"


class GhostClipping:
    """Ghost clipping (Li et al. 2022) from per-sample losses, in one backward pass (Bu et al. 2023's book-keeping).

    ``training_step`` returns the per-sample losses (``reduction="none"``, shape ``(B,)``); :meth:`backward` runs
    one backward pass of their sum through book-keeping's hooks and leaves sum_i min(1, C / ||g_i||) g_i in every
    ``p.grad``: per-sample gradients of nn.Linear layers are never materialised, and memory stays at one gradient
    per parameter for them. Other layers use their rule or replay (:mod:`.capture`).
    """

    def __init__(self, module: nn.Module, max_grad_norm: float) -> None:
        self.module = module
        self.max_grad_norm = check_max_grad_norm(max_grad_norm)  # a positive C of at least 2^-26, or a clear error
        self._per_sample = PerSampleGradients(
            module, mode="bookkeeping", loss_reduction="sum", allow_grad_accumulation=True, _report_as="ghost"
        )

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters, in ``module.parameters()`` order."""
        return self._per_sample.parameters

    def loss_sum(self, per_sample_losses: Tensor, expected_batch_size: float | None = None) -> Tensor:
        """The per-sample losses' sum times 2^-ceil(log2 E) (E the run's expected batch size, else B), the factor
        each example's loss has under the mean loss's :func:`mean_loss_multiplier`: float16 output gradients (scaled by
        the GradScaler under 16-mixed) then overflow no sooner than with a mean loss, where the plain sum's B-times
        larger ones did (a 3-class classifier's at 50,000 of float16's 65,504). The per-sample arithmetic is told the
        factor and divides it out exactly (a power of two)."""
        factor = mean_loss_multiplier(1, expected_batch_size or max(per_sample_losses.numel(), 1))
        self._per_sample.set_mean_loss_multiplier(factor)
        return per_sample_losses.sum() * factor

    def backward(self, per_sample_losses: Tensor, expected_batch_size: float | None = None) -> Tensor:
        """Leave sum_i clip(g_i) in every ``p.grad`` (the backward pass of :meth:`loss_sum`); return the unclipped
        per-sample gradient norms."""
        if per_sample_losses.dim() != 1:
            self._per_sample.clear()
        self.check_loss_shape(per_sample_losses)
        if per_sample_losses.numel() == 0:  # an empty Poisson batch: nothing to clip, the step is pure noise
            self._per_sample.clear()
            self.clip_nothing()
            return per_sample_losses.detach().new_zeros(0)
        try:
            self.loss_sum(per_sample_losses, expected_batch_size).backward()
            return self._per_sample.clip_and_sum(self.max_grad_norm)
        finally:
            self._per_sample.clear()

    def clip_nothing(self) -> None:
        """A step without examples: zero sums (:meth:`PerSampleGradients.clip_nothing`)."""
        self._per_sample.clip_nothing()

    def take_clipped_sums(self) -> list[Tensor]:
        """The last :meth:`backward`'s clipped sums in float64 (:meth:`PerSampleGradients.take_clipped_sums`)."""
        return self._per_sample.take_clipped_sums()

    @staticmethod
    def check_loss_shape(per_sample_losses: Tensor) -> None:
        """Refuse anything but the per-sample losses (shape (batch,)) with the fix."""
        if per_sample_losses.dim() != 1:
            raise PrivacyConfigError(
                "ghost clipping needs the per-sample losses: return `F.cross_entropy(logits, y, reduction='none')` "
                f"(shape (batch,)) from training_step; got a loss of shape {tuple(per_sample_losses.shape)}"
            )

    def check_examples(self, backward: Callable[[Sequence[int]], Any], examples: int) -> str:
        """:meth:`PerSampleGradients.check_examples`; ``backward`` runs the backward pass of the per-sample
        losses' sum (:meth:`check_loss_shape` first)."""
        return self._per_sample.check_examples(backward, examples)

    def set_loss_scale(self, scale: float, drop_nonfinite: bool = True) -> None:
        """As :meth:`PerSampleGradients.set_loss_scale` (``scale``: what the per-sample losses were multiplied by)."""
        self._per_sample.set_loss_scale(scale, drop_nonfinite)

    def take_nonfinite_examples(self) -> int:
        return self._per_sample.take_nonfinite_examples()

    def detach(self) -> None:
        """Remove the hooks from the module."""
        self._per_sample.detach()
