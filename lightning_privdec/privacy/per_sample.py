"""Per-sample gradients for DP-SGD on a module Lightning already holds (Opacus's hooks, attached in place).

DP-SGD (Abadi et al. 2016, Algorithm 1) clips each example's gradient, so it needs gradients per example, not only
their sum. Opacus computes them with forward/backward hooks (``opacus.grad_sample``); here they are attached to the
existing module object, so Lightning, the optimizer and the strategy keep holding the same module and parameters,
and the LightningModule's own ``training_step`` (``self(x)``) fills ``param.grad_sample``.

The default mode, ``"bookkeeping"`` (Bu, Wang, Zha, Karypis 2023, "book-keeping" ghost clipping), keeps what those
hooks capture (every layer's input ``a_i`` and output gradient ``g_i``) and computes nothing more during the
backward pass. Once the pass is over it gets each example's gradient norm without materialising the gradient
(for a linear layer ||g_i a_i^T||^2 = ||g_i||^2 ||a_i||^2; Goodfellow 2015, Li et al. 2022) and then the sum of
CLIPPED gradients in one matrix product per layer, sum_i c_i g_i a_i^T = (c * G)^T A. The result is the same sum of
clipped per-sample gradients as ``"hooks"`` (same flat clipping, same mean-loss convention, any training_step), with
one backward pass and no (B, *p.shape) tensors; layers without such a formula fall back to Opacus's per-sample
gradients for that layer only.

Layers that mix examples within a batch (BatchNorm) or that Opacus cannot differentiate per example are rejected
before training by :func:`check_private_model`, which can also replace them in place.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from opacus.grad_sample import GradSampleHooks, GradSampleHooksFastGradientClipping
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient
from opacus.grad_sample.utils import prepare_module
from opacus.utils.module_utils import has_trainable_params, trainable_modules, trainable_parameters
from opacus.validators import ModuleValidator
from torch import Tensor, nn

from lightning_privdec.privacy.dp_step import clip_and_accumulate, clip_factor
from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = [
    "DEFAULT_GRAD_SAMPLE_MODE",
    "GRAD_SAMPLE_MODES",
    "GhostClipping",
    "PerSampleGradients",
    "check_private_model",
]

GradSampleMode = Literal["bookkeeping", "hooks", "functorch", "ghost"]
GRAD_SAMPLE_MODES: tuple[str, ...] = ("bookkeeping", "hooks", "functorch", "ghost")
#: the fastest mode that keeps DP-SGD's semantics for every model (see benchmarks/step_time.py --modes-only)
DEFAULT_GRAD_SAMPLE_MODE = "bookkeeping"
_PER_SAMPLE_MODES = ("bookkeeping", "hooks", "functorch")  # modes of PerSampleGradients (ghost: GhostClipping)
_GRAD_ACCUMULATION_ERROR = (
    "Poisson sampling is not compatible with grad accumulation: a second backward pass before clear(). Take one "
    "optimizer step per sampled batch."
)

#: normalisations that mix the examples of a batch even without trainable parameters
_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)

_FIX_HINT = (
    "Fix: call check_private_model(model, fix=True) (or pass fix_model=True to the strategy), which replaces them "
    "in place (BatchNorm -> GroupNorm, nn.LSTM -> opacus.layers.DPLSTM, ...); or use "
    "opacus.validators.ModuleValidator.fix(model), which returns a fixed copy, before building the Trainer."
)


@dataclass(frozen=True)
class _Offence:
    name: str
    module: nn.Module
    reason: str
    fixable: bool

    def describe(self) -> str:
        how = "fixable" if self.fixable else "no automatic fix: replace it by hand"
        return f"  - {self.name or '<root>'} ({type(self.module).__name__}): {self.reason} [{how}]"


def _first_sentence(error: Exception) -> str:
    text = str(error).strip()
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _offences(module: nn.Module) -> list[_Offence]:
    """Layers incompatible with per-sample DP, by Opacus's ``ModuleValidator`` registry plus its buffer rule."""
    found: dict[int, _Offence] = {}
    for name, sub in module.named_modules():
        validator = ModuleValidator.VALIDATORS.get(type(sub))
        # Opacus validates trainable layers only; a BatchNorm without affine parameters mixes examples just the same
        if validator is not None and (has_trainable_params(sub) or isinstance(sub, _BATCH_NORMS)):
            errors = validator(sub)
            if errors:
                found[id(sub)] = _Offence(
                    name, sub, _first_sentence(errors[0]), fixable=type(sub) in ModuleValidator.FIXERS
                )
    for name, sub in trainable_modules(module):  # opacus.GradSampleModule's strict rule
        if id(sub) not in found and any(True for _ in sub.buffers()):
            buffers = ", ".join(n for n, _ in sub.named_buffers())
            if not any(id(m) in found for m in sub.modules()):
                found[id(sub)] = _Offence(
                    name,
                    sub,
                    f"a trainable layer with buffers ({buffers}), which Opacus cannot privatize",
                    fixable=False,
                )
    return list(found.values())


def _replace_in_place(root: nn.Module, old: nn.Module, new: nn.Module) -> list[str]:
    """Point every parent reference to ``old`` (shared submodules included) at ``new``; return the names."""
    names = []
    for parent_name, parent in root.named_modules(remove_duplicate=False):
        for child_name, child in list(parent.named_children()):
            if child is old:
                setattr(parent, child_name, new)
                names.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    return names


def _drop_disabled_running_stats(module: nn.Module) -> None:
    """Opacus's InstanceNorm fixer turns ``track_running_stats`` off but keeps the buffers, which its own
    ``GradSampleModule(strict=True)`` then rejects; unregister them as PyTorch does for such layers."""
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and not module.track_running_stats:
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            if module._buffers.get(name) is not None:
                module.register_buffer(name, None)


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    reference = next(iter(old.parameters()), None)
    if reference is None:
        reference = next(iter(old.buffers()), None)
    if reference is not None:
        new.to(device=reference.device)
        if reference.is_floating_point():
            new.to(dtype=reference.dtype)
    new.train(old.training)
    _drop_disabled_running_stats(new)
    return new


def _short(module: nn.Module) -> str:
    return f"{type(module).__name__}({module.extra_repr()})"


def check_private_model(module: nn.Module, fix: bool = False) -> nn.Module:
    """Check that per-sample DP-SGD (Abadi et al. 2016) is well defined for ``module``; optionally fix it IN PLACE.

    Uses Opacus's ``ModuleValidator`` validators (BatchNorm, InstanceNorm with running stats, nn.LSTM/GRU/
    MultiheadAttention, ...) plus Opacus's rule that trainable layers may not hold buffers. With ``fix=True`` each
    fixable layer is replaced by ``ModuleValidator.FIXERS`` (BatchNorm -> GroupNorm, as ``ModuleValidator.fix``)
    through ``setattr`` on its parents, so ``module`` stays the same object (Lightning holds it) and the function
    returns it; a warning lists the replacements. Call it before the optimizer is created: replaced layers have new
    (freshly initialised) parameters.

    Raises:
        PrivacyConfigError: naming the offending layers and the fix, when ``fix=False`` and layers are
            incompatible, or when some cannot be fixed automatically.
    """
    offences = _offences(module)
    if not offences:
        return module
    if not fix:
        raise PrivacyConfigError(
            "the model has layers incompatible with per-sample differential privacy:\n"
            + "\n".join(o.describe() for o in offences)
            + "\n"
            + _FIX_HINT
        )
    unfixable = [o for o in offences if not o.fixable or o.module is module]
    if unfixable:
        raise PrivacyConfigError(
            "these layers are incompatible with per-sample differential privacy and cannot be fixed in place:\n"
            + "\n".join(o.describe() for o in unfixable)
            + "\nReplace them by hand (e.g. BatchNorm -> GroupNorm or LayerNorm; a root-level BatchNorm must be "
            "wrapped in a parent module first)."
        )
    replaced = []
    for offence in offences:
        new = _like(ModuleValidator.FIXERS[type(offence.module)](offence.module), offence.module)
        for name in _replace_in_place(module, offence.module, new):
            replaced.append(f"{name}: {_short(offence.module)} -> {_short(new)}")
    warnings.warn(
        "check_private_model(fix=True) replaced layers incompatible with per-sample differential privacy, in "
        "place: " + "; ".join(replaced) + ". The new layers have freshly initialised parameters; create the "
        "optimizer after this call.",
        UserWarning,
        stacklevel=2,
    )
    remaining = _offences(module)
    if remaining:
        raise PrivacyConfigError(
            "after replacing the fixable layers, these remain incompatible with per-sample differential privacy:\n"
            + "\n".join(o.describe() for o in remaining)
        )
    return module


@dataclass
class _Record:
    """What one backward hook call saw: the layer, its inputs a and its output gradients g (batch first; for a mean
    loss already multiplied by B, so that they are per-example loss gradients), and the backward pass it belongs to."""

    module: nn.Module
    activations: list[Tensor]
    backprops: Tensor
    batch_size: int
    backward_pass: int


def _ghost_linear(record: _Record) -> bool:
    """Whether ``record`` gets book-keeping's closed forms: an nn.Linear on (B, d) inputs, or on (B, T, d) inputs
    when the T x T Gram matrices are smaller than a per-sample weight gradient (Li et al. 2022, Sec. 4)."""
    if type(record.module) is not nn.Linear or record.backprops.dim() not in (2, 3):
        return False
    if record.backprops.dim() == 2:
        return True
    steps = record.backprops.shape[1]
    return 2 * steps * steps <= record.module.in_features * record.module.out_features


class _BookKeepingHooks(GradSampleHooks):
    """Opacus's hooks whose backward hook only records (layer, a, g); see :meth:`clip_and_sum`.

    Forward hooks, validation, functorch preparation of layers without a per-sample rule and the mean-loss rescaling
    of g are Opacus's own (``GradSampleHooks``).
    """

    def __init__(self, module: nn.Module, *, batch_first: bool, loss_reduction: str, strict: bool) -> None:
        self.records: list[_Record] = []
        self._finished: set[int] = set()  # ids of parameters whose current backward pass is complete
        self._pass = 0
        super().__init__(module, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict)

    def capture_backprops_hook(  # type: ignore[override]
        self, module: nn.Module, _forward_input: Tensor, forward_output: Tensor, loss_reduction: str, batch_first: bool
    ) -> None:
        if not self.hooks_enabled:
            return
        params = [p for _, p in trainable_parameters(module)]
        if any(id(p) in self._finished for p in params):  # a parameter is back for more: a new backward pass
            if not self.grad_accumulation_allowed:
                raise ValueError(_GRAD_ACCUMULATION_ERROR)
            self._pass += 1
            self._finished.clear()
        activations, backprops = self.rearrange_grad_samples(
            module=module, backprops=forward_output[0].detach(), loss_reduction=loss_reduction, batch_first=batch_first
        )
        self.records.append(_Record(module, activations, backprops, int(module.max_batch_len), self._pass))
        for p in params:
            p._forward_counter -= 1
            if p._forward_counter == 0:
                self._finished.add(id(p))
        if len(module.activations) == 0 and hasattr(module, "max_batch_len"):
            del module.max_batch_len

    def forget(self) -> None:
        self.records = []
        self._finished.clear()
        self._pass = 0

    # ---- after the backward pass ---------------------------------------------------------------------------------
    def _grad_samples(self, records: list[_Record]) -> dict[nn.Parameter, Tensor]:
        """Per-sample gradients of the parameters the records touch (Opacus's per-layer rules, else functorch),
        summed over a parameter's uses (tied weights, recurrent layers)."""
        out: dict[nn.Parameter, Tensor] = {}
        batch = max((r.batch_size for r in records), default=0)
        for r in records:
            sampler = self.GRAD_SAMPLERS.get(type(r.module), ft_compute_per_sample_gradient)
            for p, gs in sampler(r.module, r.activations, r.backprops).items():
                if not p.requires_grad:
                    continue
                if gs.shape[0] < batch:  # a shorter call (packed sequences): zero rows for the rest
                    gs = torch.cat([gs, gs.new_zeros((batch - gs.shape[0], *gs.shape[1:]))])
                out[p] = gs if p not in out else out[p] + gs  # usually one use per parameter: no copy
        return out

    def per_sample_grads(self, params: list[nn.Parameter]) -> list[Tensor]:
        """Materialised per-sample gradients (backward passes concatenated), for callers that need them."""
        passes = self._passes()
        out: list[list[Tensor]] = [[] for _ in params]
        for records in passes:
            samples, batch = self._grad_samples(records), max(r.batch_size for r in records)
            for k, p in enumerate(params):
                gs = samples.get(p)
                out[k].append(gs if gs is not None else torch.zeros((batch, *p.shape), dtype=p.dtype, device=p.device))
        return [
            torch.cat(gs) if gs else torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            for p, gs in zip(params, out)
        ]

    def batch_size(self) -> int:
        """Examples of the recorded backward passes together (the rows of :meth:`per_sample_grads`)."""
        return sum(max(r.batch_size for r in records) for records in self._passes())

    def _passes(self) -> list[list[_Record]]:
        passes = [[r for r in self.records if r.backward_pass == k] for k in range(self._pass + 1)]
        return [records for records in passes if records]

    def per_sample_grads_into(self, params: list[nn.Parameter], out: Tensor) -> Tensor:
        """:meth:`per_sample_grads` flattened into ``out`` of shape ``(batch_size(), d)``, parameters in order. An
        nn.Linear on (B, d) inputs used once writes its outer products g_i a_i^T straight into ``out``; other layers
        go through their per-sample rule and are copied."""
        spans, offset = {}, 0
        for p in params:
            spans[p] = (offset, p.numel())
            offset += p.numel()
        if out.dim() != 2 or out.shape[1] != offset:
            raise RuntimeError(f"per-sample gradients of {offset} parameters do not fit a buffer of shape {tuple(out.shape)}")

        def columns(block: Tensor, p: nn.Parameter) -> Tensor:
            start, size = spans[p]
            return block[:, start : start + size]

        row = 0
        for records in self._passes():
            batch = max(r.batch_size for r in records)
            block = out[row : row + batch]
            row += batch
            uses = _uses(records)
            direct = [
                r for r in records
                if type(r.module) is nn.Linear and r.backprops.dim() == 2 and r.backprops.shape[0] == batch
                and all(uses[id(p)] == 1 for _, p in trainable_parameters(r.module))
            ]
            direct_ids = {id(r) for r in direct}
            written: set[int] = set()
            for r in direct:
                g, a = r.backprops, r.activations[0].to(r.backprops.dtype)
                weight, bias = r.module.weight, r.module.bias
                if weight.requires_grad and weight in spans:
                    torch.mul(g.unsqueeze(2), a.unsqueeze(1), out=columns(block, weight).view(batch, *weight.shape))
                    written.add(id(weight))
                if bias is not None and bias.requires_grad and bias in spans:
                    columns(block, bias).copy_(g)
                    written.add(id(bias))
            for p, gs in self._grad_samples([r for r in records if id(r) not in direct_ids]).items():
                if p in spans:  # a layer that saw fewer rows (packed sequences, a masked sub-batch): zeros after them
                    rows, target = min(int(gs.shape[0]), batch), columns(block, p)
                    target[:rows].copy_(gs.reshape(gs.shape[0], p.numel())[:rows])
                    target[rows:].zero_()
                    written.add(id(p))
            for p in params:
                if id(p) not in written:
                    columns(block, p).zero_()  # no example reached this parameter
        if row != out.shape[0]:
            raise RuntimeError(f"{row} per-sample gradients for a buffer of {out.shape[0]} rows")
        return out

    def clip_and_sum(self, params: list[nn.Parameter], max_grad_norm: float) -> Tensor:
        """p.grad <- sum_i min(1, C / (||g_i|| + 1e-6)) g_i for every parameter, with ||g_i|| the norm over ALL
        parameters jointly; returns the norms (float32 or wider), one per example of every backward pass."""
        sums: dict[nn.Parameter, Tensor] = {}
        all_norms = []
        for records in self._passes():
            all_norms.append(self._clip_and_sum_pass(records, max_grad_norm, sums))
        for p in params:
            summed = sums.get(p)
            if summed is None:
                summed = torch.zeros_like(p)  # no example reached this parameter
            if p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype:
                p.grad.copy_(summed)
            else:
                p.grad = summed
        if not all_norms:
            return torch.zeros(0, device=params[0].device)
        return torch.cat(all_norms)

    def _clip_and_sum_pass(self, records: list[_Record], max_grad_norm: float, sums: dict[nn.Parameter, Tensor]) -> Tensor:
        uses = _uses(records)
        ghost = [
            r for r in records if _ghost_linear(r) and all(uses[id(p)] == 1 for _, p in trainable_parameters(r.module))
        ]
        ghost_ids = {id(r) for r in ghost}
        materialised = self._grad_samples([r for r in records if id(r) not in ghost_ids])
        batch = max(r.batch_size for r in records)
        dtype = torch.promote_types(records[0].backprops.dtype, torch.float32)
        squared = torch.zeros(batch, dtype=dtype, device=records[0].backprops.device)
        for r in ghost:  # ||g_i a_i^T||^2 and ||sum_t g_it||^2 from a and g alone
            g, a = r.backprops, r.activations[0].to(r.backprops.dtype)
            rows = slice(0, g.shape[0])
            if g.dim() == 2:
                g2 = torch.linalg.vector_norm(g, dim=1, dtype=dtype).square()
                if r.module.weight.requires_grad:
                    squared[rows] += g2 * torch.linalg.vector_norm(a, dim=1, dtype=dtype).square()
                if r.module.bias is not None and r.module.bias.requires_grad:
                    squared[rows] += g2
            else:
                if r.module.weight.requires_grad:
                    squared[rows] += (torch.bmm(g, g.transpose(1, 2)) * torch.bmm(a, a.transpose(1, 2))).sum(
                        dim=(1, 2), dtype=dtype
                    )
                if r.module.bias is not None and r.module.bias.requires_grad:
                    squared[rows] += torch.linalg.vector_norm(g.sum(dim=1), dim=1, dtype=dtype).square()
        for gs in materialised.values():
            squared[: gs.shape[0]] += torch.linalg.vector_norm(gs.flatten(1), dim=1, dtype=dtype).square()
        norms = squared.sqrt()
        factor = clip_factor(norms, max_grad_norm)
        for r in ghost:  # sum_i c_i g_i a_i^T = (c * G)^T A: one matrix product per layer
            g, a = r.backprops, r.activations[0].to(r.backprops.dtype)
            c = factor[: g.shape[0]].to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
            weighted = (g * c).reshape(-1, g.shape[-1])
            if r.module.weight.requires_grad:
                _accumulate(sums, r.module.weight, weighted.t() @ a.reshape(-1, a.shape[-1]))
            if r.module.bias is not None and r.module.bias.requires_grad:
                _accumulate(sums, r.module.bias, weighted.sum(dim=0))
        for p, gs in materialised.items():
            _accumulate(sums, p, torch.einsum("i,i...->...", factor[: gs.shape[0]].to(gs.dtype), gs))
        return norms


def _uses(records: list[_Record]) -> dict[int, int]:
    """How many of ``records`` touch each trainable parameter (by id): more than one for tied or recurrent weights."""
    uses: dict[int, int] = {}
    for r in records:
        for _, p in trainable_parameters(r.module):
            uses[id(p)] = uses.get(id(p), 0) + 1
    return uses


def _accumulate(sums: dict[nn.Parameter, Tensor], p: nn.Parameter, value: Tensor) -> None:
    value = value.to(p.dtype).view_as(p)
    sums[p] = value if p not in sums else sums[p] + value


class PerSampleGradients:
    """Opacus's per-sample gradient hooks attached to ``module`` in place (the module object is not replaced).

    Uses ``opacus.grad_sample.prepare_module(module, mode, wrap_model=False)``, i.e. ``opacus.GradSampleModule``'s
    hooks without the wrapper: after a forward and backward pass of ``module`` (or of any code calling it, such as
    a LightningModule's ``training_step`` calling ``self(x)``) in training mode, every trainable parameter holds
    ``p.grad_sample`` of shape ``(B, *p.shape)``.

    Args:
        module: the model; validated with :func:`check_private_model` when ``strict``.
        mode: ``"hooks"`` (Opacus's per-layer formulas; functorch for layers without one), ``"functorch"``
            (``force_functorch=True``: vmap/grad for every layer), or ``"bookkeeping"``: the hooks only record
            every layer's inputs and output gradients, :meth:`clip_and_sum` then clips without materialising
            per-sample gradients (see the module docstring), and :meth:`per_sample_grads` materialises them on
            demand; ``p.grad_sample`` is not set. Ghost clipping with per-sample losses is :class:`GhostClipping`.
        loss_reduction: how the loss reduces over the batch, ``"mean"`` (Lightning's usual mean loss) or ``"sum"``;
            Opacus rescales backprops by B for ``"mean"`` so the results are true per-example gradients.
        batch_first: whether inputs have the batch in dimension 0.
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
        if hasattr(module, "autograd_grad_sample_hooks"):
            raise PrivacyConfigError(
                f"{type(module).__name__} already has Opacus per-sample hooks attached; call detach() on the "
                "existing PerSampleGradients (or remove the other hooks) first"
            )
        if not any(p.requires_grad for p in module.parameters()):
            raise PrivacyConfigError("the model has no trainable parameters: there is nothing to privatize")
        self.module = module
        self.mode = mode
        self.loss_reduction = loss_reduction
        self._bookkeeping: _BookKeepingHooks | None = None
        if mode == "bookkeeping":
            self._hooks = self._bookkeeping = _BookKeepingHooks(
                module, batch_first=batch_first, loss_reduction=loss_reduction, strict=strict
            )
        else:
            self._hooks = prepare_module(
                module,
                grad_sample_mode=mode,
                wrap_model=False,
                batch_first=batch_first,
                loss_reduction=loss_reduction,
                strict=strict,
            )
        if not allow_grad_accumulation:
            self._hooks.forbid_grad_accumulation()
        self._attached = True

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
        releases pure noise.
        """
        params = self.parameters
        if self._bookkeeping is not None:
            return self._bookkeeping.per_sample_grads(params)
        samples: list[Tensor | None] = []
        for p in params:
            gs = getattr(p, "grad_sample", None)
            if isinstance(gs, (list, tuple)):
                gs = torch.cat(list(gs), dim=0) if gs else None
            samples.append(gs)
        sizes = {int(g.shape[0]) for g in samples if g is not None}
        if len(sizes) > 1:
            raise RuntimeError(
                f"per-sample gradients of different batch sizes {sorted(sizes)}: some parameters kept samples from "
                "an earlier step. Call clear() after every optimizer step."
            )
        batch_size = sizes.pop() if sizes else 0
        return [
            g if g is not None else torch.zeros((batch_size, *p.shape), dtype=p.dtype, device=p.device)
            for p, g in zip(params, samples)
        ]

    @property
    def batch_size(self) -> int:
        """The number of per-sample gradients the last backward pass(es) recorded (0 when none)."""
        if self._bookkeeping is not None:
            return self._bookkeeping.batch_size()
        return int(self.per_sample_grads()[0].shape[0])

    def flat_per_sample_grads(self, out: Tensor | None = None) -> Tensor:
        """The per-sample gradients as one ``(B, d)`` matrix, parameters concatenated in order, written into ``out``
        (shape ``(batch_size, d)``) when given: book-keeping then allocates no B x d temporary for nn.Linear layers."""
        params = self.parameters
        if out is None:
            out = torch.empty(self.batch_size, sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        if self._bookkeeping is not None:
            return self._bookkeeping.per_sample_grads_into(params, out)
        grads = self.per_sample_grads()
        return torch.cat([g.reshape(g.shape[0], p.numel()) for p, g in zip(params, grads)], dim=1, out=out)

    def clip_and_sum(self, max_grad_norm: float) -> Tensor:
        """``p.grad <- sum_i min(1, C / (||g_i|| + 1e-6)) g_i`` (flat clipping: ||g_i|| over ALL parameters jointly,
        as in :func:`~lightning_privdec.privacy.dp_step.privatize_gradients`); returns the norms ``||g_i||``.

        Book-keeping never materialises the g_i (module docstring); the other modes clip their stored per-sample
        gradients. An empty batch, or a step without backward, leaves zeros.
        """
        params = self.parameters
        if self._bookkeeping is not None:
            return self._bookkeeping.clip_and_sum(params, max_grad_norm)
        sums, norms = clip_and_accumulate(self.per_sample_grads(), max_grad_norm, params[0].device)
        for p, summed in zip(params, sums):
            summed = summed.to(device=p.device, dtype=p.dtype)
            if p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype:
                p.grad.copy_(summed)
            else:
                p.grad = summed
        return norms

    def clear(self) -> None:
        """Forget the stored per-sample gradients and activations (call after every optimizer step)."""
        if self._bookkeeping is not None:
            self._bookkeeping.forget()
        for p in self.module.parameters():
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
            if hasattr(p, "_current_grad_sample"):
                del p._current_grad_sample
            if p.requires_grad:
                p._forward_counter = 0
        for m in self.module.modules():
            if hasattr(m, "activations"):
                del m.activations
            if hasattr(m, "max_batch_len"):
                del m.max_batch_len

    def detach(self) -> None:
        """Remove the hooks and every attribute Opacus added; the module is as before. Idempotent."""
        if not self._attached:
            return
        self.clear()
        self._hooks.cleanup()
        self._attached = False

    def __enter__(self) -> PerSampleGradients:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return f"PerSampleGradients({type(self.module).__name__}, mode={self.mode!r}, attached={self._attached})"


class GhostClipping:
    """Ghost clipping (Li et al. 2022; Bu et al. 2023) through Opacus's hooks, attached to ``module`` in place.

    Per-sample gradients are never materialised: a first backward pass of the summed per-sample losses lets Opacus's
    hooks compute every example's gradient norm (for linear layers from activations and backprops alone), then a
    second backward pass of sum_i min(1, C / ||g_i||) * loss_i leaves the sum of CLIPPED per-sample gradients in
    ``p.grad``. Memory stays at one gradient per parameter instead of B. It needs the per-sample losses, so
    ``training_step`` must return ``loss`` with ``reduction="none"`` (shape ``(B,)``).
    """

    def __init__(self, module: nn.Module, max_grad_norm: float) -> None:
        check_private_model(module)
        self.module = module
        self.max_grad_norm = float(max_grad_norm)
        self._hooks = GradSampleHooksFastGradientClipping(
            module, loss_reduction="sum", max_grad_norm=self.max_grad_norm, use_ghost_clipping=True
        )

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The trainable parameters, in ``module.parameters()`` order."""
        return [p for p in self.module.parameters() if p.requires_grad]

    def backward(self, per_sample_losses: Tensor) -> Tensor:
        """Leave sum_i clip(g_i) in every ``p.grad``; return the unclipped per-sample gradient norms."""
        if per_sample_losses.dim() != 1:
            self._forget_forward()
            raise PrivacyConfigError(
                "ghost clipping needs the per-sample losses: return `F.cross_entropy(logits, y, reduction='none')` "
                f"(shape (batch,)) from training_step; got a loss of shape {tuple(per_sample_losses.shape)}"
            )
        params = self.parameters
        if per_sample_losses.numel() == 0:  # an empty Poisson batch: nothing to clip, the step is pure noise
            self._forget_forward()
            for p in params:
                p.grad = torch.zeros_like(p)
            return per_sample_losses.detach().new_zeros(0)
        per_sample_losses.sum().backward(retain_graph=True)  # hooks record the per-sample norms
        norms = self._hooks.get_norm_sample().detach()
        coefficients = clip_factor(norms, self.max_grad_norm)
        for p in params:
            p.grad = None
        self._hooks.disable_hooks()
        try:
            (coefficients.to(per_sample_losses.dtype) * per_sample_losses).sum().backward()
        finally:
            self._hooks.enable_hooks()
        return norms

    def _forget_forward(self) -> None:
        """Drop what the hooks captured in a forward pass that gets no ghost backward (else the next forward
        looks like parameter tying to Opacus)."""
        for module in self.module.modules():
            if hasattr(module, "activations"):
                module.activations = []
        for p in self.parameters:
            p._forward_counter = 0  # type: ignore[attr-defined]

    def detach(self) -> None:
        """Remove the hooks from the module."""
        self._hooks.cleanup()
