"""The user-facing DP-SGD parameters (``max_grad_norm=``, ``noise_multiplier=``, ``target_epsilon=``, ...)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

from lightning_privdec.privacy.accounting.gaussian import (
    calibrate_noise_multiplier,
    check_accountant,
)
from lightning_privdec.privacy.errors import PrivacyConfigError
from lightning_privdec.privacy.validation import (
    check_delta,
    check_max_grad_norm,
    check_noise_multiplier,
    check_sample_rate,
    check_steps,
    check_target_epsilon,
)

__all__ = ["DEFAULT_DELTA", "PrivacyParameters"]

#: delta used to *report* epsilon when only a noise multiplier is given (see PrivacyParameters.delta_for_reporting)
DEFAULT_DELTA = 1e-5


@dataclass
class PrivacyParameters:
    """Per-node DP-SGD parameters: clip each per-sample gradient to ``max_grad_norm`` (C), add N(0, sigma^2 C^2 I).

    Give ``noise_multiplier`` (sigma), or a budget ``target_epsilon`` + ``target_delta`` from which sigma is
    calibrated for the run's sampling rate and number of steps (Abadi et al. 2016, Sec. 3.1; accounting by the
    named Opacus accountant). The guarantee is per node, for one example of that node's shard.

    Args:
        max_grad_norm: the clipping bound C (> 0).
        noise_multiplier: sigma (>= 0; 0 means no privacy, epsilon = inf). With ``target_epsilon`` too, sigma is
            used as given and the budget only caps training (PrivacyBudgetCallback stops before it is exceeded).
        target_epsilon: the per-node budget epsilon (> 0); needs ``target_delta``. Alone, sigma is calibrated so
            that the planned steps spend exactly this budget.
        target_delta: the budget's delta in (0, 1); with ``noise_multiplier`` it is only the delta at which epsilon is
            reported.
        accountant: ``"rdp"`` (default) or ``"prv"``; ``"gdp"`` (an approximation) is refused.
    """

    max_grad_norm: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    target_delta: float | None = None
    accountant: str = "rdp"

    DEFAULT_DELTA: ClassVar[float] = DEFAULT_DELTA

    def validate(self, *, level_required: bool = True) -> PrivacyParameters:
        """Check the parameters; raise :class:`PrivacyConfigError` saying what is wrong and how to fix it.

        ``level_required=False``: a paper whose noise is set in its own options (CPGT's Laplace scales, Decor's
        noise pair) needs neither a noise multiplier nor a budget here."""
        check_max_grad_norm(self.max_grad_norm)
        check_accountant(self.accountant)  # "gdp" is refused: an approximation never decides sigma or when to stop
        has_sigma = self.noise_multiplier is not None
        has_eps = self.target_epsilon is not None
        if level_required and not has_sigma and not has_eps:
            raise PrivacyConfigError(
                "no privacy level given: pass noise_multiplier=..., or target_epsilon=... and target_delta=... "
                "(e.g. target_epsilon=3.0, target_delta=1e-5)"
            )
        if self.target_delta is not None:
            check_delta(self.target_delta, "target_delta")
        if has_eps:
            check_target_epsilon(self.target_epsilon)
            if self.target_delta is None:
                raise PrivacyConfigError(
                    f"target_epsilon={self.target_epsilon!r} needs target_delta: pass target_delta=... "
                    "(below 1/J for a shard of J examples, e.g. 1e-5)"
                )
        if has_sigma:
            check_noise_multiplier(self.noise_multiplier)
            if self.noise_multiplier == 0:
                warnings.warn(
                    "noise_multiplier=0 adds no noise: training clips gradients but is NOT differentially private "
                    "(epsilon = inf)",
                    UserWarning,
                    stacklevel=2,
                )
        return self

    @property
    def delta_for_reporting(self) -> float:
        """``target_delta`` if given, else :data:`DEFAULT_DELTA` (1e-5).

        With only a noise multiplier there is no budget delta; epsilon is still reported, at 1e-5, the usual choice
        for datasets of up to ~10^5 examples. Pass ``target_delta`` (below 1/J for a shard of J examples) to report
        at another delta.
        """
        return float(self.target_delta) if self.target_delta is not None else DEFAULT_DELTA

    def check_delta(self, shard_size: int, rank: int = 0) -> None:
        """Refuse ``target_delta >= 1/J`` for a shard of J examples; warn if the default reporting delta is.

        (epsilon, delta)-DP with delta >= 1/J allows releasing one whole example of the shard outright (the
        "name and shame" mechanism), so such a guarantee protects nobody.
        """
        if shard_size <= 0:
            return
        if self.target_delta is not None and float(self.target_delta) >= 1.0 / shard_size:
            raise PrivacyConfigError(
                f"target_delta={self.target_delta} is not below 1/J = {1.0 / shard_size:.3g} for node {rank}'s shard "
                f"of J={shard_size} examples: with delta >= 1/J a mechanism may publish one example outright. Use "
                f"target_delta <= {0.1 / shard_size:.1g} (a common choice is below 1/(10 J))"
            )
        if self.target_delta is None and DEFAULT_DELTA >= 1.0 / shard_size:
            warnings.warn(
                f"epsilon is reported at the default delta={DEFAULT_DELTA}, which is not below 1/J for node {rank}'s "
                f"shard of J={shard_size} examples; pass target_delta below {1.0 / shard_size:.3g}",
                UserWarning,
                stacklevel=2,
            )

    def resolve(self, sample_rate: float, steps: int) -> float:
        """The noise multiplier for a run of ``steps`` steps at Poisson rate ``sample_rate``: given, or calibrated.

        Calibration finds the smallest sigma with epsilon(sigma, q, T, target_delta) <= target_epsilon (within 1%),
        with :func:`calibrate_noise_multiplier`.
        """
        self.validate()
        sample_rate = check_sample_rate(sample_rate)
        steps = check_steps(steps, minimum=1)
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        assert self.target_epsilon is not None and self.target_delta is not None
        return calibrate_noise_multiplier(
            float(self.target_epsilon),
            float(self.target_delta),
            sample_rate,
            steps,
            accountant=self.accountant,
        )
