"""Every privacy value a user passes, validated in one place: each check raises :class:`PrivacyConfigError` saying
what is wrong and how to fix it, and returns the value as the library uses it (a float, an int, a name).

The strategies validate their arguments once, when they are built (before any process starts); the accountants and
the calibrations check the values they are called with, through the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lightning_privdec.privacy.errors import PrivacyConfigError

__all__ = [
    "check_choice", "check_delta", "check_epsilon", "check_factor", "check_max_grad_norm",
    "check_noise_multiplier", "check_number", "check_positive", "check_sample_rate", "check_steps",
    "check_target_epsilon", "is_finite_number",
]


def is_finite_number(value: Any) -> bool:
    """A real number (not a bool), finite."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(float(value))


def check_number(value: Any, name: str) -> float:
    if not is_finite_number(value):
        raise PrivacyConfigError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_positive(value: Any, name: str, *, where: str = "", hint: str = "") -> float:
    """A finite number > 0 (``where`` prefixes the message, e.g. ``"CPGT: "``; ``hint`` ends it)."""
    if not is_finite_number(value) or value <= 0:
        raise PrivacyConfigError(f"{where}{name} must be a finite number > 0, got {value!r}{hint}")
    return float(value)


def check_epsilon(epsilon: Any, name: str = "epsilon") -> float:
    return check_positive(epsilon, name, hint=" (e.g. 0.5, 1 or 3)")


def check_delta(delta: Any, name: str = "delta") -> float:
    delta = check_number(delta, name)
    if not 0.0 < delta < 1.0:
        raise PrivacyConfigError(
            f"{name} must lie strictly between 0 and 1, got {delta!r}; a common choice is below 1/J for a shard "
            "of J examples (e.g. 1e-5)"
        )
    return delta


def check_sample_rate(sample_rate: Any) -> float:
    sample_rate = check_number(sample_rate, "sample_rate")
    if not 0.0 < sample_rate <= 1.0:
        raise PrivacyConfigError(
            f"sample_rate must lie in (0, 1], got {sample_rate!r}; it is q = B / J, the expected batch size over "
            "this node's shard size"
        )
    return sample_rate


def check_noise_multiplier(noise_multiplier: Any) -> float:
    if not is_finite_number(noise_multiplier) or noise_multiplier < 0:
        raise PrivacyConfigError(
            f"noise_multiplier must be a number >= 0, got {noise_multiplier!r}; it is sigma, the noise standard "
            "deviation in units of max_grad_norm (typically 0.5 to 2)"
        )
    return float(noise_multiplier)


#: the smallest clip bound C accepted: the absolute rounding of weighted output gradients below float32's normal range
#: (at most 2^-62 sqrt(d_out) T, per_sample.gram.HUGE_INPUT) then stays below 2^-36 sqrt(d_out) T of C
#: (docs/privacy.md, "The batch's sum")
MIN_MAX_GRAD_NORM = 2.0**-26


def check_max_grad_norm(max_grad_norm: Any) -> float:
    if not is_finite_number(max_grad_norm) or max_grad_norm <= 0:
        raise PrivacyConfigError(
            f"max_grad_norm must be a positive number, got {max_grad_norm!r}; it is the per-sample clipping bound C "
            "(DP-CSGP uses 1.5 for ResNet-18/CIFAR-10, 0.5 for an MLP on MNIST)"
        )
    if max_grad_norm < MIN_MAX_GRAD_NORM:
        raise PrivacyConfigError(
            f"max_grad_norm={max_grad_norm!r} is below 2^-26 (1.5e-8), the smallest clipping bound C whose "
            "float32 rounding the clipping bounds cover; scale the loss instead (C and the gradients scale together: "
            "DP-CSGP uses 1.5 for ResNet-18/CIFAR-10, 0.5 for an MLP on MNIST)"
        )
    return float(max_grad_norm)


def check_target_epsilon(target_epsilon: Any) -> float:
    if not is_finite_number(target_epsilon) or target_epsilon <= 0:
        raise PrivacyConfigError(
            f"target_epsilon must be a positive number, got {target_epsilon!r} (e.g. 1.0, 3.0 or 8.0)"
        )
    return float(target_epsilon)


def check_steps(steps: Any, *, minimum: int = 0) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < minimum:
        raise PrivacyConfigError(f"steps must be an integer >= {minimum}, got {steps!r}")
    return steps


def check_factor(value: Any, name: str, role: str) -> float:
    """A factor >= 1 by which a quantity changes over the whole run (Dyn-D2P's rho_c and rho_mu)."""
    value = check_number(value, name)
    if value < 1.0:
        raise PrivacyConfigError(
            f"{name} must be >= 1, got {value!r}: it is the {role} over the whole run (the paper uses "
            f"1/{name} in {{0.1, ..., 0.8}}, i.e. {name} between 1.25 and 10; 1 keeps it constant)"
        )
    return value


def check_choice(value: Any, choices: Sequence[Any], message: str) -> Any:
    """``value`` if it is one of ``choices``; else the error ``message`` (which names the choices and what they do)."""
    if value not in choices:
        raise PrivacyConfigError(message)
    return value
