"""Per-sample gradients for DP-SGD on unchanged models: checks (:mod:`.checks`), capture without output wrapping
and per-layer mechanisms (:mod:`.capture`), clipping arithmetic and the public classes (:mod:`.gradients`)."""

from lightning_privdec.privacy.per_sample.checks import check_private_model
from lightning_privdec.privacy.per_sample.gradients import (
    DEFAULT_GRAD_SAMPLE_MODE,
    GRAD_SAMPLE_MODES,
    GhostClipping,
    GradSampleMode,
    PerSampleGradients,
    mean_loss_multiplier,
)

__all__ = [
    "DEFAULT_GRAD_SAMPLE_MODE",
    "GRAD_SAMPLE_MODES",
    "GhostClipping",
    "GradSampleMode",
    "PerSampleGradients",
    "check_private_model",
    "mean_loss_multiplier",
]
