"""Which models per-sample DP-SGD is defined for, and the in-place fix for those it is not (BatchNorm)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from opacus.utils.module_utils import has_trainable_params, trainable_modules
from opacus.validators import ModuleValidator
from torch import nn

from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.per_sample.capture import REPLAYED, rule_for

#: normalisations that mix the examples of a batch even without trainable parameters
_BATCH_NORMS = (nn.modules.batchnorm._BatchNorm,)
#: layers Opacus's validators refuse that per-layer replay trains unchanged
_SUPPORTED_AS_IS = (nn.RNNBase, nn.MultiheadAttention)

_FIX_HINT = (
    "Fix: call check_private_model(model, fix=True) (or pass fix_model=True to the strategy), which replaces them "
    "in place (BatchNorm -> GroupNorm, InstanceNorm keeps no running statistics); or use "
    "opacus.validators.ModuleValidator.fix(model), which returns a fixed copy, before building the Trainer."
)


_BY_HAND = "Fix: replace them by hand before building the Trainer (fix_model=True cannot replace them)."


@dataclass(frozen=True)
class _Offence:
    name: str
    module: nn.Module
    reason: str
    fixable: bool

    def describe(self) -> str:
        how = "fixable" if self.fixable else "no automatic fix: replace it by hand"
        return f"  - {self.name or '<root>'} ({type(self.module).__name__}): {self.reason} [{how}]"


#: layers named for each kind of offence; the rest are counted
_NAMED = 3


def _listed(offences: list[_Offence]) -> str:
    """The offences, one line each for the first :data:`_NAMED` of a kind (layer type and reason), then a count."""
    kinds: dict[tuple[str, str, bool], list[_Offence]] = {}
    for offence in offences:
        kinds.setdefault((type(offence.module).__name__, offence.reason, offence.fixable), []).append(offence)
    lines = []
    for (kind, _, _), alike in kinds.items():
        lines += [o.describe() for o in alike[:_NAMED]]
        if len(alike) > _NAMED:
            lines.append(f"  - and {len(alike) - _NAMED} more {kind} layers alike ({len(alike)} in all)")
    return "\n".join(lines)


def _first_sentence(error: Exception) -> str:
    text = str(error).strip()
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def _offences(module: nn.Module) -> list[_Offence]:
    """Layers incompatible with per-sample DP, by Opacus's ``ModuleValidator`` registry plus its buffer rule."""
    found: dict[int, _Offence] = {}
    for name, sub in module.named_modules():
        # recurrent layers and attention train as they are (per-layer replay, see capture.py): not offences
        validator = None if isinstance(sub, _SUPPORTED_AS_IS) else ModuleValidator.VALIDATORS.get(type(sub))
        # Opacus validates trainable layers only; a BatchNorm without affine parameters mixes examples just the same
        if validator is not None and (has_trainable_params(sub) or isinstance(sub, _BATCH_NORMS)):
            errors = validator(sub)
            if errors:
                found[id(sub)] = _Offence(
                    name, sub, _first_sentence(errors[0]), fixable=type(sub) in ModuleValidator.FIXERS
                )
    for name, sub in trainable_modules(module):  # opacus.GradSampleModule's strict rule
        if rule_for(sub) is None and not isinstance(sub, REPLAYED):
            continue  # a layer's own parameters (capture.py, "shared"): a buffer it updates is refused at run time
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

    Uses Opacus's ``ModuleValidator`` validators (BatchNorm, InstanceNorm with running stats; not nn.LSTM/GRU/
    MultiheadAttention, which train unchanged through per-layer replay) plus Opacus's rule that trainable layers
    may not hold buffers. With ``fix=True`` each fixable layer is replaced by ``ModuleValidator.FIXERS``
    (BatchNorm -> GroupNorm, as ``ModuleValidator.fix``) through ``setattr`` on its parents, so ``module`` stays
    the same object (Lightning holds it) and the function returns it; a warning lists the replacements. Call it before the optimizer is created: replaced layers have new
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
            + _listed(offences)
            + "\n"
            + (_FIX_HINT if any(o.fixable for o in offences) else _BY_HAND)
        )
    unfixable = [o for o in offences if not o.fixable or o.module is module]
    if unfixable:
        raise PrivacyConfigError(
            "these layers are incompatible with per-sample differential privacy and cannot be fixed in place:\n"
            + _listed(unfixable)
            + "\nReplace them by hand (e.g. BatchNorm -> GroupNorm or LayerNorm; a root-level BatchNorm must be "
            "wrapped in a parent module first)."
        )
    replaced = []
    for offence in offences:
        new = _like(ModuleValidator.FIXERS[type(offence.module)](offence.module), offence.module)
        for name in _replace_in_place(module, offence.module, new):
            replaced.append(f"{name}: {_short(offence.module)} -> {_short(new)}")
    more = f" and {len(replaced) - _NAMED} more" if len(replaced) > _NAMED else ""
    warnings.warn(
        "check_private_model(fix=True) replaced layers incompatible with per-sample differential privacy, in "
        "place: " + "; ".join(replaced[:_NAMED]) + more + ". The new layers have freshly initialised parameters; "
        "create the optimizer after this call.",
        UserWarning,
        stacklevel=2,
    )
    remaining = _offences(module)
    if remaining:
        raise PrivacyConfigError(
            "after replacing the fixable layers, these remain incompatible with per-sample differential privacy:\n"
            + _listed(remaining)
        )
    return module


